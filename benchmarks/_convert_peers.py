"""Peers' writers for ``benchmarks/convert.py``: the same JPEGs to the same 224x224 uint8 records.

Runs in the bench venv (``pip install -e '.[bench]'``), not in shardkit's:
``python _convert_peers.py SYSTEM SRC OUT WORKERS SIZE``; prints one JSON line
``{"seconds": ..., "records": ..., "bytes": ..., "cpu": ..., "parent_cpu": ...}`` (or ``{"error": ...}``):
``cpu`` is the CPU seconds of the writer and its worker processes, ``parent_cpu`` those of this process alone.

Every peer decodes with the same transform as the benchmark's bare loop (Pillow: open, RGB, resize
the shorter side with bilinear filtering, centre crop; what shardkit's default decode does at this
size, where no JPEG is reduced by 2x or more) and stores the raw uint8 bytes uncompressed, with the
label. With ``WORKERS`` worker processes each peer runs its own documented parallel writer:

* ``litdata``: ``litdata.optimize(fn, inputs, num_workers=W)`` (its workers decode and write chunks);
* ``mds``: W processes, each an ``MDSWriter`` over a contiguous slice into its own subdirectory, then
  ``streaming.base.util.merge_index`` (MosaicML's recipe for parallel writing); 1 worker writes in
  this process;
* ``wds``: W processes, each a ``webdataset.ShardWriter`` over a contiguous slice with its own shard
  prefix; 1 worker writes in this process.

The time counts from the start of the writing to its end, worker start-up included (as shardkit's);
the peer's modules are imported before the clock starts (shardkit's are imported by the caller), and
the MDS and WebDataset pools fork this process, so their workers do not import torch again.
"""

from __future__ import annotations

import importlib
import itertools
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

SIZE = 224
#: Shard size for every peer: shardkit's default (256 MiB).
SHARD_BYTES = 256 << 20


def transform(path: str) -> np.ndarray:
    with Image.open(path) as img:
        img = img.convert("RGB")
        w, h = img.size
        s = max(SIZE / w, SIZE / h)
        nw, nh = round(w * s), round(h * s)
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = (nw - SIZE) // 2, (nh - SIZE) // 2
        return np.ascontiguousarray(np.asarray(img.crop((left, top, left + SIZE, top + SIZE))))


def corpus(src: Path) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return [(str(f), c) for c, name in enumerate(classes) for f in sorted((src / name).glob("*.jpg"))]


def _litdata_item(item: tuple[str, int]) -> dict[str, object]:
    path, label = item
    return {"image": transform(path), "label": label}


def litdata(items: list[tuple[str, int]], out: Path, workers: int) -> None:
    import litdata as ld

    ld.optimize(fn=_litdata_item, inputs=items, output_dir=str(out), num_workers=workers,
                chunk_bytes=SHARD_BYTES, verbose=False, mode="overwrite")  # fmt: skip


def _mds_slice(args: tuple[list[tuple[str, int]], str]) -> int:
    from streaming import MDSWriter

    items, out = args
    with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit=SHARD_BYTES, progress_bar=False) as w:
        for path, label in items:
            w.write({"image": transform(path).tobytes(), "label": label})
    return len(items)


def mds(items: list[tuple[str, int]], out: Path, workers: int) -> None:
    if workers == 1:
        _mds_slice((items, str(out)))
        return
    from streaming.base.util import merge_index

    slices = [(part, str(out / f"{w}")) for w, part in enumerate(_split(items, workers))]
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(_mds_slice, slices)
    merge_index(str(out), keep_local=True)


def _wds_slice(args: tuple[list[tuple[str, int]], str, int]) -> int:
    import webdataset as wds

    items, pattern, first = args
    per_shard = max(1, SHARD_BYTES // (SIZE * SIZE * 3))
    with wds.ShardWriter(pattern, maxcount=per_shard, maxsize=1 << 40, verbose=0) as sink:
        for i, (path, label) in enumerate(items, first):
            sink.write({"__key__": f"{i:08d}", "u8": transform(path).tobytes(), "cls": label})
    return len(items)


def wds(items: list[tuple[str, int]], out: Path, workers: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if workers == 1:
        _wds_slice((items, str(out / "shard-%05d.tar"), 0))
        return
    slices, first = [], 0
    for w, part in enumerate(_split(items, workers)):
        slices.append((part, str(out / f"w{w}-shard-%05d.tar"), first))
        first += len(part)
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(_wds_slice, slices)


def _split(items: list[tuple[str, int]], parts: int) -> list[list[tuple[str, int]]]:
    """Contiguous slices of nearly equal length (what each peer's workers get)."""
    bounds = np.linspace(0, len(items), parts + 1).round().astype(int)
    return [items[int(a) : int(b)] for a, b in itertools.pairwise(bounds)]


SYSTEMS = {"litdata": litdata, "mds": mds, "wds": wds}
#: What each peer imports, loaded before the clock starts.
MODULES = {"litdata": ("litdata",), "mds": ("streaming", "streaming.base.util"), "wds": ("webdataset",)}


def _cpu() -> float:
    """CPU seconds of this process and of every child process that ended (the writer's workers)."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def _own_cpu() -> float:
    """CPU seconds of this process alone (every thread)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def main() -> None:
    system, src, out, workers = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    items = corpus(src)
    shutil.rmtree(out, ignore_errors=True)
    for module in MODULES[system]:
        importlib.import_module(module)
    cpu0, own0 = _cpu(), _own_cpu()
    t0 = time.perf_counter()
    try:
        SYSTEMS[system](items, out, workers)
    except Exception as exc:  # one line for the table, never a traceback in the middle of it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    seconds = time.perf_counter() - t0
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps({"seconds": seconds, "records": len(items), "bytes": written, "cpu": _cpu() - cpu0,
                      "parent_cpu": _own_cpu() - own0}))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
