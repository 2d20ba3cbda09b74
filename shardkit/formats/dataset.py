"""An opened shardkit dataset: metadata, the payload reader and the small fields in RAM."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.closing import Closing
from shardkit.errors import ChecksumError, MissingShardError, NotADatasetError, TruncatedShardError
from shardkit.formats.checksums import FileDigest, read_objects
from shardkit.formats.fields import read_field_rows
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, DatasetMeta, parse_json, read_dataset_meta
from shardkit.formats.provenance import Provenance, RecordSource
from shardkit.formats.ranged import DEFAULT_REMOTE_GAP_BYTES, RangedPayloadArray
from shardkit.formats.reader import DEFAULT_GAP_BYTES, PayloadArray, ReadStats
from shardkit.formats.spec import ZARR_JSON
from shardkit.formats.versions import list_versions, read_versioned, version_key, version_of
from shardkit.stores import Location, Store, StoreOptions, open_store
from shardkit.stores.cache import ShardCache, cache_namespace

__all__ = ["Dataset", "DatasetDocuments", "open_dataset", "Batch"]

#: A batch: payload, every per-record field, and ``key`` (global record index), each ``[n, ...]``.
Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class DatasetDocuments:
    """What opening a dataset in an object store reads and checks before any record: its metadata
    and the payload array's document. The root document records the digest of every other
    document, so a reader that knows the root document is unchanged (same ETag, see
    :mod:`shardkit.readers.identity`) can open the same version again from these, without a request.
    ``payload_document=None``: only the root document is known (read moments ago, with the identity);
    the array documents are then read and checked against its digests as at a first open.
    ``fields``: the per-record fields that batches carry (:attr:`Dataset.fields`), loaded and
    checked with these documents, or ``None`` (read at first use); a DataLoader's start helper
    passes them on so that its workers do not each fetch them (docs/design.md §6, worker start).
    ``tails``: shards whose ``tail_crc32c`` that helper checked, with the ETag each response carried
    (:meth:`~shardkit.formats.ranged.RangedPayloadArray.check_tails`): a reader pins those ETags
    instead of checking the tails again before its first block."""

    meta: DatasetMeta
    payload_document: dict[str, Any] | None
    fields: Mapping[str, np.ndarray] | None = None
    tails: Mapping[int, str] | None = None


class Dataset(Closing):
    """A shardkit dataset opened for reading.

    Parameters
    ----------
    path
        Dataset directory, a URL (``s3://bucket/ds``, ``gs://``, ``az://``, ``http(s)://``) or a
        :class:`~shardkit.stores.Store`.
    stats
        Read counters for the payload (one ``read_calls`` is one request to an object store).
    gap_bytes, remote_gap_bytes
        Coalescing threshold for sparse reads of a local dataset, and of one in an object store.
    store_options
        Concurrency, timeouts and retries of an object store (:class:`~shardkit.stores.StoreOptions`).
    cache_dir, cache_size, cache_stats
        For a dataset in an object store: keep fetched shards in this local directory (at most
        ``cache_size`` bytes in all; ``None``: no limit) and read them from there once complete and
        verified (:mod:`shardkit.stores.cache`), counting those reads in ``cache_stats``.
    version
        Open this kept older version instead of the current one (``shardkit info`` lists them).
    opened
        Documents already read and checked, by store location (:attr:`Store.location`): a remote
        dataset found there is opened from them without a request (the caller vouches that its
        root document is unchanged; a sampler does, by its dataset identity).
    ask_priority
        With ``cache_dir``: the first read's turn (0 first) when it asks another process filling a
        copy for pages; a sampler passes its place among the consumers of its rank.
    fillers
        With ``cache_dir``: the processes that download into the cache together (a DataLoader's
        workers); each keeps its share of the background parts in flight.

    Opening checks everything cheap (metadata, its checksum, every array document); fields are loaded
    on first use, each chunk checked; payload records are checked only by
    :func:`~shardkit.formats.verify`. The opened version stays readable while a commit adds a newer one.
    """

    def __init__(
        self,
        path: Location,
        *,
        stats: ReadStats | None = None,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        remote_gap_bytes: int = DEFAULT_REMOTE_GAP_BYTES,
        store_options: StoreOptions | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | None = None,
        cache_stats: ReadStats | None = None,
        version: int | None = None,
        opened: Mapping[str, DatasetDocuments] | None = None,
        decode_workers: int = 0,
        decode: bool = True,
        ask_priority: int = 0,
        fillers: int = 1,
    ) -> None:
        self.store: Store = open_store(path, store_options)
        #: The local cache of remote shards (``cache_dir``), or None.
        self.cache: ShardCache | None = None
        #: Local directory, or the URL for messages (secrets redacted; ``store.location`` reopens it).
        self.path: Path | str = self.store.local_path() if self.store.is_local else self.store.url
        self._current = version is None
        known = None
        if opened and version is None and not self.store.is_local:
            known = opened.get(self.store.location)
        self.meta: DatasetMeta = known.meta if known is not None else read_dataset_meta(
            self.store, ZARR_JSON if version is None else version_key(version)
        )  # fmt: skip
        files = self.meta.files
        docs = [f"{name}/{ZARR_JSON}" for name in self.meta.fields if f"{name}/{ZARR_JSON}" in files]
        payload_digest = files.get(f"{self.meta.payload}/{ZARR_JSON}")  # checked as the payload reader reads it
        #: The field documents read (and checked) here, by key: a field's read does not fetch its document again.
        self._field_documents: dict[str, bytes] = {}
        if self.store.is_local:
            for rel in docs:
                self._field_documents[rel] = read_versioned(self.store, rel, files[rel], what="field array document")
            self.store.local_path(f"{self.meta.payload}/{ZARR_JSON}")  # inside the dataset, or UnsafePathError
            self.payload: PayloadArray = PayloadArray(self.store.local_path() / self.meta.payload, shards=self.meta.shards,
                                                      stats=stats, gap_bytes=gap_bytes, document_digest=payload_digest)
        else:
            payload_document = None if known is None else known.payload_document
            if payload_document is None:  # else the fields' are checked when first read
                self._field_documents, payload_document = self._array_documents(docs, payload_digest)
            self.cache = None if cache_dir is None else ShardCache(cache_dir, cache_namespace(
                self.store.url, hashlib.sha256(json.dumps(self.meta.to_json(), sort_keys=True).encode()).hexdigest()
            ), cache_size)
            self.payload = RangedPayloadArray(self.store, self.meta.payload, shards=self.meta.shards, stats=stats,
                                              gap_bytes=remote_gap_bytes, document_digest=payload_digest, cache=self.cache,
                                              cache_stats=cache_stats, document=payload_document,
                                              checked_tails=None if known is None else known.tails,
                                              ask_priority=ask_priority, fillers=fillers)
        self.payload.use_decoders(decode_workers)
        self.payload.decode = decode
        if (self.payload.records_per_shard != self.meta.records_per_shard
                or (self.payload.codec is None) != (self.meta.compression is None)):
            raise NotADatasetError(
                f"{self.path}: {self.meta.payload}/{ZARR_JSON} has {self.payload.records_per_shard} records per shard "
                f"and compression {self.payload.codec.name if self.payload.codec else None}, the dataset's {ZARR_JSON} "
                f"says {self.meta.records_per_shard} and {(self.meta.compression or {}).get('name')}"
            )
        if self.payload.num_records != self.meta.num_records or self.payload.record != self.meta.record:
            raise NotADatasetError(
                f"{self.path}: {self.meta.payload}/{ZARR_JSON} describes {self.payload.shape} {self.payload.dtype}, "
                f"the dataset's {ZARR_JSON} says {self.meta.num_records} records of {self.meta.record.shape} "
                f"{self.meta.record.dtype}"
            )
        #: Where the records came from (``None`` for a dataset written without provenance).
        self.provenance: Provenance | None = Provenance.from_meta(self.meta, where=self.store.describe(ZARR_JSON))
        #: Fields that came with the documents (kept with them by :attr:`documents`), else loaded on first use.
        self._given_fields = None if known is None or known.fields is None else dict(known.fields)
        self._fields: dict[str, np.ndarray] | None = self._given_fields
        self._given_tails = None if known is None else known.tails

    def _array_documents(self, docs: list[str], payload_digest: FileDigest | None) -> tuple[dict[str, bytes], dict[str, Any] | None]:
        """The field arrays' documents ``docs`` (checked) and the payload array's (checked and parsed;
        ``None``: its reader reads it), from a remote store in one round of concurrent requests: the
        payload reader would otherwise ask for its document a round trip after the fields'. Should one
        be replaced by a newer version or gone, each is read as this version recorded it, one by one."""
        files = self.meta.files
        payload_key = f"{self.meta.payload}/{ZARR_JSON}"
        keys = [*docs, payload_key] if payload_digest is not None and payload_digest.nbytes > 0 else docs
        try:
            got = read_objects(self.store, keys, files, what="array document", max_nbytes=MAX_DOCUMENT_NBYTES)
        except (TruncatedShardError, ChecksumError, MissingShardError):
            return {rel: read_versioned(self.store, rel, files[rel], what="field array document",
                                        max_nbytes=MAX_DOCUMENT_NBYTES) for rel in docs}, None  # fmt: skip
        payload = parse_json(got[-1], self.store.describe(payload_key)) if len(keys) > len(docs) else None
        return dict(zip(docs, got)), payload

    # ------------------------------------------------------------------ description
    @property
    def documents(self) -> DatasetDocuments | None:
        """The documents this dataset was opened from, to open it again without a request (``None``
        for a local dataset, whose documents are files, and for an older version)."""
        if isinstance(self.payload, RangedPayloadArray) and self._current:
            return DatasetDocuments(self.meta, self.payload.document, self._given_fields, self._given_tails)
        return None

    def __len__(self) -> int:
        return self.meta.num_records

    @property
    def num_records(self) -> int:
        return self.meta.num_records

    @property
    def payload_name(self) -> str:
        return self.meta.payload

    @property
    def record_nbytes(self) -> int:
        return self.meta.record.nbytes

    @property
    def label_names(self) -> list[str] | None:
        return self.meta.label_names

    @property
    def stats(self) -> ReadStats:
        return self.payload.stats

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """Every per-record field that batches carry, as one in-RAM array ``[N, ...]`` each (loaded once,
        every chunk checked: :func:`~shardkit.formats.fields.read_field_rows`); not the provenance
        field, which training does not need (:meth:`source`, :meth:`sources` and :meth:`field` read it)."""
        if self._fields is None:
            skip = None if self.provenance is None else self.provenance.field
            self._fields = {name: self.field(name) for name in self.meta.fields if name != skip}
        return self._fields

    def loaded_field(self, name: str) -> np.ndarray | None:
        """Field ``name`` if it is in memory already (loaded, or given with the documents), else ``None``."""
        return None if self._fields is None else self._fields.get(name)

    def field(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Any declared per-record field, provenance included, read whole (every chunk checked; its
        document as the open read it), into ``out`` when given."""
        m = self.meta
        if name not in m.fields:
            raise KeyError(f"{self.path}: no field {name!r}; fields: {', '.join(m.fields) or 'none'}")
        loaded = self.loaded_field(name)
        if loaded is not None:
            if out is None:
                return loaded
            out[...] = loaded
            return out
        return read_field_rows(self.store, name, m.fields[name], m.num_records, m.field_chunk_records, m.files,
                               out=out, document=self._field_documents.get(f"{name}/{ZARR_JSON}"))

    def source(self, key: int) -> RecordSource | None:
        """Where record ``key`` came from (``None`` without provenance), reading one chunk of each table."""
        if self.provenance is None:
            return None
        k = int(key)
        if not 0 <= k < self.num_records:
            raise IndexError(f"{self.path}: record {key} outside [0, {self.num_records})")
        return self.provenance.source(self.store, self.meta, k)

    def sources(self, keys: Any) -> dict[str, Any]:
        """Where each of many records came from, e.g. a batch's ``key``: one int64 array per provenance
        column (``input``, ``part``, the kind's own such as ``row`` or ``width``) and ``name``, a list of
        input names, all in the order of ``keys``. Reads only the field chunks the keys fall in and one
        table chunk per distinct input, so provenance stays out of the batches (and of RAM) until asked
        for. ``{}`` for a dataset written without provenance."""
        if self.provenance is None:
            return {}
        prov, m = self.provenance, self.meta
        k = np.asarray(keys, dtype=np.int64).reshape(-1)
        if k.size and (int(k.min()) < 0 or int(k.max()) >= self.num_records):
            bad = int(k[(k < 0) | (k >= self.num_records)][0])
            raise IndexError(f"{self.path}: record {bad} outside [0, {self.num_records})")
        rows = np.empty((k.size, len(prov.columns)), dtype=np.int64)
        chunk = m.field_chunk_records
        for c in np.unique(k // chunk).tolist():
            start, stop = c * chunk, min((c + 1) * chunk, self.num_records)
            here = (k >= start) & (k < stop)
            rows[here] = prov.values(self.store, m, start, stop)[k[here] - start]
        out: dict[str, Any] = {col: rows[:, j].copy() for j, col in enumerate(prov.columns)}
        inputs = out["input"]
        if inputs.size and (int(inputs.min()) < 0 or int(inputs.max()) >= prov.count):
            bad = (inputs < 0) | (inputs >= prov.count)
            raise NotADatasetError(f"{self.store.describe(prov.field)}: record {int(k[bad][0])} says it came from input "
                                   f"{int(inputs[bad][0])}, but the provenance table holds {prov.count} inputs")
        names = {i: prov.input_name(self.store, i) for i in np.unique(inputs).tolist()}
        out["name"] = [names[i] for i in inputs.tolist()]
        return out

    def info(self) -> dict[str, Any]:
        """Summary for ``shardkit info --json``."""
        m = self.meta
        return {
            "path": str(self.path),
            "remote": not self.store.is_local,
            "format_version": m.format_version,
            "format": m.format,
            "kind": m.kind,
            "payload": m.payload,
            "records": m.num_records,
            "shape": list(m.record.shape),
            "dtype": m.record.dtype,
            "record_bytes": m.record.nbytes,
            "records_per_shard": m.records_per_shard,
            "shards": len(m.shards),
            "bytes": m.payload_nbytes,
            "compression": m.compression,
            "fields": {k: v.to_json() for k, v in m.fields.items()
                       if self.provenance is None or k != self.provenance.field},
            "labels": m.labels,
            "skipped": len(m.skipped),
            "skipped_inputs": [s.to_json() for s in m.skipped],
            "changes": {} if self.provenance is None else dict(self.provenance.changes),
            **({} if self.provenance is None else {"provenance": {
                "field": self.provenance.field, "columns": list(self.provenance.columns),
                "root": self.provenance.root, "inputs": self.provenance.count}}),
            "transform": m.transform,
            "source": m.source,
            "created_by": m.created_by,
            "version": version_of(m.to_json()),
            "versions": [v.to_json() for v in list_versions(self.store)],
            "history": m.source.get("history", []),
        }

    # ------------------------------------------------------------------ reading
    def read(self, keys: np.ndarray | list[int], out: np.ndarray | None = None) -> Batch:
        """A batch of the records ``keys`` in that order (payload, fields and ``key``)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        batch: Batch = {self.meta.payload: self.payload.read(keys, out)}
        for name, values in self.fields.items():
            batch[name] = values[keys]
        batch["key"] = keys
        return batch

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        """One record as a dict of arrays (no leading batch axis)."""
        k = int(key)
        if k < 0:
            k += self.num_records
        if not 0 <= k < self.num_records:
            raise IndexError(f"{self.path}: record {key} outside [0, {self.num_records})")
        return {name: value[0] for name, value in self.read([k]).items()}

    def close(self) -> None:
        self.payload.close()
        if self.cache is not None:
            self.cache.close()

    def __repr__(self) -> str:
        m = self.meta
        return (
            f"Dataset({str(self.path)!r}, kind={m.kind!r}, records={m.num_records}, "
            f"{m.payload}={m.record.shape} {m.record.dtype}, shards={len(m.shards)})"
        )


def open_dataset(path: Location, **kwargs: Any) -> Dataset:
    """Open a shardkit dataset (see :class:`Dataset`)."""
    return Dataset(path, **kwargs)
