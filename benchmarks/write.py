"""Writer throughput: ``shardkit.write`` vs LitData ``optimize`` and Streaming ``MDSWriter``, same function, same inputs.

Issue 35, done-when 2. The inputs are the JPEGs of ``benchmarks/convert.py`` (made once, cached in
``benchmarks/_data/convert_jpegs``) as ``(path, label)`` pairs in class order; the function is
``_convert_peers._litdata_item``: open, RGB, resize the shorter side to 224 (bilinear), centre crop,
``{"image": uint8[224, 224, 3], "label": int}``. Every system runs that very function:

* ``shardkit``: ``shardkit.write(fn, inputs, out, workers=W)`` (this venv);
* ``litdata``: ``litdata.optimize(fn, inputs, num_workers=W)``, and ``mds``: W processes each an
  ``MDSWriter`` over a contiguous slice, then ``merge_index`` (both in the bench venv
  ``SHARDKIT_BENCH_PYTHON``, default ``/work/benchvenv/bin/python``, through ``_convert_peers.py``, as
  ``benchmarks/convert.py`` runs them; their clock starts after their imports, as shardkit's: its lazy
  ``shardkit.write`` is looked up, importing ``shardkit.converters``, before the clock starts).

Every output is uncompressed with 256 MiB shards. Each round runs every variant once, interleaved, after
dropping the JPEGs' page cache, and each run is **the whole command a user runs**: a fresh Python process
that imports its writer, writes and exits (shardkit: this script with ``--one``; the peers:
``_convert_peers.py``). The headline images/s is that command's wall time; the CPU seconds per image are
those of the command and every process below it (this script is a child subreaper, so a fork server
orphaned at exit is reaped, and counted, here). "writing" is the writer's own clock inside the command
(after its imports, as the peers' ``_convert_peers.py`` measures it), and the CPU of that writing is
split between the command's own process (for shardkit the parent: decode loop, writer thread, commit)
and the processes below it (the decode workers). The table gives the median over the
rounds with the range (a shared machine is noisy: read the spread), and the bytes each output holds.
Each round also gives shardkit's ratio to every peer at the same worker count (their runs are
interleaved in that round, so they met the same load): the median of those per-round ratios and their
range are the comparison to quote.

How the peers parallelise (not the same as shardkit): shardkit's workers decode in input order and one
writer cuts fixed-size shards, so the output is byte-identical for any worker count; Streaming's W
processes are forked, each writes its own ``MDSWriter`` directory over a contiguous slice of the inputs
and ``merge_index`` joins the indexes (W sets of shards, a different output for every W); LitData's
``optimize`` starts its own worker processes and writes chunks per worker.

Usage: ``python benchmarks/write.py [--images 1000] [--rounds 3] [--workers 1,2] [--no-peers] [--quick]``
(``--one OUT``: one shardkit run in this process, JSON on stdout; what each round starts)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import drop_cache
from _convert_peers import _litdata_item, corpus
from convert import BENCH_PYTHON, DATA, HERE, make_corpus

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


def own_cpu() -> float:
    """CPU seconds of this process alone, every thread (the parent: decode loop, writer thread, commit)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def shardkit_write(out: Path, workers: int) -> tuple[float, float, float]:
    """Seconds, CPU seconds of every process and CPU seconds of this process alone of one
    ``shardkit.write`` of the corpus into ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    items = corpus(DATA)
    write = shardkit.write  # imports shardkit.converters (lazy) before the clock, as the peers' modules are
    cpu0, own0 = tree_cpu(), own_cpu()
    t0 = time.perf_counter()
    s = write(_litdata_item, items, out, workers=workers, progress=False)
    dt = time.perf_counter() - t0
    assert s.records == len(items), s
    return dt, tree_cpu() - cpu0, own_cpu() - own0


def _reap_orphans() -> None:
    """Wait for every process reparented to this one (a fork server outliving its program), so that
    ``RUSAGE_CHILDREN`` holds their CPU time."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def command(system: str, out: Path, workers: int) -> dict[str, Any]:
    """One whole command in a fresh process: its wall seconds, CPU seconds (it and every process below
    it) and what it reported (``seconds`` of writing, ``bytes``); ``{}`` with a message when it failed."""
    if system == "shardkit":
        cmd = [sys.executable, str(HERE / "write.py"), "--one", str(out), "--workers", str(workers)]
    else:
        cmd = [str(BENCH_PYTHON), str(HERE / "_convert_peers.py"), system, str(DATA), str(out), str(workers)]
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    _reap_orphans()
    cpu = _children_cpu() - cpu0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": proc.stderr.strip().splitlines()[-1:] or "no output"}
    if "error" in res:
        print(f"[{system}, {workers} workers] failed: {res['error']}")
        return {}
    return {**res, "writing_cpu": res.get("cpu", float("nan")), "wall": wall, "cpu": cpu}


def one(out: Path, workers: int) -> None:
    """``--one``: write the corpus into ``out`` in this process, print the JSON line :func:`command` reads."""
    dt, cpu, parent = shardkit_write(out, workers)
    size = dir_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"seconds": dt, "bytes": size, "cpu": cpu, "parent_cpu": parent}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median and range reported)")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    ap.add_argument("--no-peers", action="store_true", help="shardkit only")
    ap.add_argument("--quick", action="store_true", help="200 images, one round: a smoke run")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        one(args.one, int(args.workers))
        return
    if args.quick:
        args.images, args.rounds = 200, 1
    files = make_corpus(args.images)
    n = len(files)
    counts = [int(w) for w in args.workers.split(",")]
    systems = ["shardkit"] + ([] if args.no_peers else ["litdata", "mds"])
    if not args.no_peers and not BENCH_PYTHON.exists():
        print(f"peers skipped: {BENCH_PYTHON} not found (set SHARDKIT_BENCH_PYTHON)")
        systems = ["shardkit"]
    with contextlib.suppress(OSError, AttributeError):  # orphans of the commands come here
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-bench-write-"))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for r in range(args.rounds):
            for system in systems:
                for w in counts:
                    out = tmp / f"{system}-{w}"
                    shutil.rmtree(out, ignore_errors=True)
                    drop_cache(files)
                    res = command(system, out, w)
                    shutil.rmtree(out, ignore_errors=True)
                    if not res:
                        continue
                    runs.setdefault((system, w), []).append({**res, "round": r})
                    parent, rest = _split(res)
                    print(f"round {r + 1}: {system} x{w}: {n / res['wall']:.1f} images/s (command), "
                          f"{n / float(res['seconds']):.1f} (writing), {1e3 * res['cpu'] / n:.1f} CPU ms/image, "
                          f"writing: {1e3 * parent / n:.2f} parent + {1e3 * rest / n:.2f} workers CPU ms/image, "
                          f"{int(res['bytes']) / 1e6:.1f} MB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{n} JPEGs (~500x375) -> 224x224x3 uint8 + label; {args.rounds} interleaved rounds; each a fresh "
          f"process, page cache dropped; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| writer | workers | images/s, whole command (median) | range | images/s, writing only (median) | range | "
          "CPU ms/image (median, all processes) | writing: CPU ms/image of the parent | of the workers | MB written |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (system, w), done in runs.items():
        rates = sorted(n / d["wall"] for d in done)
        writing = sorted(n / float(d["seconds"]) for d in done)
        per_image = statistics.median(1e3 * d["cpu"] / n for d in done)
        parent = statistics.median(1e3 * _split(d)[0] / n for d in done)
        rest = statistics.median(1e3 * _split(d)[1] / n for d in done)
        print(f"| {SYSTEMS[system]} | {w} | {statistics.median(rates):.1f} | {rates[0]:.1f}-{rates[-1]:.1f} | "
              f"{statistics.median(writing):.1f} | {writing[0]:.1f}-{writing[-1]:.1f} | {per_image:.1f} | "
              f"{parent:.2f} | {rest:.2f} | {int(done[-1]['bytes']) / 1e6:.1f} |")
    paired = round_ratios(runs, n)
    if paired:
        print("\n| shardkit.write ÷ | workers | rounds | writing only: median ratio (range) | "
              "whole command: median ratio (range) |")
        print("|---|---|---|---|---|")
        for (peer, w), (writing, whole) in paired.items():
            print(f"| {SYSTEMS[peer]} | {w} | {len(writing)} | {statistics.median(writing):.2f}x "
                  f"({min(writing):.2f}-{max(writing):.2f}) | {statistics.median(whole):.2f}x "
                  f"({min(whole):.2f}-{max(whole):.2f}) |")


def round_ratios(runs: dict[tuple[str, int], list[dict[str, Any]]],
                 n: int) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """Per peer and worker count: shardkit's images/s over the peer's in each round (writing only, whole
    command), pairing the runs of one round; rounds where either failed are left out."""
    out: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for (system, w), done in runs.items():
        ours = {d["round"]: d for d in runs.get(("shardkit", w), [])}
        if system == "shardkit" or not ours:
            continue
        pairs = [(ours[d["round"]], d) for d in done if d["round"] in ours]
        if pairs:
            out[(system, w)] = ([float(b["seconds"]) / float(a["seconds"]) for a, b in pairs],
                                [b["wall"] / a["wall"] for a, b in pairs])
    return out


def _split(res: dict[str, Any]) -> tuple[float, float]:
    """CPU seconds of the writing, in the command's own process and in the processes below it (its
    workers); NaN when the writer did not report them."""
    parent = float(res.get("parent_cpu", float("nan")))
    return parent, float(res.get("writing_cpu", float("nan"))) - parent

if __name__ == "__main__":
    main()
