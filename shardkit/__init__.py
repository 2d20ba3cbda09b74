"""shardkit: shard files of fixed-size records, read in an exactly uniform random order with only
sequential storage access.

``import shardkit`` never imports torch or tensorflow; the adapters in ``shardkit.adapters`` do so
lazily. Converting, merging and writing (:mod:`shardkit.converters`) are imported on first use too, so a
process that only reads (a spawned DataLoader worker) does not import the conversion engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkit import errors
from shardkit._version import __version__
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, open_dataset, publish, verify

if TYPE_CHECKING:
    from shardkit.converters import convert
    from shardkit.converters.merging import merge
    from shardkit.converters.write import write
    from shardkit.readers.sources import Mixture, mix
    from shardkit.viz import export, show

__all__ = [
    "__version__",
    "errors",
    "Dataset",
    "DatasetWriter",
    "FieldSpec",
    "open_dataset",
    "verify",
    "publish",
    "convert",
    "merge",
    "show",
    "export",
    "mix",
    "Mixture",
    "write",
]


def __getattr__(name: str) -> Any:
    # show / export live in shardkit.viz, which needs the readers' seed domains: imported on first
    # use, so `import shardkit` stays as light as before.
    if name in ("show", "export"):
        import shardkit.viz

        return getattr(shardkit.viz, name)
    if name == "convert":
        import shardkit.converters

        return shardkit.converters.convert
    if name == "merge":
        import shardkit.converters.merging

        return shardkit.converters.merging.merge
    if name in ("mix", "Mixture"):
        # Mixtures are a sampler source (shardkit.readers), imported on first use like show / export.
        import shardkit.readers.sources

        return getattr(shardkit.readers.sources, name)
    if name == "write":
        import shardkit.converters.write

        return shardkit.converters.write.write
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
