"""Image and audio codecs per record: ``jpeg``, ``png``, ``webp``, ``jpegxl`` (imagecodecs), ``flac``,
``opus`` and ``vorbis`` (soundfile). Each turns one record array into one stored stream (a zarr v3 array-to-bytes codec: it
replaces zarr's ``bytes`` codec) and decodes it straight into the record's row of the destination
buffer. The codec library is chosen with numbers in docs/design.md §3 (*Image and audio codecs*).
"""

from __future__ import annotations

import io
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from shardkit._extras import import_extra
from shardkit.errors import ConfigError, SchemaError
from shardkit.formats.codecs import RecordCodec, register_codec
from shardkit.units import parse_rate

__all__ = ["ImageCodec", "JpegCodec", "PngCodec", "WebpCodec", "JpegxlCodec", "FlacCodec", "OggAudioCodec", "OpusCodec",
           "VorbisCodec", "imagecodecs_module"]

#: The pip extra that installs the image codec library.
CODECS_EXTRA = "codecs"
#: Where a batch buffer of RGB JPEG records starts past a page (see :meth:`JpegCodec.row_offset`).
JPEG_ROW_OFFSET = 16


def imagecodecs_module() -> Any:
    """The ``imagecodecs`` module, or MissingExtraError naming ``shardkit[codecs]``."""
    return import_extra("imagecodecs", CODECS_EXTRA, needed_by="shardkit's image codecs (jpeg, png, webp, jpegxl)")


class ImageCodec(RecordCodec):
    """An image format of imagecodecs, one uint8 ``[H, W, C]`` image a record (``C`` in :attr:`channels`)."""

    array_to_bytes = True
    #: Channel counts the format stores.
    channels: ClassVar[tuple[int, ...]]
    #: Largest width or height the format stores.
    max_side: ClassVar[int]
    #: imagecodecs' function prefix (``jpeg8`` for ``jpeg8_encode`` / ``jpeg8_decode``).
    _function: ClassVar[str]

    def __init__(self) -> None:
        module = imagecodecs_module()
        self._encode_fn = getattr(module, f"{self._function}_encode")
        self._decode_fn = getattr(module, f"{self._function}_decode")

    def check_record(self, shape: tuple[int, ...], dtype: str, where: str) -> None:
        """uint8 ``[H, W, C]`` with ``C`` in :attr:`channels` and each side at most :attr:`max_side`."""
        ok = dtype == "uint8" and len(shape) == 3 and shape[2] in self.channels and max(shape[:2]) <= self.max_side
        if not ok:
            raise SchemaError(
                f"{where}: compression {self.name!r} stores uint8 images [H, W, C] with C in {list(self.channels)} and "
                f"sides of at most {self.max_side} pixels, found records {list(shape)} {dtype} (use zstd for other records)"
            )

    def encode(self, record: np.ndarray) -> bytes:
        return bytes(self._encode_fn(_image_view(np.ascontiguousarray(record)), **self._encode_args()))

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decode into ``out`` itself; a stream of any other shape or type is refused before its pixels
        are decoded (imagecodecs compares the header with ``out``), so a record never allocates more."""
        view = _image_view(out)
        got = self._decode_fn(data, out=view)
        if got is not view:
            if got.shape != view.shape or got.dtype != view.dtype:
                raise ValueError(f"the {self.name} stream decodes to {got.shape} {got.dtype}, expected {view.shape} {view.dtype}")
            view[...] = got

    def _encode_args(self) -> dict[str, Any]:
        """Keyword arguments of imagecodecs' encode function."""
        return {}

    def zarr_inner_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return self.zarr_codecs(itemsize)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The one array-to-bytes codec: imagecodecs' numcodecs codec of the same stream, under zarr-python's
        ``numcodecs.<id>`` naming (:mod:`shardkit.formats.zarr_codecs` makes zarr-python read it)."""
        return [{"name": self.zarr_name, "configuration": self._zarr_configuration()}]

    def _zarr_configuration(self) -> dict[str, Any]:
        return {}


def _image_view(a: np.ndarray) -> np.ndarray:
    """A one-channel ``[H, W, 1]`` image as ``[H, W]`` (the shape the image libraries use), else ``a``."""
    return a.reshape(a.shape[:2]) if a.ndim == 3 and a.shape[2] == 1 else a


def _quality(value: Any, name: str) -> int:
    """A quality 1-100 (an integer; bools and floats are refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 100:
        raise ConfigError(f"compression {name!r}: quality must be an integer in [1, 100], found {value!r}")
    return value


def _quality_or_lossless(cls: type[RecordCodec], argument: str) -> dict[str, Any]:
    """``lossless`` or a quality 1-100."""
    if argument == "lossless":
        return {"lossless": True}
    try:
        return {"quality": int(argument)}
    except ValueError:
        raise ConfigError(f"compression {cls.name!r}: expected {cls.name}:QUALITY (1-100) or {cls.name}:lossless, "
                          f"found {argument!r}") from None


@register_codec
class JpegCodec(ImageCodec):
    """Baseline JPEG (libjpeg-turbo through imagecodecs), 4:2:0 chroma; ``quality`` 1-100 (90 default)."""

    name = "jpeg"
    usage = "jpeg[:QUALITY 1-100]"
    zarr_name = "numcodecs.imagecodecs_jpeg"
    lossy = True
    channels = (1, 3)
    max_side = 65500
    _function = "jpeg8"

    def __init__(self, quality: int = 90) -> None:
        self.quality = _quality(quality, self.name)
        super().__init__()

    @classmethod
    def parse_argument(cls, argument: str) -> dict[str, Any]:
        try:
            return {"quality": int(argument)}
        except ValueError:
            raise ConfigError(f"compression 'jpeg': expected jpeg:QUALITY (1-100), found {argument!r}") from None

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(quality=configuration.get("level", 90))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "quality": self.quality}

    def _encode_args(self) -> dict[str, Any]:
        return {"level": self.quality}

    def row_offset(self, shape: tuple[int, ...]) -> int:
        """16 for RGB records of a multiple of 32 bytes: libjpeg-turbo's AVX2 colour conversion writes
        a row that starts on a 32-byte boundary with non-temporal stores, which cost 80-90 µs more per
        224x224 record on this VM than ordinary ones (docs/design.md §4, *Decoding*); 16 bytes past
        a page every row of such a buffer starts off one."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        return JPEG_ROW_OFFSET if len(shape) == 3 and shape[2] == 3 and nbytes % 32 == 0 else 0

    def _zarr_configuration(self) -> dict[str, Any]:
        return {"level": self.quality}


@register_codec
class PngCodec(ImageCodec):
    """PNG (lossless, zlib ``level`` 0-9, 6 default)."""

    name = "png"
    usage = "png[:LEVEL 0-9]"
    zarr_name = "numcodecs.imagecodecs_png"
    channels = (1, 3, 4)
    max_side = 1 << 24
    _function = "png"

    def __init__(self, level: int = 6) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 9:
            raise ConfigError(f"compression 'png': level must be an integer in [0, 9], found {level!r}")
        self.level = level
        super().__init__()

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(level=configuration.get("level", 6))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}

    def _encode_args(self) -> dict[str, Any]:
        return {"level": self.level}

    def _zarr_configuration(self) -> dict[str, Any]:
        return {"level": self.level}


class _QualityOrLossless(ImageCodec):
    """A format with a lossy ``quality`` 1-100 and a ``lossless`` mode (webp, jpegxl)."""

    def __init__(self, quality: int = 90, lossless: bool = False) -> None:
        if not isinstance(lossless, bool):
            raise ConfigError(f"compression {self.name!r}: lossless must be true or false, found {lossless!r}")
        self.quality = _quality(quality, self.name)
        self.lossless = lossless
        super().__init__()

    def is_lossy(self) -> bool:
        return not self.lossless

    @classmethod
    def parse_argument(cls, argument: str) -> dict[str, Any]:
        return _quality_or_lossless(cls, argument)

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(quality=int(configuration.get("level", 90)), lossless=bool(configuration.get("lossless", False)))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "quality": self.quality, "lossless": self.lossless}

    def _encode_args(self) -> dict[str, Any]:
        return {"level": self.quality, "lossless": self.lossless}

    def _zarr_configuration(self) -> dict[str, Any]:
        return {"level": self.quality, "lossless": self.lossless}


@register_codec
class WebpCodec(_QualityOrLossless):
    """WebP (libwebp through imagecodecs): ``quality`` 1-100 (90 default) or ``lossless``; RGB or RGBA."""

    name = "webp"
    usage = "webp[:QUALITY 1-100|lossless]"
    zarr_name = "numcodecs.imagecodecs_webp"
    lossy = True
    channels = (3, 4)
    max_side = 16383
    _function = "webp"


@register_codec
class JpegxlCodec(_QualityOrLossless):
    """JPEG XL (libjxl through imagecodecs): ``quality`` 1-100 (90 default) or ``lossless``."""

    name = "jpegxl"
    usage = "jpegxl[:QUALITY 1-100|lossless]"
    zarr_name = "numcodecs.imagecodecs_jpegxl"
    lossy = True
    channels = (1, 3, 4)
    max_side = 1 << 20
    _function = "jpegxl"

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        # libjxl decodes with a thread pool of its own by default; the loader's decode pool is the
        # parallelism (one thread per record), so extra threads would only compete with it.
        view = _image_view(out)
        got = self._decode_fn(data, out=view, numthreads=1)
        if got is not view:
            raise ValueError(f"the jpegxl stream decodes to {got.shape} {got.dtype}, expected {view.shape} {view.dtype}")


@register_codec
class FlacCodec(RecordCodec):
    """FLAC (lossless; libsndfile through soundfile), int16 audio ``[T]`` or ``[T, C]`` (C ≤ 8)."""

    name = "flac"
    usage = "flac[:LEVEL 0-8]"
    zarr_name = "shardkit.flac"
    array_to_bytes = True
    #: FLAC's sample rate is only a header field here (records are sample arrays): a fixed, valid one.
    SAMPLE_RATE = 48000

    def __init__(self, level: int = 5) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 8:
            raise ConfigError(f"compression 'flac': level must be an integer in [0, 8], found {level!r}")
        self.level = level

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        return cls(level=configuration.get("level", 5))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level}

    def check_record(self, shape: tuple[int, ...], dtype: str, where: str) -> None:
        """int16 samples ``[T]`` or ``[T, C]`` with 1-8 channels (FLAC's limit)."""
        if dtype != "int16" or not (len(shape) == 1 or (len(shape) == 2 and 1 <= shape[1] <= 8)):
            raise SchemaError(
                f"{where}: compression 'flac' stores int16 audio [T] or [T, C] with C ≤ 8, found records "
                f"{list(shape)} {dtype} (use zstd for float audio)"
            )

    def encode(self, record: np.ndarray) -> bytes:
        import soundfile

        buf = io.BytesIO()
        # libsndfile maps FLAC's levels 0-8 onto a compression fraction in [0, 1].
        with soundfile.SoundFile(buf, "w", samplerate=self.SAMPLE_RATE, channels=1 if record.ndim == 1 else record.shape[1],
                                 format="FLAC", subtype="PCM_16", compression_level=self.level / 8) as f:
            f.write(np.ascontiguousarray(record))
        return buf.getvalue()

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """The stream's frame and channel counts must be the record's (checked before decoding)."""
        import soundfile

        with soundfile.SoundFile(io.BytesIO(data)) as f:
            channels = 1 if out.ndim == 1 else out.shape[1]
            if f.format != "FLAC" or f.frames != out.shape[0] or f.channels != channels:
                raise ValueError(f"the stream is {f.format} {f.frames} frames x {f.channels} channels, "
                                 f"expected FLAC {out.shape[0]} x {channels}")
            got = f.read(out.shape[0], dtype="int16", out=out, always_2d=False)
            if got.shape[0] != out.shape[0]:
                raise ValueError(f"the FLAC stream holds {got.shape[0]} frames, expected {out.shape[0]}")

    def zarr_inner_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return self.zarr_codecs(itemsize)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [{"name": self.zarr_name, "configuration": {"level": self.level}}]


class OggAudioCodec(RecordCodec):
    """Lossy audio, one Ogg stream a record (libsndfile through soundfile): int16 or float32 ``[T]`` or
    ``[T, C]`` (C ≤ 8) at the records' sample rate, which the codec needs (a lossy coder shapes its noise
    by frequency) and takes from the conversion (:meth:`for_records`) or from ``NAME:ARG@RATE``.

    Length: libsndfile ends the stream with the granule position of the last sample (Opus subtracts its
    pre-skip), so the stream declares exactly ``T`` frames, encoder priming and last-packet padding cut
    off; a stream that declares any other length, channel count or rate is refused before decoding.
    Type: decoding is float; int16 records are ``clip(rint(x * 32767), -32768, 32767)`` (libsndfile's own
    scale, but clipped: a lossy stream overshoots full scale, and libsndfile's int16 read wraps around).
    """

    array_to_bytes = True
    lossy = True
    quality_measure = "snr"
    #: libsndfile's Ogg subtype.
    _subtype: ClassVar[str]
    #: Channels stored (FLAC's limit too; Opus' and Vorbis' defined channel layouts stop at 8).
    MAX_CHANNELS = 8
    DTYPES = ("int16", "float32")

    def __init__(self, sample_rate: int | None) -> None:
        if sample_rate is not None:
            if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or not self._rate_ok(sample_rate):
                raise ConfigError(f"compression {self.name!r}: sample_rate must be {self._rates_text()}, found {sample_rate!r}")
        self.sample_rate = sample_rate

    @classmethod
    @abstractmethod
    def _rate_ok(cls, rate: int) -> bool:
        """True when the format stores audio at ``rate`` Hz."""

    @classmethod
    @abstractmethod
    def _rates_text(cls) -> str:
        """The rates :meth:`_rate_ok` accepts, for error messages."""

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """The configuration besides the sample rate (JSON and zarr alike)."""

    @abstractmethod
    def _level(self) -> float:
        """libsndfile's compression level 0 (best quality) - 1 (smallest) for this configuration."""

    #: What the argument before ``@RATE`` is, for errors (``opus:BITRATE (bits/s per channel: ...)``).
    _argument_usage: ClassVar[str]

    @classmethod
    @abstractmethod
    def _parse_setting(cls, arg: str) -> dict[str, Any]:
        """The codec's own setting from the text between ``:`` and ``@`` (not empty); raises ValueError
        (a ConfigError is one) when it is not one."""

    @classmethod
    def parse_argument(cls, argument: str) -> dict[str, Any]:
        """``ARG@RATE`` or ``ARG`` or ``@RATE``: the rate parsed here, ``ARG`` by :meth:`_parse_setting`;
        a bad ``ARG`` is refused with the codec's usage and the whole argument."""
        arg, at, text = argument.partition("@")
        rate = {"sample_rate": parse_rate(text, what=f"compression {cls.name!r}: the rate after @")} if at else {}
        if not arg:
            return rate
        try:
            return {**cls._parse_setting(arg), **rate}
        except ValueError:
            raise ConfigError(f"compression {cls.name!r}: expected {cls._argument_usage} and optionally @RATE, "
                              f"found {argument!r}") from None

    def for_records(self, transform: dict[str, Any]) -> RecordCodec:
        """The codec at the records' ``sample_rate``; a rate given with ``@`` must be that one."""
        rate = transform.get("sample_rate")
        if not isinstance(rate, int) or isinstance(rate, bool):
            return self
        if self.sample_rate is None:
            return type(self)(**{**self._config(), "sample_rate": rate})
        if self.sample_rate != rate:
            raise ConfigError(f"compression {self.name!r}: sample_rate {self.sample_rate} Hz differs from the records' "
                              f"{rate} Hz (leave @RATE out: the records' rate is used)")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self._config(), "sample_rate": self.sample_rate}

    @classmethod
    def from_zarr(cls, configuration: dict[str, Any]) -> RecordCodec:
        if "sample_rate" not in configuration:
            raise ConfigError(f"compression {cls.name!r}: the configuration has no sample_rate")
        return cls(**configuration)

    def zarr_inner_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return self.zarr_codecs(itemsize)

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        return [{"name": self.zarr_name, "configuration": {**self._config(), "sample_rate": self.sample_rate}}]

    def check_record(self, shape: tuple[int, ...], dtype: str, where: str) -> None:
        """int16 or float32 ``[T]`` or ``[T, C ≤ 8]`` at a known sample rate."""
        ok = dtype in self.DTYPES and shape[:1] != (0,) and (
            len(shape) == 1 or (len(shape) == 2 and 1 <= shape[1] <= self.MAX_CHANNELS))
        if not ok:
            raise SchemaError(
                f"{where}: compression {self.name!r} stores int16 or float32 audio [T] or [T, C] with C ≤ "
                f"{self.MAX_CHANNELS}, found records {list(shape)} {dtype} (use flac or zstd for other records)"
            )
        import soundfile

        if self._subtype not in soundfile.available_subtypes("OGG"):
            raise ConfigError(f"{where}: compression {self.name!r}: this libsndfile ({soundfile.__libsndfile_version__}) has "
                              f"no Ogg {self._subtype.title()} (install the soundfile wheel, which bundles one that does)")
        if self.sample_rate is None:
            raise SchemaError(
                f"{where}: compression {self.name!r} needs the records' sample rate, and these records have none "
                f"(convert an audio kind, whose --sample-rate it takes, or write {self.name}:...@RATE, e.g. "
                f"{self.usage.split('[')[0]}@16k)"
            )

    def encode(self, record: np.ndarray) -> bytes:
        import soundfile

        buf = io.BytesIO()
        with soundfile.SoundFile(buf, "w", samplerate=self.sample_rate, channels=1 if record.ndim == 1 else record.shape[1],
                                 format="OGG", subtype=self._subtype, compression_level=self._level()) as f:
            f.write(np.ascontiguousarray(record))
        return buf.getvalue()

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """The stream's format, frames, channels and rate must be the record's (checked before decoding)."""
        import soundfile

        with soundfile.SoundFile(io.BytesIO(data)) as f:
            channels = 1 if out.ndim == 1 else out.shape[1]
            if (f.format, f.subtype, f.frames, f.channels, f.samplerate) != ("OGG", self._subtype, out.shape[0], channels,
                                                                             self.sample_rate):
                raise ValueError(f"the stream is {f.format}/{f.subtype} {f.frames} frames x {f.channels} channels at "
                                 f"{f.samplerate} Hz, expected OGG/{self._subtype} {out.shape[0]} x {channels} at "
                                 f"{self.sample_rate} Hz")
            buf = out if out.dtype == np.float32 else np.empty(out.shape, np.float32)
            got = f.read(out.shape[0], dtype="float32", out=buf, always_2d=False)
            if got.shape[0] != out.shape[0]:
                raise ValueError(f"the {self.name} stream holds {got.shape[0]} frames, expected {out.shape[0]}")
        if buf is not out:
            np.multiply(buf, 32767.0, out=buf)
            np.rint(buf, out=buf)
            np.clip(buf, -32768, 32767, out=buf)
            out[...] = buf


@register_codec
class OpusCodec(OggAudioCodec):
    """Opus in Ogg (libopus through libsndfile): ``bitrate`` 6,000-256,000 bits/s per channel (32,000
    default), at 8, 12, 16, 24 or 48 kHz (Opus' rates; libsndfile refuses others)."""

    name = "opus"
    zarr_name = "shardkit.opus"
    usage = "opus[:BITRATE 6k-256k][@RATE]"
    _argument_usage = "opus:BITRATE (bits/s per channel: 32000, 32k)"
    _subtype = "OPUS"
    RATES = (8000, 12000, 16000, 24000, 48000)
    MIN_BITRATE, MAX_BITRATE = 6000, 256000

    def __init__(self, bitrate: int = 32000, sample_rate: int | None = None) -> None:
        if not isinstance(bitrate, int) or isinstance(bitrate, bool) or not self.MIN_BITRATE <= bitrate <= self.MAX_BITRATE:
            raise ConfigError(f"compression 'opus': bitrate must be {self.MIN_BITRATE}-{self.MAX_BITRATE} bits/s per "
                              f"channel, found {bitrate!r}")
        self.bitrate = bitrate
        super().__init__(sample_rate)

    @classmethod
    def _rate_ok(cls, rate: int) -> bool:
        return rate in cls.RATES

    @classmethod
    def _rates_text(cls) -> str:
        return "one of " + ", ".join(map(str, cls.RATES)) + " Hz (Opus' rates)"

    @classmethod
    def _parse_setting(cls, arg: str) -> dict[str, Any]:
        return {"bitrate": parse_rate(arg, what="compression 'opus'")}

    def _config(self) -> dict[str, Any]:
        return {"bitrate": self.bitrate}

    def _level(self) -> float:
        # libsndfile sets Opus' bitrate to int((1 - level) * 250000 + 6000) per channel; the half bit
        # keeps the float round trip from truncating to bitrate - 1.
        return max(0.0, (self.MAX_BITRATE - self.bitrate - 0.5) / (self.MAX_BITRATE - self.MIN_BITRATE))


@register_codec
class VorbisCodec(OggAudioCodec):
    """Vorbis in Ogg (libvorbis through libsndfile): ``quality`` 0-10 (oggenc's scale, 4 default), at
    1-192 kHz (libvorbis has no setup beyond; libsndfile crashes at 384 kHz, so it is refused here)."""

    name = "vorbis"
    zarr_name = "shardkit.vorbis"
    usage = "vorbis[:QUALITY 0-10][@RATE]"
    _argument_usage = "vorbis:QUALITY (0-10)"
    _subtype = "VORBIS"
    MIN_RATE, MAX_RATE = 1000, 192000

    def __init__(self, quality: int = 4, sample_rate: int | None = None) -> None:
        if not isinstance(quality, int) or isinstance(quality, bool) or not 0 <= quality <= 10:
            raise ConfigError(f"compression 'vorbis': quality must be an integer in [0, 10], found {quality!r}")
        self.quality = quality
        super().__init__(sample_rate)

    @classmethod
    def _rate_ok(cls, rate: int) -> bool:
        return cls.MIN_RATE <= rate <= cls.MAX_RATE

    @classmethod
    def _rates_text(cls) -> str:
        return f"{cls.MIN_RATE}-{cls.MAX_RATE} Hz"

    @classmethod
    def _parse_setting(cls, arg: str) -> dict[str, Any]:
        return {"quality": int(arg)}

    def _config(self) -> dict[str, Any]:
        return {"quality": self.quality}

    def _level(self) -> float:
        return 1.0 - self.quality / 10  # libsndfile: Vorbis VBR quality = 1 - level


def stored_nbytes_field(payload: str) -> str:
    """The batch entry that holds each record's stored length when records are not decoded."""
    return f"{payload}_nbytes"


def stored_nbytes(ds: Any) -> np.ndarray:
    """Every record's stored size, int64 ``[N]``, from the shard indexes of the dataset ``ds`` (the
    lengths batches carry when ``decode`` is off); a record stored in more bytes than a decoded
    record is a SchemaError naming it (its stream would not fit the row that carries it)."""
    payload = ds.payload
    out = np.full(payload.num_records, payload.record_nbytes, dtype=np.int64)
    if payload.codec is None:
        return out
    for i, info in enumerate(payload.shards):
        out[info.start : info.stop] = payload.index(i).nbytes[: info.count]
    if out.size and int(out.max()) > payload.record_nbytes:
        k = int(np.argmax(out))
        raise SchemaError(
            f"{ds.path}: record {k} is stored in {int(out[k])} bytes, more than the {payload.record_nbytes} bytes of a "
            f"decoded record, so its stored bytes cannot be handed over in a batch row: read this dataset with decode on"
        )
    return out


def cuda_decoder() -> Any:
    """``torchvision.io.decode_jpeg`` when torch sees a CUDA device, else a ConfigError saying what is missing."""
    try:
        import torch
        from torchvision.io import decode_jpeg
    except ImportError as exc:
        raise ConfigError(f"decode='cuda' needs torch and torchvision (torchvision.io.decode_jpeg), which could not be "
                          f"imported ({exc}); use decode=True to decode on the CPU") from None
    if not torch.cuda.is_available():
        raise ConfigError("decode='cuda' needs a CUDA device, and torch.cuda.is_available() is False here; use "
                          "decode=True to decode on the CPU, or decode=False for the stored bytes")
    return decode_jpeg
