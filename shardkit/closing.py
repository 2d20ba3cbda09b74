"""Objects that hold resources until ``close()``, and close them when a ``with`` block ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

__all__ = ["Closing"]


class Closing(ABC):
    """A context manager whose exit calls :meth:`close` (as files do): the ``with`` behaviour of
    datasets, mixtures and samplers; ``__enter__`` returns the object, exceptions propagate."""

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
