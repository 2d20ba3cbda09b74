"""``shardkit.merge``: :func:`shardkit.formats.merge.merge` with the change counts the converters know
(``provenance.changes`` recounted over every merged record by :func:`shardkit.converters.provenance.summarize`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.formats import DatasetMeta
from shardkit.formats.commit import CommitReport
from shardkit.formats.merge import merge as merge_datasets
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS
from shardkit.stores import Location

__all__ = ["merge"]


def _changes(meta: DatasetMeta, values: np.ndarray) -> dict[str, Any]:
    from shardkit.converters.provenance import summarize

    columns = [str(c) for c in meta.provenance.get("columns", [])]
    return summarize(meta.payload, meta.transform, columns, values)


def merge(
    inputs: Sequence[Location],
    out: Location,
    *,
    overwrite: bool = False,
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
) -> CommitReport:
    """One new dataset at ``out`` from the datasets ``inputs`` (one schema), their records in order
    (see :func:`shardkit.formats.merge.merge`)."""

    return merge_datasets(inputs, out, overwrite=overwrite, keep_versions=keep_versions, summarize=_changes)
