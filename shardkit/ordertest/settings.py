"""The battery's options and their defaults, importing nothing heavy: the CLI shows them in ``--help``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings", "DEFAULTS"]


@dataclass(frozen=True)
class Settings:
    """Options of one battery run, each as the parameter of :func:`shardkit.ordertest.run` of the same
    name (validated there)."""

    alpha: float = 1e-3
    power: float = 0.8
    seed: int = 0
    bins: int = 16
    batch_size: int | None = None
    null_draws: int = 500
    compute_power: bool = True
    effect: float = 0.1


#: Every default of the battery: :func:`~shardkit.ordertest.run`, the mixture run and the CLI read them here.
DEFAULTS = Settings()
