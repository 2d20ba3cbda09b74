"""Orders known *not* to be uniform: what real loaders do instead of a full shuffle.

The battery states its power against these (how many epochs each test needs to reject them with 80%
probability), and the tests of the tool feed them in to check that each is rejected by the test
designed for it. Every function returns storage positions ``0..n-1`` in emitted order and draws only
from the generator it is given.

* :func:`buffer_shuffle`: sequential reads through a shuffle buffer (WebDataset ``.shuffle``,
  ``tf.data`` ``shuffle``): storage neighbours come out close together and early records come out early.
* :func:`block_shuffle`: whole blocks (shards, chunks) in random order, records shuffled inside each
  (LitData's chunk shuffle, MosaicML's block shuffles at small blocks): every single item's position is
  nearly uniform, but storage neighbours are emitted together.
* :func:`interleave`: shards read sequentially and interleaved round robin (``tf.data`` ``interleave``).
* :func:`repeated_block_orders`: a block shuffle whose block order is drawn once and repeats every
  epoch (WebDataset's shard order, seeded once per dataset object): consecutive epochs are dependent.
"""

from __future__ import annotations

import numpy as np

__all__ = ["buffer_shuffle", "block_shuffle", "interleave", "repeated_block_orders"]


def buffer_shuffle(rng: np.random.Generator, n: int, buffer: int) -> np.ndarray:
    """Read ``0..n-1`` in order through a buffer of ``buffer`` records, emitting a uniform buffer member
    each time the buffer is full, then the rest in random order."""
    out = np.empty(n, dtype=np.int64)
    picks = rng.integers(0, max(buffer, 1), size=n).tolist()
    buf: list[int] = []
    i = 0
    for key in range(n):
        buf.append(key)
        if len(buf) >= buffer:
            j = picks[key]  # uniform over the full buffer; swap-remove keeps the choice uniform
            buf[j], buf[-1] = buf[-1], buf[j]
            out[i] = buf.pop()
            i += 1
    rest = np.asarray(buf, dtype=np.int64)
    out[i:] = rest[rng.permutation(rest.size)]
    return out


def _blocks(n: int, block: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) // max(block, 1)


def block_shuffle(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    """Blocks of ``block`` consecutive storage positions in random order, each shuffled inside."""
    blocks = _blocks(n, block)
    rank = rng.permutation(int(blocks[-1]) + 1)[blocks] if n else blocks
    return np.lexsort((rng.random(n), rank)).astype(np.int64)


def interleave(rng: np.random.Generator, n: int, shards: int) -> np.ndarray:
    """``shards`` contiguous shards in random order, read sequentially and interleaved round robin."""
    shard = np.arange(n, dtype=np.int64) * shards // max(n, 1)
    start = np.searchsorted(shard, np.arange(shards))
    within = np.arange(n) - start[shard]
    rank = rng.permutation(shards)[shard]
    return np.lexsort((rank, within)).astype(np.int64)


def repeated_block_orders(rng: np.random.Generator, n: int, block: int, epochs: int) -> np.ndarray:
    """``[epochs, n]``: one block order drawn once, records re-shuffled inside blocks every epoch."""
    blocks = _blocks(n, block)
    rank = rng.permutation(int(blocks[-1]) + 1)[blocks] if n else blocks
    return np.stack([np.lexsort((rng.random(n), rank)) for _ in range(epochs)]).astype(np.int64)
