"""The cost model of ``shardkit profile``: epoch time and stalls as plain arithmetic on a few
measured :class:`Rates` and the cache sizes (docs/design.md §15)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shardkit.errors import ConfigError
from shardkit.order.schedule import resolve_permutation
from shardkit.readers.options import SamplerOptions, TierSizes
from shardkit.tiers.static_cache import region_allocated_first

__all__ = [
    "Rates",
    "Workload",
    "Scenario",
    "EpochPrediction",
    "Prediction",
    "read_amplification",
    "page_cache_hit",
    "predict",
    "with_options",
    "RESOURCES",
]

#: Stages of an epoch as :class:`EpochPrediction` names them (slowest one = the bottleneck).
RESOURCES = ("storage", "page cache", "ssd", "assembly", "compute", "cpu")
#: Threads that map a static cache's pages in its first epoch: the reader and the cache's own.
FILL_THREADS = 2


@dataclass(frozen=True)
class Workload:
    """The dataset and the job: ``N`` records of ``record_nbytes`` bytes, in batches of ``batch_size``;
    ``mapped``: a static cache that holds the dataset whole is its mapped shard files, with no pages
    of its own to fill (a local dataset of uncompressed records, ``TieredSampler.maps_whole_cache``)."""

    num_records: int
    record_nbytes: int
    batch_size: int
    epochs: int = 2
    mapped: bool = False

    @property
    def dataset_bytes(self) -> int:
        return self.num_records * self.record_nbytes


@dataclass(frozen=True)
class Rates:
    """Rates measured by the profile's phases (bytes per second, seconds per batch).

    ``storage_bps`` / ``page_cache_bps``: the bottom tier read cold / warm; ``copy_bps``: cached records
    copied into batches; ``assembly_s``: the assembler's other work per batch; ``handover_s``: the
    consumer's side of taking a batch; ``step_s`` / ``step_cpu_s``: wall and CPU seconds of one step (a
    sleeping step has no CPU); ``ssd_write_bps`` / ``ssd_read_bps``: the SSD tier (``None``: not
    measured, SSD predictions refused); ``cores``; ``page_cache_bytes``: memory the OS may use to cache
    the dataset. ``page_cache_bps`` is the CPU's cost of a warm read; ``warm_bps`` the rate a warm
    epoch's reads reached on the clock (``None``: ``page_cache_bps``); ``fill_bps`` the rate fresh
    shared memory gets its pages, paid once per byte of the static cache in the first epoch
    (``None``: free); ``parallel`` how many of the process's threads run at once (``None``:
    ``cores``; fewer where other processes keep the cores busy); ``start_s`` what a fresh sampler takes
    to its first batch besides reading its first block and allocating its cache (threads, buffers), paid
    once, before the first epoch's first batch.
    """

    storage_bps: float
    page_cache_bps: float
    copy_bps: float
    assembly_s: float
    handover_s: float
    step_s: float
    step_cpu_s: float = 0.0
    ssd_write_bps: float | None = None
    ssd_read_bps: float | None = None
    cores: int = 1
    page_cache_bytes: int = 0
    warm_bps: float | None = None
    fill_bps: float | None = None
    parallel: float | None = None
    start_s: float = 0.0

    @property
    def threads_at_once(self) -> float:
        """Threads of the process that run at the same time (at least 1, at most ``cores``)."""
        cores = max(1, self.cores)
        return cores if self.parallel is None else min(float(cores), max(1.0, self.parallel))


@dataclass(frozen=True)
class Scenario:
    """One configuration to predict: sampler options plus the machine's what-ifs (``storage_bps``,
    ``step_s``, ``page_cache_bytes`` replace the measured rate; ``cold_start``: dataset out of the page cache)."""

    label: str
    options: SamplerOptions
    workers: int = 1
    storage_bps: float | None = None
    step_s: float | None = None
    page_cache_bytes: int | None = None
    cold_start: bool = True


@dataclass(frozen=True)
class EpochPrediction:
    """One epoch of one consumer: its time, the consumer's stall, and in ``stages`` the seconds each
    resource of :data:`RESOURCES` alone would need."""

    seconds: float
    stall_seconds: float
    storage_bytes: float
    startup_seconds: float
    stages: dict[str, float] = field(default_factory=dict)
    #: The resource the epoch waits for (a name of :data:`RESOURCES`).
    bottleneck: str = "compute"

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Prediction:
    """The epochs of one :class:`Scenario` and the memory plan they follow."""

    scenario: Scenario
    sizes: TierSizes
    epochs: tuple[EpochPrediction, ...]

    @property
    def seconds(self) -> float:
        """The whole run."""
        return sum(e.seconds for e in self.epochs)

    @property
    def stall_seconds(self) -> float:
        return sum(e.stall_seconds for e in self.epochs)

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady(self) -> EpochPrediction:
        """The last epoch: after the first, every epoch is the same."""
        return self.epochs[-1]

    @property
    def cache_fraction(self) -> float:
        return self.sizes.cache_fraction


def read_amplification(density: float, gap_bytes: int, record_nbytes: int) -> float:
    """Bytes read per wanted byte when a fraction ``density`` d of the records is wanted independently.

    A gap of k unwanted records (``P(k) = d (1-d)^k``) is read when ``k <= G = gap_bytes // record_nbytes``,
    so a wanted record costs ``1 + q (1 - (G+1) q^G + G q^(G+1)) / d`` records, ``q = 1 - d``.
    """
    if not 0 < density <= 1:
        raise ConfigError(f"density: expected 0 < density <= 1, found {density}")
    g = gap_bytes // max(1, record_nbytes)
    q = 1.0 - density
    if g == 0 or q == 0:
        return 1.0
    return 1.0 + q * (1 - (g + 1) * q**g + g * q ** (g + 1)) / density


def page_cache_hit(page_cache_bytes: float, dataset_bytes: float) -> float:
    """Fraction of uniformly random reads an LRU page cache of ``page_cache_bytes`` serves."""
    if dataset_bytes <= 0:
        return 1.0
    return max(0.0, min(1.0, page_cache_bytes / dataset_bytes))


def predict(work: Workload, rates: Rates, scenario: Scenario) -> Prediction:
    """Predict every epoch of ``scenario``: what each epoch reads, from which tier, and how long its
    slowest stage takes (the model is in docs/design.md §15)."""
    w = scenario.workers
    if w < 1:
        raise ConfigError(f"workers: expected at least 1, found {w}")
    opts = scenario.options
    sizes = opts.replace(world_size=opts.world_size * w, rank=0).tier_sizes(work.record_nbytes, work.num_records)
    if sizes.ssd_block is not None and (rates.ssd_write_bps is None or rates.ssd_read_bps is None):
        raise ConfigError(f"{scenario.label}: the SSD tier's rates were not measured (profile with --ssd-dir)")
    page_cache = rates.page_cache_bytes if scenario.page_cache_bytes is None else scenario.page_cache_bytes
    later_hit = page_cache_hit(max(0, page_cache - w * sizes.ram_bytes), work.dataset_bytes)
    first_hit = 0.0 if scenario.cold_start else later_hit
    epochs = tuple(
        _epoch(work, rates, scenario, sizes, first=e == 0, hit=first_hit if e == 0 else later_hit) for e in range(max(1, work.epochs))
    )
    return Prediction(scenario, sizes, epochs)


def _epoch(work: Workload, rates: Rates, sc: Scenario, sizes: TierSizes, *, first: bool, hit: float) -> EpochPrediction:
    """One epoch of one consumer (one of ``sc.workers``)."""
    n, rec, w = work.num_records, work.record_nbytes, sc.workers
    n, rec = int(n), int(rec)
    per = n / w  # records of this consumer
    batches = math.ceil(per / work.batch_size)
    cached = sizes.static_records / n if n else 0.0
    unread = 0.0 if first else cached  # the first epoch reads the pinned records into the cache
    records = per * (1 - unread)
    gap = sc.options.gap_bytes
    top = sizes.ssd_block if sizes.ssd_block is not None else sizes.ram_block
    density = min(1.0, top * w / n) * (1 - unread)  # a block's keys are a random subset of all N keys
    storage_bytes = records * rec * (read_amplification(density, gap, rec) if records else 1.0)
    bw = sc.storage_bps if sc.storage_bps is not None else rates.storage_bps
    cold_s = storage_bytes * (1 - hit) / bw
    warm_s = storage_bytes * hit / (rates.warm_bps or rates.page_cache_bps)
    # The first epoch maps the static cache's pages as it pins records. A thread of the cache's own
    # maps them ahead of the reads (tiers/static_cache.py) and the reader maps any page it reaches
    # first, so the two share that work: the reader's path takes the longer of its reads and their
    # sum over the threads that run at once (fewer than the cores when other processes hold them),
    # and the mapping's CPU joins the epoch's CPU.
    # A node-shared cache held as its sorted keys allocates its whole region before the first batch
    # (tiers/static_cache.py): that part of its start is serial, and no pages are left to fill.
    at_once = rates.threads_at_once
    mapped = work.mapped and cached >= 1 and sizes.ssd_block is None  # the files' pages are the cache
    fill_s = per * cached * rec / rates.fill_bps if first and rates.fill_bps and not mapped else 0.0
    bijection = resolve_permutation(sc.options.permutation, n) == "feistel"
    allocate_s = 0.0
    if fill_s and region_allocated_first(sizes.static_records, n, shared=sc.options.node_sharing, bijection=bijection):
        allocate_s, fill_s = sizes.static_records * rec / (rates.fill_bps or 1.0), 0.0
    reader = max(cold_s + warm_s, (cold_s + warm_s + fill_s) / min(FILL_THREADS, at_once))
    ssd = 0.0
    if sizes.ssd_block is not None:
        assert rates.ssd_write_bps is not None and rates.ssd_read_bps is not None
        inner = min(1.0, sizes.ram_block / max(1, sizes.ssd_block))
        ssd_read = records * rec * read_amplification(inner, gap, rec) / rates.ssd_read_bps
        reader += records * rec / rates.ssd_write_bps  # the SSD creator reads, then writes
        ssd = max(ssd_read, records * rec / rates.ssd_write_bps)
        reader = max(reader, ssd_read)
    assembly = batches * rates.assembly_s + per * cached * rec / rates.copy_bps
    step = sc.step_s if sc.step_s is not None else rates.step_s
    step_cpu = rates.step_cpu_s * (step / rates.step_s) if rates.step_s > 0 else 0.0
    compute = batches * (step + rates.handover_s)
    # Every byte read is copied by a CPU at page-cache speed; the SSD tier copies it twice more.
    cpu_read = storage_bytes / rates.page_cache_bps + (2 * records * rec / rates.page_cache_bps if ssd else 0.0)
    cpu = w * (cpu_read + fill_s + assembly + batches * (step_cpu + rates.handover_s)) / at_once
    stages = {
        "storage": w * cold_s,  # bandwidth is shared by the workers
        "page cache": warm_s,
        "ssd": ssd,
        "assembly": assembly,
        "compute": compute,
        "cpu": cpu,
    }
    startup = 0.0
    if first:
        first_bytes = min(sizes.first_block, per) * rec
        startup = rates.start_s + allocate_s + first_bytes * (1 - hit) / bw + first_bytes * hit / (rates.warm_bps or rates.page_cache_bps)
    neck = max(stages, key=lambda k: stages[k])
    if reader > stages[neck]:  # the reader thread, storage and page cache together
        neck = "storage" if stages["storage"] >= stages["page cache"] else "page cache"
    seconds = max(reader, *stages.values()) + startup
    return EpochPrediction(seconds, max(0.0, seconds - compute), float(storage_bytes), startup, stages, neck)


def with_options(scenario: Scenario, label: str, **options: object) -> Scenario:
    """``scenario`` with sampler options changed (validated) and a new label."""
    return replace(scenario, label=label, options=scenario.options.replace(**options))
