"""Memory of the sampler at scale (issue 19): peak RSS and PSS per process, field sharing, SSD use.

Run: ``python benchmarks/memory.py [--quick] [--before /path/to/previous/tree]``.

A dataset of 224x224x3 images with COCO-size per-record fields (``boxes`` float32 ``[100, 4]``,
``box_labels`` int32 ``[100]``, ``num_boxes``, ``label``: about 2 KB a record, zstd-compressed on
disk) is read for one epoch by 2 ranks (2 processes), each with 0, 2 and 4 DataLoader workers, with
``tiers=ram`` and ``tiers=ram,ssd``. A monitor samples every process of the run (ranks and their
workers) every 0.1 s: RSS, PSS, and the PSS of the node-shared field regions it maps. Reported per
configuration:

* the peak RSS of each consumer process above its own RSS when its sampler started (a consumer is a
  rank's main process with 0 workers, else each worker), against ``ram_size`` + 15%;
* the node's total PSS at its peak, and the node's PSS of the fields (one copy, split among the
  processes that map it), from which the PSS an extra worker adds for fields follows (target:
  at most 10% of the field bytes);
* the SSD bytes on disk at their peak, against ``ssd_size`` per consumer.

``--before TREE`` runs the same configurations with the shardkit in ``TREE``. Prints a markdown
table; the numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "memory-bench"
SHAPE = (224, 224, 3)
REC = int(np.prod(SHAPE))
MAX_BOXES = 100
FIELDS = {
    "label": FieldSpec((), "int64"),
    "boxes": FieldSpec((MAX_BOXES, 4), "float32"),
    "box_labels": FieldSpec((MAX_BOXES,), "int32"),
    "num_boxes": FieldSpec((), "int32"),
}
FIELD_BYTES = sum(spec.nbytes for spec in FIELDS.values())
AFTER = str(HERE.parent)
RANKS = 2


def coco_like(path: Path, n: int) -> Path:
    """``n`` images with COCO-size fields (written once, reused while ``n`` matches)."""
    if (path / "zarr.json").exists():
        with open_dataset(path) as ds:
            if ds.num_records == n and set(ds.meta.fields) == set(FIELDS):
                return path
        shutil.rmtree(path)
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *SHAPE), dtype=np.uint8)
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(SHAPE, "uint8"), fields=FIELDS) as w:
        for a in range(0, n, 64):
            k = min(64, n - a)
            boxes = rng.random((k, MAX_BOXES, 4), dtype=np.float32)
            w.write({"image": pattern[:k], "label": np.arange(a, a + k) % 80, "boxes": boxes,
                     "box_labels": rng.integers(0, 80, (k, MAX_BOXES), dtype=np.int32),
                     "num_boxes": rng.integers(0, MAX_BOXES, k, dtype=np.int32)})  # fmt: skip
    return path


# ---------------------------------------------------------------------------------------------- one rank
def rank_job(cfg: dict[str, Any]) -> None:
    """One rank: a DataLoader over ShardIterableDataset for one epoch (run in its own process).

    Every consumer (the rank itself without workers, else each worker) notes its RSS when it starts
    and, once its epoch is over, waits until every consumer of the run is done, reports its peak RSS
    (``VmHWM``) and PSS, and holds on for a moment, so the monitor sees all processes at once.
    """
    import torch  # before the baseline: the framework is not the sampler's memory

    from shardkit.adapters.torch import ShardIterableDataset

    report, consumers = Path(cfg["report"]), cfg["consumers"]
    start = {"rss": _status("VmRSS")}

    def begin(_: int = 0) -> None:
        start["rss"] = _status("VmRSS")

    def finish(role: str) -> None:
        done = Path(f"{report}.done.{os.getpid()}")
        done.touch()
        deadline = time.monotonic() + 600
        while len(list(report.parent.glob(f"{report.name}.done.*"))) < consumers and time.monotonic() < deadline:
            time.sleep(0.02)
        note = {"pid": os.getpid(), "role": role, "start": start["rss"], "peak": _status("VmHWM"),
                "pss": _pss(os.getpid()), "field_pss": _field_pss(os.getpid())}  # fmt: skip
        with report.open("a") as f:
            f.write(json.dumps(note) + "\n")
        time.sleep(1.0)  # every process alive and stable for the monitor

    class Measured(ShardIterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from super().__iter__()
            finish("worker" if torch.utils.data.get_worker_info() is not None else "rank")

    workers = cfg["workers"]
    ds = Measured(cfg["path"], batch_size=cfg["batch"], tiers=cfg["tiers"], ram_size=cfg["ram"], ssd_size=cfg["ssd"],
                  ssd_dir=cfg["ssd_dir"], rank=cfg["rank"], world_size=RANKS, seed=0, num_workers=workers)  # fmt: skip
    begin()
    loader = ds.loader(num_workers=workers, worker_init_fn=begin if workers else None)
    for batch in loader:
        del batch


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory line in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------------- monitor
def _field_pss(pid: int) -> int:
    """PSS of the node-shared field regions ``pid`` maps (bytes)."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    inside = "/shardkit-" in line and "/field-" in line
                elif inside and line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


class Monitor:
    """Samples the run's processes (the rank processes and their descendants) and the SSD directory."""

    def __init__(self, pids: list[int], ssd_dir: Path, period: float = 0.1) -> None:
        import psutil

        self.psutil = psutil
        self.roots = [psutil.Process(p) for p in pids]
        self.ssd_dir, self.period = ssd_dir, period
        self.peak_rss: dict[int, int] = {}
        self.peak_node_pss = 0
        self.peak_field_pss = 0
        self.peak_ssd = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _procs(self) -> list[Any]:
        out = []
        for root in self.roots:
            try:
                out += [root, *root.children(recursive=True)]
            except self.psutil.Error:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            node_pss = field_pss = 0
            for p in self._procs():
                try:
                    info = p.memory_full_info()
                except self.psutil.Error:
                    continue
                self.peak_rss[p.pid] = max(self.peak_rss.get(p.pid, 0), info.rss)
                node_pss += info.pss
                field_pss += _field_pss(p.pid)
            self.peak_node_pss = max(self.peak_node_pss, node_pss)
            self.peak_field_pss = max(self.peak_field_pss, field_pss)
            self.peak_ssd = max(self.peak_ssd, _tree_bytes(self.ssd_dir))
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def run_config(tree: str, path: Path, tiers: str, workers: int, ram: int, ssd: int, batch: int) -> dict[str, Any]:
    ssd_dir = Path(tempfile.mkdtemp(prefix="sk-mem-ssd-", dir=HERE / "_data"))
    report = ssd_dir.with_suffix(".jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(HERE)])}
    procs = []
    for r in range(RANKS):
        cfg = {"path": str(path), "batch": batch, "tiers": tiers, "ram": ram, "ssd": ssd, "ssd_dir": str(ssd_dir),
               "rank": r, "workers": workers, "report": str(report), "consumers": RANKS * max(1, workers)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-job", json.dumps(cfg)], env=env))
    mon = Monitor([p.pid for p in procs], ssd_dir, period=0.05)
    try:
        for p in procs:
            if p.wait(timeout=3600) != 0:
                raise RuntimeError(f"rank process failed with {p.returncode}")
    finally:
        mon.stop()
    notes = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    shutil.rmtree(ssd_dir, ignore_errors=True)
    for f in [report, *report.parent.glob(f"{report.name}.done.*")]:
        f.unlink(missing_ok=True)
    return {"consumer_peak": max((n["peak"] - n["start"] for n in notes), default=0), "consumers": len(notes),
            "node_pss": mon.peak_node_pss, "field_pss": mon.peak_field_pss, "ssd_peak": mon.peak_ssd,
            "processes": len(mon.peak_rss), "consumer_field_pss": max((n["field_pss"] for n in notes), default=0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--ram", default=256 << 20, type=int, help="ram_size per consumer (bytes)")
    ap.add_argument("--ssd", default=512 << 20, type=int, help="ssd_size per consumer (bytes)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--before", help="a shardkit tree to compare with")
    ap.add_argument("--quick", action="store_true", help="a small dataset and small budgets: a smoke run")
    ap.add_argument("--rank-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_job:
        rank_job(json.loads(args.rank_job))
        return
    if args.quick:
        args.records, args.ram, args.ssd, args.batch = 400, 24 << 20, 48 << 20, 16
    path = coco_like(DATA.with_name(DATA.name + ("-quick" if args.quick else "")), args.records)
    fields = args.records * FIELD_BYTES
    trees = {"after": AFTER, **({"before": args.before} if args.before else {})}
    lines = [
        f"{args.records} records of {REC} B + fields of {FIELD_BYTES} B/record ({fields / 2**20:.1f} MiB of fields), "
        f"{RANKS} ranks, batch {args.batch}, ram_size {args.ram / 2**20:.0f} MiB and ssd_size {args.ssd / 2**20:.0f} "
        "MiB per consumer, one epoch",
        "",
        "| sampler | tiers | workers/rank | processes | consumer peak RSS - start | <= ram+15% | node PSS (peak) | "
        "fields PSS on node | fields PSS per consumer | SSD peak | <= ssd budget |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    field_by: dict[tuple[str, str, int], int] = {}
    for name, tree in trees.items():
        for tiers in ("ram", "ram,ssd"):
            for workers in (0, 2, 4):
                r = run_config(tree, path, tiers, workers, args.ram, args.ssd, args.batch)
                field_by[(name, tiers, workers)] = r["field_pss"]
                ssd_budget = args.ssd * r["consumers"]
                lines.append(
                    f"| {name} | {tiers} | {workers} | {r['processes']} | {r['consumer_peak'] / 2**20:,.0f} MiB | "
                    f"{'met' if r['consumer_peak'] <= 1.15 * args.ram else '**missed**'} | "
                    f"{r['node_pss'] / 2**20:,.0f} MiB | {r['field_pss'] / 2**20:,.1f} MiB | "
                    f"{r['consumer_field_pss'] / 2**20:,.2f} MiB | "
                    f"{r['ssd_peak'] / 2**20:,.0f} MiB | "
                    f"{'' if tiers == 'ram' else ('met' if r['ssd_peak'] <= ssd_budget else '**missed**')} |"
                )
    per_worker = [(field_by[("after", t, 4)] - field_by[("after", t, 2)]) / (2 * RANKS) for t in ("ram", "ram,ssd")]
    lines += ["", "Field PSS an extra worker adds to the node (after, 2 -> 4 workers per rank): "
              + ", ".join(f"{x / 2**10:,.1f} KiB = {x / fields:.1%} of the field bytes" for x in per_worker)
              + " (target <= 10%)"]  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
