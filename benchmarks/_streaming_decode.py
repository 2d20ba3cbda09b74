"""The peer row of record_codecs.py's loader table: MosaicML Streaming decoding the same JPEG bytes.

Run by record_codecs.py with an interpreter that has ``mosaicml-streaming`` (its ``--streaming-python``),
so the benchmark runs without it. Reads the stored jpeg:90 records record_codecs.py wrote (``BLOBS``, an
``.npz`` of ``data`` uint8 and ``offsets`` int64) and prints one JSON object:

- ``decode``: Streaming's ``jpeg`` MDS encoding's ``decode`` (``PIL.Image.open`` on the bytes) forced to
  pixels with ``np.asarray`` (Streaming hands out the lazy PIL image; a training transform decodes it),
  from memory on ``--threads`` threads: records/s and CPU µs per record;
- ``dataset`` (with ``--dataset``): the same bytes written by ``MDSWriter`` (the ``jpeg`` encoding keeps a
  JPEG file's bytes as they are) and read back by ``StreamingDataset`` in this one process, each sample's
  image decoded the same way: records/s and CPU µs per record.

    python benchmarks/_streaming_decode.py BLOBS [--threads 2] [--dataset WORKDIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def _blobs(path: Path) -> list[bytes]:
    z = np.load(path)
    data, offsets = z["data"], z["offsets"]
    return [data[int(a) : int(b)].tobytes() for a, b in itertools.pairwise(offsets)]


def decode(blobs: list[bytes], threads: int) -> dict[str, Any]:
    """Streaming's jpeg decode of every blob, forced to pixels, on ``threads`` threads."""
    from streaming.base.format.mds.encodings import JPEG

    enc = JPEG()

    def job(a: int) -> None:
        for b in blobs[a : a + 8]:
            np.asarray(enc.decode(b))

    t, c = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(job, range(0, len(blobs), 8)))
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    return {"rps": round(len(blobs) / dt), "cpu_us": round(cpu / len(blobs) * 1e6)}


def dataset(blobs: list[bytes], work: Path) -> dict[str, Any]:
    """``StreamingDataset`` over an MDS copy of the blobs (``jpeg`` column), one process, decoded."""
    from PIL import Image
    from streaming import MDSWriter, StreamingDataset

    files, mds = work / "jpg", work / "mds"
    files.mkdir(parents=True, exist_ok=True)
    if not (mds / "index.json").exists():
        with MDSWriter(out=str(mds), columns={"image": "jpeg"}) as w:
            for i, b in enumerate(blobs):
                f = files / f"{i}.jpg"
                f.write_bytes(b)
                with Image.open(f) as im:
                    w.write({"image": im})  # JpegImageFile with a filename: its bytes, not re-encoded
    ds = StreamingDataset(local=str(mds), shuffle=False, batch_size=64)
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for sample in ds:
        np.asarray(sample["image"])
        n += 1
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    stored = sum(p.stat().st_size for p in mds.glob("shard.*.mds"))
    return {"rps": round(n / dt), "cpu_us": round(cpu / n * 1e6), "records": n, "stored_bytes": stored}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("blobs", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", type=Path, help="also read an MDS copy through StreamingDataset (made here once)")
    args = ap.parse_args()
    import streaming

    blobs = _blobs(args.blobs)
    out: dict[str, Any] = {"streaming": streaming.__version__, "records": len(blobs), "bytes": sum(map(len, blobs)),
                           "threads": args.threads, "decode": decode(blobs, args.threads)}
    if args.dataset is not None:
        out["dataset"] = dataset(blobs, args.dataset)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
