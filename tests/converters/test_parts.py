"""Conversions in parts on local executors, appends and merges (issue 22): the same dataset as one
process, killed at every step and resumed without converting a finished part again, refusals that
change nothing, readers that keep their version, and the sampler's proof tests on the results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters import partrun, register
from shardkit.converters.executors import InlineExecutor
from shardkit.converters.parts import PartPlan, default_part_size, read_manifest
from shardkit.errors import ConfigError, ConversionError, InsecurePathError, MissingExtraError
from shardkit.formats import open_dataset, verify
from shardkit.readers import TieredSampler
from shardkit.stores import LocalStore
from tests.converters.fault_injection import inject
from tests.converters.kinds_for_parts import Keyed, keyed_corpus
from tests.helpers.cli import run_cli
from tests.helpers.corpora import make_imagefolder
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.parts import DATASETS, assert_same_records, class_corpus, tree_digest
from tests.helpers.sampler_data import check_batch, epochs_of

BAD = {"plant/zero.jpg": "", "plant/text.jpg": "not an image\n", "object/notes.txt": "a stray file\n"}


@pytest.fixture(scope="module")
def keyed_kind() -> None:
    register(Keyed, replace=True)


def _executor(name: str):  # type: ignore[no-untyped-def]
    return {"inline": InlineExecutor, "threads": lambda: ThreadPoolExecutor(3),
            "processes": lambda: ProcessPoolExecutor(2)}[name]()


@pytest.mark.parametrize("executor", ["inline", "threads", "processes"])
def test_parts_on_any_executor_equal_one_process(tmp_path: Path, executor: str) -> None:
    # Generated class folders with every bad-input case: skips inside parts, parts smaller and
    # larger than a shard, shards cut across part boundaries.
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=4, splits=("train",))
    one = shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=3, workers=1)
    got = shardkit.convert(src, tmp_path / "parts", size=16, records_per_shard=3, executor=_executor(executor),
                           part_size=5)
    assert got.records == one.records and got.parts == 5 and got.parts_converted == 5
    assert got.skipped == one.skipped and got.num_skipped >= 8
    assert_same_records(tmp_path / "parts", tmp_path / "one")
    assert verify(tmp_path / "parts").ok
    assert not (tmp_path / "parts" / ".shardkit-parts").exists()  # the plan directory is gone after the commit
    # At most one shard per part is re-packed by the commit; the rest was written in place.
    assert got.commit is not None and got.commit.shards_repacked <= got.parts + 1
    assert got.commit.shards_in_place + got.commit.shards_linked + got.commit.shards_repacked == len(
        open_dataset(tmp_path / "parts").meta.shards)


def test_windows_and_compression_in_parts(tmp_path: Path) -> None:
    # Audio cut into windows: inputs give several records, part boundaries fall inside shards; zstd.
    speech = tmp_path / "speech"
    for word in sorted(p.name for p in (DATASETS / "speech").iterdir() if p.is_dir())[:6]:
        shutil.copytree(DATASETS / "speech" / word, speech / word)
    kw = dict(window=True, duration=0.25, sample_rate=8000, records_per_shard=4, compression="zstd")
    shardkit.convert(speech, tmp_path / "one", workers=1, **kw)
    s = shardkit.convert(speech, tmp_path / "parts", executor=ThreadPoolExecutor(2), part_size=2, **kw)
    assert s.records > 2 * s.parts  # several records per input
    assert_same_records(tmp_path / "parts", tmp_path / "one")


def test_plan_is_a_function_of_the_corpus_and_options_only() -> None:
    assert PartPlan(10, 4).ranges() == [(0, 4), (4, 8), (8, 10)]
    assert PartPlan(0, 4).ranges() == []
    # About 64 parts, each at least one shard and at most 16 shards of inputs.
    assert default_part_size(6400, 10) == 100
    assert default_part_size(100, 10) == 10
    assert default_part_size(10**7, 100) == 1600
    with pytest.raises(ConversionError, match="at least 1"):
        PartPlan(10, 0)


def _assert_resumes_without_redoing_parts(report: dict, min_steps: int) -> None:
    assert report["reference"] == "ok" and report["steps"] >= min_steps, report
    for r in report["runs"]:
        assert r["first"] == "killed", r  # every step was reached: no timing involved
        assert r["final"] == "ok" and r["same"], r
        # Parts whose manifest was written before the kill are not converted again (nor any part,
        # once the commit had published the new root document: only its cleanup was left).
        expected = 0 if r["committed_before"] else report["parts"] - r["parts_done_before"]
        assert r["parts_converted"] == expected, r


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: every step is a fork and a re-run, minutes on a busy machine
def test_killed_at_every_step_of_parts_and_commit_resumes(tmp_path: Path) -> None:
    # Inline: the killed process converts the parts itself, so the kill lands at every step of every
    # part (pieces, whole shards moved into place, field values, manifest) and of the commit.
    src = class_corpus(tmp_path / "corpus", ["landscape", "object"], bad={"object/zero.jpg": ""})
    report = inject({"src": str(src), "out": str(tmp_path / "out"), "executor": "inline",
                      "kwargs": {"size": 16, "records_per_shard": 3, "part_size": 5, "workers": 1}})
    _assert_resumes_without_redoing_parts(report, min_steps=60)
    assert report["parts"] == 3 and any(r["parts_done_before"] == 3 for r in report["runs"])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: every step is a fork and a re-run, minutes on a busy machine
def test_append_killed_at_every_step_resumes(tmp_path: Path) -> None:
    # The commit of an append replaces the base's last shard, field chunks and documents: a kill
    # between any two steps is finished by the same command, and the base's readers keep version 1.
    base = tmp_path / "base"
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), base, size=16, records_per_shard=3, workers=1)
    src = class_corpus(tmp_path / "c2", ["object"], bad={"object/text.jpg": "x"})
    report = inject({"src": str(src), "out": str(tmp_path / "out"), "executor": "inline", "base": str(base),
                      "kwargs": {"size": 16, "part_size": 4, "workers": 1, "append": True}, "every": 2})
    _assert_resumes_without_redoing_parts(report, min_steps=40)


def _split_corpora(tmp_path: Path) -> tuple[Path, Path, Path]:
    """One corpus of three classes, and the same split in two: classes 1-2, and class 3 (with bad files)."""
    bad = BAD
    whole = class_corpus(tmp_path / "whole", ["landscape", "object", "plant"], bad=bad)
    first = class_corpus(tmp_path / "first", ["landscape", "object"], bad=bad)
    second = class_corpus(tmp_path / "second", ["plant"], bad=bad)
    return whole, first, second


def test_append_equals_converting_both_in_one_go(tmp_path: Path) -> None:
    whole, first, second = _split_corpora(tmp_path)
    kw = dict(size=16, records_per_shard=4, workers=1)
    shardkit.convert(whole, tmp_path / "one", **kw)
    out = tmp_path / "grown"
    shardkit.convert(first, out, **kw)
    before = open_dataset(out)  # a reader of version 1, opened before the append
    n1 = before.num_records
    v1_images = before.payload.read_range(0, n1).copy()
    s = shardkit.convert(second, out, append=True, size=16, workers=1, part_size=3)
    assert s.version == 2 and s.commit is not None and s.commit.records_added == s.records - n1
    assert s.skipped == {"empty": 1, "unsupported": 1}  # this run's skips
    # Same records, fields, labels ("plant" extends the list) and skips as one conversion of both.
    assert_same_records(out, tmp_path / "one", roots=(whole, first, second))
    # Existing records keep their indices and bytes; the old reader still reads version 1.
    with open_dataset(out) as now:
        np.testing.assert_array_equal(now.payload.read_range(0, n1), v1_images)
        assert now.label_names == ["landscape", "object", "plant"]
    np.testing.assert_array_equal(before.payload.read_range(0, n1), v1_images)
    assert before.label_names == ["landscape", "object"] and before.fields["label"].shape == (n1,)
    assert verify(out).ok
    # The same command again is a no-op; `info` shows both versions.
    again = shardkit.convert(second, out, append=True, size=16, workers=1, part_size=3)
    assert again.already_complete and again.records == s.records
    info = subprocess.run([sys.executable, "-m", "shardkit", "info", str(out)], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "version      2 (kept: 1, 2)" in info.stdout and "append" in info.stdout and str(second) in info.stdout


@pytest.mark.parametrize("change,message", [
    (dict(size=24), "record shape"),
    (dict(kind="audio", sample_rate=8000, duration=0.2), "kind"),
    (dict(size=16, crop="pad"), "transform"),
    (dict(size=16, compression="zstd"), "compression"),
])
def test_refused_appends_change_nothing_on_disk(tmp_path: Path, change: dict, message: str) -> None:
    out = tmp_path / "ds"
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), out, size=16, workers=1)
    before = tree_digest(out)
    other = DATASETS / "speech" if change.get("kind") == "audio" else class_corpus(tmp_path / "c2", ["plant"])
    with pytest.raises(ConversionError, match=f"cannot append .*its {message}.*Nothing was changed"):
        shardkit.convert(other, out, append=True, workers=1, **change)
    assert tree_digest(out) == before


def test_append_refusals_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), out, size=16, workers=1)
    before = tree_digest(out)
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(class_corpus(tmp_path / "c2", ["plant"])),
                        "-o", str(out), "--append", "--size", "24", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "record shape (24, 24, 3) differs from the dataset's (16, 16, 3)" in r.stderr
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(tmp_path / "c2"), "-o", str(tmp_path / "none"),
                        "--append", "--size", "16", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no dataset to append to" in r.stderr
    assert tree_digest(out) == before


def test_merge_of_two_datasets_equals_their_append(tmp_path: Path) -> None:
    _, first, second = _split_corpora(tmp_path)
    kw = dict(size=16, records_per_shard=4, workers=1)
    shardkit.convert(first, tmp_path / "a", **kw)
    shardkit.convert(second, tmp_path / "b", **kw)
    shardkit.convert(first, tmp_path / "grown", **kw)
    shardkit.convert(second, tmp_path / "grown", append=True, size=16, workers=1)
    r = subprocess.run([sys.executable, "-m", "shardkit", "merge", str(tmp_path / "a"), str(tmp_path / "b"),
                        "-o", str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "merged       2 datasets" in r.stdout and "linked" in r.stdout
    assert_same_records(tmp_path / "merged", tmp_path / "grown")  # the same corpora: the same skip paths
    assert verify(tmp_path / "merged").ok
    # Datasets of another schema are refused, naming the difference, and nothing is written.
    shardkit.convert(second, tmp_path / "c", size=24, workers=1)
    with pytest.raises(ConversionError, match=r"record shape .* differs"):
        shardkit.merge([tmp_path / "a", tmp_path / "c"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_merge_links_aligned_shards(tmp_path: Path) -> None:
    # 12 + 8 records in shards of 4: every shard of both inputs lands on the grid as it is.
    a = shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), tmp_path / "a", size=16, records_per_shard=4,
                         workers=1)
    assert a.records % 4 == 0
    shardkit.convert(class_corpus(tmp_path / "c2", ["object"]), tmp_path / "b", size=16, records_per_shard=4, workers=1)
    report = shardkit.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert report.shards_repacked == 0 and report.bytes_repacked == 0 and report.shards_linked == 4
    assert os.path.samefile(tmp_path / "m" / "image/c/0/0/0/0", tmp_path / "a" / "image/c/0/0/0/0")


def _sampler_orders(path: Path, ssd_dir: Path, n: int, epochs: int) -> np.ndarray:
    sampler = TieredSampler(path, tiers="ram,ssd", ram_size="4records", ssd_size="10records", ssd_dir=ssd_dir,
                            batch_size=3, epochs=epochs, seed=23)
    return epochs_of(sampler, n)


@pytest.mark.parametrize("how", ["append", "merge"])
def test_sampler_proof_on_appended_and_merged_datasets(tmp_path: Path, keyed_kind: None, how: str) -> None:
    """The item x position chi-square (scaled by (N-1)/N, (N-1)^2 dof, alpha 1e-3) on a dataset made of
    two conversions; every batch row carries its own key's payload and fields."""
    n = 8
    first, second = keyed_corpus(tmp_path / "k1", range(5)), keyed_corpus(tmp_path / "k2", range(5, n))
    out = tmp_path / "ds"
    if how == "append":
        shardkit.convert(first, out, kind="keyed", records_per_shard=3, workers=1)
        shardkit.convert(second, out, kind="keyed", append=True, workers=1, part_size=1)
    else:
        shardkit.convert(first, tmp_path / "a", kind="keyed", records_per_shard=3, workers=1)
        shardkit.convert(second, tmp_path / "b", kind="keyed", records_per_shard=3, workers=1)
        shardkit.merge([tmp_path / "a", tmp_path / "b"], out)
    with open_dataset(out) as ds:
        assert ds.num_records == n and [(s.start, s.stop) for s in ds.meta.shards] == [(0, 3), (3, 6), (6, 8)]
        check_batch(ds.read(np.arange(n)))
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    orders = _sampler_orders(out, ssd, n, 400)
    assert (np.sort(orders, axis=1) == np.arange(n)).all()
    assert item_position_pvalue(orders) > ALPHA


def test_a_hostile_manifest_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape"])
    out = tmp_path / "out"

    def stop_after_parts(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # every part is written, the commit does not start

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(partrun, "commit", stop_after_parts)
        shardkit.convert(src, out, size=16, records_per_shard=3, part_size=4, workers=1, executor=InlineExecutor())
    manifests = sorted(out.glob(".shardkit-parts/*/p000000.json"))
    assert manifests
    doc = json.loads(manifests[0].read_text())
    plan = manifests[0].parent.name
    args = (LocalStore(out), plan, 0, tuple(doc["inputs"]), 3, "image", 4)
    assert read_manifest(*args) is not None
    doc["pieces"][0]["key"] = "../../../../etc/passwd"
    manifests[0].write_text(json.dumps(doc))
    assert read_manifest(*args) is None  # not followed: the part is converted again
    s = shardkit.convert(src, out, size=16, records_per_shard=3, part_size=4, workers=1, executor=InlineExecutor())
    assert s.parts_converted == 1
    shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=3, workers=1)
    assert_same_records(out, tmp_path / "one")


def test_a_spill_directory_of_someone_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    spill = tmp_path / "tmp" / f"shardkit-spill-{os.geteuid()}"
    spill.mkdir(parents=True, mode=0o777)
    os.chmod(spill, 0o777)  # writable by anyone: decoded records must not go there
    src = class_corpus(tmp_path / "corpus", ["landscape"])
    with pytest.raises(InsecurePathError, match="mode 0o700"):
        shardkit.convert(src, tmp_path / "out", size=16, part_size=2, executor=ThreadPoolExecutor(2))


def test_scheduler_needs_the_dask_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)
    with pytest.raises(MissingExtraError, match=r'pip install "shardkit\[dask\]"'):
        shardkit.convert(DATASETS / "imagefolder", tmp_path / "out", size=16, scheduler="tcp://127.0.0.1:1")


def test_an_unreachable_scheduler_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(DATASETS / "imagefolder"), "-o",
                        str(tmp_path / "out"), "--size", "16", "--scheduler", "tcp://127.0.0.1:9", "-q"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert r.returncode == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert "--scheduler tcp://127.0.0.1:9: no Dask scheduler answered" in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_scheduler_connect_timeout_follows_dask_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait for an unreachable scheduler is Dask's own connect timeout (30 s by default), so a user,
    # and the command-line test above, can shorten it the way Dask documents.
    distributed = pytest.importorskip("distributed")
    import dask

    from shardkit.converters.executors import dask_executor

    asked: list[float] = []

    def client(address: str, timeout: float, set_as_default: bool) -> None:
        asked.append(timeout)
        raise OSError(f"Timed out trying to connect to {address} after {timeout} s")

    monkeypatch.setattr(distributed, "Client", client)
    for configured, expected in (("1500ms", 1.5), ("30s", 30.0), (7, 7.0)):
        with dask.config.set({"distributed.comm.timeouts.connect": configured}):
            with pytest.raises(ConfigError, match=r"scheduler tcp://127\.0\.0\.1:9: no Dask scheduler answered"):
                with dask_executor("tcp://127.0.0.1:9"):
                    pass
        assert asked.pop() == expected
    with pytest.raises(ConfigError, match="no Dask scheduler answered"):
        with dask_executor("tcp://127.0.0.1:9", timeout=4.0):
            pass
    assert asked == [4.0]


def test_options_and_outputs_are_checked(tmp_path: Path) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape"])
    with pytest.raises(ConfigError, match="part_size"):
        shardkit.convert(src, tmp_path / "out", size=16, part_size="many", executor=InlineExecutor())
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "-o", str(tmp_path / "out"), "--size",
                        "16", "--append", "--part-size", "many", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--part-size" in r.stderr and "Traceback" not in r.stderr
    # A dataset is there: a new conversion in parts refuses to replace it and says how to add to it.
    shardkit.convert(src, tmp_path / "ds", size=16, workers=1)
    with pytest.raises(ConversionError, match="--append"):
        shardkit.convert(src, tmp_path / "ds", size=24, executor=InlineExecutor())
    # An interrupted conversion with other parameters is named, with how to discard it.
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(src, tmp_path / "half", size=16, part_size=2, executor=InlineExecutor(),
                         progress=lambda done, total, records: (_ for _ in ()).throw(KeyboardInterrupt) if done else None)
    with pytest.raises(ConversionError, match=r"interrupted conversion or append with other parameters .* delete"):
        shardkit.convert(src, tmp_path / "half", size=24, part_size=2, executor=InlineExecutor())


def test_scheduler_local_overrides_the_environment(tmp_path: Path) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape"])
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "-o", str(tmp_path / "out"), "--size",
                        "16", "--scheduler", "local", "-q"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DASK_SCHEDULER_ADDRESS": "tcp://127.0.0.1:9"})
    assert r.returncode == 0, r.stderr
    assert "Dask" not in r.stderr and verify(tmp_path / "out").ok


def test_a_dead_pool_worker_is_reported_and_finished_parts_kept(tmp_path: Path) -> None:
    from tests.converters.kinds_for_parts import DyingImages

    register(DyingImages, replace=True)
    src = class_corpus(tmp_path / "corpus", ["landscape", "plant"])
    with pytest.raises(ConversionError, match=r"worker process died .* re-run the same command"):
        shardkit.convert(src, tmp_path / "out", kind="dyingimages", size=16, part_size=4,
                         executor=ProcessPoolExecutor(1))
    # Parts before the dying one were written and stay for the re-run.
    assert list((tmp_path / "out").glob(".shardkit-parts/*/p000000.json"))


def test_stray_shards_of_an_abandoned_append_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), out, size=16, records_per_shard=2, workers=1)

    def stop(done: int, total: int, records: int) -> None:
        if done == total:
            raise KeyboardInterrupt

    big = class_corpus(tmp_path / "c2", ["plant"])
    with pytest.raises(KeyboardInterrupt):  # its parts are written, whole shards in its plan directory too ...
        shardkit.convert(big, out, append=True, size=16, workers=1, part_size=8, progress=stop)
    assert sorted(int(p.name) for p in (out / "image" / "c").iterdir()) == [0, 1, 2, 3]  # the dataset's only
    assert list((out / ".shardkit-parts").rglob("*.shard"))
    shutil.rmtree(out / ".shardkit-parts")  # ... and then abandoned
    # An older shardkit wrote an append's whole shards under their final names before its commit: the
    # strays such an abandoned append left are removed by the next commit.
    for k in (4, 7):
        shutil.copytree(out / "image" / "c" / "0", out / "image" / "c" / str(k))
    s = shardkit.convert(class_corpus(tmp_path / "c3", ["object"]), out, append=True, size=16, workers=1)
    n_shards = len(open_dataset(out).meta.shards)
    assert s.records == 14 and sorted(int(p.name) for p in (out / "image" / "c").iterdir()) == list(range(n_shards))
    assert verify(out).ok


@pytest.mark.parametrize("executor", ["inline", "threads"])
def test_commit_rewrites_at_most_one_shard_per_part(tmp_path: Path, executor: str) -> None:
    # 23 photos, shards of 2, parts of 7 inputs: each part writes its whole shards under their final
    # names, and only the shard it shares with its neighbour is re-packed at the commit.
    src = DATASETS / "imagefolder"
    s = shardkit.convert(src, tmp_path / "parts", size=16, records_per_shard=2, part_size=7,
                         executor=_executor(executor))
    c = s.commit
    assert c is not None and s.parts == 4
    shards = len(open_dataset(tmp_path / "parts").meta.shards)
    assert c.shards_in_place + c.shards_linked + c.shards_repacked == shards == 12
    assert c.shards_repacked <= s.parts and c.shards_in_place >= shards - s.parts
    assert c.bytes_repacked <= s.parts * max(info.nbytes for info in open_dataset(tmp_path / "parts").meta.shards)
    shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=2, workers=1)
    assert_same_records(tmp_path / "parts", tmp_path / "one")


@pytest.mark.parametrize("workers", [1, 2])
def test_part_size_alone_converts_in_parts_on_this_machine(tmp_path: Path, workers: int) -> None:
    # --part-size without a scheduler: local processes each convert whole parts and write their own
    # shards (issue 15 item 2); one worker converts the parts here, one after another.
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=4, splits=("train",))
    one = shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=3, workers=1)
    got = shardkit.convert(src, tmp_path / "parts", size=16, records_per_shard=3, workers=workers, part_size=5)
    assert got.parts == 5 and got.parts_converted == 5 and one.parts == 0
    assert_same_records(tmp_path / "parts", tmp_path / "one")
    assert verify(tmp_path / "parts").ok and not (tmp_path / "parts" / ".shardkit-parts").exists()


def test_workers_write_their_own_shards_and_give_one_workers_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --part-size on 2 local workers: each part decoded and written by one worker, those started before
    # the skips of earlier parts were counted at a guessed offset (re-packed by the commit, never counted
    # into a spill and written twice, never redone); the whole output byte for byte that of 1 worker.
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=20, splits=("train",))  # 69 inputs
    one = shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=3, workers=1, part_size=18)
    kinds: list[str] = []
    real_submit = partrun._Runner.submit
    monkeypatch.setattr(partrun._Runner, "submit", lambda self, kind, part: kinds.append(kind) or real_submit(self, kind, part))
    two = shardkit.convert(src, tmp_path / "two", size=16, records_per_shard=3, workers=2, part_size=18)
    assert "guess" in kinds and "count" not in kinds  # no part counted into a spill first
    assert two.parts == one.parts == 4 and two.parts_converted == 4 and two.records == one.records
    assert two.commit is not None and two.commit.shards_repacked > 0
    assert tree_digest(tmp_path / "two") == tree_digest(tmp_path / "one")


def test_cli_part_size_converts_in_parts_and_a_plain_rerun_names_the_parts(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=4, splits=("train",))
    shardkit.convert(src, tmp_path / "one", size=16, shard_bytes=3 * 16 * 16 * 3, workers=1)
    res = run_cli("convert", str(src), "-o", str(tmp_path / "cli"), "--size", "16", "--shard-size", "2304B",
                  "--part-size", "6", "-j", "2", "-q")
    assert res.returncode == 0, res.stderr
    assert_same_records(tmp_path / "cli", tmp_path / "one")
    # An interrupted conversion in parts, then the same command without --part-size: the error says
    # what is there and how to finish it, and nothing is touched.
    out = tmp_path / "interrupted"
    (out / ".shardkit-parts" / "0123456789abcdef").mkdir(parents=True)
    (out / ".shardkit-parts" / "0123456789abcdef" / "plan.json").write_text("{}")
    before = tree_digest(out)
    with pytest.raises(ConversionError, match=r"interrupted conversion in parts .*re-run that command"):
        shardkit.convert(src, out, size=16, records_per_shard=3, workers=1)
    res = run_cli("convert", str(src), "-o", str(out), "--size", "16", "--shard-size", "2304B", "-q")
    assert res.returncode != 0 and "interrupted conversion in parts" in res.stderr
    assert tree_digest(out) == before


def test_every_shard_of_a_conversion_in_parts_and_its_append_records_its_tail(tmp_path: Path) -> None:
    # Shards written by parts (in place, linked, re-packed) and by an append's commit all carry
    # tail_crc32c, so two swapped shards of such a dataset are refused on open like any other's.
    from shardkit.errors import ChecksumError
    from shardkit.formats import Dataset

    out = tmp_path / "parts"
    s = shardkit.convert(class_corpus(tmp_path / "c1", ["landscape", "object"]), out, size=16, records_per_shard=3,
                         part_size=4, workers=1)
    assert s.parts > 1 and s.commit is not None and s.commit.shards_in_place and s.commit.shards_repacked
    shardkit.convert(class_corpus(tmp_path / "c2", ["plant"]), out, size=16, part_size=3, workers=1, append=True)
    shards = open_dataset(out).meta.shards
    assert len(shards) > 4 and all(info.tail_crc32c is not None for info in shards)
    a, b = (out / shards[0].path).read_bytes(), (out / shards[1].path).read_bytes()
    assert len(a) == len(b)
    (out / shards[0].path).write_bytes(b)
    (out / shards[1].path).write_bytes(a)
    with Dataset(out) as ds, pytest.raises(ChecksumError, match="not the dataset's shard"):
        ds.payload.read([0])


def test_a_spill_that_is_not_private_is_not_reused(tmp_path: Path) -> None:
    # A complete spill is reused only from a private (0700) directory of this user, checked through
    # shardkit.privdir: records planted in a directory others can write are decoded again instead.
    from shardkit.converters.parts import PartJob, _read_spill
    from shardkit.formats import FieldSpec

    job = PartJob(plan="p", part=3, first=0, items=[], decoder=None, src="", out="",  # type: ignore[arg-type]
                  payload="x", record=FieldSpec((4,), "uint8"), fields={}, records_per_shard=2, compression=None)
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    os.chmod(spill, 0o700)
    (spill / "spill.json").write_text(json.dumps({"part": 3, "records": 5}))
    (spill / "records.bin").write_bytes(bytes(20))
    for f in ("spill.json", "records.bin"):
        os.chmod(spill / f, 0o600)
    assert _read_spill(spill, job) == 5
    os.chmod(spill / "records.bin", 0o644)  # a file others may have written
    assert _read_spill(spill, job) is None
    os.chmod(spill / "records.bin", 0o600)
    os.chmod(spill, 0o755)
    assert _read_spill(spill, job) is None
    os.chmod(spill, 0o700)
    (tmp_path / "link").symlink_to(spill)
    assert _read_spill(tmp_path / "link", job) is None
    (spill / "records.bin").unlink()
    (spill / "records.bin").symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(bytes(20))
    os.chmod(tmp_path / "elsewhere.bin", 0o600)
    assert _read_spill(spill, job) is None


def test_the_file_that_ends_a_part_gets_no_checkpoint_before_the_manifest(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Every closed file is checkpointed for a resume, except the one ending the part: the part's
    # manifest follows it at once, so its checkpoint would only lengthen the serial end.
    from shardkit.converters import parts

    make_imagefolder(tmp_path / "src", per_class=2, bad=False, splits=("train",))  # 6 inputs
    written: list[str] = []
    put = parts.put_checked

    def recording(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        written.append(key.rsplit("/", 1)[-1])
        return put(store, key, *args, **kwargs)

    monkeypatch.setattr(parts, "put_checked", recording)
    shardkit.convert(tmp_path / "src", tmp_path / "out", size=16, workers=1, records_per_shard=3)
    assert [k for k in written if k.startswith("p000000")] == ["p000000-0.npz", "p000000-0.json", "p000000.npz",
                                                               "p000000.json"]
    assert verify(tmp_path / "out").ok
