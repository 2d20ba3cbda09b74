"""Cold passes of the tiered sampler driven by TensorFlow's ``from_generator``, next to the bare sampler.

Run: ``python benchmarks/tf_generator.py`` (reuses ``benchmarks/_data/adapters-bench``, 10 000
224x224x3 records, written by ``adapters.py`` if missing). It isolates the cold tf.data cap found in
the adapters benchmark (RESULTS.md, "tf.data lets go of its holder"): the generator builds a
``TieredSampler`` and yields only each batch's keys, so no payload crosses into TensorFlow and the
adapter's own work (DLPack adoption, presentation) is out of the picture. Each configuration runs
with the node-shared static cache (``auto``) and without it (``0``); passes are interleaved and the
page cache is dropped before each. Prints records/s per pass, its median, and the process's CPU cores
used during the pass (CPU seconds / wall seconds: low means it waits for the disk).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
from _common import drop_cache, synthetic_dataset

from shardkit.readers import TieredSampler

DATA = Path(__file__).resolve().parent / "_data" / "adapters-bench"
BATCH = 256


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(batches: Iterable[dict[str, object]], n: int) -> tuple[float, float]:
    """(records/s, cores used) of one pass, from ``iter()`` to the last batch."""
    c0, t0 = _cpu(), time.perf_counter()
    got = sum(int(np.asarray(b["key"]).shape[0]) for b in batches)
    wall = time.perf_counter() - t0
    if got != n:
        raise RuntimeError(f"expected {n} records in a pass, got {got}")
    return n / wall, (_cpu() - c0) / wall


def bare(path: Path, n: int, epoch: int, static_cache: str) -> tuple[float, float]:
    sampler = TieredSampler(path, batch_size=BATCH, seed=0, start_epoch=epoch, static_cache=static_cache)
    sampler.hold_shared()
    try:
        return timed(sampler, n)
    finally:
        sampler.close()


def generator(path: Path, n: int, epoch: int, static_cache: str) -> tuple[float, float]:
    import tensorflow as tf

    def keys() -> Iterator[dict[str, np.ndarray]]:
        sampler = TieredSampler(path, batch_size=BATCH, seed=0, start_epoch=epoch, static_cache=static_cache)
        try:
            for batch in sampler:
                yield {"key": batch["key"]}
        finally:
            sampler.close()

    ds = tf.data.Dataset.from_generator(keys, output_signature={"key": tf.TensorSpec((None,), tf.int64)})
    return timed(ds, n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    path = synthetic_dataset(DATA, args.records)
    import tensorflow  # noqa: F401  (imported before the clock)

    configs: dict[str, Callable[[int], tuple[float, float]]] = {
        "bare TieredSampler, static cache auto": lambda e: bare(path, args.records, e, "auto"),
        "from_generator (keys only), static cache auto": lambda e: generator(path, args.records, e, "auto"),
        "bare TieredSampler, static cache 0": lambda e: bare(path, args.records, e, "0"),
        "from_generator (keys only), static cache 0": lambda e: generator(path, args.records, e, "0"),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    epoch = 0
    for _ in range(args.repeats):
        for name, run in configs.items():
            drop_cache(path)
            runs[name].append(run(epoch))
            epoch += 1
    print(f"{args.records} records of 224x224x3 uint8, batch {BATCH}, cold (page cache dropped before each pass), "
          f"{args.repeats} interleaved passes; {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| configuration | records/s per pass | median | cores used (median) |")
    print("|---|---|---:|---:|")
    for name, rs in runs.items():
        rates = ", ".join(f"{r:,.0f}" for r, _ in rs)
        print(f"| {name} | {rates} | {statistics.median(r for r, _ in rs):,.0f} | "
              f"{statistics.median(c for _, c in rs):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
