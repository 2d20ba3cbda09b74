"""``profile()``: run the phases (ingest-cold, ingest-warm, ssd, compute, both, check; docs/design.md
§15), derive the per-tier rates, predict, and optionally check the predictions."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardkit.errors import ConfigError
from shardkit.order.schedule import resolve_permutation
from shardkit.profiling.model import Prediction, Rates, Scenario, Workload, predict, with_options
from shardkit.profiling.phases import (
    PhaseResult,
    Step,
    copy_rate,
    cpu_parallelism,
    page_cache_capacity,
    populate_rate,
    progress,
    run_pipeline,
    run_steps,
    sleep_step,
    synthetic_batch,
)
from shardkit.profiling.whatif import Advice, advise, cache_curve, whatif_grid
from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.stores import Location, as_location
from shardkit.tiers.static_cache import region_allocated_first
from shardkit.units import human_bytes, parse_duration

__all__ = ["Check", "Profile", "profile", "default_checks", "bracket", "PROFILE_EPOCHS"]

#: Compute-phase steps at most (the step's rate settles quickly; a slow step must not dominate).
MAX_COMPUTE_STEPS = 50
#: Epochs per phase unless the options say otherwise: the first fills the static cache, the second is
#: the steady state.
PROFILE_EPOCHS = 2


@dataclass(frozen=True)
class Check:
    """A configuration run for real next to its prediction."""

    prediction: Prediction
    measured: PhaseResult
    #: The rates the prediction came from: the profile's, or measured again just before this run
    #: (``profile(recalibrate=True)``), so prediction and measurement see the machine's same load.
    rates: Rates | None = None

    @property
    def error(self) -> float:
        """Relative error of the predicted run time: ``(predicted - measured) / measured``."""
        m = self.measured.seconds
        return (self.prediction.seconds - m) / m if m > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    """Everything ``shardkit profile`` measured and predicted (see :mod:`shardkit.profiling.report`)."""

    path: str
    workload: Workload
    options: SamplerOptions
    step_name: str
    phases: dict[str, PhaseResult]
    rates: Rates
    measured: Prediction
    whatifs: tuple[Prediction, ...]
    curve: tuple[Prediction, ...]
    advice: Advice
    checks: tuple[Check, ...] = ()
    remote: bool = False


def default_checks(work: Workload, base: Scenario) -> list[Scenario]:
    """Three configurations unlike ``base``: no static cache, half the dataset pinned, all of it."""
    pool = base.options.tier_sizes(work.record_nbytes, work.num_records).pool_bytes
    half = (work.num_records // 2) * work.record_nbytes
    out = [
        with_options(base, "static_cache 0", static_cache=0),
        with_options(base, f"half cached ({human_bytes(half)})", ram_size=pool + half, static_cache=half),
        with_options(base, "all cached", ram_size=pool + 2 * work.dataset_bytes, static_cache="auto"),
    ]
    if base.options.static_cache == out[0].options.static_cache:
        quarter = (work.num_records // 4) * work.record_nbytes
        out[0] = with_options(base, f"quarter cached ({human_bytes(quarter)})", ram_size=pool + quarter,
                              static_cache=quarter)  # fmt: skip
    return out


def profile(
    path: Location,
    options: SamplerOptions | None = None,
    *,
    step: Step | None = None,
    step_time: float | str | None = None,
    cold: bool = True,
    check: bool | Sequence[Mapping[str, Any] | Scenario] = False,
    recalibrate: bool = False,
    progress_bars: bool = False,
    **overrides: Any,
) -> Profile:
    """Measure ``path``'s data stalls differentially and predict other configurations.

    Parameters
    ----------
    path
        Dataset directory or object-store URL.
    options, **overrides
        The job's sampler options; ``epochs`` defaults to :data:`PROFILE_EPOCHS` (2: the first epoch
        fills the static cache, the second is the steady state).
    step, step_time
        The training step: a callable taking a batch, or a duration the step sleeps (seconds or
        ``"20ms"``). Exactly one of them.
    cold
        Start the ``both`` and ``check`` runs with the dataset out of the page cache (local datasets).
    check
        ``True`` for :func:`default_checks`, or a list of configurations: option overrides (run like
        the profiled job) or :class:`Scenario` objects (e.g. ``cold_start=False``: page cache warm).
    recalibrate
        Measure the rates again (the ingest phases, the SSD probe, the step, the page mapping)
        between the checks, and predict each check (and the measured run) from the rates measured
        just before and just after it (:func:`bracket`): on a shared machine whose load drifts,
        prediction and measurement then see the same load.
    progress_bars
        A tqdm bar per phase.
    """
    if (step is None) == (step_time is None):
        raise ConfigError("profile: give exactly one of step (a function) and step_time (a duration such as 20ms)")
    if step is None:
        seconds = parse_duration(step_time if step_time is not None else 0, what="step_time")
        step, step_name = sleep_step(seconds), f"sleep {seconds * 1e3:g} ms"
    else:
        step_name = getattr(step, "__qualname__", repr(step))
    if options is None:
        overrides.setdefault("epochs", PROFILE_EPOCHS)
    opts = SamplerOptions.parse(**overrides) if options is None else options.replace(**overrides)
    if opts.epochs is None or opts.epochs < 1:
        raise ConfigError(f"{opts.name('epochs')}: profile runs a whole number of epochs (at least 1), found {opts.epochs}")
    location = as_location(path)
    remote = isinstance(location, str)
    probe = TieredSampler(location, opts)
    with probe:
        work = Workload(int(probe.num_records), int(probe.record_nbytes), opts.batch_size, opts.epochs,
                        mapped=probe.maps_whole_cache)
        spec, nbatches = probe.element_spec(), len(probe)
    phases: dict[str, PhaseResult] = {}
    plain = opts.replace(tiers="ram")
    plain_sizes = plain.tier_sizes(work.record_nbytes, work.num_records)
    first_block = plain_sizes.first_block
    bijection = resolve_permutation(plain.permutation, work.num_records) == "feistel"
    allocated = plain_sizes.static_records * work.record_nbytes if region_allocated_first(
        plain_sizes.static_records, work.num_records, shared=plain.node_sharing, bijection=bijection) else 0

    def phase(name: str, o: SamplerOptions, fn: Step | None, is_cold: bool) -> PhaseResult:
        epochs = o.epochs or 1
        with progress(progress_bars, name, nbatches * epochs) as bar:
            result = run_pipeline(name, location, o, fn, cold=is_cold, bar=bar)
        phases[name] = result
        return result

    run_step: Step = step

    def calibrate(suffix: str = "") -> Rates:
        """Measure the rates the model needs (``suffix``: a recalibration, its phases not kept)."""
        keep = dict(phases)
        phase("ingest-cold", plain.replace(epochs=1), None, True)
        phase("ingest-warm", plain, None, False)
        if "ssd" in opts.tiers or opts.ssd_dir is not None:
            ram = opts.ram_size.to_bytes(work.record_nbytes)
            ssd_opts = opts if "ssd" in opts.tiers else opts.replace(tiers="ram,ssd", ssd_size=max(4 * ram, ram))
            phase("ssd", ssd_opts.replace(epochs=1), None, False)
        count = min(MAX_COMPUTE_STEPS, nbatches * work.epochs)
        with progress(progress_bars, "compute" + suffix, count) as bar:
            step_s, step_cpu = run_steps(run_step, synthetic_batch(spec, opts.batch_size), count, bar)
        out = derive_rates(work, phases, step_s, step_cpu, remote=remote, fill_bps=populate_rate(),
                           parallel=cpu_parallelism(_cores()), first_block=first_block, allocated=allocated)
        if suffix:
            phases.clear()
            phases.update(keep)
        return out

    rates = calibrate()
    base = Scenario("measured", opts, cold_start=cold and not remote)
    phase("both", opts, step, base.cold_start)
    measured_rates = rates
    checks: list[Check] = []
    if check:
        scenarios = (
            default_checks(work, base)
            if check is True
            else [c if isinstance(c, Scenario) else
                  replace(base, label=", ".join(f"{k}={v}" for k, v in c.items()), options=opts.replace(**c))
                  for c in check]
        )  # fmt: skip
        before = rates
        runs: list[tuple[Scenario, PhaseResult, Rates]] = []
        for i, sc in enumerate(scenarios):
            if recalibrate:
                after = calibrate(f" ({sc.label})")
                if i == 0:
                    measured_rates = bracket(rates, after)  # "both" ran between the two
                before = after
            runs.append((sc, phase(f"check: {sc.label}", sc.options, step, sc.cold_start), before))
        if recalibrate and runs:  # each check ran between its calibration and the next one
            ends = [r for _, _, r in runs[1:]] + [calibrate(" (last)")]
            runs = [(sc, ph, bracket(r, end)) for (sc, ph, r), end in zip(runs, ends)]
        checks = [Check(predict(work, r, sc), ph, r) for sc, ph, r in runs]
    return Profile(
        str(location), work, opts, step_name, phases, rates, predict(work, measured_rates, base),
        tuple(whatif_grid(work, rates, base)), tuple(cache_curve(work, rates, base)), advise(work, rates, base),
        tuple(checks), remote,
    )  # fmt: skip


def derive_rates(work: Workload, phases: Mapping[str, PhaseResult], step_s: float, step_cpu: float,
                 *, remote: bool, fill_bps: float | None = None, parallel: float | None = None,
                 first_block: int = 0, allocated: int = 0) -> Rates:  # fmt: skip
    """The model's rates from the phases: bytes over seconds per tier, seconds per batch.

    Storage is the cold epoch's bytes over its wall time after the first batch (never less than the
    reader's busy time), and ``warm_bps`` a warm epoch's: an epoch
    waits for everything its reads wait for (the device, other processes for the cores), which the
    reader's busy time leaves out, so a cold first epoch predicted from busy time came out short.
    ``start_s`` is the warm phase's wait for its first batch less its first block's read
    (``first_block`` records at the warm rate) and the ``allocated`` bytes of a static cache region
    allocated before it (at ``fill_bps``): what starting a sampler costs besides those, which the
    model charges per configuration.
    """
    cold, warm = phases["ingest-cold"], phases["ingest-warm"]
    copy_bps = copy_rate(work.record_nbytes, work.batch_size)
    # Up to its first batch the cold phase also pays the process's first sampler (threads, first
    # use of the code): not the device's, and on a small dataset most of the epoch.
    cold_disk = cold.busy.get("disk", 0.0)
    storage = (_bps(cold.storage_bytes, max(cold.seconds - cold.first_batch_seconds, cold_disk))
               or _bps(warm.storage_bytes, warm.busy.get("disk", 0.0)))  # fmt: skip
    # Page-cache reads are CPU copies: their CPU time is their cost (the wall time of the unthrottled
    # ingest phase also counts waiting for a core the assembler and the consumer loop hold).
    warm_cpu = warm.busy.get("disk_cpu", 0.0) or warm.busy.get("disk", 0.0)
    page = copy_bps if remote else (_bps(warm.storage_bytes, warm_cpu) or storage)
    if not storage or not page:
        raise ConfigError(f"{phases['ingest-cold'].name}: the dataset delivered no bytes to time (is it empty?)")
    batches = max(1, warm.batches)
    assembly = max(0.0, warm.busy.get("assembly", 0.0) - warm.cache_bytes / copy_bps) / batches
    # The warm phase's last epoch (the first may fill the static cache): its reads on the clock.
    warm_wall = None
    if not remote and len(warm.epoch_seconds) > 1 and len(warm.epoch_storage_bytes) == len(warm.epoch_seconds):
        warm_wall = _bps(warm.epoch_storage_bytes[-1], warm.epoch_seconds[-1]) or None
    ssd_w = ssd_r = None
    if "ssd" in phases:
        s = phases["ssd"]
        # What writing took beyond reading: the probe reads warm files, on the clock like the model's
        # warm reads (less only their CPU would leave the reads' waits in the write rate, counted twice).
        fill = s.busy.get("ssd_fill", 0.0) - s.ssd_written / (warm_wall or page)
        ssd_w = _bps(s.ssd_written, max(fill, 1e-6))
        ssd_r = _bps(s.ssd_bytes, s.busy.get("ssd", 0.0))
    cores = _cores()
    region = allocated / fill_bps if fill_bps else 0.0
    start = max(0.0, warm.first_batch_seconds - first_block * work.record_nbytes / (warm_wall or page) - region)
    return Rates(storage, page, copy_bps, assembly, warm.busy.get("handover", 0.0) / batches, step_s, step_cpu,
                 ssd_w, ssd_r, cores, 0 if remote else page_cache_capacity(), warm_wall, fill_bps,
                 parallel, start)  # fmt: skip


def bracket(before: Rates, after: Rates) -> Rates:
    """The rates over a run measured just before and just after it: the mean time per byte (or per
    batch) of the two, so a load that changed during the run counts half each way."""

    def per_byte(a: float | None, b: float | None) -> float | None:
        if a is None or b is None or a <= 0 or b <= 0:
            return a if b is None else b if a is None else max(a, b)
        return 2 / (1 / a + 1 / b)

    def mean(a: float, b: float) -> float:
        return (a + b) / 2

    def rate(name: str) -> float | None:
        return per_byte(getattr(before, name), getattr(after, name))

    return replace(
        before, storage_bps=rate("storage_bps") or before.storage_bps,
        page_cache_bps=rate("page_cache_bps") or before.page_cache_bps, copy_bps=rate("copy_bps") or before.copy_bps,
        ssd_write_bps=rate("ssd_write_bps"), ssd_read_bps=rate("ssd_read_bps"), warm_bps=rate("warm_bps"),
        fill_bps=rate("fill_bps"), assembly_s=mean(before.assembly_s, after.assembly_s),
        handover_s=mean(before.handover_s, after.handover_s), step_s=mean(before.step_s, after.step_s),
        step_cpu_s=mean(before.step_cpu_s, after.step_cpu_s),
        page_cache_bytes=min(before.page_cache_bytes, after.page_cache_bytes),
        parallel=None if before.parallel is None or after.parallel is None else mean(before.parallel, after.parallel),
        start_s=mean(before.start_s, after.start_s),
    )  # fmt: skip


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _bps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if nbytes > 0 and seconds > 0 else 0.0
