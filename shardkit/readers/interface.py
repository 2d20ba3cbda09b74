"""What every sampler offers its consumers: the :class:`Sampler` protocol (docs/design.md §2), the
only interface the adapters and the CLI rely on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardkit.tiers.stats import SamplerStats

__all__ = ["Batch", "ElementSpec", "Sampler"]

#: One batch: entry name -> array with a leading batch axis.
Batch = dict[str, np.ndarray]
#: Per-record ``(shape, dtype)`` of every batch entry.
ElementSpec = dict[str, tuple[tuple[int, ...], np.dtype[Any]]]


@runtime_checkable
class Sampler(Protocol):
    """The interface of every sampler: an iterable of batches, dicts of numpy arrays (the payload,
    every per-record field, ``"key"``) that the consumer may keep as long as it likes. A sampler
    that cannot resume raises :class:`~shardkit.errors.SamplerError` from the resume methods."""

    @property
    def path(self) -> Path | str:
        """The dataset: its directory, or its URL when it lives in an object store."""
        ...

    @property
    def num_records(self) -> int:
        """Records in the dataset (``N``)."""
        ...

    @property
    def batch_size(self) -> int:
        """Records per batch of this consumer (``B``)."""
        ...

    @property
    def payload_name(self) -> str:
        """The payload entry of every batch (``"image"`` or ``"audio"``)."""
        ...

    @property
    def stats(self) -> SamplerStats:
        """Counters of bytes, records and waiting time."""
        ...

    @property
    def epoch(self) -> int | None:
        """The epoch the sampler stands in (``None`` while a shared sampler has not started one)."""
        ...

    def __iter__(self) -> Iterator[Batch]:
        """Batches of the next epochs, from where the sampler stands."""
        ...

    def __len__(self) -> int:
        """Batches this consumer gets in one whole epoch."""
        ...

    def element_spec(self) -> ElementSpec:
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``)."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` on the next iteration."""
        ...

    def close(self) -> None:
        """Stop a running iteration and free its resources (idempotent)."""
        ...

    def __enter__(self) -> Sampler: ...

    def __exit__(self, *exc: object) -> None: ...
