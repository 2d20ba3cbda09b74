"""Peers for ``benchmarks/remote.py`` (MosaicML Streaming and LitData on the same S3 server, shuffle
on), and the few helpers both sides share: the epoch check and the proxy's counter query.

The peers run in the bench venv (see ``remote.py``'s docstring for how it is built), not in shardkit's,
so this module imports only the standard library and numpy at the top; it never imports shardkit.
Two commands, each printing one JSON line::

    python _remote_peers.py prepare SYSTEM ENDPOINT BUCKET PREFIX N WORKDIR
    python _remote_peers.py read SYSTEM ENDPOINT BUCKET PREFIX N WORKDIR EPOCHS [COUNTERS_PORT]

``prepare`` writes the records in the peer's own format (the same bytes as ``remote.py``'s dataset:
128 KiB each, the key in the first 8 bytes) to ``WORKDIR`` and uploads them with boto3, straight to
the server (not through the proxy, so the upload is not counted). ``read`` reads ``EPOCHS`` epochs
from the bucket into an empty local cache through ``ENDPOINT`` (the counting proxy) and reports per
epoch: payload MB/s, the time to the first 64 samples (shardkit's batch), the proxy's bytes and
requests during the epoch, and an :class:`EpochCheck` of what was delivered.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

RECORD_SHAPE = (128, 256, 4)
#: Samples of a "batch" for the peers' first-batch time (shardkit's ``batch_size`` in remote.py).
BATCH = 64
#: One byte in this many of each record goes into the content digest (plus the key in its first 8).
SAMPLE_STRIDE = 4096


# ---------------------------------------------------------------------- shared with remote.py
class EpochCheck:
    """What an epoch delivered, cheaply enough to run inside the timed loop.

    Each record contributes its key and a 1-in-:data:`SAMPLE_STRIDE` sample of its bytes (the key is
    also stored in the record's first 8 bytes, and those must agree). ``ordered`` is a digest of the
    sequence (equal only for the same order), ``unordered`` a sum of per-record digests (equal for
    the same records in any order: comparable across loaders and across shardkit and the peers, whose
    records are the same bytes). ``complete`` says every key of ``range(n)`` came exactly once.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.counts = np.zeros(n, dtype=np.int64)
        self._ordered = hashlib.blake2b(digest_size=16)
        self._unordered = 0
        self.mismatched = 0  # records whose embedded key differs from the key they came with
        self.outside = 0  # keys outside range(n)

    def add(self, keys: Any, payload: Any) -> None:
        """One batch: ``keys`` ``[b]`` integers, ``payload`` ``[b, ...]`` uint8 (numpy or a tensor)."""
        k = np.asarray(keys, dtype=np.int64).reshape(-1)
        flat = np.ascontiguousarray(np.asarray(payload)).reshape(k.size, -1)
        embedded = np.ascontiguousarray(flat[:, :8]).view("<i8").reshape(-1)
        self.mismatched += int(np.count_nonzero(embedded != k))
        inside = (k >= 0) & (k < self.n)
        self.outside += int(k.size - np.count_nonzero(inside))
        np.add.at(self.counts, k[inside], 1)
        sample = np.ascontiguousarray(flat[:, ::SAMPLE_STRIDE])
        rows = np.concatenate([k.view(np.uint8).reshape(k.size, 8), sample], axis=1)
        self._ordered.update(rows.tobytes())
        for row in rows:
            h = int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
            self._unordered = (self._unordered + h) % (1 << 64)

    @property
    def records(self) -> int:
        return int(self.counts.sum()) + self.outside

    @property
    def complete(self) -> bool:
        return self.outside == 0 and self.mismatched == 0 and bool(np.all(self.counts == 1))

    def summary(self) -> dict[str, Any]:
        """JSON-ready: ``records``, ``complete``, ``mismatched``, ``ordered`` and ``unordered`` digests."""
        return {"records": self.records, "complete": self.complete, "mismatched": self.mismatched,
                "ordered": self._ordered.hexdigest(), "unordered": f"{self._unordered:016x}"}


def read_counters(port: int) -> dict[str, int]:
    """The counting proxy's totals so far (``remote.py``'s proxy answers one JSON line per connection
    on its control port): ``bytes`` sent by the server, ``requests``, and requests by method."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return dict(json.loads(data))


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` for every counter (a missing one counts 0)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after))}


# ---------------------------------------------------------------------- the peers
def records(n: int) -> Iterator[tuple[int, np.ndarray]]:
    """The records of ``remote.py``'s dataset: record ``i`` is ``pattern[i % 64]`` with ``i`` (int64)
    in its first 8 bytes."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    for i in range(n):
        rec = pattern[i % 64].copy()
        rec.reshape(-1)[:8] = np.array([i], dtype=np.int64).view(np.uint8)
        yield i, rec


def upload(local: Path, endpoint: str, bucket: str, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


def _lit_item(i: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    rec = pattern[i % 64].copy()
    rec.reshape(-1)[:8] = np.array([i], dtype=np.int64).view(np.uint8)
    return {"key": i, "image": rec.tobytes()}


def prepare(system: str, endpoint: str, bucket: str, prefix: str, n: int, work: Path) -> dict[str, Any]:
    """Write the peer's copy of the records under ``work`` and upload it (once: a marker remembers)."""
    done = work / f"uploaded-{prefix}"
    if done.exists():
        return {"prepared": system, "uploaded": False}
    local = work / system
    shutil.rmtree(local, ignore_errors=True)
    if system == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=str(local), columns={"key": "int", "image": "bytes"}, size_limit=32 << 20) as w:
            for i, rec in records(n):
                w.write({"key": i, "image": rec.tobytes()})
    else:
        import litdata as ld

        ld.optimize(fn=_lit_item, inputs=list(range(n)), output_dir=str(local), chunk_bytes="32MB", num_workers=1)
    upload(local, endpoint, bucket, prefix)
    done.write_text("")
    return {"prepared": system, "uploaded": True}


def allow_plain_http(system: str, endpoint: str) -> None:
    """Point the peer's S3 client at ``endpoint`` (an ``http://`` address of the proxy).

    Streaming reads ``S3_ENDPOINT_URL``; LitData builds its boto3 client from the standard AWS
    variables (``AWS_ENDPOINT_URL``), which boto3 honours over plain http. LitData 0.2.76 then
    downloads chunks with an obstore ``S3Store`` built from that client's endpoint and its own
    ``_OBSTORE_CLIENT_OPTIONS``, which do not allow http (obstore answers with a reqwest "builder"
    error): the site customisation of this benchmark adds ``allow_http`` to those options, in this
    process only (the peer is read without DataLoader workers).
    """
    os.environ["S3_ENDPOINT_URL"] = endpoint
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    if system != "litdata" or not endpoint.startswith("http://"):
        return
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": True}


def dataset(system: str, bucket: str, prefix: str, cache: Path) -> Any:
    shutil.rmtree(cache, ignore_errors=True)
    if system == "streaming":
        from streaming import StreamingDataset

        return StreamingDataset(remote=f"s3://{bucket}/{prefix}", local=str(cache), shuffle=True, shuffle_seed=1,
                                batch_size=BATCH)
    import litdata as ld

    return ld.StreamingDataset(f"s3://{bucket}/{prefix}", shuffle=True, seed=1, cache_dir=str(cache))


def epoch(ds: Any, n: int, counters: int | None) -> dict[str, Any]:
    """One pass over ``ds``: MB/s, first-batch time, the proxy's counts during it, the check."""
    before = read_counters(counters) if counters else {}
    check = EpochCheck(n)
    keys: list[int] = []
    images: list[np.ndarray] = []
    first = None
    nbytes = 0
    t0, started = time.perf_counter(), time.monotonic()
    for sample in ds:
        img = np.frombuffer(sample["image"], dtype=np.uint8)
        nbytes += img.size
        keys.append(int(sample["key"]))
        images.append(img)
        if len(keys) == BATCH:
            first = first if first is not None else time.perf_counter() - t0
            check.add(keys, np.stack(images))
            keys, images = [], []
    if keys:
        first = first if first is not None else time.perf_counter() - t0
        check.add(keys, np.stack(images))
    dt = time.perf_counter() - t0
    out: dict[str, Any] = {"MB/s": nbytes / 1e6 / dt, "seconds": dt, "first_batch_s": first or 0.0,
                           "started": started, "ended": time.monotonic(), **check.summary()}
    if counters:
        d = counter_delta(before, read_counters(counters))
        out["fetched_MB"] = d.get("bytes", 0) / 1e6
        out["requests"] = d.get("requests", 0)
    return out


def read(system: str, endpoint: str, bucket: str, prefix: str, n: int, work: Path, epochs: int,
         counters: int | None) -> dict[str, Any]:
    allow_plain_http(system, endpoint)
    ds = dataset(system, bucket, prefix, work / f"cache-{system}")
    return {"epochs": [epoch(ds, n, counters) for _ in range(epochs)]}


def main() -> None:
    cmd, system, endpoint, bucket, prefix, n, work, *rest = sys.argv[1:]
    if system not in ("streaming", "litdata"):
        raise SystemExit(f"unknown peer {system!r}: expected streaming or litdata")
    Path(work).mkdir(parents=True, exist_ok=True)
    if cmd == "prepare":
        out = prepare(system, endpoint, bucket, prefix, int(n), Path(work))
    else:
        epochs = int(rest[0]) if rest else 1
        counters = int(rest[1]) if len(rest) > 1 else None
        out = read(system, endpoint, bucket, prefix, int(n), Path(work), epochs, counters)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
