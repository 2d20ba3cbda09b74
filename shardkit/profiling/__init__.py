"""``shardkit profile``: measure data stalls differentially and predict what more RAM, SSD, cache,
workers or bandwidth would buy (docs/design.md §15)."""

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
