"""Writing datasets: payload shards streamed sequentially, metadata last, resumable after a crash.

A :class:`ShardWriter` streams records into ``<shard>.partial`` with plain ``os.write`` calls, appends
the index and its crc32c, fsyncs and renames: a shard file either exists complete or not at all.

A :class:`DatasetWriter` cuts the stream of records into shards, keeps the small per-record fields,
and on :meth:`DatasetWriter.close` writes the field arrays, the zarr array documents and finally the
root group document that lists every shard. Until that last rename the directory is recognisably
incomplete (``IncompleteDatasetError`` on open).

Resume: after each completed shard the writer records, in ``.shardkit-staging/``, the shard's info,
its per-record fields, the inputs skipped so far and the *input cursor* (how many inputs of the
producer's deterministic input sequence are covered). A new writer with the same configuration picks up
there; the producer skips ``writer.input_cursor`` inputs and continues. The output is byte-identical to
an uninterrupted run because shards are cut at the same record boundaries.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit._version import __version__
from shardkit.errors import ConversionError, SchemaError, ShardkitError
from shardkit.formats.atomic import fsync_dir, is_out_of_space, raise_out_of_space
from shardkit.formats.checksums import FileDigest
from shardkit.formats.codecs import RecordCodec, codec_from_json, get_codec
from shardkit.formats.fields import write_field_array
from shardkit.formats.index import ShardIndex, crc32c_of, extend_crc32c
from shardkit.formats.metadata import (
    DEFAULT_FIELD_CHUNK,
    DatasetMeta,
    array_metadata,
    group_metadata,
    read_dataset_meta,
    read_json,
    write_json_atomic,
)
from shardkit.formats.paths import check_name
from shardkit.formats.spec import (
    ATTRS_KEY,
    DEFAULT_SHARD_BYTES,
    MAX_FIELD_CHUNK_NBYTES,
    MAX_RECORDS_PER_SHARD,
    ZARR_JSON,
    FieldSpec,
    ShardInfo,
    SkippedInput,
    chunk_key,
    records_per_shard_for,
)

__all__ = ["ShardWriter", "ShardChecksums", "DatasetWriter", "STAGING_DIR", "remove_output"]

logger = logging.getLogger(__name__)

#: Directory inside an unfinished dataset that holds what is needed to resume.
STAGING_DIR = ".shardkit-staging"
#: Codec used for the small per-record field arrays (mostly zeros for boxes; cheap to decode).
_FIELD_CODEC = "zstd"


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


def _as_record_bytes(records: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(records)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8).data


class ShardWriter:
    """Stream records into one payload shard file.

    Parameters
    ----------
    path
        Final path of the shard; bytes go to ``path.partial`` until :meth:`close`.
    capacity
        Records per shard S (the index always has S entries; unused ones are marked empty).
    record
        Shape and dtype of one record.
    codec
        Per-record compression, or ``None`` for the fixed-size layout.
    durable
        fsync before the rename (default). ``False`` for scratch files (SSD-tier reservoirs): the
        rename still makes the file appear complete or not at all, but nothing waits for the disk.
    """

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
        self.durable = durable
        self.count = 0
        self._offset = 0
        self._crc = 0  # running crc32c of everything written: the records, then the index
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

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

    def _write(self, data: memoryview) -> None:
        assert self._fd is not None
        try:
            _write_all(self._fd, data, self.partial)
        except BaseException:
            self.abort()
            raise
        self._crc = extend_crc32c(self._crc, data)
        self._offset += data.nbytes

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
        encoded = index.encode()
        self._write(memoryview(encoded))
        if self.durable:
            try:
                os.fsync(self._fd)
            except OSError as exc:
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
        return ShardChecksums(self._offset, self._crc, data_crc, index_crc)

    def abort(self) -> None:
        """Close and delete the partial file (nothing half-written survives)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.partial.unlink(missing_ok=True)


def _field_chunk_for(fields: Mapping[str, FieldSpec], requested: int) -> int:
    """Records per field chunk: ``requested``, fewer if a chunk would decode to more than readers allow."""
    if int(requested) < 1:
        raise SchemaError(f"field_chunk must be positive, found {requested}")
    widest = max((spec.nbytes for spec in fields.values()), default=1)
    return max(1, min(int(requested), MAX_FIELD_CHUNK_NBYTES // widest))


def _looks_like_output(path: Path) -> bool:
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    if (path / STAGING_DIR).is_dir():
        return True
    doc = path / ZARR_JSON
    if doc.exists():
        try:
            return ATTRS_KEY in read_json(doc).get("attributes", {})
        except ShardkitError:
            return False
    return False


def remove_output(path: Path) -> None:
    """Delete a previous shardkit output (``--overwrite``), refusing anything that is not one."""
    path = Path(path)
    if not path.exists():
        return
    if not _looks_like_output(path):
        raise ConversionError(
            f"{path}: refusing to overwrite: expected an empty directory or a shardkit dataset, "
            "found other files"
        )
    shutil.rmtree(path)


class DatasetWriter:
    """Write a whole dataset: payload shards, small fields, metadata (last).

    Parameters
    ----------
    path
        Output directory.
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
        Records per chunk of the small field arrays (fewer when the dataset or a chunk's decoded
        size would be smaller, see ``DatasetMeta.field_chunk_records``).
    compression
        Codec name (``"zstd"``), codec JSON, a codec object, or ``None``.
    transform, source, extra
        Provenance stored in the metadata.
    config
        The producer's parameters. A staging directory written with a different config is refused
        (``ConversionError``) instead of mixing two conversions.
    resume
        Continue a matching interrupted write in ``path`` (default). With ``False`` an existing
        staging directory is an error.
    overwrite
        Delete a previous shardkit output at ``path`` first.
    durable
        fsync every file before it is renamed into place (default). ``False`` for scratch datasets
        (SSD-tier reservoirs) that nobody needs after a crash: same atomic renames, no waiting.
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
        config: dict[str, Any] | None = None,
        resume: bool = True,
        overwrite: bool = False,
        durable: bool = True,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self.record = record
        self.fields = dict(fields or {})
        if payload in self.fields or "key" in self.fields or payload == "key":
            raise SchemaError(f"field names must differ from the payload {payload!r} and from 'key'")
        for name in (payload, *self.fields):
            check_name(name, "array name", str(self.path))
        if isinstance(compression, str):
            self.codec = get_codec(compression)
        elif isinstance(compression, dict):
            self.codec = codec_from_json(compression)
        else:
            self.codec = compression
        self.records_per_shard = int(records_per_shard or records_per_shard_for(record.nbytes, shard_bytes))
        if not 1 <= self.records_per_shard <= MAX_RECORDS_PER_SHARD:
            raise SchemaError(f"records_per_shard must be in [1, {MAX_RECORDS_PER_SHARD}], found {self.records_per_shard}")
        field_chunk = _field_chunk_for(self.fields, field_chunk)
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
        self._config = {
            "config": config or {},
            "kind": kind,
            "payload": payload,
            "record": record.to_json(),
            "fields": {k: v.to_json() for k, v in self.fields.items()},
            "records_per_shard": self.records_per_shard,
            "compression": self.meta.compression,
        }
        self.staging = self.path / STAGING_DIR
        self.shards: list[ShardInfo] = []
        self.skipped: list[SkippedInput] = []
        self._pending_skips: list[SkippedInput] = []
        self._field_parts: dict[str, list[np.ndarray]] = {k: [] for k in self.fields}
        self._shard: ShardWriter | None = None
        self._shard_fields: dict[str, list[np.ndarray]] = {k: [] for k in self.fields}
        self._records = 0
        self.input_cursor = 0
        self._last_cursor = 0
        self.complete = False
        self._closed = False

        if overwrite:
            remove_output(self.path)
        self._prepare(resume)

    # ------------------------------------------------------------------ set-up and resume
    def _prepare(self, resume: bool) -> None:
        if (self.path / ZARR_JSON).exists():
            existing = read_dataset_meta(self.path)
            stored = existing.source.get("config_fingerprint")
            if resume and stored == self._fingerprint():
                logger.info("%s: already complete with the same parameters; nothing to do", self.path)
                self.complete = True
                self._closed = True
                self.meta = existing
                return
            raise ConversionError(
                f"{self.path}: a dataset already exists here"
                + (" with different parameters" if stored else "")
                + "; use --overwrite to replace it"
            )
        if self.path.exists() and not _looks_like_output(self.path):
            raise ConversionError(
                f"{self.path}: output directory is not empty and is not a shardkit dataset; "
                "choose another directory"
            )
        if self.staging.is_dir():
            if not resume:
                raise ConversionError(
                    f"{self.path}: holds an interrupted conversion; resume it or use --overwrite"
                )
            self._load_staging()
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir()
            write_json_atomic(self.staging / "config.json", self._config, durable=self.durable)

    def _fingerprint(self) -> str:
        return f"{crc32c_of(json.dumps(self._config, sort_keys=True).encode()):08x}"

    def _load_staging(self) -> None:
        stored = read_json(self.staging / "config.json") if (self.staging / "config.json").exists() else None
        if stored != json.loads(json.dumps(self._config)):
            raise ConversionError(
                f"{self.path}: an interrupted conversion with different parameters is here; "
                "re-run with the same parameters to resume, or use --overwrite to start fresh"
            )
        i = 0
        while True:
            info_path = self.staging / f"shard-{i:06d}.json"
            fields_path = self.staging / f"fields-{i:06d}.npz"
            if not info_path.exists() or not fields_path.exists():
                break
            try:
                doc = read_json(info_path)
                info = ShardInfo.from_json(doc["shard"], where=str(info_path))
                if info.data_crc32c is None or info.index_crc32c is None:
                    break  # staged by a shardkit before format 1.1: redo it to get its checksums
                with np.load(fields_path) as npz:
                    parts = {name: npz[name] for name in self.fields}
            except (ShardkitError, KeyError, ValueError, OSError, EOFError):
                # Staging files are not fsynced (see _finish_shard): one lost to a power cut only
                # means that shard is written again.
                logger.info("%s: staging of shard %d unreadable; redoing it", self.path, i)
                break
            shard_file = self.path / info.path
            if not shard_file.exists() or shard_file.stat().st_size != info.nbytes:
                break
            for name in self.fields:
                self._field_parts[name].append(parts[name])
            self.shards.append(info)
            self.skipped.extend(SkippedInput(s["path"], s["reason"]) for s in doc["skipped"])
            self._records = info.stop
            self.input_cursor = int(doc["input_cursor"])
            i += 1
        # Anything after the last good shard is redone: drop stale partial files and orphans.
        payload_dir = self.path / self.meta.payload
        if payload_dir.exists():
            keep = {str(self.path / s.path) for s in self.shards}
            for f in payload_dir.rglob("*"):
                if f.is_file() and str(f) not in keep:
                    f.unlink()
        for stale in self.staging.glob("*.partial"):
            stale.unlink()
        if self.shards:
            logger.info(
                "%s: resuming after %d complete shards (%d records, input %d)",
                self.path, len(self.shards), self._records, self.input_cursor,
            )

    # ------------------------------------------------------------------ writing
    @property
    def records_written(self) -> int:
        """Records accepted so far (including resumed shards)."""
        return self._records

    def skip(self, path: str, reason: str, cursor: int | None = None) -> None:
        """Record that input ``path`` (at position ``cursor`` of the input sequence) was skipped."""
        self._pending_skips.append(SkippedInput(str(path), str(reason), -1 if cursor is None else cursor))

    def write(self, batch: Mapping[str, np.ndarray], cursors: np.ndarray | None = None) -> None:
        """Append ``k`` records.

        Parameters
        ----------
        batch
            The payload under the payload name and every declared field, each with ``k`` rows.
        cursors
            For each record, the input cursor *after* it (inputs consumed once it is written); by
            default inputs and records correspond one to one.
        """
        if self._closed:
            raise ShardkitError(f"{self.path}: writer is closed")
        payload = np.asarray(batch[self.meta.payload]) if self.meta.payload in batch else None
        if payload is None:
            raise SchemaError(f"{self.path}: batch has no payload field {self.meta.payload!r}")
        k = payload.shape[0]
        payload = self.record.check(self.meta.payload, payload, k)
        missing = set(self.fields) - set(batch)
        if missing:
            raise SchemaError(f"{self.path}: batch lacks fields {sorted(missing)}")
        values = {name: spec.check(name, batch[name], k) for name, spec in self.fields.items()}
        if cursors is None:
            cursors = self.input_cursor_base() + np.arange(1, k + 1)
        cursors = np.asarray(cursors, dtype=np.int64)
        if k:
            self._last_cursor = int(cursors[-1])
        pos = 0
        while pos < k:
            if self._shard is None:
                self._open_shard()
            assert self._shard is not None
            take = min(k - pos, self._shard.capacity - self._shard.count)
            self._shard.append(payload[pos : pos + take])
            for name in self.fields:
                self._shard_fields[name].append(values[name][pos : pos + take])
            self._records += take
            pos += take
            if self._shard.full:
                self._finish_shard(int(cursors[pos - 1]))

    def input_cursor_base(self) -> int:
        """Input cursor that corresponds to the records written so far, when inputs map 1:1."""
        return self._records

    def _open_shard(self) -> None:
        i = len(self.shards)
        rel = chunk_key(self.meta.payload, i, 1 + len(self.record.shape))
        self._shard = ShardWriter(
            self.path / rel, self.records_per_shard, self.record, self.codec, durable=self.durable
        )
        self._shard_rel = rel

    def _finish_shard(self, cursor: int) -> None:
        assert self._shard is not None
        count = self._shard.count
        sums = self._shard.close()
        start = self._records - count
        info = ShardInfo(self._shard_rel, start, self._records, sums.nbytes, sums.crc32c, sums.data_crc32c, sums.index_crc32c)
        i = len(self.shards)
        parts = {name: np.concatenate(self._shard_fields[name]) if self._shard_fields[name]
                 else np.empty((0, *spec.shape), spec.dtype) for name, spec in self.fields.items()}
        # The shard itself is durable now. Its staging record is not fsynced: it survives a killed
        # process (the page cache keeps it), and if a power cut loses it, resume simply redoes this
        # shard — so waiting for the disk three more times per shard would buy nothing.
        tmp = self.staging / f"fields-{i:06d}.npz.partial"
        with open(tmp, "wb") as fh:
            np.savez(fh, **parts)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
        os.replace(tmp, self.staging / f"fields-{i:06d}.npz")
        mine = [s for s in self._pending_skips if s.cursor < cursor]
        self._pending_skips = [s for s in self._pending_skips if s.cursor >= cursor]
        write_json_atomic(
            self.staging / f"shard-{i:06d}.json",
            {"shard": info.to_json(), "input_cursor": cursor, "skipped": [s.to_json() for s in mine]},
            durable=False,
        )
        self.shards.append(info)
        self.skipped.extend(mine)
        for name in self.fields:
            self._field_parts[name].append(parts[name])
            self._shard_fields[name] = []
        self.input_cursor = cursor
        self._shard = None

    # ------------------------------------------------------------------ finishing
    def close(self) -> DatasetMeta:
        """Flush the last shard, write fields and zarr documents, then the group metadata (last)."""
        if self._closed:
            return self.meta
        if self._shard is not None:
            if self._shard.count:
                self._finish_shard(self._last_cursor)
            else:
                self._shard.abort()
                self._shard = None
        self.skipped.extend(self._pending_skips)
        self._pending_skips = []
        n = self._records
        self.meta = self.meta.with_(num_records=n)
        chunk = self.meta.field_chunk_records
        files = self._write_fields(chunk)
        ndim = 1 + len(self.record.shape)
        files[f"{self.meta.payload}/{ZARR_JSON}"] = write_json_atomic(
            self.path / self.meta.payload / ZARR_JSON,
            array_metadata(
                shape=(n, *self.record.shape),
                dtype=self.record.dtype,
                chunk_shape=(self.records_per_shard, *self.record.shape),
                inner_chunk_shape=(1, *self.record.shape),
                codec=self.codec,
                itemsize=np.dtype(self.record.dtype).itemsize,
                dimension_names=["record", *[f"dim_{d}" for d in range(1, ndim)]],
            ),
            durable=self.durable,
        )
        self.meta = self.meta.with_(
            field_chunk=chunk,
            shards=list(self.shards),
            skipped=list(self.skipped),
            files=files,
            source={**self.meta.source, "config_fingerprint": self._fingerprint()},
        )
        write_json_atomic(self.path / ZARR_JSON, group_metadata(self.meta), durable=self.durable)
        shutil.rmtree(self.staging, ignore_errors=True)
        self._closed = True
        self.complete = True
        logger.info("%s: wrote %d records in %d shards", self.path, n, len(self.shards))
        return self.meta

    def _write_fields(self, chunk: int) -> dict[str, FileDigest]:
        """Every field array in chunks of ``chunk`` records, then its document; returns the digests."""
        codec = get_codec(_FIELD_CODEC)
        files: dict[str, FileDigest] = {}
        for name, spec in self.fields.items():
            parts = self._field_parts[name]
            data = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            files |= write_field_array(self.path, name, spec, data, chunk, codec, durable=self.durable)
        return files

    def abort(self) -> None:
        """Stop writing; completed shards stay staged for a resume, the open shard is deleted."""
        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        self._closed = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
