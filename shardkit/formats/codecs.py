"""Per-record compression codecs, by name (numcodecs style registry).

Each codec compresses ONE record (one zarr inner chunk) on its own, so a record can still be read
without touching its neighbours; the shard index then gives each record's offset and size. The codec's
configuration is stored twice: as a zarr v3 codec in the payload array's ``zarr.json`` (so zarr-python
decodes the same bytes) and as shardkit JSON in the group attributes (so shardkit does not have to
interpret zarr's codec pipeline).

The byte streams are exactly zarr v3's ``zstd``, ``gzip`` and ``blosc`` codecs; numcodecs implements
them, so we encode and decode with numcodecs directly instead of zarr's async codec pipeline, which is
far too slow per record on the hot path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from shardkit.errors import ConfigError

__all__ = [
    "RecordCodec",
    "register_codec",
    "get_codec",
    "codec_from_json",
    "codec_from_zarr",
    "available_codecs",
]


class RecordCodec(ABC):
    """Turns the raw little-endian bytes of one record into stored bytes and back."""

    #: Registry name, also the value of ``--compression``.
    name: ClassVar[str]

    @abstractmethod
    def encode(self, record: np.ndarray) -> bytes:
        """Compress the raw bytes of one C-contiguous record."""

    @abstractmethod
    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decompress ``data`` into ``out`` (a C-contiguous record buffer of the right size)."""

    @abstractmethod
    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The bytes-to-bytes codecs of the zarr v3 inner-chunk pipeline (after ``bytes``)."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """Configuration stored in the group attributes; ``codec_from_json`` reverses it."""


_REGISTRY: dict[str, type[RecordCodec]] = {}


def register_codec(cls: type[RecordCodec]) -> type[RecordCodec]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available_codecs() -> list[str]:
    """Names accepted by ``--compression`` (``none`` included)."""
    return ["none", *sorted(_REGISTRY)]


def get_codec(name: str | None, **config: Any) -> RecordCodec | None:
    """Instantiate the codec ``name``; ``None`` or ``"none"`` means uncompressed."""
    if name is None or name == "none":
        return None
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown compression {name!r}: expected one of {', '.join(available_codecs())}"
        ) from None
    try:
        return cls(**config)
    except TypeError as exc:
        raise ConfigError(f"bad configuration for compression {name!r}: {exc}") from None


def codec_from_json(data: dict[str, Any] | None) -> RecordCodec | None:
    """Rebuild a codec from the JSON stored in the metadata."""
    if data is None:
        return None
    config = dict(data)
    return get_codec(config.pop("name"), **config)


def _decode_into(codec: Any, data: bytes | memoryview, out: np.ndarray) -> None:
    # numcodecs decodes into a flat buffer; view the record as bytes so shapes never disagree.
    codec.decode(data, out=out.reshape(-1).view(np.uint8))


@register_codec
class ZstdCodec(RecordCodec):
    """Zstandard; ``level`` 1-22 (3 is zstd's default trade-off)."""

    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        from numcodecs import Zstd

        self.level = int(level)
        self._codec = Zstd(level=self.level)

    def encode(self, record: np.ndarray) -> bytes:
        return bytes(self._codec.encode(np.ascontiguousarray(record).reshape(-1).view(np.uint8)))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        _decode_into(self._codec, data, out)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [{"name": "zstd", "configuration": {"level": self.level, "checksum": False}}]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}


@register_codec
class GzipCodec(RecordCodec):
    """gzip (zlib deflate with a gzip header), ``level`` 0-9."""

    name = "gzip"

    def __init__(self, level: int = 5) -> None:
        from numcodecs import GZip

        self.level = int(level)
        self._codec = GZip(level=self.level)

    def encode(self, record: np.ndarray) -> bytes:
        return bytes(self._codec.encode(np.ascontiguousarray(record).reshape(-1).view(np.uint8)))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        _decode_into(self._codec, data, out)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [{"name": "gzip", "configuration": {"level": self.level}}]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}


@register_codec
class BloscLz4Codec(RecordCodec):
    """Blosc with the lz4 compressor and byte shuffle: fastest to decode, modest ratio."""

    name = "blosc-lz4"

    def __init__(self, level: int = 5) -> None:
        from numcodecs import Blosc

        self.level = int(level)
        self._codec = Blosc(cname="lz4", clevel=self.level, shuffle=Blosc.SHUFFLE, blocksize=0)

    def encode(self, record: np.ndarray) -> bytes:
        arr = np.ascontiguousarray(record)
        return bytes(self._codec.encode(arr))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        _decode_into(self._codec, data, out)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [
            {
                "name": "blosc",
                "configuration": {
                    "typesize": itemsize,
                    "cname": "lz4",
                    "clevel": self.level,
                    "shuffle": "shuffle",
                    "blocksize": 0,
                },
            }
        ]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}


def codec_from_zarr(codecs: list[dict[str, Any]], *, where: str) -> RecordCodec | None:
    """Map a zarr v3 inner-chunk codec list (``bytes`` [+ one compressor]) to a RecordCodec.

    Used to read arrays written by zarr-python; anything else (transpose, big-endian, two
    compressors) is refused with a clear error rather than decoded wrongly.
    """
    from shardkit.errors import NotADatasetError

    if not codecs or codecs[0].get("name") != "bytes":
        raise NotADatasetError(f"{where}: expected the 'bytes' codec first, found {codecs[:1]}")
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if endian != "little":
        raise NotADatasetError(f"{where}: expected little-endian records, found endian={endian!r}")
    rest = codecs[1:]
    if not rest:
        return None
    if len(rest) > 1:
        raise NotADatasetError(f"{where}: expected at most one compressor, found {[c['name'] for c in rest]}")
    name = rest[0].get("name")
    conf = rest[0].get("configuration") or {}
    if name == "zstd":
        return ZstdCodec(level=conf.get("level", 3))
    if name == "gzip":
        return GzipCodec(level=conf.get("level", 5))
    if name == "blosc":
        return BloscLz4Codec(level=conf.get("clevel", 5))  # blosc frames are self-describing
    raise NotADatasetError(f"{where}: unsupported zarr codec {name!r} (shardkit reads zstd, gzip, blosc)")
