"""Termination and the SSD directory: no leaked threads or files, stale runs cleaned, full disks."""

from __future__ import annotations

import errno
import gc
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError, OutOfSpaceError, SamplerError
from shardkit.readers import TieredSampler
from shardkit.stopping import CurrentRun
from shardkit.tiers.ssd import PREFIX, SsdSpace, remove_stale
from shardkit.tiers.ssd_slots import SLOT_PREFIX
from tests.helpers.sampler_data import check_batch, collect, make_dataset


def _sampler_threads() -> list[threading.Thread]:
    """The sampler's threads; not the object stores' one event-loop thread, which lives for the process
    once any test of this process used an object store (shardkit/stores/objectstore.py)."""
    return [t for t in threading.enumerate() if t.name.startswith("shardkit-") and t.name != "shardkit-store-io"]


def _wait_clean(ssd_dir: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (_sampler_threads() or list(ssd_dir.glob(PREFIX + "*"))):
        time.sleep(0.01)
    assert _sampler_threads() == []
    assert list(ssd_dir.iterdir()) == []


def _make(tmp_path: Path, ssd_dir: Path, **kw: object) -> TieredSampler:
    ds = make_dataset(tmp_path / "ds", 60)
    return TieredSampler(ds, tiers="ram,ssd", ram_size="4records", ssd_size="10records", ssd_dir=ssd_dir,
                         batch_size=3, epochs=None, seed=0, **kw)  # type: ignore[arg-type]


def test_break_then_gc(tmp_path: Path, ssd_dir: Path) -> None:
    s = _make(tmp_path, ssd_dir)
    for i, batch in enumerate(s):  # epochs=None: would run forever
        check_batch(batch)
        if i == 0:
            assert len(list(ssd_dir.glob(PREFIX + "*"))) == 1
            assert len(_sampler_threads()) == 4  # SSD creator and its writer, RAM creator, batch creator
        if i == 5:
            break
    gc.collect()
    _wait_clean(ssd_dir)


def test_exception_in_consumer(tmp_path: Path, ssd_dir: Path) -> None:
    s = _make(tmp_path, ssd_dir)

    def consume() -> None:
        for _ in s:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        consume()
    gc.collect()
    _wait_clean(ssd_dir)


def test_context_manager_and_explicit_close(tmp_path: Path, ssd_dir: Path) -> None:
    with _make(tmp_path, ssd_dir) as s:
        it = iter(s)
        next(it)
        assert _sampler_threads()
    _wait_clean(ssd_dir)  # `it` is still referenced, yet everything stopped
    with pytest.raises(StopIteration):
        next(it)


def test_normal_end_and_restart(tmp_path: Path, ssd_dir: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    s = TieredSampler(ds, tiers="ram,ssd", ram_size="4records", ssd_size="6records", ssd_dir=ssd_dir, batch_size=5)
    assert sum(k.size for k in collect(s)) == 12
    _wait_clean(ssd_dir)
    assert sum(k.size for k in collect(s)) == 12  # the next epoch
    _wait_clean(ssd_dir)


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from shardkit.tiers.ssd import SsdSpace
    space = SsdSpace(sys.argv[1])
    print(space.path, flush=True)
    if sys.argv[2] == "kill":
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    """
)


def _holder(ssd_dir: Path, how: str) -> tuple[subprocess.Popen[str], Path]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(ssd_dir), how], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    path = Path(p.stdout.readline().strip())
    return p, path


def test_stale_dir_removed_live_dir_kept(ssd_dir: Path) -> None:
    dead, dead_dir = _holder(ssd_dir, "kill")
    dead.wait(10)
    assert dead.returncode == -9 and dead_dir.is_dir()
    (dead_dir / "reservoir-00000000").mkdir()
    live, live_dir = _holder(ssd_dir, "live")
    try:
        mine = SsdSpace(ssd_dir)  # scans siblings at start
        assert not dead_dir.exists()
        assert live_dir.is_dir()
        assert remove_stale(ssd_dir) == []  # our own live dir is kept too
        assert mine.path.is_dir()
        mine.close()
        assert not mine.path.exists()
    finally:
        live.kill()
        live.wait(10)
    assert remove_stale(ssd_dir) == [live_dir]  # once its owner died


def test_enospc_surfaces_as_out_of_space(tmp_path: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _make(tmp_path, ssd_dir)
    real_write = os.pwrite
    calls = {"n": 0}

    def full_disk(fd: int, data: object, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 3:  # the first reservoir gets written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OutOfSpaceError):
        for batch in s:
            check_batch(batch)  # batches before the failure are intact
    monkeypatch.undo()
    _wait_clean(ssd_dir)  # no partial reservoir left behind


def test_ssd_space_checked_up_front(tmp_path: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    ds = make_dataset(tmp_path / "ds", 10)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OutOfSpaceError, match="free"):
        TieredSampler(ds, tiers="ram,ssd", ssd_size="10records", ssd_dir=ssd_dir, ram_size="4records")
    monkeypatch.undo()
    with pytest.raises(ConfigError):
        TieredSampler(ds, tiers="ram,ssd", ssd_dir=tmp_path / "missing")


def test_background_error_reraised(tmp_path: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = make_dataset(tmp_path / "ds", 30)
    s = TieredSampler(ds, ram_size="4records", batch_size=2)
    from shardkit.formats import PayloadArray

    def broken(self: PayloadArray, keys: np.ndarray, dest: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(PayloadArray, "read_into", broken)  # the primitive every read goes through
    with pytest.raises(SamplerError, match="disk on fire"):
        collect(s)
    _wait_clean(ssd_dir)


@pytest.mark.parametrize(
    "kw",
    [
        {"tiers": "ram,gpu"}, {"tiers": "ssd"}, {"ram_size": "lots"}, {"ram_size": 0}, {"batch_size": 0},
        {"mode": "random"}, {"rank": 2, "world_size": 2}, {"epochs": -1}, {"limit": -1}, {"seed": -3},
    ],
)
def test_bad_options(tmp_path: Path, kw: dict) -> None:
    ds = make_dataset(tmp_path / "ds", 5)
    with pytest.raises(ConfigError):
        TieredSampler(ds, **kw)


# ------------------------------------------------------------------ privacy of the SSD tier
def _modes(root: Path) -> dict[Path, tuple[bool, int]]:
    """(is a directory, permission bits) of ``root`` and everything under it (entries deleted
    meanwhile are skipped)."""
    out: dict[Path, tuple[bool, int]] = {}
    found = [root]
    for parent, dirs, files in os.walk(root):  # os.walk skips directories that vanish meanwhile
        found += [Path(parent, name) for name in dirs + files]
    for path in found:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        out[path] = (stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode))
    return out


def _settled_modes(root: Path, timeout: float = 20.0) -> dict[Path, tuple[bool, int]]:
    """:func:`_modes` once the creators are blocked (two snapshots 0.2 s apart agree)."""
    deadline = time.monotonic() + timeout
    before = _modes(root)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _modes(root)
        if now == before:
            return now
        before = now
    raise AssertionError("the SSD directory never stopped changing")


def test_ssd_tier_is_private(tmp_path: Path, ssd_dir: Path) -> None:
    """The run directory is 0700 from the moment it exists, and the reservoir files in it are 0600
    from the moment they exist, whatever the umask (sampled while reservoirs are being written)."""
    old = os.umask(0)  # the most permissive umask: nothing may rely on it
    try:
        space = SsdSpace(ssd_dir)
        assert stat.S_IMODE(space.path.lstat().st_mode) == 0o700
        assert stat.S_IMODE((space.path / "lock").lstat().st_mode) == 0o600
        space.close()
        s = _make(tmp_path, ssd_dir)
        it = iter(s)
        seen: dict[Path, tuple[bool, int]] = {}
        for _ in range(40):  # several reservoirs, modes sampled while they are written
            check_batch(next(it))
            (run,) = ssd_dir.glob(PREFIX + "*")
            seen.update(_modes(run))
        seen.update(_settled_modes(run))
    finally:
        os.umask(old)
    s.close()
    dirs = {p: m for p, (is_dir, m) in seen.items() if is_dir}
    files = {p: m for p, (is_dir, m) in seen.items() if not is_dir}
    assert sorted(p.name for p in files) == ["lock", f"{SLOT_PREFIX}0", f"{SLOT_PREFIX}1"]  # reservoirs were on disk
    assert set(dirs.values()) == {0o700}, {str(p): oct(m) for p, m in dirs.items()}
    assert set(files.values()) == {0o600}, {str(p): oct(m) for p, m in files.items()}
    _wait_clean(ssd_dir)


def _victim(tmp_path: Path, name: str, with_lock: bool) -> Path:
    victim = tmp_path / name
    (victim / "sub").mkdir(parents=True)
    (victim / "keep.txt").write_text("precious")
    (victim / "sub" / "data").write_text("precious too")
    if with_lock:
        (victim / "lock").write_text("")  # a lock file nobody holds: the trap a naive clean-up falls in
    return victim


def test_stale_cleanup_never_follows_symlinks(tmp_path: Path, ssd_dir: Path) -> None:
    """A symlink named like a stale SSD directory is left alone, and so is what it points at: nothing is
    deleted there and no lock file is created there. Symlinks inside a dead run's directory are
    removed, not followed."""
    locked, bare = _victim(tmp_path, "victim-a", True), _victim(tmp_path, "victim-b", False)
    (ssd_dir / f"{PREFIX}999999-aaaaaaaa").symlink_to(locked, target_is_directory=True)
    (ssd_dir / f"{PREFIX}999999-bbbbbbbb").symlink_to(bare, target_is_directory=True)
    dead, dead_dir = _holder(ssd_dir, "kill")
    dead.wait(10)
    inner = _victim(tmp_path, "victim-c", True)
    (dead_dir / "reservoir-00000000").symlink_to(inner, target_is_directory=True)
    assert remove_stale(ssd_dir) == [dead_dir]
    SsdSpace(ssd_dir).close()  # a new run's start-up scan, too
    for victim in (locked, bare, inner):
        assert (victim / "keep.txt").read_text() == "precious" and (victim / "sub" / "data").is_file()
    assert not (bare / "lock").exists()
    assert sorted(p.name for p in ssd_dir.iterdir()) == [f"{PREFIX}999999-aaaaaaaa", f"{PREFIX}999999-bbbbbbbb"]
    assert all((ssd_dir / n).is_symlink() for n in (f"{PREFIX}999999-aaaaaaaa", f"{PREFIX}999999-bbbbbbbb"))


def test_stale_cleanup_only_touches_own_directories(ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead run's directory owned by another user is never touched (as root: really chowned to
    another uid; otherwise this process pretends to be another user)."""
    dead, dead_dir = _holder(ssd_dir, "kill")
    dead.wait(10)
    (dead_dir / "reservoir-00000000").mkdir()
    if os.geteuid() == 0:
        os.chown(dead_dir, 54321, 54321)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    assert remove_stale(ssd_dir) == []
    SsdSpace(ssd_dir).close()
    assert (dead_dir / "reservoir-00000000").is_dir()
    if os.geteuid() == 0:
        os.chown(dead_dir, os.getuid(), os.getgid())
    else:
        monkeypatch.undo()
    assert remove_stale(ssd_dir) == [dead_dir]  # once it is ours, it goes
    assert not dead_dir.exists()


def test_current_run_closes_a_live_run_and_does_not_keep_an_abandoned_one() -> None:
    class Run:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    current: CurrentRun[Run] = CurrentRun()
    live = current.start(Run())
    current.close()
    current.close()  # idempotent: the run is forgotten once closed
    assert live.closed == 1
    abandoned = current.start(Run())
    seen = weakref.ref(abandoned)
    del abandoned
    gc.collect()
    assert seen() is None  # a dropped run is collected (and stops itself), not kept alive by the sampler
    current.close()

