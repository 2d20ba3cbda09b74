"""The small per-record fields (``label``, ``boxes``, ...): ordinary chunked zarr v3 arrays.

Each is ``[N, *shape]`` chunked along the record axis, every chunk written (the last padded). Reading
is strict, since a label that silently changes is worse than an error: the document must be exactly
the declared field, every chunk must exist and match its recorded digest, sizes bounded before allocating.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ChecksumError, CorruptShardError, MissingShardError, NotADatasetError, TruncatedShardError
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest, read_objects
from shardkit.formats.codecs import RecordCodec, codec_from_zarr, decode_record
from shardkit.formats.metadata import array_metadata, encode_json, parse_json
from shardkit.formats.paths import resolve_inside
from shardkit.formats.spec import MAX_NDIM, ZARR_JSON, FieldSpec, chunk_key
from shardkit.formats.transfer import put_checked
from shardkit.formats.versions import read_document, read_versioned
from shardkit.stores import LocalStore, Store
from shardkit.stores.atomic import write_bytes_atomic

__all__ = ["read_field_rows", "write_field_array", "write_field_arrays"]


def write_field_array(
    root: Path | Store,
    name: str,
    spec: FieldSpec,
    data: np.ndarray,
    chunk: int,
    codec: RecordCodec | None,
    *,
    durable: bool = True,
    first_chunk: int = 0,
) -> dict[str, FileDigest]:
    """Write field ``name`` (``data``: ``[n, *spec.shape]``, the records from chunk ``first_chunk`` on)
    and its ``zarr.json`` under ``root``, each file atomically; returns their digests by relative path
    (the document last), for the metadata's ``files`` map."""
    base = first_chunk * chunk
    n = base + data.shape[0]
    ndim = 1 + len(spec.shape)
    le = np.dtype(spec.dtype).newbyteorder("<")
    digests: dict[str, FileDigest] = {}
    for j, start in enumerate(range(base, n, chunk), first_chunk):
        block = np.zeros((chunk, *spec.shape), dtype=le)
        part = data[start - base : start - base + chunk]
        block[: part.shape[0]] = part
        blob = codec.encode(block) if codec is not None else block.tobytes()
        rel = chunk_key(name, j, ndim)
        digests[rel] = _put(root, rel, blob, durable)
    document = array_metadata(shape=(n, *spec.shape), dtype=spec.dtype, chunk_shape=(chunk, *spec.shape), codec=codec,
                              itemsize=le.itemsize)
    digests[f"{name}/{ZARR_JSON}"] = _put(root, f"{name}/{ZARR_JSON}", encode_json(document), durable)
    return digests


def write_field_arrays(
    root: Path | Store,
    arrays: Sequence[tuple[str, FieldSpec, np.ndarray, int, int]],
    codec: RecordCodec | None,
    *,
    durable: bool = True,
) -> dict[str, FileDigest]:
    """:func:`write_field_array` of every ``(name, spec, data, chunk, first_chunk)``, the arrays of a local
    dataset at the same time: each durable file waits for its fsyncs (file, then directory), and fsyncs
    that wait together share the file system's journal commits. Digests in the order of ``arrays``."""
    local = isinstance(root, Path) or root.is_local
    if len(arrays) < 2 or not durable or not local:
        files: dict[str, FileDigest] = {}
        for name, spec, data, chunk, first in arrays:
            files |= write_field_array(root, name, spec, data, chunk, codec, durable=durable, first_chunk=first)
        return files
    with ThreadPoolExecutor(len(arrays), thread_name_prefix="shardkit-fields") as pool:
        # Each thread runs in a copy of this context: inside a synced_together block its fsyncs wait too.
        futures = [pool.submit(contextvars.copy_context().run, write_field_array, root, name, spec, data, chunk, codec,
                               durable=durable, first_chunk=first)
                   for name, spec, data, chunk, first in arrays]
        return functools.reduce(lambda a, b: a | b, (f.result() for f in futures), {})


def _put(root: Path | Store, key: str, data: bytes, durable: bool) -> FileDigest:
    """One file of a dataset, whole or not at all: an atomic local write, or one PUT (its crc32c in
    the object's metadata, as every uploaded object of a dataset has)."""
    digest = FileDigest.of(data)
    if isinstance(root, Store) and not root.is_local:
        put_checked(root, key, data, digest.crc32c)
    else:
        local = root.local_path() if isinstance(root, Store) else root
        write_bytes_atomic(resolve_inside(local, key, "field array file"), data, durable=durable)
    return digest


def read_field_rows(
    root: Path | Store,
    name: str,
    spec: FieldSpec,
    num_records: int,
    chunk_records: int,
    files: Mapping[str, FileDigest] | None = None,
    start: int = 0,
    stop: int | None = None,
    out: np.ndarray | None = None,
    document: bytes | None = None,
) -> np.ndarray:
    """Rows ``[start, stop)`` (``stop=None``: to the end) of field ``name`` of the dataset at ``root``,
    reading only the chunks that hold them and checking everything. The document must say exactly
    ``[num_records, *spec.shape]`` of ``spec.dtype`` in chunks of
    ``chunk_records`` (else NotADatasetError); ``files`` are the metadata's digests (empty for 1.0),
    a file a newer version replaced is read from its kept copy. ``out`` (checked first) receives the
    rows instead of a new array; ``document``: the field's ``zarr.json`` as the caller read and
    checked it already (an open :class:`~shardkit.formats.dataset.Dataset` did), not read again.
    IndexError for rows outside ``[0, num_records)``; MissingShardError, TruncatedShardError,
    ChecksumError or CorruptShardError for a damaged chunk or document.
    """
    files = files or {}
    stop = num_records if stop is None else stop
    store = root if isinstance(root, Store) else LocalStore(root)
    if not 0 <= start <= stop <= num_records:
        raise IndexError(f"{store.describe(name)}: rows [{start}, {stop}) outside [0, {num_records})")
    if store.is_local:
        resolve_inside(store.local_path(), name, "field array")
    doc_rel = f"{name}/{ZARR_JSON}"
    if document is not None:
        doc = parse_json(document, store.describe(doc_rel))
    else:
        if store.is_local and not store.local_path(doc_rel).exists():
            raise NotADatasetError(f"{store.describe(name)}: field array metadata {store.describe(doc_rel)} is missing")
        try:
            doc = read_document(store, doc_rel, files.get(doc_rel))
        except MissingShardError:
            raise NotADatasetError(f"{store.describe(name)}: field array metadata {store.describe(doc_rel)} is missing") from None
    codec = _check_field_document(doc, store.describe(doc_rel), spec, num_records, chunk_records)
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    block = np.empty((chunk_records, *spec.shape), dtype=dtype)
    wanted = range(start // chunk_records, -(-stop // chunk_records))
    # Any codec's worst case is far below twice the raw size: a larger file is not a chunk.
    chunks = _chunk_sources(store, name, 1 + len(spec.shape), wanted, files, max_nbytes=2 * block.nbytes + 1024)
    # Allocation bounded by what exists: every chunk read is there (checked just above), each one
    # decodes to chunk_records x spec.nbytes <= MAX_FIELD_CHUNK_NBYTES (DatasetMeta.check_layout), so
    # a document that claims more records than the dataset holds fails before this line.
    if out is None:
        out = np.empty((stop - start, *spec.shape), dtype=dtype)
    elif out.shape != (stop - start, *spec.shape) or out.dtype != dtype:
        raise ValueError(f"{store.describe(name)}: destination {out.shape} {out.dtype}, expected "
                         f"{(stop - start, *spec.shape)} {dtype}")  # fmt: skip
    for j, (rel, load) in zip(wanted, chunks):
        data = load()
        if codec is not None:  # exactly the block's bytes: a short chunk must not leave the last one's rows
            decode_record(codec, data, block, where=store.describe(rel), what=f"field chunk {j} of {block.shape} {dtype}")
        elif len(data) != block.nbytes:
            raise CorruptShardError(f"{store.describe(rel)}: field chunk is {len(data)} bytes, expected {block.shape} "
                                    f"{dtype} ({block.nbytes} bytes)")  # fmt: skip
        else:
            block[...] = np.frombuffer(data, dtype=dtype).reshape(block.shape)
        first = j * chunk_records
        lo, hi = max(start, first), min(stop, first + chunk_records)
        out[lo - start : hi - start] = block[lo - first : hi - first]
    return out


def _chunk_sources(
    store: Store, name: str, ndim: int, wanted: range, files: Mapping[str, FileDigest], *, max_nbytes: int
) -> list[tuple[str, Callable[[], bytes]]]:
    """``(relative key, loader)`` of the ``wanted`` chunks of field ``name``; each must exist (shardkit
    writes every chunk, so a missing one was lost). Remote chunks are downloaded here, so a missing one
    fails before the field's array is allocated."""
    keys = [chunk_key(name, j, ndim) for j in wanted]
    if store.is_local:
        out: list[tuple[str, Callable[[], bytes]]] = []
        for rel in keys:
            real = resolve_inside(store.local_path(), rel, "field chunk")
            if not real.exists():  # a directory or a named pipe is refused by name when it is read
                raise MissingShardError(f"{store.describe(rel)}: field chunk listed in the dataset metadata is missing")
            out.append((rel, functools.partial(read_versioned, store, rel, files.get(rel), what="field chunk", max_nbytes=max_nbytes)))
        return out
    try:
        blobs = read_objects(store, keys, files, what="field chunk", max_nbytes=max_nbytes)
    except (TruncatedShardError, ChecksumError):  # a newer version replaced a chunk: one at a time, as recorded
        blobs = [read_versioned(store, k, files.get(k), what="field chunk", max_nbytes=max_nbytes) for k in keys]
    return [(rel, functools.partial(bytes, blob)) for rel, blob in zip(keys, blobs)]


def _check_field_document(
    doc: dict[str, Any], where: str, spec: FieldSpec, num_records: int, chunk_records: int
) -> RecordCodec | None:
    """The field's ``zarr.json`` describes exactly the declared field; returns its codec."""
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise NotADatasetError(f"{where}: expected zarr v3 array metadata")
    shape = jv.shape(jv.member(doc, "shape", where), "shape", where, max_ndim=MAX_NDIM + 1, lo=0)
    expected = (num_records, *spec.shape)
    if shape != expected:
        raise NotADatasetError(f"{where}: field has shape {list(shape)}, the dataset metadata says {list(expected)}")
    dtype = jv.string(jv.member(doc, "data_type", where), "data_type", where)
    if dtype != spec.dtype:
        raise NotADatasetError(f"{where}: field has data type {dtype!r}, the dataset metadata says {spec.dtype!r}")
    grid = jv.mapping(jv.member(doc, "chunk_grid", where), "chunk_grid", where)
    conf = jv.mapping(jv.member(grid, "configuration", where), "chunk_grid.configuration", where)
    chunk = jv.shape(jv.member(conf, "chunk_shape", where), "chunk_shape", where, max_ndim=MAX_NDIM + 1)
    if grid.get("name") != "regular" or chunk != (chunk_records, *spec.shape):
        raise NotADatasetError(
            f"{where}: expected regular chunks of {[chunk_records, *spec.shape]}, found {grid.get('name')!r} {list(chunk)}"
        )
    encoding = jv.mapping(doc.get("chunk_key_encoding", {"name": "default"}), "chunk_key_encoding", where)
    sep = jv.mapping(encoding.get("configuration") or {}, "chunk_key_encoding.configuration", where).get("separator", "/")
    if encoding.get("name") != "default" or sep != "/":
        raise NotADatasetError(f"{where}: expected the 'default' chunk key encoding with '/', found {encoding}")
    codec = codec_from_zarr(doc.get("codecs", []), where=where)
    if codec is not None and codec.array_to_bytes:  # an image or audio stream holds one record, not a chunk of values
        raise NotADatasetError(f"{where}: a field is stored with bytes [+ a compressor], found {codec.zarr_name!r}")
    return codec
