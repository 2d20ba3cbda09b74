"""Per-record compression codecs, by name: zarr v3's ``zstd``, ``gzip`` and ``blosc`` byte streams,
one record each, the image and audio codecs of :mod:`~shardkit.formats.media_codecs` (``jpeg``, ``png``,
``webp``, ``jpegxl``, ``flac``, ``opus``, ``vorbis``), and :func:`decode_record`, the one decode every reader uses
(docs/design.md §3, *Codecs*).
"""

from __future__ import annotations

import gzip
import io
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import numpy as np

from shardkit.errors import ConfigError, CorruptShardError, NotADatasetError

__all__ = ["RecordCodec", "register_codec", "get_codec", "codec_from_json", "codec_from_zarr", "available_codecs", "codec_usage",
           "decode_record", "decode_error"]


class RecordCodec(ABC):
    """Turns the raw little-endian bytes of one record into stored bytes and back."""

    #: Registry name, also the value of ``--compression``.
    name: ClassVar[str]
    #: Name of the zarr v3 bytes-to-bytes codec with the same byte stream (array-to-bytes when
    #: :attr:`array_to_bytes`: the codec replaces zarr's ``bytes`` codec).
    zarr_name: ClassVar[str]
    #: True for codecs that turn a record array into bytes themselves (images, audio), False for
    #: compressors of the record's raw little-endian bytes.
    array_to_bytes: ClassVar[bool] = False
    #: True when a decoded record may differ from the one encoded (``convert`` then reports PSNR).
    lossy: ClassVar[bool] = False
    #: What a conversion measures on a sample for a lossy codec: ``psnr`` (images) or ``snr`` (audio).
    quality_measure: ClassVar[str] = "psnr"
    #: How ``--compression`` names this codec and its argument (the ``--help`` text is made of these).
    usage: ClassVar[str] = ""

    def row_offset(self, shape: tuple[int, ...]) -> int:
        """Bytes past a page boundary where a destination buffer of decoded ``shape`` records should
        start for this codec's decoder to write its rows fastest (0: page aligned)."""
        return 0

    @classmethod
    @abstractmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        """The codec that decodes what the zarr v3 codec ``zarr_name`` with ``configuration`` wrote."""

    @abstractmethod
    def encode(self, record: np.ndarray) -> bytes:
        """Compress the raw bytes of one C-contiguous record."""

    @abstractmethod
    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decompress ``data`` into ``out`` (a C-contiguous record), filling it exactly, else raise."""

    @abstractmethod
    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The bytes-to-bytes codecs of the zarr v3 inner-chunk pipeline (after ``bytes``)."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """Configuration stored in the group attributes; ``codec_from_json`` reverses it."""

    def is_lossy(self) -> bool:
        """True when this configuration may decode to other values than encoded (:attr:`lossy`, unless lossless)."""
        return self.lossy

    def check_record(self, shape: tuple[int, ...], dtype: str, where: str) -> None:
        """Refuse records this codec cannot store (a SchemaError naming ``where``, the shape and dtype
        expected and found); compressors of raw bytes take any record."""
        return

    def for_records(self, transform: dict[str, Any]) -> RecordCodec:
        """This codec configured for records a conversion's ``transform`` made (its metadata): audio codecs
        take its ``sample_rate``; every other codec needs nothing of it and is returned as it is."""
        return self

    def zarr_inner_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The whole zarr v3 inner-chunk codec list: ``bytes`` (little-endian) and :meth:`zarr_codecs`."""
        return [{"name": "bytes", "configuration": {"endian": "little"}}, *self.zarr_codecs(itemsize)]

    @classmethod
    def parse_argument(cls, argument: str) -> dict[str, Any]:
        """The configuration ``--compression NAME:ARGUMENT`` means (here: ``ARGUMENT`` is the level)."""
        try:
            return {"level": int(argument)}
        except ValueError:
            raise ConfigError(f"compression {cls.name!r}: expected {cls.name}:LEVEL (an integer), found {argument!r}") from None


_REGISTRY: dict[str, type[RecordCodec]] = {}
_ZARR_REGISTRY: dict[str, type[RecordCodec]] = {}


def register_codec(cls: type[RecordCodec]) -> type[RecordCodec]:
    """Class decorator: make ``cls`` available under ``cls.name`` and its zarr name ``cls.zarr_name``;
    ConfigError when either is taken (or ``none``): registering twice is a bug, not an override."""
    if cls.name == "none" or cls.name in _REGISTRY:
        raise ConfigError(f"codec name {cls.name!r} is already registered (by {_REGISTRY.get(cls.name)})")
    if cls.zarr_name in _ZARR_REGISTRY:
        raise ConfigError(f"zarr codec name {cls.zarr_name!r} is already registered (by {_ZARR_REGISTRY[cls.zarr_name]})")
    _REGISTRY[cls.name] = cls
    _ZARR_REGISTRY[cls.zarr_name] = cls
    return cls


def available_codecs() -> list[str]:
    """Names accepted by ``--compression`` (``none`` included)."""
    return ["none", *sorted(_REGISTRY)]


def codec_usage() -> str:
    """Every ``--compression`` value with its argument, from the registry (the ``--help`` text)."""
    return ", ".join(_REGISTRY[name].usage or name for name in sorted(_REGISTRY))


def get_codec(name: str | None, **config: Any) -> RecordCodec | None:
    """Instantiate the codec ``name``; ``None`` or ``"none"`` means uncompressed. ``NAME:ARGUMENT``
    (``jpeg:90``, ``webp:lossless``, ``zstd:9``, ``opus:32k@16k``) and ``NAME@RATE`` (``opus@16k``) are the
    codec's :meth:`~RecordCodec.parse_argument` of what follows the name."""
    if name is None or name == "none":
        return None
    cut = min((i for i in (name.find(":"), name.find("@")) if i >= 0), default=len(name))
    # ``NAME:ARG``; the audio codecs' ``NAME@RATE`` keeps its ``@`` (``opus@16k`` is ``opus:@16k``).
    name, argument, has_argument = name[:cut], name[cut + (name[cut:cut + 1] == ":"):], cut < len(name)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConfigError(f"unknown compression {name!r}: expected one of {', '.join(available_codecs())}")
    if has_argument:
        config = {**cls.parse_argument(argument), **config}
    try:
        return cls(**config)
    except TypeError as exc:
        raise ConfigError(f"bad configuration for compression {name!r}: {exc}") from None


def codec_from_json(data: dict[str, Any] | None) -> RecordCodec | None:
    """Rebuild a codec from the JSON stored in the metadata."""
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ConfigError(f"compression: expected null or an object with a 'name', found {data!r}")
    config = dict(data)
    return get_codec(config.pop("name"), **config)


class _NumcodecsCodec(RecordCodec):
    """A codec whose byte stream a numcodecs ``_codec`` writes and reads, records as flat bytes."""

    _codec: Any
    level: int

    def encode(self, record: np.ndarray) -> bytes:
        return bytes(self._codec.encode(np.ascontiguousarray(record).reshape(-1).view(np.uint8)))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The zarr codec of the same name, configured by :meth:`to_json` (zstd's and gzip's agree)."""
        return [{"name": self.zarr_name, "configuration": {k: v for k, v in self.to_json().items() if k != "name"}}]


@register_codec
class ZstdCodec(_NumcodecsCodec):
    """Zstandard; ``level`` 1-22 (3 is zstd's default trade-off); ``checksum`` (default on) appends the
    content checksum the decoder verifies (frames without one, as format 1.0 wrote them, decode too)."""

    name = "zstd"
    zarr_name = "zstd"
    usage = "zstd[:LEVEL]"

    def __init__(self, level: int = 3, checksum: bool = True) -> None:
        from numcodecs import Zstd

        self.level = _level(level, self.name)
        self.checksum = bool(checksum)
        self._codec = Zstd(level=self.level, checksum=self.checksum)

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(level=configuration.get("level", 3), checksum=configuration.get("checksum", False))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "checksum": self.checksum}

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Fast path when the frame header declares exactly the record size (zstd and numcodecs check
        the frames fill exactly ``out``); any other frame is stream-decoded, bounded, and must end there."""
        import zstandard

        flat = _flat(out)
        if zstandard.frame_content_size(data) == flat.nbytes:
            self._codec.decode(data, out=flat)
            return
        # A window larger than the record (and zstd's usual 8 MiB) is not needed to decode it.
        window = max(_ZSTD_MIN_WINDOW, 1 << max(0, flat.nbytes - 1).bit_length())
        reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(data, read_across_frames=True)
        _read_exact(reader, flat, "zstd")


@register_codec
class GzipCodec(_NumcodecsCodec):
    """gzip (zlib deflate with a gzip header), ``level`` 0-9."""

    name = "gzip"
    zarr_name = "gzip"
    usage = "gzip[:LEVEL 0-9]"

    def __init__(self, level: int = 5) -> None:
        from numcodecs import GZip

        self.level = _level(level, self.name)
        self._codec = GZip(level=self.level)

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(level=configuration.get("level", 5))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Every member decoded straight into ``out`` (as numcodecs reads them), bounded by its size."""
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as reader:
            _read_exact(reader, _flat(out), "gzip")


@register_codec
class BloscLz4Codec(_NumcodecsCodec):
    """Blosc with the lz4 compressor and byte shuffle: fastest to decode, modest ratio."""

    name = "blosc-lz4"
    zarr_name = "blosc"
    usage = "blosc-lz4[:LEVEL 0-9]"

    def __init__(self, level: int = 5) -> None:
        from numcodecs import Blosc

        self.level = _level(level, self.name)
        self._codec = Blosc(cname="lz4", clevel=self.level, shuffle=Blosc.SHUFFLE, blocksize=0)

    def encode(self, record: np.ndarray) -> bytes:
        return bytes(self._codec.encode(np.ascontiguousarray(record)))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """The header must declare the record size and the frame's length (blosc fills only that size)."""
        flat = _flat(out)
        if len(data) < _BLOSC_HEADER_NBYTES:
            raise ValueError(f"{len(data)} bytes are shorter than a blosc header ({_BLOSC_HEADER_NBYTES} bytes)")
        nbytes = int.from_bytes(data[4:8], "little")
        cbytes = int.from_bytes(data[12:16], "little")
        if nbytes != flat.nbytes:
            raise ValueError(f"the blosc header says it decodes to {nbytes} bytes, expected {flat.nbytes}")
        if cbytes != len(data):
            raise ValueError(f"the blosc header says the frame is {cbytes} bytes, found {len(data)}")
        self._codec.decode(data, out=flat)

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        # Blosc frames are self-describing: this decoder reads any compressor and shuffle.
        return cls(level=configuration.get("clevel", 5))

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        conf = {"typesize": itemsize, "cname": "lz4", "clevel": self.level, "shuffle": "shuffle", "blocksize": 0}
        return [{"name": "blosc", "configuration": conf}]


def codec_from_zarr(codecs: Any, *, where: str) -> RecordCodec | None:
    """Map a zarr v3 inner-chunk codec list (``bytes`` [+ one compressor]) to a RecordCodec; anything
    else (transpose, big-endian, an unregistered codec) is a NotADatasetError, never decoded wrongly."""
    if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
        raise NotADatasetError(f"{where}: expected a list of codec objects, found {codecs!r}"[:300])
    first = codecs[0].get("name") if codecs else None
    serializer = _ZARR_REGISTRY.get(first) if isinstance(first, str) else None
    if serializer is not None and serializer.array_to_bytes:
        if len(codecs) > 1:  # an image or audio stream is the record: nothing may follow it
            raise NotADatasetError(f"{where}: expected {first!r} alone, found {[c.get('name') for c in codecs]}")
        rest = codecs
    else:
        if first != "bytes":
            raise NotADatasetError(f"{where}: expected the 'bytes' codec first, found {codecs[:1]}")
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        if endian != "little":
            raise NotADatasetError(f"{where}: expected little-endian records, found endian={endian!r}")
        rest = codecs[1:]
        if not rest:
            return None
        if len(rest) > 1:
            raise NotADatasetError(f"{where}: expected at most one compressor, found {[c.get('name') for c in rest]}")
    name = rest[0].get("name")
    conf = rest[0].get("configuration") or {}
    cls = _ZARR_REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None or (cls.array_to_bytes and rest is not codecs):
        raise NotADatasetError(f"{where}: unsupported zarr codec {name!r} (shardkit reads {', '.join(sorted(_ZARR_REGISTRY))})")
    if not isinstance(conf, dict):
        raise NotADatasetError(f"{where}: codec {name!r}: expected a configuration object, found {conf!r}")
    try:
        return cls.from_zarr(conf)
    except (ConfigError, TypeError, ValueError) as exc:
        raise NotADatasetError(f"{where}: codec {name!r}: bad configuration ({exc})") from None


def decode_record(
    codec: RecordCodec, data: bytes | memoryview, out: np.ndarray, *, where: str, what: str | Callable[[], str]
) -> None:
    """Decode ``data`` into ``out`` (exactly ``out.nbytes`` bytes), or raise CorruptShardError naming the
    file (``where``) and the record or chunk (``what``, or a function called only on an error). Every
    reader and ``verify`` decode through it, so what one accepts the others accept too."""
    try:
        codec.decode(data, out)
    except Exception as exc:
        raise decode_error(where, what if isinstance(what, str) else what(), out.nbytes, exc) from None


def decode_error(where: str, name: str, nbytes: int, exc: Exception) -> CorruptShardError:
    """The error of a record or chunk ``name`` of the file ``where`` that failed to decode into its
    ``nbytes`` bytes with ``exc`` (:func:`decode_record`'s, for readers that decode in a loop of their own)."""
    return CorruptShardError(f"{where}: {name} does not decode to its {nbytes} bytes ({exc})")


#: Bytes of a blosc frame header (version, flags, type size, nbytes, blocksize, cbytes).
_BLOSC_HEADER_NBYTES = 16
#: Smallest zstd window the stream decoder accepts (zstd's default window at most levels is smaller).
_ZSTD_MIN_WINDOW = 8 << 20


class _Reader(Protocol):
    def readinto(self, buffer: Any, /) -> int: ...

    def read(self, size: int = ..., /) -> bytes: ...


def _flat(out: np.ndarray) -> np.ndarray:
    """``out`` as a flat uint8 view (no copy: ``out`` is C-contiguous)."""
    flat: np.ndarray = out.reshape(-1).view(np.uint8)
    return flat


def _read_exact(reader: _Reader, flat: np.ndarray, name: str) -> None:
    """Fill ``flat`` from a decompressing ``reader``; fewer bytes, or any more, is an error."""
    view = flat.data
    got = 0
    while got < flat.nbytes:
        n = reader.readinto(view[got:])
        if not n:
            raise ValueError(f"{name} data decodes to {got} bytes, expected {flat.nbytes}")
        got += n
    if reader.read(1):
        raise ValueError(f"{name} data decodes to more than the {flat.nbytes} bytes expected")


def _level(level: Any, name: str) -> int:
    """A compression level: an integer (bools and floats are refused)."""
    if not isinstance(level, int) or isinstance(level, bool):
        raise ConfigError(f"compression {name!r}: level must be an integer, found {level!r}")
    return level


# The image and audio codecs register themselves (their libraries are imported only when used).
from shardkit.formats import media_codecs  # noqa: E402, F401
