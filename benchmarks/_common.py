"""Helpers shared by the benchmark scripts (they run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset

__all__ = ["drop_cache", "synthetic_dataset", "IMAGE_SHAPE"]

#: The record every throughput benchmark uses: one 224x224 RGB image, 150,528 bytes.
IMAGE_SHAPE = (224, 224, 3)


def drop_cache(paths: Path | Iterable[Path]) -> None:
    """Evict files (or every file under a directory) from the page cache: each is flushed first (dirty
    pages cannot be dropped), then ``posix_fadvise(DONTNEED)``.

    Written here rather than imported from the library (``shardkit.profiling.phases.evict_page_cache``
    does the same for ``shardkit profile``): ``--before TREE`` runs these scripts against an older
    shardkit that does not have it.
    """
    for p in [paths] if isinstance(paths, Path) else paths:
        for f in [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def synthetic_dataset(path: Path, n: int, shape: tuple[int, ...] = IMAGE_SHAPE) -> Path:
    """A dataset of ``n`` uint8 records at ``path``, written once and reused while ``n`` matches.

    Record ``i`` is one of 256 random images with its first byte set to ``i % 256`` (so a wrong key is
    visible) and label ``i % 1000``.
    """
    if (path / "zarr.json").exists():
        with open_dataset(path) as ds:
            if ds.num_records == n and ds.meta.record.shape == tuple(shape):
                return path
    if path.exists():
        shutil.rmtree(path)  # another size, or a write cut short
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(256, *shape), dtype=np.uint8)
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(shape, "uint8"),
                       fields={"label": FieldSpec((), "int64")}) as w:
        for a in range(0, n, 256):
            k = min(256, n - a)
            images = pattern[:k].copy()
            images.reshape(k, -1)[:, 0] = np.arange(a, a + k) % 256
            w.write({"image": images, "label": np.arange(a, a + k) % 1000})
    return path
