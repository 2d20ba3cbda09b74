"""Head-to-head: shardkit vs the PyTorch per-file loader, random access, WebDataset and MosaicML
Streaming -- throughput and randomness on the same data, in one run.

One command (peers come from the optional ``bench`` extra, torch from the ``torch`` extra)::

    pip install -e '.[bench]' && python benchmarks/compare.py

``--small`` is a quick development run (300 JPEGs, 100 order epochs; results are not written).
``--orders-only`` runs only the repeated-epoch order runs (no JPEG corpus, no timing: an order does not
depend on the machine's load; about 5 minutes) and prints the ``shardkit order-test`` table of them.
The full run takes about 10-15 minutes on a 2-core VM, most of it building the corpus the first time
(cached in ``benchmarks/_data/compare/``, gitignored).

What it does
------------
1. Corpus: ``--n`` (3000) generated natural-image-like JPEGs of 500x375 (one in four portrait),
   quality 90, in 10 class folders. They are decoded once with shardkit's transform (shorter side
   to 224, centre crop) into 224x224x3 uint8 records; from those same records, in the same order
   (record key = storage position), each loader's own writer builds its format: ``shardkit.convert``
   (checked byte-identical to the records; ``DatasetWriter`` if the converter is unavailable),
   ``webdataset.ShardWriter`` (tar shards) and ``streaming.MDSWriter`` (MDS shards). The peers store
   the raw uint8 bytes (plus label and key), so no loader except the per-file baseline pays a JPEG
   decode at read time. Peer shards are 64 MiB (MDS's default size; WebDataset cut at the same count).
2. Every measured run is a fresh child process, started after the page cache of every corpus file
   was dropped (``posix_fadvise(POSIX_FADV_DONTNEED)``). Batch size 64; loaders with DataLoader
   workers use the same count (1 and 2 for the per-file baseline, 2 for the peers). Records/s is
   ``N`` over the wall time from building the loader to the last batch of one full epoch (worker
   start-up included, Python/torch import excluded). Bytes read from disk are the kernel's
   ``read_bytes`` I/O accounting of the child and all its descendants (``getrusage(RUSAGE_CHILDREN)``
   ``ru_inblock``, which is ``read_bytes / 512`` summed over waited-for processes). Peak memory is
   the peak of the summed PSS of the process tree, sampled every 50 ms (summed RSS would count the
   pages forked DataLoader workers share several times). Every child imports torch.
3. Randomness on the emitted keys: the mean number of distinct labels per batch against its exact
   expectation under a uniform shuffle, and Spearman's rho between storage and emitted position,
   both on the measured full-size epoch; and the item x position chi-square over ``--epochs``
   repeated epochs of a small corpus (N = 200 records of 16x16x3, positions binned by 10, see
   ``order_metrics.uniformity_chi2``) plus the adjacent-pairs test (storage neighbours emitted
   together; ``order_metrics.adjacent_pairs_test``), with every size that shapes the order scaled to
   keep its ratio to N: 7 shards, WebDataset buffer 1000 * 200/3000 = 67 (initial 7), RAM/SSD blocks
   of the same fraction of N. MosaicML's default shuffle block (262,144 samples) exceeds both corpora
   and is left at its default; a second MosaicML row scales the block to its ImageNet-1k ratio.
   The keys each loader emitted in those epochs are saved as ``benchmarks/_data/orders/<loader>.npy``
   (``[epochs, 200]`` int64, with ``labels.npy`` and ``meta.json``), for ``shardkit order-test`` and
   ``benchmarks/order_table.py``, which runs the whole battery on them and prints a Markdown table.
4. Writes the table and notes to ``benchmarks/RESULTS.md`` (section "Head-to-head") and the chart
   to ``benchmarks/compare.png``; the raw numbers go to ``benchmarks/_data/compare/compare.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import order_metrics as om  # noqa: E402
from _common import drop_cache  # noqa: E402
from _compare_corpus import (  # noqa: E402
    PEER_SHARD_BYTES,
    RECORD_NBYTES,
    CorpusSpec,
    build_jpegs,
    build_records,
    format_files,
    resident_bytes,
    write_mds,
    write_shardkit,
    write_wds,
)
from _compare_loaders import RunConfig  # noqa: E402

from shardkit.order.schedule import consumer_records_bound, ram_block, ssd_block  # noqa: E402
from shardkit.units import parse_bytes  # noqa: E402

logger = logging.getLogger("compare")
ALPHA = om.ALPHA
#: MosaicML's default shuffle block (262,144 samples) over ImageNet-1k's 1,281,167 training images.
MDS_IMAGENET_RATIO = (1 << 18) / 1_281_167
#: Storage block (keys) of the adjacent-pairs test on the N = 200 corpus.
PAIR_BLOCK = 10
#: What each order run is, as ``benchmarks/order_table.py`` names it (its keys are saved as <key>.npy).
ORDER_NAMES = {
    "perfile": "PyTorch DataLoader, shuffle=True",
    "random": "shardkit random access, a permutation per epoch",
    "wds": "WebDataset, shard shuffle + buffer",
    "mds": "MosaicML Streaming, default shuffle (py1e)",
    "mds-scaled": "MosaicML Streaming, py1e block at its ImageNet ratio",
    "sampler-ram": "shardkit TieredSampler, tiers=ram",
    "sampler-ram-ssd": "shardkit TieredSampler, tiers=ram,ssd",
}
SECTION = "## Head-to-head"


@dataclass
class Entry:
    """One row of the comparison."""

    label: str
    loader: str
    workers: int
    reads: str  # how it reads storage: "per file", "random", "sequential"
    extra: dict[str, Any]
    order_key: str  # which order run gives its chi-square (shared when the order is the same)


def entries(workers: int) -> list[Entry]:
    return [
        Entry("PyTorch per-file JPEG (Pillow), 1 worker", "perfile", 1, "random files", {}, "perfile"),
        Entry(f"PyTorch per-file JPEG (Pillow), {workers} workers", "perfile", workers, "random files", {}, "perfile"),
        Entry("shardkit random access, read() per batch", "random-batched", 0, "random", {}, "random"),
        Entry("shardkit random access, 1 pread per record", "random-pread", 0, "random", {}, "random"),
        Entry(f"WebDataset, shard shuffle + buffer 1000, {workers} workers", "wds", workers, "sequential", {}, "wds"),
        Entry(f"MosaicML Streaming, default shuffle (py1e), {workers} workers", "mds", workers, "random (per sample)", {},
              "mds"),
        Entry(f"MosaicML Streaming, py1e block scaled to its ImageNet ratio (0.2 N), {workers} workers", "mds",
              workers, "per sample, within a few shards", {"block": "scaled"}, "mds-scaled"),
        Entry("shardkit TieredSampler, tiers=ram", "sampler", 0, "sequential", {"tiers": "ram"}, "sampler-ram"),
        Entry("shardkit TieredSampler, tiers=ram,ssd", "sampler", 0, "sequential", {"tiers": "ram,ssd"},
              "sampler-ram-ssd"),
    ]


# ---------------------------------------------------------------------------------------------- children
class TreeMonitor(threading.Thread):
    """Peak summed PSS (and RSS) of a process and its descendants, sampled every ``interval`` s."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_pss = 0
        self.peak_rss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._halt.is_set():
            pss = rss = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    m = p.memory_full_info()
                    pss += m.pss
                    rss += m.rss
                except psutil.Error:
                    pass
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_rss = max(self.peak_rss, rss)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_child(cfg: RunConfig, work: Path, drop: list[Path] | None,
              own: list[Path] | None = None) -> dict[str, Any]:
    """Run one loader in a fresh process; return its timings, I/O, memory and emitted keys."""
    work.mkdir(parents=True, exist_ok=True)
    tag = "-".join([cfg.loader, *(f"{k}{v}" for k, v in sorted(cfg.extra.items())), f"w{cfg.workers}",
                    f"e{cfg.epochs}"]).replace(",", "+")
    spec, result = work / f"{tag}.cfg.json", work / f"{tag}.result"
    spec.write_text(json.dumps(asdict(cfg)))
    if drop:
        drop_cache(drop)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, str(HERE / "_compare_loaders.py"), str(spec), str(result)])
    mon = TreeMonitor(proc.pid)
    mon.start()
    rc = proc.wait()
    mon.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise RuntimeError(f"{cfg.loader} ({cfg.extra}) failed with exit code {rc}")
    info = json.loads(result.with_suffix(".json").read_text())
    info["keys"] = np.load(result.with_suffix(".npy"))
    info["bytes_read"] = (after.ru_inblock - before.ru_inblock) * 512
    info["peak_pss"] = mon.peak_pss
    info["peak_rss"] = mon.peak_rss
    info["paged_in"] = resident_bytes(own) if own else None
    return info


def baseline_memory() -> int:
    """Peak PSS of a process that only imports what every child imports (python, numpy, torch)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time, numpy, torch; time.sleep(1.5)"])
    mon = TreeMonitor(proc.pid)
    mon.start()
    proc.wait()
    mon.stop()
    return mon.peak_pss


# ---------------------------------------------------------------------------------------------- build
def build_all(args: argparse.Namespace) -> dict[str, Any]:
    data = args.dir
    spec = CorpusSpec(n=args.n, classes=10)
    t = time.perf_counter()
    jpegs, labels = build_jpegs(data / "jpeg", spec, args.build_workers)
    logger.info("corpus: %d JPEGs (%.0f s)", len(jpegs), time.perf_counter() - t)
    t = time.perf_counter()
    records = build_records(data / "records.npy", jpegs, spec, args.build_workers)
    logger.info("decoded records (%.0f s)", time.perf_counter() - t)
    np.save(data / "labels.npy", labels)
    (data / "jpegs.json").write_text(json.dumps([str(p) for p in jpegs]))
    class_names = [f"class_{c:02d}" for c in range(spec.classes)]
    peer_rps = max(1, PEER_SHARD_BYTES // RECORD_NBYTES)
    t = time.perf_counter()
    how = write_shardkit(data / "shardkit", records, labels, class_names, src=data / "jpeg",
                         workers=args.build_workers)
    logger.info("shardkit dataset via %s (%.0f s)", how, time.perf_counter() - t)
    t = time.perf_counter()
    write_wds(data / "wds", records, labels, peer_rps)
    write_mds(data / "mds", records, labels, peer_rps)
    logger.info("peer formats (%.0f s)", time.perf_counter() - t)
    return {"labels": labels, "how": how, "peer_rps": peer_rps, "jpeg_bytes": sum(p.stat().st_size for p in jpegs),
            **build_small(args)}


def build_small(args: argparse.Namespace) -> dict[str, Any]:
    """The small corpus for the repeated-epoch order tests: the big one's structure, scaled to N = 200
    (as many shards as the ``--n`` corpus has; random 16x16 records: the order does not look at them)."""
    peer_rps = max(1, PEER_SHARD_BYTES // RECORD_NBYTES)
    n_small, per_shard = 200, -(-200 // max(1, -(-args.n // peer_rps)))
    rng = np.random.default_rng(1)
    small_records = rng.integers(0, 256, size=(n_small, 16, 16, 3), dtype=np.uint8)
    small_labels = (np.arange(n_small) * 10 // n_small).astype(np.int64)
    class_names = [f"class_{c:02d}" for c in range(10)]
    small = args.dir / "small"
    small.mkdir(parents=True, exist_ok=True)
    np.save(small / "labels.npy", small_labels)
    write_shardkit(small / "shardkit", small_records, small_labels, class_names, records_per_shard=per_shard)
    write_wds(small / "wds", small_records, small_labels, per_shard)
    write_mds(small / "mds", small_records, small_labels, per_shard)
    return {"small_labels": small_labels, "small_per_shard": per_shard, "n_small": n_small}


def all_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for sub in ("jpeg", "shardkit", "wds", "mds"):
        files += format_files(root / sub)
    return files


# ---------------------------------------------------------------------------------------------- measure
def measure(args: argparse.Namespace, built: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    data = args.dir
    paths = {k: str(data / k) for k in ("shardkit", "wds", "mds")}
    ssd_dir = data / "ssd-tier"
    ssd_dir.mkdir(exist_ok=True)
    work = data / "runs"
    shutil.rmtree(work, ignore_errors=True)
    drop = all_files(data)
    ram_size, ssd_size = tier_sizes(args)
    base = dict(n=args.n, shape=[224, 224, 3], batch=args.batch, epochs=1, seed=args.seed, paths=paths,
                labels_file=str(data / "labels.npy"), jpeg_list=str(data / "jpegs.json"), ram_size=ram_size,
                ssd_size=ssd_size, ssd_dir=str(ssd_dir))
    # Warm-up: bring Python, torch and the peers' code into the page cache so that the measured
    # children's reads are the dataset's.
    first_jpeg = json.loads((data / "jpegs.json").read_text())[0]
    subprocess.run([sys.executable, "-c", "import sys, torch, webdataset, streaming, shardkit.readers; "
                    f"sys.path.insert(0, {str(HERE)!r}); import _compare_loaders, _compare_corpus as c; "
                    f"c.perfile_transform({first_jpeg!r})"], check=True)
    # Order runs on the small corpus first (many epochs, one child per loader kind): they also bring
    # every code path of every loader into the page cache before the measured cold runs.
    orders = run_orders(args, built, work, ssd_dir)
    orders["baseline_pss"] = baseline_memory()
    rows = []
    for ent in entries(args.workers):
        if args.only and ent.loader not in args.only:
            continue
        extra = dict(ent.extra)
        if extra.get("block") == "scaled":
            extra["block"] = round(MDS_IMAGENET_RATIO * args.n)
        cfg = RunConfig(loader=ent.loader, workers=ent.workers, extra=extra, **base)
        own = format_files(data / {"perfile": "jpeg", "wds": "wds", "mds": "mds"}.get(ent.loader, "shardkit"))
        info = run_child(cfg, work, drop, own)
        info["entry"] = ent
        rows.append(info)
        logger.info("%-60s %8.0f rec/s  %7.1f MB read (%5.1f MB of the dataset)  %6.0f MiB  (load %s)", ent.label,
                    args.n / info["seconds"], info["bytes_read"] / 1e6, info["paged_in"] / 1e6,
                    info["peak_pss"] / 2**20, _load())

    runs = orders["runs"]
    if "sampler-ram" in runs and "sampler-ram-ssd" in runs:
        orders["sampler_same_order"] = bool(np.array_equal(runs["sampler-ram"]["keys"], runs["sampler-ram-ssd"]["keys"]))
    return rows, orders


def tier_sizes(args: argparse.Namespace) -> tuple[str, str]:
    """RAM tier ~ 1/4 of the ``--n`` dataset, SSD tier ~ 1/2 (both smaller than the dataset)."""
    dataset_bytes = args.n * RECORD_NBYTES
    return f"{dataset_bytes // 4 >> 20}MiB", f"{dataset_bytes // 2 >> 20}MiB"


def run_orders(args: argparse.Namespace, built: dict[str, Any], work: Path, ssd_dir: Path) -> dict[str, Any]:
    """Every loader for ``--epochs`` epochs of the small corpus, one child each: chi-square, adjacent
    pairs, and the emitted keys saved to ``args.orders_dir`` for ``shardkit order-test``."""
    n_small = built["n_small"]
    small = args.dir / "small"
    ram_size, ssd_size = tier_sizes(args)
    spaths = {k: str(small / k) for k in ("shardkit", "wds", "mds")}
    # The blocks the sampler derives for the full corpus (its own rules), scaled to the small one.
    bound = consumer_records_bound(args.n, args.batch, 1)
    k2 = max(1, round(ram_block(parse_bytes(ram_size, what="ram_size"), RECORD_NBYTES, args.batch, bound) * n_small / args.n))
    k1 = max(1, round(ssd_block(parse_bytes(ssd_size, what="ssd_size"), RECORD_NBYTES, bound) * n_small / args.n))
    scale = n_small / args.n
    sbase = dict(n=n_small, shape=[16, 16, 3], batch=args.batch, epochs=args.epochs, seed=args.seed, paths=spaths,
                 labels_file=str(small / "labels.npy"), decode=False,
                 wds_buffer=max(2, round(1000 * scale)), wds_initial=max(1, round(100 * scale)),
                 ram_size=f"{2 * k2}records", ssd_size=f"{2 * k1}records", ssd_dir=str(ssd_dir))
    order_runs = {
        "perfile": RunConfig(loader="perfile", workers=args.workers, **sbase),
        "random": RunConfig(loader="random-batched", workers=0, **sbase),
        "wds": RunConfig(loader="wds", workers=args.workers, **sbase),
        "mds": RunConfig(loader="mds", workers=args.workers, **sbase),
        "mds-scaled": RunConfig(loader="mds", workers=args.workers,
                                extra={"block": round(MDS_IMAGENET_RATIO * n_small)}, **sbase),
        "sampler-ram": RunConfig(loader="sampler", workers=0, extra={"tiers": "ram"}, **sbase),
        "sampler-ram-ssd": RunConfig(loader="sampler", workers=0, extra={"tiers": "ram,ssd"}, **sbase),
    }
    orders: dict[str, Any] = {"k2": k2, "k1": k1, "wds_buffer": sbase["wds_buffer"],
                              "wds_initial": sbase["wds_initial"], "runs": {}}
    args.orders_dir.mkdir(parents=True, exist_ok=True)
    np.save(args.orders_dir / "labels.npy", built["small_labels"])
    (args.orders_dir / "meta.json").write_text(json.dumps({
        "records": n_small, "epochs": args.epochs, "batch": args.batch, "seed": args.seed,
        "loaders": {k: ORDER_NAMES[k] for k, c in order_runs.items() if not args.only or c.loader in args.only},
    }, indent=1))
    for key, cfg in order_runs.items():
        if args.only and cfg.loader not in args.only:
            continue
        t = time.perf_counter()
        info = run_child(cfg, work / "order", None)
        # The keys each loader emitted, [epochs, N] int64: `shardkit order-test` and
        # benchmarks/order_table.py read them from here.
        np.save(args.orders_dir / f"{key}.npy", info["keys"])
        pos_bins = n_small // 10
        chi = om.uniformity_chi2(info["keys"], n_small, pos_bins=pos_bins)
        pairs = om.adjacent_pairs_test(info["keys"], n_small, PAIR_BLOCK)
        orders["runs"][key] = {"chi": chi, "pairs": pairs, "keys": info["keys"]}
        logger.info("order %-16s chi2 %.0f dof %d p=%.3g; adjacent pairs %.2f (exp. %.2f) p=%.3g (%.0f s)", key,
                    chi.statistic, chi.dof, chi.pvalue, pairs.mean, pairs.expected, pairs.pvalue,
                    time.perf_counter() - t)
    return orders


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------- report
def summarise(args: argparse.Namespace, built: dict[str, Any], rows: list[dict[str, Any]],
              orders: dict[str, Any]) -> list[dict[str, Any]]:
    labels = built["labels"]
    class_counts = np.bincount(labels)
    table = []
    for r in rows:
        ent: Entry = r["entry"]
        keys = r["keys"][0]
        sizes = r["batch_sizes"]
        obs = om.distinct_labels_per_batch(labels[keys], sizes)
        exp = om.expected_distinct_labels(class_counts, sizes)
        o = orders["runs"].get(ent.order_key)
        table.append({
            "label": ent.label, "reads": ent.reads, "workers": ent.workers,
            "rps": args.n / r["seconds"], "seconds": r["seconds"], "bytes_read": r["bytes_read"],
            "paged_in": r["paged_in"], "first_batch_s": r["first_batch_s"],
            "peak_pss": r["peak_pss"], "peak_rss": r["peak_rss"], "labels_obs": obs, "labels_exp": exp,
            "spearman": om.storage_spearman(keys), "chi": o["chi"] if o else None,
            "pairs": o["pairs"] if o else None,
            "bad_labels": r["bad_labels"], "extra": r["extra"], "order_key": ent.order_key,
        })
    return table


def markdown(args: argparse.Namespace, built: dict[str, Any], table: list[dict[str, Any]],
             orders: dict[str, Any], started_load: str, ended_load: str) -> str:
    base = next((t["rps"] for t in table if t["label"].endswith("1 worker")), table[0]["rps"] if table else 1.0)
    sd = om.spearman_null_sd(args.n)
    lines = [
        "| loader | storage reads | records/s | vs per-file 1 worker | MB read from disk: process tree / its dataset "
        "files | peak memory MiB (PSS) "
        "| distinct labels / batch (uniform: {:.2f}) | Spearman storage vs emitted (uniform: 0 ± {:.3f}) "
        "| item×position χ² p (N=200) | adjacent storage pairs / epoch (uniform: {:.0f}), p "
        "| uniform at α=1e-3 (both tests) |".format(
            table[0]["labels_exp"] if table else 0.0, sd, PAIR_BLOCK - 1),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in table:
        chi, pr = t["chi"], t["pairs"]
        lines.append(
            f"| {t['label']} | {t['reads']} | {t['rps']:,.0f} | "
            f"{t['rps'] / base:.1f}× | {t['bytes_read'] / 1e6:,.0f} / {t['paged_in'] / 1e6:,.0f} | "
            f"{t['peak_pss'] / 2**20:,.0f} | "
            f"{t['labels_obs']:.2f} (exp. {t['labels_exp']:.2f}) | {t['spearman']:+.3f} | "
            f"{_p(chi.pvalue) if chi else 'n/a'} | "
            f"{f'{pr.mean:.2f}, p{_peq(pr.pvalue)}' if pr else 'n/a'} | "
            f"{('yes' if uniform(t) else '**no**') if chi else 'n/a'} |")
    return "\n".join(lines)


def uniform(t: dict[str, Any]) -> bool:
    """Both order tests pass at ALPHA (Bonferroni: each at ALPHA / 2)."""
    return bool(t["chi"] and t["pairs"] and t["chi"].pvalue >= ALPHA / 2 and t["pairs"].pvalue >= ALPHA / 2)


def combined_p(t: dict[str, Any]) -> float:
    """Bonferroni-adjusted p-value of the two order tests."""
    if not (t["chi"] and t["pairs"]):
        return float("nan")
    return min(1.0, 2 * min(t["chi"].pvalue, t["pairs"].pvalue))


def _peq(p: float) -> str:
    """``=0.12`` or `` < 1e-300``: a p-value after the letter p."""
    text = _p(p)
    return f" {text}" if text.startswith("<") else f"={text}"


def _p(p: float) -> str:
    if p <= 0.0:
        return "< 1e-300"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def chart(path: Path, table: list[dict[str, Any]], n: int, batch: int) -> None:
    """Three panels: throughput, distinct labels per batch, and the chi-square verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table[::-1]
    names = [t["label"] for t in rows]
    colours = ["#1f77b4" if "shardkit" in t["label"] else "#999999" for t in rows]
    fig, axes = plt.subplots(1, 3, figsize=(17, 0.5 * len(names) + 2.2), sharey=True,
                             gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax = axes[0]
    vals = [t["rps"] for t in rows]
    ax.barh(names, vals, color=colours)
    ax.set_xscale("log")
    ax.set_xlim(right=max(vals) * 3)
    ax.set_xlabel("records/s, one cold epoch (log scale)")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    ax = axes[1]
    ax.barh(names, [t["labels_obs"] for t in rows], color=colours)
    for y, t in enumerate(rows):
        ax.plot([t["labels_exp"]] * 2, [y - 0.4, y + 0.4], color="k", ls="--", lw=1,
                label="uniform shuffle (exact)" if y == 0 else None)
        ax.text(t["labels_obs"], y, f" {t['labels_obs']:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, 12.5)
    ax.set_xlabel(f"distinct labels per batch of {batch} (of 10)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False)
    ax = axes[2]
    lp = [(-np.log10(max(combined_p(t), 1e-300)) if t["chi"] else 0.0) for t in rows]
    ax.barh(names, lp, color=colours)
    ax.axvline(3, color="r", ls="--", lw=1, label="α = 1e-3: bars right of the line are not uniform")
    ax.set_xscale("symlog", linthresh=3)
    ax.set_xlim(0, 1e4)
    for y, t in enumerate(rows):
        if t["chi"]:
            ax.text(lp[y], y, f" p{_peq(combined_p(t))}", va="center", fontsize=8)
    ax.set_xlabel("−log10 p: χ² item×position + adjacent pairs (N=200)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False)
    fig.suptitle(f"Same {n} images, cold page cache, batch {batch}: shardkit (blue) vs per-file, WebDataset, "
                 "MosaicML Streaming", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes(args: argparse.Namespace, built: dict[str, Any], table: list[dict[str, Any]],
          orders: dict[str, Any]) -> list[str]:
    base = next((t for t in table if t["label"].endswith("1 worker")), None)
    if base is None:
        return []
    sk = [t for t in table if "TieredSampler" in t["label"]]
    out = []
    if sk:
        ratios = ", ".join(f"{t['label'].split(', ')[1]} {t['rps'] / base['rps']:.1f}×" for t in sk)
        worst = min(t["rps"] / base["rps"] for t in sk)
        verdict = "met" if worst >= 3.6 else f"MISSED by {(3.6 - worst) / 3.6:.0%}"
        out.append(f"- **Target ≥ 3.6× the 1-worker per-file baseline**: TieredSampler {ratios} — {verdict}. "
                   "The per-file loader is bound by JPEG decode + resize on the CPU; shardkit's records are "
                   "decoded once at conversion (OneAccess's 3.6× was measured with decode in the loop).")
    peers = [t for t in table if t["label"].startswith(("WebDataset", "MosaicML"))]
    if sk and peers:
        fastest = max(peers, key=lambda t: t["rps"])
        for t in sk:
            rel = t["rps"] / fastest["rps"]
            verdict = "met" if rel >= 0.9 else f"MISSED: {1 - rel:.0%} slower, {0.9 - rel:.0%} short of the target"
            out.append(f"- **Target within 10% of the fastest peer ({fastest['label'].split(',')[0]}, "
                       f"{fastest['rps']:,.0f} records/s) or ahead**: {t['label'].split(', ')[1]} "
                       f"{t['rps']:,.0f} records/s = {rel:.2f}× — {verdict}.")
    ssd = next((t for t in sk if "ssd" in t["label"]), None)
    ram = next((t for t in sk if t is not ssd), None)
    if ssd and ram and ssd["rps"] < 0.9 * ram["rps"]:
        ex = ssd["extra"]
        out.append(f"- Why tiers=ram,ssd is slower than tiers=ram ({ssd['rps'] / ram['rps']:.2f}×): the SSD tier "
                   "lives on the same virtual disk as the dataset, so every record is read from the dataset, "
                   f"written into an SSD reservoir ({ex.get('ssd_written', 0) / 1e6:,.0f} MB written) and read "
                   f"back ({ex.get('ssd_bytes', 0) / 1e6:,.0f} MB), with the consumer stalled "
                   f"{ex.get('stall_s', 0):.1f} s of {ssd['seconds']:.1f} s. The tier pays off only when it is "
                   "faster than the dataset's storage (local SSD in front of network or spinning storage); on one "
                   "disk it is pure overhead, which this row measures honestly.")
    passing = [t["label"] for t in table if t["chi"] and uniform(t)]
    failing = [t["label"] for t in table if t["chi"] and not uniform(t)]
    chi_only = [t["label"] for t in table if t["chi"] and t["chi"].passes(ALPHA) and not uniform(t)]
    out.append("- **Target: the only loader that passes the uniformity test at α = 1e-3** (χ² and adjacent pairs, "
               "α/2 each): pass: " + "; ".join(passing) + ". Fail: " + ("; ".join(failing) or "none") + ". "
               + _uniform_note(table))
    if chi_only:
        out.append("- Passing the item×position χ² alone is not enough: " + "; ".join(chi_only) + " pass" +
                   ("es" if len(chi_only) == 1 else "") + " it (each item's position is uniform, because whole "
                   "shards/spans are exchangeable) yet " + ("emits" if len(chi_only) == 1 else "emit") +
                   " storage neighbours together, which the adjacent-pairs test and the distinct-labels column "
                   "expose.")
    same = orders.get("sampler_same_order")
    if same is not None:
        out.append(f"- The two TieredSampler tier settings emitted {'the identical' if same else 'different'} "
                   "orders for the same seed (the order depends on the seed only, not on the tiers).")
    return out


def _uniform_note(table: list[dict[str, Any]]) -> str:
    seq_pass = [t for t in table if t["chi"] and uniform(t) and t["reads"] == "sequential"]
    others = [t for t in table if t["chi"] and uniform(t) and t["reads"] != "sequential"]
    s = ""
    if seq_pass and all("shardkit" in t["label"] for t in seq_pass):
        s += "**Met among loaders that read storage sequentially: only shardkit's sampler passes.** "
    if others:
        s += (f"As literally stated the target is MISSED: {len(others)} loaders that read at random offsets "
              "pass too. ")
    if others:
        s += ("They are " + "; ".join(t["label"] for t in others) + ": a full random permutation is uniform by "
              "construction, and its price is random reads (and, per file, a JPEG decode per record), the cost "
              "shardkit's sampler avoids. ")
        if any(t["label"].startswith("MosaicML") for t in others):
            s += ("MosaicML's default passes only because its 262,144-sample shuffle block exceeds this corpus, "
                  "which also makes it read at random offsets; with the block at its ImageNet ratio it fails.")
    return s


def write_results(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="quick run: 300 JPEGs, 100 order epochs, no RESULTS.md")
    ap.add_argument("--n", type=int, default=3000, help="JPEGs in the corpus (>= 3000 for the recorded run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for the peers")
    ap.add_argument("--epochs", type=int, default=500, help="epochs of the small corpus for the chi-square")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-workers", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--orders-dir", type=Path, default=None,
                    help="where each loader's emitted keys go as <loader>.npy (default benchmarks/_data/orders, "
                         "orders-small with --small); `python benchmarks/order_table.py DIR` tests them")
    ap.add_argument("--only", nargs="*", help="loader kinds to run (perfile random-batched random-pread wds mds "
                    "sampler)")
    ap.add_argument("--no-results", action="store_true", help="do not update RESULTS.md / compare.png")
    ap.add_argument("--build-only", action="store_true", help="build the corpus and formats, measure nothing")
    ap.add_argument("--orders-only", action="store_true",
                    help="only the repeated-epoch order runs on the N = 200 corpus (no JPEG corpus, no timing: "
                         "orders do not depend on the machine's load), then the `shardkit order-test` table")
    args = ap.parse_args()
    if args.small:
        args.n, args.epochs, args.no_results = min(args.n, 300), min(args.epochs, 100), True
    if args.dir is None:
        args.dir = HERE / "_data" / ("compare-small" if args.small else "compare")
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.orders_dir is None:
        args.orders_dir = HERE / "_data" / ("orders-small" if args.small else "orders")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    t0 = time.perf_counter()
    if args.orders_only:
        orders_only(args)
        logger.info("done in %.0f s", time.perf_counter() - t0)
        return
    built = build_all(args)
    if args.build_only:
        logger.info("built in %.0f s", time.perf_counter() - t0)
        return
    start_load = _load()
    logger.info("measuring (load average %s)", start_load)
    rows, orders = measure(args, built)
    end_load = _load()
    table = summarise(args, built, rows, orders)
    md = markdown(args, built, table, orders, start_load, end_load)
    date = time.strftime("%Y-%m-%d")
    header = (f"{args.n} JPEGs ({built['jpeg_bytes'] / 1e6:.0f} MB) → 224×224×3 uint8 records "
              f"({args.n * RECORD_NBYTES / 1e6:.0f} MB per format); batch {args.batch}; one cold epoch per row; "
              f"shardkit dataset written by {built['how']}; load average before measuring {start_load}, at the end "
              f"{end_load} (including this run's own processes); "
              f"{platform.node()}, {os.cpu_count()} cores, {date}")
    print(f"# compare: {header}\n")
    print(md)
    nts = notes(args, built, table, orders)
    print()
    print("\n".join(nts))
    dump = [{k: (asdict(v) if k in ("chi", "pairs") and v else v) for k, v in t.items()} for t in table]
    (args.dir / "compare.json").write_text(json.dumps({"header": header, "rows": dump, "orders": {
        k: {"chi": asdict(v["chi"]), "pairs": asdict(v["pairs"])} for k, v in orders["runs"].items()}},
        indent=1, default=str))
    if not args.no_results:
        chart(HERE / "compare.png", table, args.n, args.batch)
        section = render_section(args, built, table, orders, md, nts, header, date, start_load, end_load)
        write_results(HERE / "RESULTS.md", section)
    else:
        chart(args.dir / "compare.png", table, args.n, args.batch)
    logger.info("done in %.0f s", time.perf_counter() - t0)


def orders_only(args: argparse.Namespace) -> None:
    """``--orders-only``: the order runs and the battery's table (``benchmarks/order_table.py``)."""
    import order_table

    ssd_dir = args.dir / "ssd-tier"
    ssd_dir.mkdir(exist_ok=True)
    work = args.dir / "runs"
    shutil.rmtree(work, ignore_errors=True)
    run_orders(args, build_small(args), work, ssd_dir)
    print(order_table.markdown(order_table.reports(args.orders_dir, ALPHA, args.seed), ALPHA))


def render_section(args: argparse.Namespace, built: dict[str, Any], table: list[dict[str, Any]],
                   orders: dict[str, Any], md: str, nts: list[str], header: str, date: str,
                   start_load: str, end_load: str) -> str:
    chi = next((t["chi"] for t in table if t["chi"]), None)
    # The load at the end includes this run's own processes (a loader and its workers), so only the
    # load before measuring says whether others were using the machine.
    busy = float(start_load.split(", ")[0]) > 1.5
    sampler = [t for t in table if "TieredSampler" in t["label"]]
    sx = "; ".join(f"{t['label'].split(', ')[1]}: K2={t['extra'].get('K2')}, K1={t['extra'].get('K1')}, "
                   f"disk {t['extra'].get('disk_bytes', 0) / 1e6:.0f} MB, SSD-tier reads "
                   f"{t['extra'].get('ssd_bytes', 0) / 1e6:.0f} MB, stalled {t['extra'].get('stall_s', 0):.1f} s"
                   for t in sampler)
    return "\n".join([
        f"{SECTION} (`benchmarks/compare.py`)",
        "",
        f"Machine: 2-core VM, 24 GiB RAM, virtual disk; {date}. Command: "
        "`pip install -e '.[bench]' && python benchmarks/compare.py`.",
        f"{header}.",
        *([] if not busy else ["**The machine was busy during this run (load average above 1.5 before it "
                               "started): other engineers' test runs shared the 2 cores, so absolute numbers are "
                               "low and noisy; the ratios were measured in the same run.**"]),
        "",
        md,
        "",
        "![compare](compare.png)",
        "",
        *nts,
        "",
        "How it was measured:",
        "- One corpus, generated: natural-image-like JPEGs of 500×375 (one in four portrait), quality 90, 10 class "
        "folders. The per-file baseline decodes them (Pillow; shorter side to 224, centre crop: what "
        "ImageFolder + Resize + CenterCrop does). Every other loader reads the same pre-decoded 224×224 uint8 "
        "records, written by its own writer in the same order (class-sorted, as ImageFolder lists them): "
        "shardkit, `webdataset.ShardWriter` tar shards (raw bytes + `.cls` + `__key__`), `streaming.MDSWriter` "
        "(raw `bytes` + label + key columns). No peer decodes JPEG at read time. Peer shards 64 MiB.",
        "- Each row: a fresh process after dropping the page cache of every corpus file; records/s over one "
        "full epoch from loader construction to the last batch (worker start-up included). MB read: the kernel's "
        "I/O accounting (`read_bytes`) of the whole process tree / the bytes of the loader's own dataset files "
        "found in the page cache afterwards (`mincore`; readahead included, other reads excluded; a lower bound if "
        "the kernel evicted pages during the run). Memory: peak "
        "summed PSS of the process tree (every process imports torch, as a training job would; a process that "
        f"only imports numpy and torch has {orders.get('baseline_pss', 0) / 2**20:.0f} MiB).",
        f"- Randomness: distinct labels per batch and Spearman ρ(storage position, emitted position) on the "
        f"measured epoch above (expected value of labels per batch computed exactly from the hypergeometric "
        f"law, for the same batch sizes). χ²: a corpus of N = {built['n_small']} records with the same structure "
        f"scaled to N ({built['small_per_shard']} records per shard; WebDataset buffer {orders['wds_buffer']}, "
        f"initial {orders['wds_initial']}; sampler K2 = {orders['k2']}, K1 = {orders['k1']}), "
        f"{chi.epochs if chi else args.epochs} epochs, item × position table with positions in bins of 10 "
        f"({chi.dof if chi else '?'} degrees of freedom); the statistic is Pearson's X² × (N−1)/N, the exact "
        "large-sample null for sums of uniform permutation matrices (`benchmarks/order_metrics.py`). The χ² "
        "sees each item's position alone, so a shuffle of whole shards passes it; the adjacent-pairs test counts, "
        f"per epoch, consecutive emitted records from the same storage block of {PAIR_BLOCK} keys (exact "
        f"expectation {PAIR_BLOCK - 1} under a uniform shuffle; one-sample t-test over epochs). A loader is "
        "called uniform when both pass at α/2 = 5e-4 (Bonferroni). The per-file "
        "rows share one order run (the order is the DataLoader's RandomSampler, independent of workers), as do "
        "the two random-access rows (same permutation).",
        "- MosaicML Streaming's default shuffle (py1e, block 262,144 samples) is larger than either corpus, so "
        "every sample may land anywhere in the epoch and is read at a random offset of a random shard: on a "
        "small dataset its default *is* a (near) full shuffle with random reads, and every single item's "
        "position is uniform (spans of equal size are exchangeable), so it passes the item×position test. "
        "On datasets much larger than the block it is a block shuffle; the row \"block scaled to its ImageNet "
        f"ratio\" sets `shuffle_block_size` to 262,144 / 1,281,167 = {MDS_IMAGENET_RATIO:.3f} of N "
        f"({round(MDS_IMAGENET_RATIO * args.n)} here, {round(MDS_IMAGENET_RATIO * built['n_small'])} for the χ² "
        "corpus) to show what the default does on ImageNet-1k.",
        "- WebDataset: `WebDataset(urls, shardshuffle=100).shuffle(1000)` (`shardshuffle=True` means 100 in "
        "webdataset 1.x). Its shard order is seeded once per `WebDataset` object, so it repeats every epoch, as in "
        "normal use; DataLoader workers each read their own shards and emit their own (partial) batches.",
        f"- Sampler details: {sx}.",
        "",
    ])


if __name__ == "__main__":
    main()
