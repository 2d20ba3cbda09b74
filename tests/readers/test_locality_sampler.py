"""``locality=True`` through the real sampler: the same steps, storage reads only for misses, node caches.

Every consumer of a simulated run is a TieredSampler in this process (consumer c of W, nodes as the
options say). A step's keys are batch ``j`` of every consumer of one step group (consumers
``r * k + w`` for a fixed worker ``w``); without locality they are fixed positions of ``pi``, and with
it they must be the same set. Storage reads are the sampler's own counters (``stats.disk``).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.cli.main import main
from shardkit.errors import ConfigError, InsecurePathError, SamplerError
from shardkit.order.locality import node_partition
from shardkit.readers import SamplerOptions, TieredSampler, epoch_permutation, epoch_stream
from shardkit.tiers.node_cache import node_cache_dir
from tests.helpers.sampler_data import collect, make_dataset

N = 61  # prime: ragged tails everywhere


def _run(ds: Path, w: int, epochs: int = 1, **options: Any) -> list[list[np.ndarray]]:
    """Batches of every consumer c of W (one iteration each)."""
    out = []
    for c in range(w):
        with TieredSampler(ds, rank=c, world_size=w, epochs=epochs, **options) as s:
            out.append(collect(s))
    return out


def _steps(batches: list[list[np.ndarray]], k: int) -> list[np.ndarray]:
    """Sorted keys of every training step: batch j of the consumers of step group w, for every (j, w)."""
    w = len(batches)
    steps = []
    for group in range(k):
        members = range(group, w, k)
        for j in range(max(len(batches[c]) for c in members)):
            keys = [batches[c][j] for c in members if j < len(batches[c])]
            steps.append(np.sort(np.concatenate(keys)))
    return steps


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "ds", N, records_per_shard=7)


CONFIGS = [
    dict(world=4, k=1, nodes=2, extra=dict(static_cache="12records")),
    dict(world=4, k=1, nodes=2, extra=dict(static_cache="31records", drop_last=True)),
    dict(world=6, k=2, nodes=3, extra=dict(static_cache="9records")),
    dict(world=4, k=1, nodes=4, extra=dict(static_cache="16records", mode="replacement")),
    dict(world=4, k=2, nodes=1, extra=dict(static_cache="30records", tiers="ram,ssd", ssd_size="80records")),
    dict(world=3, k=1, nodes=3, extra=dict(static_cache="5records", node_cache="6records")),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_every_step_keeps_its_keys_and_every_consumer_its_count(ds: Path, tmp_path: Path, ssd_dir: Path, cfg: dict[str, Any]) -> None:
    w, k, m = cfg["world"], cfg["k"], cfg["nodes"]
    extra = dict(batch_size=3, ram_size="72records", seed=5, ssd_dir=ssd_dir, workers_per_rank=k, **cfg["extra"])
    node = dict(locality=True, nodes=m, node_cache=extra.pop("node_cache", 0), node_cache_dir=tmp_path)
    for epoch in (0, 1):
        plain = _run(ds, w, start_epoch=epoch, **extra)
        local = _run(ds, w, start_epoch=epoch, **extra, **node)
        for p, q in zip(plain, local):
            assert [b.size for b in p] == [b.size for b in q]
        for a, b in zip(_steps(plain, k), _steps(local, k)):
            np.testing.assert_array_equal(a, b)
        assert any(not np.array_equal(np.concatenate(p), np.concatenate(q)) for p, q in zip(plain, local))
    everything = np.sort(np.concatenate([np.concatenate(c) for c in local]))
    with TieredSampler(ds, world_size=w, **extra) as probe:
        stream = epoch_stream(probe.mode, 5, 1, N, probe.reservoir_size)
    want = stream[: (N // (3 * w)) * 3 * w] if extra.get("drop_last") else stream
    np.testing.assert_array_equal(everything, np.sort(want))


def test_without_pinned_records_locality_is_the_plain_order(ds: Path) -> None:
    plain = _run(ds, 4, batch_size=3, seed=2, static_cache=0)
    local = _run(ds, 4, batch_size=3, seed=2, locality=True, nodes=2, static_cache=0)
    for p, q in zip(plain, local):
        np.testing.assert_array_equal(np.concatenate(p), np.concatenate(q))


def _check_reads_are_misses(samplers: list[TieredSampler], part: Any, ram: int, disk: int, epochs: int) -> None:
    """Storage reads of every consumer (two per node) and epoch, exactly: its misses (keys its node
    does not pin), the node's RAM-pinned keys it is the first on its node to take (the static cache
    fills as a side effect of reading), and the node's disk part once per node (the first consumer
    to read); once every pinned key has come up, only the misses."""
    nodes = len(samplers) // 2
    ram_part = [set(part.pinned_keys(node, 0, ram).tolist()) for node in range(nodes)]
    filled: list[set[int]] = [set() for _ in range(nodes)]
    fills = []
    for epoch in range(epochs):
        fills.append(0)
        for c, s in enumerate(samplers):
            node = c // 2
            s.set_epoch(epoch)
            before = s.stats.disk.records
            keys = np.concatenate(collect(s))
            misses = int(np.count_nonzero(part.holders(keys) != node))
            new = (set(keys.tolist()) & ram_part[node]) - filled[node]
            filled[node] |= new
            fills[-1] += len(new)
            build = disk if epoch == 0 and c % 2 == 0 else 0
            assert s.stats.disk.records - before == misses + len(new) + build, (epoch, c)
    assert filled == ram_part  # every pinned record was read once, by one consumer of its node
    assert fills[-1] == 0  # from then on, storage reads are the misses only


def test_storage_reads_per_epoch_are_the_misses(ds: Path, tmp_path: Path) -> None:
    """Storage reads per consumer and epoch are its misses (see _check_reads_are_misses)."""
    w, m, ram, disk = 4, 2, 10, 8
    part = node_partition(3, N, m, ram + disk)
    samplers = [TieredSampler(ds, rank=c, world_size=w, nodes=m, locality=True, batch_size=4, seed=3, epochs=1,
                              static_cache=f"{ram}records", node_cache=f"{disk}records", ram_size=f"{ram + 40}records",
                              node_cache_dir=tmp_path, gap_bytes=0) for c in range(w)]  # fmt: skip
    try:
        _check_reads_are_misses(samplers, part, ram, disk, epochs=8)
    finally:
        for s in samplers:
            s.close()


def test_resume_with_another_world_size_continues_the_same_global_batches(ds: Path) -> None:
    opts = dict(seed=8, static_cache="20records", locality=True)
    first = TieredSampler(ds, rank=1, world_size=4, nodes=2, batch_size=2, **opts)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    first.close()
    assert state["position"] == 16
    pi = epoch_permutation(8, 0, N)
    for w, m, b in [(2, 1, 4), (2, 2, 4), (8, 4, 1)]:
        resumed = []
        for c in range(w):
            s = TieredSampler(ds, rank=c, world_size=w, nodes=m, batch_size=b, **opts)
            s.load_state_dict(state)
            resumed.append(collect(s))
        for g in range(len(resumed[0])):
            got = np.sort(np.concatenate([r[g] for r in resumed if g < len(r)]))
            np.testing.assert_array_equal(got, np.sort(pi[16 + 8 * g : 16 + 8 * (g + 1)]))


# ---------------------------------------------------------------------------------------------- node cache
def _node_sampler(ds: Path, where: Path, rank: int = 0, **extra: Any) -> TieredSampler:
    opts: dict[str, Any] = dict(rank=rank, world_size=2, nodes=2, locality=True, batch_size=4, seed=1,
                                node_cache="20records", node_cache_dir=where, ram_size="6records")  # fmt: skip
    return TieredSampler(ds, **{**opts, **extra})


def test_node_cache_is_written_once_and_reused_by_later_runs(ds: Path, tmp_path: Path) -> None:
    tmp_path = tmp_path / "caches"
    tmp_path.mkdir()
    part = node_partition(1, N, 2, 20)
    first = _node_sampler(ds, tmp_path)
    keys = np.concatenate(collect(first))
    misses = int(np.count_nonzero(part.holders(keys) != 0))
    assert first.stats.disk.records == 20 + misses
    first.close()
    later = _node_sampler(ds, tmp_path)
    keys = np.concatenate(collect(later))
    assert later.stats.disk.records == int(np.count_nonzero(part.holders(keys) != 0))
    assert later.stats.node.records + later.stats.cache.records == keys.size - later.stats.disk.records
    later.close()
    users = list(tmp_path.iterdir())
    assert users == [node_cache_dir(tmp_path)]
    assert len([p for p in users[0].iterdir() if p.name.startswith("entry-")]) == 1
    other_seed = _node_sampler(ds, tmp_path, seed=2)
    collect(other_seed)
    other_seed.close()
    assert len([p for p in users[0].iterdir() if p.name.startswith("entry-")]) == 2


def test_processes_of_one_node_build_the_cache_once(ds: Path, tmp_path: Path) -> None:
    samplers = [_node_sampler(ds, tmp_path, workers_per_rank=2, world_size=4, rank=r) for r in (0, 1)]
    results: dict[int, np.ndarray] = {}

    def run(i: int) -> None:
        results[i] = np.concatenate(collect(samplers[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1]
    part = node_partition(1, N, 2, 20)
    misses = sum(int(np.count_nonzero(part.holders(v) != 0)) for v in results.values())
    assert sum(s.stats.disk.records for s in samplers) == 20 + misses
    for s in samplers:
        s.close()


def _entry(where: Path) -> Path:
    return next(p for p in node_cache_dir(where).iterdir() if p.name.startswith("entry-"))


def _truncate_a_shard(entry: Path) -> None:
    shard = max((p for p in entry.rglob("*") if p.is_file() and "c" in p.parts), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-3])


def _replace_with_other_keys(entry: Path) -> None:
    """The entry of another node (other keys, a valid dataset) put in this one's place."""
    other = entry.parent / "other"
    shutil.copytree(entry, other)
    shutil.rmtree(entry)
    ds = entry.parent.parent.parent / "ds"
    s = _node_sampler(ds, entry.parent.parent, rank=1)  # node 1 writes its own entry
    collect(s)
    s.close()
    shutil.rmtree(other)
    theirs = next(p for p in entry.parent.iterdir() if p.name.startswith("entry-"))
    theirs.rename(entry)


@pytest.mark.parametrize("damage", [_truncate_a_shard, _replace_with_other_keys, lambda e: (e / "zarr.json").unlink()])
def test_a_damaged_entry_is_written_again(ds: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any) -> None:
    where = tmp_path / "caches"
    where.mkdir()
    s = _node_sampler(ds, where)
    want = collect(s)
    s.close()
    damage(_entry(where))
    again = _node_sampler(ds, where)
    got = collect(again)  # check_batch in collect proves every payload matches its key
    assert again.stats.disk.records == s.stats.disk.records  # the entry was written again
    again.close()
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert "writing it again" in caplog.text


def test_a_writer_that_died_leaves_no_entry(ds: Path, tmp_path: Path) -> None:
    where = tmp_path / "caches"
    where.mkdir()
    s = _node_sampler(ds, where)
    collect(s)
    s.close()
    entry = _entry(where)
    partial = entry.parent / f".{entry.name}.building-1-dead"
    entry.rename(partial)
    again = _node_sampler(ds, where)
    collect(again)
    again.close()
    assert sorted(p.name for p in node_cache_dir(where).iterdir()) == sorted([entry.name, "lock"])


def test_node_cache_directory_must_be_private(ds: Path, tmp_path: Path) -> None:
    mine = node_cache_dir(tmp_path)
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    with pytest.raises(InsecurePathError, match="has mode 0o755"):
        collect(_node_sampler(ds, tmp_path))
    mine.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    mine.symlink_to(elsewhere)
    with pytest.raises(InsecurePathError, match="is a symlink"):
        collect(_node_sampler(ds, tmp_path))
    assert list(elsewhere.iterdir()) == []


def test_node_cache_files_are_private(ds: Path, tmp_path: Path) -> None:
    s = _node_sampler(ds, tmp_path)
    collect(s)
    s.close()
    for p in node_cache_dir(tmp_path).rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "values,message",
    [
        (dict(world_size=4, nodes=3), "nodes: expected a divisor of the 4 ranks"),
        (dict(world_size=4, workers_per_rank=3), "workers_per_rank: expected a divisor of world_size=4"),
        (dict(world_size=4, workers_per_rank=2, nodes=4), "nodes: expected a divisor of the 2 ranks"),
        (dict(node_cache="5records"), "node_cache: a node's disk cache .* only locality uses"),
        (dict(locality="yes"), "locality: expected True or False"),
        (dict(nodes=0), "nodes: "),
    ],
)
def test_bad_locality_options(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplerOptions.parse(**values)


def test_missing_node_cache_dir_is_a_config_error(ds: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="node_cache_dir: expected an existing directory"):
        _node_sampler(ds, tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"node_cache: .* holds no record"):
        _node_sampler(ds, tmp_path, node_cache="3B")


def test_cli_sample_with_locality(ds: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "order.npy"
    args = ["sample", str(ds), "--locality", "--nodes", "2", "--world-size", "4", "--rank", "2", "--batch-size", "3",
            "--static-cache", "10records", "--node-cache", "8records", "--node-cache-dir", str(tmp_path),
            "--seed", "4", "--order-out", str(out)]  # fmt: skip
    try:
        main(args)
    except SystemExit as exc:
        assert not exc.code
    text = capsys.readouterr().out
    assert "node         1 of 2, pinning 18 records" in text
    want = np.concatenate(_run(ds, 4, batch_size=3, seed=4, locality=True, nodes=2, static_cache="10records",
                               node_cache="8records", node_cache_dir=tmp_path)[2])  # fmt: skip
    np.testing.assert_array_equal(np.load(out)[0], want)
    with pytest.raises(SystemExit):
        main(["sample", str(ds), "--locality", "--nodes", "3", "--world-size", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --nodes: expected a divisor of the 4 ranks (--world-size / --workers-per-rank), found 3"]


def test_state_dict_is_the_same_with_and_without_locality(ds: Path) -> None:
    a = TieredSampler(ds, rank=0, world_size=2, batch_size=3, static_cache="10records")
    b = TieredSampler(ds, rank=0, world_size=2, batch_size=3, static_cache="10records", locality=True, nodes=2)
    ia, ib = iter(a), iter(b)
    for _ in range(3):
        next(ia), next(ib)
    assert a.state_dict() == b.state_dict()
    a.close(), b.close()
    with pytest.raises(SamplerError):
        b.load_state_dict({**b.state_dict(), "seed": 99})


def test_locality_over_an_object_store(s3: Any, tmp_path: Path) -> None:
    """A dataset in an object store: each node's disk cache is written from it once, the static
    cache fills from it as it is read, and then the store serves only the misses (its requests)."""
    from tests.helpers.datasets import upload

    url = upload(make_dataset(tmp_path / "remote-ds", 40, records_per_shard=6), s3.url("locality-ds"))
    caches = tmp_path / "caches"
    for node in range(2):
        (caches / f"n{node}").mkdir(parents=True)
    part = node_partition(2, 40, 2, 16)
    samplers = [TieredSampler(url, rank=c, world_size=4, nodes=2, locality=True, batch_size=3, seed=2, epochs=1,
                              static_cache="8records", node_cache="8records", ram_size="48records",
                              node_cache_dir=caches / f"n{c // 2}", cache_dir=None) for c in range(4)]  # fmt: skip
    try:
        _check_reads_are_misses(samplers, part, 8, 8, epochs=8)
        assert [s.stats.records // 8 for s in samplers] == [12, 10, 9, 9]  # 3 global batches of 12, a tail of 4
    finally:
        for s in samplers:
            s.close()
