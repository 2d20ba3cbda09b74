"""Memory shared by the processes of a node (issue 19): fields, the exact epoch order and the static
cache, each once per machine in a private region under /dev/shm; identical results in every process,
private files, cleaned up by the last user or, after a crash, by the next one."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.readers import TieredSampler, epoch_permutation
from shardkit.tiers import shm as node
from tests.helpers.sampler_data import collect, make_dataset

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not node.sharing_available(), reason="no usable /dev/shm on this machine")


@pytest.fixture
def private_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """node's root moved to a fresh directory of this test (other processes never see it)."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(node, "SHM_ROOT", root)
    monkeypatch.setattr(node, "_dir_state", {})
    return root


def _region_files(sampler: TieredSampler) -> list[str]:
    key = sampler._share_key
    assert key is not None
    d = node.SHM_ROOT / f"shardkit-{os.geteuid()}"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _run_jobs(ds: Path, tmp_path: Path, world: int, epochs: int, cache: int, ram: int, kill: bool = False) -> list[dict]:
    barrier = tmp_path / "barrier"
    barrier.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for r in range(world):
        out = tmp_path / f"job{r}.json"
        args = [sys.executable, "-m", "tests.tiers.node_job", str(ds), str(out), "--rank", str(r), "--world",
                str(world), "--epochs", str(epochs), "--cache", str(cache), "--ram", str(ram), "--barrier", str(barrier)]
        procs.append((subprocess.Popen([*args, *(["--kill"] if kill else [])], cwd=REPO, env=env), out))
    results = []
    for proc, out in procs:
        code = proc.wait(timeout=300)
        assert code == (-9 if kill else 0), code
        results.append(json.loads(out.read_text()))
    return results


def test_processes_share_fields_order_and_cache(tmp_path: Path) -> None:
    """Two consumers in two processes: the same fields (read-only, decoded once: exactly one process
    created each region), their slices of the same exact order, one cache filled together in the
    first epoch, so in the second each reads only its unpinned keys; every region is gone after."""
    n, m = 40, 12
    ds = make_dataset(tmp_path / "ds", n)
    res = _run_jobs(ds, tmp_path, world=2, epochs=2, cache=m, ram=m + 6)
    for e in range(2):
        pi = epoch_permutation(5, e, n)
        both = [np.array(r["keys"][e]) for r in res]
        rebuilt = np.concatenate([both[r][g * 2 : g * 2 + 2] for g in range(n // 4) for r in range(2)])
        np.testing.assert_array_equal(rebuilt, pi)
    assert res[0]["fields"] == res[1]["fields"] and not any(res[0]["writeable"].values())
    np.testing.assert_array_equal(np.array(res[0]["fields"]["label"]), np.arange(n) * 3)
    assert res[0]["pinned"] == res[1]["pinned"] and len(res[0]["pinned"]) == m
    created = res[0]["created"] + res[1]["created"]
    assert len(created) == len(set(created))  # each region created by exactly one process
    kinds = sorted(name.split("-")[0] for name in created)
    assert kinds == ["cache", "field", "field", "order", "order"]  # 2 fields, 2 epochs, 1 cache
    assert res[0]["maps"] and res[0]["maps"] == res[1]["maps"]  # both map the same files
    pinned = set(res[0]["pinned"])
    for r in res:
        assert r["disk"][0] == len(r["keys"][0])  # epoch 0: every own key once (pinned ones into the cache)
        assert r["disk"][1] == sum(k not in pinned for k in r["keys"][1])  # epoch 1: only the unpinned
    leftovers = [name for name in os.listdir(node.SHM_ROOT / f"shardkit-{os.geteuid()}")
                 if any(name.startswith(c) for c in created)]  # fmt: skip
    assert leftovers == []


def test_processes_share_what_the_mapped_files_made_resident(tmp_path: Path) -> None:
    """A cache of the whole dataset is its mapped files in both processes, and the node's record of
    what is resident is shared: in the second epoch neither reads from storage, though half of its
    keys were made resident by the other process's mapping in the first; one cache region (the
    record) for both, gone after."""
    n = 40
    ds = make_dataset(tmp_path / "ds", n, shape=(32, 32, 4))  # page-sized records
    res = _run_jobs(ds, tmp_path, world=2, epochs=2, cache=n, ram=2 * n)
    assert all(r["mapped_files"] for r in res)
    for r in res:
        assert r["disk"] == [len(r["keys"][0]), 0]
    for e in range(2):
        assert sorted(res[0]["keys"][e] + res[1]["keys"][e]) == list(range(n))
    created = res[0]["created"] + res[1]["created"]
    assert sorted(name.split("-")[0] for name in created).count("cache") == 1
    d = node.SHM_ROOT / f"shardkit-{os.geteuid()}"
    assert not [name for name in os.listdir(d) if any(name.startswith(c) for c in created)]


def test_a_crashed_process_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    """A SIGKILLed process never releases its regions; the next process that attaches removes them."""
    ds = make_dataset(tmp_path / "ds", 12)
    res = _run_jobs(ds, tmp_path, world=1, epochs=1, cache=4, ram=10, kill=True)
    d = node.SHM_ROOT / f"shardkit-{os.geteuid()}"
    mapped = {Path(line.split()[-1]).name for line in res[0]["maps"].splitlines() if str(d) in line}
    assert mapped and all((d / name).exists() for name in mapped)
    node.remove_stale()
    assert not any((d / name).exists() for name in mapped)


def test_regions_are_private_and_released(tmp_path: Path, private_root: Path) -> None:
    old = os.umask(0)  # the most permissive umask: nothing may rely on it
    try:
        ds = make_dataset(tmp_path / "ds", 30)
        s = TieredSampler(ds, ram_size="20records", static_cache="8records", batch_size=4, epochs=2, seed=1)
        collect(s)
        d = private_root / f"shardkit-{os.geteuid()}"
        assert stat.S_IMODE(d.lstat().st_mode) == 0o700
        files = list(d.iterdir())
        assert {p.name.split("-")[0] for p in files} == {"field", "cache"}
        for p in files:
            st = p.lstat()
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    finally:
        os.umask(old)
    s.close()
    del s
    assert list(d.iterdir()) == []  # the last user deleted every region


def test_nothing_planted_is_followed_or_used(tmp_path: Path, private_root: Path) -> None:
    """A symlink or a foreign-looking file at a region's name is never followed, written or mapped:
    the sampler keeps a private copy and the target is untouched."""
    ds = make_dataset(tmp_path / "ds", 20)
    probe = TieredSampler(ds, ram_size="16records", static_cache="5records", batch_size=4, seed=2)
    key = probe._share_key
    probe.close()
    del probe
    d = private_root / f"shardkit-{os.geteuid()}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 20)  # exactly a label field's size: following it would "work"
    name = node.region_name("field", key, "label", "int64", ())
    (d / name).symlink_to(victim)
    (d / f"{node.region_name('field', key, 'pair', 'float32', (2,))}").write_bytes(b"x" * 160)
    os.chmod(d / node.region_name("field", key, "pair", "float32", (2,)), 0o644)
    s = TieredSampler(ds, ram_size="16records", static_cache="5records", batch_size=4, seed=2, epochs=2)
    keys = np.concatenate(collect(s)).reshape(2, 20)  # collect() checks every field of every batch
    np.testing.assert_array_equal(keys[0], epoch_permutation(2, 0, 20))
    np.testing.assert_array_equal(s.fields["label"], np.arange(20) * 3)
    assert victim.read_bytes() == b"precious" * 20


def test_a_foreign_directory_turns_sharing_off(tmp_path: Path, private_root: Path) -> None:
    d = private_root / f"shardkit-{os.geteuid()}"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)  # someone else could write here
    assert not node.sharing_available()
    ds = make_dataset(tmp_path / "ds", 10)
    s = TieredSampler(ds, batch_size=4, seed=1, epochs=2)
    np.testing.assert_array_equal(np.concatenate(collect(s))[:10], epoch_permutation(1, 0, 10))
    assert list(d.iterdir()) == []


def test_node_permutation_is_the_exact_one(private_root: Path) -> None:
    shared = node.node_permutation(9, 3, 1000)
    assert shared is not None
    array, region = shared
    np.testing.assert_array_equal(array, epoch_permutation(9, 3, 1000))
    assert region.created and not array.flags.writeable
    again = node.node_permutation(9, 3, 1000)
    assert again is not None and not again[1].created  # the node computed it once
    region.release()
    again[1].release()
    assert list((private_root / f"shardkit-{os.geteuid()}").iterdir()) == []


def test_sharing_off_keeps_everything_private(tmp_path: Path, private_root: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 15)
    s = TieredSampler(ds, ram_size="12records", static_cache="4records", batch_size=4, seed=1, epochs=2,
                      node_sharing=False)
    keys = np.concatenate(collect(s)).reshape(2, 15)
    np.testing.assert_array_equal(keys[1], epoch_permutation(1, 1, 15))
    assert s.stats.disk.records == 15 + 11
    assert not (private_root / f"shardkit-{os.geteuid()}").exists()


def test_a_full_node_degrades_to_uncached_reads(tmp_path: Path, private_root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache rows are allocated as they are first filled; rows the node has no memory for (a full
    tmpfs) are read like uncached records, never written through the mapping (which would be a
    SIGBUS), and the order is unchanged. (The dataset's files are taken as unmappable, so the
    cache of the whole dataset keeps its own rows.)"""
    from shardkit.tiers.mapped import MappedShards

    monkeypatch.setattr(MappedShards, "open", classmethod(lambda cls, payload: None))
    real = node.SharedRegion.reserve
    refused: list[int] = []
    page = 4096

    def half_full(self: node.SharedRegion, ranges: list[tuple[int, int]]) -> list[bool]:
        # Records of one page each, so a block's rows are ranges of whole rows. The node has memory
        # only for a range of a single row on an even page: which rows get memory depends on the rows
        # alone, never on which thread asks or in what order (the front-to-back pass, a range of many
        # rows, is refused at its first try).
        ok = real(self, ranges)
        verdict = [good and length == page and (offset // page) % 2 == 0 for good, (offset, length) in zip(ok, ranges)]
        refused.extend(offset for (offset, _), good in zip(ranges, verdict) if not good)
        return verdict

    monkeypatch.setattr(node.SharedRegion, "reserve", half_full)
    n = 30
    ds = make_dataset(tmp_path / "ds", n, shape=(64, 64, 1))
    s = TieredSampler(ds, ram_size=f"{n}records", batch_size=4, seed=3, epochs=3, gap_bytes=0)
    assert s.memory_plan.full_cache
    keys = np.concatenate(collect(s)).reshape(3, n)  # collect() checks every payload row
    for e in range(3):
        np.testing.assert_array_equal(keys[e], epoch_permutation(3, e, n))
    per_epoch = s.stats.disk_bytes_by_epoch
    assert refused and 0 < per_epoch[1] < n * page and 0 < per_epoch[2] <= per_epoch[1]  # refused rows: read again


_CHURN = """
import sys
import numpy as np
from shardkit.tiers import shm as node
node.SHM_ROOT = type(node.SHM_ROOT)(sys.argv[1])
for i in range(int(sys.argv[2])):
    name = f"churn-{i % 3}"
    def init(m, i=i):
        a = np.frombuffer(m, dtype=np.int64)
        a[:] = np.arange(a.size) * 7 + i % 3
        del a
    region = node.attach(name, 8 * 1000, init)
    assert region is not None
    a = region.array(np.int64, (1000,))
    assert np.array_equal(a, np.arange(1000) * 7 + i % 3), (i, a[:3])
    del a
    region.release()
"""


def test_attach_and_release_under_contention(tmp_path: Path) -> None:
    """Four processes attach and release the same regions hundreds of times at once: every one
    sees complete contents, and when all are done no file is left (no region outlives its lock)."""
    root = tmp_path / "shm"
    root.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _CHURN, str(root), "300"], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(4)]  # fmt: skip
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    assert list((root / f"shardkit-{os.geteuid()}").iterdir()) == []
