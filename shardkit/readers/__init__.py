"""Readers: the tiered sampler (``TieredSampler``, configured by one ``SamplerOptions``), its sources,
and the ``Sampler`` protocol the adapters rely on (docs/design.md §4); ``TierServer``, ``serve`` and
``SharedSampler`` (:mod:`shardkit.serve`) share one tier stack between jobs.

The serving side is imported on first use (:func:`__getattr__`): a DataLoader worker that only reads
imports no server, socket protocol or ring. ``TieredSampler`` is too, so that the tier engine (which
imports this package's options and sources) can be imported first without an import cycle.
"""

from typing import TYPE_CHECKING, Any

from shardkit.formats import DEFAULT_GAP_BYTES
from shardkit.order.reservoir import algorithm_l, algorithm_r, reservoir_keys, sample_of_sample
from shardkit.order.schedule import (
    ConsumerPlan,
    EpochShare,
    batches_per_consumer,
    consumer_plan,
    epoch_permutation,
    epoch_share,
    epoch_stream,
    pass_length,
    records_per_consumer,
)
from shardkit.readers.identity import DatasetIdentity
from shardkit.readers.interface import Sampler
from shardkit.readers.options import DEFAULTS, SamplerOptions, TierSizes, parse_tiers
from shardkit.readers.sources import Mixture, mix
from shardkit.tiers.stats import SamplerStats

if TYPE_CHECKING:
    from shardkit.readers.sampler import TieredSampler
    from shardkit.serve import SharedSampler, TierServer, serve

__all__ = [
    "DEFAULT_GAP_BYTES",
    "DEFAULTS",
    "ConsumerPlan",
    "DatasetIdentity",
    "Mixture",
    "EpochShare",
    "Sampler",
    "SamplerOptions",
    "SamplerStats",
    "SharedSampler",
    "TierServer",
    "TierSizes",
    "TieredSampler",
    "algorithm_l",
    "algorithm_r",
    "batches_per_consumer",
    "consumer_plan",
    "epoch_permutation",
    "epoch_share",
    "epoch_stream",
    "mix",
    "pass_length",
    "parse_tiers",
    "records_per_consumer",
    "reservoir_keys",
    "sample_of_sample",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name == "TieredSampler":
        from shardkit.readers.sampler import TieredSampler

        return TieredSampler
    if name in ("SharedSampler", "TierServer", "serve"):
        import shardkit.serve

        return getattr(shardkit.serve, name)
    raise AttributeError(f"module 'shardkit.readers' has no attribute {name!r}")
