"""Shared fixtures: small generated datasets written with shardkit's own writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import DatasetWriter, FieldSpec

REPO = Path(__file__).resolve().parents[1]
DATASETS = REPO / "datasets"


def make_records(n: int, shape: tuple[int, ...] = (4, 3, 3), dtype: str = "uint8", seed: int = 0) -> np.ndarray:
    """Deterministic pseudo-random records; record i differs from every other."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, *shape)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=(n, *shape), endpoint=True, dtype=dtype)


def write_dataset(
    path: Path,
    records: np.ndarray,
    *,
    labels: np.ndarray | None = None,
    records_per_shard: int = 10,
    compression: str | None = None,
    payload: str = "image",
) -> Path:
    """Write ``records`` (and an int64 ``label`` field) as a shardkit dataset at ``path``."""
    n = records.shape[0]
    if labels is None:
        labels = np.arange(n, dtype=np.int64) % 3
    with DatasetWriter(
        path,
        kind="test",
        payload=payload,
        record=FieldSpec(records.shape[1:], records.dtype.name),
        fields={"label": FieldSpec((), "int64")},
        labels={"label": ["a", "b", "c"]},
        records_per_shard=records_per_shard,
        compression=compression,
    ) as w:
        for start in range(0, n, 7):  # several writes that cross shard boundaries
            w.write({payload: records[start : start + 7], "label": labels[start : start + 7]})
    return path


@pytest.fixture
def small_dataset(tmp_path: Path) -> Callable[..., tuple[Path, np.ndarray]]:
    """Factory: ``small_dataset(n=37, compression=None)`` -> (path, records)."""

    def make(n: int = 37, compression: str | None = None, records_per_shard: int = 10) -> tuple[Path, np.ndarray]:
        recs = make_records(n)
        path = write_dataset(tmp_path / f"ds-{n}-{compression}-{records_per_shard}", recs,
                             records_per_shard=records_per_shard, compression=compression)
        return path, recs

    return make
