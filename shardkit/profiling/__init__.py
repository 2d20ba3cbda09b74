"""``shardkit profile``: measure data stalls differentially and predict what more RAM, SSD, cache,
workers or bandwidth would buy (DS-Analyzer's method applied to the tiered sampler).

:func:`profile` runs the phases (:mod:`~shardkit.profiling.phases`) and returns a :class:`Profile`;
:mod:`~shardkit.profiling.model` holds the arithmetic, :mod:`~shardkit.profiling.whatif` the
configurations it is asked about and the advice, :mod:`~shardkit.profiling.report` the table, the
JSON and the plot.
"""

from shardkit.profiling.model import (
    EpochPrediction,
    Prediction,
    Rates,
    Scenario,
    Workload,
    page_cache_hit,
    predict,
    read_amplification,
)
from shardkit.profiling.phases import PhaseResult, Step, load_step, sleep_step
from shardkit.profiling.profiler import Check, Profile, default_checks, profile
from shardkit.profiling.report import plot, report_lines, to_json
from shardkit.profiling.whatif import Advice, advise, whatif_grid

__all__ = [
    "Advice",
    "Check",
    "EpochPrediction",
    "PhaseResult",
    "Prediction",
    "Profile",
    "Rates",
    "Scenario",
    "Step",
    "Workload",
    "advise",
    "default_checks",
    "load_step",
    "page_cache_hit",
    "plot",
    "predict",
    "profile",
    "read_amplification",
    "report_lines",
    "sleep_step",
    "to_json",
    "whatif_grid",
]
