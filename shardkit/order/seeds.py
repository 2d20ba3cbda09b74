"""Random-number domains: every random use draws from a stream no other use can ever share
(docs/design.md §4, randomness domains). A new random use gets a new :class:`Domain` member.
"""

from __future__ import annotations

import enum
import operator

# Imported with the package, not on a sampler's first draw: numpy loads ``numpy.random`` lazily, and
# its first use cost tens of milliseconds (more under load) of a fresh sampler's first epoch.
from numpy.random import PCG64, Generator, SeedSequence

from shardkit.errors import ConfigError

__all__ = ["Domain", "rng", "seed_words", "check_seed"]

#: First word of every encoded seed ("shardkit" in a 32-bit tag): no other seeding scheme in this
#: package produces it, so a stream from :func:`rng` cannot coincide with a hand-seeded one.
_TAG = 0x5348_4B54
_LIMIT = 1 << 64


class Domain(enum.IntEnum):
    """One member per random use in shardkit (values are part of the stream: never renumber)."""

    #: The epoch order pi: ``(seed, epoch)``.
    EPOCH_ORDER = 1
    #: Independent reservoirs in ``replacement`` mode: ``(seed, epoch)``.
    REPLACEMENT = 2
    #: The static cache's pinned subset: ``(seed,)``.
    STATIC_CACHE = 3
    #: A shared tier stack's epoch partition into reservoirs: ``(server seed, epoch)``.
    SERVER_PARTITION = 4
    #: A job's permutation inside one shared reservoir: ``(job seed, epoch, reservoir)``.
    JOB_PERMUTATION = 5
    #: The keys each node pins in its local tiers: ``(seed, nodes)``.
    NODE_PARTITION = 6
    #: A mixture's draws: ``(seed, part, dataset, walk)`` for a walk's head, tail and middle, ``(seed,
    #: part, epoch)`` for an epoch's slot arrangement (parts in :mod:`shardkit.order.mixture`).
    MIXTURE = 7
    #: Statistical order tests' simulated nulls: ``(seed, test)``.
    ORDER_TEST = 8
    #: The records ``shardkit show`` / ``export`` pick with ``--random N --seed S``: ``(seed,)``.
    RECORD_SAMPLE = 9
    #: Round keys of the on-demand epoch order (a Feistel bijection): ``(seed, epoch)``.
    EPOCH_BIJECTION = 10
    #: Round keys of the static cache's pinned set when it is drawn by a bijection: ``(seed,)``.
    STATIC_CACHE_BIJECTION = 11


def check_seed(seed: object, *, what: str = "seed") -> int:
    """A seed as a Python int in ``[0, 2**64)``; ``ConfigError`` naming ``what`` otherwise."""
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or not 0 <= value < _LIMIT:
        raise ConfigError(f"{what}: expected an integer in [0, 2**64), found {seed!r}")
    return value



def seed_words(domain: Domain, *values: int) -> list[int]:
    """The unambiguous 32-bit word list for ``(domain, values)`` (docs/design.md §4, randomness domains)."""
    words = [_TAG, int(domain), len(values)]
    for i, v in enumerate(values):
        x = check_seed(v, what=f"{domain.name.lower()} value {i}")
        words += [x & 0xFFFF_FFFF, x >> 32]
    return words


def rng(domain: Domain, *values: int) -> Generator:
    """A PCG64 generator for ``(domain, values)``, independent of every other domain and value list."""
    return Generator(PCG64(SeedSequence(seed_words(domain, *values))))
