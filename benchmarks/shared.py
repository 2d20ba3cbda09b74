"""Benchmark of the shared tier stack: k concurrent jobs sharing one server vs k independent samplers.

Run: ``python benchmarks/shared.py`` (generates ``benchmarks/_data/shared-bench`` once: about 1.5 GiB
of 224x224x3 uint8 records). For k = 1, 2, 4 consumer processes it runs

* **independent**: k processes, each a :class:`~shardkit.readers.TieredSampler` with its own seed;
* **shared**: one :func:`~shardkit.readers.serve` process (``wait_for=k``) and k processes each a
  :class:`~shardkit.readers.SharedSampler` with its own ``job_seed``,

every job reading ``--epochs`` whole epochs and touching one byte per record. By default there is no
compute (jobs are only as fast as the data and the CPU copying it); ``--step-ms`` adds a sleep per
batch, a training step on an accelerator (time passes, the CPU stays free). Before each configuration the page
cache is dropped (``posix_fadvise(DONTNEED)`` on every shard file). With ``--evict`` (second
table) a thread keeps dropping it every 0.2 s during the run, which emulates a dataset much larger
than RAM: then concurrent independent jobs cannot serve each other from the page cache.

Reported per configuration: bytes requested from the dataset files (the reader's counters: every
sampler's disk tier, or the server's), device bytes read system-wide (``/proc/diskstats`` through
psutil; noisy on a shared machine), and records/s per job (records / time from its first batch
request to its last batch), and the Spearman correlation between jobs 1 and 2 of each item's position in
an epoch (about 0 for independent jobs; ``(N^2 - K^2) / (N^2 - 1)`` for jobs sharing a server whose
ring holds reservoirs of ``K`` records: the cost of sharing, see docs/sharing.md).

``--quick`` runs a small configuration (600 records, jobs 1 and 2, one epoch) as a smoke test.
``--before TREE --rounds N`` runs every configuration with this tree's shardkit and with the one in
``TREE`` (e.g. a checkout of an earlier version), alternating which goes first, ``N`` rounds, each run
in its own process, and prints the medians side by side with their spread (after / before per row).
``--server-tiers ram,ssd`` gives the server an SSD tier (``--ssd-size``, in a private directory under
``/dev/shm`` or ``--ssd-dir``); it is a run of this tree only when the other tree's server had no SSD tier.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import drop_cache, synthetic_dataset
from scipy import stats

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "shared-bench"
QUICK_DATA = HERE / "_data" / "shared-bench-quick"
SHAPE = (224, 224, 3)
REC = int(np.prod(SHAPE))

class Evictor:
    """Drops the dataset from the page cache every ``period`` seconds (dataset >> RAM emulation)."""

    def __init__(self, path: Path, period: float = 0.2) -> None:
        self.path, self.period = path, period
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            drop_cache(self.path)

    def __enter__(self) -> Evictor:
        self.t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.t.join()


def _consume(sampler: Any, q: Any, start: Any, step: float) -> None:
    start.wait()
    touched = 0
    keys = []
    for batch in sampler:
        touched += int(batch["image"][:, 0, 0, 0].sum())  # touch every record
        keys.append(batch["key"])
        if step:
            time.sleep(step)  # a training step on an accelerator: time passes, the CPU is free
    st = sampler.stats
    q.put({"records": st.records, "elapsed": st.elapsed, "disk": st.disk.bytes_read, "stall": st.stall_seconds,
           "seed": seed_of(sampler), "keys": np.concatenate(keys)})


def seed_of(sampler: Any) -> int:
    return int(getattr(sampler, "job_seed", getattr(sampler, "seed", -1)))


def independent_job(path: str, seed: int, epochs: int, ram: str, batch: int, step: float, q: Any, start: Any) -> None:
    from shardkit.readers import TieredSampler

    s = TieredSampler(path, ram_size=ram, batch_size=batch, epochs=epochs, seed=seed)
    _consume(s, q, start, step)


def shared_job(name: str, seed: int, epochs: int, batch: int, step: float, q: Any, start: Any) -> None:
    from shardkit.readers import SharedSampler

    s = SharedSampler(name, job_seed=seed, batch_size=batch, epochs=epochs, connect_timeout=60)
    _consume(s, q, start, step)


def server_proc(path: str, name: str, k: int, epochs: int, ram: str, q: Any, tiers: dict[str, Any]) -> None:
    from shardkit.readers import serve

    srv = serve(path, name=name, ram_size=ram, slots=3, epochs=epochs, wait_for=k, seed=99, **tiers)
    q.put({"disk": srv.stats.disk.bytes_read, "epochs": srv.epochs_served, "slot_records": srv.slot_records})


def device_read_bytes() -> int:
    c = psutil.disk_io_counters()
    return int(c.read_bytes) if c is not None else 0


def run_config(path: Path, mode: str, k: int, epochs: int, ram: str, batch: int, evict: bool,
               step: float = 0.0, tiers: dict[str, Any] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    start = ctx.Event()
    drop_cache(path)
    procs = []
    server = None
    sq: Any = ctx.Queue()
    name = f"bench-{os.getpid()}-{k}"
    if mode == "shared":
        server = ctx.Process(target=server_proc, args=(str(path), name, k, epochs, ram, sq, tiers or {}))
        server.start()
        for j in range(k):
            procs.append(ctx.Process(target=shared_job, args=(name, j + 1, epochs, batch, step, q, start)))
    else:
        for j in range(k):
            procs.append(ctx.Process(target=independent_job, args=(str(path), j + 1, epochs, ram, batch, step, q, start)))
    for p in procs:
        p.start()
    time.sleep(0.5)  # let them import and attach; timing starts at each job's first batch request
    dev0 = device_read_bytes()
    t0 = time.perf_counter()
    if evict:
        with Evictor(path):
            start.set()
            results = [q.get(timeout=1800) for _ in procs]
    else:
        start.set()
        results = [q.get(timeout=1800) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    slot_records = None
    if server is not None:
        srv = sq.get(timeout=120)
        server.join(60)
        requested = srv["disk"]
        slot_records = srv["slot_records"]
    else:
        requested = sum(r["disk"] for r in results)
    dev = device_read_bytes() - dev0
    rates = [r["records"] / r["elapsed"] for r in results]
    return {"mode": mode, "k": k, "requested": requested, "device": dev, "rates": rates, "wall": wall,
            "records": sum(r["records"] for r in results), "spearman": position_spearman(results, epochs),
            "slot_records": slot_records}


def position_spearman(results: list[dict[str, Any]], epochs: int) -> float | None:
    """Mean over epochs of the Spearman correlation of item positions between jobs 1 and 2 (None for one job)."""
    by_seed = {r["seed"]: r["keys"] for r in results}
    if 1 not in by_seed or 2 not in by_seed:
        return None
    a, b = (by_seed[s].reshape(epochs, -1) for s in (1, 2))
    return float(np.mean([stats.spearmanr(np.argsort(a[e]), np.argsort(b[e])).statistic for e in range(epochs)]))


def table(rows: list[dict[str, Any]], n: int, epochs: int) -> str:
    single = next(r for r in rows if r["mode"] == "independent" and r["k"] == 1)
    base_rate = float(np.mean(single["rates"]))
    by = {(r["mode"], r["k"]): r for r in rows}
    out = ["| jobs | mode | requested from dataset | vs independent | device reads (noisy) | records/s per job (mean, min) "
           "| vs 1 job | position Spearman, jobs 1-2 |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ind = by.get(("independent", r["k"]))
        ratio = r["requested"] / ind["requested"] if ind else float("nan")
        mean, lo = float(np.mean(r["rates"])), float(np.min(r["rates"]))
        out.append(
            f"| {r['k']} | {r['mode']} | {r['requested'] / 1e9:.2f} GB ({r['requested'] / (n * REC * epochs):.2f} passes/epoch) | "
            f"{ratio:.3f} | {r['device'] / 1e9:.2f} GB | {mean:,.0f} / {lo:,.0f} | {mean / base_rate:.2f}x | "
            f"{spearman_cell(r, n)} |"
        )
    return "\n".join(out)


def spearman_cell(r: dict[str, Any], n: int) -> str:
    if r["spearman"] is None:
        return "-"
    if r["slot_records"] is None:
        return f"{r['spearman']:.4f}"
    k = r["slot_records"]
    return f"{r['spearman']:.4f} (K = {k}: (N²-K²)/(N²-1) = {(n * n - k * k) / (n * n - 1):.4f})"


def server_tiers(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    if args.server_tiers == "ram":
        return {}
    return {"tiers": args.server_tiers, "ssd_size": args.ssd_size, "ssd_dir": args.ssd_dir or scratch}


def run_all(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration of one pass (independent and shared for each job count), printed as it ends."""
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as scratch:
        for evict in ([False, True] if args.evict else [False]):
            for k in [int(x) for x in args.jobs.split(",")]:
                for mode in ("independent", "shared"):
                    r = run_config(path, mode, k, args.epochs, args.ram_size, args.batch, evict, args.step_ms / 1e3,
                                   server_tiers(args, scratch) if mode == "shared" else None)
                    r["evict"] = evict
                    rows.append(r)
                    print(f"  {mode:<11} k={k}: {r['requested'] / 1e9:.2f} GB requested, {r['device'] / 1e9:.2f} GB "
                          f"device, rates {[round(x) for x in r['rates']]}, wall {r['wall']:.1f} s", file=sys.stderr,
                          flush=True)
    return rows


def compare(path: Path, args: argparse.Namespace) -> None:
    """``--before``: each round runs this tree and ``args.before`` in fresh processes, alternating the order."""
    trees = {"after": str(HERE.parent), "before": args.before}
    # Every argument but --before (either spelling), so that each child runs one tree, not a comparison.
    passthrough = [a for a in sys.argv[1:] if a not in ("--before", args.before) and not a.startswith("--before=")]
    runs: dict[str, list[list[dict[str, Any]]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for t in (("after", "before") if r % 2 == 0 else ("before", "after")):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([trees[t], str(HERE)])}
            print(f"round {r + 1}: {t}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, *passthrough, "--rounds", "1", "--json"], env=env,
                                 check=True, stdout=subprocess.PIPE, text=True, timeout=7200)
            runs[t].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.rounds} rounds, medians (min-max) of records/s per job (mean over the round's jobs); "
          "requested bytes per configuration")
    print("| evicted | jobs | mode | before records/s | after records/s | after / before | requested before | "
          "requested after |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for i, row in enumerate(runs["after"][0]):
        cells = {}
        for t in trees:
            rates = [float(np.mean(rs[i]["rates"])) for rs in runs[t]]
            cells[t] = (statistics.median(rates), min(rates), max(rates), statistics.median(rs[i]["requested"]
                                                                                            for rs in runs[t]))
        b, a = cells["before"], cells["after"]
        print(f"| {'yes' if row['evict'] else 'no'} | {row['k']} | {row['mode']} | {b[0]:,.0f} ({b[1]:,.0f}-{b[2]:,.0f}) "
              f"| {a[0]:,.0f} ({a[1]:,.0f}-{a[2]:,.0f}) | {a[0] / b[0]:.2f} | {b[3] / 1e9:.2f} GB | {a[3] / 1e9:.2f} GB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=10_000, help="dataset size (10,000 x 150 KB = 1.5 GB)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ram-size", default="384MiB", help="RAM tier of each independent sampler = the server's ring")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--jobs", default="1,2,4")
    ap.add_argument("--evict", action="store_true", help="also run with continuous page-cache eviction")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="sleep per batch in every job: an accelerator step (time passes, the CPU is free)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 600 records, 24MiB ring, jobs 1,2, one epoch")
    ap.add_argument("--before", help="a shardkit tree to compare with, configuration by configuration")
    ap.add_argument("--rounds", type=int, default=1, help="with --before: rounds (medians and spread reported)")
    ap.add_argument("--server-tiers", default="ram", help="the server's tiers: ram or ram,ssd")
    ap.add_argument("--ssd-size", default="768MiB", help="with --server-tiers ram,ssd: the server's SSD tier")
    ap.add_argument("--ssd-dir", help="with --server-tiers ram,ssd: where (default a private directory in /dev/shm)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.records, args.epochs, args.ram_size, args.jobs = 600, 1, "24MiB", "1,2"
    path = synthetic_dataset(QUICK_DATA if args.quick else DATA, args.records)
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"load {os.getloadavg()}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"dataset: {args.records} records x {REC} B = {args.records * REC / 1e9:.2f} GB; epochs per job {args.epochs}; "
          f"ram {args.ram_size}; batch {args.batch}; step {args.step_ms} ms per batch")
    if args.before:
        compare(path, args)
        return
    rows = run_all(path, args)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "keys"} for r in rows]))
        return
    for evict in ([False, True] if args.evict else [False]):
        print("page cache evicted every 0.2 s (dataset >> RAM emulation)" if evict else "page cache dropped before each configuration")
        print(table([r for r in rows if r["evict"] == evict], args.records, args.epochs))
        print()

if __name__ == "__main__":
    main()
