"""shardkit: shard files of fixed-size records, read in an exactly uniform random order with only
sequential storage access.

``import shardkit`` never imports torch or tensorflow; the adapters in ``shardkit.adapters`` do so
lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

from shardkit import errors  # noqa: E402
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, open_dataset, verify  # noqa: E402
from shardkit.converters import convert  # noqa: E402

__all__ = [
    "__version__",
    "errors",
    "Dataset",
    "DatasetWriter",
    "FieldSpec",
    "open_dataset",
    "verify",
    "convert",
]
