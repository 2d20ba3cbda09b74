"""The local cache of remote shards: later epochs read locally with the order unchanged, every
cached shard verified against the metadata's checksums, a budget without thrashing, LRU eviction
across datasets, private files, and concurrent processes sharing one cache directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import InsecurePathError
from shardkit.readers import TieredSampler
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import check_batch, make_dataset

N, REC = 60, 16  # make_dataset's records are 16 bytes


def _cached_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("shard-*") if p.is_file())


def _run(url: str, cache_dir: Path, epochs: int = 1, start_epoch: int = 0, **kw: Any) -> tuple[TieredSampler, np.ndarray]:
    s = TieredSampler(url, batch_size=4, epochs=epochs, seed=6, ram_size="12records", cache_dir=cache_dir,
                      start_epoch=start_epoch, **kw)
    keys = np.concatenate([check_batch(b) for b in s])
    return s, keys


@pytest.fixture
def remote(s3: Any, tmp_path: Path) -> str:
    return upload(make_dataset(tmp_path / "ds", N, records_per_shard=7), s3.url("ds"))


def test_later_epochs_read_locally_order_unchanged(remote: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    plain = TieredSampler(remote, batch_size=4, epochs=3, seed=6, ram_size="12records")
    expected = np.concatenate([check_batch(b) for b in plain])
    s, keys = _run(remote, cache, epochs=1)
    first = s.stats.disk.read_calls
    assert first > 0 and len(_cached_files(cache)) == 9  # every shard complete and verified after epoch 0
    s2, keys2 = _run(remote, cache, epochs=2, start_epoch=1)
    np.testing.assert_array_equal(np.concatenate([keys, keys2]), expected)  # the order does not change
    assert s2.stats.disk.read_calls == 0 and s2.stats.disk.bytes_read == 0  # nothing requested
    assert s2.stats.remote_cache.bytes_read >= 2 * N * REC
    # Within one sampler too: epoch 0 fills the cache, epoch 1 reads it.
    cache_b = tmp_path / "cache-b"
    cache_b.mkdir()
    s3_, _ = _run(remote, cache_b, epochs=1)
    requests_epoch0 = s3_.stats.disk.read_calls
    s4, _ = _run(remote, cache_b, epochs=1, start_epoch=1)
    assert requests_epoch0 > 0 and s4.stats.disk.read_calls == 0


def test_cache_is_private(remote: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    old = os.umask(0o022)
    try:
        _run(remote, cache)
    finally:
        os.umask(old)
    root = cache / f"shardkit-cache-{os.geteuid()}"
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode & 0o077 == 0, f"{p} is {oct(mode)}"
    # A planted symlink in place of the cache root is refused, not followed.
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / f"shardkit-cache-{os.geteuid()}").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(InsecurePathError, match="symlink"):
        _run(remote, evil)


def test_damaged_cached_shard_is_dropped_not_served(remote: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    _run(remote, cache)
    victim = _cached_files(cache)[2]
    raw = bytearray(victim.read_bytes())
    raw[5] ^= 0xFF
    victim.write_bytes(bytes(raw))
    s, keys = _run(remote, cache, epochs=1, start_epoch=1)  # check_batch proves every byte is right
    assert sorted(keys.tolist()) == list(range(N))
    assert 0 < s.stats.disk.read_calls  # the damaged shard was fetched again
    # ... and only that one: its 7 records, and before them its tail once (the identity check against
    # tail_crc32c, at most 4 KiB of the end of its records: here all 7 records)
    assert s.stats.disk.bytes_read <= 7 * REC + 64 + 7 * REC


def test_budget_caches_what_fits_without_thrashing(remote: str, tmp_path: Path) -> None:
    """A budget of 4 shards: 4 stay cached epoch after epoch (no eviction among this job's own
    shards), the others are read remotely each epoch."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shard_bytes = 7 * REC + 7 * 16 + 4
    budget = 4 * shard_bytes + shard_bytes // 2
    _run(remote, cache, cache_size=budget)
    kept = _cached_files(cache)
    assert len(kept) == 4
    s, _ = _run(remote, cache, epochs=1, start_epoch=1, cache_size=budget)
    assert _cached_files(cache) == kept
    # The uncached shards, and only those; each one's tail is fetched once first (the identity check
    # against tail_crc32c: the last 4 KiB of its records, here all of them).
    names = {p.name for p in kept}
    tails = sum(min(7, N - 7 * i) * REC for i in range(9) if f"shard-{i:08d}" not in names)
    assert 0 < s.stats.disk.bytes_read - tails < N * REC
    assert s.stats.remote_cache.bytes_read > 0


def test_lru_eviction_across_datasets(s3: Any, remote: str, tmp_path: Path) -> None:
    """A second dataset in the same cache directory evicts the least recently used copies of the first."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shard_bytes = 7 * REC + 7 * 16 + 4
    budget = 10 * shard_bytes
    _run(remote, cache, cache_size=budget)
    first = {p.parent.name for p in _cached_files(cache)}
    other = upload(make_dataset(tmp_path / "ds2", N, records_per_shard=7), s3.url("ds2"))
    _run(other, cache, cache_size=budget)
    by_ns: dict[str, int] = {}
    for p in _cached_files(cache):
        by_ns[p.parent.name] = by_ns.get(p.parent.name, 0) + 1
    (ns_a,) = first
    ns_b = next(k for k in by_ns if k != ns_a)
    assert by_ns[ns_b] == 9 and by_ns.get(ns_a, 0) == 1  # 10 fit: the newest dataset whole, one old shard
    assert sum(p.stat().st_size for p in _cached_files(cache)) <= budget


_WORKER = """
import sys, numpy as np
from shardkit.readers import TieredSampler
from tests.helpers.sampler_data import check_batch
url, cache, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = TieredSampler(url, batch_size=4, epochs=2, seed=6, ram_size="12records", cache_dir=cache, rank=rank, world_size=2)
keys = np.concatenate([check_batch(b) for b in s])
print(keys.size, s.stats.disk.read_calls)
"""


def test_concurrent_processes_share_one_cache(remote: str, tmp_path: Path) -> None:
    """Two ranks on one machine read their halves concurrently into one cache directory; the cache
    ends complete and verified, and a later run requests nothing."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, remote, str(cache), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert sum(int(out.split()[0]) for out, _ in outs) == 2 * N
    assert len(_cached_files(cache)) == 9
    s, keys = _run(remote, cache, epochs=1, start_epoch=2)
    assert s.stats.disk.read_calls == 0 and sorted(keys.tolist()) == list(range(N))


def test_a_process_checks_each_complete_copy_once_not_once_per_pass(tmp_path: Path) -> None:
    """Every pass builds a new cache instance: a copy this process completed or checked is not read
    again to check it, its use is recorded in the access time (mtime kept), and a copy whose bytes
    changed afterwards (same inode, same size, new mtime) is checked again and dropped."""
    from shardkit.stores import cache as cache_mod

    root = tmp_path / "c"
    root.mkdir()
    checks: list[str] = []

    def verify(ok: bool) -> Any:
        def check(fd: int) -> bool:
            checks.append("check")
            return ok
        return check

    name, size = "shard-00000000", 1 << 16
    first = cache_mod.ShardCache(root, "ns")
    fd = first.claim(name, size)
    assert fd is not None
    os.pwrite(fd, b"\1" * size, 0)
    assert first.complete(name, fd, size, verify(True))
    first.close()
    assert checks == ["check"]
    copy = root / cache_mod.cache_root(root).name / "ns" / name
    mtime = copy.stat().st_mtime_ns
    for _ in range(3):  # three later passes of this process
        again = cache_mod.ShardCache(root, "ns")
        assert again.open(name, verify(True)) is not None
        again.close()
    assert checks == ["check"]
    assert copy.stat().st_mtime_ns == mtime  # recency went to the access time
    os.utime(copy, ns=(copy.stat().st_atime_ns, mtime + 10**9))  # its bytes were rewritten in place
    later = cache_mod.ShardCache(root, "ns")
    assert later.open(name, verify(False)) is None  # checked again, failed, dropped
    later.close()
    assert checks == ["check", "check"] and not copy.exists()


def test_a_completed_copy_is_not_flushed_and_a_torn_one_is_dropped_by_the_next_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Completing a copy does not wait for the disk (no fsync of the copy): the download goes on.
    That is safe because a complete copy is checked before its first use after a restart: a copy a
    crash left zeroed is dropped by the next process (its check memo starts empty, and the check
    recorded on the copy was made in another boot), never served."""
    from shardkit.stores import cache as cache_mod

    root = tmp_path / "c"
    root.mkdir()
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    name, size = "shard-00000000", 1 << 16
    first = cache_mod.ShardCache(root, "ns")
    fd = first.claim(name, size)
    assert fd is not None
    os.pwrite(fd, b"\1" * size, 0)
    copy_inode = os.fstat(fd).st_ino
    assert first.complete(name, fd, size, lambda f: True)
    first.close()
    copy = root / cache_mod.cache_root(root).name / "ns" / name
    assert copy.stat().st_ino == copy_inode
    assert not synced, "the completed copy was flushed: the download waited for the disk"

    def same_bytes(f: int) -> bool:
        return os.pread(f, size, 0) == b"\1" * size

    with open(copy, "r+b") as f:  # what a crash can leave of a copy the kernel had not written back
        f.write(bytes(size))
    monkeypatch.setattr(cache_mod, "_VERIFIED", {})  # a new process: nothing checked yet
    monkeypatch.setattr(cache_mod, "_BOOT_ID", b"after-the-crash")
    later = cache_mod.ShardCache(root, "ns")
    assert later.open(name, same_bytes) is None  # checked, failed, dropped
    later.close()
    assert not copy.exists()


def test_a_copy_checked_by_another_process_of_this_boot_is_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy one process filled and checked is trusted by the machine's other processes (DataLoader
    workers, ranks, the next run) without reading it again, until the machine restarts or the copy
    is rewritten: then it is checked again. Where the file system keeps no user attributes, every
    process checks it, as before."""
    from shardkit.stores import cache as cache_mod

    root = tmp_path / "c"
    root.mkdir()
    name, size = "shard-00000000", 1 << 16
    first = cache_mod.ShardCache(root, "ns")
    fd = first.claim(name, size)
    assert fd is not None
    os.pwrite(fd, b"\1" * size, 0)
    assert first.complete(name, fd, size, lambda f: True)
    first.close()
    copy = root / cache_mod.cache_root(root).name / "ns" / name
    probe = tmp_path / "probe"
    probe.touch()
    try:
        os.setxattr(probe, "user.probe", b"1")
        kept = True  # this file system keeps user attributes
    except OSError:
        kept = False
    checks: list[str] = []

    def opened_by_another_process(what: str) -> None:
        monkeypatch.setattr(cache_mod, "_VERIFIED", {})  # a new process: nothing checked in it yet
        other = cache_mod.ShardCache(root, "ns")
        assert other.open(name, lambda f: checks.append(what) is None) is not None
        other.close()

    opened_by_another_process("same boot")
    assert checks == ([] if kept else ["same boot"])
    monkeypatch.setattr(cache_mod, "_BOOT_ID", b"another-boot")
    opened_by_another_process("after a restart")
    assert checks[-1] == "after a restart"
    opened_by_another_process("checked again in that boot")  # the check that passed was recorded
    assert checks[-1] == "after a restart" or not kept
    os.utime(copy, ns=(0, 0))  # rewritten in place: a new mtime
    opened_by_another_process("rewritten")
    assert checks[-1] == "rewritten"



def test_a_listeners_wait_reads_its_wake_ups_once_while_another_process_keeps_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filler's watcher reads its wake-ups in one bounded read: a process of the node that writes
    its FIFO again after every read (a bug, or a hostile process of the same user) cannot keep it
    reading. Here every read of the FIFO is followed by another byte, at most 1,000 times."""
    from shardkit.stores.cache import ShardCache, cache_namespace

    (tmp_path / "cache").mkdir()
    cache = ShardCache(tmp_path / "cache", cache_namespace("s3://b/ds", "v1"))
    listener = cache.listen()
    assert listener is not None
    listening = listener._fd
    writer = os.open(cache.root / "wake" / listener.name, os.O_WRONLY | os.O_NONBLOCK)
    reads: list[int] = []
    real_read = os.read

    def refilled(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        if fd == listening:
            reads.append(len(data))
            if len(reads) < 1000:
                os.write(writer, b"\1")  # written again as soon as it was read
        return data

    try:
        os.write(writer, b"\1")
        monkeypatch.setattr(os, "read", refilled)
        assert listener.wait(1.0)
        monkeypatch.undo()
        assert reads == [1]
    finally:
        monkeypatch.undo()
        os.close(writer)
        listener.close()
        cache.close()


def test_a_copy_opened_the_moment_it_is_completed_is_not_checked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete copy is marked checked before it gets its final name, so a reader that opens it
    the moment it appears (in this process, or another one of this boot) does not read it back to
    check it again. The opens here run right after the rename, inside :meth:`ShardCache.complete`."""
    from shardkit.stores import cache as cache_mod

    root = tmp_path / "c"
    root.mkdir()
    name, size = "shard-00000000", 1 << 16
    filler = cache_mod.ShardCache(root, "ns")
    reader = cache_mod.ShardCache(root, "ns")  # as another process of the node
    checks: list[str] = []
    opened: list[int | None] = []

    def check(who: str) -> Any:
        def verify(fd: int) -> bool:
            checks.append(who)
            return True
        return verify

    real_rename = os.rename

    def renamed_then_opened(*args: Any, **kw: Any) -> None:
        real_rename(*args, **kw)
        opened.extend([filler.open(name, check("this process")), reader.open(name, check("another"))])

    fd = filler.claim(name, size)
    assert fd is not None
    os.pwrite(fd, b"\1" * size, 0)
    monkeypatch.setattr(os, "rename", renamed_then_opened)
    try:
        assert filler.complete(name, fd, size, check("complete"))
    finally:
        monkeypatch.undo()
        filler.close()
        reader.close()
    assert len(opened) == 2 and None not in opened
    assert checks == ["complete"]
