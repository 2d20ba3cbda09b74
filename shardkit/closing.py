"""Objects that hold resources until ``close()``, and close them when a ``with`` block ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

__all__ = ["Closing"]


class Closing(ABC):
    """A context manager whose exit calls :meth:`close` (as files and ``zarr`` stores do).

    Datasets, mixtures and samplers hold mappings, threads, shared memory or a server connection;
    each says in its own ``close`` what it releases, and this base gives all of them the same ``with``
    behaviour: ``__enter__`` returns the object itself, ``__exit__`` closes it and lets any exception
    propagate.
    """

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
