"""Orders known *not* to be uniform, what real loaders do instead of a full shuffle: the battery
states its power against them (docs/design.md §15). Each returns storage positions in emitted order
and draws only from the generator it is given."""

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
