"""``shardkit.write(fn, inputs, out)`` and ``shardkit write`` (issue 35, item 1): a user's function on the
conversion engine.

Records equal what ``fn`` gives, in input order, with provenance naming each input; the same bytes
for one process, two decode processes and parts on two local processes (a Dask cluster:
tests/converters/test_cluster.py); a kill at random steps then a re-run gives the same bytes; append;
the layout is inferred or given, then enforced (mismatch skipped, or a stop with strict); an fn that
raises stops the run naming its input; a lambda cannot go to worker processes; the CLI's errors are
one line.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.converters import write as write_module
from shardkit.converters.write import MAX_INPUT_NAME, Layout, WriteDecoder, inputs_from, make_layout
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import FieldSpec, open_dataset, verify
from shardkit.formats.provenance import Provenance
from tests.converters import write_fns
from tests.converters.fault_injection import inject
from tests.helpers.parts import assert_same_records, tree_digest

REPO = Path(__file__).resolve().parents[2]
FNS = "tests.converters.write_fns"


def _records(out: Path) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
    """Payload, fields (without provenance) and each record's input name."""
    with open_dataset(out) as ds:
        payload = ds.payload.read_range(0, ds.num_records).copy()
        fields = {k: np.asarray(v).copy() for k, v in ds.fields.items() if k != "provenance"}
        prov = Provenance.from_meta(ds.meta, where=str(out))
        assert prov is not None
        names = [prov.source(ds.store, ds.meta, i).name for i in range(ds.num_records)]
    return payload, fields, names


def _expected(fn: Any, inputs: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for item in inputs:
        got = fn(item)
        for rec in [got] if isinstance(got, dict) else list(got or []):
            out.append((str(item), rec))
    return out


def test_records_are_fns_in_input_order_whatever_runs_them(tmp_path: Path) -> None:
    inputs = list(range(23))
    kw: dict[str, Any] = dict(records_per_shard=5, progress=False)
    one = shardkit.write(write_fns.tile, inputs, tmp_path / "one", workers=1, **kw)
    assert (one.kind, one.records, one.skipped) == ("write", 23, {})
    payload, fields, names = _records(tmp_path / "one")
    expected = _expected(write_fns.tile, inputs)
    np.testing.assert_array_equal(payload, np.stack([r["image"] for _, r in expected]))
    assert fields["label"].dtype == np.int64 and fields["label"].tolist() == [r["label"] for _, r in expected]
    assert fields["score"].dtype == np.float64 and fields["score"].tolist() == [r["score"] for _, r in expected]
    assert names == [n for n, _ in expected]
    # Two decode processes; parts on two local processes; by name: the same bytes.
    shardkit.write(write_fns.tile, inputs, tmp_path / "two", workers=2, **kw)
    shardkit.write(f"{FNS}:tile", inputs, tmp_path / "parts", workers=2, part_size=4, **kw)
    for other in ("two", "parts"):
        assert_same_records(tmp_path / other, tmp_path / "one")
    assert verify(tmp_path / "parts").ok
    # The same call again finds it done.
    assert shardkit.write(write_fns.tile, inputs, tmp_path / "one", workers=1, **kw).already_complete


def test_generators_empty_inputs_and_long_inputs(tmp_path: Path) -> None:
    inputs = [str(i) for i in range(11)]
    s = shardkit.write(write_fns.windows, inputs, tmp_path / "w1", workers=1, records_per_shard=4, progress=False)
    expected = _expected(write_fns.windows, inputs)
    assert s.records == len(expected) and s.skipped == {"empty": 3}  # inputs 0, 4, 8 give nothing
    payload, fields, names = _records(tmp_path / "w1")
    np.testing.assert_array_equal(payload, np.stack([r["signal"] for _, r in expected]))
    assert fields["window"].tolist() == [r["window"] for _, r in expected] and names == [n for n, _ in expected]
    shardkit.write(write_fns.windows, inputs, tmp_path / "w2", workers=2, records_per_shard=4, progress=False)
    assert_same_records(tmp_path / "w2", tmp_path / "w1")
    # Inputs of more than one decode call (6 and 7 MiB): continued, in one process and in two.
    long = [1, 6, 2, 7]
    shardkit.write(write_fns.long_recording, long, tmp_path / "l1", workers=1, records_per_shard=3, progress=False)
    shardkit.write(write_fns.long_recording, long, tmp_path / "l2", workers=2, records_per_shard=3, progress=False)
    assert_same_records(tmp_path / "l2", tmp_path / "l1")
    payload, fields, _ = _records(tmp_path / "l1")
    assert payload[:, 0].tolist() == [1000 * n + k for n in long for k in range(n)]


def test_a_continued_input_is_the_same_with_or_without_the_live_generator() -> None:
    layout = make_layout(next(write_fns.long_recording(6)), None, None, "6")
    decoder = WriteDecoder(write_fns.long_recording, layout)
    first = decoder.decode(6)
    assert first.more and len(first.records) == 4
    elsewhere = pickle.loads(pickle.dumps(decoder))  # another worker: no live generator, fn runs again
    assert elsewhere._live is None
    again = elsewhere.decode(6, 4)
    kept = decoder.decode(6, 4)  # this worker continues its generator
    assert decoder._live is None and not kept.more and not again.more
    for a, b in zip(kept.records, again.records, strict=True):
        np.testing.assert_array_equal(a["audio"], b["audio"])
    assert [int(r["audio"][0]) for r in kept.records] == [6004, 6005]


def _not_called(*args: Any) -> Any:
    raise AssertionError("fn was called to infer a layout given in full")


def test_layout_is_inferred_or_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = {"small": np.zeros(3, np.uint8), "big": np.zeros((2, 4), np.float32), "same": np.zeros(8, np.uint8)}
    layout = make_layout(first, None, None, "x")
    assert layout.payload == "big" and set(layout.fields) == {"small", "same"} and layout.exact
    tie = make_layout({"a": np.zeros(4, np.uint8), "b": np.zeros(4, np.uint8)}, None, None, "x")
    assert tie.payload == "a"  # the first of the largest
    named = make_layout(first, "small", ["same"], "x")
    assert named.payload == "small" and list(named.fields) == ["same"] and not named.exact
    # Given in full: fn is not called before the run.
    monkeypatch.setattr(write_module, "_first_record", _not_called)
    spec = {"image": FieldSpec((6, 5, 3), "uint8")}
    out = tmp_path / "given"
    s = shardkit.write(write_fns.tile, [1, 2], out, record=spec, fields={"label": "int32"}, workers=1, progress=False)
    assert s.records == 2
    monkeypatch.undo()
    with open_dataset(out) as ds:  # the score key is dropped, the label stored as the int32 asked for
        assert set(ds.fields) == {"label"} and ds.fields["label"].dtype == np.int32
    for bad, match in [
        (dict(record="nope"), "has no such key"),
        (dict(record=123), "expected the payload key"),
        (dict(fields="label"), "expected a list of keys"),
        (dict(record="image", fields=["image"]), "a key is one or the other"),
        (dict(fields={"provenance": "int64"}), "reserved"),
        (dict(fields={"x": "str"}), "expected a FieldSpec"),
    ]:
        with pytest.raises(ConfigError, match=match):
            shardkit.write(write_fns.tile, [1], tmp_path / "bad", workers=1, progress=False, **bad)
    assert not (tmp_path / "bad").exists()


def test_records_that_do_not_fit_are_skipped_with_their_reason_or_stop_a_strict_run(tmp_path: Path) -> None:
    inputs = list(range(9))
    s = shardkit.write(write_fns.some_do_not_fit, inputs, tmp_path / "out", workers=1, progress=False)
    assert s.records == 6 and s.skipped == {"mismatch": 3}
    reasons = dict(s.skipped_inputs)
    assert "'image' has shape (4, 4), expected (4, 4, 3)" in reasons["3"]
    assert "'label' is a str" in reasons["5"] and "'extra'" in reasons["7"]
    with pytest.raises(ConversionError, match=r"^3: mismatch: record 0: 'image' has shape .*--strict"):
        shardkit.write(write_fns.some_do_not_fit, inputs, tmp_path / "strict", workers=1, strict=True, progress=False)


@pytest.mark.parametrize("label, value, fits", [
    ("int into uint8", 255, True), ("int too large", 256, False), ("negative into uint", -1, False),
    ("float into int", 1.5, False), ("bool into int", True, True), ("numpy int64 into uint8", np.int64(3), False),
    ("array of the wrong shape", np.zeros(2, np.uint8), False), ("str", "3", False),
])
def test_small_fields_fit_only_when_nothing_is_lost(label: str, value: Any, fits: bool) -> None:
    layout = Layout("x", FieldSpec((2,), "uint8"), {"f": FieldSpec((), "uint8")}, exact=True)
    decoder = WriteDecoder(lambda _: {"x": np.zeros(2, np.uint8), "f": value}, layout)
    if fits:
        assert int(decoder.decode("in").records[0]["f"]) == int(value)
    else:
        with pytest.raises(shardkit.errors.InputFileError, match=r"^in: mismatch: record 0: 'f'"):
            decoder.decode("in")


def test_an_fn_that_raises_stops_the_run_naming_the_input_and_a_rerun_resumes(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    inputs = list(range(30))
    kw: dict[str, Any] = dict(workers=1, records_per_shard=2, progress=False)
    with pytest.raises(ConversionError) as info:
        shardkit.write(write_fns.fails_on_4, inputs, out, **kw)
    text = str(info.value)
    assert text.startswith("4: fn tests.converters.write_fns:fails_on_4 raised ValueError: no such scan (at ")
    assert "write_fns.py:" in text and "re-run the same command to resume" in text
    # Inputs 0, 1 and 3 made a shard before the failure: the same command, once fn is fixed, keeps it.
    monkeypatch.setenv("WRITE_FNS_FIXED", "1")
    s = shardkit.write(write_fns.fails_on_4, inputs, out, **kw)
    assert s.records == 29 and s.records_this_run == 27 and s.skipped == {"unreadable": 1}
    shardkit.write(write_fns.fails_on_4, inputs, tmp_path / "fresh", **kw)
    assert_same_records(out, tmp_path / "fresh")


def test_each_worker_writes_whole_parts_of_its_own(tmp_path: Path) -> None:
    # fn returns one record per input: with --part-size on 2 workers each part is written by one worker
    # process, and this process runs fn for none of them (only for the first record, to infer the layout).
    # The skip in the first part puts the guessed offset of a part started beside it off the shard
    # grid: the commit re-packs its shards, and no part is converted twice for it.
    inputs = list(range(100))
    s = shardkit.write(write_fns.tile_and_pid, inputs, tmp_path / "two", workers=2, records_per_shard=4,
                       part_size=16, progress=False)
    assert s.records == 99 and s.parts == 7 and s.parts_converted == 7  # parts of 16 inputs
    assert s.commit is not None and s.commit.shards_repacked > 0
    _, fields, names = _records(tmp_path / "two")
    part_of = [int(name) // 16 for name in names]
    pids = {p: {int(pid) for pid, q in zip(fields["pid"], part_of) if q == p} for p in set(part_of)}
    assert all(len(v) == 1 for v in pids.values()) and os.getpid() not in set().union(*pids.values())


def test_a_run_on_two_workers_resumes_on_one_to_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan does not depend on the worker count: parts finished by 2 workers are kept by a re-run with
    # 1, and the dataset is byte for byte the one a single uninterrupted worker writes.
    inputs = list(range(100))
    kw: dict[str, Any] = dict(records_per_shard=2, part_size=16, progress=False)
    with pytest.raises(ConversionError, match="no such scan"):
        shardkit.write(write_fns.fails_on_4, inputs, tmp_path / "out", workers=2, **kw)
    monkeypatch.setenv("WRITE_FNS_FIXED", "1")
    s = shardkit.write(write_fns.fails_on_4, inputs, tmp_path / "out", workers=1, **kw)
    assert s.records == 99 and 0 < s.parts_converted < s.parts
    shardkit.write(write_fns.fails_on_4, inputs, tmp_path / "fresh", workers=1, **kw)
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "fresh")
    shardkit.write(write_fns.fails_on_4, inputs, tmp_path / "two", workers=2, **kw)
    assert tree_digest(tmp_path / "two") == tree_digest(tmp_path / "fresh")


def test_lambdas_and_local_functions_stay_in_this_process(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def local(i: Any) -> dict[str, Any]:
        return {"x": np.full(4, int(i), np.uint8)}

    for fn in (local, lambda i: {"x": np.full(4, int(i), np.uint8)}):
        with pytest.raises(ConfigError, match=r"worker processes cannot import it.*workers 1"):
            shardkit.write(fn, [1, 2], tmp_path / "a", workers=2, progress=False)
        with pytest.raises(ConfigError, match="worker processes cannot import it"):
            shardkit.write(fn, [1, 2], tmp_path / "a", workers=1, part_size=1, executor=_Threads(), progress=False)
    assert not (tmp_path / "a").exists()
    with caplog.at_level(logging.WARNING, logger="shardkit.converters.write"):
        s = shardkit.write(local, [1, 2, 3], tmp_path / "b", progress=False)  # default workers: here, said so
    assert s.records == 3 and "running it in this process" in caplog.text
    assert shardkit.write(local, [1, 2, 3], tmp_path / "c", workers=1, progress=False).records == 3


class _Threads:
    """Stands for any executor (it is never reached: the function is refused first)."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not reached")


def test_inputs_are_checked(tmp_path: Path) -> None:
    for inputs, match in [([], "no inputs"), ("abc", "expected a sequence of inputs"), (tmp_path, "expected a sequence")]:
        with pytest.raises(ConfigError, match=match):
            shardkit.write(write_fns.tile, inputs, tmp_path / "o", workers=1, progress=False)
    with pytest.raises(ConfigError, match="no module named 'no_such_module'"):
        shardkit.write("no_such_module:f", [1], tmp_path / "o")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        shardkit.write(f"{FNS}:nope", [1], tmp_path / "o")
    with pytest.raises(ConfigError, match="is a int, not a function"):
        shardkit.write(f"{FNS}:NOT_A_FUNCTION", [1], tmp_path / "o")
    with pytest.raises(ConfigError, match="expected module:function"):
        shardkit.write("tile", [1], tmp_path / "o")
    # An iterable is taken whole; names are cut to a bounded length.
    long = "x" * (MAX_INPUT_NAME + 50)
    s = shardkit.write(write_fns.from_path, (p for p in [_file(tmp_path, long[:200]), _file(tmp_path, "b")]),
                       tmp_path / "it", workers=1, progress=False)
    assert s.records == 2
    decoder = WriteDecoder(write_fns.tile, make_layout(write_fns.tile(1), None, None, "1"))
    assert len(decoder.item_path(long)) == MAX_INPUT_NAME and decoder.item_path(long).endswith("...")


def _file(tmp_path: Path, name: str) -> str:
    path = tmp_path / "files" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(name.encode()[:20])
    return str(path)


def test_inputs_from_a_file_or_a_glob(tmp_path: Path) -> None:
    listing = tmp_path / "inputs.txt"
    listing.write_text("a\n\n b \r\nc")
    assert inputs_from(listing) == ["a", " b ", "c"]
    _file(tmp_path, "2.txt"), _file(tmp_path, "1.txt")
    (tmp_path / "files" / "sub").mkdir()
    (tmp_path / "files" / "sub" / "3.txt").write_text("3")
    assert inputs_from(f"{tmp_path}/files/**/*.txt") == [f"{tmp_path}/files/{n}" for n in ("1.txt", "2.txt", "sub/3.txt")]
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "long.txt").write_text("x" * 70000)
    os.mkfifo(tmp_path / "fifo")
    for spec, match in [(tmp_path / "empty.txt", "lists no input"), (tmp_path / "long.txt", "line 1 is longer"),
                        (tmp_path / "fifo", "a special file"), (tmp_path, "a directory"),
                        (tmp_path / "none.txt", "found nothing"), (f"{tmp_path}/*.nope", "matches no file")]:
        with pytest.raises(ConfigError, match=match):
            inputs_from(spec)


def test_append_adds_the_records_of_more_inputs(tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(records_per_shard=4, progress=False)
    shardkit.write(write_fns.tile, list(range(14)), tmp_path / "whole", workers=1, **kw)
    out = tmp_path / "grown"
    shardkit.write(write_fns.tile, list(range(9)), out, workers=1, **kw)
    s = shardkit.write(write_fns.tile, list(range(9, 14)), out, workers=2, append=True, **kw)
    assert s.version == 2 and s.records == 14
    a, b = _records(out), _records(tmp_path / "whole")
    np.testing.assert_array_equal(a[0], b[0])
    assert a[2] == b[2] and all(np.array_equal(a[1][k], b[1][k]) for k in b[1])
    assert verify(out).ok
    # Records of another layout are refused, naming the difference, and change nothing.
    with pytest.raises(ConversionError, match=r"cannot append write tests\.converters\.write_fns:windows: its payload"):
        shardkit.write(write_fns.windows, [1, 2], out, workers=1, append=True, **kw)


def test_killed_at_random_steps_a_rerun_gives_the_same_bytes(tmp_path: Path) -> None:
    # The killed process writes the parts itself (inline), so a kill lands inside a part, between parts
    # and in the commit; eight steps drawn at random (seeded) keep it short.
    report = inject({"src": list(range(17)), "out": str(tmp_path / "out"), "executor": "inline", "sample": 8,
                     "seed": 35, "kwargs": {"fn": f"{FNS}:windows", "records_per_shard": 3, "part_size": 5,
                                            "workers": 1, "progress": False}})
    assert report["reference"] == "ok" and report["steps"] > 20, report
    assert len(report["runs"]) == 8
    for r in report["runs"]:
        assert r["first"] == "killed" and r["final"] == "ok" and r["same"], r


# ---------------------------------------------------------------------- the command line
def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "shardkit", "write", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_writes_with_progress_and_summary_from_a_file_or_a_glob(tmp_path: Path) -> None:
    files = [_file(tmp_path, f"{i:02d}.txt") for i in range(12)]
    listing = tmp_path / "inputs.txt"
    listing.write_text("\n".join(files) + "\n")
    r = _cli(f"{FNS}:from_path", "--inputs", str(listing), "-o", str(tmp_path / "a"), "--workers", "2",
             "--record", "bytes", "--shard-size", "1KiB")
    assert r.returncode == 0, r.stderr
    assert "wrote        12 records" in r.stdout and "records/s" in r.stdout and "input/s" in r.stderr
    assert "Traceback" not in r.stderr
    # A glob, a module of the current directory, --fields, then --append.
    (tmp_path / "mine.py").write_text("from tests.converters.write_fns import from_path as mine\n")
    r = _cli("mine:mine", "--inputs", f"{tmp_path}/files/0*.txt", "-o", str(tmp_path / "b"), "--fields", "size", "-q",
             "-j", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli("mine:mine", "--inputs", f"{tmp_path}/files/1*.txt", "-o", str(tmp_path / "b"), "--fields", "size", "-q",
             "--append", "-j", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    np.testing.assert_array_equal(a[0], b[0])
    assert a[2] == b[2] == files and a[1]["size"].tolist() == b[1]["size"].tolist()


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.cli.main import main

    listing = tmp_path / "inputs.txt"
    listing.write_text("\n".join(str(i) for i in range(8)) + "\n")
    out = str(tmp_path / "o")
    cases = [
        (["no_such_module:f", "--inputs", str(listing), "-o", out], "no module named 'no_such_module'"),
        ([f"{FNS}:nope", "--inputs", str(listing), "-o", out], "has no 'nope'"),
        (["not a reference", "--inputs", str(listing), "-o", out], "expected module:function"),
        ([f"{FNS}:tile", "--inputs", str(tmp_path / "missing.txt"), "-o", out], "--inputs"),
        ([f"{FNS}:tile", "--inputs", f"{tmp_path}/*.none", "-o", out], "matches no file"),
        ([f"{FNS}:tile", "--inputs", str(listing), "-o", out, "--fields", ","], "--fields"),
        ([f"{FNS}:fails_on_4", "--inputs", str(listing), "-o", out, "-q", "-j", "1"],
         "error: 4: fn tests.converters.write_fns:fails_on_4 raised ValueError: no such scan (at "),
        ([f"{FNS}:some_do_not_fit", "--inputs", str(listing), "-o", str(tmp_path / "s"), "-q", "--strict", "-j", "1"],
         "error: 3: mismatch: record 0: 'image' has shape (4, 4)"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["write", *args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert exit_.value.code == 1 and "Traceback" not in err, (args, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, err)


def test_info_names_the_input_of_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.cli.main import main

    shardkit.write(write_fns.windows, ["3", "7"], tmp_path / "ds", workers=1, progress=False)
    with pytest.raises(SystemExit) as exit_:
        main(["info", str(tmp_path / "ds"), "--record", "4"])  # input "7", its record 1
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None)
    assert "source       7\n" in out and "input        1 (in the converter's input order, record 1 of it)" in out
    assert "conversion" not in out  # nothing was transformed: no empty line about it


def test_when_no_record_fits_nothing_is_written_and_the_message_names_the_function(tmp_path: Path) -> None:
    spec = {"image": FieldSpec((6, 5, 2), "uint8")}  # tile gives (6, 5, 3): every input is a mismatch
    with pytest.raises(ConversionError) as info:
        shardkit.write(write_fns.tile, [1, 2], tmp_path / "o", record=spec, fields={}, workers=1, progress=False)
    assert str(info.value) == (
        "write tests.converters.write_fns:tile: no input could be converted as kind 'write' (2 inputs, skipped: "
        "mismatch 2); does fn give records for these inputs? Nothing was written")
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConversionError, match="gave no record for any of the 3 inputs; nothing was written"):
        shardkit.write(write_fns.windows, [0, 4, 8], tmp_path / "o", workers=1, progress=False)


def test_a_partial_is_sent_to_workers_and_its_arguments_are_part_of_the_config(tmp_path: Path) -> None:
    out = tmp_path / "o"
    s = shardkit.write(functools.partial(write_fns.scaled, factor=2), [1, 2, 3], out, workers=2, progress=False)
    assert s.records == 3 and _records(out)[0][:, 0].tolist() == [2, 4, 6]
    with open_dataset(out) as ds:
        assert ds.meta.source["fn"] == "partial(tests.converters.write_fns:scaled)"
    with pytest.raises(ConversionError, match="different parameters"):  # other arguments: not the same dataset
        shardkit.write(functools.partial(write_fns.scaled, factor=3), [1, 2, 3], out, workers=1, progress=False)
