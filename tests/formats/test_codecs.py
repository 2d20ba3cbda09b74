"""Codec registries (shardkit names and zarr names) and the payload layout value object."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import PayloadArray, codecs
from shardkit.formats.codecs import RecordCodec, codec_from_zarr, get_codec, register_codec
from shardkit.formats.reader import ShardedLayout
from tests.helpers.datasets import make_records, write_dataset


@pytest.fixture
def registries(monkeypatch) -> None:
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(codecs, "_REGISTRY", dict(codecs._REGISTRY))
    monkeypatch.setattr(codecs, "_ZARR_REGISTRY", dict(codecs._ZARR_REGISTRY))


def _codec_class(name: str, zarr_name: str) -> type[RecordCodec]:
    class Identity(RecordCodec):
        """Stores the raw bytes (a stand-in for a plug-in codec)."""

        def encode(self, record: np.ndarray) -> bytes:
            return record.tobytes()

        def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)

        def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
            return [{"name": self.zarr_name}]

        def to_json(self) -> dict[str, Any]:
            return {"name": self.name}

        @classmethod
        def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
            return cls()

    Identity.name = name
    Identity.zarr_name = zarr_name
    return Identity


@pytest.mark.parametrize("name,zarr_name", [("zstd", "other"), ("other", "zstd"), ("none", "other2")])
def test_duplicate_codec_names_are_refused(registries: None, name: str, zarr_name: str) -> None:
    before = (dict(codecs._REGISTRY), dict(codecs._ZARR_REGISTRY))
    with pytest.raises(errors.ConfigError, match="already registered"):
        register_codec(_codec_class(name, zarr_name))
    assert (codecs._REGISTRY, codecs._ZARR_REGISTRY) == before  # nothing half-registered


def test_zarr_codec_names_are_looked_up_in_the_registry(registries: None) -> None:
    where = "test/zarr.json"
    with pytest.raises(errors.NotADatasetError, match="unsupported zarr codec 'ident'"):
        codec_from_zarr([{"name": "bytes"}, {"name": "ident"}], where=where)
    cls = register_codec(_codec_class("identity", "ident"))
    assert isinstance(codec_from_zarr([{"name": "bytes"}, {"name": "ident"}], where=where), cls)
    assert isinstance(codec_from_zarr([{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 5}}],
                                      where=where), codecs.ZstdCodec)
    assert get_codec("identity") is not None


def test_zstd_writes_frame_checksums_and_says_so_in_both_documents() -> None:
    codec = get_codec("zstd")
    assert isinstance(codec, codecs.ZstdCodec)
    assert codec.to_json() == {"name": "zstd", "level": 3, "checksum": True}
    assert codec.zarr_codecs(1) == [{"name": "zstd", "configuration": {"level": 3, "checksum": True}}]
    frame = codec.encode(np.arange(64, dtype=np.uint8))
    bad = bytearray(frame)
    bad[-1] ^= 0x01  # the content checksum itself
    with pytest.raises(RuntimeError, match="checksum"):
        codec.decode(bytes(bad), np.empty(64, np.uint8))


def test_codec_levels_must_be_integers() -> None:
    with pytest.raises(errors.ConfigError, match="level must be an integer"):
        get_codec("gzip", level="9")


def test_payload_layout_is_a_frozen_value(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "ds", make_records(12), records_per_shard=5, compression="zstd")
    layout = PayloadArray(path / "image").layout
    assert isinstance(layout, ShardedLayout) and dataclasses.is_dataclass(layout)
    assert (layout.shape, layout.records_per_shard, layout.separator, layout.fill_value) == ((12, 4, 3, 3), 5, "/", 0)
    assert isinstance(layout.codec, codecs.ZstdCodec) and layout.dtype == np.dtype("uint8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.records_per_shard = 6  # type: ignore[misc]
