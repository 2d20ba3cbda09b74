"""Throughput of the framework adapters next to the bare tiered sampler, in the same run.

Run: ``python benchmarks/adapters.py`` (generates ``benchmarks/_data/adapters-bench`` once: 10 000
224x224x3 uint8 records, about 1.5 GB). Every configuration iterates one whole epoch (batch 256,
RAM tier only) and its time counts from ``iter()`` to the last batch, so sampler start-up, DataLoader
worker start-up and tf.data set-up are all included (one untimed short pass per configuration
first pays the framework imports and tf.data tracing). The page cache is dropped (posix_fadvise
DONTNEED on every file) before each cold run; warm runs read from the page cache, where the sampler
is fastest and the adapters' overhead weighs most. The consumer only counts records.

Each configuration is built before the clock starts and let go of after its pass (a training run
builds its loader once and iterates it every epoch): building a ``ShardIterableDataset`` or
``make_tf_dataset`` attaches the node-shared static cache that its holder keeps across epochs
(measured: about 0.11 s of ``posix_fallocate`` for this dataset), so the bare sampler attaches its own
(``hold_shared``) before the clock too, and every pass starts with an empty cache (a tf.data dataset
lets go of its holder when it is collected; before that was so, the tf.data process kept the cache its
first pass filled for every later pass, bare and tf.data alike).

Configurations: bare ``TieredSampler``; ``ShardIterableDataset`` through ``DataLoader`` with 0
and 2 workers (``batch_size=None``); ``make_tf_dataset`` iterated eagerly, with its default
``prefetch(AUTOTUNE)`` and without. For context, a DataLoader whose 2 workers read nothing and only
ship batches of the same size measures what worker IPC alone allows (they copy every batch into
shared memory, as DataLoader did with shardkit's workers before they handed over their shared
buffers). Targets (issue 15), as the median of paired passes against the bare sampler: DataLoader
0 workers >= 100 %, 2 workers >= 80 %, tf.data >= 90 %, warm and cold. Prints a markdown table for benchmarks/RESULTS.md, with the CPU time
per batch (process + finished workers), which other tenants of a shared machine do not disturb.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
from _common import drop_cache, synthetic_dataset

from shardkit.readers import TieredSampler

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "adapters-bench"
SHAPE = (224, 224, 3)
BATCH = 256
#: Issue 15's targets: records/s as a fraction of the bare sampler's in the same run.
TARGETS = {"torch DataLoader, 0 workers": 1.0, "torch DataLoader, 2 workers": 0.8, "tf.data (make_tf_dataset)": 0.9}




def warm_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(8 << 20):
                    pass


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Prepared(NamedTuple):
    """A configuration built before the clock starts, and how to let go of it after its pass."""

    iterable: Iterable
    close: Callable[[], None]


def timed(source: Iterable, count: Callable[[object], int], n: int) -> tuple[float, float]:
    """(records/s, CPU ms per batch) of one full pass over ``source``, from ``iter()`` to the last batch;
    checks it delivered ``n`` records.

    CPU time is the steadier measure on a shared machine: other tenants slow the wall clock but do
    not add to our CPU time, so it shows what an adapter costs on top of the sampler.
    """
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    got = 0
    for batch in source:
        got += count(batch)
    elapsed = time.perf_counter() - t0
    if got != n:
        raise RuntimeError(f"expected {n} records in a pass, got {got}")
    return n / elapsed, (_cpu_seconds() - cpu0) * 1e3 / (n / BATCH)


def bare(path: Path, epoch: int) -> Prepared:
    sampler = TieredSampler(path, batch_size=BATCH, seed=0, start_epoch=epoch)
    sampler.hold_shared()  # attached before the clock, as each adapter's holder is
    return Prepared(sampler, sampler.close)


def torch_loader(path: Path, epoch: int, workers: int) -> Prepared:
    from shardkit.adapters.torch import ShardIterableDataset

    ds = ShardIterableDataset(path, batch_size=BATCH, seed=0, num_workers=workers)
    ds.set_epoch(epoch)
    return Prepared(ds.loader(num_workers=workers), ds.close)


def ipc_ceiling(n: int, workers: int) -> Prepared:
    """DataLoader moving batches of the same size from ``workers`` processes that do no reading at all:
    the most any worker-based pipeline can deliver on this machine."""
    import torch

    class Blank(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            info = torch.utils.data.get_worker_info()
            w, k = (info.id, info.num_workers) if info is not None else (0, 1)
            for start in range(w * BATCH, n, k * BATCH):
                size = min(BATCH, n - start)
                images = np.empty((size, *SHAPE), np.uint8)
                images[:, 0] = 1  # touch the rows, as a reader would
                yield {"image": torch.from_numpy(images), "key": torch.arange(start, start + size)}

    return Prepared(torch.utils.data.DataLoader(Blank(), batch_size=None, num_workers=workers), lambda: None)


def tf_dataset(path: Path, epoch: int, prefetch: bool = True) -> Prepared:
    from shardkit.adapters.tf import make_tf_dataset

    ds = make_tf_dataset(path, batch_size=BATCH, seed=0, start_epoch=epoch, prefetch=prefetch)
    # make_tf_dataset has no close(): its holder goes when the dataset is collected.
    return Prepared(ds, gc.collect)


def run_configs(
    names: list[str], path: Path, n: int, repeats: int, cache: str
) -> dict[str, list[tuple[float, float]]]:
    """Interleaved repeats (bare, adapter, bare, adapter, ...) so machine noise hits all alike."""
    configs: dict[str, tuple[Callable[[int], Prepared], Callable[[object], int]]] = {
        "bare": (lambda e: bare(path, e), lambda b: int(b["key"].shape[0])),
        "torch0": (lambda e: torch_loader(path, e, 0), lambda b: int(b["key"].shape[0])),
        "torch2": (lambda e: torch_loader(path, e, 2), lambda b: int(b["key"].shape[0])),
        "tf": (lambda e: tf_dataset(path, e), lambda b: int(b["key"].shape[0])),
        "tf_noprefetch": (lambda e: tf_dataset(path, e, prefetch=False), lambda b: int(b["key"].shape[0])),
        "ipc2": (lambda e: ipc_ceiling(n, 2), lambda b: int(b["key"].shape[0])),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for name in names:  # untimed: imports (torch/tensorflow take seconds), tracing, first worker start
        warm = configs[name][0](0)
        for i, _ in enumerate(warm.iterable):
            if i == 1:
                break
        warm.close()
    epoch = 0
    for _ in range(repeats):
        for name in names:
            make, count = configs[name]
            if cache == "cold":
                drop_cache(path)
            else:
                warm_cache(path)
            # Built before the clock (a training run builds its loader once), let go of after the
            # pass, so that no pass finds a static cache another pass filled.
            prepared = make(epoch)
            close = prepared.close
            try:
                results[name].append(timed(prepared.iterable, count, n))
            finally:
                del prepared  # the last reference to a tf.data dataset: its holder goes with it
                close()
            epoch += 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = synthetic_dataset(DATA, args.records)

    if args.child:  # tf.data runs in its own interpreter: TensorFlow and torch share no process
        cache, *names = args.child
        print(repr(run_configs(names, path, args.records, args.repeats, cache)))
        return

    rows = []
    for cache in ("cold", "warm"):
        res = run_configs(["bare", "torch0", "torch2", "ipc2"], path, args.records, args.repeats, cache)
        out = subprocess.run(
            [sys.executable, __file__, "--records", str(args.records), "--repeats", str(args.repeats),
             "--child", cache, "bare", "tf", "tf_noprefetch"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        tf_res = eval(out.stdout.strip().splitlines()[-1])
        rows.append((cache, "bare TieredSampler", res["bare"], res["bare"]))
        for key, label in (("torch0", "torch DataLoader, 0 workers"), ("torch2", "torch DataLoader, 2 workers"),
                           ("ipc2", "(DataLoader, 2 workers reading nothing: IPC ceiling)")):  # fmt: skip
            rows.append((cache, label, res[key], res["bare"]))
        rows.append((cache, "bare TieredSampler (tf process)", tf_res["bare"], tf_res["bare"]))
        rows.append((cache, "tf.data (make_tf_dataset)", tf_res["tf"], tf_res["bare"]))
        rows.append((cache, "tf.data (make_tf_dataset, prefetch=False)", tf_res["tf_noprefetch"], tf_res["bare"]))

    mb = SHAPE[0] * SHAPE[1] * SHAPE[2] / 1e6
    print(f"{args.records} records of {SHAPE} uint8 ({args.records * mb / 1e3:.2f} GB), batch {BATCH}, "
          f"ram tier 512MiB per consumer, {args.repeats} interleaved passes per configuration; "
          f"{platform.python_version()}, {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| cache | pipeline | records/s (median) | MB/s | vs bare: median [min, max] of paired passes "
          "| CPU ms per batch (median) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for cache, name, runs, bases in rows:
        # Each pass is paired with the bare pass run just before it: slow drifts of the shared
        # machine cancel in the ratio.
        ratios = [r[0] / b[0] for r, b in zip(runs, bases)]
        rate = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"| {cache} | {name} | {rate:,.0f} | {rate * mb:,.0f} | "
              f"{statistics.median(ratios):.0%} [{min(ratios):.0%}, {max(ratios):.0%}] | {cpu:.1f} |")  # fmt: skip
    print()
    for cache, name, runs, bases in rows:
        target = TARGETS.get(name)
        if target is not None:
            ratio = statistics.median(r[0] / b[0] for r, b in zip(runs, bases))
            print(f"- {cache}, {name}: {ratio:.0%} of the bare sampler (target >= {target:.0%}): "
                  f"{'met' if ratio >= target else 'MISSED'}")


if __name__ == "__main__":
    main()
