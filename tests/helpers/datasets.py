"""Small generated datasets written with shardkit's own writer, and byte-level edits of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec

REPO = Path(__file__).resolve().parents[2]
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


def flip_byte(file: Path, pos: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``pos`` (negative counts from the end) with ``mask``."""
    raw = bytearray(file.read_bytes())
    raw[pos] ^= mask
    file.write_bytes(bytes(raw))


def edit_attributes(path: Path, edit: Callable[[dict[str, Any]], None], *, fix_checksum: bool = True) -> None:
    """Apply ``edit`` to the ``shardkit`` attributes of dataset ``path``; recompute their own crc32c."""
    from shardkit.formats.checksums import ATTRIBUTES_CRC_KEY, attributes_crc32c

    doc_path = path / "zarr.json"
    doc = json.loads(doc_path.read_text())
    attrs = doc["attributes"]["shardkit"]
    edit(attrs)
    if fix_checksum and ATTRIBUTES_CRC_KEY in attrs:
        attrs[ATTRIBUTES_CRC_KEY] = attributes_crc32c(attrs)
    doc_path.write_text(json.dumps(doc, indent=2))


def rewrite_shard_index(file: Path, records_per_shard: int, edit: Callable[[np.ndarray], None]) -> None:
    """Edit a shard's index table ``[S, 2]`` (offset, nbytes) in place and rewrite a *valid* crc32c."""
    from shardkit.formats.index import crc32c_of

    raw = bytearray(file.read_bytes())
    start = len(raw) - records_per_shard * 16 - 4
    table = np.frombuffer(bytes(raw[start:-4]), "<u8").reshape(records_per_shard, 2).copy()
    edit(table)
    body = table.astype("<u8").tobytes()
    raw[start:] = body + crc32c_of(body).to_bytes(4, "little")
    file.write_bytes(bytes(raw))


def upload(path: Path, url: str) -> str:
    """Copy the local dataset ``path`` to ``url`` (root document last); returns the URL."""
    from shardkit.formats.transfer import upload_dataset

    upload_dataset(path, url)
    return url

