"""LitData optimized datasets: ``index.json`` and ``chunk-R-N[.zstd].bin`` files, read directly (litdata
and torch are not needed).

A chunk is a row count, row offsets, then the rows; a row is the ``uint32`` size of every leaf of
the sample's pytree, then each leaf's bytes as its serializer (``config.data_format``) wrote them.
Column names come from ``config.data_spec`` (a dict's keys, ``a.b`` when nested, positions in a
tuple). Decoded: ``jpeg``, ``image:EXT`` and ``pil`` images; ``jpeg_array`` image lists (one
``[N, H, W, 3]`` record, N fixed by the first row); ``audio:EXT`` clips (through the audio options,
as ``convert`` does for audio folders); ``numpy`` and ``tensor`` (their dtype
and shape header) and ``no_header_numpy:K`` / ``no_header_tensor:K`` arrays; ``int``, ``float``,
``bool`` numbers; ``str``/``text``. Other leaves are kept out of records; ``pickle`` is never loaded.
Chunks compressed with zstd whole or in frames of items (``compression_level`` ``chunk`` or
``batch``, the default) are read; a frame per item (``sample``), Arrow-footer chunks and encryption
are refused with the reason. Checks: :mod:`~shardkit.converters.rowshards`.
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import struct
from typing import Any

import numpy as np

from shardkit.converters.audio import AUDIO_OPTIONS
from shardkit.converters.rowshards import (
    ARRAY,
    AUDIO,
    IMAGE,
    IMAGE_LIST,
    MAX_NDIM,
    MAX_SHARD_BYTES,
    OTHER,
    PICKLE,
    PIL_RAW,
    SCALAR,
    TEXT,
    Column,
    RowShardConverter,
    ShardInfo,
    compression_of,
    count_of,
    decompress,
    inside,
    shape_of,
    want,
)
from shardkit.errors import ConversionError, InputFileError

__all__ = ["LitDataConverter", "litdata_column", "leaf_names"]

logger = logging.getLogger(__name__)

#: LitData's numpy dtype numbers (position in its list of numpy scalar types; object, bytes, str and
#: void arrays are not numbers and are refused).
_NUMPY_DTYPES = {0: "int8", 1: "int16", 2: "int32", 3: "int64", 4: "uint8", 5: "uint16", 6: "uint32", 7: "uint64",
                 8: "float16", 9: "float32", 10: "float64", 11: "complex64", 12: "complex128", 13: "bool"}
#: LitData's torch dtype numbers, as numpy dtypes (10, bfloat16, has none and is refused).
_TORCH_DTYPES = {0: "float32", 1: "float32", 2: "float64", 3: "float64", 4: "complex64", 5: "complex64",
                 6: "complex128", 7: "complex128", 8: "float16", 9: "float16", 11: "uint8", 12: "int8", 13: "int16",
                 14: "int16", 15: "int32", 16: "int32", 17: "int64", 18: "int64", 19: "bool", 20: "uint16"}
#: Deepest pytree nesting read from ``data_spec``.
_MAX_SPEC_DEPTH = 32
#: What ends a chunk written with an Arrow footer (not the row layout read here).
_ARROW_TAIL = b"LDARW01\0"
#: What starts a chunk of zstd frames (``compression_level="batch"``), its header and one frame's entry.
_FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")
_FRAME = struct.Struct("<IIQII")


def unframe(data: bytes | mmap.mmap, where: str) -> bytes | mmap.mmap:
    """A chunk LitData wrote with ``compression_level="batch"`` (its default with zstd) in the classic row
    layout: the frame table is checked against the file and the item offsets before any frame is
    inflated, and each frame inflates to exactly the size it states. Other chunks are returned as they are.

    Layout: ``LDFZ01\\0\\0``, version u16, flags u16, items u32, rows per frame u32, frames u32; item
    offsets u32[items + 1] into the items' bytes; per frame: first item u32, items u32, file offset
    u64, compressed and uncompressed bytes u32; then the zstd frames.
    """
    if len(data) < _FRAMED_PREFIX.size or data[:8] != _FRAMED_MAGIC:
        return data
    _, version, _flags, n, per_frame, frames = _FRAMED_PREFIX.unpack_from(data, 0)
    if version != 1 or not n or not per_frame or frames != -(-n // per_frame):
        raise InputFileError(where, f"corrupt: framed zstd chunk header (version {version}, {n} items, "
                             f"{per_frame} a frame, {frames} frames) is not LitData's version 1")
    offsets_end = _FRAMED_PREFIX.size + 4 * (n + 1)
    table_end = offsets_end + _FRAME.size * frames
    if len(data) < table_end:
        raise InputFileError(where, f"truncated: {len(data)} bytes cannot hold the offsets and frame table of "
                             f"{n} items ({table_end} bytes)")
    offsets = np.frombuffer(data, dtype="<u4", count=n + 1, offset=_FRAMED_PREFIX.size).astype(np.int64)
    if offsets[0] != 0 or np.any(np.diff(offsets) < 0) or offsets[-1] > MAX_SHARD_BYTES:
        raise InputFileError(where, f"offsets: item offsets must rise from 0 to at most {MAX_SHARD_BYTES}, found "
                             f"{int(offsets[0])}..{int(offsets[-1])}")
    spans = []
    for f in range(frames):
        first, count, at, size, inflated = _FRAME.unpack_from(data, offsets_end + f * _FRAME.size)
        end = first + count
        if first != f * per_frame or not count or end > n or at < table_end or at + size > len(data) \
                or inflated != offsets[end] - offsets[first]:
            raise InputFileError(where, f"corrupt: frame {f} (items {first}..{end}, {size} bytes at {at}, "
                                 f"{inflated} inflated) does not match the chunk's items and size")
        spans.append((at, size, inflated))
    head = 4 * (n + 2)
    out = bytearray(head)
    struct.pack_into("<I", out, 0, n)
    out[4:head] = (offsets + head).astype("<u4").tobytes()
    for at, size, inflated in spans:
        frame = decompress(memoryview(data)[at : at + size], "zstd", inflated, where)
        if len(frame) != inflated:
            raise InputFileError(where, f"truncated: a frame inflates to {len(frame)} bytes, the chunk states {inflated}")
        out += frame
    return bytes(out)


def _dtype(table: dict[int, str], code: int, what: str, where: str) -> str:
    if code not in table:
        raise InputFileError(where, f"unsupported: {what} dtype number {code} is not a numeric dtype shardkit stores")
    return table[code]


def _header_reader(table: dict[int, str], what: str) -> Any:
    """The reader of a ``numpy`` / ``tensor`` leaf (picklable: decoders travel to worker processes)."""
    return functools.partial(_read_header, table, what)


def _read_header(table: dict[int, str], what: str, raw: memoryview,
                 where: str) -> tuple[str, tuple[int, ...] | None, memoryview]:
    """Read ``[dtype u32][rank u32][rank x u32 sizes][values]``.

    ``numpy`` writes the header little-endian; ``tensor`` big-endian in recent LitData and
    little-endian before: a dtype number and rank that are small read one way decide which.
    """
    if len(raw) < 8:
        raise InputFileError(where, f"truncated: a {what} value of {len(raw)} bytes ends inside its header")
    order = "<"
    code, rank = struct.unpack_from("<II", raw, 0)
    if code not in table or rank > MAX_NDIM:
        order = ">"
        code, rank = struct.unpack_from(">II", raw, 0)
    if rank > MAX_NDIM:
        raise InputFileError(where, f"shape: {rank} dimensions claimed, at most {MAX_NDIM} are allowed")
    if len(raw) < 8 + 4 * rank:
        raise InputFileError(where, f"truncated: a {what} value ends inside its {rank} sizes")
    dims = shape_of(struct.unpack_from(f"{order}{rank}I", raw, 8), where)
    return _dtype(table, code, what, where), dims, raw[8 + 4 * rank :]


def litdata_column(name: str, fmt: str) -> Column:
    """The :class:`Column` of a LitData serializer name (``data_format`` entry)."""
    family, _, arg = fmt.partition(":")
    if fmt in ("jpeg", "image") or family == "image":
        return Column(name, IMAGE, fmt)
    if fmt == "pil":
        return Column(name, PIL_RAW, fmt)
    if family == "audio":
        return Column(name, AUDIO, fmt)
    if fmt == "jpeg_array":  # [n u32][n sizes u32][JPEG files], as MDS's jpeg_array
        return Column(name, IMAGE_LIST, fmt, element=IMAGE, list_at=0)
    if fmt in ("str", "text"):
        return Column(name, TEXT, fmt)
    if fmt == "int":
        return Column(name, SCALAR, fmt, 8, "int64", ())
    if fmt == "float":
        return Column(name, SCALAR, fmt, 8, "float64", ())
    if fmt == "bool":
        return Column(name, SCALAR, fmt, 1, "bool", ())
    if fmt == "numpy":
        return Column(name, ARRAY, fmt, header=_header_reader(_NUMPY_DTYPES, "numpy"))
    if fmt == "tensor":
        return Column(name, ARRAY, fmt, header=_header_reader(_TORCH_DTYPES, "tensor"))
    if family in ("no_header_numpy", "no_header_tensor"):
        table = _NUMPY_DTYPES if family == "no_header_numpy" else _TORCH_DTYPES
        try:
            code = int(arg)
        except ValueError:
            code = -1
        if code not in table:
            raise ConversionError(f"column {name!r}: {fmt!r} names no numeric dtype")
        return Column(name, ARRAY, fmt, None, table[code], None)
    if fmt == "pickle":
        return Column(name, PICKLE, fmt)
    if fmt not in ("bytes", "json", "tifffile", "tiff", "video", "nifti", "mesh", "pdf",
                   "graph", "file"):
        logger.warning("column %r has the serializer %r, unknown here; it is left out", name, fmt)
    return Column(name, OTHER, fmt)


def leaf_names(spec_text: Any, where: str) -> list[str]:
    """The name of every leaf of a LitData ``data_spec`` (a serialized pytree spec), in leaf order:
    a dict's keys, joined with ``.`` when nested, a tuple's or list's positions, ``"0"`` for a lone leaf."""
    spec_text = want(spec_text, str, "config.data_spec", where)
    try:
        doc = json.loads(spec_text)
    except (ValueError, RecursionError) as exc:
        raise ConversionError(f"{where}: config.data_spec is not JSON ({exc})") from None
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[1], dict)):
        raise ConversionError(f"{where}: config.data_spec is not a pytree spec ([version, tree])")
    names: list[str] = []
    stack: list[tuple[Any, str, int]] = [(doc[1], "", 0)]
    while stack:
        node, prefix, depth = stack.pop()
        if not isinstance(node, dict) or depth > _MAX_SPEC_DEPTH:
            raise ConversionError(f"{where}: config.data_spec holds a node that is not a spec, or nests too deeply")
        children = node.get("children_spec") or []
        if not isinstance(children, list):
            raise ConversionError(f"{where}: config.data_spec: children_spec is not a list")
        if node.get("type") is None and not children:
            names.append(prefix or "0")
            continue
        keys: list[str]
        if node.get("type") in ("builtins.dict", "collections.OrderedDict", "collections.defaultdict"):
            try:
                context = json.loads(node.get("context") or "[]")
            except (ValueError, TypeError, RecursionError):
                context = None
            if not isinstance(context, list) or len(context) != len(children):
                raise ConversionError(f"{where}: config.data_spec: a dict's keys do not match its children")
            keys = [str(k) for k in context]
        else:
            keys = [str(i) for i in range(len(children))]
        for key, child in reversed(list(zip(keys, children))):
            stack.append((child, f"{prefix}.{key}" if prefix else key, depth + 1))
    return names


class LitDataConverter(RowShardConverter):
    """Convert a LitData optimized dataset (``index.json`` with ``"chunks"``; a split directory holding one)."""

    name = "litdata"
    index_what = "LitData index"
    index_marker = b'"chunks"'
    every_column_sized = True
    options = (*RowShardConverter.options, *AUDIO_OPTIONS)

    def parse_index(self, doc: dict[str, Any]) -> tuple[list[ShardInfo], list[Column]]:
        where = str(self.index_path)
        config = want(doc.get("config"), dict, "config", where)
        loader = config.get("item_loader", "PyTreeLoader")
        if loader != "PyTreeLoader":
            raise ConversionError(f"{where}: item_loader {loader!r}; shardkit reads chunks of samples (PyTreeLoader), "
                                  "not token or Parquet chunks")
        if config.get("encryption"):
            raise ConversionError(f"{where}: the chunks are encrypted; decrypt them with LitData first")
        level = config.get("compression_level")
        if level not in (None, "chunk", "batch"):
            raise ConversionError(f"{where}: compression_level {level!r} (a zstd frame per item) is not read here; "
                                  "re-optimize with compression_level 'batch' or 'chunk', or without compression")
        if config.get("ipc_compression"):
            raise ConversionError(f"{where}: Arrow IPC chunks (ipc_compression) are not read here")
        compression = compression_of(config.get("compression"), where) if level in (None, "chunk") else None
        formats = want(config.get("data_format"), list, "config.data_format", where)
        names = leaf_names(config.get("data_spec"), where)
        if not formats or len(formats) != len(names) or len(names) > 4096:
            raise ConversionError(f"{where}: config.data_format lists {len(formats)} serializers for {len(names)} "
                                  "leaves of data_spec; expected as many (1 to 4096)")
        try:
            columns = [litdata_column(n, want(f, str, "a data_format entry", where)) for n, f in zip(names, formats)]
        except ConversionError as exc:
            raise ConversionError(f"{where}: {exc}") from None
        chunks = want(doc.get("chunks"), list, "chunks", where)
        shards = []
        for k, entry in enumerate(chunks):
            at = f"{where} (chunk {k})"
            want(entry, dict, f"chunks[{k}]", where)
            rows = count_of(entry.get("chunk_size"), "chunk_size", at)
            raw_bytes = count_of(entry.get("chunk_bytes"), "chunk_bytes", at, maximum=1 << 33)
            if 4 * (rows + 2) > raw_bytes:
                raise ConversionError(f"{at}: states {rows} items in {raw_bytes} bytes; their offsets alone need "
                                      f"{4 * (rows + 2)} bytes")
            filename = want(entry.get("filename"), str, "filename", at)
            shards.append(ShardInfo(inside(self.base, filename, at), filename, rows,
                                    None if compression else raw_bytes, raw_bytes if compression else None,
                                    compression, refused_tail=(_ARROW_TAIL, "LitData Arrow-footer chunk"),
                                    unwrap=unframe))
        if not shards:
            raise ConversionError(f"{where}: no chunks listed")
        return shards, columns
