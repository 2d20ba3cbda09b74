"""benchmarks/_common.py's throttled device: with root and a cgroup io controller a cold read of the
dataset's disk runs no faster than the rate set, through a cgroup removed afterwards; without them the
scripts say why in one line and run unthrottled."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.benchmarks import load_benchmark

MBPS = 40


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("_common", monkeypatch)


def _can_throttle(path: Path) -> bool:
    """Root, ``path`` on a block device, and a v1 blkio or v2 io controller: the throttle must work."""
    st = os.stat(path).st_dev
    v1 = Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists()
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    has_io = v1 or (v2.exists() and "io" in v2.read_text().split())
    return os.geteuid() == 0 and has_io and Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}").exists()


def _cold_read(common: ModuleType, path: Path) -> float:
    common.drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(1 << 20):
            pass
    return path.stat().st_size / (time.perf_counter() - t0) / 1e6


def test_throttled_read_or_the_stated_fallback(common: ModuleType, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    data = tmp_path / "data"
    data.write_bytes(os.urandom(24 << 20))
    before = Path("/proc/self/cgroup").read_text()
    with caplog.at_level(logging.WARNING), common.throttled_device(data) as dev:
        line = dev.set(MBPS)
        if not _can_throttle(data):
            assert dev.cgroup is None and line.startswith("device not throttled (")
            assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("device not throttled (")]
            _cold_read(common, data)  # runs all the same
            return
        cgroup = dev.cgroup
        assert cgroup is not None and str(os.getpid()) in (cgroup / "cgroup.procs").read_text().split()
        assert line.endswith(f"throttled to {MBPS} MB/s (cgroup {dev.version})")
        read0 = dev.bytes_read()
        rate = _cold_read(common, data)
        assert dev.bytes_read() - read0 >= data.stat().st_size  # the read went through the cgroup
        assert rate <= 1.25 * MBPS  # an upper bound: a loaded machine only reads slower
    assert not cgroup.exists() and Path("/proc/self/cgroup").read_text() == before


def test_cgroup_removed_on_error(common: ModuleType, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_bytes(b"x" * 4096)
    made: list[Path | None] = []
    with pytest.raises(RuntimeError), common.throttled_device(data) as dev:
        made.append(dev.cgroup)
        raise RuntimeError("a benchmark failed")
    assert made[0] is None or not made[0].exists()
    assert not list(Path("/sys/fs/cgroup/blkio").glob(f"{common.CGROUP_PREFIX}{os.getpid()}"))


def test_without_a_controller_one_line_and_unthrottled(common: ModuleType, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    def none() -> tuple[str, Path]:
        raise OSError("no cgroup v1 blkio or v2 io controller mounted")

    monkeypatch.setattr(common, "_cgroup_hierarchy", none)
    data = tmp_path / "data"
    data.write_bytes(b"x" * 4096)
    with caplog.at_level(logging.WARNING), common.throttled_device(data) as dev:
        assert dev.cgroup is None
        assert dev.set(MBPS) == "device not throttled (no cgroup v1 blkio or v2 io controller mounted)"
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("device not throttled (no cgroup")


def test_cgroup_removed_when_a_child_is_still_exiting(common: ModuleType, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The kernel refuses to remove a cgroup while a process that left it is still exiting (EBUSY)."""
    data = tmp_path / "data"
    data.write_bytes(b"x" * 4096)
    real_rmdir, busy = Path.rmdir, [2]

    def rmdir(self: Path) -> None:
        if busy[0]:
            busy[0] -= 1
            raise OSError(16, "Device or resource busy")
        real_rmdir(self)

    with caplog.at_level(logging.WARNING), common.throttled_device(data) as dev:
        cgroup = dev.cgroup
        monkeypatch.setattr(Path, "rmdir", rmdir)
    assert cgroup is None or (not cgroup.exists() and busy == [0])
    assert not [r for r in caplog.records if "could not remove" in r.getMessage()]


def _can_loop() -> bool:
    """Root, ``losetup`` and ``mkfs.ext4``: the dataset can be put on a loop device."""
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount"))


def test_loop_device_holds_a_copy_on_its_own_device(common: ModuleType, tmp_path: Path) -> None:
    data = tmp_path / "ds"
    (data / "shards").mkdir(parents=True)
    payload = os.urandom(3 << 20)
    (data / "shards" / "0").write_bytes(payload)
    if not _can_loop():
        with pytest.raises((OSError, subprocess.CalledProcessError)), common.loop_device(data, tmp_path / "img"):
            pass
        return
    with common.loop_device(data, tmp_path / "img") as copy, common.throttled_device(copy) as dev:
        st = os.stat(copy / "shards" / "0").st_dev
        assert (copy / "shards" / "0").read_bytes() == payload and st != os.stat(data).st_dev
        assert Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}/loop/backing_file").read_text().startswith(
            str(tmp_path / "img"))  # fmt: skip
        assert dev.device == f"{os.major(st)}:{os.minor(st)}"  # the throttle limits the loop device
    assert not os.path.ismount(copy.parent) and list((tmp_path / "img").iterdir()) == []
    assert str(tmp_path / "img") not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
