"""Readers: reservoir primitives, the schedule on keys, the tier stack and the tiered sampler.

``TieredSampler`` is the public entry point; see DESIGN §4 for the algorithm. ``TierServer`` /
``serve`` and ``SharedSampler`` share one tier stack between concurrent jobs
(:mod:`shardkit.readers.shared`).
"""

from shardkit.formats import DEFAULT_GAP_BYTES
from shardkit.readers.config import parse_capacity, parse_tiers
from shardkit.readers.reservoir import algorithm_l, algorithm_r, reservoir_keys, sample_of_sample
from shardkit.readers.sampler import TieredSampler
from shardkit.readers.schedule import ConsumerPlan, consumer_plan, epoch_permutation, epoch_stream
from shardkit.readers.shared import SharedSampler, TierServer, serve
from shardkit.readers.stats import SamplerStats

__all__ = [
    "DEFAULT_GAP_BYTES",
    "ConsumerPlan",
    "SamplerStats",
    "SharedSampler",
    "TierServer",
    "TieredSampler",
    "algorithm_l",
    "algorithm_r",
    "consumer_plan",
    "epoch_permutation",
    "epoch_stream",
    "parse_capacity",
    "parse_tiers",
    "reservoir_keys",
    "sample_of_sample",
    "serve",
]
