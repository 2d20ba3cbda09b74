"""shardkit: shard files of fixed-size records, read in an exactly uniform random order with only
sequential storage access.

``import shardkit`` never imports torch or tensorflow; the adapters in ``shardkit.adapters`` do so
lazily.
"""

from __future__ import annotations

from shardkit import errors
from shardkit._version import __version__
from shardkit.converters import convert
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.readers.sources import Mixture, mix

__all__ = [
    "__version__",
    "errors",
    "Dataset",
    "DatasetWriter",
    "FieldSpec",
    "open_dataset",
    "verify",
    "convert",
    "mix",
    "Mixture",
]
