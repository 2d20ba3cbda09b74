"""Helpers shared by the benchmark scripts (they run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset

__all__ = ["drop_cache", "synthetic_dataset", "IMAGE_SHAPE", "DeviceThrottle", "throttled_device", "device_rates",
           "loop_device"]

log = logging.getLogger("benchmarks")

#: The record every throughput benchmark uses: one 224x224 RGB image, 150,528 bytes.
IMAGE_SHAPE = (224, 224, 3)


def drop_cache(paths: Path | Iterable[Path]) -> None:
    """Evict files (or every file under a directory) from the page cache: each is flushed first (dirty
    pages cannot be dropped), then ``posix_fadvise(DONTNEED)``.

    Written here rather than imported from the library (``shardkit.profiling.phases.evict_page_cache``
    does the same for ``shardkit profile``): ``--before TREE`` runs these scripts against an older
    shardkit that does not have it.
    """
    for p in [paths] if isinstance(paths, Path) else paths:
        for f in [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def synthetic_dataset(path: Path, n: int, shape: tuple[int, ...] = IMAGE_SHAPE) -> Path:
    """A dataset of ``n`` uint8 records at ``path``, written once and reused while ``n`` matches.

    Record ``i`` is one of 256 random images with its first byte set to ``i % 256`` (so a wrong key is
    visible) and label ``i % 1000``.
    """
    if (path / "zarr.json").exists():
        with open_dataset(path) as ds:
            if ds.num_records == n and ds.meta.record.shape == tuple(shape):
                return path
    if path.exists():
        shutil.rmtree(path)  # another size, or a write cut short
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(256, *shape), dtype=np.uint8)
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(shape, "uint8"),
                       fields={"label": FieldSpec((), "int64")}) as w:
        for a in range(0, n, 256):
            k = min(256, n - a)
            images = pattern[:k].copy()
            images.reshape(k, -1)[:, 0] = np.arange(a, a + k) % 256
            w.write({"image": images, "label": np.arange(a, a + k) % 1000})
    return path


# ---------------------------------------------------------------------------------------------- device
#: Name prefix of the cgroups these scripts create (one per process, suffixed with its pid).
CGROUP_PREFIX = "shardkit-bench-"


def device_rates(arg: str | None) -> list[float | None]:
    """``--device-mbps`` ("300,800") as a list of rates; ``[None]`` (unthrottled) when not given."""
    return [float(x) for x in arg.split(",")] if arg else [None]


def block_device(path: Path) -> str:
    """``MAJ:MIN`` of the whole disk holding ``path`` (a partition resolves to its disk, whose reads
    a cgroup can limit). Raises ``OSError`` when ``path`` is not on a block device (tmpfs, overlay)."""
    st = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}")
    if not sysfs.exists():
        raise OSError(f"{path} is on no block device ({os.major(st)}:{os.minor(st)})")
    if (sysfs / "partition").exists():
        return (sysfs.resolve().parent / "dev").read_text().strip()
    return f"{os.major(st)}:{os.minor(st)}"


def _cgroup_hierarchy() -> tuple[str, Path]:
    """("v1", blkio mount) or ("v2", cgroup2 mount offering ``io``); ``OSError`` when neither."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    for _, where, fstype, opts, *_ in mounts:
        if fstype == "cgroup" and "blkio" in opts.split(",") and Path(where, "blkio.throttle.read_bps_device").exists():
            return "v1", Path(where)
    for _, where, fstype, *_ in mounts:
        ctl = Path(where, "cgroup.controllers")
        if fstype == "cgroup2" and ctl.exists() and "io" in ctl.read_text().split():
            return "v2", Path(where)
    raise OSError("no cgroup v1 blkio or v2 io controller mounted")


def _own_cgroup(root: Path, version: str) -> Path:
    """The cgroup of this process in the hierarchy mounted at ``root``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if (version == "v1" and "blkio" in controllers.split(",")) or (version == "v2" and line.startswith("0::")):
            return root / rel.lstrip("/")
    return root


class DeviceThrottle:
    """This process (and every child it starts later) in a cgroup of its own that limits the reads of
    the dataset's disk, so a cold read meets a device of known speed rather than whatever a virtual
    machine's host happens to have cached. Made by :func:`throttled_device`, which removes it again."""

    def __init__(self, path: Path) -> None:
        self.cgroup: Path | None = None
        self.version, self.device, self.reason = "", "", ""
        self._home = Path()
        try:
            self.device = block_device(path)
            self.version, root = _cgroup_hierarchy()
            if os.geteuid() != 0:
                raise OSError("not root")
            self._remove_stale(root)
            self._home = _own_cgroup(root, self.version)
            cgroup = root / f"{CGROUP_PREFIX}{os.getpid()}"
            if self.version == "v2" and "io" not in (root / "cgroup.subtree_control").read_text().split():
                (root / "cgroup.subtree_control").write_text("+io")
            cgroup.mkdir(exist_ok=True)
            self.cgroup = cgroup
            self._limit(None)
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            self.reason = str(e)
            self.close()
            log.warning("device not throttled (%s): cold reads run at whatever the disk and its host give", e)

    def set(self, mbps: float | None) -> str:
        """Limit reads to ``mbps`` MB/s (``None``: no limit); returns the one line a table header states."""
        if self.cgroup is None:
            return f"device not throttled ({self.reason})"
        self._limit(mbps)
        if mbps is None:
            return f"device {self.device} not throttled"
        return f"reads of device {self.device} throttled to {mbps:,.0f} MB/s (cgroup {self.version})"

    def bytes_read(self) -> int:
        """Bytes this cgroup has read from the device (what the throttle accounted), 0 without one."""
        if self.cgroup is None:
            return 0
        if self.version == "v1":
            for line in (self.cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
                f = line.split()
                if len(f) == 3 and f[0] == self.device and f[1] == "Read":
                    return int(f[2])
            return 0
        for line in (self.cgroup / "io.stat").read_text().splitlines():
            f = line.split()
            if f and f[0] == self.device:
                return int(dict(kv.split("=") for kv in f[1:]).get("rbytes", 0))
        return 0

    def _limit(self, mbps: float | None) -> None:
        assert self.cgroup is not None
        bps = int(mbps * 1e6) if mbps else 0
        if self.version == "v1":  # 0 removes the rule
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{self.device} {bps}")
        else:
            (self.cgroup / "io.max").write_text(f"{self.device} rbps={bps or 'max'}")

    def close(self) -> None:
        """Move this process and any child still in the cgroup back to where it came from, remove it."""
        if self.cgroup is None:
            return
        cgroup, self.cgroup = self.cgroup, None
        with contextlib.suppress(OSError):
            for pid in [str(os.getpid()), *(cgroup / "cgroup.procs").read_text().split()]:
                with contextlib.suppress(OSError):  # a child that ended meanwhile
                    (self._home / "cgroup.procs").write_text(pid)
        for attempt in range(20):  # a child that is still exiting keeps the cgroup busy a moment
            try:
                cgroup.rmdir()
                return
            except OSError as e:
                if attempt == 19:
                    log.warning("could not remove %s: %s (the next run removes it)", cgroup, e)
                time.sleep(0.1)

    @staticmethod
    def _remove_stale(root: Path) -> None:
        """Remove the empty cgroups of earlier runs killed before they could (their pid is gone)."""
        for old in root.glob(f"{CGROUP_PREFIX}*"):
            pid = old.name.removeprefix(CGROUP_PREFIX)
            if pid.isdigit() and not Path(f"/proc/{pid}").exists() and not (old / "cgroup.procs").read_text().strip():
                with contextlib.suppress(OSError):
                    old.rmdir()


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM as ``SystemExit``, so the ``finally`` that removes the cgroup runs."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def throttled_device(path: Path) -> Iterator[DeviceThrottle]:
    """A :class:`DeviceThrottle` for the disk holding ``path``, removed on leaving (also on an error or
    SIGTERM). Without root or a cgroup controller it says so in one line and throttles nothing."""
    throttle = DeviceThrottle(path)
    old = None
    if throttle.cgroup is not None and threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield throttle
    finally:
        throttle.close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def loop_device(dataset: Path, image_dir: Path) -> Iterator[Path]:
    """``dataset`` copied onto a device of its own: an ext4 file system in an image file under
    ``image_dir`` (a tmpfs), attached to a loop device and mounted under ``image_dir``; yields the
    copy's path. Unmounted, detached and deleted on leaving (also on an error). Needs root.

    A virtual machine's disk is served by its host, whose page cache survives the guest's
    ``drop_cache``: a "cold" read met that cache in one run and the disk in the next. The loop
    device's reads come from memory the guest owns, so with :func:`throttled_device` on it (the copy's
    device is the loop device) the cold device is the throttle's rate and nothing else, like a
    drive that always delivers its rated bandwidth (no seek or queue effects: what a fast SSD
    approaches). The loop driver's copy from the image costs a few hundredths of a CPU second per GB
    in a kernel worker, outside every measured process.
    """
    size = sum(f.stat().st_size for f in dataset.rglob("*") if f.is_file())
    image_dir.mkdir(parents=True, exist_ok=True)
    image = image_dir / f"{dataset.name}.ext4"
    mount = image_dir / f"{dataset.name}.mnt"
    dev = ""
    try:
        with open(image, "wb") as fh:
            fh.truncate(int(size * 1.1) + (128 << 20))
        # Inode tables and journal initialised now, not by a background thread during the runs.
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image)],
                       check=True, capture_output=True)  # fmt: skip
        dev = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
        mount.mkdir(exist_ok=True)
        subprocess.run(["mount", "-o", "noatime", dev, str(mount)], check=True, capture_output=True)
        shutil.copytree(dataset, mount / dataset.name)
        os.sync()
        log.info("dataset on %s (image %s, %.0f MB)", dev, image, size / 1e6)
        yield mount / dataset.name
    finally:
        if os.path.ismount(mount):
            subprocess.run(["umount", str(mount)], check=False)
        if dev:
            subprocess.run(["losetup", "-d", dev], check=False)
        with contextlib.suppress(OSError):
            mount.rmdir()
        image.unlink(missing_ok=True)
