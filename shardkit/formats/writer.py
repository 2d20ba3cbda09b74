"""Writing datasets: payload shards streamed sequentially, metadata last.

A :class:`ShardWriter` streams records into ``<shard>.partial``, appends the index and its crc32c,
fsyncs and renames: a shard file exists complete or not at all. A :class:`DatasetWriter` cuts records
into shards and on :meth:`DatasetWriter.close` writes the field arrays, the array documents and last
the root group document; until then the directory is incomplete (``IncompleteDatasetError`` on open).
DatasetWriter can continue after shards already on disk (``start``) and reports each shard it
completes (``on_shard``), cut at the same record boundaries as one uninterrupted write. Given an
object-store URL it writes into a private local staging directory, uploads each shard as it completes
and the metadata last (the order of :func:`~shardkit.formats.transfer.upload_dataset`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit._version import __version__
from shardkit.errors import ConfigError, SchemaError, ShardkitError
from shardkit.formats.checksums import FileDigest
from shardkit.formats.codecs import RecordCodec, codec_from_json, get_codec
from shardkit.formats.fields import write_field_arrays
from shardkit.formats.index import ShardIndex, crc32c_of, extend_crc32c
from shardkit.formats.metadata import (
    DEFAULT_FIELD_CHUNK,
    DatasetMeta,
    array_metadata,
    group_metadata,
    write_json_atomic,
)
from shardkit.formats.paths import check_name
from shardkit.formats.provenance import PROVENANCE_FIELD, TABLE_ARRAYS, ProvenanceSpec, write_provenance
from shardkit.formats.spec import (
    DEFAULT_SHARD_BYTES,
    MAX_FIELD_CHUNK_NBYTES,
    MAX_RECORDS_PER_SHARD,
    TAIL_SAMPLE_NBYTES,
    ZARR_JSON,
    FieldSpec,
    ShardInfo,
    SkippedInput,
    chunk_key,
    records_per_shard_for,
)
from shardkit.formats.transfer import put_checked, upload_dataset
from shardkit.privdir import PrivateDir, create_run_dir, sweep_stale
from shardkit.stores import Store, as_location, open_store
from shardkit.stores.atomic import BackgroundFlush, fsync_dir, is_out_of_space, raise_out_of_space

__all__ = ["ShardWriter", "ShardChecksums", "DatasetWriter", "WrittenShard", "payload_document", "field_chunk_for", "FIELD_CODEC",
           "prepare_field_codec"]

logger = logging.getLogger(__name__)

#: Codec used for the small per-record field arrays (mostly zeros for boxes; cheap to decode).
FIELD_CODEC = "zstd"
#: A durable shard's written bytes are made durable in the background each time this many more were
#: written (:class:`~shardkit.stores.atomic.BackgroundFlush`: one device cache flush per this many
#: bytes), so that its fsync at close waits for at most about this much.
FLUSH_BYTES = 16 << 20


def prepare_field_codec() -> None:
    """Make :data:`FIELD_CODEC` ready in this process. Its first use imports numcodecs (a tenth of a
    second of CPU or more), which would otherwise land at a conversion's end, in its commit: the
    conversion's writer thread calls this while the first records decode."""
    get_codec(FIELD_CODEC)


def _write_all(fd: int, data: memoryview, path: Path) -> None:
    """os.write until every byte is written; ENOSPC becomes OutOfSpaceError naming the file."""
    view = data.cast("B")
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as exc:
        if is_out_of_space(exc):
            raise_out_of_space(path, "writing")
        raise


@dataclass(frozen=True)
class ShardChecksums:
    """Size and checksums of a finished shard file (see :class:`~shardkit.formats.spec.ShardInfo`)."""

    nbytes: int
    crc32c: int
    data_crc32c: int
    index_crc32c: int
    tail_crc32c: int | None = None


def _as_record_bytes(records: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(records)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8).data


class ShardWriter:
    """Stream records (``record``, compressed by ``codec`` or fixed-size) into one payload shard file of
    ``capacity`` records: bytes go to ``path.partial`` until :meth:`close`. ``durable=False`` (scratch
    files) keeps the atomic rename but skips the fsync. A durable file's bytes are flushed to the device
    in the background every :data:`FLUSH_BYTES` while it is written, not all at its close."""

    def __init__(
        self,
        path: Path,
        capacity: int,
        record: FieldSpec,
        codec: RecordCodec | None = None,
        *,
        durable: bool = True,
    ) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.capacity = int(capacity)
        self.record = record
        self.codec = codec
        if codec is not None:
            codec.check_record(record.shape, record.dtype, str(self.path))
        self.durable = durable
        self.count = 0
        self._offset = 0
        self._crc = 0  # running crc32c of everything written: the records, then the index
        self._tail = b""  # the last TAIL_SAMPLE_NBYTES bytes written (ShardInfo.tail_crc32c)
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._flush = BackgroundFlush(self._fd, self.partial, FLUSH_BYTES) if durable else None

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def append(self, records: np.ndarray) -> None:
        """Append ``k`` records (array of shape ``[k, *record.shape]``) in one sequential write."""
        if self._fd is None:
            raise ShardkitError(f"{self.partial}: shard writer already closed")
        k = records.shape[0]
        if self.count + k > self.capacity:
            raise SchemaError(
                f"{self.path}: shard holds {self.capacity} records, cannot append {k} more to {self.count}"
            )
        if self.codec is None:
            data = _as_record_bytes(records)
            self._write(data)
        else:
            for rec in records:
                blob = self.codec.encode(np.ascontiguousarray(rec))
                self._offsets.append(self._offset)
                self._sizes.append(len(blob))
                self._write(memoryview(blob))
        self.count += k

    def append_stored(self, data: bytes | memoryview, sizes: Sequence[int]) -> None:
        """Append records already in their stored form (``data``: one after the other, ``sizes``: the
        stored size of each), as a commit re-packs them: a codec is deterministic, so the bytes are the same."""
        if self._fd is None:
            raise ShardkitError(f"{self.partial}: shard writer already closed")
        k = len(sizes)
        view = memoryview(data).cast("B")
        if self.count + k > self.capacity:
            raise SchemaError(f"{self.path}: shard holds {self.capacity} records, cannot append {k} more to {self.count}")
        if sum(int(n) for n in sizes) != view.nbytes:
            raise SchemaError(f"{self.path}: stored records of {sum(sizes)} bytes, given {view.nbytes}")
        if self.codec is None:
            if any(int(n) != self.record.nbytes for n in sizes):
                raise SchemaError(f"{self.path}: uncompressed records must be {self.record.nbytes} bytes each")
        else:
            offset = self._offset
            for n in sizes:
                self._offsets.append(offset)
                self._sizes.append(int(n))
                offset += int(n)
        self._write(view)
        self.count += k

    def _write(self, data: memoryview, *, last: bool = False) -> None:
        """Write ``data`` at the end; unless it is the ``last`` write (the close's fsync follows), count
        it towards the next background flush."""
        assert self._fd is not None
        try:
            _write_all(self._fd, data, self.partial)
        except BaseException:
            self.abort()
            raise
        self._crc = extend_crc32c(self._crc, data)
        self._offset += data.nbytes
        self._tail = (self._tail + bytes(data[-TAIL_SAMPLE_NBYTES:]))[-TAIL_SAMPLE_NBYTES:]
        if self._flush is not None and not last:
            try:
                self._flush.written(data.nbytes)
            except BaseException:
                self.abort()
                raise

    def close(self) -> ShardChecksums:
        """Append index + crc32c, fsync, rename. Returns the file's size and checksums."""
        if self._fd is None:
            raise ShardkitError(f"{self.partial}: shard writer already closed")
        if self.codec is None:
            index = ShardIndex.dense(self.count, self.capacity, self.record.nbytes)
        else:
            index = ShardIndex.dense(0, self.capacity, 0)
            index.offsets[: self.count] = self._offsets
            index.nbytes[: self.count] = self._sizes
        data_crc = self._crc
        tail_crc = crc32c_of(self._tail)
        encoded = index.encode()
        self._write(memoryview(encoded), last=True)
        if self._flush is not None:
            try:
                self._flush.finish()  # a background flush's error too: out of space, or the OSError, naming the file
                os.fsync(self._fd)
            except BaseException as exc:
                self.abort()
                if is_out_of_space(exc):
                    raise_out_of_space(self.partial, "flushing (fsync)")
                raise
        os.close(self._fd)
        self._fd = None
        os.replace(self.partial, self.path)
        if self.durable:
            fsync_dir(self.path.parent)
        index_crc = int.from_bytes(encoded[-4:], "little")
        return ShardChecksums(self._offset, self._crc, data_crc, index_crc, tail_crc)

    def abort(self) -> None:
        """Close and delete the partial file (nothing half-written survives)."""
        if self._fd is not None:
            if self._flush is not None:
                self._flush.finish_quietly()  # the descriptor stays open until no flush uses it
            os.close(self._fd)
            self._fd = None
        self.partial.unlink(missing_ok=True)


def shard_runs(count: int, open_writer: Callable[[], ShardWriter]) -> Iterator[tuple[ShardWriter, slice]]:
    """Cut a batch of ``count`` records at shard boundaries: each run goes to the writer ``open_writer()``
    returns (the open one, or a new one once the caller has closed the full one)."""
    pos = 0
    while pos < count:
        writer = open_writer()
        run = slice(pos, pos + min(count - pos, writer.capacity - writer.count))
        yield writer, run
        pos = run.stop


def stacked(parts: Sequence[np.ndarray], spec: FieldSpec) -> np.ndarray:
    """The rows of ``parts`` in one array (an empty one of ``spec`` when there are none)."""
    return np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)


def payload_document(meta: DatasetMeta) -> dict[str, Any]:
    """The payload array's ``zarr.json`` for a dataset of ``meta.num_records`` records."""
    record = meta.record
    codec = None if meta.compression is None else codec_from_json(meta.compression)
    return array_metadata(
        shape=(meta.num_records, *record.shape),
        dtype=record.dtype,
        chunk_shape=(meta.records_per_shard, *record.shape),
        inner_chunk_shape=(1, *record.shape),
        codec=codec,
        itemsize=np.dtype(record.dtype).itemsize,
        dimension_names=["record", *[f"dim_{d}" for d in range(1, 1 + len(record.shape))]],
    )


def field_chunk_for(fields: Mapping[str, FieldSpec], requested: int) -> int:
    """Records per field chunk: ``requested``, fewer if a chunk would decode to more than readers allow."""
    if int(requested) < 1:
        raise SchemaError(f"field_chunk must be positive, found {requested}")
    widest = max((spec.nbytes for spec in fields.values()), default=1)
    return max(1, min(int(requested), MAX_FIELD_CHUNK_NBYTES // widest))


@dataclass(frozen=True)
class WrittenShard:
    """A completed payload shard and the values of the small fields for its records.

    What :class:`DatasetWriter` hands to ``on_shard`` after each shard, and what it takes back as
    ``start`` to continue after shards already on disk.
    """

    info: ShardInfo
    fields: Mapping[str, np.ndarray]


class DatasetWriter:
    """Write a whole dataset: payload shards, small fields, metadata (last).

    Parameters
    ----------
    path
        Output directory, or an object-store URL (``s3://bucket/ds``, ``gs://``, ``az://``; see
        :func:`~shardkit.stores.open_store`): then the files are written in a private directory under
        ``staging_dir`` and each shard is uploaded as it completes, the other files at :meth:`close`
        and the root document last, so a reader sees the whole dataset or none; the staging directory
        is removed at the end. A failed write deletes what it uploaded (no dataset is visible); the
        shards of a writer killed before it could are removed by the next write to the URL, before
        its root document goes up (:func:`~shardkit.formats.transfer.remove_strays`).
    kind, payload
        Corpus kind and payload array name (``image`` / ``audio``).
    record
        Shape/dtype of one payload record.
    fields
        Small per-record fields by name.
    labels
        Class names per label field.
    records_per_shard
        S; by default chosen so an uncompressed shard is about ``shard_bytes``.
    field_chunk
        Records per chunk of the small field arrays (fewer when the dataset is smaller or a chunk
        would decode to too much).
    compression
        Codec name (``"zstd"``), codec JSON, a codec object, or ``None``.
    transform, source, extra
        Provenance stored in the metadata.
    durable
        fsync every file before it is renamed into place (default), so the metadata never lists a
        file a power cut could lose; ``False`` for scratch datasets: same atomic renames, no waiting.
    start
        Shards already on disk in ``path`` that the dataset begins with, in order: listed in the
        metadata, not written again; new shards follow.
    on_shard
        Called with each shard this writer completes, once its file is in place.
    provenance
        Where the records came from (:mod:`shardkit.formats.provenance`): ``fields`` then holds the
        per-record field ``provenance``; :meth:`close` writes the input table.
    staging_dir
        For a URL ``path``: the directory that holds the private ``shardkit-upload-<uid>`` staging
        directory (default: the system temporary directory); at most one shard of it at a time.

    ConfigError when ``path`` already holds a dataset (the writer never replaces one), or is a URL of
    a read-only store, or a URL given with ``start``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        kind: str,
        payload: str,
        record: FieldSpec,
        fields: Mapping[str, FieldSpec] | None = None,
        labels: Mapping[str, list[str]] | None = None,
        records_per_shard: int | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        field_chunk: int = DEFAULT_FIELD_CHUNK,
        compression: str | dict[str, Any] | RecordCodec | None = None,
        transform: dict[str, Any] | None = None,
        source: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        durable: bool = True,
        start: Sequence[WrittenShard] = (),
        on_shard: Callable[[WrittenShard], None] | None = None,
        provenance: ProvenanceSpec | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        where = as_location(path)
        self.store: Store | None = None
        self._staging: PrivateDir | None = None
        self._uploaded: list[str] = []
        if isinstance(where, str):
            self.store = self._open_target(where, bool(start))
            durable = False  # scratch files: what counts is the upload, checked by its crc32c
        #: The directory written: the output, or for a URL the staging copy (made once all is checked).
        self.path = where if isinstance(where, Path) else Path()
        #: How messages name the output: the directory, or the URL (credentials redacted).
        self.where = str(self.path) if self.store is None else self.store.url
        self.durable = durable
        self.record = record
        self.fields = dict(fields or {})
        if payload in self.fields or "key" in self.fields or payload == "key":
            raise SchemaError(f"field names must differ from the payload {payload!r} and from 'key'")
        if {payload, *self.fields} & set(TABLE_ARRAYS):
            raise SchemaError(f"field names must differ from the provenance table's arrays {list(TABLE_ARRAYS)}")
        if provenance is not None and self.fields.get(PROVENANCE_FIELD) != provenance.field_spec:
            raise SchemaError(
                f"{self.where}: provenance needs the field {PROVENANCE_FIELD!r} {provenance.field_spec.to_json()}, "
                f"found {self.fields.get(PROVENANCE_FIELD)}"
            )
        self.provenance = provenance
        for name in (payload, *self.fields):
            check_name(name, "array name", self.where)
        if isinstance(compression, str):
            self.codec = get_codec(compression)
        elif isinstance(compression, dict):
            self.codec = codec_from_json(compression)
        else:
            self.codec = compression
        if self.codec is not None:
            self.codec = self.codec.for_records(transform or {})  # audio codecs take the records' sample rate
            self.codec.check_record(record.shape, record.dtype, self.where)
        self.records_per_shard = int(records_per_shard or records_per_shard_for(record.nbytes, shard_bytes))
        if not 1 <= self.records_per_shard <= MAX_RECORDS_PER_SHARD:
            raise SchemaError(f"records_per_shard must be in [1, {MAX_RECORDS_PER_SHARD}], found {self.records_per_shard}")
        field_chunk = field_chunk_for(self.fields, field_chunk)
        self.meta = DatasetMeta(
            kind=kind,
            payload=payload,
            record=record,
            num_records=0,
            records_per_shard=self.records_per_shard,
            fields=self.fields,
            field_chunk=field_chunk,
            labels={k: list(v) for k, v in (labels or {}).items()},
            compression=None if self.codec is None else self.codec.to_json(),
            transform=dict(transform or {}),
            source=dict(source or {}),
            extra=dict(extra or {}),
            created_by=f"shardkit {__version__}",
        )
        self.on_shard = on_shard
        self.shards: list[ShardInfo] = []
        self.skipped: list[SkippedInput] = []
        self._field_parts: dict[str, list[np.ndarray]] = {k: [] for k in self.fields}
        self._shard: ShardWriter | None = None
        self._shard_fields: dict[str, list[np.ndarray]] = {k: [] for k in self.fields}
        self._records = 0
        self._closed = False
        if self.store is None and (self.path / ZARR_JSON).exists():
            raise ConfigError(f"{self.path}: a dataset already exists here; write to another directory")
        if self.store is not None:
            self._staging = _staging_run(staging_dir)
            self.path = self._staging.path / "dataset"
        self.path.mkdir(parents=True, exist_ok=True)
        for shard in start:
            self._adopt(shard)

    @staticmethod
    def _open_target(url: str, resuming: bool) -> Store:
        """The object store to publish into: writable, without a dataset yet (ConfigError naming it)."""
        store = open_store(url)
        if store.read_only:
            raise ConfigError(f"{store.url}: this store is read-only; write to an s3://, gs:// or az:// URL or a directory")
        if resuming:
            raise ConfigError(f"{store.url}: continuing after shards already written (start=) needs a local directory")
        if store.exists(ZARR_JSON):
            raise ConfigError(f"{store.url}: a dataset already exists here; write to another prefix")
        return store

    def _adopt(self, shard: WrittenShard) -> None:
        """List ``shard`` (already on disk) as the next shard of the dataset."""
        info = shard.info
        expected = chunk_key(self.meta.payload, len(self.shards), 1 + len(self.record.shape))
        if info.path != expected or info.start != self._records or not 0 < info.count <= self.records_per_shard:
            raise SchemaError(
                f"{self.where}: cannot continue after shard {info.path} [{info.start}, {info.stop}): expected "
                f"{expected} starting at record {self._records} with 1 to {self.records_per_shard} records"
            )
        for name, spec in self.fields.items():
            if name not in shard.fields:
                raise SchemaError(f"{self.where}: shard {info.path} lacks field {name!r}")
            self._field_parts[name].append(spec.check(name, shard.fields[name], info.count))
        self.shards.append(info)
        self._records = info.stop

    # ------------------------------------------------------------------ writing
    @property
    def records_written(self) -> int:
        """Records accepted so far (including resumed shards)."""
        return self._records

    def skip(self, path: str, reason: str) -> None:
        """Record that input ``path`` was skipped (kept in the metadata, in call order)."""
        self.skipped.append(SkippedInput(str(path), str(reason)))

    def write(self, batch: Mapping[str, np.ndarray]) -> None:
        """Append ``k`` records: the payload under the payload name and every declared field, each with
        ``k`` rows."""
        if self._closed:
            raise ShardkitError(f"{self.where}: writer is closed")
        payload = np.asarray(batch[self.meta.payload]) if self.meta.payload in batch else None
        if payload is None:
            raise SchemaError(f"{self.where}: batch has no payload field {self.meta.payload!r}")
        k = payload.shape[0]
        payload = self.record.check(self.meta.payload, payload, k)
        missing = set(self.fields) - set(batch)
        if missing:
            raise SchemaError(f"{self.where}: batch lacks fields {sorted(missing)}")
        values = {name: spec.check(name, batch[name], k) for name, spec in self.fields.items()}
        for shard, run in shard_runs(k, self._open_shard):
            shard.append(payload[run])
            for name in self.fields:
                self._shard_fields[name].append(values[name][run])
            self._records += run.stop - run.start
            if shard.full:
                self._finish_shard()

    def _open_shard(self) -> ShardWriter:
        """The open shard, or a new one after the last."""
        if self._shard is None:
            self._shard_rel = chunk_key(self.meta.payload, len(self.shards), 1 + len(self.record.shape))
            self._shard = ShardWriter(
                self.path / self._shard_rel, self.records_per_shard, self.record, self.codec, durable=self.durable
            )
        return self._shard

    def _finish_shard(self) -> None:
        assert self._shard is not None
        count = self._shard.count
        sums = self._shard.close()
        start = self._records - count
        info = ShardInfo(self._shard_rel, start, self._records, sums.nbytes, sums.crc32c, sums.data_crc32c,
                         sums.index_crc32c, sums.tail_crc32c)
        if self.store is not None:
            self._upload_shard(self.store, self._shard.path, sums.crc32c)
        parts = {name: stacked(self._shard_fields[name], spec) for name, spec in self.fields.items()}
        self.shards.append(info)
        for name in self.fields:
            self._field_parts[name].append(parts[name])
            self._shard_fields[name] = []
        self._shard = None
        if self.on_shard is not None:
            self.on_shard(WrittenShard(info, parts))

    # ------------------------------------------------------------------ finishing
    def close(self) -> DatasetMeta:
        """Flush the last shard, write fields and zarr documents, then the group metadata (last)."""
        if self._closed:
            return self.meta
        if self._shard is not None:
            if self._shard.count:
                self._finish_shard()
            else:
                self._shard.abort()
                self._shard = None
        try:
            return self._close()
        except BaseException:
            if self.store is not None:
                self.abort()
            raise

    def _close(self) -> DatasetMeta:
        n = self._records
        self.meta = self.meta.with_(num_records=n)
        chunk = self.meta.field_chunk_records
        files = self._write_fields(chunk)
        if self.provenance is not None:
            self.meta = self.meta.with_(provenance=write_provenance(
                self.path, self.provenance, self._field_values(PROVENANCE_FIELD), durable=self.durable))
        files[f"{self.meta.payload}/{ZARR_JSON}"] = write_json_atomic(
            self.path / self.meta.payload / ZARR_JSON, payload_document(self.meta), durable=self.durable
        )
        self.meta = self.meta.with_(
            field_chunk=chunk,
            shards=list(self.shards),
            skipped=list(self.skipped),
            files=files,
        )
        write_json_atomic(self.path / ZARR_JSON, group_metadata(self.meta), durable=self.durable)
        if self.store is not None:
            self._publish(self.store)
        self._closed = True
        logger.info("%s: wrote %d records in %d shards", self.where, n, len(self.shards))
        return self.meta

    def _upload_shard(self, store: Store, local: Path, crc32c: int) -> None:
        """Upload the finished shard ``local`` to its key, then drop the local copy."""
        key = self._shard_rel
        self._uploaded.append(key)
        try:
            put_checked(store, key, local, crc32c)
        except BaseException:
            self.abort()
            raise
        local.unlink()
        logger.debug("%s: uploaded", store.describe(key))

    def _publish(self, store: Store) -> None:
        """Upload the fields and documents written in the staging directory, the root document last."""
        local = self.path
        self._uploaded += [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
        upload_dataset(local, store, uploaded={info.path for info in self.shards})
        self._uploaded = []  # published: nothing for abort() to take back
        self._remove_staging()

    def _remove_staging(self) -> None:
        if self._staging is not None:
            self._staging.remove()
            self._staging.close()
            self._staging = None

    def _write_fields(self, chunk: int) -> dict[str, FileDigest]:
        """Every field array in chunks of ``chunk`` records, then its document; returns the digests."""
        codec = get_codec(FIELD_CODEC)
        arrays = [(name, spec, self._field_values(name), chunk, 0) for name, spec in self.fields.items()]
        return write_field_arrays(self.path, arrays, codec, durable=self.durable)

    def _field_values(self, name: str) -> np.ndarray:
        """Every record's value of field ``name`` so far (completed shards)."""
        return stacked(self._field_parts[name], self.fields[name])

    def abort(self) -> None:
        """Stop writing: the open shard is deleted, completed shard files stay (see ``on_shard``); for a
        URL, what was uploaded is deleted (the root document never was) and the staging directory removed."""
        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        self._closed = True
        if self.store is not None:
            self._unpublish(self.store)
        self._remove_staging()

    def _unpublish(self, store: Store) -> None:
        """Delete what this writer uploaded, root document first, best effort (a failure is logged)."""
        keys = sorted(set(self._uploaded), key=lambda k: k != ZARR_JSON)
        self._uploaded = []
        for key in keys:
            try:
                store.delete(key)
            except (OSError, ShardkitError) as exc:
                logger.warning("%s: writing was abandoned; could not delete %s: %s", store.url, key, exc)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _staging_run(parent: str | os.PathLike[str] | None) -> PrivateDir:
    """A fresh private directory for one URL writer, in this user's ``shardkit-upload-<uid>`` under
    ``parent`` (default: the temporary directory); runs a killed writer left there are deleted first."""
    base_dir = Path(tempfile.gettempdir() if parent is None else parent)
    if not base_dir.is_dir():
        raise ConfigError(f"staging_dir: expected an existing directory, found {str(base_dir)!r}")
    with PrivateDir.create(base_dir / f"shardkit-upload-{os.geteuid()}", what="the staging directory",
                           advice="Remove it, or choose another staging_dir", tighten=True) as base:
        sweep_stale(base.path, _RUN_PREFIX)
        return create_run_dir(base.path, _RUN_PREFIX)


#: Name prefix of a URL writer's staging directory (inside ``shardkit-upload-<uid>``).
_RUN_PREFIX = "writer-"
