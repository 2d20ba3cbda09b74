"""What the MDS (MosaicML Streaming) and LitData importers share: shard files of rows behind an index.

Both formats write a directory holding ``index.json`` and shard files laid out the same way: a
``uint32`` row count ``n``, ``n + 1`` ``uint32`` absolute offsets, then the rows; a row is a header of
``uint32`` column sizes followed by the columns' bytes. The index, the offsets and every size are
someone else's claims: each is checked against the file's real size before anything is read or
allocated, paths in the index stay inside the source directory, and pickled columns are never loaded.
Each kind (:mod:`~shardkit.converters.mds`, :mod:`~shardkit.converters.litdata`) parses its index into
:class:`ShardInfo` and :class:`Column` and lets :class:`RowShardConverter` do the rest (docs/design.md §2).
"""

from __future__ import annotations

import bz2
import functools
import io
import json
import logging
import math
import mmap
import os
import stat
import struct
import zlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shardkit.converters import untrusted_json
from shardkit.converters.audio_transforms import AUDIO_COLUMNS, AudioTransform
from shardkit.converters.base import (
    PROVENANCE,
    RECORD_BYTES_PER_CALL,
    Converter,
    Decoded,
    Decoder,
    InputNames,
    ScanResult,
    Skip,
)
from shardkit.converters.classfolders import choose_split
from shardkit.converters.images import IMAGE_COLUMNS, ImageTransform, color_flags, image_options, to_rgb
from shardkit.converters.layout import RecordLayout
from shardkit.converters.options import Option, text
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import FieldSpec

__all__ = [
    "INDEX",
    "MAX_INDEX_BYTES",
    "MAX_SHARD_BYTES",
    "LABEL_NAMES",
    "Column",
    "ShardInfo",
    "RowShardConverter",
    "RowShardDecoder",
    "array_from",
    "list_images",
    "decompress",
    "inside",
    "read_index",
]

logger = logging.getLogger(__name__)

#: The index file both formats write.
INDEX = "index.json"
#: Largest index read (a real one is a few hundred bytes per shard: 64 MiB is some 100k shards).
MAX_INDEX_BYTES = 64 << 20
#: Largest shard held in memory once decompressed (MDS writes 64 MiB shards by default, LitData chunks
#: of at most a few hundred MiB; uint32 offsets cannot address more than 4 GiB in any case).
MAX_SHARD_BYTES = 1 << 30
#: Most dimensions an array column may claim.
MAX_NDIM = 32
#: Column names taken as the label when no label column is named, in this order.
LABEL_NAMES = ("label", "class", "target")
#: Most images one image-list value may claim (a record holds them all, stacked).
MAX_LIST_IMAGES = 4096
#: Compressions decoded here, as both formats name them (``zstd:7`` is zstd at level 7).
COMPRESSIONS = ("zstd", "gz", "bz2")

#: Column kinds: what a column's bytes hold once split out of a row.
IMAGE = "image"  # an encoded picture Pillow reads (JPEG, PNG, ...)
PIL_RAW = "pil"  # [width u32][height u32][mode length u32][mode][raw pixels]
ARRAY = "array"  # an array; ``dtype``/``shape`` fixed by the column or read per row by ``header``
SCALAR = "scalar"  # one number of ``dtype``
INT_TEXT = "int_text"  # an integer written as text
TEXT = "text"  # UTF-8 text
AUDIO = "audio"  # an encoded audio file soundfile reads (WAV, FLAC, Ogg)
IMAGE_LIST = "image_list"  # [n u32][n sizes u32][images], after ``list_at`` bytes; each image of ``element`` kind
OTHER = "other"  # bytes, JSON, ...: never a payload or a label
PICKLE = "pickle"  # never loaded


@dataclass(frozen=True)
class Column:
    """One column of a row: its name, what it holds (:data:`IMAGE`, :data:`ARRAY`, ...), its fixed size
    in bytes (``None``: the row header gives it), and for arrays and scalars the dtype and shape, either
    fixed here or read from each value by ``header`` (``header(value, where) -> (dtype, shape, data)``)."""

    name: str
    kind: str
    encoding: str
    size: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    header: Callable[[memoryview, str], tuple[str, tuple[int, ...] | None, memoryview]] | None = None
    #: An :data:`IMAGE_LIST`'s images: their kind (:data:`IMAGE` or :data:`PIL_RAW`) and the bytes before the count.
    element: str | None = None
    list_at: int = 0

    @property
    def is_label(self) -> bool:
        """Whether the column can be a label (an integer or a text)."""
        return self.kind in (INT_TEXT, TEXT) or (self.kind == SCALAR and self.dtype is not None
                                                 and np.dtype(self.dtype).kind in "iub")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index describes it: its path (inside the source directory) and name relative to
    it, its row count, the bytes of its file and, when compressed, of the data once decompressed (``None``:
    the index does not say)."""

    path: Path
    name: str
    rows: int
    file_bytes: int | None
    raw_bytes: int | None
    compression: str | None
    #: ``(tail, what)``: a shard ending in ``tail`` is another layout (``what``), refused.
    refused_tail: tuple[bytes, str] | None = None
    #: ``unwrap(data, where)``: the classic row layout of a shard stored in another one (LitData's framed zstd).
    unwrap: Callable[[bytes | mmap.mmap, str], bytes | mmap.mmap] | None = None


# ---------------------------------------------------------------------- reading what the index claims
def _open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """An fd of the regular file ``path`` (a FIFO would block, a device never end); ConversionError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConversionError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConversionError(f"{path}: expected a regular file holding the {what}, found a directory or special file")
    return fd, st


def read_index(path: Path, what: str) -> dict[str, Any]:
    """The JSON object of the index ``path`` (at most :data:`MAX_INDEX_BYTES`); ConversionError naming it otherwise."""
    fd, st = _open_regular(path, what)
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > MAX_INDEX_BYTES:
            raise ConversionError(f"{path}: {st.st_size} bytes; expected an {what} of at most {MAX_INDEX_BYTES}")
        raw = fh.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise ConversionError(f"{path}: more than {MAX_INDEX_BYTES} bytes; expected a smaller {what}")
    try:
        doc, cut = untrusted_json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ConversionError(f"{path}: not a JSON {what} ({type(exc).__name__}: {exc})") from None
    if cut or not isinstance(doc, dict):
        raise ConversionError(f"{path}: expected a JSON object as the {what}, found {type(doc).__name__}"
                              f"{' nested too deeply' if cut else ''}")
    return doc


def want(value: Any, kind: type | tuple[type, ...], key: str, where: Path | str, *, optional: bool = False) -> Any:
    """``value`` if it is a ``kind`` (``None`` too when ``optional``); ConversionError naming ``key`` otherwise.

    ``bool`` is never taken for an ``int``: ``"samples": true`` is a broken index, not one row.
    """
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return value
    names = " or ".join(k.__name__ for k in kinds)
    raise ConversionError(f"{where}: expected {key} to be {names}, found {json.dumps(value)[:60]}")


def count_of(value: Any, key: str, where: Path | str, *, optional: bool = False, maximum: int = 1 << 32) -> Any:
    """A non-negative whole number below ``maximum`` (uint32 by default), as the index states it."""
    n = want(value, int, key, where, optional=optional)
    if n is not None and not 0 <= n < maximum:
        raise ConversionError(f"{where}: expected {key} from 0 to {maximum - 1}, found {n}")
    return n


def inside(root: Path, name: Any, where: Path | str) -> Path:
    """``root / name`` for a relative ``name`` that stays inside ``root`` once symlinks are resolved
    (``../x``, ``/etc/passwd`` and a link out of the dataset are refused)."""
    rel: str = want(name, str, "a shard file name", where)
    if not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith("\\"):
        raise ConversionError(f"{where}: shard file name {rel!r} is not a relative path inside {root}")
    path = root / rel
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise ConversionError(f"{where}: shard file name {rel!r} leads outside {root}")
    return path


def compression_of(value: Any, where: Path | str) -> str | None:
    """The compression family (``zstd``, ``gz``, ``bz2``) of an index's ``compression`` value, or ``None``."""
    algo: str | None = want(value, str, "compression", where, optional=True)
    if not algo:
        return None
    family = algo.split(":", 1)[0]
    if family not in COMPRESSIONS:
        raise ConversionError(f"{where}: shards compressed with {algo!r}; shardkit decodes {', '.join(COMPRESSIONS)} "
                              "(decompress the shards with their own tools first)")
    return family


def decompress(data: bytes | memoryview, algo: str, limit: int, where: str) -> bytes:
    """``data`` decompressed with ``algo``, refused (InputFileError) once it would exceed ``limit`` bytes,
    so a small file cannot expand into gigabytes."""
    try:
        if algo == "zstd":
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
            out = reader.read(limit + 1)
        elif algo == "gz":
            d = zlib.decompressobj(wbits=47)  # gzip or zlib header
            out = d.decompress(data, limit + 1)
        else:
            b = bz2.BZ2Decompressor()
            out = b.decompress(data, limit + 1)
    except Exception as exc:  # every codec has its own error type
        raise InputFileError(where, f"corrupt: cannot decompress ({algo}): {type(exc).__name__}: {exc}") from None
    if len(out) > limit:
        raise InputFileError(where, f"size: decompresses to more than the {limit} bytes the index states")
    return bytes(out)


def stored_count(info: ShardInfo) -> int | None:
    """The row count a shard's first bytes hold (decompressing only those; LitData's framed chunks hold
    it at byte 12), or ``None`` when the file is too short to hold one."""
    with open(info.path, "rb") as fh:
        if info.compression is None:
            head = fh.read(16)
        elif info.compression == "zstd":
            import zstandard

            try:
                head = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read(16)
            except zstandard.ZstdError as exc:
                raise InputFileError(str(info.path), f"corrupt: cannot decompress (zstd): {exc}") from None
        else:
            d: Any = zlib.decompressobj(wbits=47) if info.compression == "gz" else bz2.BZ2Decompressor()
            head = b""
            try:
                while len(head) < 16 and (piece := fh.read(1 << 16)):  # output capped: no bomb
                    head += d.decompress(piece, 16 - len(head))
            except (OSError, ValueError, zlib.error, EOFError) as exc:
                raise InputFileError(str(info.path), f"corrupt: cannot decompress ({info.compression}): {exc}") from None
    if head[:8] == b"LDFZ01\0\0" and info.unwrap is not None and len(head) >= 16:
        return int(struct.unpack_from("<I", head, 12)[0])
    return int(struct.unpack_from("<I", head, 0)[0]) if len(head) >= 4 else None


def array_from(data: memoryview, dtype: str, shape: tuple[int, ...] | None, where: str) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` (``None``: one dimension) made of exactly ``data``; the size the
    shape claims is compared with the bytes held (Python integers, no overflow) before anything is made."""
    dt = np.dtype(dtype).newbyteorder("<")
    if shape is None:
        if len(data) % dt.itemsize:
            raise InputFileError(where, f"size: {len(data)} bytes are not a whole number of {dtype} values")
        shape = (len(data) // dt.itemsize,)
    claimed = math.prod(shape) * dt.itemsize
    if claimed != len(data):
        raise InputFileError(where, f"size: an array of shape {list(shape)} {dtype} needs {claimed} bytes, "
                             f"the row holds {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(np.dtype(dtype).newbyteorder("="), copy=True)


def shape_of(values: Sequence[Any], where: str) -> tuple[int, ...]:
    """A claimed shape: at most :data:`MAX_NDIM` whole numbers, each at least 1."""
    if len(values) > MAX_NDIM:
        raise InputFileError(where, f"shape: {len(values)} dimensions claimed, at most {MAX_NDIM} are allowed")
    dims = tuple(int(v) for v in values)
    if any(d < 0 for d in dims):
        raise InputFileError(where, f"shape: negative dimension in {list(dims)}")
    return dims


# ---------------------------------------------------------------------- one shard, open
class _Shard:
    """The bytes of one shard (mapped, or decompressed once) and its validated offsets."""

    def __init__(self, info: ShardInfo) -> None:
        where = str(info.path)
        try:
            fd, st = _open_regular(info.path, "shard")
        except ConversionError as exc:
            raise InputFileError(where, f"missing: {str(exc).removeprefix(where + ': ')}") from None
        with os.fdopen(fd, "rb") as fh:
            if info.file_bytes is not None and st.st_size != info.file_bytes:
                kind = "truncated" if st.st_size < info.file_bytes else "size"
                raise InputFileError(where, f"{kind}: {st.st_size} bytes, the index states {info.file_bytes}")
            if info.compression is None:
                if st.st_size > MAX_SHARD_BYTES * 4:
                    raise InputFileError(where, f"too-large: {st.st_size} bytes; uint32 offsets address at most 4 GiB")
                self.data: bytes | mmap.mmap = (mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size
                                                else b"")
            else:
                limit = MAX_SHARD_BYTES if info.raw_bytes is None else info.raw_bytes
                if limit > MAX_SHARD_BYTES:
                    raise InputFileError(where, f"too-large: the index states {limit} bytes once decompressed, "
                                         f"at most {MAX_SHARD_BYTES} are read")
                self.data = decompress(fh.read(MAX_SHARD_BYTES), info.compression, limit, where)
                if info.raw_bytes is not None and len(self.data) != info.raw_bytes:
                    raise InputFileError(where, f"truncated: decompresses to {len(self.data)} bytes, the index "
                                         f"states {info.raw_bytes}")
        if info.unwrap is not None:
            self.data = info.unwrap(self.data, where)
        size = len(self.data)
        if info.refused_tail is not None and size >= len(info.refused_tail[0]) \
                and self.data[size - len(info.refused_tail[0]) :] == info.refused_tail[0]:
            raise InputFileError(where, f"unsupported: a {info.refused_tail[1]}, not rows shardkit reads")
        n = info.rows
        header = 4 * (n + 2)
        if size < header:
            raise InputFileError(where, f"truncated: {size} bytes cannot hold the count and offsets of {n} rows "
                                 f"({header} bytes)")
        (found,) = struct.unpack_from("<I", self.data, 0)
        if found != n:
            raise InputFileError(where, f"count: the shard holds {found} rows, the index states {n}")
        offsets = np.frombuffer(self.data, dtype="<u4", count=n + 1, offset=4).astype(np.int64)
        if n and (offsets[0] < header or np.any(np.diff(offsets) < 0) or offsets[-1] > size):
            raise InputFileError(where, f"offsets: row offsets must rise from {header} to at most the "
                                 f"{size} bytes of the shard, found {int(offsets[0])}..{int(offsets[-1])}")
        self.offsets = offsets

    def row(self, i: int) -> memoryview:
        """The bytes of row ``i``."""
        return memoryview(self.data)[int(self.offsets[i]) : int(self.offsets[i + 1])]


def split_row(row: memoryview, columns: Sequence[Column], every: bool, where: str) -> list[memoryview]:
    """The bytes of each column of ``row``: its header gives the size of every column (``every``, LitData)
    or only of those without a fixed size (MDS); sizes must add up to the row exactly."""
    sized = [c for c in columns if every or c.size is None]
    head = 4 * len(sized)
    if len(row) < head:
        raise InputFileError(where, f"truncated: a row of {len(row)} bytes cannot hold its {len(sized)} column sizes")
    given = iter(struct.unpack_from(f"<{len(sized)}I", row, 0))
    sizes = []
    for c in columns:
        size = next(given) if every or c.size is None else c.size
        if c.size is not None and size != c.size:
            raise InputFileError(where, f"size: column {c.name!r} ({c.encoding}) holds {c.size} bytes, the row says {size}")
        sizes.append(size)
    if head + sum(sizes) != len(row):
        raise InputFileError(where, f"size: column sizes add up to {head + sum(sizes)} bytes, the row holds {len(row)}")
    out, pos = [], head
    for size in sizes:
        out.append(row[pos : pos + size])
        pos += size
    return out


# ---------------------------------------------------------------------- the worker half
class RowShardDecoder(Decoder):
    """Decode one row (an item is ``(shard number, row number)``) into a record: the payload column as an
    image (through the image transform) or an array, the label column as an int64. The last shard
    opened stays open: items arrive in order, many per task."""

    def __init__(self, payload: str, record: FieldSpec, shards: Sequence[ShardInfo], columns: Sequence[Column],
                 every: bool, payload_column: int, label_column: int | None, classes: Sequence[str] | None,
                 image: ImageTransform | None, audio: AudioTransform | None = None) -> None:
        super().__init__(payload, record)
        self.audio = audio
        self.per_call = max(1, RECORD_BYTES_PER_CALL // max(1, record.nbytes))
        #: Images per record when the payload is an image list (the first row's count), else ``None``.
        self.images = record.shape[0] if image is not None and columns[payload_column].kind == IMAGE_LIST else None
        self.shards, self.columns, self.every = list(shards), list(columns), every
        self.payload_column, self.label_column = payload_column, label_column
        self.classes = None if classes is None else {name: k for k, name in enumerate(classes)}
        self.image = image
        self._open: tuple[int, _Shard | InputFileError] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = None
        return state

    def item_path(self, item: tuple[int, int]) -> str:
        return f"{self.shards[item[0]].path}#{item[1]}"

    def shard(self, k: int) -> _Shard:
        """Shard ``k``, opened (and checked) once; a shard that fails fails each of its rows alike."""
        if self._open is None or self._open[0] != k:
            self._open = None  # the map closes once no row of it is referenced any more
            try:
                opened: _Shard | InputFileError = _Shard(self.shards[k])
            except InputFileError as exc:
                opened = exc
            self._open = (k, opened)
        found = self._open[1]
        if isinstance(found, InputFileError):
            raise InputFileError(found.path, found.reason)
        return found

    def values(self, item: tuple[int, int]) -> list[memoryview]:
        """The bytes of every column of row ``item``."""
        return split_row(self.shard(item[0]).row(item[1]), self.columns, self.every, self.item_path(item))

    def label(self, raw: memoryview, where: str) -> np.int64:
        """The label of a row from its label column's bytes."""
        assert self.label_column is not None
        col = self.columns[self.label_column]
        if col.kind == TEXT or (col.kind == INT_TEXT and self.classes is not None):
            try:
                name = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                raise InputFileError(where, f"label: column {col.name!r} is not UTF-8 text") from None
            if self.classes is None or name not in self.classes:
                raise InputFileError(where, f"label: {name[:40]!r} is not one of the classes found by the scan")
            return np.int64(self.classes[name])
        return np.int64(label_value(col, raw, where))

    def decode(self, item: tuple[int, int], start: int = 0) -> Decoded:
        where = self.item_path(item)
        values = self.values(item)
        col = self.columns[self.payload_column]
        raw = values[self.payload_column]
        record: dict[str, Any] = {}
        if self.audio is not None:
            clips = self.audio.read(Path(where), start, self.per_call, data=bytes(raw))
            label = {} if self.label_column is None else {"label": self.label(values[self.label_column], where)}
            source = {**clips.provenance(), "row": item[1]}
            return Decoded([{self.payload: c, **label, PROVENANCE: source} for c in clips.records], start, clips.more)
        if self.images is not None:
            assert self.image is not None
            record[self.payload], measured = load_images(self.image, col, raw, self.images, where)
            record[PROVENANCE] = {**measured, "row": item[1]}
        elif self.image is not None:
            loaded = load_image(self.image, col, raw, where)
            record[self.payload] = loaded.array
            record[PROVENANCE] = {**loaded.provenance(), "row": item[1]}
        else:
            arr = column_array(col, raw, where)
            record.update(RecordLayout({self.payload: self.record}).check({self.payload: arr}, where,
                                                                            f"column {col.name!r}"))
            record[PROVENANCE] = {"row": item[1]}
        if self.label_column is not None:
            record["label"] = self.label(values[self.label_column], where)
        return Decoded([record])


def label_value(col: Column, raw: memoryview, where: str) -> int:
    """An integer label from a number or integer text; InputFileError if it does not fit an int64."""
    if col.kind == INT_TEXT:
        try:
            text_value = bytes(raw).decode("ascii").strip()
            if len(text_value) > 24:
                raise ValueError(text_value[:24])
            value = int(text_value)
        except (UnicodeDecodeError, ValueError):
            raise InputFileError(where, f"label: column {col.name!r} is not an integer written as text") from None
    else:
        assert col.dtype is not None
        value = int(array_from(raw, col.dtype, (), where)[()])
    if not -(2**63) <= value < 2**63:
        raise InputFileError(where, f"label: {value} does not fit an int64")
    return value


def column_array(col: Column, raw: memoryview, where: str) -> np.ndarray:
    """The array an :data:`ARRAY` or :data:`SCALAR` column holds in one row."""
    if col.header is not None:
        dtype, shape, data = col.header(raw, where)
    else:
        assert col.dtype is not None
        dtype, shape, data = col.dtype, col.shape, raw
    return array_from(data, dtype, shape, where)


def list_images(col: Column, raw: memoryview, where: str) -> list[memoryview]:
    """The bytes of each image of an :data:`IMAGE_LIST` value: a ``uint32`` count (at most
    :data:`MAX_LIST_IMAGES`), the ``uint32`` size of each image, then the images; the count and sizes
    are checked against the bytes held before anything is split."""
    at = col.list_at
    if len(raw) < at + 4:
        raise InputFileError(where, f"truncated: an image list of {len(raw)} bytes ends before its count")
    (n,) = struct.unpack_from("<I", raw, at)
    if n > MAX_LIST_IMAGES or len(raw) < at + 4 + 4 * n:
        raise InputFileError(where, f"size: an image list claims {n} images in {len(raw)} bytes (at most "
                             f"{MAX_LIST_IMAGES}, each with a 4-byte size)")
    sizes = struct.unpack_from(f"<{n}I", raw, at + 4)
    pos = at + 4 + 4 * n
    if pos + sum(sizes) != len(raw):
        raise InputFileError(where, f"size: the sizes of {n} images add up to {pos + sum(sizes)} bytes, the list "
                             f"holds {len(raw)}")
    out = []
    for size in sizes:
        out.append(raw[pos : pos + size])
        pos += size
    return out


def load_images(image: ImageTransform, col: Column, raw: memoryview, count: int,
                where: str) -> tuple[np.ndarray, dict[str, int]]:
    """An :data:`IMAGE_LIST` value as ``uint8 [count, H, W, 3]`` (each image through the image transform)
    and its provenance: the first image's :data:`IMAGE_COLUMNS` with the flags of every image. A list of
    another length than ``count`` (the first row's) is an InputFileError, a ``count`` skip."""
    views = list_images(col, raw, where)
    if len(views) != count:
        raise InputFileError(where, f"count: column {col.name!r} holds {len(views)} images, every record holds "
                             f"{count} (the first row's count)")
    assert col.element is not None
    element = Column(col.name, col.element, col.encoding)
    loaded = [load_image(image, element, view, f"{where}[{j}]") for j, view in enumerate(views)]
    measured = loaded[0].provenance()
    for one in loaded[1:]:
        measured["flags"] |= one.flags
    return np.stack([one.array for one in loaded]), measured


def load_image(image: ImageTransform, col: Column, raw: memoryview, where: str) -> Any:
    """An :data:`IMAGE` or :data:`PIL_RAW` column's picture through the image transform (a ``LoadedImage``)."""
    from shardkit.converters.images import LoadedImage

    if col.kind == IMAGE:
        return image.load(Path(where), raw)
    from PIL import Image

    if len(raw) < 12:
        raise InputFileError(where, f"truncated: a raw PIL image needs a 12-byte header, found {len(raw)} bytes")
    width, height, mode_len = struct.unpack_from("<3I", raw, 0)
    try:
        mode = bytes(raw[12 : 12 + mode_len]).decode("ascii")
        bands = Image.getmodebands(mode)
        bits = {"1": 1, "I;16": 16, "I;16B": 16, "I;16L": 16, "I": 32, "F": 32}.get(mode, 8)
    except (UnicodeDecodeError, ValueError, KeyError):
        raise InputFileError(where, f"unsupported: raw PIL image of mode {bytes(raw[12:12 + min(mode_len, 16)])!r}") from None
    pixels = raw[12 + mode_len :]
    need = (width * bands * bits + 7) // 8 * height
    if not width or not height or need != len(pixels):
        raise InputFileError(where, f"size: a {width}x{height} {mode} image needs {need} bytes of pixels, "
                             f"the row holds {len(pixels)}")
    limit = image.max_pixels or Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise InputFileError(where, f"too-large: {width}x{height} pixels, more than the {limit} allowed")
    img = Image.frombytes(mode, (width, height), bytes(pixels))
    flags = color_flags(img)
    arr, geo = image.apply(to_rgb(img, where))
    return LoadedImage(arr, geo, 1, (width, height), flags, 1)


# ---------------------------------------------------------------------- the main-process half
class _Rows(Sequence[tuple[int, int]]):
    """The input sequence: ``(shard number, row number)`` of every row of the usable shards, made on demand."""

    def __init__(self, shards: Sequence[int], rows: Sequence[int]) -> None:
        self.shards = list(shards)
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(rows, dtype=np.int64))]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return (self.shards[k], int(i - self.starts[k]))


class RowShardConverter(Converter):
    """An index of row shards (MDS, LitData): payload and label columns chosen by option or by default, rows
    in index order, provenance = shard file + row number. Subclasses read their index in :meth:`parse_index`."""

    #: The index's name in messages (``"MDS index"``).
    index_what: ClassVar[str] = ""
    #: Text the first bytes of this format's index hold (detection without parsing a large file).
    index_marker: ClassVar[bytes] = b""
    #: Whether each row's header sizes every column (LitData) or only those of no fixed size (MDS).
    every_column_sized: ClassVar[bool] = False

    payload = "image"
    chunk_size = 32
    progress_unit = "row"
    detect_priority = 5
    options = (
        Option("split", str, None, "Split directory holding the index (default: the source itself, else train, "
               "else the only one).", parse=text, metavar="NAME"),
        Option("payload_column", str, None, "Column stored as the record (default: the first image column, else "
               "the largest array column).", parse=text, metavar="NAME"),
        Option("label_column", str, None, "Integer or text column stored as the label (default: a column named "
               f"{', '.join(LABEL_NAMES)}, if any).", parse=text, metavar="NAME"),
        *image_options("Output frame H or HxW in pixels (default: the size of the first row's image)."),
    )

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.base, self.split = self._base()
        self.values["split"] = self.split
        self.index_path = self.base / INDEX
        self.shards, self.columns = self.parse_index(read_index(self.index_path, self.index_what))
        self.payload_index = self._payload_column()
        self.label_index = self._label_column()
        col = self.columns[self.payload_index]
        #: The audio transform when the payload is an audio column (its options: ``audio_options``).
        self.audio: AudioTransform | None = None
        if col.kind == AUDIO:
            v = self.values
            if round(v["duration"] * v["sample_rate"]) < 1:
                raise ConfigError(f"{self.label('duration')} {v['duration']} at {self.label('sample_rate')} "
                                  f"{v['sample_rate']} is less than one sample")
            self.audio = AudioTransform(v["sample_rate"], v["duration"], v["channels"], v["window"], v["dtype"])
            self.payload = "audio"  # type: ignore[misc]
        elif col.kind not in (IMAGE, PIL_RAW, IMAGE_LIST):
            # The payload's name follows the chosen column: a per-instance value of the class default.
            self.payload = "array"  # type: ignore[misc]

    @property
    def provenance_columns(self) -> tuple[str, ...]:  # type: ignore[override]
        """The image's measures and the row, or the audio file's and the row."""
        return ("row", *AUDIO_COLUMNS) if self.audio is not None else (*IMAGE_COLUMNS, "row")

    @property
    def one_record_per_input(self) -> bool:  # type: ignore[override]
        """Every row is one record, except audio cut into windows."""
        return self.audio is None or not self.audio.window

    # ------------------------------------------------------------------ layout
    def _base(self) -> tuple[Path, str | None]:
        if (self.src / INDEX).is_file() and self.values.get("split") is None:
            return self.src, None
        splits = sorted(p.name for p in self.src.iterdir() if (p / INDEX).is_file()) if self.src.is_dir() else []
        if (self.src / INDEX).is_file():
            splits = [".", *splits]
        split = choose_split(splits, self.values.get("split"), self.src, self.label("split"))
        if split is None:
            raise ConversionError(f"{self.src}: no {INDEX} found (expected the directory an {self.index_what} is in)")
        return (self.src if split == "." else self.src / split), split

    @classmethod
    def _looks_like(cls, index: Path) -> bool:
        try:
            with open(index, "rb") as fh:
                head = fh.read(1 << 16)
        except OSError:
            return False
        return cls.index_marker in head

    @classmethod
    def detect(cls, src: Path) -> bool:
        """A directory with this format's ``index.json`` (or split directories holding one)."""
        if not src.is_dir():
            return False
        if (src / INDEX).is_file():
            return cls._looks_like(src / INDEX)
        try:
            subdirs = sorted(p for p in src.iterdir() if p.is_dir())[:64]
        except OSError:
            return False
        return any((p / INDEX).is_file() and cls._looks_like(p / INDEX) for p in subdirs)

    @abstractmethod
    def parse_index(self, doc: dict[str, Any]) -> tuple[list[ShardInfo], list[Column]]:
        """The shards (in order) and the columns every shard has, from the index document."""

    # ------------------------------------------------------------------ columns
    def _column(self, option: str) -> int | None:
        name = self.values.get(option)
        if name is None:
            return None
        names = [c.name for c in self.columns]
        if name not in names:
            raise ConfigError(f"{self.label(option)}: no column {name!r} in {self.index_path}; "
                              f"expected one of {', '.join(names)}")
        return names.index(name)

    def _refuse_pickle(self, col: Column, role: str) -> None:
        if col.kind == PICKLE:
            raise ConversionError(
                f"{self.index_path}: column {col.name!r} ({col.encoding}) is pickled; shardkit never unpickles "
                f"(pickle can execute code), so it cannot be the {role}; choose another with {self.label(role + '_column')}")

    def _payload_column(self) -> int:
        k = self._column("payload_column")
        if k is not None:
            col = self.columns[k]
            self._refuse_pickle(col, "payload")
            if col.kind not in (IMAGE, PIL_RAW, IMAGE_LIST, AUDIO, ARRAY):
                raise ConfigError(f"{self.label('payload_column')}: column {col.name!r} ({col.encoding}) is not an image, "
                                  "an image list, an audio clip or an array")
            return k
        for kinds in ((IMAGE, PIL_RAW), (IMAGE_LIST,), (AUDIO,)):
            for k, col in enumerate(self.columns):
                if col.kind in kinds:
                    return k
        arrays = [k for k, c in enumerate(self.columns) if c.kind == ARRAY]
        if arrays:
            first = self._first_values()
            return max(arrays, key=lambda k: (len(first[k]), -k))
        pickled = [c for c in self.columns if c.kind == PICKLE]
        if pickled:
            self._refuse_pickle(pickled[0], "payload")
        raise ConversionError(f"{self.index_path}: no image, image list, audio or array column to store as the record; found "
                              + ", ".join(f"{c.name} ({c.encoding})" for c in self.columns))

    def _label_column(self) -> int | None:
        k = self._column("label_column")
        if k is None:
            names = [c.name for c in self.columns]
            k = next((names.index(n) for n in LABEL_NAMES if n in names), None)
            if k is None:
                return None
        col = self.columns[k]
        self._refuse_pickle(col, "label")
        if not col.is_label:
            raise ConfigError(f"{self.label('label_column')}: column {col.name!r} ({col.encoding}) is not an integer "
                              "or a text; pass another label column")
        return k

    # ------------------------------------------------------------------ scanning
    def _check_shard(self, k: int) -> str | None:
        """Why shard ``k`` cannot be read, from a listing alone (``None``: it can)."""
        info = self.shards[k]
        try:
            st = os.stat(info.path)
        except OSError:
            return "missing: shard file not found"
        if not stat.S_ISREG(st.st_mode):
            return "unreadable: not a regular file"
        if info.file_bytes is not None and st.st_size != info.file_bytes:
            kind = "truncated" if st.st_size < info.file_bytes else "size"
            return f"{kind}: {st.st_size} bytes, {self.index_path.name} states {info.file_bytes}"
        if info.compression is not None and (info.raw_bytes or 0) > MAX_SHARD_BYTES:
            return f"too-large: {self.index_path.name} states {info.raw_bytes} bytes once decompressed, at most {MAX_SHARD_BYTES} are read"
        try:
            found = stored_count(info)
        except (OSError, InputFileError) as exc:
            return exc.reason if isinstance(exc, InputFileError) else f"unreadable: {exc.strerror or exc}"
        if found != info.rows:
            # Said once for the shard, before its rows become inputs: a count that lies costs no per-row work.
            return f"count: the shard holds {found} rows, {self.index_path.name} states {info.rows}"
        return None

    @functools.cached_property
    def _usable(self) -> tuple[list[int], list[Skip]]:
        usable, skipped = [], []
        for k, info in enumerate(self.shards):
            reason = self._check_shard(k) if info.rows else None
            if reason is None:
                usable.append(k)
            else:
                skipped.append(Skip(str(info.path), reason))
                logger.warning("%s: %s (its %d rows are skipped)", info.path, reason, info.rows)
        return usable, skipped

    @functools.cached_property
    def _first(self) -> tuple[int, list[bytes]]:
        """The first row that decodes: ``(shard, column bytes)``; its payload fixes the record's shape."""
        decoder = self._plain_decoder()
        problems = []
        for k in self._usable[0]:
            if not self.shards[k].rows:
                continue
            try:
                return k, [bytes(v) for v in decoder.values((k, 0))]
            except InputFileError as exc:
                problems.append(f"{exc.path}: {exc.reason}")
        raise ConversionError(f"{self.index_path}: no shard has a readable row"
                              + (f" ({'; '.join(problems[:3])})" if problems else ""))

    def _first_values(self) -> list[memoryview]:
        return [memoryview(v) for v in self._first[1]]

    def _plain_decoder(self) -> RowShardDecoder:
        return RowShardDecoder("x", FieldSpec((1,), "uint8"), self.shards, self.columns, self.every_column_sized,
                               0, None, None, None)

    @functools.cached_property
    def image(self) -> ImageTransform | None:
        """The image transform (``None`` for an array payload); without ``size``, the first image's size."""
        col = self.columns[self.payload_index]
        if col.kind not in (IMAGE, PIL_RAW, IMAGE_LIST):
            return None
        values = dict(self.values)
        if values.get("size") is None:
            k, _ = self._first
            native = ImageTransform(1, 1, decode="exact")
            raw, where = self._first_values()[self.payload_index], f"{self.shards[k].path}#0"
            if col.kind == IMAGE_LIST:
                assert col.element is not None
                raw, col = self._first_images()[0], Column(col.name, col.element, col.encoding)
            loaded = load_image(native, col, raw, where)
            w, h = loaded.geometry.src_w, loaded.geometry.src_h
            values["size"] = (h, w)
        return ImageTransform.from_options(values, self.label)

    @functools.cached_property
    def classes(self) -> list[str] | None:
        """Class names of a text label column (every row's label read once, in the main process)."""
        if self.label_index is None or self.columns[self.label_index].kind != TEXT:
            return None
        decoder = self._plain_decoder()
        found: set[str] = set()
        for k in self._usable[0]:
            for i in range(self.shards[k].rows):
                try:
                    raw = decoder.values((k, i))[self.label_index]
                    found.add(bytes(raw).decode("utf-8"))
                except (InputFileError, UnicodeDecodeError):
                    continue  # the row is skipped with its reason when it is decoded
        return sorted(found)

    def scan(self) -> ScanResult:
        usable, skipped = self._usable
        return ScanResult(items=_Rows(usable, [self.shards[k].rows for k in usable]), skipped=list(skipped))

    def _first_images(self) -> list[memoryview]:
        """The images of the first row's image list (its count fixes every record's)."""
        k, _ = self._first
        col, where = self.columns[self.payload_index], f"{self.shards[k].path}#0"
        try:
            views = list_images(col, self._first_values()[self.payload_index], where)
        except InputFileError as exc:
            raise ConversionError(f"{exc.path}: {exc.reason}") from None
        if not views:
            raise ConversionError(f"{where}: column {col.name!r} ({col.encoding}) holds no image in the first row; "
                                  "its count fixes every record's, so it must hold at least one")
        return views

    def record_spec(self) -> FieldSpec:
        if self.audio is not None:
            return FieldSpec(self.audio.shape, self.audio.dtype)
        if self.image is not None:
            hw3 = (self.image.height, self.image.width, 3)
            if self.columns[self.payload_index].kind == IMAGE_LIST:
                return FieldSpec((len(self._first_images()), *hw3), "uint8")
            return FieldSpec(hw3, "uint8")
        col = self.columns[self.payload_index]
        k, _ = self._first
        arr = column_array(col, self._first_values()[self.payload_index], f"{self.shards[k].path}#0")
        try:
            return FieldSpec(arr.shape, arr.dtype.name)
        except Exception as exc:
            raise ConversionError(f"{self.shards[k].path}#0: column {col.name!r} holds {list(arr.shape)} {arr.dtype}, "
                                  f"which cannot be a record ({exc})") from None

    def fields(self) -> dict[str, FieldSpec]:
        return {} if self.label_index is None else {"label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        return {} if self.classes is None else {"label": list(self.classes)}

    def make_decoder(self) -> RowShardDecoder:
        return RowShardDecoder(self.payload, self.record_spec(), self.shards, self.columns, self.every_column_sized,
                               self.payload_index, self.label_index, self.classes, self.image, self.audio)

    def transform(self) -> dict[str, Any]:
        if self.audio is not None:
            return dict(self.audio.to_json())
        return {} if self.image is None else self.image.to_json()

    def source(self) -> dict[str, Any]:
        return {**super().source(), "payload_column": self.columns[self.payload_index].name,
                "label_column": None if self.label_index is None else self.columns[self.label_index].name}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "transform": self.transform(),
                "columns": [[c.name, c.encoding] for c in self.columns]}

    def source_root(self) -> Path:
        return self.base

    def input_names(self, items: Sequence[Any]) -> Sequence[str]:
        """``shard file#row``, relative to the index's directory."""
        if not isinstance(items, _Rows):
            return super().input_names(items)
        names = [self.input_name((k, 0)).rsplit("#", 1)[0] for k in range(len(self.shards))]

        def name(i: int) -> str:
            k, row = items[i]
            return f"{names[k]}#{row}"

        return InputNames(len(items), name)

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """The shards by name, row count and size: a resume counts rows by position."""
        crc = 0
        for info in self.shards:
            crc = zlib.crc32(f"{info.name}\t{info.rows}\t{info.file_bytes}\t{info.raw_bytes}\n".encode(), crc)
        for s in scan.skipped:
            crc = zlib.crc32(f"{s.path}\t{s.reason}\n".encode("utf-8", "surrogateescape"), crc)
        return f"{len(scan.items)}:{crc:08x}"
