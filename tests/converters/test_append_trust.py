"""Appends that cannot corrupt a dataset (issue 31): two appends into one dataset, interleaved at
the instants that matter through hooks (never by sleeping), an append killed at every file operation
of its commit, ``info`` on a relative path, and options read from the dataset."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.converters import partrun, parts
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset, verify
from tests.converters.fault_injection import inject
from tests.helpers.cli import run_cli
from tests.helpers.parts import assert_same_records, class_corpus

KW: dict[str, Any] = {"size": 16, "workers": 1, "part_size": 4}


@pytest.fixture()
def corpora(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A dataset of one class (shards of 3, the last one not full), and two corpora to append to it."""
    base = tmp_path / "base"
    shardkit.convert(class_corpus(tmp_path / "c0", ["landscape"]), base, size=16, records_per_shard=3, workers=1)
    return base, class_corpus(tmp_path / "ca", ["plant"]), class_corpus(tmp_path / "cb", ["object"])


def _appended(tmp_path: Path, base: Path, *corpora: Path) -> Path:
    """The reference: ``base`` with ``corpora`` appended one after the other, nothing running alongside."""
    ref = tmp_path / f"ref-{len(list(tmp_path.glob('ref-*')))}"
    shutil.copytree(base, ref)
    for src in corpora:
        shardkit.convert(src, ref, append=True, **KW)
    return ref


def _at(monkeypatch: pytest.MonkeyPatch, point: str, action: Callable[[], None]) -> list[bool]:
    """Run ``action`` once, inside the first append, at ``point``: between its check for another
    run and the writing of its plan (``"plan"``), or right after its parts wrote their first shard
    file (``"shard"``). Returns a list that gets ``True`` once the action ran."""
    fired: list[bool] = []

    def once() -> None:
        if not fired:
            fired.append(True)
            action()

    if point == "plan":
        real_put = partrun.put_checked

        def put(store: Any, key: str, *args: Any, **kwargs: Any) -> Any:
            if key.endswith("/plan.json"):
                once()
            return real_put(store, key, *args, **kwargs)

        monkeypatch.setattr(partrun, "put_checked", put)
    else:
        real_close = parts._AlignedWriter._close

        def close(self: parts._AlignedWriter, cursor: int | None) -> None:
            real_close(self, cursor)
            once()

        monkeypatch.setattr(parts._AlignedWriter, "_close", close)
    return fired


@pytest.mark.parametrize("point", ["plan", "shard"])
def test_a_second_append_is_refused_while_the_first_runs(tmp_path: Path, corpora: tuple[Path, Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    base, a, b = corpora
    ref = _appended(tmp_path, base, a)
    out = tmp_path / "ds"
    shutil.copytree(base, out)
    refusals: list[str] = []

    def second() -> None:
        with pytest.raises(ConversionError) as info:
            shardkit.convert(b, out, append=True, **KW)
        refusals.append(str(info.value))

    fired = _at(monkeypatch, point, second)
    s = shardkit.convert(a, out, append=True, **KW)
    assert fired and s.version == 2
    assert "another conversion or append into this dataset is running" in refusals[0]
    assert "Nothing was changed" in refusals[0]
    assert verify(out).ok
    assert_same_records(out, ref)
    assert not (out / ".shardkit-parts").exists()


def test_appends_planned_on_one_version_never_overwrite_each_other(
        tmp_path: Path, corpora: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the lock (an object store has none), both appends pass the check for another run
    # before either writes its plan. The second one commits first; the first one's parts then write
    # their shards, which must not land on the dataset's files, and its commit is refused.
    base, a, b = corpora
    out = tmp_path / "ds"
    shutil.copytree(base, out)
    monkeypatch.setattr(partrun._OutputLock, "acquire", lambda self: None)
    done: list[int] = []
    fired = _at(monkeypatch, "plan", lambda: done.append(shardkit.convert(b, out, append=True, **KW).version))
    with pytest.raises(ConversionError, match=r"planned on version 1; another commit came first\. Re-run"):
        shardkit.convert(a, out, append=True, **KW)
    assert fired and done == [2]
    assert verify(out).ok
    assert_same_records(out, _appended(tmp_path, base, b))
    with open_dataset(out) as ds:
        assert ds.meta.labels["label"] == ["landscape", "object"]
    # The refused append left nothing behind, and the same command now appends after the other one.
    assert not (out / ".shardkit-parts").exists()
    monkeypatch.undo()
    shardkit.convert(a, out, append=True, **KW)
    assert verify(out).ok
    assert_same_records(out, _appended(tmp_path, base, b, a))


def test_info_on_a_relative_path_to_an_appended_dataset(tmp_path: Path, corpora: tuple[Path, Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base, a, _ = corpora
    shardkit.convert(a, base, append=True, **KW)
    monkeypatch.chdir(tmp_path)
    res = run_cli("info", "base")
    assert res.returncode == 0, res.stderr
    assert "version      2 (kept: 1, 2)" in res.stdout and "append" in res.stdout
    res = run_cli("verify", "base")
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: every step is a fork and a re-run, minutes on a busy machine
def test_an_append_killed_at_every_step_of_its_commit_says_so(tmp_path: Path) -> None:
    # Killed after every file operation (SIGKILL, no timing): the dataset still opens at version 1,
    # and verify either passes or says that an append was interrupted and how to finish it; info
    # says so too; the same command then finishes it.
    base = tmp_path / "base"
    shardkit.convert(class_corpus(tmp_path / "c0", ["landscape"]), base, size=16, records_per_shard=3, workers=1)
    src = class_corpus(tmp_path / "c1", ["object"])
    report = inject({"src": str(src), "out": str(tmp_path / "out"), "executor": "inline", "base": str(base),
                      "kwargs": {**KW, "append": True}, "check": True, "commit_only": True})
    assert report["reference"] == "ok" and len(report["runs"]) >= 15, report
    interrupted = 0
    for r in report["runs"]:
        assert r["first"] == "killed" and r["final"] == "ok" and r["same"], r
        check = r["check"]
        assert "error" not in check, r
        if r["committed_before"]:
            assert check["ok"], r  # only the cleanup was left
            continue
        assert check["ok"] or check["unfinished"], r
        if check["unfinished"]:
            interrupted += 1
            assert check["info"] == check["unfinished"]
            assert "an append into this dataset was interrupted" in check["unfinished"][0], r  # its plan is read
            assert "run the same command again to finish it" in check["unfinished"][0], r
    assert interrupted and any(not r["check"]["ok"] for r in report["runs"])  # the commit was hit while it replaced files


def test_verify_and_info_name_an_interrupted_append(tmp_path: Path, corpora: tuple[Path, Path, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.formats import commit as commit_module

    base, a, _ = corpora
    ref = _appended(tmp_path, base, a)

    def stop(self: Any, meta: Any) -> None:
        raise KeyboardInterrupt  # the commit replaced the base's last shard and fields, not the root document

    monkeypatch.setattr(commit_module._Commit, "publish", stop)
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(a, base, append=True, **KW)
    monkeypatch.undo()
    res = run_cli("verify", str(base))
    assert "an append into this dataset was interrupted" in res.stderr, res.stderr
    assert "run the same command again to finish it" in res.stderr and "version 1" in res.stderr
    res = run_cli("info", str(base))
    assert res.returncode == 0 and "unfinished   an append into this dataset was interrupted" in res.stdout, res.stdout
    shardkit.convert(a, base, append=True, **KW)
    assert verify(base).ok and not verify(base).unfinished
    assert_same_records(base, ref)
    assert "unfinished" not in run_cli("info", str(base)).stdout
