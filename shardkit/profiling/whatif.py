"""What-if questions for the cost model: :func:`whatif_grid` lists the configurations ``shardkit
profile`` predicts; :func:`advise` names the bottleneck and the cheapest fix (docs/design.md §15)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from shardkit.errors import ConfigError
from shardkit.profiling.model import Prediction, Rates, Scenario, Workload, predict, with_options
from shardkit.units import human_bytes

__all__ = ["STALL_TARGET", "Advice", "whatif_grid", "advise", "cache_curve"]

#: A stall below this fraction of the epoch counts as removed.
STALL_TARGET = 0.05
#: RAM budgets tried, as fractions of the dataset's payload.
RAM_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25)
WORKERS = (2, 4, 8)
BANDWIDTH_FACTORS = (0.5, 2.0, 4.0, 10.0)


@dataclass(frozen=True)
class Advice:
    """The bottleneck of the measured configuration's steady-state epoch and the cheapest change
    that removes its stall (``stall_fraction`` is that epoch's)."""

    bottleneck: str
    stall_fraction: float
    change: str | None
    prediction: Prediction | None

    def sentence(self) -> str:
        if self.stall_fraction < STALL_TARGET:
            return (
                f"the training step is the bottleneck ({self.bottleneck}); the data pipeline keeps up "
                f"(predicted steady-state stall {self.stall_fraction:.1%}), so more RAM, SSD or bandwidth buys nothing"
            )
        if self.change is None or self.prediction is None:
            return f"bottleneck: {self.bottleneck} (predicted stall {self.stall_fraction:.1%}); no change tried removes the stall"
        return (
            f"bottleneck: {self.bottleneck} (predicted steady-state stall {self.stall_fraction:.1%}); cheapest fix: "
            f"{self.change} (predicted stall {self.prediction.stall_fraction:.1%}, "
            f"run {self.prediction.seconds:.2f} s)"
        )


def _try(work: Workload, rates: Rates, scenario: Scenario) -> Prediction | None:
    try:
        return predict(work, rates, scenario)
    except ConfigError:
        return None  # e.g. a budget too small for this record size, or the SSD tier not measured


def ram_scenarios(work: Workload, base: Scenario, fractions: tuple[float, ...] = RAM_FRACTIONS) -> Iterator[Scenario]:
    """``base`` with ``ram_size`` at fractions of the dataset (plus the batch buffers), cache auto."""
    sizes = base.options.tier_sizes(work.record_nbytes, work.num_records)
    for f in fractions:
        ram = int(work.dataset_bytes * f) + sizes.pool_bytes
        yield with_options(base, f"ram_size {human_bytes(ram)}", ram_size=ram, static_cache="auto")


def whatif_grid(work: Workload, rates: Rates, base: Scenario) -> list[Prediction]:
    """Predictions for the configurations around ``base`` (those the model cannot size are left out)."""
    scenarios: list[Scenario] = [base, *ram_scenarios(work, base)]
    for f in (0.0, 0.25, 0.5):
        cache = int(work.dataset_bytes * f)
        scenarios.append(with_options(base, f"static_cache {human_bytes(cache)}", static_cache=cache))
    if rates.ssd_write_bps is not None:
        ram = base.options.ram_size.to_bytes(work.record_nbytes)
        for mult in (2, 8):
            scenarios.append(with_options(base, f"ssd tier {human_bytes(ram * mult)}", tiers="ram,ssd",
                                          ssd_size=ram * mult))  # fmt: skip
    for w in WORKERS:
        scenarios.append(replace(base, label=f"{w} workers", workers=w))
    for f in BANDWIDTH_FACTORS:
        bw = rates.storage_bps * f
        scenarios.append(replace(base, label=f"storage {human_bytes(bw)}/s", storage_bps=bw))
    return [p for p in (_try(work, rates, s) for s in scenarios) if p is not None]


def cache_curve(work: Workload, rates: Rates, base: Scenario, points: int = 21) -> list[Prediction]:
    """Predictions with ``ram_size`` from almost nothing to the whole dataset (the plot's x axis)."""
    fractions = tuple(i / (points - 1) * 1.1 for i in range(points))
    return [p for p in (_try(work, rates, s) for s in ram_scenarios(work, base, fractions)) if p is not None]


def advise(work: Workload, rates: Rates, base: Scenario) -> Advice:
    """The bottleneck of ``base`` and the first change (cheapest first) that removes its stall, judged
    on the steady-state epoch (the first epoch's cold reads are paid once whatever the configuration)."""
    steady = predict(work, rates, base).steady
    if steady.stall_fraction < STALL_TARGET:
        return Advice(steady.bottleneck, steady.stall_fraction, None, None)
    candidates: list[tuple[str, Scenario]] = []
    for w in WORKERS:
        if w <= rates.cores:
            candidates.append((f"{w} DataLoader workers (idle cores)", replace(base, label=f"{w} workers", workers=w)))
    for s in ram_scenarios(work, base):
        ram = s.options.ram_size.to_bytes(work.record_nbytes)
        if ram <= rates.page_cache_bytes or rates.page_cache_bytes == 0:
            candidates.append((f"--ram-size {human_bytes(ram)} (memory the machine has free)", s))
    if rates.ssd_write_bps is not None:
        ram = base.options.ram_size.to_bytes(work.record_nbytes)
        candidates.append((f"--tiers ram,ssd --ssd-size {human_bytes(8 * ram)}",
                           with_options(base, "ssd", tiers="ram,ssd", ssd_size=8 * ram)))  # fmt: skip
    for f in BANDWIDTH_FACTORS[1:]:
        bw = rates.storage_bps * f
        candidates.append((f"storage at {human_bytes(bw)}/s ({f:g}x today's)", replace(base, label="bw", storage_bps=bw)))
    for change, scenario in candidates:
        p = _try(work, rates, scenario)
        if p is not None and p.steady.stall_fraction < STALL_TARGET:
            return Advice(steady.bottleneck, steady.stall_fraction, change, p)
    return Advice(steady.bottleneck, steady.stall_fraction, None, None)
