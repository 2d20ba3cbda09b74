"""Peers for ``benchmarks/remote.py``: MosaicML Streaming and LitData reading the same records from
the same S3 server, shuffle on. Runs in the bench venv (``pip install -e '.[bench]'``), not in
shardkit's: ``python _remote_peers.py SYSTEM ENDPOINT BUCKET PREFIX N WORKDIR``; prints one JSON line.

Each peer writes the dataset in its own format (the same records as ``remote.py``: 128 KiB each,
the key in the first 8 bytes) to a local directory, uploads it with boto3 (once per prefix), then
reads one epoch from the bucket into an empty local cache, and reports payload MB/s and the time to
the first sample.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import boto3
import numpy as np

RECORD_SHAPE = (128, 256, 4)


def records(n: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    for i in range(n):
        rec = pattern[i % 64].copy()
        rec.reshape(-1)[:8] = np.array([i], dtype=np.int64).view(np.uint8)
        yield i, rec


def upload(local: Path, endpoint: str, bucket: str, prefix: str) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


def streaming(endpoint: str, bucket: str, prefix: str, n: int, work: Path) -> dict[str, float]:
    from streaming import MDSWriter, StreamingDataset

    os.environ["S3_ENDPOINT_URL"] = endpoint
    local = work / "mds"
    if not local.exists():
        with MDSWriter(out=str(local), columns={"key": "int", "image": "bytes"}, size_limit=32 << 20) as w:
            for i, rec in records(n):
                w.write({"key": i, "image": rec.tobytes()})
        upload(local, endpoint, bucket, prefix)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    ds = StreamingDataset(remote=f"s3://{bucket}/{prefix}", local=str(cache), shuffle=True, shuffle_seed=1, batch_size=256)
    return _epoch(ds, n)


def litdata(endpoint: str, bucket: str, prefix: str, n: int, work: Path) -> dict[str, float]:
    import litdata as ld

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    local = work / "lit"
    if not local.exists():
        ld.optimize(fn=_lit_item, inputs=list(range(n)), output_dir=str(local), chunk_bytes="32MB", num_workers=1)
        upload(local, endpoint, bucket, prefix)
    cache = work / "litcache"
    shutil.rmtree(cache, ignore_errors=True)
    ds = ld.StreamingDataset(f"s3://{bucket}/{prefix}", shuffle=True, seed=1, cache_dir=str(cache))
    return _epoch(ds, n)


def _lit_item(i: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    rec = pattern[i % 64].copy()
    rec.reshape(-1)[:8] = np.array([i], dtype=np.int64).view(np.uint8)
    return {"key": i, "image": rec.tobytes()}


def _epoch(ds: object, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    first = None
    seen = 0
    nbytes = 0
    for sample in ds:  # type: ignore[attr-defined]
        first = first or time.perf_counter() - t0
        seen += 1
        nbytes += len(sample["image"])
    dt = time.perf_counter() - t0
    if seen != n:
        raise RuntimeError(f"read {seen} samples, expected {n}")
    return {"MB/s": nbytes / 1e6 / dt, "first_batch_s": first or 0.0, "records": seen}


def main() -> None:
    system, endpoint, bucket, prefix, n, work = sys.argv[1:7]
    Path(work).mkdir(parents=True, exist_ok=True)
    fn = {"streaming": streaming, "litdata": litdata}[system]
    print(json.dumps(fn(endpoint, bucket, prefix, int(n), Path(work))))


if __name__ == "__main__":
    main()
