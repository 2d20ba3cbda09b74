"""A field's ``zarr.json`` is read once per open dataset: the copy the open read and checked
serves the field's read (node-shared fields included), not a second request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import Dataset, versions
from tests.helpers.sampler_data import make_dataset


def test_a_field_read_uses_the_document_the_open_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_dataset(tmp_path / "ds", 12, records_per_shard=4)
    reads: list[str] = []
    real = versions.read_object

    def counted(store: Any, key: str, *args: Any, **kwargs: Any) -> bytes:
        reads.append(key)
        return real(store, key, *args, **kwargs)

    monkeypatch.setattr(versions, "read_object", counted)
    with Dataset(path) as ds:
        names = list(ds.meta.fields)
        assert names
        fields = ds.fields
        out = np.empty_like(fields[names[0]])
        ds._fields = None  # as a sampler filling node-shared memory with nothing loaded yet
        ds.field(names[0], out=out)
        np.testing.assert_array_equal(out, fields[names[0]])
    for name in names:
        assert reads.count(f"{name}/zarr.json") == 1, reads
