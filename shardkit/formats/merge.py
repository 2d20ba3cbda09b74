"""``merge``: one dataset from several datasets of the same schema, with the commit of appends (docs/design.md §11).

The inputs become the segments of one commit into a new dataset: records in input order, label names
extended, skips concatenated; shards on the output's grid are linked, the others re-packed. Merging A
and B gives exactly what appending B's corpus to A's dataset would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardkit.errors import ConversionError
from shardkit.formats.commit import CommitReport, InputTable, Segment, StoredShard, commit
from shardkit.formats.dataset import Dataset
from shardkit.formats.fields import read_field_rows
from shardkit.formats.metadata import DEFAULT_FIELD_CHUNK, DatasetMeta, read_dataset_meta
from shardkit.formats.outputs import PARTS_DIR, clear_store, refuse_overlap, top_names
from shardkit.formats.provenance import Provenance
from shardkit.formats.spec import ZARR_JSON
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS, version_of
from shardkit.stores import Location, as_location, open_store

__all__ = ["merge", "check_same_schema"]

logger = logging.getLogger(__name__)


def check_same_schema(first: DatasetMeta, other: DatasetMeta, where: str) -> None:
    """ConversionError naming the first difference (kind, payload, record, fields, transform,
    compression, kind metadata) that forbids putting ``other``'s records after ``first``'s."""
    for what, a, b in [
        ("kind", first.kind, other.kind),
        ("payload", first.payload, other.payload),
        ("record shape", first.record.shape, other.record.shape),
        ("record dtype", first.record.dtype, other.record.dtype),
        ("fields", {k: v.to_json() for k, v in first.fields.items()}, {k: v.to_json() for k, v in other.fields.items()}),
        ("transform", first.transform, other.transform),
        ("compression", first.compression, other.compression),
        ("kind metadata (extra)", first.extra, other.extra),
    ]:
        if a != b:
            text = [json.dumps(x, sort_keys=True) if isinstance(x, dict) else repr(x) for x in (b, a)]
            raise ConversionError(f"{where}: its {what} {text[0][:200]} differs from the first dataset's {text[1][:200]}; "
                                  "only datasets of one schema can be merged. Nothing was written")


def _segment(ds: Dataset, table: int | None) -> Segment:
    """A dataset's records as a segment of the commit (fields loaded when the commit asks)."""
    shards = tuple(StoredShard.of(ds.store, info, ds.meta.records_per_shard) for info in ds.meta.shards)

    def fields() -> dict[str, np.ndarray]:
        m = ds.meta
        return {name: read_field_rows(ds.store, name, spec, m.num_records, m.field_chunk_records, m.files)
                for name, spec in m.fields.items()}

    return Segment(ds.num_records, shards, fields, ds.meta.labels, tuple(ds.meta.skipped), table)


def _input_table(ds: Dataset) -> InputTable:
    """The names of a dataset's inputs (its provenance table; none without provenance)."""
    prov = Provenance.from_meta(ds.meta, where=str(ds.path))
    return InputTable([], "") if prov is None else InputTable(prov.names(ds.store), prov.root)


def merge(
    inputs: Sequence[Location],
    out: Location,
    *,
    overwrite: bool = False,
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
    summarize: Callable[[DatasetMeta, np.ndarray], dict[str, Any]] | None = None,
) -> CommitReport:
    """Write the records of every dataset in ``inputs``, in order, as one new dataset at ``out``.

    ``inputs`` are at least one dataset (directory or URL), all of one schema; ``out`` is absent or
    empty (a merge of the same inputs there is left alone), or a shardkit dataset to replace with
    ``overwrite``; ``keep_versions`` is as for a conversion; ``summarize(meta, values)`` counts what
    conversion changed over the merged provenance (``provenance.changes``; none without it).

    Returns the :class:`CommitReport`. Raises ConversionError for datasets of different schemas,
    an ``out`` that holds something else, or one that overlaps an input (refused before anything
    is deleted, :func:`~shardkit.formats.outputs.refuse_overlap`).
    """
    if not inputs:
        raise ConversionError("merge: give at least one dataset")
    refuse_overlap(inputs, out, "merge")
    store = open_store(as_location(out, resolve=True))
    opened = [Dataset(as_location(p, resolve=True)) for p in inputs]
    try:
        first = opened[0].meta
        for ds in opened[1:]:
            check_same_schema(first, ds.meta, str(ds.path))
        identity = [{"path": str(ds.path), "crc": ds.meta.to_json().get("attributes_crc32c"), "records": ds.num_records} for ds in opened]
        plan = "merge-" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        if store.exists(ZARR_JSON) and not overwrite:
            done = read_dataset_meta(store)
            if done.source.get("plan") == plan:
                logger.info("%s: already the merge of these datasets", store.url)
                return CommitReport(done, version_of(done.to_json()), already_committed=True)
            raise ConversionError(f"{store.url}: a dataset already exists here; use --overwrite to replace it")
        if overwrite:
            clear_store(store)
        elif top_names(store, (PARTS_DIR,)):
            raise ConversionError(f"{store.url}: output is not empty; choose another directory or prefix")
        tables = [_input_table(ds) for ds in opened]
        segments = [_segment(ds, i if ds.meta.provenance else None) for i, ds in enumerate(opened)]
        template = first.with_(
            num_records=0, labels={}, field_chunk=DEFAULT_FIELD_CHUNK,
            source={"merged": [{**i, "kind": ds.meta.kind, "version": version_of(ds.meta.to_json())}
                               for i, ds in zip(identity, opened)]},
        )
        history = {"operation": "merge", "inputs": [i["path"] for i in identity]}
        count = None if summarize is None else functools.partial(summarize, first)
        report = commit(store, template, segments, base=None, plan=plan, history=history, keep_versions=keep_versions,
                        inputs=tables, summarize=count)
    finally:
        for ds in opened:
            ds.close()
    logger.info("%s: merged %d datasets, %d records: %d shards linked, %d re-packed (%d bytes)", store.url, len(opened),
                report.meta.num_records, report.shards_linked, report.shards_repacked, report.bytes_repacked)
    return report
