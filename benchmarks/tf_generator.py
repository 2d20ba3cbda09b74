"""Cold passes of the tiered sampler driven by TensorFlow's ``from_generator``, next to the bare sampler.

Run: ``python benchmarks/tf_generator.py [--records N] [--repeats R] [--before TREE] [--warm]`` (reuses
``benchmarks/_data/adapters-bench``, 10 000 224x224x3 records, written by ``adapters.py`` if missing).
It isolates the cold tf.data cap found in the adapters benchmark (RESULTS.md, "tf.data lets go of its
holder"): the generator builds a ``TieredSampler`` and yields only each batch's keys, so no payload
crosses into TensorFlow and the adapter's own work (DLPack adoption, presentation) is out of the
picture. That row keeps tf.data's default options, autotuning on: deleting its iterator waits for the
autotuning thread's next wake-up (10 ms x (2^k - 1) after the pass began: 0.63, 1.27, 2.55 s ...), which
is the cap; ``make_tf_dataset`` turns autotuning off (docs/adapters.md). The ``make_tf_dataset`` rows
are the adapter itself (payload included, its default prefetch), built before the clock as
``adapters.py`` does, so they compare with the bare sampler built the same way. Each configuration runs
with the node-shared static cache (``auto``) and without it (``0``); passes are interleaved and the page
cache is dropped before each (``--warm``: kept, so a fast drive's rate is what the disk allows and any
cap is the pipeline's own; ``--host-warm``: before each pass the files are read once in plain 8 MiB
reads and dropped from the page cache again). On a virtual machine dropping the guest's page cache
leaves the host's, so a "cold" pass reads either from the device or from the host's cache, whichever it
happens to meet (on the 2-core VM of RESULTS.md: about 590 MB/s against 1.5-1.9 GB/s); ``--host-warm``
makes every pass meet the host's cache, so the ratios compare the pipelines on one device, and prints
the priming reads' rate. Prints records/s per pass, its median, the ratio to the bare pass of the same
round (median [min, max]), and the process's CPU cores used during the pass (CPU seconds / wall seconds: low means it waits for the disk).

Every configuration runs in a child process per shardkit tree (TensorFlow imported once in each);
``--before TREE`` adds a child running an older tree (e.g. ``git archive`` of main), whose passes are
interleaved with this tree's, so before and after meet the same disk in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
from _common import DeviceThrottle, device_rates, drop_cache, synthetic_dataset, throttled_device

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "adapters-bench"
AFTER = HERE.parent
BATCH = 256
CONFIGS = ("bare", "generator", "adapter")
LABELS = {
    "bare": "bare TieredSampler",
    "generator": "from_generator (keys only)",
    "adapter": "make_tf_dataset (payload, built before the clock)",
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


Pass = tuple[float, float, float]  # records/s, cores used, seconds to the first batch


def timed(batches: Iterable[dict[str, object]], n: int) -> Pass:
    """(records/s, cores used, seconds to the first batch) of one pass, from ``iter()`` to the last batch."""
    c0, t0 = _cpu(), time.perf_counter()
    got, first = 0, 0.0
    for b in batches:
        if not got:
            first = time.perf_counter() - t0
        got += int(np.asarray(b["key"]).shape[0])
    wall = time.perf_counter() - t0
    if got != n:
        raise RuntimeError(f"expected {n} records in a pass, got {got}")
    return n / wall, (_cpu() - c0) / wall, first


def bare(path: Path, n: int, epoch: int, static_cache: str) -> Pass:
    from shardkit.readers import TieredSampler

    sampler = TieredSampler(path, batch_size=BATCH, seed=0, start_epoch=epoch, static_cache=static_cache)
    sampler.hold_shared()
    try:
        return timed(sampler, n)
    finally:
        sampler.close()


def generator(path: Path, n: int, epoch: int, static_cache: str) -> Pass:
    import tensorflow as tf

    from shardkit.readers import TieredSampler

    def keys() -> Iterator[dict[str, np.ndarray]]:
        sampler = TieredSampler(path, batch_size=BATCH, seed=0, start_epoch=epoch, static_cache=static_cache)
        try:
            for batch in sampler:
                yield {"key": batch["key"]}
        finally:
            sampler.close()

    ds = tf.data.Dataset.from_generator(keys, output_signature={"key": tf.TensorSpec((None,), tf.int64)})
    return timed(ds, n)


def adapter(path: Path, n: int, epoch: int, static_cache: str) -> Pass:
    from shardkit.adapters.tf import make_tf_dataset

    ds = make_tf_dataset(path, batch_size=BATCH, seed=0, start_epoch=epoch, static_cache=static_cache)
    try:
        return timed(ds, n)
    finally:
        del ds  # its holder (static cache) goes with it
        gc.collect()


def plain_read(path: Path) -> float:
    """MB/s of one sequential read of every file under ``path`` in 8 MiB reads (unbuffered)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(8 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t0) / 1e6


def child(path: Path, n: int) -> None:
    """Serve passes: read ``CONFIG STATIC_CACHE EPOCH`` lines, answer ``RATE CORES FIRST`` (one process per tree)."""
    import tensorflow  # noqa: F401  (imported before any clock)

    runs: dict[str, Callable[[Path, int, int, str], Pass]] = {
        "bare": bare, "generator": generator, "adapter": adapter,
    }  # fmt: skip
    # One untimed short pass of each: tf.data tracing and first-use costs are paid here.
    for name in ("generator", "adapter"):
        runs[name](path, n, 0, "0")
    print("ready", flush=True)
    for line in sys.stdin:
        name, cache, epoch = line.split()
        print(" ".join(map(str, runs[name](path, n, int(epoch), cache))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--before", help="an older shardkit tree whose adapter runs in the same rounds")
    parser.add_argument("--warm", action="store_true",
                        help="keep the files in the page cache (a fast NVMe drive: the disk is not the limit)")
    parser.add_argument("--host-warm", action="store_true",
                        help="read the files once and drop them again before each pass, so every cold pass "
                             "meets the same device (on a VM: the host's cache)")
    parser.add_argument("--device-mbps", help="comma-separated read rates in MB/s: the rounds run once at each, "
                        "with the dataset's disk throttled to it (needs root and a cgroup io controller, else "
                        "says so and runs unthrottled)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.epoch = 0  # every pass a new epoch, over all rates
    path = synthetic_dataset(DATA, args.records)
    if args.child:
        child(path, args.records)
        return

    trees = {"after": AFTER, **({"before": Path(args.before).resolve()} if args.before else {})}
    device: contextlib.AbstractContextManager[DeviceThrottle | None] = (
        throttled_device(path) if args.device_mbps else contextlib.nullcontext())
    with device as dev:  # the children are started inside: their reads go through it too
        procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for tree, root in trees.items():
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(HERE)])}
                procs[tree] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--records", str(args.records), "--child"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(root),
                )  # fmt: skip
                assert procs[tree].stdout is not None
                if procs[tree].stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                    raise RuntimeError(f"the {tree} tree's child failed to start")
            for mbps in device_rates(args.device_mbps):
                rate_line = dev.set(mbps) if dev is not None else ""
                report(path, args, procs, measure(path, args, procs), rate_line)
        finally:
            for proc in procs.values():
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait()


Row = tuple[str, str, str]  # tree, configuration, static cache


def measure(path: Path, args: argparse.Namespace, procs: dict[str, subprocess.Popen[str]]) -> dict[Row, list[Pass]]:
    """Every row's passes, interleaved over ``args.repeats`` rounds (the bare sampler of each tree is its
    own baseline); the primes' rates under the key ``("", "prime", "")``."""
    rows = [(tree, name, cache) for cache in ("auto", "0") for tree in procs for name in CONFIGS
            if tree == "after" or name != "generator"]  # fmt: skip
    runs: dict[Row, list[Pass]] = {row: [] for row in rows}
    primes: list[Pass] = []
    for _ in range(args.repeats):
        for tree, name, cache in rows:
            if args.host_warm and not args.warm:
                drop_cache(path)
                primes.append((plain_read(path), 0.0, 0.0))
            if not args.warm:
                drop_cache(path)
            proc = procs[tree]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{name} {cache} {args.epoch}\n")
            proc.stdin.flush()
            rate, cores, first = (float(x) for x in proc.stdout.readline().split())
            runs[(tree, name, cache)].append((rate, cores, first))
            args.epoch += 1
    if primes:
        runs[("", "prime", "")] = primes
    return runs


def report(path: Path, args: argparse.Namespace, procs: dict[str, subprocess.Popen[str]],
           runs: dict[Row, list[Pass]], device: str) -> None:  # fmt: skip
    """Print the table of one :func:`measure`, headed by the device's rate when it is throttled."""
    load = os.getloadavg()
    how = "warm (files kept in the page cache)" if args.warm else "cold (page cache dropped before each pass)"
    primes = [p[0] for p in runs.pop(("", "prime", ""), [])]
    if primes:
        how += (f"; host-warm: the files read once before each drop, at {statistics.median(primes):,.0f} MB/s "
                f"(median; {min(primes):,.0f}-{max(primes):,.0f})")
    if device:
        how += f"; {device}"
    print(f"{args.records} records of 224x224x3 uint8, batch {BATCH}, {how}, "
          f"{args.repeats} interleaved rounds; {os.cpu_count()} CPUs; load average at the end "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")  # fmt: skip
    print("| tree | static cache | configuration | records/s per pass | median | vs bare, same round: median [min, max] "
          "| cores used (median) | first batch ms (median) |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|")
    for (tree, name, cache), rs in runs.items():
        base = runs[(tree, "bare", cache)]
        ratios = [r[0] / b[0] for r, b in zip(rs, base)]
        rates = ", ".join(f"{r[0]:,.0f}" for r in rs)
        print(f"| {tree} | {cache} | {LABELS[name]} | {rates} | {statistics.median(r[0] for r in rs):,.0f} | "
              f"{statistics.median(ratios):.0%} [{min(ratios):.0%}, {max(ratios):.0%}] | "
              f"{statistics.median(r[1] for r in rs):.2f} | {statistics.median(r[2] for r in rs) * 1e3:.0f} |")  # fmt: skip
    print(flush=True)


if __name__ == "__main__":
    main()
