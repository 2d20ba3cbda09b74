"""Benchmark of the tiered sampler against raw sequential reads and a random-order baseline.

Run: ``python benchmarks/sample.py`` (generates ``benchmarks/_data/sample-bench`` once: >= 4 GiB of
224x224x3 uint8 records). The page cache is dropped (posix_fadvise DONTNEED on every shard file)
before each cold measurement. Prints a markdown table; the numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import drop_cache, synthetic_dataset

from shardkit.formats import open_dataset
from shardkit.readers import TieredSampler
from shardkit.readers.pipeline import assemble_batch
from shardkit.units import capacity_bytes

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "sample-bench"
SHAPE = (224, 224, 3)
REC = int(np.prod(SHAPE))




def raw_sequential(ds_path: Path) -> float:
    """MB/s of reading every shard file front to back in 8 MiB reads."""
    ds = open_dataset(ds_path)
    files = [ds.payload.shard_path(i) for i in range(len(ds.payload.shards))]
    drop_cache(ds_path)
    buf = bytearray(8 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [buf])
                if n <= 0:
                    break
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e6


def random_baseline(ds_path: Path, seconds: float = 20.0) -> float:
    """MB/s of reading records one pread each in permutation order (how exact shuffles read)."""
    ds = open_dataset(ds_path)
    pa = ds.payload
    drop_cache(ds_path)
    perm = np.random.default_rng(1).permutation(ds.num_records)
    buf = bytearray(REC)
    fds = [os.open(pa.shard_path(i), os.O_RDONLY) for i in range(len(pa.shards))]
    done = 0
    t0 = time.perf_counter()
    for k in perm.tolist():
        s, r = divmod(k, pa.records_per_shard)
        os.preadv(fds[s], [buf], r * REC)
        done += 1
        if done % 256 == 0 and time.perf_counter() - t0 > seconds:
            break
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return done * REC / dt / 1e6


class PeakRss:
    """Sample this process's RSS every 10 ms (ru_maxrss is a lifetime maximum, useless per run)."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._t.join()
        return self.base, self.peak


def run_sampler(ds_path: Path, tiers: str, ram: str, ssd: str, ssd_dir: Path, batch: int) -> dict:
    drop_cache(ds_path)
    rss = PeakRss()
    s = TieredSampler(ds_path, tiers=tiers, ram_size=ram, ssd_size=ssd, ssd_dir=ssd_dir, batch_size=batch, seed=0)
    lat = []
    t = time.perf_counter()
    for b in s:
        now = time.perf_counter()
        lat.append(now - t)
        t = now
        del b
    base, peak = rss.stop()
    st = s.stats
    return {"mbps": st.bytes_per_s / 1e6, "stall": st.stall_seconds, "elapsed": st.elapsed, "lat": np.array(lat),
            "disk": st.disk.bytes_read, "ssd": st.ssd.bytes_read, "peak_rss": peak, "base_rss": base,
            "ram_block": s.ram_block, "ssd_block": s.ssd_block}


def assembly_rate(batch: int, block_records: int = 4096, repeats: int = 3) -> float:
    """GB/s of cutting batches out of a filled RAM block (the batch creator's copy + field gather)."""
    block = np.random.default_rng(0).integers(0, 256, size=(block_records, *SHAPE), dtype=np.uint8)
    fields = {"label": np.arange(block_records, dtype=np.int64)}
    keys = np.arange(block_records, dtype=np.int64)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a in range(0, block_records - batch + 1, batch):
            out = np.empty((batch, *SHAPE), dtype=np.uint8)
            out[:] = block[a : a + batch]
            assemble_batch("image", out, fields, keys[a : a + batch])
        dt = time.perf_counter() - t0
        best = max(best, (block_records // batch) * batch * REC / dt / 1e9)
    return best


def _busy_python(seconds: float) -> int:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += sum(range(200))
    return n


def _proc_reader(path: str, keys: np.ndarray, shm_name: str) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    ds = open_dataset(path)
    out = np.ndarray((len(keys), *SHAPE), dtype=np.uint8, buffer=shm.buf)
    for a in range(0, len(keys), 1024):
        ds.payload.read(keys[a : a + 1024], out=out[a : a + 1024])
    del out
    shm.close()


def threads_vs_processes(ds_path: Path, n: int = 8192) -> dict:
    """Read the same n random records (in 1024-record blocks) while the main thread runs pure-Python
    work, once with the reader in a thread, once in a process writing into shared memory."""
    from multiprocessing import shared_memory

    keys = np.random.default_rng(2).permutation(open_dataset(ds_path).num_records)[:n]
    res = {}
    # thread
    drop_cache(ds_path)
    ds = open_dataset(ds_path)
    out = np.empty((n, *SHAPE), dtype=np.uint8)

    def reader() -> None:
        for a in range(0, n, 1024):
            ds.payload.read(keys[a : a + 1024], out=out[a : a + 1024])

    t0 = time.perf_counter()
    th = threading.Thread(target=reader)
    th.start()
    work = 0
    while th.is_alive():
        work += _busy_python(0.01)
    res["thread_s"] = time.perf_counter() - t0
    res["thread_work"] = work
    # process
    drop_cache(ds_path)
    shm = shared_memory.SharedMemory(create=True, size=n * REC)
    t0 = time.perf_counter()
    p = mp.get_context("fork").Process(target=_proc_reader, args=(str(ds_path), keys, shm.name))
    p.start()
    work = 0
    while p.is_alive():
        work += _busy_python(0.01)
    p.join()
    res["process_s"] = time.perf_counter() - t0
    res["process_work"] = work
    shm.close()
    shm.unlink()
    res["mb"] = n * REC / 1e6
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=4.2, help="dataset size")
    ap.add_argument("--ram", default="1GiB")
    ap.add_argument("--ssd", default="2GiB")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--plot", default=str(HERE / "sample_latency.png"))
    ap.add_argument("--rounds", type=int, default=3, help="repeat every measurement; report medians")
    args = ap.parse_args()
    n = int(args.gib * 2**30 // REC)
    t0 = time.perf_counter()
    path = synthetic_dataset(DATA, n)
    print(f"dataset: {n} records of {REC} B = {n * REC / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s to prepare)",
          file=sys.stderr)
    ssd_dir = Path(tempfile.mkdtemp(prefix="sk-bench-ssd-", dir=HERE / "_data"))  # same disk
    # The virtual disk's speed drifts by 2-4x within minutes: run every measurement in each of
    # several rounds and compare each sampler pass with the raw pass of the *same* round.
    rounds = []
    for r in range(args.rounds):
        rounds.append({
            "raw": raw_sequential(path),
            "ram": run_sampler(path, "ram", args.ram, args.ssd, ssd_dir, args.batch),
            "ssd": run_sampler(path, "ram,ssd", args.ram, args.ssd, ssd_dir, args.batch),
            "rnd": random_baseline(path),
        })
        x = rounds[-1]
        print(f"round {r + 1}: raw {x['raw']:,.0f}, ram {x['ram']['mbps']:,.0f}, ram,ssd {x['ssd']['mbps']:,.0f}, "
              f"random {x['rnd']:,.0f} MB/s", file=sys.stderr)
    med = statistics.median
    raw = med(x["raw"] for x in rounds)
    rnd = med(x["rnd"] for x in rounds)
    ram = dict(rounds[-1]["ram"], mbps=med(x["ram"]["mbps"] for x in rounds),
               peak_rss=max(x["ram"]["peak_rss"] for x in rounds))
    ssd = dict(rounds[-1]["ssd"], mbps=med(x["ssd"]["mbps"] for x in rounds),
               peak_rss=max(x["ssd"]["peak_rss"] for x in rounds))
    ram_raw = med(x["ram"]["mbps"] / x["raw"] for x in rounds)
    ram_rnd = med(x["ram"]["mbps"] / x["rnd"] for x in rounds)
    ssd_raw = med(x["ssd"]["mbps"] / x["raw"] for x in rounds)
    ssd_rnd = med(x["ssd"]["mbps"] / x["rnd"] for x in rounds)
    asm = assembly_rate(args.batch)
    tvp = threads_vs_processes(path)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    ram_bytes = capacity_bytes(args.ram, REC, what="--ram")
    dataset_gb = n * REC / 1e9

    def row(name: str, value: str, target: str, ok: bool | None) -> str:
        return f"| {name} | {value} | {target} | {'' if ok is None else ('met' if ok else '**missed**')} |"

    lines = [
        f"dataset {n} x {SHAPE} uint8 = {dataset_gb:.2f} GB, RAM tier {args.ram} (K2 = {ram['ram_block']}), "
        f"SSD tier {args.ssd} (K1 = {ssd['ssd_block']}), batch {args.batch}; {args.rounds} rounds, medians "
        "(ratios: each sampler pass against the raw / random pass of the same round)",
        "",
        "| measurement | value | target | |",
        "|---|---|---|---|",
        row("raw sequential read (cold)", f"{raw:,.0f} MB/s", "baseline", None),
        row("random-order baseline (one pread per record, cold)", f"{rnd:,.0f} MB/s", "baseline", None),
        row("sample, tiers ram (cold)", f"{ram['mbps']:,.0f} MB/s = {ram_raw:.0%} of raw, "
            f"{ram_rnd:.1f}x random", ">= 85% raw, >= 2x random", ram_raw >= 0.85 and ram_rnd >= 2),
        row("sample, tiers ram,ssd (cold, ssd_dir on the same disk)", f"{ssd['mbps']:,.0f} MB/s = "
            f"{ssd_raw:.0%} of raw, {ssd_rnd:.1f}x random", ">= 85% raw, >= 2x random",
            ssd_raw >= 0.85 and ssd_rnd >= 2),
        row("disk bytes read per epoch (ram / ram,ssd)", f"{ram['disk'] / 1e9:.3f} / {ssd['disk'] / 1e9:.3f} GB",
            f"{dataset_gb:.3f} GB", abs(ram['disk'] - n * REC) < 0.001 * n * REC),
        row("batch assembly from the RAM tier", f"{asm:.1f} GB/s", ">= 4 GB/s", asm >= 4),
        row("peak RSS, tiers ram", f"{ram['peak_rss'] / 2**30:.2f} GiB (start {ram['base_rss'] / 2**30:.2f} GiB)",
            f"<= {ram_bytes * 1.15 / 2**30:.2f} GiB", ram['peak_rss'] <= ram_bytes * 1.15),
        row("peak RSS, tiers ram,ssd", f"{ssd['peak_rss'] / 2**30:.2f} GiB", f"<= {ram_bytes * 1.15 / 2**30:.2f} GiB",
            ssd['peak_rss'] <= ram_bytes * 1.15),
        row("consumer stall (ram / ram,ssd)", f"{ram['stall']:.1f} s of {ram['elapsed']:.1f} s / "
            f"{ssd['stall']:.1f} s of {ssd['elapsed']:.1f} s", "(consumer does nothing: I/O bound)", None),
        row("per-batch latency p50 / p99 / max (ram)", " / ".join(f"{np.percentile(ram['lat'], q) * 1e3:.1f}"
            for q in (50, 99, 100)) + " ms", "", None),
        "",
        f"threads vs processes (reading {tvp['mb']:.0f} MB of random records in 1024-record blocks while the "
        f"consumer runs pure Python): thread {tvp['thread_s']:.2f} s ({tvp['mb'] / tvp['thread_s']:.0f} MB/s, "
        f"consumer work {tvp['thread_work']:,}), process + shared memory {tvp['process_s']:.2f} s "
        f"({tvp['mb'] / tvp['process_s']:.0f} MB/s, consumer work {tvp['process_work']:,})",
    ]
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(ram["lat"] * 1e3, lw=0.6, label="tiers ram")
        ax.plot(ssd["lat"] * 1e3, lw=0.6, label="tiers ram,ssd")
        ax.set_xlabel("batch")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.set_title(f"per-batch latency, {args.batch} x 150 KB records, cold page cache")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
