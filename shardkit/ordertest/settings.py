"""The battery's options and their defaults, in a module that imports nothing heavy.

``shardkit order-test`` shows these defaults in its ``--help``, so the CLI reads them at start-up;
the battery itself (SciPy) is imported only when a test runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings", "DEFAULTS"]


@dataclass(frozen=True)
class Settings:
    """Options of one battery run (validated by :func:`shardkit.ordertest.run`).

    Attributes
    ----------
    alpha
        Significance level of every verdict.
    power
        Power the ``epochs_needed`` figures aim for.
    seed
        Seed of the simulated null and the reference alternatives.
    bins
        At most this many item and position bins.
    batch_size
        The loader's batch size (the labels-per-batch test needs it).
    null_draws
        Epochs drawn for the labels test's simulated null.
    compute_power
        Whether to compute the power figures.
    effect
        Size of the reference alternatives, as a fraction of N.
    """

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
