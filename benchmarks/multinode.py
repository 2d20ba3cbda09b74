"""Benchmark of node-aware loading (``locality=True``, DESIGN §10): storage traffic, hit rates, scaling.

Run: ``python benchmarks/multinode.py`` (generates ``benchmarks/_data/multinode-bench`` once: 8,192
records of 224x224x3 uint8, 1.2 GB), or ``--quick`` for a small smoke run (1,024 records of 32x32x3).

Four parts:

1. **Measured on this machine.** For 1, 2 and 4 simulated nodes of ``--ranks-per-node`` ranks each,
   every consumer is a :class:`~shardkit.readers.TieredSampler` run in this process, one after
   another (a real cluster runs them in parallel; bytes and requests do not depend on that). Each
   node's cache holds a fraction ``f`` (25 / 50 / 100 %) of its ``N / M`` share in the static cache.
   *Locality off*: today's sampler with the same per-node budget (every node pins the same random
   ``f N / M`` records, so a consumer hits ``f / M`` of its keys). *Locality on*: the node
   partition and the node-aware assignment. The static cache fills as epochs read its records;
   the table is the steady state (caches filled first): bytes and requests read from storage in
   one epoch (the sampler's disk counters, summed over consumers), the local hit rate next to the
   model (:func:`shardkit.order.locality.expected_hit_fraction`), and records/s (all records /
   the consumers' summed epoch time, the page cache dropped first). Then, from cold caches, the
   storage records of each epoch: how soon the steady state comes with locality on and off.
2. **The hit-rate model** (pure arithmetic, no I/O): the exact expected hit fraction for ``R``
   ranks per node, ``sum_m E[min(X_m, R B)] / (M R B)`` with ``X_m`` hypergeometric, next to the
   mean over many global batches of the real assignment and the approximation
   ``f (1 - E|X - RB| / (2RB))``, ``X ~ Binomial(M R B, 1 / M)`` (the issue's with ``R B`` for ``B``;
   it is exact at full coverage up to binomial vs hypergeometric, and underestimates at ``f < 1``,
   where a node's pinned count ``~ Binomial(M R B, f / M)`` rarely exceeds its room ``R B``).
3. **Peer exchange** (optional design): ``--ranks-per-node`` x 2 processes exchange records with one
   gloo ``all_to_all`` per block, against reading the same records from the dataset files (page
   cache dropped, and warm).
4. **Simulation, 4 to 256 nodes** from the per-record costs measured in part 1 (storage read,
   cache serve, assignment): one epoch of a fixed dataset against shared storage of fixed bandwidth,
   plain rank slicing vs locality with full coverage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import drop_cache, synthetic_dataset
from scipy import stats

from shardkit.formats import open_dataset
from shardkit.formats.reader import Destination
from shardkit.order.locality import NodeLayout, assign_rows, expected_hit_fraction, local_consumer_plan, node_partition
from shardkit.order.schedule import step_group_positions
from shardkit.readers import TieredSampler, epoch_permutation

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- part 1
def _prefill(s: TieredSampler) -> None:
    """Fill the sampler's static cache now, as enough epochs would (the cache fills as epochs read
    its records; a node sees only its share of every epoch, so without locality that takes about
    M ln(1/eps) epochs): the measured epoch is then the steady state."""
    cache = s._cache
    if cache is None:
        return
    cache.attach()
    assert cache.rows is not None
    keys = cache.keys()
    rows = cache.lookup(keys)[1]
    with open_dataset(s.path) as ds:
        ds.payload.read_into(keys, Destination((cache.rows,), np.zeros(keys.size, dtype=np.int64), rows))
    cache.publish(rows)


def run_config(path: Path, nodes: int, ranks: int, batch: int, fraction: float, locality: bool, n: int,
               rec: int) -> dict[str, Any]:  # fmt: skip
    """One configuration at steady state: every consumer's cache filled first, then one epoch's storage
    traffic, hits and time (page cache dropped). Without locality each consumer's cache is its own
    (one rank per node here, so it is the node's); with it the node's consumers share theirs."""
    world = nodes * ranks
    per_node = int(round(fraction * -(-n // nodes)))
    totals = dict(bytes=0, requests=0, storage_records=0, records=0, hits=0, seconds=0.0)
    for c in range(world):
        s = TieredSampler(path, rank=c, world_size=world, batch_size=batch, seed=3, epochs=1, drop_last=True,
                          ram_size=f"{per_node + max(8 * batch, 256)}records", static_cache=f"{max(per_node, 0)}records",
                          locality=locality, nodes=nodes if locality else 1, node_sharing=locality)  # fmt: skip
        try:
            _prefill(s)
            drop_cache(path)
            t0 = time.perf_counter()
            for _ in s:
                pass
            totals["seconds"] += time.perf_counter() - t0
            totals["bytes"] += s.stats.disk.bytes_read
            totals["requests"] += s.stats.disk.read_calls
            totals["storage_records"] += s.stats.disk.records
            totals["records"] += s.stats.records
            totals["hits"] += s.stats.cache.records
        finally:
            s.close()
    model = expected_hit_fraction(n, nodes, ranks, batch, per_node) if locality else per_node / n
    return {"nodes": nodes, "ranks": ranks, "batch": batch, "fraction": fraction, "locality": locality,
            "per_node": per_node, "model_hit": model, **totals,
            "hit_rate": totals["hits"] / max(1, totals["records"]),
            # against the plain loader, which reads every delivered record from storage every epoch
            "vs_plain": totals["storage_records"] / max(1, totals["records"]),
            "records_per_s": totals["records"] / max(1e-9, totals["seconds"])}  # fmt: skip


def warmup(path: Path, nodes: int, batch: int, n: int, epochs: int, locality: bool) -> list[int]:
    """Storage records per epoch from cold caches (full coverage, one rank per node, the nodes'
    consumers run epoch by epoch): how fast the lazily filled caches reach the steady state."""
    per_node = -(-n // nodes)
    samplers = [TieredSampler(path, rank=c, world_size=nodes, batch_size=batch, seed=3, epochs=1, drop_last=True,
                              ram_size=f"{per_node + max(8 * batch, 256)}records", static_cache=f"{per_node}records",
                              locality=locality, nodes=nodes if locality else 1, node_sharing=locality)
                for c in range(nodes)]  # fmt: skip
    reads = []
    try:
        for s in samplers:
            s.hold_shared()
        for epoch in range(epochs):
            before = sum(s.stats.disk.records for s in samplers)
            for s in samplers:
                s.set_epoch(epoch)
                for _ in s:
                    pass
            reads.append(int(sum(s.stats.disk.records for s in samplers) - before))
    finally:
        for s in samplers:
            s.close()
    return reads


def part1(path: Path, n: int, rec: int, batch: int, ranks: int) -> list[dict[str, Any]]:
    rows = []
    for nodes in (1, 2, 4):
        if nodes * ranks * batch > n:
            continue
        for fraction in (0.25, 0.5, 1.0):
            for locality in (False, True):
                row = run_config(path, nodes, ranks, batch, fraction, locality, n, rec)
                rows.append(row)
                print(f"  M={nodes} f={fraction:>4.0%} locality={'on ' if locality else 'off'}: storage "
                      f"{row['storage_records']:6d} records ({row['vs_plain']:6.1%} of plain), {row['bytes'] / 1e6:9.1f} "
                      f"MB in {row['requests']:6d} requests, hits {row['hit_rate']:.3f} (model "
                      f"{row['model_hit']:.3f}), {row['records_per_s']:,.0f} records/s", flush=True)  # fmt: skip
    return rows


def part1_warmup(path: Path, n: int, batch: int, quick: bool) -> dict[str, list[int]]:
    nodes = 4 if 4 * batch <= n else 2
    epochs = 4 if quick else 6
    out = {}
    for locality in (False, True):
        reads = warmup(path, nodes, batch, n, epochs, locality)
        out["on" if locality else "off"] = reads
        print(f"  M={nodes}, full coverage, cold caches, locality {'on ' if locality else 'off'}: storage records "
              f"per epoch {reads}", flush=True)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- part 2
def measured_hits(n: int, nodes: int, ranks: int, batch: int, per_node: int, epochs: int) -> tuple[float, float]:
    """Mean and standard error of the hit fraction per global batch of the real assignment."""
    lay = NodeLayout(nodes * ranks, 1, nodes)
    part = node_partition(5, n, nodes, per_node)
    fractions: list[float] = []
    for e in range(epochs):
        pi = epoch_permutation(17, e, n)
        rows = step_group_positions(n, 0, batch, lay.consumers, 1, 0, drop_last=True)
        got = assign_rows(part.holders(pi[rows.full]), np.full(lay.ranks, batch), lay.member_nodes())
        fractions += got.hit.mean(axis=1).tolist()
    f = np.asarray(fractions)
    return float(f.mean()), float(f.std(ddof=1) / np.sqrt(f.size)) if f.size > 1 else 0.0


def issue_approximation(nodes: int, ranks: int, batch: int, fraction: float) -> float:
    """The issue's ``f (1 - E|X - B| / (2B))``, ``X ~ Binomial(B W, 1 / M)``, with a node's room
    ``R B`` in place of ``B`` (literally, with ``B``, it holds only for one rank per node)."""
    s, room = nodes * ranks * batch, ranks * batch
    x = np.arange(s + 1)
    pmf = stats.binom(s, 1 / nodes).pmf(x)
    return fraction * (1 - float(np.abs(x - room) @ pmf) / (2 * room))


def part2(quick: bool) -> list[dict[str, Any]]:
    rows = []
    grid = [(m, r, b) for m in (2, 4, 16, 64) for r in (1, 8) for b in (32, 256)]
    if quick:
        grid = [(2, 1, 32), (4, 2, 32), (16, 1, 256)]
    for m, r, b in grid:
        n = max(8 * m * r * b, 4096)
        for fraction in (0.25, 0.5, 1.0):
            per_node = int(fraction * n / m)
            model = expected_hit_fraction(n, m, r, b, per_node)
            mean, se = measured_hits(n, m, r, b, per_node, epochs=2 if quick else 6)
            rows.append({"nodes": m, "ranks": r, "batch": b, "fraction": fraction, "model": model, "measured": mean,
                         "se": se, "approx": issue_approximation(m, r, b, fraction)})  # fmt: skip
    for row in rows:
        print(f"  M={row['nodes']:3d} R={row['ranks']} B={row['batch']:3d} f={row['fraction']:.0%}: model "
              f"{row['model']:.4f}  measured {row['measured']:.4f} +- {row['se']:.4f}  issue approx "
              f"{row['approx']:.4f}", flush=True)  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- part 3
def _exchange_worker(rank: int, world: int, init: str, nbytes: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        send = torch.ones(nbytes, dtype=torch.uint8)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            dist.all_to_all_single(recv, send)
        seconds = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds}))
    finally:
        dist.destroy_process_group()


def part3(path: Path, n: int, rec: int, world: int, quick: bool) -> dict[str, Any]:
    """Records moved between ``world`` processes by gloo vs read from the dataset files."""
    import torch.multiprocessing as mp

    per_peer = max(1, (64 if quick else 256) // world)  # records each process sends to each other one
    nbytes = per_peer * world * rec
    rounds = 3 if quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        mp.start_processes(_exchange_worker, args=(world, f"file://{tmp}/store", nbytes, rounds, out), nprocs=world,
                           start_method="spawn")  # fmt: skip
        exchange = json.loads(Path(out).read_text())["seconds"]
    moved = nbytes * world * rounds  # bytes received by all processes together
    from shardkit.formats import open_dataset

    keys = np.random.default_rng(0).choice(n, size=min(n, per_peer * world), replace=False)
    result = {"exchange_GBps": moved / exchange / 1e9}
    with open_dataset(path) as ds:
        for label, cold in (("storage_cold_GBps", True), ("storage_warm_GBps", False)):
            t = 0.0
            for _ in range(rounds):
                if cold:
                    drop_cache(path)
                t0 = time.perf_counter()
                ds.payload.read(keys)
                t += time.perf_counter() - t0
            result[label] = keys.size * rec * rounds / t / 1e9
    result["exchange_per_process_GBps"] = result["exchange_GBps"] / world
    print(f"  gloo all_to_all among {world} processes: {result['exchange_GBps']:.2f} GB/s received in total "
          f"({result['exchange_per_process_GBps']:.2f} per process); reading the same records in one process: "
          f"{result['storage_cold_GBps']:.2f} GB/s cold, {result['storage_warm_GBps']:.2f} GB/s warm", flush=True)  # fmt: skip
    return result


def exchange_saving(rows: list[dict[str, Any]], exchange: dict[str, Any], rec: int) -> float | None:
    """Fraction of a full-coverage epoch's time peer exchange could save: every miss is then an
    overflow key another node caches, received at the exchange's per-process rate instead of read
    from cold storage; the rest of the epoch (hits) is unchanged."""
    full = [r for r in rows if r["locality"] and r["fraction"] == 1.0 and r["nodes"] > 1]
    if not full:
        return None
    row = max(full, key=lambda r: r["nodes"])
    misses = row["records"] - row["hits"]
    saved = misses * rec * (1 / (exchange["storage_cold_GBps"] * 1e9) - 1 / (exchange["exchange_per_process_GBps"] * 1e9))
    share = saved / max(1e-9, row["seconds"])
    print(f"  M={row['nodes']}, full coverage: {misses} misses of {row['records']} records; exchanging them instead "
          f"of reading them cold would save {saved:.3f} s of {row['seconds']:.2f} s ({share:.1%})", flush=True)  # fmt: skip
    return share


# ---------------------------------------------------------------------------------------------- part 4
def assignment_cost(quick: bool) -> float:
    """Seconds per key a rank spends computing its node-aware plan (it computes its whole group's)."""
    n, nodes, ranks, batch = (8192, 4, 2, 64) if quick else (65536, 16, 4, 256)
    lay = NodeLayout(nodes * ranks, 1, nodes)
    part = node_partition(1, n, nodes, n // nodes)
    pi = epoch_permutation(1, 0, n)
    t0 = time.perf_counter()
    local_consumer_plan(pi, 0, batch, 0, lay, part, drop_last=True)
    return (time.perf_counter() - t0) / n


def part4(rows: list[dict[str, Any]], rec: int, quick: bool, batch: int, ranks: int) -> list[dict[str, Any]]:
    """Strong scaling of one epoch of a fixed dataset over M nodes against one shared storage.

    Costs measured here: the storage's bandwidth is what one consumer read per second in part 1
    without any cache (locality off, smallest budget: nearly every record from storage); a rank
    serves cached records at the rate of the full-coverage locality run's hits (RAM copies; a
    node's ``R`` ranks in parallel); every rank computes the assignment of its step group
    (``assignment_cost`` per key of the epoch).
    A node's client bandwidth is taken equal to the storage's (one node alone could saturate it).
    """
    plain = [r for r in rows if not r["locality"] and r["nodes"] == 1]
    full = [r for r in rows if r["locality"] and r["fraction"] == 1.0]
    if not plain or not full:
        return []
    worst = min(plain, key=lambda r: r["per_node"])
    storage_bw = worst["bytes"] / max(1e-9, worst["seconds"])  # bytes/s of the shared storage
    best = max(full, key=lambda r: r["hit_rate"])
    cache_rate = best["records"] / max(1e-9, best["seconds"])  # records/s a node serves (mostly hits)
    per_key = assignment_cost(quick)
    n = 1_281_167  # ImageNet-1k's training set: a fixed dataset
    data = n * rec
    out = []
    for m in (4, 8, 16, 32, 64, 128, 256):
        miss = 1 - expected_hit_fraction(n, m, ranks, batch, -(-n // m))
        t_plain = max(data / storage_bw, (data / m) / storage_bw)
        t_local = max(miss * data / storage_bw, (n / (m * ranks)) / cache_rate, n * per_key)
        out.append({"nodes": m, "miss": miss, "plain_s": t_plain, "locality_s": t_local, "speedup": t_plain / t_local,
                    "storage_share": miss})  # fmt: skip
        print(f"  M={m:3d}: miss {miss:.4f}, epoch plain {t_plain:8.1f} s, locality {t_local:7.2f} s, "
              f"speedup {t_plain / t_local:6.1f}x (storage bytes {miss:.1%} of plain)", flush=True)  # fmt: skip
    print(f"  costs: storage {storage_bw / 1e9:.2f} GB/s shared, cache {cache_rate:,.0f} records/s per rank, "
          f"assignment {per_key * 1e9:.0f} ns per key per rank", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (1,024 small records)")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None, help="per-rank batch B (default 256; 32 with --quick)")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args()
    quick = args.quick
    shape = (32, 32, 3) if quick else (224, 224, 3)
    n = args.records or (1024 if quick else 8192)
    batch = args.batch_size or (32 if quick else 256)
    data = HERE / "_data" / ("multinode-bench-quick" if quick else "multinode-bench")
    synthetic_dataset(data, n, shape)
    rec = int(np.prod(shape))
    print(f"# multinode benchmark: {n} records of {shape} ({rec} B), B={batch}, R={args.ranks_per_node}, "
          f"{platform.node()}, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    print("1. storage per epoch at steady state, locality off vs on")
    rows = part1(data, n, rec, batch, args.ranks_per_node)
    fill = part1_warmup(data, n, batch, quick)
    print("2. hit-rate model vs the assignment")
    model = part2(quick)
    print("3. peer exchange vs storage")
    exchange = part3(data, n, rec, max(2, 2 * args.ranks_per_node), quick)
    exchange["saving"] = exchange_saving(rows, exchange, rec)
    print("4. simulation, 4-256 nodes (ImageNet-1k size, records of this run's size)")
    sim = part4(rows, rec, quick, batch, args.ranks_per_node)
    if args.json is not None:
        args.json.write_text(json.dumps({"measured": rows, "warmup": fill, "model": model, "exchange": exchange,
                                         "simulation": sim}, indent=1, default=_plain))  # fmt: skip


def _plain(value: object) -> object:
    """numpy scalars in the results as JSON numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    main()
