"""Commit records as a new version of a dataset: boundary shards re-packed, metadata last (docs/design.md §11).

A commit appends *segments* (runs of records stored in files of the shard layout: the parts of a
conversion, the datasets being merged) to the *base* (or to nothing) and writes one ordinary dataset.
Each new shard is in place, linked, or re-packed in stored form (never re-encoded) from sources whose
checksums are verified first. Every step is idempotent, so running a killed commit again finishes it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from shardkit.errors import (
    ChecksumError,
    ConversionError,
    ObjectChangedError,
    ObjectTooLargeError,
    SchemaError,
    TruncatedShardError,
)
from shardkit.formats.checksums import FileDigest
from shardkit.formats.codecs import codec_from_json, get_codec
from shardkit.formats.fields import read_field_rows, write_field_arrays
from shardkit.formats.index import ShardIndex, crc32c_of
from shardkit.formats.metadata import DEFAULT_FIELD_CHUNK, MAX_DOCUMENT_NBYTES, DatasetMeta, encode_json, group_metadata, read_json_object
from shardkit.formats.provenance import PROVENANCE_FIELD, Provenance, ProvenanceSpec, write_provenance
from shardkit.formats.spec import ATTRS_KEY, FORMAT_MINOR, ZARR_JSON, FieldSpec, ShardInfo, SkippedInput, chunk_key, index_nbytes
from shardkit.formats.transfer import copy_object, object_matches, put_checked, writing
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS, VERSIONS_DIR, prune, retired_key, version_key, version_of
from shardkit.formats.writer import FIELD_CODEC, ShardWriter, field_chunk_for, payload_document
from shardkit.stores import Location, Store, open_store
from shardkit.stores.atomic import synced_now, synced_together

__all__ = ["StoredShard", "Segment", "CommitReport", "ShardRecipe", "InputTable", "commit", "merge_labels", "plan_shards", "build_shard"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredShard:
    """A file in the shard layout: object ``key`` of ``store`` (pickles as its URL, for remote tasks),
    ``count`` records, an index of ``capacity`` entries (S, or ``count`` for a piece), and its size and
    checksums as its writer recorded them (:class:`~shardkit.formats.spec.ShardInfo`)."""

    store: Store
    key: str
    count: int
    capacity: int
    nbytes: int
    crc32c: int
    data_crc32c: int
    index_crc32c: int
    tail_crc32c: int | None = None

    @classmethod
    def of(cls, store: Store, info: ShardInfo, capacity: int, key: str | None = None) -> StoredShard:
        """The shard file ``info`` describes (``info.path``, or ``key``, in ``store``)."""
        if info.data_crc32c is None or info.index_crc32c is None:
            raise SchemaError(f"{store.describe(key or info.path)}: a shard without data/index checksums (format 1.0) "
                              "cannot be re-packed; convert it again with this shardkit")
        return cls(store, key or info.path, info.count, capacity, info.nbytes, info.crc32c,
                   info.data_crc32c, info.index_crc32c, info.tail_crc32c)

    def info_at(self, key: str, start: int) -> ShardInfo:
        """Its :class:`ShardInfo` as global shard ``key`` starting at record ``start``."""
        return ShardInfo(key, start, start + self.count, self.nbytes, self.crc32c, self.data_crc32c, self.index_crc32c, self.tail_crc32c)


@dataclass(frozen=True)
class Segment:
    """Records a commit appends: ``records`` of them, stored in ``shards`` in order.

    ``fields`` loads their small fields (called once); ``labels`` are the class names their label
    fields index (mapped onto the dataset's, see :func:`merge_labels`); ``skipped`` follow the base's;
    ``table`` is the :class:`InputTable` their provenance numbers inputs in (``None``: no provenance).
    """

    records: int
    shards: tuple[StoredShard, ...]
    fields: Callable[[], Mapping[str, np.ndarray]]
    labels: Mapping[str, Sequence[str]] = field(default_factory=dict)
    skipped: tuple[SkippedInput, ...] = ()
    table: int | None = None

    def __post_init__(self) -> None:
        if sum(s.count for s in self.shards) != self.records:
            raise SchemaError(f"segment of {self.records} records stored in shards of {sum(s.count for s in self.shards)}")


@dataclass(frozen=True)
class InputTable:
    """Inputs some segments' records came from, by name relative to the corpus ``root`` (appended to the table)."""

    names: Sequence[str]
    root: str


@dataclass(frozen=True)
class ShardRecipe:
    """How global shard ``index`` of the new version is made: from ``pieces`` (``(file, first record,
    count)``), or ``in_place`` when a segment already wrote it under its final name, or ``link`` when
    one source file is exactly this shard."""

    index: int
    start: int
    stop: int
    pieces: tuple[tuple[StoredShard, int, int], ...]
    in_place: bool = False
    link: bool = False


@dataclass(frozen=True)
class CommitReport:
    """What a commit did: the new version's metadata and number, records added, new shards by how they
    were made and their payload bytes, files retired for older versions, wall time, and whether the
    root document already described this commit (a re-run after a kill: only cleanup ran).

    The linked shards are taken from the inputs unchanged; ``linked_by`` and ``bytes_linked_by`` say how
    their bytes got there (:func:`~shardkit.formats.transfer.copy_object`: ``link``, ``copy``,
    ``server``, ``transfer``; ``kept`` when an interrupted run had put them there)."""

    meta: DatasetMeta
    version: int
    records_added: int = 0
    shards_in_place: int = 0
    shards_linked: int = 0
    shards_repacked: int = 0
    bytes_linked: int = 0
    bytes_repacked: int = 0
    retired: int = 0
    seconds: float = 0.0
    already_committed: bool = False
    linked_by: Mapping[str, int] = field(default_factory=dict)
    bytes_linked_by: Mapping[str, int] = field(default_factory=dict)
    #: The dataset is in an object store (its new shards were uploaded or copied by the server).
    remote: bool = False

    @property
    def bytes_uploaded(self) -> int:
        """Payload bytes this commit sent to an object store: shards transferred, shards re-packed there."""
        return self.bytes_linked_by.get("transfer", 0) + (self.bytes_repacked if self.remote else 0)


def merge_labels(
    base: Mapping[str, Sequence[str]], incoming: Sequence[Mapping[str, Sequence[str]]]
) -> tuple[dict[str, list[str]], list[dict[str, np.ndarray]]]:
    """The dataset's label lists after appending segments, and how to map each segment's label values.

    Every name keeps its index; a name the dataset does not have yet is appended to its list, in the
    order the segments bring them. Returns ``(labels, remaps)``: ``remaps[i][field][v]`` is the new
    index of segment ``i``'s label value ``v`` (only fields whose indices change are listed).
    """
    labels = {k: list(v) for k, v in base.items()}
    remaps: list[dict[str, np.ndarray]] = []
    for names_by_field in incoming:
        remap: dict[str, np.ndarray] = {}
        for name, names in names_by_field.items():
            target = labels.setdefault(name, [])
            position = {n: i for i, n in enumerate(target)}
            lookup = np.empty(len(names), dtype=np.int64)
            for i, n in enumerate(names):
                if n not in position:
                    position[n] = len(target)
                    target.append(n)
                lookup[i] = position[n]
            if not np.array_equal(lookup, np.arange(len(names))):
                remap[name] = lookup
        remaps.append(remap)
    return labels, remaps


def _remapped(values: np.ndarray, lookup: np.ndarray) -> np.ndarray:
    """Label values mapped through ``lookup``; values outside it (``-1`` for "no box") are kept."""
    out = values.copy()
    valid = (values >= 0) & (values < lookup.shape[0])
    out[valid] = lookup[values[valid]].astype(values.dtype)
    return out


def plan_shards(
    base_records: int, base_last: StoredShard | None, segments: Sequence[Segment], records_per_shard: int, root: Store,
    payload: str, ndim: int,
) -> list[ShardRecipe]:
    """Recipes of every global shard from the base's last (not full) one, ``base_last``, to the end; reads nothing."""
    s = records_per_shard
    total = base_records + sum(seg.records for seg in segments)
    # Every stored file as (global start, file), in record order.
    runs: list[tuple[int, StoredShard]] = []
    if base_last is not None:
        runs.append(((base_records // s) * s, base_last))
    g = base_records
    for seg in segments:
        for shard in seg.shards:
            if shard.count:
                runs.append((g, shard))
                g += shard.count
    recipes = []
    r = 0
    for k in range(base_records // s, math.ceil(total / s)):
        lo, hi = k * s, min((k + 1) * s, total)
        pieces = []
        while r < len(runs) and runs[r][0] < hi:
            start, shard = runs[r]
            a, b = max(lo, start), min(hi, start + shard.count)
            if b > a:
                pieces.append((shard, a - start, b - a))
            if start + shard.count <= hi:
                r += 1
            else:
                break
        whole = (len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][0].count == hi - lo and pieces[0][0].capacity == s)
        key = chunk_key(payload, k, ndim)
        in_place = whole and pieces[0][0].store.url == root.url and pieces[0][0].key == key
        recipes.append(ShardRecipe(k, lo, hi, tuple(pieces), in_place=in_place, link=whole and not in_place))
    return recipes


def _stored_records(shard: StoredShard, first: int, count: int, record: FieldSpec, compressed: bool) -> tuple[bytes, list[int]]:
    """Records ``first .. first + count - 1`` of ``shard`` in stored form, after checking its size and checksums."""
    path = shard.store.describe(shard.key)
    try:
        if shard.store.is_local:
            with open(shard.store.local_path(shard.key), "rb") as fh:
                data = fh.read(shard.nbytes + 1)
        else:
            data = shard.store.get(shard.key, max_nbytes=shard.nbytes)
    except (FileNotFoundError, ObjectTooLargeError) as exc:
        raise TruncatedShardError(f"{path}: expected {shard.nbytes} bytes as recorded ({exc})") from None
    if len(data) != shard.nbytes:
        raise TruncatedShardError(f"{path}: expected {shard.nbytes} bytes as recorded, found {len(data)}")
    isize = index_nbytes(shard.capacity)
    data_n = shard.nbytes - isize
    idx = ShardIndex.decode(data[data_n:], shard.capacity, path=path, data_nbytes=data_n, recorded_crc32c=shard.index_crc32c)
    if crc32c_of(memoryview(data)[:data_n]) != shard.data_crc32c:
        raise ChecksumError(f"{path}: records crc32c differs from the {shard.data_crc32c:#010x} recorded")
    if int(idx.present[: shard.count].sum()) != shard.count:
        raise ChecksumError(f"{path}: index holds fewer than the {shard.count} records recorded")
    if not compressed:
        idx.check_dense(path, shard.count, record.nbytes)
        rn = record.nbytes
        return data[first * rn : (first + count) * rn], [rn] * count
    offs = idx.offsets[first : first + count].astype(np.int64)
    sizes = idx.nbytes[first : first + count].astype(np.int64)
    view = memoryview(data)
    blob = b"".join(view[o : o + n] for o, n in zip(offs.tolist(), sizes.tolist()))
    return blob, sizes.tolist()


def build_shard(store: Store, key: str, pieces: Sequence[tuple[StoredShard, int, int]], capacity: int, record: FieldSpec,
                compression: dict[str, Any] | None, durable: bool, start: int, stop: int) -> ShardInfo:
    """Re-pack records ``start .. stop - 1`` from their pieces into ``key`` of ``store`` (a task for any executor)."""
    codec = None if compression is None else codec_from_json(compression)
    with writing(store, key) as path:
        writer = ShardWriter(path, capacity, record, codec, durable=durable)
        try:
            for shard, first, count in pieces:
                data, sizes = _stored_records(shard, first, count, record, codec is not None)
                writer.append_stored(data, sizes)
            sums = writer.close()
        except BaseException:
            writer.abort()
            raise
    return ShardInfo(key, start, stop, sums.nbytes, sums.crc32c, sums.data_crc32c, sums.index_crc32c, sums.tail_crc32c)


def _done(value: ShardInfo) -> Future[ShardInfo]:
    future: Future[ShardInfo] = Future()
    future.set_result(value)
    return future


class _Commit:
    """One commit in progress (see :func:`commit`); each method is one idempotent step."""

    def __init__(self, store: Store, template: DatasetMeta, base: DatasetMeta | None, segments: Sequence[Segment],
                 durable: bool) -> None:
        self.store = store
        self.base = base
        self.segments = list(segments)
        self.durable = durable
        self.template = template
        self.s = template.records_per_shard
        self.n_base = base.num_records if base else 0
        self.total = self.n_base + sum(seg.records for seg in self.segments)
        self.number = (version_of(base.to_json()) + 1) if base else 1
        self.retired = 0
        #: Every record's provenance (the base's, then the segments', renumbered), for the change counts.
        self.provenance_values: list[np.ndarray] = []

    # ------------------------------------------------------------------ retiring old files
    def retire(self, rel: str, nbytes: int, crc: int, *, check_crc: bool) -> None:
        """Keep the base's ``rel`` (``nbytes``, ``crc``) as a retired copy before it is replaced."""
        store = self.store
        dst = retired_key(rel, nbytes, crc)
        if store.exists(dst):
            return
        try:
            size = store.head(rel).size
        except FileNotFoundError:
            size = -1
        same = size == nbytes and (not check_crc or crc32c_of(store.get(rel, max_nbytes=nbytes)) == crc)
        if not same:
            raise ConversionError(
                f"{store.describe(rel)}: expected the bytes version {self.number - 1} recorded ({nbytes} bytes, crc32c "
                f"{crc:#010x}) and found others, with no retired copy in {store.describe(VERSIONS_DIR)}; the dataset "
                "was changed outside shardkit"
            )
        with synced_now():  # durable before the original is replaced, whatever comes after
            copy_object(store, rel, store, dst, durable=self.durable)
        self.retired += 1

    def holds(self, key: str, src: StoredShard) -> bool:
        """``key`` is already ``src`` (linked by an interrupted earlier run): a hard link to it, or an
        object with its size and crc32c (one HEAD)."""
        if self.store.is_local:
            dst = self.store.local_path(key)
            return src.store.is_local and dst.is_file() and os.path.samefile(dst, src.store.local_path(src.key))
        return object_matches(self.store, key, src.nbytes, src.crc32c)

    # ------------------------------------------------------------------ steps
    def save_base_version(self) -> None:
        """The base's root document as version ``n - 1`` (a dataset written before versions existed)."""
        if self.base is None:
            return
        key = version_key(self.number - 1)
        if not self.store.exists(key):
            put_checked(self.store, key, self.store.get(ZARR_JSON, max_nbytes=MAX_DOCUMENT_NBYTES))

    def shards(self, report: dict[str, int], executor: Executor | None) -> list[ShardInfo]:
        """Every new global shard in place (built, possibly on ``executor``'s workers, linked, or already there)."""
        base = self.base
        ndim = 1 + len(self.template.record.shape)
        payload = self.template.payload
        base_last = None
        out: list[ShardInfo] = []
        if base is not None:
            out = list(base.shards[: self.n_base // self.s])
            if self.n_base % self.s:
                base_last = StoredShard.of(self.store, base.shards[-1], self.s)
        recipes = plan_shards(self.n_base, base_last, self.segments, self.s, self.store, payload, ndim)
        builds: dict[int, Future[ShardInfo]] = {}
        for recipe in recipes:
            key = chunk_key(payload, recipe.index, ndim)
            if recipe.in_place or recipe.link:
                continue
            pieces = recipe.pieces
            if base_last is not None and pieces and pieces[0][0] is base_last and base is not None:
                # The base's last shard is retired first and its records read back from the retired copy,
                # which holds them whether this run or an interrupted earlier one replaced the file.
                info = base.shards[-1]
                self.retire(info.path, info.nbytes, info.crc32c, check_crc=False)
                kept = StoredShard.of(self.store, info, self.s, key=retired_key(info.path, info.nbytes, info.crc32c))
                pieces = ((kept, *pieces[0][1:]), *pieces[1:])
            args = (self.store, key, pieces, self.s, self.template.record, self.template.compression, self.durable,
                    recipe.start, recipe.stop)
            builds[recipe.index] = executor.submit(build_shard, *args) if executor is not None else _done(build_shard(*args))
        for recipe in recipes:
            key = chunk_key(payload, recipe.index, ndim)
            if recipe.in_place:
                out.append(recipe.pieces[0][0].info_at(key, recipe.start))
                report["in_place"] += 1
            elif recipe.link:
                src = recipe.pieces[0][0]
                how = "kept"
                if not self.holds(key, src):
                    how = copy_object(src.store, src.key, self.store, key, durable=self.durable)
                out.append(src.info_at(key, recipe.start))
                report["linked"] += 1
                report["bytes_linked"] += src.nbytes
                report[f"linked:{how}"] = report.get(f"linked:{how}", 0) + 1
                report[f"bytes:{how}"] = report.get(f"bytes:{how}", 0) + src.nbytes
            else:
                info = builds[recipe.index].result()
                out.append(info)
                report["repacked"] += 1
                report["bytes_repacked"] += info.nbytes
        return out

    def fields(self, remaps: list[dict[str, np.ndarray]], chunk: int, offsets: Sequence[int]) -> dict[str, FileDigest]:
        """Every field array from its first chunk that changes (provenance inputs renumbered by ``offsets``); their digests."""
        base, t = self.base, self.template
        codec = get_codec(FIELD_CODEC)
        values = [seg.fields() for seg in self.segments]
        files: dict[str, FileDigest] = {}
        arrays: list[tuple[str, FieldSpec, np.ndarray, int, int]] = []
        for name, spec in t.fields.items():
            parts = []
            first = 0
            if base is not None and self.n_base:
                old_chunk = base.field_chunk_records
                first = self.n_base // chunk if old_chunk == chunk else 0
                start = 0 if name == PROVENANCE_FIELD else first * chunk
                old = read_field_rows(self.store, name, spec, self.n_base, old_chunk, base.files, start)
                if name == PROVENANCE_FIELD:
                    self.provenance_values.append(old)
                parts.append(old[first * chunk - start :])
                for rel, digest in base.files.items():
                    if rel.startswith(f"{name}/") and rel != f"{name}/{ZARR_JSON}":
                        j = int(rel[len(name) + 3 :].split("/", 1)[0])
                        if j < first:
                            files[rel] = digest
                        else:
                            self.retire(rel, digest.nbytes, digest.crc32c, check_crc=True)
                doc = base.files.get(f"{name}/{ZARR_JSON}")
                if doc is not None:
                    self.retire(f"{name}/{ZARR_JSON}", doc.nbytes, doc.crc32c, check_crc=True)
            for seg, seg_values, remap in zip(self.segments, values, remaps):
                v = spec.check(name, seg_values[name], seg_values[name].shape[0])
                if name == PROVENANCE_FIELD and seg.table is not None and offsets[seg.table]:
                    v = v.copy()
                    v[:, 0] += offsets[seg.table]  # the input's number: after the inputs already in the table
                if name == PROVENANCE_FIELD:
                    self.provenance_values.append(v)
                parts.append(_remapped(v, remap[name]) if name in remap else v)
            data = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            arrays.append((name, spec, data, chunk, first))
        return files | write_field_arrays(self.store, arrays, codec, durable=self.durable)

    def provenance(self, inputs: Sequence[InputTable], summarize: Callable[[np.ndarray], dict[str, Any]] | None,
                   ) -> dict[str, Any]:
        """The new version's provenance block: the base's inputs, then every table's (names outside the root whole)."""
        base, t = self.base, self.template
        old = Provenance.from_meta(base, where=self.store.describe(ZARR_JSON)) if base is not None else None
        root = old.root if old is not None else (inputs[0].root if inputs else "")
        names: list[str] = []
        if old is not None:
            names = old.names(self.store)
            for rel, digest in old.files.items():
                self.retire(rel, digest.nbytes, digest.crc32c, check_crc=True)
        for table in inputs:
            names += [_relative(table.root, root, n) for n in table.names]
        columns = tuple(str(c) for c in t.provenance["columns"])
        values = np.concatenate(self.provenance_values) if self.provenance_values else np.empty((0, len(columns)), "int64")
        spec = ProvenanceSpec(columns=columns, root=root, inputs=names, summarize=summarize)
        return write_provenance(self.store, spec, values, durable=self.durable)

    def payload_doc(self, meta: DatasetMeta) -> FileDigest:
        rel = f"{meta.payload}/{ZARR_JSON}"
        if self.base is not None and rel in self.base.files:
            doc = self.base.files[rel]
            self.retire(rel, doc.nbytes, doc.crc32c, check_crc=True)
        data = encode_json(payload_document(meta))
        put_checked(self.store, rel, data)
        return FileDigest.of(data)

    def save_version(self, meta: DatasetMeta) -> bytes:
        """The new version's root document, saved as its copy under ``.shardkit-versions``; returns it."""
        data = encode_json(group_metadata(meta))
        put_checked(self.store, version_key(self.number), data)
        return data

    def publish(self, data: bytes) -> None:
        """The new version's root document as ``zarr.json``: readers see the new version from here."""
        put_checked(self.store, ZARR_JSON, data)

    def drop_strays(self, shards: int) -> None:
        """Delete payload shard files past the last shard (left by an abandoned plan; no version lists them)."""
        prefix = f"{self.template.payload}/c"
        if self.store.is_local:
            top = self.store.local_path(prefix)
            for entry in list(top.iterdir()) if top.is_dir() else []:
                if entry.name.isdigit() and int(entry.name) >= shards:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            return
        for meta in list(self.store.list(prefix)):
            index = meta.key[len(prefix) + 1 :].split("/", 1)[0]
            if index.isdigit() and int(index) >= shards:
                self.store.delete(meta.key)


def _root_attrs(store: Store) -> dict[str, Any] | None:
    """The ``shardkit`` attributes of the root document, or ``None``."""
    doc = read_json_object(store, ZARR_JSON)
    attrs = doc.get("attributes", {}).get(ATTRS_KEY) if isinstance(doc.get("attributes"), dict) else None
    return attrs if isinstance(attrs, dict) else None


def claim_key(number: int) -> str:
    """Key of the claim on version ``number`` a commit to an object store holds while it writes it."""
    return f"{VERSIONS_DIR}/claim-v{number:06d}.json"


def _claim_version(store: Store, number: int, plan: str) -> None:
    """Claim version ``number`` of the object-store dataset for the commit ``plan`` before anything is
    written: the claim object is created only if absent (one conditional request, atomic on the server),
    so of two commits planned on one version exactly one gets it. A claim already held by ``plan`` (a
    re-run after a kill) is kept; one held by another plan is a ConversionError that changes nothing."""
    from shardkit.stores.objectstore import ObjectStore

    key = claim_key(number)
    if not isinstance(store, ObjectStore):
        return
    try:
        store.put_if_absent(key, encode_json({"plan": plan, "version": number}))
        return
    except ObjectChangedError:
        held = read_json_object(store, key).get("plan")
    if held != plan:
        raise ConversionError(
            f"{store.describe(key)}: another commit (plan {str(held)[:40]}) holds version {number} of this dataset; "
            "wait for it to finish, then run this command again. If that run was killed, re-run its command to "
            "finish it, or delete this object to abandon it. Nothing was changed"
        )


def _release_claim(store: Store, number: int, plan: str) -> None:
    """Delete the claim on version ``number`` if ``plan`` holds it (after its commit, or when refused)."""
    key = claim_key(number)
    if store.is_local or not store.exists(key):
        return
    if read_json_object(store, key).get("plan") == plan:
        store.delete(key)


def _committed(store: Store, plan: str) -> DatasetMeta | None:
    """The dataset's metadata if its root document already describes the commit ``plan``."""
    attrs = _root_attrs(store) if store.exists(ZARR_JSON) else None
    if attrs is None or not isinstance(attrs.get("source"), dict) or attrs["source"].get("plan") != plan:
        return None
    return DatasetMeta.from_json(attrs, where=store.describe(ZARR_JSON))


def commit(
    root: Location,
    template: DatasetMeta,
    segments: Sequence[Segment],
    *,
    base: DatasetMeta | None,
    plan: str,
    history: Mapping[str, Any],
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
    durable: bool = True,
    executor: Executor | None = None,
    inputs: Sequence[InputTable] = (),
    summarize: Callable[[np.ndarray], dict[str, Any]] | None = None,
) -> CommitReport:
    """Write the base's records followed by every segment's as the next version of the dataset at ``root``.

    ``template`` is the dataset's metadata (the base's own when there is one); ``base`` the version this
    commit was planned on (``None``: a new dataset), refused if another commit came first. ``plan`` is
    recorded as ``source.plan`` (a re-run after completion only cleans up); ``history`` is appended to
    ``source.history``. Shards to re-pack run on ``executor`` (its workers must see ``root`` and the
    segments' files) or here. With provenance, ``inputs`` (one table per :attr:`Segment.table`) extend
    the table and ``summarize`` counts its ``changes``.
    """
    t0 = time.perf_counter()
    store = open_store(root)
    if store.is_local:
        store.local_path().mkdir(parents=True, exist_ok=True)
    done = _committed(store, plan)
    if done is not None:
        _release_claim(store, version_of(done.to_json()), plan)  # a run killed between publishing and releasing
        prune(store, keep_versions)
        return CommitReport(done, version_of(done.to_json()), seconds=time.perf_counter() - t0, already_committed=True)
    number = version_of(base.to_json()) + 1 if base is not None else 1
    _claim_version(store, number, plan)  # an object store's only lock; checked again below, after it is held
    if base is not None:
        attrs = _root_attrs(store)
        current = version_of(attrs) if attrs is not None else 0
        if current != version_of(base.to_json()):
            _release_claim(store, number, plan)
            raise ConversionError(
                f"{root}: the dataset is at version {current}, but this commit was planned on version "
                f"{version_of(base.to_json())}; another commit came first. Re-run the command to plan it again"
            )
    job = _Commit(store, template, base, segments, durable)
    labels, remaps = merge_labels(template.labels, [seg.labels for seg in job.segments])
    job.save_base_version()
    report = {"in_place": 0, "linked": 0, "repacked": 0, "bytes_linked": 0, "bytes_repacked": 0}
    # Every file the root document will list is durable before it is published: their fsyncs wait
    # together at the end of this block instead of one after the other (each step rewrites its files,
    # so a re-run after a crash here writes them again).
    with synced_together():
        shards = job.shards(report, executor)
        skipped = (list(base.skipped) if base else []) + [s for seg in job.segments for s in seg.skipped]
        entry = {**history, "version": job.number, "records": [job.n_base, job.total]}
        old_history = _history_of(base) if base is not None else []
        source = {**template.source, "version": job.number, "plan": plan, "history": [*old_history, entry]}
        meta = template.with_(num_records=job.total, shards=shards, skipped=skipped, labels=labels, source=source,
                              format_minor=FORMAT_MINOR, field_chunk=_field_chunk(template, base))
        meta = meta.with_(field_chunk=meta.field_chunk_records)  # what a writer records: the chunk actually used
        offsets = _table_offsets(base, inputs)
        files = job.fields(remaps, meta.field_chunk_records, offsets)
        if PROVENANCE_FIELD in meta.fields and template.provenance:
            meta = meta.with_(provenance=job.provenance(inputs, summarize))
        files[f"{meta.payload}/{ZARR_JSON}"] = job.payload_doc(meta)
        meta = meta.with_(files=dict(sorted(files.items(), key=lambda kv: _file_order(kv[0], meta))))
        meta.check_layout(store.describe(ZARR_JSON))
        root_document = job.save_version(meta)
    job.publish(root_document)
    job.drop_strays(len(shards))
    _release_claim(store, job.number, plan)
    prune(store, keep_versions)
    result = CommitReport(
        meta, job.number, records_added=job.total - job.n_base, shards_in_place=report["in_place"],
        shards_linked=report["linked"], shards_repacked=report["repacked"], bytes_linked=report["bytes_linked"],
        bytes_repacked=report["bytes_repacked"], retired=job.retired, seconds=time.perf_counter() - t0,
        linked_by={k.split(":", 1)[1]: v for k, v in report.items() if k.startswith("linked:")},
        bytes_linked_by={k.split(":", 1)[1]: v for k, v in report.items() if k.startswith("bytes:")},
        remote=not store.is_local,
    )
    logger.info("%s: version %d committed (%d records added; shards: %d in place, %d linked, %d re-packed, %d bytes)",
                store.url, job.number, result.records_added, result.shards_in_place, result.shards_linked,
                result.shards_repacked, result.bytes_repacked)
    return result


def _history_of(base: DatasetMeta) -> list[Any]:
    """The base's ``source.history``; for a dataset written in one go, one entry describing it."""
    history = base.source.get("history")
    if isinstance(history, list):
        return history
    source = {k: v for k, v in base.source.items() if k not in ("version", "plan", "history")}
    entry = {"operation": "convert", "source": source, "version": version_of(base.to_json()), "records": [0, base.num_records]}
    if "config_fingerprint" in source:
        entry["config_fingerprint"] = source["config_fingerprint"]
    return [entry]


def _table_offsets(base: DatasetMeta | None, inputs: Sequence[InputTable]) -> list[int]:
    """Where each input table starts in the dataset's table: after the base's inputs and the tables before it."""
    count = 0
    if base is not None and base.provenance:
        inputs_block = base.provenance.get("inputs")
        count = int(inputs_block.get("count", 0)) if isinstance(inputs_block, dict) else 0
    return list(accumulate((len(table.names) for table in inputs[:-1]), initial=count)) if inputs else []


def _relative(table_root: str, root: str, name: str) -> str:
    """``name`` (relative to ``table_root``) as a name relative to ``root``: the same when the roots
    agree, relative when the input lies below ``root``, else its whole path."""
    if table_root == root:
        return name
    full = os.path.join(table_root, name)
    if root and full.startswith(root.rstrip("/") + "/"):
        return full[len(root.rstrip("/")) + 1 :]
    return full


def _field_chunk(template: DatasetMeta, base: DatasetMeta | None) -> int:
    """Records per field chunk to aim for: the base's, unless it was only capped by its size (a writer
    records ``min(requested, N)``; at N the default is assumed, as for a dataset written in one go)."""
    if base is not None and base.field_chunk < base.num_records:
        return base.field_chunk
    return field_chunk_for(template.fields, DEFAULT_FIELD_CHUNK)


def _file_order(rel: str, meta: DatasetMeta) -> tuple[int, str, int]:
    """The order a single writer lists ``files`` in: each field's chunks then its document, the payload document last."""
    names = list(meta.fields)
    head, _, rest = rel.partition("/")
    if head == meta.payload:
        return (len(names), head, 0)
    if rest == ZARR_JSON:
        return (names.index(head), head, 1 << 62)
    return (names.index(head), head, int(rest.split("/")[1]))
