"""Format I/O benchmark: shardkit's shard writer and sequential scan vs raw os.write / os.preadv.

Writes and scans a generated dataset of >= 2 GiB of 150 KB records (224x224x3 uint8) and prints, in one
run, shardkit's write and cold sequential-scan MB/s next to a raw baseline on the same bytes in the
same file sizes (``os.write`` + fsync per file; ``os.preadv`` of 8 MiB per call). The page cache is
dropped (``posix_fadvise(DONTNEED)`` on every file) before each read pass. Target: >= 90% of raw.

Usage::

    python benchmarks/format_io.py [--gib 2.1] [--dir benchmarks/_data/format_io] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from _common import drop_cache

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats.spec import DEFAULT_SHARD_BYTES, records_per_shard_for

RECORD = FieldSpec((224, 224, 3), "uint8")
BATCH = 64
READ_CHUNK = 8 * 1024 * 1024



def files_under(root: Path, prefix: str) -> list[Path]:
    return sorted((p for p in root.rglob("*") if p.is_file() and p.name != "zarr.json"
                   and str(p.relative_to(root)).startswith(prefix)), key=lambda p: str(p))


def raw_write(root: Path, data: np.ndarray, per_file: int) -> float:
    """Baseline: the same record bytes, same file sizes, plain os.write + fsync per file."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t = time.perf_counter()
    n = data.shape[0]
    for i, start in enumerate(range(0, n, per_file)):
        fd = os.open(root / f"f{i:05d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for b in range(start, min(start + per_file, n), BATCH):
                view = memoryview(data[b : min(b + BATCH, start + per_file, n)].reshape(-1))
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def raw_scan(paths: list[Path]) -> tuple[float, int]:
    buf = np.empty(READ_CHUNK, dtype=np.uint8)
    view = memoryview(buf)
    total = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while True:
                got = os.preadv(fd, [view], off)
                if got == 0:
                    break
                off += got
            total += off
        finally:
            os.close(fd)
    return time.perf_counter() - t, total


def shardkit_write(root: Path, data: np.ndarray, per_shard: int) -> float:
    shutil.rmtree(root, ignore_errors=True)
    labels = np.zeros(data.shape[0], dtype=np.int64)
    t = time.perf_counter()
    with DatasetWriter(root, kind="bench", payload="image", record=RECORD,
                       fields={"label": FieldSpec((), "int64")}, records_per_shard=per_shard) as w:
        for b in range(0, data.shape[0], BATCH):
            w.write({"image": data[b : b + BATCH], "label": labels[b : b + BATCH]})
    return time.perf_counter() - t


def shardkit_scan(root: Path) -> float:
    with open_dataset(root) as ds:
        chunk = max(1, READ_CHUNK // ds.record_nbytes) * 4
        out = ds.payload.empty(chunk)
        t = time.perf_counter()
        for start in range(0, ds.num_records, chunk):
            stop = min(start + chunk, ds.num_records)
            ds.payload.read_range(start, stop, out[: stop - start])
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.1, help="dataset size in GiB (>= 2 for the recorded run)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / "_data" / "format_io")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()

    n = int(args.gib * 2**30 // RECORD.nbytes)
    per_shard = records_per_shard_for(RECORD.nbytes, DEFAULT_SHARD_BYTES)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(n, *RECORD.shape), dtype=np.uint8)
    payload_bytes = data.nbytes
    raw_dir, sk_dir = args.dir / "raw", args.dir / "shardkit"

    rows: dict[str, list[float]] = {k: [] for k in ("raw write", "shardkit write", "raw scan", "shardkit scan")}

    def clean_slate() -> None:
        # Each write starts from the same state: no files of the other side (their page cache and
        # the device's write-back of them would otherwise slow whichever side writes second —
        # measured here: up to 2x either way), nothing dirty, a short pause for the device.
        shutil.rmtree(raw_dir, ignore_errors=True)
        shutil.rmtree(sk_dir, ignore_errors=True)
        os.sync()
        time.sleep(2)

    def raw_side() -> None:
        clean_slate()
        rows["raw write"].append(payload_bytes / raw_write(raw_dir, data, per_shard) / 1e6)
        files = files_under(raw_dir, "")
        drop_cache(files)
        secs, total = raw_scan(files)
        if total != payload_bytes:
            raise RuntimeError(f"raw scan read {total} bytes, expected {payload_bytes}")
        rows["raw scan"].append(payload_bytes / secs / 1e6)

    def shardkit_side() -> None:
        clean_slate()
        rows["shardkit write"].append(payload_bytes / shardkit_write(sk_dir, data, per_shard) / 1e6)
        drop_cache(files_under(sk_dir, "image/"))
        rows["shardkit scan"].append(payload_bytes / shardkit_scan(sk_dir) / 1e6)

    for rep in range(args.repeats):
        for side in (raw_side, shardkit_side) if rep % 2 == 0 else (shardkit_side, raw_side):
            side()

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"# format_io: {n} records x {RECORD.nbytes} B = {payload_bytes / 2**30:.2f} GiB, "
          f"{per_shard} records/shard, {args.repeats} repeats (median), {platform.node()} "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print()
    print("| operation | raw MB/s | shardkit MB/s | shardkit / raw | target |")
    print("|---|---:|---:|---:|---|")
    for op in ("write", "scan"):
        r, s = med[f"raw {op}"], med[f"shardkit {op}"]
        verdict = "met" if s / r >= 0.90 else "MISSED"
        print(f"| {op} ({'write+fsync' if op == 'write' else 'cold sequential read'}) | {r:,.0f} | {s:,.0f} | "
              f"{s / r:.1%} | >= 90% ({verdict}) |")
    print()
    print("all runs (MB/s): " + "; ".join(f"{k}: {', '.join(f'{x:,.0f}' for x in v)}" for k, v in rows.items()))
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(sk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
