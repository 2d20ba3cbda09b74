"""``shardkit.merge``: :func:`shardkit.formats.merge.merge` with the change counts the converters know.

The merged dataset's ``provenance.changes`` (images upscaled, clips trimmed, ...) is counted again over
every merged record's provenance, by the same function a conversion uses
(:func:`shardkit.converters.provenance.summarize`), so it equals what converting the corpora in one
go, or appending them, records.
"""

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
    """One new dataset at ``out`` from the datasets ``inputs`` (one schema), their records in order.

    See :func:`shardkit.formats.merge.merge`: aligned shards are hard-linked or copied server-side,
    the others re-packed; label names are extended; provenance tables are concatenated.
    """
    return merge_datasets(inputs, out, overwrite=overwrite, keep_versions=keep_versions, summarize=_changes)
