"""MosaicML Streaming (MDS) datasets: ``index.json`` and ``shard.NNNNN.mds[.zstd|.gz|.bz2]`` files, read
directly (mosaicml-streaming is not needed).

A shard is a row count, row offsets, the shard's JSON config, then the rows; a row is the ``uint32``
sizes of the columns without a fixed size, then every column's bytes. Columns are decoded by their
Streaming encoding: ``jpeg``, ``png`` and ``pil`` are images; ``ndarray``, ``ndarray:DTYPE`` and
``ndarray:DTYPE:D0,D1`` arrays; ``int``, ``int8``..``uint64``, ``float16``..``float64`` and ``str_int``
numbers; ``str`` text; ``list[jpeg]``, ``list[png]``, ``list[pil]`` and ``jpeg_array`` image lists,
stored as one ``[N, H, W, 3]`` record when every row holds the first row's count N (a row with another
count is skipped with that reason). ``bytes``, ``json``, ``str_float`` and ``str_decimal`` are kept out
of records, ``pkl`` is never loaded. Checks: :mod:`~shardkit.converters.rowshards`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from shardkit.converters.rowshards import (
    ARRAY,
    IMAGE,
    IMAGE_LIST,
    INT_TEXT,
    MAX_NDIM,
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
    inside,
    shape_of,
    want,
)
from shardkit.errors import ConversionError, InputFileError

__all__ = ["MdsConverter", "mds_column"]

logger = logging.getLogger(__name__)

#: Streaming's fixed-size scalar encodings.
_SCALARS = {"int": "int64", **{t: t for t in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                                                 "int64", "float16", "float32", "float64")}}
#: Encodings kept out of records (no fixed shape, or not numbers).
_OTHERS = frozenset({"bytes", "json", "str_float", "str_decimal"})
#: Image-list encodings: the kind of their images and the bytes before the count (``list[...]`` has a
#: 4-byte placeholder first, ``jpeg_array`` none).
_IMAGE_LISTS = {"list[jpeg]": (IMAGE, 4), "list[png]": (IMAGE, 4), "list[pil]": (PIL_RAW, 4),
                "jpeg_array": (IMAGE, 0), "jpegarray": (IMAGE, 0)}
#: Value dtype codes of a dynamic ``ndarray`` column, as Streaming numbers them.
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
#: Shape dtype codes (the two low bits of the ``ndim`` byte): uint8, uint16, uint32, uint64.
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}


def _ndarray_header(dtype: str | None, shape: tuple[int, ...] | None, raw: memoryview,
                    where: str) -> tuple[str, tuple[int, ...] | None, memoryview]:
    """Read a dynamic ``ndarray`` value: ``[dtype code]`` when the column has no dtype, then
    ``[ndim << 2 | shape dtype code][ndim sizes]`` when it has no shape, then the values."""
    pos = 0
    found_dtype, found_shape = dtype, shape
    if found_dtype is None:
        if len(raw) < 1 or raw[0] not in _VALUE_DTYPES:
            code = raw[0] if len(raw) else None
            raise InputFileError(where, f"corrupt: ndarray dtype code {code} is not one Streaming writes")
        found_dtype, pos = _VALUE_DTYPES[raw[0]], 1
    if found_shape is None:
        if len(raw) < pos + 1:
            raise InputFileError(where, "truncated: an ndarray value ends before its shape")
        ndim, code = raw[pos] >> 2, raw[pos] & 3
        width = np.dtype(_SHAPE_DTYPES[code]).itemsize
        if len(raw) < pos + 1 + ndim * width:
            raise InputFileError(where, f"truncated: an ndarray value ends inside its {ndim} sizes")
        dims = np.frombuffer(raw, dtype=_SHAPE_DTYPES[code], count=ndim, offset=pos + 1).tolist()
        found_shape = shape_of(dims, where)
        pos += 1 + ndim * width
    return found_dtype, found_shape, raw[pos:]


def mds_column(name: str, encoding: str, size: int | None, where: str) -> Column:
    """The :class:`Column` of a Streaming encoding; ConversionError when the index's fixed ``size``
    disagrees with what the encoding implies."""
    family, _, config = encoding.partition(":")
    col: Column
    if family == "ndarray":
        parts = config.split(":") if config else []
        if len(parts) > 2 or (parts and parts[0] not in _VALUE_DTYPES.values()):
            raise ConversionError(f"{where}: column {name!r}: ndarray encoding {encoding!r} is not ndarray[:DTYPE[:SHAPE]]")
        dtype = parts[0] if parts else None
        shape = None
        if len(parts) == 2:
            try:
                dims = [int(d) for d in parts[1].split(",")]
            except ValueError:
                raise ConversionError(f"{where}: column {name!r}: shape in {encoding!r} is not D0,D1,...") from None
            if not dims or len(dims) > MAX_NDIM or any(d < 1 or d >= 1 << 40 for d in dims):
                raise ConversionError(f"{where}: column {name!r}: shape in {encoding!r} must be 1 to {MAX_NDIM} "
                                      "positive sizes")
            shape = tuple(dims)
        fixed = None if dtype is None or shape is None else int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        header = None if fixed is not None else functools.partial(_ndarray_header, dtype, shape)
        col = Column(name, ARRAY, encoding, fixed, dtype, shape, header)
    elif encoding in _SCALARS:
        dtype = _SCALARS[encoding]
        col = Column(name, SCALAR, encoding, np.dtype(dtype).itemsize, dtype, ())
    elif encoding in ("jpeg", "png"):
        col = Column(name, IMAGE, encoding)
    elif encoding == "pil":
        col = Column(name, PIL_RAW, encoding)
    elif encoding in _IMAGE_LISTS:
        element, list_at = _IMAGE_LISTS[encoding]
        col = Column(name, IMAGE_LIST, encoding, element=element, list_at=list_at)
    elif encoding == "str":
        col = Column(name, TEXT, encoding)
    elif encoding == "str_int":
        col = Column(name, INT_TEXT, encoding)
    elif encoding == "pkl":
        col = Column(name, PICKLE, encoding)
    else:
        if encoding not in _OTHERS:
            logger.warning("%s: column %r has the encoding %r, unknown here; it is left out", where, name, encoding)
        col = Column(name, OTHER, encoding, size)
    if size != col.size:
        raise ConversionError(f"{where}: column {name!r} ({encoding}): the index states a fixed size of {size} "
                              f"bytes, the encoding has {col.size}")
    return col


class MdsConverter(RowShardConverter):
    """Convert an MDS dataset (``index.json`` with ``"shards"``; a split directory holding one)."""

    name = "mds"
    index_what = "MDS index"
    index_marker = b'"shards"'
    every_column_sized = False

    def parse_index(self, doc: dict[str, Any]) -> tuple[list[ShardInfo], list[Column]]:
        where = self.index_path
        shards_doc = want(doc.get("shards"), list, "shards", where)
        shards: list[ShardInfo] = []
        columns: list[Column] | None = None
        signature: tuple[Any, ...] | None = None
        for k, entry in enumerate(shards_doc):
            at = f"{where} (shard {k})"
            want(entry, dict, f"shards[{k}]", where)
            fmt = entry.get("format")
            if fmt != "mds":
                raise ConversionError(f"{at}: format {fmt!r}; shardkit reads the MDS format (not Streaming's CSV/JSON shards)")
            if entry.get("version") != 2:
                raise ConversionError(f"{at}: version {entry.get('version')!r}; expected 2")
            names = want(entry.get("column_names"), list, "column_names", at)
            encodings = want(entry.get("column_encodings"), list, "column_encodings", at)
            sizes = want(entry.get("column_sizes"), list, "column_sizes", at)
            if not names or not len(names) == len(encodings) == len(sizes) or len(names) > 4096:
                raise ConversionError(f"{at}: expected 1 to 4096 column names, encodings and sizes alike, found "
                                      f"{len(names)}, {len(encodings)} and {len(sizes)}")
            this = (tuple(names), tuple(encodings), tuple(sizes))
            if signature is None:
                signature = this
                columns = [mds_column(want(n, str, "a column name", at), want(e, str, "a column encoding", at),
                                      count_of(s, "a column size", at, optional=True), str(where))
                           for n, e, s in zip(names, encodings, sizes)]
                if len(set(names)) != len(names):
                    raise ConversionError(f"{at}: column names repeat: {names}")
            elif this != signature:
                raise ConversionError(f"{at}: columns {list(this[0])} ({list(this[1])}) differ from shard 0's; "
                                      "expected every shard to have the same columns")
            rows = count_of(entry.get("samples"), "samples", at)
            compression = compression_of(entry.get("compression"), at)
            raw = want(entry.get("raw_data"), dict, "raw_data", at)
            raw_bytes = count_of(raw.get("bytes"), "raw_data.bytes", at, maximum=1 << 33)
            zipped = want(entry.get("zip_data"), dict, "zip_data", at, optional=True)
            stored = zipped if compression else raw
            if stored is None:
                raise ConversionError(f"{at}: compressed with {compression} but no zip_data names its file")
            if zipped is not None and not compression:
                raise ConversionError(f"{at}: zip_data names a compressed file but compression is null")
            file_bytes = count_of(stored.get("bytes"), "the shard's bytes", at, maximum=1 << 33)
            if 4 * (rows + 2) > raw_bytes:
                raise ConversionError(f"{at}: states {rows} samples in {raw_bytes} bytes; their offsets alone need "
                                      f"{4 * (rows + 2)} bytes")
            basename = want(stored.get("basename"), str, "basename", at)
            shards.append(ShardInfo(inside(self.base, basename, at), basename, rows, file_bytes,
                                    raw_bytes if compression else None, compression))
        if columns is None:
            raise ConversionError(f"{where}: no shards listed")
        return shards, columns
