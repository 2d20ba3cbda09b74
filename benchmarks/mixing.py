"""Mixing datasets with weights: shardkit's mixture against one dataset, and against the peers' mixtures.

Run (the peers come from the ``bench`` extra: MosaicML Streaming and LitData)::

    python benchmarks/mixing.py            # the full run (about 10 minutes on a 2-core VM)
    python benchmarks/mixing.py --quick    # a smoke run (about 2 minutes)

Two parts, each printed as a Markdown table (and saved as JSON in ``benchmarks/_data/mixing/``):

1. **Throughput.** One dataset of ``--n`` records of 224x224x3 uint8 (``_common.synthetic_dataset``),
   and the same records split into two datasets (60/40 %) and five datasets (30/25/20/15/10 %), each
   mixed with weights equal to their sizes, so every configuration emits the same ``N`` records per
   epoch from the same bytes. Each run is a fresh :class:`~shardkit.readers.TieredSampler`
   (``tiers=ram``, a RAM budget of a quarter of the data, batch 64) over ``--epochs`` epochs with the
   page cache dropped first; the configurations are interleaved over ``--rounds`` rounds (each round
   starting with another one) and the median is reported, with the ratio to the single dataset (target >= 0.95), and
   the CPU time of the process (all threads) per record with its spread over the rounds and its ratio
   to the single dataset (target <= 1.10; survives a loaded machine better than wall time). A second
   table gives each round's ratios to the single dataset's run of the same round (median [min, max])
   and the first epoch of each fresh run timed on its own (what every run pays). Also reported: bytes
   read from the dataset files per epoch (the sampler's disk counters) against the bytes of the
   records emitted, and the same for a skewed mixture (two datasets, weights 1:1 on a 60/40 split,
   so the smaller one is read 1.25x per epoch and the larger 0.83x).
2. **Orders.** The same two mixtures on small datasets (two: 300 + 100 records, weights 1:1, ``L =
   400``; five: 200/150/100/50/25 records, weights 5:4:3:2:1, ``L = 525``) through shardkit, MosaicML
   Streaming (``Stream(proportion=)`` with ``epoch_size=L``, ``shuffle=True``) and LitData
   (``CombinedStreamingDataset(weights=)``, which requires ``iterate_over_all=False`` and ends an
   epoch when any dataset is exhausted), ``--order-epochs`` epochs each. Every record carries its
   dataset index and key, so each loader's order is recorded as ``[epochs, L, 2]`` and tested with
   ``shardkit order-test`` (:func:`shardkit.ordertest.mixture.run_mixture`): per-epoch counts
   (min..max per dataset, against the largest-remainder target), the slot arrangement tests, walk
   balance, and the battery on each dataset's own records. A loader whose epochs differ in length
   is cut to its shortest epoch for the order tests (the counts are reported uncut).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from _common import drop_cache, synthetic_dataset

import shardkit
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.order.mixture import epoch_counts
from shardkit.ordertest.mixture import MixtureReport, run_mixture
from shardkit.readers import TieredSampler

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "mixing"
SPLITS = {"1 dataset": [1.0], "2 datasets": [0.6, 0.4], "5 datasets": [0.3, 0.25, 0.2, 0.15, 0.1]}
ORDER_MIXES = {"two": ([300, 100], [1, 1], 400), "five": ([200, 150, 100, 50, 25], [5, 4, 3, 2, 1], 525)}


# ---------------------------------------------------------------------------------------------- throughput
def split_datasets(whole: Path, fractions: list[float], out: Path) -> list[Path]:
    """The records of ``whole`` cut into consecutive datasets of the given fractions (written once)."""
    with open_dataset(whole) as ds:
        n = ds.num_records
        bounds = np.round(np.cumsum([0, *fractions]) * n).astype(int)
        paths = []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            p = out / f"part{len(fractions)}-{i}"
            paths.append(p)
            if (p / "zarr.json").exists() and open_dataset(p).num_records == b - a:
                continue
            shutil.rmtree(p, ignore_errors=True)
            rec = ds.meta.record
            with DatasetWriter(p, kind="bench", payload="image", record=FieldSpec(rec.shape, rec.dtype),
                               fields={"label": FieldSpec((), "int64")}) as w:
                for c in range(a, b, 256):
                    keys = np.arange(c, min(c + 256, b))
                    w.write({"image": ds.payload.read(keys), "label": ds.fields["label"][keys]})
    return paths


def run_throughput(source: Any, paths: list[Path], args: argparse.Namespace, ram: int) -> dict[str, float]:
    """One cold run: records/s over ``--epochs`` epochs and over the first epoch alone (what a user
    meets on every fresh run: the sampler built, the page cache dropped), CPU time of the process (all
    threads) per record, bytes read per epoch and bytes emitted per epoch."""
    for p in paths:
        drop_cache(p)
    t0, c0 = time.perf_counter(), time.process_time()
    with TieredSampler(source, tiers="ram", ram_size=ram, batch_size=64, epochs=args.epochs, seed=1) as s:
        records, first_s, per_epoch = 0, 0.0, s.num_records
        for batch in s:
            records += int(batch["key"].shape[0])
            batch["image"][:, 0, 0, 0].sum()  # touch the payload like a consumer
            if not first_s and records >= per_epoch:
                first_s = time.perf_counter() - t0
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        disk = s.stats.disk.bytes_read
        rec = s.record_nbytes
    return {"records_per_s": records / elapsed, "cpu_us_per_record": 1e6 * cpu / max(1, records),
            "first_epoch_records_per_s": per_epoch / first_s if first_s else 0.0,
            "read_per_epoch": disk / args.epochs,
            "emitted_per_epoch": records * rec / args.epochs}


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    whole = synthetic_dataset(DATA / f"whole-{args.n}", args.n)
    rec = 224 * 224 * 3
    ram = max(4 * 64 * rec * 2, args.n * rec // 4)
    configs: dict[str, tuple[Any, list[Path]]] = {"1 dataset": (whole, [whole])}
    for name, fractions in SPLITS.items():
        if len(fractions) > 1:
            parts = split_datasets(whole, fractions, DATA / f"parts-{args.n}")
            sizes = [open_dataset(p).num_records for p in parts]
            configs[name] = (shardkit.mix(list(zip(parts, sizes))), parts)
    parts2 = split_datasets(whole, SPLITS["2 datasets"], DATA / f"parts-{args.n}")
    configs["2 datasets, weights 1:1"] = (shardkit.mix([(parts2[0], 1), (parts2[1], 1)]), parts2)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # a different configuration goes first each round
            source, paths = configs[name]
            runs[name].append(run_throughput(source, paths, args, ram))
            print(f"round {r + 1}: {name}: {runs[name][-1]['records_per_s']:,.0f} records/s", file=sys.stderr)
    base = statistics.median(x["records_per_s"] for x in runs["1 dataset"])
    base_cpu = statistics.median(x["cpu_us_per_record"] for x in runs["1 dataset"])
    base_first = statistics.median(x["first_epoch_records_per_s"] for x in runs["1 dataset"])
    rows = []
    for name, rs in runs.items():
        rps = statistics.median(x["records_per_s"] for x in rs)
        cpu = statistics.median(x["cpu_us_per_record"] for x in rs)
        first = statistics.median(x["first_epoch_records_per_s"] for x in rs)
        # Each round's ratio to the single dataset's run of the same round (the same load, minutes apart).
        same_round = {key: [x[key] / b[key] if b[key] else 0.0 for x, b in zip(rs, runs["1 dataset"])]
                      for key in ("records_per_s", "cpu_us_per_record", "first_epoch_records_per_s")}
        rows.append({"config": name, "records_per_s": rps, "ratio": rps / base, "cpu_us_per_record": cpu,
                     "cpu_ratio": cpu / base_cpu, "cpu_spread": [min(x["cpu_us_per_record"] for x in rs),
                                                                  max(x["cpu_us_per_record"] for x in rs)],
                     "round_ratios": same_round["records_per_s"], "round_cpu_ratios": same_round["cpu_us_per_record"],
                     "first_epoch_records_per_s": first, "first_ratio": first / base_first if base_first else 0.0,
                     "round_first_ratios": same_round["first_epoch_records_per_s"],
                     "read_per_epoch": statistics.median(x["read_per_epoch"] for x in rs),
                     "emitted_per_epoch": statistics.median(x["emitted_per_epoch"] for x in rs)})
    return rows


def throughput_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    mib = 2**20
    lines = [f"N = {args.n} records of 224x224x3 (one epoch {args.n * 150528 / mib:,.0f} MiB), tiers=ram with a RAM "
             f"budget of 1/4 of the data, batch 64, {args.epochs} epochs per cold run, median of {args.rounds}",
             "", "| configuration | records/s | vs 1 dataset | CPU µs/record (min..max) | CPU vs 1 dataset (target <= 1.10) | "
             "MiB read per epoch | MiB emitted per epoch | read / emitted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["cpu_spread"]
        lines.append(f"| {r['config']} | {r['records_per_s']:,.0f} | {r['ratio']:.3f} | {r['cpu_us_per_record']:,.1f} "
                     f"({lo:,.1f}..{hi:,.1f}) | {r['cpu_ratio']:.3f} | {r['read_per_epoch'] / mib:,.1f} | "
                     f"{r['emitted_per_epoch'] / mib:,.1f} | {r['read_per_epoch'] / r['emitted_per_epoch']:.3f} |")
    lines += ["", "Ratios to the single dataset's run of the same round (median [min, max] over the rounds); "
              "the first epoch is epoch 1 of a fresh run (sampler built, page cache dropped):", "",
              "| configuration | records/s vs 1 dataset (target >= 0.9) | CPU per record vs 1 dataset (target <= 1.10) | "
              "first epoch records/s | first epoch vs 1 dataset |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {_spread(r['round_ratios'])} | {_spread(r['round_cpu_ratios'])} | "
                     f"{r['first_epoch_records_per_s']:,.0f} | {_spread(r['round_first_ratios'])} |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    """``median [min, max]`` of per-round ratios."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


# ---------------------------------------------------------------------------------------------- orders
def _tiny_shardkit(path: Path, dataset: int, n: int) -> Path:
    if not (path / "zarr.json").exists():
        with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec((8,), "uint8"),
                           fields={"label": FieldSpec((), "int64")}, records_per_shard=25) as w:
            w.write({"image": np.full((n, 8), dataset, dtype=np.uint8), "label": np.arange(n)})
    return path


def order_shardkit(work: Path, sizes: list[int], weights: list[int], length: int, epochs: int) -> list[np.ndarray]:
    paths = [_tiny_shardkit(work / f"sk{i}", i, n) for i, n in enumerate(sizes)]
    m = shardkit.mix(list(zip(paths, weights)), epoch_size=length)
    rows: dict[int, list[np.ndarray]] = {}
    with TieredSampler(m, tiers="ram", ram_size="64records", batch_size=16, epochs=epochs, seed=3) as s:
        for batch in s:
            rows.setdefault(s.epoch if s.position else s.epoch - 1, []).append(np.stack([batch["dataset"], batch["key"]], 1))
    return [np.concatenate(rows[e]) for e in sorted(rows)]


def order_streaming(work: Path, sizes: list[int], weights: list[int], length: int, epochs: int) -> list[np.ndarray]:
    from streaming import MDSWriter, Stream, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    streams = []
    for d, n in enumerate(sizes):
        out = work / f"mds{d}"
        with MDSWriter(out=str(out), columns={"key": "int", "ds": "int"}, size_limit=1 << 10) as w:
            for i in range(n):
                w.write({"key": i, "ds": d})
        streams.append(Stream(local=str(out), proportion=weights[d] / sum(weights)))
    ds = StreamingDataset(streams=streams, epoch_size=length, shuffle=True, batch_size=16, shuffle_seed=3)
    return [np.array([(int(s["ds"]), int(s["key"])) for s in ds]) for _ in range(epochs)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence a peer's progress bars and banners (its worker processes inherit file descriptors 1, 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _lit_item(i: int, d: int) -> dict[str, int]:
    return {"key": i, "ds": d}


def order_litdata(work: Path, sizes: list[int], weights: list[int], length: int, epochs: int) -> list[np.ndarray]:
    import litdata as ld

    dss = []
    for d, n in enumerate(sizes):
        out = work / f"lit{d}"
        with _quiet():
            ld.optimize(fn=partial(_lit_item, d=d), inputs=list(range(n)), output_dir=str(out), chunk_size=25,
                        num_workers=1, mode="overwrite")
        dss.append(ld.StreamingDataset(str(out), shuffle=True, seed=3))
    total = sum(weights)
    comb = ld.CombinedStreamingDataset(dss, seed=3, weights=[w / total for w in weights], iterate_over_all=False)
    out_rows = []
    for e in range(epochs):
        comb.set_epoch(e + 1)
        out_rows.append(np.array([(int(s["ds"]), int(s["key"])) for s in comb]))
    return out_rows


LOADERS: dict[str, tuple[str, Callable[..., list[np.ndarray]]]] = {
    "shardkit": ("shardkit mix()", order_shardkit),
    "streaming": ("Streaming Stream(proportion=)", order_streaming),
    "litdata": ("LitData CombinedStreamingDataset(weights=)", order_litdata),
}


def orders(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mix_name, (sizes, weights, length) in ORDER_MIXES.items():
        target = epoch_counts(weights, length)
        for key, (label, fn) in LOADERS.items():
            work = Path(tempfile.mkdtemp(prefix=f"mixing-{key}-", dir=DATA))
            try:
                epochs = fn(work, sizes, weights, length, args.order_epochs)
            except ImportError as exc:
                rows.append({"mixture": mix_name, "loader": label, "missing": str(exc)})
                continue
            finally:
                shutil.rmtree(work, ignore_errors=True)
            lengths = [len(e) for e in epochs]
            counts = np.stack([np.bincount(e[:, 0], minlength=len(sizes)) for e in epochs])
            cut = np.stack([e[: min(lengths)] for e in epochs])
            report = run_mixture(cut, sizes=sizes, weights=weights if min(lengths) == length else None,
                                 compute_power=False)
            rows.append({"mixture": mix_name, "loader": label, "sizes": sizes, "weights": weights, "L": length,
                         "target": list(target), "epoch_lengths": [min(lengths), max(lengths)],
                         "counts_min": counts.min(0).tolist(), "counts_max": counts.max(0).tolist(),
                         "report": report.to_dict(), "failed": list(report.failed), "passed": report.passed,
                         "_report": report})
    return rows


def orders_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.order_epochs} epochs per loader; alpha = 1e-3; counts as min..max over epochs per dataset",
             "", "| mixture | loader | epoch length | counts per epoch (target) | counts | slot_positions | slot_runs | "
             "slot_independence | walk_balance | per-dataset battery | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['mixture']} | {r['loader']} | not installed: {r['missing']} |" + " |" * 8)
            continue
        rep: MixtureReport = r["_report"]
        counts = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in zip(r["counts_min"], r["counts_max"]))
        exact = all(a == b == t for a, b, t in zip(r["counts_min"], r["counts_max"], r["target"]))
        fixed = r["counts_min"] == r["counts_max"]

        def cell(name: str, rep: MixtureReport = rep) -> str:
            res = rep.result(name)
            if res.verdict == "n/a":
                return "n/a"
            p = "" if res.pvalue is None else f" (p {res.pvalue:.2g})"
            return ("pass" if res.verdict == "pass" else "**fail**") + p

        per_ds = "; ".join(
            "-" if d is None else ("pass" if d.passed else "**" + ", ".join(x.name for x in d.failed) + "**")
            for d in rep.datasets
        )
        lo, hi = r["epoch_lengths"]
        verdict = "yes" if exact and r["passed"] else "**no**"
        lines.append(f"| {r['mixture']} | {r['loader']} | {lo if lo == hi else f'{lo}..{hi}'} | {counts} "
                     f"({', '.join(map(str, r['target']))}) | {'exact' if exact else '**off target**' if fixed else '**drift**'} | "
                     f"{cell('slot_positions')} | {cell('slot_runs')} | {cell('slot_independence')} | "
                     f"{cell('walk_balance')} | {per_ds} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--n", type=int, default=6000, help="records in the throughput datasets (all parts together)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order-epochs", type=int, default=400)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-orders", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.epochs, args.rounds, args.order_epochs = 600, 2, 1, 40
    DATA.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args)}
    if not args.skip_throughput:
        rows = throughput(args)
        results["throughput"] = rows
        print("## Throughput\n\n" + throughput_table(rows, args) + "\n")
    if not args.skip_orders:
        rows = orders(args)
        results["orders"] = [{k: v for k, v in r.items() if k != "_report"} for r in rows]
        print("## Orders\n\n" + orders_table(rows, args) + "\n")
    out = DATA / ("results-quick.json" if args.quick else "results.json")
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
