"""Resume of a conversion in one process (one part with a checkpoint per shard) and the output directory:
killed at every step, relative/absolute paths, never deleting a user's directory, refusing to mix
conversions, and what an earlier shardkit's staging directory gets."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConversionError, IncompleteDatasetError
from shardkit.formats import open_dataset, verify
from shardkit.formats.outputs import STAGING_DIR, clear_output
from tests.converters.fault_injection import inject
from tests.helpers.corpora import interrupt_after, make_imagefolder

REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO / "datasets"


def _real_subset(root: Path, per_class: int) -> Path:
    """The first photos of each class of datasets/imagefolder/train, plus two bad files."""
    train = DATASETS / "imagefolder" / "train"
    classes = sorted(p.name for p in train.iterdir())
    for c in classes:
        (root / c).mkdir(parents=True)
        for f in sorted((train / c).iterdir())[:per_class]:
            shutil.copy(f, root / c / f.name)
    (root / classes[0] / "text.jpg").write_text("not an image\n")
    (root / classes[-1] / "zero.jpg").write_bytes(b"")
    return root


def _inject(spec: dict) -> dict:
    return inject(spec, timeout=1200)


def _assert_all_resumed(report: dict, min_steps: int) -> None:
    assert report["reference"] == "ok" and report["steps"] >= min_steps, report
    for r in report["runs"]:
        assert r["first"] == "killed", r  # every step was reached: the kill is not a matter of timing
        assert r["final"] == "ok" and r["same"], r


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: every step is a fork and a re-run, minutes on a busy machine
def test_killed_after_every_step_the_same_command_resumes_byte_identical(tmp_path: Path) -> None:
    # Images: scan skips + decode skips, 3 records per shard; every file-system step of the run,
    # from creating the output directory to removing the plan directory after the commit.
    src = _real_subset(tmp_path / "corpus", per_class=2)
    report = _inject({"src": str(src), "out": str(tmp_path / "out"),
                      "kwargs": {"size": 16, "records_per_shard": 3, "workers": 1}})
    _assert_all_resumed(report, min_steps=50)
    assert len(report["runs"]) == report["steps"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: every step is a fork and a re-run, minutes on a busy machine
def test_killed_twice_inside_audio_windows_resumes_byte_identical(tmp_path: Path) -> None:
    # Audio cut into windows: shards end inside a file, so resumes start in the middle of an input;
    # the re-run is itself killed once before the final run.
    src = tmp_path / "speech"
    speech = DATASETS / "speech"
    for word in sorted(p.name for p in speech.iterdir() if p.is_dir())[:3]:
        shutil.copytree(speech / word, src / word)
    report = _inject({"src": str(src), "out": str(tmp_path / "out"), "every": 3, "double": [4],
                      "kwargs": {"window": True, "duration": 0.3, "sample_rate": 8000, "records_per_shard": 3,
                                 "workers": 1}})
    _assert_all_resumed(report, min_steps=40)
    # A re-run near the end has fewer than 4 steps left to do, so it finishes before its kill.
    assert all(r["double"] in (["killed"], ["ok"]) for r in report["runs"])
    assert sum(r["double"] == ["killed"] for r in report["runs"]) > len(report["runs"]) // 2


def test_staging_directory_without_its_config_is_started_afresh(tmp_path: Path) -> None:
    # An earlier shardkit killed between creating its staging directory and writing its config:
    # mkdir -p o/.shardkit-staging && shardkit convert SRC -o o (nothing was staged: it is removed)
    src = DATASETS / "imagefolder"
    out = tmp_path / "o"
    (out / STAGING_DIR).mkdir(parents=True)
    (out / STAGING_DIR / "config.json.partial").write_text('{"half": ')
    proc = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "-o", str(out), "--size", "16", "-q"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (out / STAGING_DIR).exists()
    assert verify(out).ok


def test_relative_and_absolute_corpus_paths_are_the_same_conversion(tmp_path: Path, monkeypatch) -> None:
    src = _real_subset(tmp_path / "corpus", per_class=3)
    ref = shardkit.convert(src, tmp_path / "ref", size=16, records_per_shard=2, workers=1)

    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert("corpus", "out", size=16, records_per_shard=2, workers=1, progress=interrupt_after(6))
    resumed = shardkit.convert(src, tmp_path / "out", size=16, records_per_shard=2, workers=1)
    assert 0 < resumed.records_this_run < resumed.records == ref.records
    again = shardkit.convert("./corpus/../corpus", "out", size=16, records_per_shard=2, workers=1)
    assert again.already_complete
    with open_dataset(tmp_path / "ref") as a, open_dataset(tmp_path / "out") as b:
        assert a.meta.shards == b.meta.shards
        assert [(s.path, s.reason) for s in a.meta.skipped] == [(s.path, s.reason) for s in b.meta.skipped]
        assert b.meta.source["path"] == str(src.resolve())


def test_a_pre_existing_empty_output_directory_is_never_deleted(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=2, bad=False, splits=("train",))
    out = tmp_path / "mine"
    out.mkdir(mode=0o750)
    os.chmod(out, 0o750)
    inode = out.stat().st_ino

    def same_directory() -> bool:
        st = out.stat()
        return st.st_ino == inode and stat.S_IMODE(st.st_mode) == 0o750

    # A conversion that produces nothing (wrong kind) removes what it wrote, not the directory.
    with pytest.raises(ConversionError, match="no input could be converted"):
        shardkit.convert(src, out, kind="audio", workers=1)
    assert same_directory() and list(out.iterdir()) == []
    # --overwrite of that failed run, of a stopped run and of a finished dataset keeps it too.
    with pytest.raises(ConversionError, match="no input could be converted"):
        shardkit.convert(src, out, kind="audio", workers=1, overwrite=True)
    assert same_directory() and list(out.iterdir()) == []
    with pytest.raises(ConversionError, match="--strict"):
        shardkit.convert(src, out, size=8, workers=1, strict=True, overwrite=True, max_pixels=10)
    assert same_directory()
    shardkit.convert(src, out, size=8, workers=1, overwrite=True)
    shardkit.convert(src, out, size=12, workers=1, overwrite=True)
    assert same_directory() and open_dataset(out).meta.record.shape == (12, 12, 3)
    # A directory the conversion created itself is removed when nothing could be converted.
    with pytest.raises(ConversionError, match="no input could be converted"):
        shardkit.convert(src, tmp_path / "new" / "out", kind="audio", workers=1)
    assert not (tmp_path / "new" / "out").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("staging") / "corpus"
    make_imagefolder(root, per_class=6)
    return root


def test_spellings_of_the_same_option_value_are_the_same_conversion(corpus: Path, tmp_path: Path) -> None:
    # Options are parsed before they enter the staged config: size 16 and "16x16" resume each other.
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(corpus, tmp_path / "out", size=16, workers=1, records_per_shard=4, progress=interrupt_after(10))
    done = shardkit.convert(corpus, tmp_path / "out", size="16x16", workers=1, records_per_shard="4")
    assert 0 < done.records_this_run < done.records == 18
    with pytest.raises(ConversionError, match="already exists here with different parameters"):
        shardkit.convert(corpus, tmp_path / "out", size="16x8", workers=1, records_per_shard=4)


def test_foreign_directories_are_refused_and_never_cleared(corpus: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(ConversionError, match="refusing to overwrite"):
        shardkit.convert(corpus, home, size=16, workers=1, overwrite=True)
    with pytest.raises(ConversionError, match=r"not a shardkit dataset \(found thesis.tex\)"):
        shardkit.convert(corpus, home, size=16, workers=1)
    (home / STAGING_DIR).mkdir()  # even next to a (foreign-made) staging directory
    with pytest.raises(ConversionError, match="not a shardkit dataset"):
        shardkit.convert(corpus, home, size=16, workers=1)
    assert (home / "thesis.tex").read_text() == "precious"
    with pytest.raises(ConversionError, match="refusing to overwrite"):
        clear_output(tmp_path / "home" / "thesis.tex")


def _checkpoints(out: Path) -> list[Path]:
    """The shard checkpoints of the one part of an interrupted conversion in one process."""
    return sorted(out.glob(".shardkit-parts/*/p000000-[0-9]*.json"), key=lambda p: int(p.stem.split("-")[1]))


def test_an_unreadable_checkpoint_means_that_shard_is_redone(corpus: Path, tmp_path: Path) -> None:
    kw = dict(size=16, workers=1, records_per_shard=3)
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(corpus, tmp_path / "out", progress=interrupt_after(16), **kw)
    with pytest.raises(IncompleteDatasetError):
        open_dataset(tmp_path / "out")
    staged = _checkpoints(tmp_path / "out")
    assert len(staged) >= 3
    staged[1].with_suffix(".npz").write_bytes(b"truncated by a power cut")
    resumed = shardkit.convert(corpus, tmp_path / "out", **kw)
    assert resumed.records_this_run == resumed.records - 3  # shard 0 kept, everything from shard 1 redone
    ref = shardkit.convert(corpus, tmp_path / "ref", **kw)
    with open_dataset(tmp_path / "ref") as a, open_dataset(tmp_path / "out") as b:
        assert a.meta.shards == b.meta.shards and a.meta.skipped == b.meta.skipped
        np.testing.assert_array_equal(a.fields["label"], b.fields["label"])
    assert ref.records == resumed.records


@pytest.mark.parametrize("doc", ['{"previous": "format"}', "[1, 2"])
def test_an_earlier_shardkits_staging_directory_is_named_and_overwrite_starts_fresh(corpus: Path, tmp_path: Path,
                                                                                   doc: str) -> None:
    # A conversion an earlier shardkit interrupted (its staging config written, readable or not): this
    # version cannot resume it, says so and what to do, and changes nothing; --overwrite starts fresh.
    out = tmp_path / "out"
    (out / STAGING_DIR).mkdir(parents=True)
    (out / STAGING_DIR / "config.json").write_text(doc)
    with pytest.raises(ConversionError, match=r"interrupted conversion by an earlier shardkit .*--overwrite"):
        shardkit.convert(corpus, out, size=16, workers=1)
    assert sorted(p.name for p in out.iterdir()) == [STAGING_DIR]
    shardkit.convert(corpus, out, size=16, workers=1, overwrite=True)
    assert not (out / STAGING_DIR).exists() and verify(out).ok


def test_a_full_disk_while_checkpointing_names_the_file_and_the_rerun_resumes(corpus: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    import errno

    real = os.write

    def full_at_second_record(fd: int, data) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("p000000-1.npz.partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    kw = dict(size=16, workers=1, records_per_shard=4)
    monkeypatch.setattr(os, "write", full_at_second_record)
    with pytest.raises(shardkit.errors.OutOfSpaceError, match=r"p000000-1\.npz: no space left on device"):
        shardkit.convert(corpus, tmp_path / "out", **kw)
    monkeypatch.setattr(os, "write", real)
    assert not list((tmp_path / "out").rglob("*.partial"))
    resumed = shardkit.convert(corpus, tmp_path / "out", **kw)
    assert resumed.records_this_run == resumed.records - 4 and verify(tmp_path / "out").ok
