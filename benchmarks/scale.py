"""Scale in records (issue #34): the tiered sampler on many small records against a plain numpy loop.

Run: ``python benchmarks/scale.py [--sizes 1e6,1e7] [--rounds N] [--before TREE] [--work DIR] [--ratio-of 1e8]``

Datasets of ``N`` records of 32 bytes (uint8, no other field, ``records_per_shard`` 2^20) are written
once under ``--work`` (one directory per ``N``) and reused. For each size, each round runs in fresh
processes, files in the page cache (one warm-up read of every shard first):

* **sampler**: ``TieredSampler`` in its default exact ``epoch`` order, ``ram_size`` 256 MiB, batch 4,096,
  one epoch;
* **numpy**: the naive loop the sampler must beat: one ``np.memmap`` per shard, the same kind of uniform
  permutation, each batch's keys sorted and fancy-indexed shard by shard into the batch.

Reported per configuration (medians over ``--rounds``): records/s over the epoch (construction
excluded), construction + first batch, CPU time of the whole process per record (all threads,
construction included: steadier than wall time on a loaded machine), the process's CPU time up to
the first batch (background threads included), peak RSS (``VmHWM``) and PSS (``/proc/self/smaps_rollup``,
sampled during the epoch and at its end), both including the interpreter and imports (``base`` is the
RSS before the sampler is built). ``--before TREE`` runs the sampler of another shardkit tree (e.g.
``git archive e062d53 shardkit | tar -x -C /tmp/scale-before``) in the same run, as
``benchmarks/sample.py`` does.

At ``ram_size`` 256 MiB a larger dataset is also a larger dataset ÷ budget ratio: more blocks an
epoch, each reading the whole dataset, so the main table mixes the two. ``--ratio-of M`` adds a
second table that keeps the ratio: every size runs again with the ``ram_size`` at which the sampler
plans as many blocks an epoch as ``M`` records at 256 MiB (:func:`matched_ram`), and reports the
blocks, the seconds per block (a pass over the dataset) and the CPU per record: whether the cost
per record at a fixed ratio grows with the record count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
AFTER = str(HERE.parent)
REC = 32
SHARD = 1 << 20
BATCH = 4096
RAM = 256 << 20
#: Records written per call of the writer while generating a dataset.
_WRITE_CHUNK = 1 << 18


# ---------------------------------------------------------------------------------------------- data
def dataset(work: Path, n: int) -> Path:
    """``n`` records of :data:`REC` bytes under ``work`` (written once; record ``i`` holds ``i`` as
    little-endian uint64 in its first 8 bytes, so a wrong key is visible)."""
    from shardkit.formats import DatasetWriter, FieldSpec, open_dataset

    path = work / f"scale-{n}"
    if (path / "zarr.json").exists():
        try:
            with open_dataset(path) as ds:
                if ds.num_records == n:
                    return path
        except Exception:  # a write cut short: write it again
            pass
    if path.exists():
        shutil.rmtree(path)
    need = n * REC * 1.1 + (64 << 20)
    free = shutil.disk_usage(work).free
    if free < need:
        sys.exit(f"{work}: {n} records need about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    t0 = time.perf_counter()
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec((REC,), "uint8"),
                       records_per_shard=SHARD, durable=False) as w:  # fmt: skip
        for a in range(0, n, _WRITE_CHUNK):
            k = min(_WRITE_CHUNK, n - a)
            rows = np.zeros((k, REC), dtype=np.uint8)
            rows[:, :8] = np.arange(a, a + k, dtype="<u8").view(np.uint8).reshape(k, 8)
            w.write({"image": rows})
    print(f"wrote {path} ({n} records) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def warm(path: Path) -> None:
    """Read every file of the dataset once, so the runs find it in the page cache."""
    buf = bytearray(8 << 20)
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


# ---------------------------------------------------------------------------------------------- workers
def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _pss() -> int:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _PssProbe:
    """The largest PSS seen, sampled at most every ``every`` seconds (reading smaps_rollup costs)."""

    def __init__(self, every: float = 0.25) -> None:
        self.every, self.peak, self._next = every, _pss(), time.perf_counter() + every

    def poll(self) -> None:
        now = time.perf_counter()
        if now >= self._next:
            self.peak, self._next = max(self.peak, _pss()), now + self.every


def blocks_per_epoch(n: int, ram: int) -> int:
    """Blocks an epoch of ``n`` records needs at ``ram`` bytes without a static cache (the largest
    block's count: the ramp of the first blocks adds a few)."""
    from shardkit.readers import SamplerOptions

    return -(-n // SamplerOptions(ram_size=ram, batch_size=BATCH, static_cache="off").tier_sizes(REC, n).ram_block)


def matched_ram(n: int, reference: int) -> int:
    """The smallest ``ram_size`` (whole KiB, at most :data:`RAM`) at which ``n`` records need at most
    as many blocks an epoch as ``reference`` records at :data:`RAM` (as many as blocks of whole
    batches allow: 41 for 42 at 10^6): the same dataset ÷ budget ratio, counted in
    what it costs (passes over the dataset), not in bytes (the pool of batches in flight is a fixed
    share of the budget). Without a static cache: a small budget would otherwise pin a few records
    and take the unstaged plan, which 10^8 records at 256 MiB do not."""
    want = blocks_per_epoch(reference, RAM)
    lo, hi = 1, RAM >> 10  # KiB; fewer blocks as the budget grows
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks_per_epoch(n, mid << 10) > want:
            lo = mid + 1
        else:
            hi = mid
    return lo << 10


def sampler_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One epoch of the tiered sampler in this fresh process (``ram_size`` ``cfg["ram"]``, default :data:`RAM`)."""
    import shardkit
    from shardkit.readers import TieredSampler

    assert Path(shardkit.__file__).is_relative_to(cfg["tree"]), shardkit.__file__
    base = _status("VmRSS")
    probe = _PssProbe()
    t0, c0 = time.perf_counter(), time.process_time()
    options = {"ram_size": int(cfg.get("ram", RAM)), **({"static_cache": cfg["static_cache"]} if "static_cache" in cfg else {})}
    s = TieredSampler(cfg["path"], batch_size=BATCH, epochs=1, seed=int(cfg["seed"]), **options)
    built = time.perf_counter() - t0
    first, first_cpu, records, check = None, 0.0, 0, 0
    t1 = time.perf_counter()
    for b in s:
        if first is None:
            first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
            t1 = time.perf_counter()  # the epoch's rate counts from the first batch on
        keys = b["key"]
        records += int(keys.shape[0])
        check += int(np.count_nonzero(b["image"][:, :8].copy().view("<u8").reshape(-1) != keys))
        probe.poll()
        del b
    dt, cpu = time.perf_counter() - t1, time.process_time() - c0
    probe.poll()
    s.close()
    return {"records": records, "seconds": dt, "built": built, "first": first or 0.0, "wrong": check, "cpu": cpu,
            "first_cpu": first_cpu, "peak_rss": _status("VmHWM"), "pss": max(probe.peak, _pss()),
            "base_rss": base, "ram_block": s.memory_plan.ram_block}  # fmt: skip


def numpy_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """The naive loop: a permutation, each batch's keys sorted, fancy-indexed from per-shard memmaps."""
    from shardkit.formats import open_dataset

    base = _status("VmRSS")
    probe = _PssProbe()
    t0, c0 = time.perf_counter(), time.process_time()
    with open_dataset(cfg["path"]) as ds:
        n, s = ds.num_records, ds.payload.records_per_shard
        maps = [ds.payload.memmap(i) for i in range(len(ds.payload.shards))]
    order = np.random.default_rng(int(cfg["seed"])).permutation(n)
    out = np.empty((BATCH, REC), dtype=np.uint8)
    first, first_cpu, records, wrong = None, 0.0, 0, 0
    t1 = time.perf_counter()
    for a in range(0, n, BATCH):
        keys = np.sort(order[a : a + BATCH])
        k = keys.size
        shard = keys // s
        cuts = np.flatnonzero(np.diff(shard)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), k]):
            i = int(shard[lo])
            out[lo:hi] = maps[i][keys[lo:hi] - i * s]
        if first is None:
            first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
            t1 = time.perf_counter()
        records += k
        wrong += int(np.count_nonzero(out[:k, :8].copy().view("<u8").reshape(-1) != keys))
        probe.poll()
    dt, cpu = time.perf_counter() - t1, time.process_time() - c0
    probe.poll()
    return {"records": records, "seconds": dt, "built": 0.0, "first": first or 0.0, "wrong": wrong, "cpu": cpu,
            "first_cpu": first_cpu, "peak_rss": _status("VmHWM"), "pss": max(probe.peak, _pss()),
            "base_rss": base}  # fmt: skip


def run(kind: str, tree: str, path: Path, seed: int, **options: Any) -> dict[str, Any]:
    """One worker in a new process whose ``shardkit`` is the one in ``tree`` (``options``: the
    sampler's ``ram`` and ``static_cache``)."""
    env = {**os.environ, "PYTHONPATH": tree}
    cfg = {"kind": kind, "tree": tree, "path": str(path), "seed": seed, **options}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env, check=True,
                         capture_output=True, text=True, timeout=7200)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------------- report
def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def report(sizes: list[int], work: Path, trees: dict[str, str], rounds: int,
           measured: dict[int, tuple[float, float]] | None = None) -> list[str]:
    """The main table; ``measured`` gets the after tree's median (base RSS, peak RSS) per size."""
    lines = [
        f"{REC}-byte records, records_per_shard {SHARD}, ram_size {RAM >> 20} MiB, batch {BATCH}, one epoch, "
        f"files in the page cache; medians of {rounds} round(s). RSS/PSS in MiB include the interpreter "
        "(base: RSS before the sampler).",
        "",
        "| records | run | records/s | construct + first batch | CPU to first batch | epoch s | CPU µs/record | peak RSS "
        "| peak PSS | base RSS | per record above base |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        path = dataset(work, n)
        warm(path)
        configs = [(f"sampler ({name})", "sampler", tree) for name, tree in trees.items()] + [("numpy memmap", "numpy", AFTER)]
        results: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
        for r in range(rounds):
            for label, kind, tree in configs:
                res = run(kind, tree, path, seed=r)
                if res["wrong"] or res["records"] != n:
                    raise SystemExit(f"{label}: {res['wrong']} wrong records, {res['records']} of {n} delivered")
                results[label].append(res)
        for label, _, _ in configs:
            rs = results[label]

            def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
                return statistics.median(float(x.get(key, 0.0)) for x in rs)

            rate = statistics.median(x["records"] / x["seconds"] for x in rs)
            extra = med("peak_rss") - med("base_rss")
            if measured is not None and label == "sampler (after)":
                measured[n] = (med("base_rss"), med("peak_rss"))
            lines.append(
                f"| {n:.0e} | {label} | {rate / 1e6:.2f} M | {med('first'):.2f} s | {med('first_cpu'):.2f} s | "
                f"{med('seconds'):.1f} | "
                f"{med('cpu') / n * 1e6:.2f} | "
                f"{_mib(med('peak_rss'))} | {_mib(med('pss'))} | {_mib(med('base_rss'))} | {extra / n:.1f} B |"
            )
    return lines


def model_rss(n: int, base: float) -> float:
    """Peak RSS the memory rule allows a consumer (docs/design.md §4, *Memory per record*): the
    interpreter, ``ram_size`` + 15%, and 8 B a record of exact permutation up to
    ``EXACT_PERMUTATION_LIMIT`` records (nothing per record with the Feistel order past it)."""
    from shardkit.order.schedule import EXACT_PERMUTATION_LIMIT

    return base + RAM * 1.15 + (8 * n if n <= EXACT_PERMUTATION_LIMIT else 0)


def model_report(measured: dict[int, tuple[float, float]]) -> list[str]:
    """The per-record byte model against the measured sizes, and extrapolated to 10^9 and 10^10."""
    base = statistics.median(b for b, _ in measured.values()) if measured else 45 * 2**20
    lines = ["Memory model: peak RSS <= interpreter + ram_size x 1.15 + 8 B a record of exact permutation "
             "(up to EXACT_PERMUTATION_LIMIT records; the Feistel order past it, 0 B a record).", "",
             "| records | model MiB | measured peak RSS MiB | measured ÷ model |", "|---|---|---|---|"]
    for n, (b, peak) in sorted(measured.items()):
        lines.append(f"| {n:.0e} | {_mib(model_rss(n, b))} | {_mib(peak)} | {peak / model_rss(n, b):.2f} |")
    for n in (10**9, 10**10):
        lines.append(f"| {n:.0e} | {_mib(model_rss(n, base))} (Feistel; the exact order would add "
                     f"{8 * n / 2**30:,.0f} GiB, node-shared) | | |")
    return lines


def ratio_report(sizes: list[int], work: Path, trees: dict[str, str], rounds: int, reference: int) -> list[str]:
    """The sampler at the same dataset ÷ budget ratio as ``reference`` records at :data:`RAM`
    (:func:`matched_ram`): per-record cost against the record count, the ratio held."""
    want = blocks_per_epoch(reference, RAM)
    lines = [
        f"Same dataset ÷ budget ratio as {reference:.0e} records at ram_size {RAM >> 20} MiB ({want} blocks an "
        f"epoch, each a pass over the dataset), static_cache off; medians of {rounds} round(s).",
        "",
        "| records | run | ram_size MiB | blocks | records/s | epoch s | s per block | CPU µs/record |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        path = dataset(work, n)
        warm(path)
        ram = RAM if n == reference else matched_ram(n, reference)
        blocks = blocks_per_epoch(n, ram)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for r in range(rounds):
            for name, tree in trees.items():
                res = run("sampler", tree, path, seed=r, ram=ram, static_cache="off")
                if res["wrong"] or res["records"] != n:
                    raise SystemExit(f"sampler ({name}): {res['wrong']} wrong records, {res['records']} of {n} delivered")
                results[name].append(res)
        for name, rs in results.items():
            rate = statistics.median(x["records"] / x["seconds"] for x in rs)
            sec = statistics.median(x["seconds"] for x in rs)
            cpu = statistics.median(x["cpu"] for x in rs)
            lines.append(f"| {n:.0e} | sampler ({name}) | {ram / 2**20:,.1f} | {blocks} | {rate / 1e6:.2f} M | {sec:.1f} | "
                         f"{sec / blocks:.3f} | {cpu / n * 1e6:.2f} |")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7", help="comma-separated record counts (1e8: 3.2 GB of data)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every configuration; report medians")
    ap.add_argument("--before", help="a shardkit tree to compare with (its sampler runs the same configurations)")
    ap.add_argument("--work", type=Path, default=HERE / "_data", help="where the datasets are written and kept")
    ap.add_argument("--ratio-of", type=float, help="also run every size at the dataset ÷ budget ratio of this many records at 256 MiB")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        print(json.dumps(sampler_worker(cfg) if cfg["kind"] == "sampler" else numpy_worker(cfg)))
        return
    sizes = [int(float(s)) for s in args.sizes.split(",") if s]
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {"after": AFTER, **({"before": str(Path(args.before).resolve())} if args.before else {})}
    measured: dict[int, tuple[float, float]] = {}
    print("\n".join(report(sizes, args.work, trees, args.rounds, measured)), flush=True)
    print()
    print("\n".join(model_report(measured)), flush=True)
    if args.ratio_of:
        print()
        print("\n".join(ratio_report(sizes, args.work, trees, args.rounds, int(args.ratio_of))))


if __name__ == "__main__":
    main()
