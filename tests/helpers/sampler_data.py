"""Helpers for the sampler tests: tiny datasets whose payload encodes the record key."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from shardkit import mix
from shardkit.formats import DatasetWriter, FieldSpec, ReadStats
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES, index_nbytes
from shardkit.readers import TieredSampler
from shardkit.readers.sources import MixedDataset, MixedPayload


def encode(keys: np.ndarray, shape: tuple[int, ...] = (4, 4, 1)) -> np.ndarray:
    """Record i: bytes 0..1 hold i (little endian), the rest a key-dependent pattern."""
    keys = np.asarray(keys, dtype=np.int64)
    rec = np.empty((keys.size, int(np.prod(shape))), dtype=np.uint8)
    rec[:] = ((keys[:, None] * 7 + np.arange(rec.shape[1])[None, :]) % 251).astype(np.uint8)
    rec[:, 0] = keys % 256
    rec[:, 1] = keys // 256
    return rec.reshape(keys.size, *shape)


def make_dataset(
    path: Path, n: int, *, records_per_shard: int = 3, shape: tuple[int, ...] = (4, 4, 1), first: int = 0
) -> Path:
    """``n`` records; record ``i`` encodes ``first + i`` (a mixture's datasets get disjoint codes)."""
    keys = np.arange(first, first + n, dtype=np.int64)
    with DatasetWriter(
        path,
        kind="test",
        payload="image",
        record=FieldSpec(shape, "uint8"),
        fields={"label": FieldSpec((), "int64"), "pair": FieldSpec((2,), "float32")},
        records_per_shard=records_per_shard,
    ) as w:
        for a in range(0, n, 5):
            k = keys[a : a + 5]
            w.write({"image": encode(k, shape), "label": k * 3, "pair": np.stack([k, -k], 1).astype(np.float32)})
    return path


def check_batch(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Every field of every row belongs to the row's key; returns the keys."""
    k = batch["key"]
    assert k.dtype == np.int64
    shape = batch["image"].shape[1:]
    np.testing.assert_array_equal(batch["image"], encode(k, shape))
    np.testing.assert_array_equal(batch["label"], k * 3)
    np.testing.assert_array_equal(batch["pair"][:, 0], k.astype(np.float32))
    return k


def collect(sampler: TieredSampler) -> list[np.ndarray]:
    """Keys of every batch of one iteration (each batch checked)."""
    return [check_batch(b) for b in sampler]


def epochs_of(sampler: TieredSampler, n_per_epoch: int) -> np.ndarray:
    keys = np.concatenate(collect(sampler))
    assert keys.size % n_per_epoch == 0
    return keys.reshape(-1, n_per_epoch)


def opening_nbytes(n: int, rps: int, rec: int) -> int:
    """Bytes a reader reads to open every shard of an uncompressed dataset of ``n`` records of ``rec``
    bytes, ``rps`` a shard, once: each shard's index with the end of its records (``tail_crc32c``)."""
    sizes = [min(rps, n - a) for a in range(0, n, rps)]
    return sum(index_nbytes(rps) + min(TAIL_SAMPLE_NBYTES, k * rec) for k in sizes)



FIVE_WAY_SIZES = (13, 11, 9, 7, 5)
FIVE_WAY_STARTS = np.concatenate([[0], np.cumsum(FIVE_WAY_SIZES)])


@contextmanager
def five_way_mixture(tmp_path: Path, shape: tuple[int, ...] = (4, 4, 1)
                     ) -> Iterator[tuple[MixedPayload, ReadStats, list[Path]]]:  # fmt: skip
    """Five local datasets of 13, 11, 9, 7 and 5 records mixed with equal weights (record ``i`` of the
    mixture encodes ``i``): its payload, a read trace that holds only what comes after (every shard is
    opened and checked first) and the datasets' paths."""
    paths = [make_dataset(tmp_path / f"d{i}", n, first=int(FIVE_WAY_STARTS[i]), records_per_shard=3, shape=shape)
             for i, n in enumerate(FIVE_WAY_SIZES)]  # fmt: skip
    stats = ReadStats(trace=[])
    with MixedDataset(mix(list(zip(paths, [1] * 5))), stats=stats) as md:
        payload = md.payload
        assert isinstance(payload, MixedPayload)
        payload.read(np.arange(int(FIVE_WAY_STARTS[-1])))
        assert stats.trace is not None
        stats.trace.clear()
        yield payload, stats, paths
