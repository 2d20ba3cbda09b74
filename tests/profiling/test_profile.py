"""``shardkit profile``: the model's arithmetic against hand-computed cases, the stage timers, and the
phases end to end on tiny datasets (local and in an object store, CLI and Python). No timing
assertions: the machine is shared; tests check what was measured is consistent, not how fast."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import ConfigError
from shardkit.profiling import (
    PhaseResult,
    Rates,
    Scenario,
    Workload,
    load_step,
    page_cache_hit,
    predict,
    profile,
    read_amplification,
    report_lines,
)
from shardkit.profiling.profiler import bracket, derive_rates
from shardkit.profiling.whatif import advise
from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.tiers.static_cache import region_allocated_first
from tests.helpers.cli import run_main
from tests.helpers.profiling import check_profile
from tests.helpers.sampler_data import make_dataset

REC = 1000  # bytes of a record in the model cases


def _rates(**kw: Any) -> Rates:
    base: dict[str, Any] = dict(storage_bps=1e6, page_cache_bps=1e7, copy_bps=1e8, assembly_s=0.0, handover_s=0.0,
                                step_s=0.01, step_cpu_s=0.0, cores=4, page_cache_bytes=0)  # fmt: skip
    base.update(kw)
    return Rates(**base)


def _run(args: list[str]) -> int:
    return run_main(*args)


# ------------------------------------------------------------------ model arithmetic
def test_read_amplification_hand_computed() -> None:
    # gaps smaller than a record are never read
    assert read_amplification(0.1, 500, REC) == 1.0
    # G = 1: a gap of exactly one record is read, with probability d(1-d): 1 + 1 * 0.5 * 0.5
    assert read_amplification(0.5, 1000, REC) == pytest.approx(1.25)
    # G = 2, d = 0.5: 1 + 1*0.25 + 2*0.125 = 1.5
    assert read_amplification(0.5, 2000, REC) == pytest.approx(1.5)
    assert read_amplification(1.0, 10_000, REC) == 1.0  # everything wanted: no gaps
    with pytest.raises(ConfigError):
        read_amplification(0.0, 1000, REC)


def test_page_cache_hit() -> None:
    assert page_cache_hit(50, 200) == 0.25
    assert page_cache_hit(500, 200) == 1.0
    assert page_cache_hit(-1, 200) == 0.0


def test_predict_without_cache_hand_computed() -> None:
    # 1000 records of 1000 B, batches of 100, blocks of 100 records; no static cache; cold storage 1 MB/s
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(ram_size=100 * REC * 5, static_cache=0, batch_size=100, gap_bytes=0)
    p = predict(work, _rates(), Scenario("x", opts))
    e0, e1 = p.epochs
    assert e0.storage_bytes == e1.storage_bytes == 1_000_000
    # page cache 0: both epochs read 1 MB cold = 1 s; compute 10 batches x 10 ms = 0.1 s
    assert e1.stages["storage"] == pytest.approx(1.0)
    assert e1.stages["compute"] == pytest.approx(0.1)
    assert e1.seconds == pytest.approx(1.0)
    assert e1.stall_seconds == pytest.approx(0.9)
    assert e1.bottleneck == "storage"
    first = p.sizes.first_block * REC / 1e6  # the first block is read before the first batch
    assert e0.seconds == pytest.approx(1.0 + first)
    assert p.seconds == pytest.approx(2.0 + first)


def test_predict_static_cache_and_page_cache_hand_computed() -> None:
    work = Workload(1000, REC, 100, epochs=2)
    # half the dataset pinned, page cache holds half the dataset (after the sampler's own RAM)
    opts = SamplerOptions(ram_size=2 * 1000 * REC, static_cache=500 * REC, batch_size=100, gap_bytes=0)
    ram = opts.tier_sizes(REC, 1000).ram_bytes
    rates = _rates(page_cache_bytes=ram + 500 * REC)
    p = predict(work, rates, Scenario("x", opts, cold_start=True))
    assert p.sizes.static_records == 500
    e0, e1 = p.epochs
    # epoch 0 (cold): all 1000 records from storage, 1 s; later: 500 records, half of them page-cache hits
    assert e0.stages["storage"] == pytest.approx(1.0)
    assert e1.storage_bytes == pytest.approx(500 * REC)
    assert e1.stages["storage"] == pytest.approx(250 * REC / 1e6)
    assert e1.stages["page cache"] == pytest.approx(250 * REC / 1e7)
    # the assembler copies the 500 cached records at 1e8 B/s
    assert e1.stages["assembly"] == pytest.approx(500 * REC / 1e8)
    assert e1.seconds == pytest.approx(0.25 + 0.025)  # one reader thread: storage + page cache
    # a warm start: epoch 0's reads hit the page cache like the later ones
    warm = predict(work, rates, Scenario("x", opts, cold_start=False))
    assert warm.epochs[0].stages["storage"] == pytest.approx(0.5)


def test_predict_cold_first_epoch_maps_the_static_cache_and_reads_warm_at_the_clock_rate() -> None:
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(ram_size=2 * 1000 * REC, static_cache=500 * REC, batch_size=100, gap_bytes=0,
                          node_sharing=False)  # a private cache: its pages are mapped beside the reads
    ram = opts.tier_sizes(REC, 1000).ram_bytes
    plain = _rates(page_cache_bytes=ram + 1000 * REC)  # the whole dataset fits the page cache
    rates = _rates(page_cache_bytes=ram + 1000 * REC, warm_bps=2e6, fill_bps=1e6)
    before, after = predict(work, plain, Scenario("x", opts)), predict(work, rates, Scenario("x", opts))
    e0, e1 = after.epochs
    # epoch 0 (cold): 1 MB from storage at 1 MB/s; mapping the 500 pinned records' pages at 1 MB/s
    # (0.5 s) runs on the cache's own thread beside the reads, so the device's 1 s is the epoch
    assert e0.seconds - e0.startup_seconds == pytest.approx(1.0)
    # mapping slower than the reads (2 s at 250 kB/s): the reader and the cache's thread share it,
    # (1 + 2) / 2 s on two cores, 1 + 2 s on one; its CPU counts with the epoch's CPU
    slow = predict(work, replace(rates, fill_bps=2.5e5), Scenario("x", opts)).epochs[0]
    assert slow.seconds - slow.startup_seconds == pytest.approx(1.5)
    one = predict(work, replace(rates, fill_bps=2.5e5, cores=1), Scenario("x", opts)).epochs[0]
    assert one.seconds - one.startup_seconds == pytest.approx(3.0)
    assert one.stages["cpu"] - predict(work, replace(plain, cores=1), Scenario("x", opts)).epochs[0].stages["cpu"] == (
        pytest.approx(2.0))
    assert before.epochs[0].seconds - before.epochs[0].startup_seconds == pytest.approx(1.0)
    # epoch 1: the 500 uncached records hit the page cache, read at the warm epoch's 2 MB/s (not the
    # CPU's 10 MB/s); no pages left to map
    assert e1.stages["page cache"] == pytest.approx(500 * REC / 2e6)
    assert e1.seconds == pytest.approx(0.25)
    assert before.epochs[1].stages["page cache"] == pytest.approx(500 * REC / 1e7)
    assert before.epochs[1].seconds == pytest.approx(0.1)  # compute-bound: 10 steps of 10 ms
    # a warm start maps the pages too, but reads everything at the warm rate
    warm = predict(work, rates, Scenario("x", opts, cold_start=False)).epochs[0]
    assert warm.seconds - warm.startup_seconds == pytest.approx(max(1000 * REC / 2e6, (1000 * REC / 2e6 + 0.5) / 2))


def test_predict_a_mapped_whole_dataset_cache_has_no_pages_to_fill() -> None:
    # A static cache of the whole local dataset is its mapped shard files: the first epoch reads
    # them once and maps no memory of its own; a partial cache (or one of a dataset that cannot be
    # mapped) still pays its pages.
    work = Workload(1000, REC, 100, epochs=2)
    whole = SamplerOptions(ram_size=4 * 1000 * REC, static_cache=1000 * REC, batch_size=100, gap_bytes=0,
                          node_sharing=False)  # a private cache: its pages are mapped beside the reads
    half = whole.replace(static_cache=500 * REC)
    ram = whole.tier_sizes(REC, 1000).ram_bytes
    rates = _rates(page_cache_bytes=ram + 1000 * REC, warm_bps=2e6, fill_bps=2.5e5, cores=1)
    mapped = replace(work, mapped=True)
    e0 = predict(mapped, rates, Scenario("x", whole)).epochs[0]
    assert e0.seconds - e0.startup_seconds == pytest.approx(1.0)  # 1 MB from storage at 1 MB/s, nothing to map
    copied = predict(work, rates, Scenario("x", whole)).epochs[0]
    assert copied.seconds - copied.startup_seconds == pytest.approx(1.0 + 4.0)  # 1 MB of pages at 250 kB/s on one core
    assert e0.stages["cpu"] == pytest.approx(copied.stages["cpu"] - 4.0)
    part = predict(mapped, rates, Scenario("x", half)).epochs[0]
    assert part.seconds - part.startup_seconds == pytest.approx(1.0 + 2.0)


def test_predict_a_node_shared_partial_cache_allocates_its_region_before_the_first_batch() -> None:
    # A node-shared cache of half the dataset is held as its sorted keys and reserves its whole region
    # before the first batch: 0.5 MB at 250 kB/s is 2 s of start, in series, with no pages left to
    # map during the epoch. A private cache (or the whole dataset) maps its pages beside the reads.
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(ram_size=2 * 1000 * REC, static_cache=500 * REC, batch_size=100, gap_bytes=0)
    assert opts.node_sharing and region_allocated_first(500, 1000, shared=True)
    assert not region_allocated_first(500, 1000, shared=False) and not region_allocated_first(1000, 1000, shared=True)
    assert not region_allocated_first(500, 1000, shared=True, bijection=True)
    rates = _rates(page_cache_bytes=0, warm_bps=2e6, fill_bps=2.5e5, cores=2)
    shared = predict(work, rates, Scenario("x", opts)).epochs[0]
    private = predict(work, rates, Scenario("x", opts.replace(node_sharing=False))).epochs[0]
    plain = predict(work, replace(rates, fill_bps=None), Scenario("x", opts)).epochs[0]
    assert shared.startup_seconds - plain.startup_seconds == pytest.approx(2.0)
    assert shared.seconds - shared.startup_seconds == pytest.approx(plain.seconds - plain.startup_seconds)
    assert private.startup_seconds == pytest.approx(plain.startup_seconds)
    assert private.seconds - private.startup_seconds == pytest.approx((1.0 + 2.0) / 2)  # reads and mapping, 2 threads
    # the profiled job's own region is part of its first batch's wait, not of the sampler's start
    warm = _phase("ingest-warm", 0.75, (0.5, 0.25), (1_000_000, 500_000), 0.2, first=0.5)
    phases = {"ingest-cold": _phase("ingest-cold", 2.0, (2.0,), (1_000_000,), 0.5, first=0.5), "ingest-warm": warm}
    got = derive_rates(work, phases, 0.01, 0.0, remote=False, fill_bps=1e6, first_block=100, allocated=400_000)
    assert got.start_s == pytest.approx(0.5 - 100 * REC / 2e6 - 0.4)


def test_predict_threads_that_run_at_once_bound_the_overlap() -> None:
    # Two cores, but other processes keep them busy: the process's threads run 1.5 at a time, so the
    # reader and the cache's mapping thread overlap less, and the epoch's CPU spreads over 1.5 threads.
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(ram_size=2 * 1000 * REC, static_cache=500 * REC, batch_size=100, gap_bytes=0,
                          node_sharing=False)  # a private cache: its pages are mapped beside the reads
    ram = opts.tier_sizes(REC, 1000).ram_bytes
    rates = _rates(page_cache_bytes=ram + 1000 * REC, warm_bps=2e6, fill_bps=2.5e5, cores=2)
    idle = predict(work, rates, Scenario("x", opts)).epochs[0]
    busy = predict(work, replace(rates, parallel=1.5), Scenario("x", opts)).epochs[0]
    # reads 1 s, mapping 2 s: (1 + 2) / 2 on idle cores, (1 + 2) / 1.5 with 1.5 threads at once
    assert idle.seconds - idle.startup_seconds == pytest.approx(1.5)
    assert busy.seconds - busy.startup_seconds == pytest.approx(2.0)
    assert busy.stages["cpu"] == pytest.approx(idle.stages["cpu"] * 2 / 1.5)
    # never fewer than one thread, never more than the cores
    assert replace(rates, parallel=0.3).threads_at_once == 1.0 and replace(rates, parallel=5.0).threads_at_once == 2.0
    assert rates.threads_at_once == 2


def _phase(name: str, seconds: float, epochs: tuple[float, ...], nbytes: tuple[int, ...], disk_busy: float,
           first: float = 0.0) -> PhaseResult:  # fmt: skip
    return PhaseResult(name, seconds, 1000 * len(epochs), 10 * len(epochs), epochs, 0.0, first,
                       {"disk": disk_busy, "disk_cpu": disk_busy / 2, "assembly": 0.0, "handover": 0.0},
                       sum(nbytes), epoch_storage_bytes=nbytes, epoch_storage_calls=(1,) * len(nbytes))  # fmt: skip


def test_rates_come_from_the_epochs_wall_time() -> None:
    work = Workload(1000, REC, 100, epochs=2)
    phases = {
        # the cold epoch read 1 MB in 2 s, 0.5 s of them to its first batch (the process's first
        # sampler), its reader busy only 0.5 s (it waited for a core)
        "ingest-cold": _phase("ingest-cold", 2.0, (2.0,), (1_000_000,), 0.5, first=0.5),
        # warm: the first epoch filled the cache; the second read 0.5 MB in 0.25 s
        "ingest-warm": _phase("ingest-warm", 0.75, (0.5, 0.25), (1_000_000, 500_000), 0.2),
    }
    rates = derive_rates(work, phases, 0.01, 0.0, remote=False, fill_bps=3e6)
    assert rates.storage_bps == pytest.approx(1e6 / 1.5)  # not the busy time's 2 MB/s
    assert rates.warm_bps == pytest.approx(2e6)
    assert rates.page_cache_bps == pytest.approx(1.5e6 / 0.1)  # the CPU's cost of a warm read
    assert rates.fill_bps == 3e6
    # a dataset read by its first batch: the busy time is all there is to go by
    phases["ingest-cold"] = _phase("ingest-cold", 2.0, (2.0,), (1_000_000,), 0.5, first=1.9)
    assert derive_rates(work, phases, 0.01, 0.0, remote=False).storage_bps == pytest.approx(2e6)
    # an object store: no page cache, so no warm rate
    assert derive_rates(work, phases, 0.01, 0.0, remote=True).warm_bps is None
    # the SSD probe (warm files) read 1 MB and wrote it in 1 s of the creator's time: reads on the
    # clock at the warm 2 MB/s took 0.5 s of it, so writing 1 MB took the other 0.5 s
    phases["ssd"] = PhaseResult("ssd", 1.2, 1000, 10, (1.2,), 0.0, 0.0, {"ssd_fill": 1.0, "ssd": 0.25},
                                1_000_000, 1, ssd_bytes=1_000_000, ssd_written=1_000_000)  # fmt: skip
    ssd = derive_rates(work, phases, 0.01, 0.0, remote=False)
    assert ssd.ssd_write_bps == pytest.approx(2e6) and ssd.ssd_read_bps == pytest.approx(4e6)


def test_a_fresh_samplers_start_is_paid_once_before_the_first_epoch() -> None:
    # The warm phase waited 0.1 s for its first batch, of which its first block (100 records of 1 kB at
    # the warm epoch's 2 MB/s) took 0.05 s: starting a sampler costs the other 0.05 s. The model
    # charges it before the first epoch's first batch, cold or warm, and never again.
    work = Workload(1000, REC, 100, epochs=2)
    warm = _phase("ingest-warm", 0.75, (0.5, 0.25), (1_000_000, 500_000), 0.2, first=0.1)
    phases = {"ingest-cold": _phase("ingest-cold", 2.0, (2.0,), (1_000_000,), 0.5, first=0.5), "ingest-warm": warm}
    rates = derive_rates(work, phases, 0.01, 0.0, remote=False, first_block=100)
    assert rates.start_s == pytest.approx(0.1 - 100 * REC / 2e6)
    opts = SamplerOptions(ram_size=100 * REC * 5, static_cache=0, batch_size=100, gap_bytes=0)
    for cold in (True, False):
        sc = Scenario("x", opts, cold_start=cold)
        without, with_start = predict(work, replace(rates, start_s=0.0), sc), predict(work, rates, sc)
        assert with_start.epochs[0].seconds - without.epochs[0].seconds == pytest.approx(0.05)
        assert with_start.epochs[0].startup_seconds - without.epochs[0].startup_seconds == pytest.approx(0.05)
        assert with_start.epochs[1].seconds == pytest.approx(without.epochs[1].seconds)
    # a first batch quicker than its block's read (e.g. a pipeline started early) costs nothing extra
    phases["ingest-warm"] = replace(warm, first_batch_seconds=0.01)
    assert derive_rates(work, phases, 0.01, 0.0, remote=False, first_block=100).start_s == 0.0
    assert bracket(replace(rates, start_s=0.02), replace(rates, start_s=0.06)).start_s == pytest.approx(0.04)


def test_bracket_averages_time_per_byte_of_the_rates_before_and_after() -> None:
    before = _rates(storage_bps=1e6, step_s=0.01, parallel=1.0, fill_bps=None, page_cache_bytes=10)
    after = _rates(storage_bps=3e6, step_s=0.03, parallel=2.0, fill_bps=4e6, page_cache_bytes=5)
    both = bracket(before, after)
    # 1 MB takes 1 s before and 1/3 s after: 2/3 s on average, 1.5 MB/s (not the mean rate's 2 MB/s)
    assert both.storage_bps == pytest.approx(1.5e6)
    assert both.step_s == pytest.approx(0.02) and both.parallel == pytest.approx(1.5)
    assert both.fill_bps == 4e6 and both.page_cache_bytes == 5  # one side unmeasured; the smaller page cache


def test_predict_compute_bound_workers_and_bandwidth() -> None:
    work = Workload(1000, REC, 100, epochs=1)
    opts = SamplerOptions(ram_size=100 * REC * 5, static_cache=0, batch_size=100, gap_bytes=0)
    slow_step = _rates(step_s=1.0)
    p = predict(work, slow_step, Scenario("x", opts, cold_start=False, page_cache_bytes=10**9))
    assert p.steady.bottleneck == "compute" and p.steady.stall_seconds == pytest.approx(p.steady.startup_seconds)
    # two workers: each consumer has 500 records, 5 batches; storage bandwidth shared (cold)
    base = Scenario("x", opts)
    one, two = predict(work, _rates(), base), predict(work, _rates(), Scenario("x", opts, workers=2))
    assert two.steady.stages["compute"] == pytest.approx(one.steady.stages["compute"] / 2)
    assert two.steady.stages["storage"] == pytest.approx(one.steady.stages["storage"])
    fast = predict(work, _rates(), Scenario("x", opts, storage_bps=4e6))
    assert fast.steady.stages["storage"] == pytest.approx(one.steady.stages["storage"] / 4)
    with pytest.raises(ConfigError, match="SSD"):
        predict(work, _rates(), Scenario("x", opts.replace(tiers="ram,ssd", ssd_size=10**6)))


def test_predict_ssd_tier_hand_computed() -> None:
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(tiers="ram,ssd", ram_size=100 * REC * 5, ssd_size=1000 * REC, static_cache=0,
                          batch_size=100, gap_bytes=0)  # fmt: skip
    rates = _rates(storage_bps=1e7, ssd_write_bps=2e6, ssd_read_bps=4e6)
    e1 = predict(work, rates, Scenario("x", opts)).steady
    # creator: read 1 MB at 10 MB/s + write it at 2 MB/s = 0.6 s; reader: 1 MB at 4 MB/s = 0.25 s
    assert e1.stages["ssd"] == pytest.approx(0.5)
    assert e1.seconds == pytest.approx(0.6)


def test_advice_names_bottleneck_and_fix() -> None:
    work = Workload(1000, REC, 100, epochs=2)
    opts = SamplerOptions(ram_size=100 * REC * 5, static_cache=0, batch_size=100, gap_bytes=0)
    adv = advise(work, _rates(), Scenario("x", opts))  # no page cache: every epoch reads storage
    assert adv.bottleneck == "storage" and adv.stall_fraction > 0.5
    assert adv.change is not None and "ram-size" in adv.change  # the cache removes steady-state reads
    fast = advise(work, _rates(step_s=10.0), Scenario("x", opts))
    assert fast.change is None and "keeps up" in fast.sentence()


# ------------------------------------------------------------------ instrumentation
def test_stage_timers_count_each_tier(tmp_path: Path, ssd_dir: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 40)
    with TieredSampler(ds, batch_size=4, ram_size="12records", static_cache=0, epochs=1) as s:
        batches = list(s)
    busy = s.stats.busy_seconds
    assert set(busy) == {"disk", "disk_cpu", "assembly", "handover"} and all(v >= 0 for v in busy.values())
    assert busy["disk"] > 0 and busy["assembly"] > 0
    assert s.stats.first_batch_seconds is not None and 0 < s.stats.first_batch_seconds <= s.stats.elapsed
    assert len(batches) == 10
    with TieredSampler(ds, tiers="ram,ssd", batch_size=4, ram_size="12records", ssd_size="24records",
                       ssd_dir=ssd_dir, static_cache=0, epochs=1) as s2:  # fmt: skip
        list(s2)
    assert {"ssd_fill", "ssd", "assembly"} <= set(s2.stats.busy_seconds)


# ------------------------------------------------------------------ phases end to end


def test_profile_python_api_with_step_function_and_checks(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 60, records_per_shard=7)
    seen: list[int] = []

    def step(batch: dict[str, np.ndarray]) -> None:
        seen.append(int(batch["key"].shape[0]))

    prof = profile(ds, step=step, batch_size=8, ram_size="40records", check=True)
    check_profile(prof, 60, 2)
    assert prof.rates.fill_bps and prof.rates.fill_bps > 0  # the first touch of the static cache, measured
    assert sum(seen) >= 60 * 2  # compute phase (synthetic) + both + checks
    assert len(prof.checks) == 3
    fractions = {round(c.prediction.cache_fraction, 2) for c in prof.checks}
    assert len(fractions) == 3 and 1.0 in fractions and 0.0 in fractions
    for c in prof.checks:
        assert c.measured.records == 60 * 2 and math.isfinite(c.error)
    assert "check" in "\n".join(report_lines(prof))
    with pytest.raises(ConfigError, match="exactly one"):
        profile(ds, batch_size=8)


def test_profile_recalibrates_each_check_and_runs_warm_checks(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 40)
    opts = SamplerOptions.parse(batch_size=4, ram_size="12records", epochs=2)
    warm = Scenario("static_cache 0, warm", opts.replace(static_cache=0), cold_start=False)
    prof = profile(ds, opts, step_time="1ms", check=[{"static_cache": 0}, warm], recalibrate=True)
    assert [c.prediction.scenario.cold_start for c in prof.checks] == [True, False]
    for c in prof.checks:
        # each check predicted from rates measured just before and after it, not the profile's
        assert c.rates is not None and c.rates is not prof.rates and c.prediction.epochs[0].storage_bytes > 0
        assert 1.0 <= (c.rates.parallel or 0) <= c.rates.cores
    assert set(prof.phases) == {"ingest-cold", "ingest-warm", "both", "check: static_cache=0", "check: static_cache 0, warm"}
    plain = profile(ds, opts, step_time="1ms", check=[{"static_cache": 0}])
    assert plain.checks[0].rates is plain.rates


def test_profile_ssd_probe(tmp_path: Path, ssd_dir: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 40)
    prof = profile(ds, step_time="1ms", batch_size=4, ram_size="12records", ssd_dir=ssd_dir, epochs=1)
    assert "ssd" in prof.phases and prof.rates.ssd_write_bps and prof.rates.ssd_read_bps
    assert any(p.scenario.label.startswith("ssd tier") for p in prof.whatifs)


def test_profile_cli_report_json_plot_and_step(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pytest.importorskip("matplotlib")
    ds = make_dataset(tmp_path / "ds", 30)
    png = tmp_path / "p.png"
    assert _run(["profile", str(ds), "--step-ms", "1", "--batch-size", "4", "--ram-size", "12records",
                 "--plot", str(png), "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert "ingest-cold" in out.out and "advice" in out.out and png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "mystep.py").write_text("def step(batch):\n    assert 'image' in batch\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert _run(["profile", str(ds), "--step", "mystep:step", "--batch-size", "4", "--json", "--epochs", "1",
                 "--check", "--recalibrate"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == "step" and doc["workload"]["num_records"] == 30 and doc["phases"]["both"]["records"] == 30
    # each check with the rates it was predicted from, measured around it
    assert len(doc["checks"]) == 3 and all(c["rates"]["parallel"] >= 1 for c in doc["checks"])
    assert doc["checks"][0]["rates"] != doc["rates"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "4"], "exactly one of --step-ms"),
        (["--step-ms", "abc"], "--step-ms"),
        (["--step", "nosuchmodule_xyz:step"], "cannot import"),
        (["--step", "json"], "module:function"),
        (["--step-ms", "1", "--plot", "x.jpg"], "--plot"),
        (["--step-ms", "1", "--ram-size", "1"], "--ram-size"),
    ],
)
def test_profile_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    assert _run(["profile", str(ds), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err and "Traceback" not in err


def test_load_step_errors() -> None:
    with pytest.raises(ConfigError, match="no function"):
        load_step("json:no_such_function")
    assert load_step("json:dumps") is json.dumps
