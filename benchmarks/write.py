"""Writer throughput: ``shardkit.write`` vs LitData ``optimize`` and Streaming ``MDSWriter``, same function, same inputs.

Issue 35, done-when 2. The inputs are the JPEGs of ``benchmarks/convert.py`` (made once, cached in
``benchmarks/_data/convert_jpegs``) as ``(path, label)`` pairs in class order; the function is
``_convert_peers._litdata_item``: open, RGB, resize the shorter side to 224 (bilinear), centre crop,
``{"image": uint8[224, 224, 3], "label": int}``. Every system runs that very function:

* ``shardkit``: ``shardkit.write(fn, inputs, out, workers=W)`` (this venv);
* ``litdata``: ``litdata.optimize(fn, inputs, num_workers=W)``, and ``mds``: W processes each an
  ``MDSWriter`` over a contiguous slice, then ``merge_index`` (both in the bench venv
  ``SHARDKIT_BENCH_PYTHON``, default ``/work/benchvenv/bin/python``, through ``_convert_peers.py``, as
  ``benchmarks/convert.py`` runs them; their clock starts after their imports, as shardkit's).

Every output is uncompressed with 256 MiB shards. Each round runs every variant once, interleaved, after
dropping the JPEGs' page cache; the table gives the median images/s over the rounds with the range
(a shared machine is noisy: read the spread), the CPU seconds per image of the writer and all its
worker processes (what survives a loaded machine best), and the bytes each output holds.

Usage: ``python benchmarks/write.py [--images 1000] [--rounds 3] [--workers 1,2] [--no-peers] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import drop_cache
from _convert_peers import _litdata_item, corpus
from convert import BENCH_PYTHON, DATA, make_corpus, peer_report

import shardkit
from shardkit.converters.pipeline import dir_bytes

SYSTEMS = {"shardkit": "shardkit.write", "litdata": "LitData optimize", "mds": "Streaming MDSWriter"}


def tree_cpu() -> float:
    """CPU seconds of this process and every process below it, running or ended (the decode workers
    are children of the fork server, itself a child of this process: they count once it reaps them)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def shardkit_write(out: Path, workers: int) -> tuple[float, float]:
    """Seconds and CPU seconds (every process) of one ``shardkit.write`` of the corpus into ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    items = corpus(DATA)
    cpu0 = tree_cpu()
    t0 = time.perf_counter()
    s = shardkit.write(_litdata_item, items, out, workers=workers, progress=False)
    dt = time.perf_counter() - t0
    assert s.records == len(items), s
    return dt, tree_cpu() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median and range reported)")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    ap.add_argument("--no-peers", action="store_true", help="shardkit only")
    ap.add_argument("--quick", action="store_true", help="200 images, one round: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.images, args.rounds = 200, 1
    files = make_corpus(args.images)
    n = len(files)
    counts = [int(w) for w in args.workers.split(",")]
    systems = ["shardkit"] + ([] if args.no_peers else ["litdata", "mds"])
    if not args.no_peers and not BENCH_PYTHON.exists():
        print(f"peers skipped: {BENCH_PYTHON} not found (set SHARDKIT_BENCH_PYTHON)")
        systems = ["shardkit"]
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-bench-write-"))
    seconds: dict[tuple[str, int], list[float]] = {}
    nbytes: dict[tuple[str, int], int] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for system in systems:
                for w in counts:
                    out = tmp / f"{system}-{w}"
                    shutil.rmtree(out, ignore_errors=True)
                    drop_cache(files)
                    if system == "shardkit":
                        (dt, used), size = shardkit_write(out, w), dir_bytes(out)
                    else:  # the peer's own report: its output is gone when it returns
                        report = peer_report(system, out, w)
                        dt, size = float(report.get("seconds", "inf")), int(report.get("bytes", 0))
                        used = float(report.get("cpu", "nan"))
                    seconds.setdefault((system, w), []).append(dt)
                    cpu.setdefault((system, w), []).append(used)
                    nbytes[(system, w)] = size
                    print(f"round {r + 1}: {system} x{w}: {n / dt:.1f} images/s, {1e3 * used / n:.1f} CPU ms/image, "
                          f"{size / 1e6:.1f} MB", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{n} JPEGs (~500x375) -> 224x224x3 uint8 + label; {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| writer | workers | images/s (median) | range | CPU ms/image (median, all processes) | MB written |")
    print("|---|---|---|---|---|---|")
    for (system, w), times in seconds.items():
        rates = sorted(n / t for t in times)
        per_image = statistics.median(1e3 * c / n for c in cpu[(system, w)])
        print(f"| {SYSTEMS[system]} | {w} | {statistics.median(rates):.1f} | {rates[0]:.1f}-{rates[-1]:.1f} | "
              f"{per_image:.1f} | {nbytes[(system, w)] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
