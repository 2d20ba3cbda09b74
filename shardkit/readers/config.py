"""The sampler's options: one frozen, validated value that every entry point builds and passes down.

:class:`SamplerOptions` holds every option of the tiered sampler with its default and its check, so
the CLI (``shardkit sample``), the Python API (:class:`~shardkit.readers.TieredSampler` keyword
arguments), the adapters and the benchmarks cannot drift apart: a default or a range is written
here once. Sizes go through :mod:`shardkit.units` (one grammar); every error names the option the
way the user wrote it, ``--ram-size`` on the command line and ``ram_size`` in Python (the
``source`` the options were built from).

Options that need the dataset to be checked (a budget smaller than two records, an SSD budget below
the RAM budget) are resolved by :meth:`SamplerOptions.tier_sizes` once the record size is known;
the block-size rules themselves live in :mod:`shardkit.readers.schedule`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import numpy as np

from shardkit import units
from shardkit.errors import ConfigError
from shardkit.formats import DEFAULT_GAP_BYTES
from shardkit.formats.ranged import DEFAULT_REMOTE_GAP_BYTES
from shardkit.readers.buffers import HOLD_BATCHES
from shardkit.readers.schedule import (
    BATCH_PREFETCH,
    MODES,
    PERMUTATIONS,
    block_limits,
    consumer_records_bound,
    pool_batches,
    ram_block,
    ssd_block,
)
from shardkit.readers.seeds import check_seed
from shardkit.readers.ssd import READ_CHUNK_BYTES
from shardkit.stores import DEFAULT_OPTIONS
from shardkit.units import Capacity, human_bytes, parse_bytes, parse_count

__all__ = ["TIERS", "Source", "option_name", "parse_tiers", "path_or_none", "UserOptions", "SamplerOptions", "TierSizes", "DEFAULTS"]

#: Known tiers, ordered slow -> fast. ``disk`` (the dataset itself) is implicit.
TIERS = ("ssd", "ram")

#: Where options came from: decides how errors spell their names.
Source = Literal["python", "cli"]


def option_name(name: str, source: Source = "python") -> str:
    """``ram_size`` as the user wrote it: ``--ram-size`` on the command line, ``ram_size`` in Python."""
    return f"--{name.replace('_', '-')}" if source == "cli" else name


def parse_tiers(tiers: str | Sequence[str], *, what: str = "tiers") -> tuple[str, ...]:
    """Normalise ``"ram"``, ``"ram,ssd"``, ``"ssd,ram"`` or ``["ram", "ssd"]`` to slow -> fast order.

    ``ram`` is mandatory (batches are assembled there); ``ssd`` is optional.
    """
    if isinstance(tiers, str):
        names = [t.strip().lower() for t in tiers.split(",") if t.strip()]
    elif isinstance(tiers, Sequence):
        names = [str(t).strip().lower() for t in tiers]
    else:
        raise ConfigError(f"{what}: expected 'ram' or 'ram,ssd' (a string or a list), found {tiers!r}")
    unknown = [t for t in names if t not in TIERS]
    if unknown:
        raise ConfigError(f"{what}: expected a comma-separated subset of {', '.join(TIERS)}, found {unknown}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what}: each tier may appear once, found {names}")
    if "ram" not in names:
        raise ConfigError(f"{what}: 'ram' is required (batches are assembled in RAM), found {names}")
    return tuple(t for t in TIERS if t in names)


@dataclass(frozen=True)
class UserOptions:
    """What every set of options a user gives by name shares (:class:`SamplerOptions`,
    :class:`~shardkit.readers.shared.server.ServeOptions`): where they came from, how errors spell
    their names, and the refusal of a name the set does not have.

    Attributes
    ----------
    source
        ``"python"`` or ``"cli"``: how error messages spell option names (``ram_size`` or
        ``--ram-size``). Keyword-only, and not part of equality.
    """

    #: What one option is called in the error for an unknown name ("sampler option").
    KIND: ClassVar[str] = "option"

    source: Source = field(default="python", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.source not in ("python", "cli"):
            raise ConfigError(f"source: expected 'python' or 'cli', found {self.source!r}")

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options of the set (every field but ``source``)."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - {"source"}

    @classmethod
    def spell(cls, option: str, source: Source) -> str:
        """``option`` as a user of ``source`` writes it (see :func:`option_name`)."""
        return option_name(option, source)

    @classmethod
    def parse(cls, *, source: Source = "python", **values: Any) -> Self:
        """Options from user-given values (any accepted spelling); unknown names are a ConfigError."""
        cls.check_names(values, source)
        return cls(source=source, **values)

    @classmethod
    def check_names(cls, values: Mapping[str, Any], source: Source) -> None:
        """Refuse the names in ``values`` that are not options of the set, spelled as the user wrote them."""
        known = cls.option_names()
        unknown = sorted(set(values) - known)
        if unknown:
            names = ", ".join(cls.spell(u, source) for u in unknown)
            raise ConfigError(f"unknown {cls.KIND} {names}; expected some of {', '.join(sorted(known))}")

    def name(self, option: str) -> str:
        """``option`` as the user wrote it."""
        return self.spell(option, self.source)


@dataclass(frozen=True)
class TierSizes:
    """The options' budgets resolved for one dataset and consumer count (see :meth:`SamplerOptions.tier_sizes`).

    This is the sampler's whole memory plan: ``ram_bytes`` covers everything it holds in RAM —
    the batch buffers that RAM blocks are read into (``pool_batches`` of ``batch_size`` records),
    the static cache (``static_records``), and with the SSD tier its copy buffer
    (``ssd_copy_bytes``). The small per-record fields and the epoch order are not in it: they are
    per dataset, shared by every process of a node (see :mod:`shardkit.readers.node`).

    Attributes
    ----------
    ram_bytes
        The RAM budget in bytes.
    ram_block, first_block
        ``K2``, the largest RAM block, and the run's first (smaller) block, in records; blocks
        double from the first up to ``K2`` (see :func:`~shardkit.readers.schedule.block_bounds`).
    pool_batches, batch_size
        Batch buffers of the run (two blocks in flight and the batches the consumer holds).
    static_records, num_records
        ``M``, records pinned by the static cache (0 = off; ``num_records`` = the whole dataset),
        and ``N``.
    ssd_bytes, ssd_block
        The SSD budget and ``K1``, the largest SSD reservoir (``None`` without the SSD tier).
    ssd_copy_bytes
        The disk -> SSD copy buffer (0 without the SSD tier): two halves, one read while the other
        is written (see :mod:`shardkit.readers.scratch`). A local, uncompressed dataset of large
        records is copied inside the kernel and leaves it untouched.
    record_nbytes
        Bytes of one record.
    node_records
        Records the node cache pins on the node's local disk (0 = off; only with ``locality``).
    """

    ram_bytes: int
    ram_block: int
    ssd_bytes: int | None
    ssd_block: int | None
    static_records: int
    first_block: int = 1
    pool_batches: int = 1
    batch_size: int = 1
    num_records: int = 0
    ssd_copy_bytes: int = 0
    record_nbytes: int = 1
    node_records: int = 0

    @property
    def reservoir(self) -> int:
        """``K``: records per reservoir of the top tier (``K1`` with the SSD tier, else ``K2``)."""
        return self.ssd_block if self.ssd_block is not None else self.ram_block

    @property
    def cache_fraction(self) -> float:
        """``M / N``: the fraction of every epoch after the first served from RAM, not storage."""
        return self.static_records / self.num_records if self.num_records else 0.0

    @property
    def full_cache(self) -> bool:
        """The whole dataset is cached: epochs after the first read nothing from storage."""
        return self.num_records > 0 and self.static_records >= self.num_records

    @property
    def pool_bytes(self) -> int:
        return self.pool_batches * self.batch_size * self.record_nbytes

    @property
    def cache_bytes(self) -> int:
        return self.static_records * self.record_nbytes

    def describe(self) -> list[str]:
        """What the budget was spent on, one line each (``shardkit sample`` prints these)."""
        rec = self.record_nbytes
        lines = [
            f"blocks       {self.first_block} records first, doubling to {self.ram_block} records "
            f"({human_bytes(self.ram_block * rec)}, {self.ram_block / max(1, self.num_records):.1%} of the dataset)",
            f"buffers      {self.pool_batches} batches of {self.batch_size} ({human_bytes(self.pool_bytes)})",
            f"cache        {self.static_records} records ({human_bytes(self.cache_bytes)}, "
            f"{self.cache_fraction:.1%} of the dataset)" + (": every epoch after the first reads nothing"
                                                           " from storage" if self.full_cache else ""),
        ]
        if self.ssd_block is not None:
            lines.append(f"ssd          reservoirs of up to {self.ssd_block} records, copy buffer "
                         f"{human_bytes(self.ssd_copy_bytes)}")
        used = self.pool_bytes + self.cache_bytes + self.ssd_copy_bytes
        lines.append(f"ram budget   {human_bytes(self.ram_bytes)}, planned {human_bytes(used)}")
        return lines


#: The smallest disk -> SSD copy buffer worth taking out of the RAM budget (see tier_sizes).
MIN_COPY_BYTES = 1 << 20

# Default budgets (values, so every SamplerOptions shares them).
_RAM_SIZE = Capacity(nbytes=512 << 20)
_SSD_SIZE = Capacity(nbytes=4 << 30)
_OFF = Capacity(nbytes=0)


@dataclass(frozen=True)
class SamplerOptions(UserOptions):
    """Every option of the tiered sampler, validated and normalised on construction.

    Build one with keyword arguments (values are parsed: ``ram_size="2GiB"``, ``tiers="ram,ssd"``),
    or with :meth:`parse` when the values come from a user (it refuses unknown names), and derive
    variants with :meth:`replace` (validated again). Fields hold the normalised values.

    Attributes
    ----------
    tiers
        ``("ram",)`` or ``("ssd", "ram")``; given as ``"ram"``, ``"ram,ssd"`` (any order) or a list.
    ram_size
        This consumer's whole RAM budget: bytes (int), a size (``"512MiB"``) or a record count
        (``"10000records"``); at least two records. It covers everything the sampler holds in RAM
        for this consumer: the batch buffers that RAM blocks are read into (two blocks in flight
        plus the batches the consumer holds), the static cache (see ``static_cache``) and, with the
        SSD tier, the disk -> SSD copy buffer. Blocks are sized for read speed (see
        :mod:`shardkit.readers.schedule`), and what they do not need caches records across
        epochs; when it is at least the dataset's payload, every epoch after the first reads
        nothing from storage. Not in it: the per-record fields and the epoch order, which are per
        dataset and shared by the processes of a node (``node_sharing``).
    ssd_size, ssd_dir
        SSD-tier budget (same syntax; two reservoirs of ``K1`` = ``ssd_size / (2 * record size)``
        records; at least two records and at least ``ram_size``), and the directory that holds the
        run's private sub-directory (default: the system temporary directory).
    batch_size
        Per-consumer batch size ``B``.
    epochs
        Epochs per iteration (``None`` = forever). An iteration runs epochs
        ``start_epoch .. start_epoch + epochs - 1``; iterating again continues with the next ones.
    seed
        An integer in ``[0, 2**64)``; with the epoch it defines every order (see
        :mod:`shardkit.readers.seeds`).
    mode
        ``"epoch"`` (a uniform random permutation per epoch), ``"replacement"`` (independent uniform
        reservoirs of ``K`` records) or ``"sequential"`` (storage order).
    rank, world_size
        This is consumer ``c = rank`` of ``W = world_size`` (see :mod:`shardkit.readers.schedule`).
    drop_last
        Drop the incomplete final global batch, so every consumer gets the same number of full
        batches (what DDP needs).
    limit
        Stop an iteration after this many records were emitted to this consumer (``None``: no limit).
    gap_bytes
        Gaps between wanted records up to this size are read rather than skipped (64 KiB by default).
    remote_gap_bytes
        The same for a dataset in an object store, where a request costs far more than reading a
        gap (1 MiB by default; see :mod:`shardkit.formats.ranged` for how it was chosen).
    remote_concurrency
        Requests in flight at once when reading a dataset in an object store (32 by default).
    remote_timeout, remote_retry
        For an object store: how long one request may take before it counts as a transient failure
        (60 s), and how long transient failures are retried before the read fails with an error
        naming the object and byte range (120 s: long enough to ride out a server restart). Seconds
        or a duration (``"90s"``, ``"2min"``).
    cache_dir, cache_size
        A local directory that keeps the shards of a dataset in an object store once they were
        fetched, so later epochs read them from local disk (see :mod:`shardkit.stores.cache`), and
        its budget in bytes (``None``: as much as the dataset needs). Ignored for local datasets.
    start_epoch
        First epoch of the first iteration.
    static_cache
        The part of ``ram_size`` that pins records for the whole run (CoorDL's MinIO policy):
        ``"auto"`` (default: whatever the blocks do not need, the whole dataset when it fits),
        ``0`` (off), or bytes, a size or a record count taken out of ``ram_size``. The cache is
        shared by the processes of a node that use the same dataset, seed and size. See
        :mod:`shardkit.readers.static_cache`.
    permutation
        How ``epoch`` mode draws its order: ``"exact"`` (numpy's uniform permutation, 8 bytes a
        record), ``"feistel"`` (an on-demand keyed bijection, statistically uniform, nothing per
        record; see :mod:`shardkit.readers.bijection`), ``"auto"`` (default: exact up to
        :data:`~shardkit.readers.schedule.EXACT_PERMUTATION_LIMIT` records).
    locality
        Many nodes (docs/design.md §10, :mod:`shardkit.readers.locality`): each node pins a disjoint random
        part of the dataset (the static cache in RAM, ``node_cache`` on its local disk) and every
        global batch's keys go to the ranks so that each takes as many as possible from its own
        node's cache. The sets of keys each training step sees are exactly those without it.
        Default ``False``: the plain slicing.
    nodes
        ``M``: nodes the ranks run on; the ranks (``world_size / workers_per_rank``) of node ``m``
        are the consecutive ranks ``m * R .. (m + 1) * R - 1`` as torchrun numbers them.
    workers_per_rank
        Consumers per rank (DataLoader workers; consumer ``c`` is worker ``c % workers_per_rank`` of
        rank ``c // workers_per_rank``). With ``locality`` keys move only between the consumers
        whose batches make one training step.
    node_cache, node_cache_dir
        With ``locality`` and ``tiers="ram"``: records this node pins on its local disk on top of
        the static cache (``0`` off, bytes, a size or a record count), written once per node into a
        private directory under ``node_cache_dir`` (default: the system temporary directory) and
        reused by every process of the node and by later runs. See
        :mod:`shardkit.readers.node_cache`.
    node_sharing
        Share per-dataset memory (fields, the exact epoch order, the static cache) among the
        processes of this machine through private files under ``/dev/shm`` (default ``True``);
        ``False`` keeps everything private to the process. See :mod:`shardkit.readers.node`.
    source
        ``"python"`` or ``"cli"``: how error messages spell option names. Not part of equality.
    """

    tiers: tuple[str, ...] = ("ram",)
    ram_size: Capacity = _RAM_SIZE
    ssd_size: Capacity = _SSD_SIZE
    ssd_dir: Path | None = None
    batch_size: int = 256
    epochs: int | None = 1
    seed: int = 0
    mode: str = "epoch"
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    limit: int | None = None
    gap_bytes: int = DEFAULT_GAP_BYTES
    remote_gap_bytes: int = DEFAULT_REMOTE_GAP_BYTES
    remote_concurrency: int = DEFAULT_OPTIONS.concurrency
    remote_timeout: float = DEFAULT_OPTIONS.timeout
    remote_retry: float = DEFAULT_OPTIONS.retry_seconds
    cache_dir: Path | None = None
    cache_size: int | None = None
    start_epoch: int = 0
    static_cache: Capacity | Literal["auto"] = "auto"
    permutation: str = "auto"
    node_sharing: bool = True
    locality: bool = False
    nodes: int = 1
    workers_per_rank: int = 1
    node_cache: Capacity = _OFF
    node_cache_dir: Path | None = None

    KIND = "sampler option"

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.name
        values: dict[str, Any] = {
            "tiers": parse_tiers(self.tiers, what=name("tiers")),
            "ram_size": units.parse_capacity(self.ram_size, what=name("ram_size")),
            "ssd_size": units.parse_capacity(self.ssd_size, what=name("ssd_size")),
            "ssd_dir": path_or_none(self.ssd_dir, name("ssd_dir")),
            "batch_size": parse_count(self.batch_size, what=name("batch_size"), minimum=1),
            "epochs": None if self.epochs is None else parse_count(self.epochs, what=name("epochs"), minimum=0),
            "seed": check_seed(self.seed, what=name("seed")),
            "mode": self.mode,
            "world_size": parse_count(self.world_size, what=name("world_size"), minimum=1),
            "drop_last": _flag(self.drop_last, name("drop_last")),
            "limit": None if self.limit is None else parse_count(self.limit, what=name("limit"), minimum=0),
            "gap_bytes": DEFAULT_GAP_BYTES if self.gap_bytes is None
            else parse_bytes(self.gap_bytes, what=name("gap_bytes"), allow_zero=True),
            "remote_gap_bytes": parse_bytes(self.remote_gap_bytes, what=name("remote_gap_bytes"), allow_zero=True),
            "remote_concurrency": parse_count(self.remote_concurrency, what=name("remote_concurrency"), minimum=1),
            "remote_timeout": units.parse_duration(self.remote_timeout, what=name("remote_timeout"), allow_zero=False),
            "remote_retry": units.parse_duration(self.remote_retry, what=name("remote_retry"), allow_zero=False),
            "cache_dir": path_or_none(self.cache_dir, name("cache_dir")),
            "cache_size": None if self.cache_size is None else parse_bytes(self.cache_size, what=name("cache_size")),
            "start_epoch": parse_count(self.start_epoch, what=name("start_epoch"), minimum=0),
            "static_cache": _cache_option(self.static_cache, name("static_cache")),
            "permutation": self.permutation,
            "node_sharing": _flag(self.node_sharing, name("node_sharing")),
            "locality": _flag(self.locality, name("locality")),
            "nodes": parse_count(self.nodes, what=name("nodes"), minimum=1),
            "workers_per_rank": parse_count(self.workers_per_rank, what=name("workers_per_rank"), minimum=1),
            "node_cache": units.parse_capacity(0 if self.node_cache is None else self.node_cache,
                                               what=name("node_cache"), allow_zero=True),
            "node_cache_dir": path_or_none(self.node_cache_dir, name("node_cache_dir")),
        }  # fmt: skip
        if self.permutation not in PERMUTATIONS:
            raise ConfigError(f"{name('permutation')}: expected one of {', '.join(PERMUTATIONS)}, found {self.permutation!r}")
        if self.mode not in MODES:
            raise ConfigError(f"{name('mode')}: expected one of {', '.join(MODES)}, found {self.mode!r}")
        rank = parse_count(self.rank, what=name("rank"), minimum=0)
        if rank >= values["world_size"]:
            raise ConfigError(
                f"{name('rank')}: expected 0 <= {name('rank')} < {name('world_size')}={values['world_size']}, "
                f"found {self.rank!r}"
            )
        values["rank"] = rank
        self._check_layout(values)
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def _check_layout(self, values: dict[str, Any]) -> None:
        """Consumers, workers per rank and nodes must nest (W = ranks * k, ranks = M * R); the node
        cache needs locality and the RAM tier alone."""
        name = self.name
        w, k, m = values["world_size"], values["workers_per_rank"], values["nodes"]
        if w % k:
            raise ConfigError(
                f"{name('workers_per_rank')}: expected a divisor of {name('world_size')}={w} (consumers are "
                f"ranks x workers), found {k}"
            )
        if (w // k) % m:
            raise ConfigError(
                f"{name('nodes')}: expected a divisor of the {w // k} ranks ({name('world_size')} / "
                f"{name('workers_per_rank')}), found {m}"
            )
        if values["node_cache"].to_bytes(1):
            if not values["locality"]:
                raise ConfigError(
                    f"{name('node_cache')}: a node's disk cache holds its part of the node partition, which only "
                    f"{name('locality')} uses; found {name('node_cache')}={values['node_cache']} without {name('locality')}"
                )
            if "ssd" in values["tiers"]:
                raise ConfigError(
                    f"{name('node_cache')}: the node cache is this node's local-disk tier; with "
                    f"{name('tiers')}={','.join(values['tiers'])} the SSD tier would copy the same records again. "
                    f"Use {name('tiers')}='ram' with {name('node_cache')}, or the SSD tier without it"
                )

    # ------------------------------------------------------------------ construction
    def replace(self, **values: Any) -> SamplerOptions:
        """A copy with ``values`` changed, validated again; unknown names are a ConfigError."""
        self.check_names(values, self.source)
        return dataclasses.replace(self, **values)

    def dataset_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~shardkit.formats.Dataset` for the bottom tier (the dataset
        itself): gap thresholds, and for an object store its concurrency and local cache."""
        return {
            "gap_bytes": self.gap_bytes,
            "remote_gap_bytes": self.remote_gap_bytes,
            "store_options": dataclasses.replace(
                DEFAULT_OPTIONS, concurrency=self.remote_concurrency, timeout=self.remote_timeout,
                retry_seconds=self.remote_retry,
            ),
            "cache_dir": self.cache_dir,
            "cache_size": self.cache_size,
        }

    # ------------------------------------------------------------------ resolution
    def tier_sizes(self, record_nbytes: int, num_records: int, num_keys: int | None = None) -> TierSizes:
        """The memory plan for records of ``record_nbytes`` bytes: budgets in bytes, block sizes,
        batch buffers and the static cache (see :class:`TierSizes`).

        ``num_records`` is the length of an epoch's order (what consumers split into batches);
        ``num_keys`` the distinct records behind it (what blocks are dense in and what the static
        cache may pin), the same by default. They differ for a mixture, whose epoch of ``L`` slots
        draws on the records of all its datasets.

        Raises :class:`~shardkit.errors.ConfigError`, naming the option and the record size, when a
        tier budget holds fewer than two records (each tier double-buffers blocks of at least one
        record, so a smaller budget cannot be honoured), when the SSD budget is below the RAM
        budget (the SSD tier exists to hold more than RAM), when a static cache that is not off
        holds no record at all, or when it leaves ``ram_size`` fewer than two records for blocks.
        """
        rec, b = int(record_nbytes), self.batch_size
        n = int(num_records if num_keys is None else num_keys)
        bound = consumer_records_bound(int(num_records), b, self.world_size)
        ram = self._budget("ram_size", rec)
        ssd: int | None = None
        k1: int | None = None
        copy = 0
        if "ssd" in self.tiers:
            ssd = self._budget("ssd_size", rec)
            if ssd < ram:
                raise ConfigError(
                    f"{self.name('ssd_size')}: {_describe(ssd, rec)} is smaller than {self.name('ram_size')} "
                    f"{_describe(ram, rec)}; the SSD tier feeds the RAM tier, so give it at least as much"
                )
            k1 = ssd_block(ssd, rec, bound)
            # The disk -> SSD copy buffer comes out of the RAM budget: an eighth of it, at most
            # READ_CHUNK_BYTES; below MIN_COPY_BYTES it copies one record at a time (not counted).
            copy = min(READ_CHUNK_BYTES, ram // 8) // rec * rec
            copy = copy if copy >= MIN_COPY_BYTES else 0
        blocks_budget = ram - copy
        copy_bytes = max(copy, rec) if ssd is not None else 0
        pinned = self._static_records(blocks_budget, rec, n)
        full = n > 0 and pinned is None and blocks_budget >= n * rec
        if full or (pinned is not None and pinned >= n > 0):
            # Everything cached: blocks are read into the cache, batches gathered from it.
            first, largest = block_limits(ram_block(ram, rec, b, bound), rec, b, n, self.gap_bytes, bound, ssd is None)
            return TierSizes(ram, largest, ssd, k1, n, first, BATCH_PREFETCH + HOLD_BATCHES + 1, b, n, copy_bytes, rec,
                             self._node_records(rec, n))  # fmt: skip
        if pinned is not None:
            blocks_budget -= pinned * rec
        # Blocks of whole batches, read straight into the batch buffers: the pool is the memory.
        # SSD reservoirs are not whole batches, so their blocks may start inside one (one more each).
        aligned = ssd is None
        per_block = (blocks_budget // (b * rec) - HOLD_BATCHES) // 2 - (0 if aligned else 1)
        if per_block >= 1:
            first, largest = block_limits(per_block * b, rec, b, n, self.gap_bytes, bound, aligned)
        else:
            # A budget of fewer batches than the pipeline holds: blocks smaller than a batch (the
            # batch buffers then exceed the budget; a batch cannot be smaller than the batch size).
            aligned = False
            first, largest = block_limits(ram_block(blocks_budget, rec, b, bound), rec, b, n, self.gap_bytes,
                                          bound, aligned)  # fmt: skip
        pool = pool_batches(largest, b, aligned)
        if pinned is None:  # auto: the budget the blocks do not need caches records
            pinned = min(n, max(0, blocks_budget - pool * b * rec) // rec)
        return TierSizes(ram, largest, ssd, k1, pinned, first, pool, b, n, copy_bytes, rec, self._node_records(rec, n))

    def _node_records(self, rec: int, n: int) -> int:
        """Records ``node_cache`` pins on the node's disk (0 = off); a budget of no record is an error."""
        cache = self.node_cache.to_bytes(rec)
        if 0 < cache < rec:
            raise ConfigError(
                f"{self.name('node_cache')}: {human_bytes(cache)} holds no record of {human_bytes(rec)} "
                f"({rec} bytes); use 0 to turn the node cache off or at least {rec} bytes"
            )
        return min(cache // rec, n)

    def _static_records(self, budget: int, rec: int, n: int) -> int | None:
        """Records an explicit ``static_cache`` pins (``None`` for ``"auto"``), checked against the
        part of ``ram_size`` it comes out of."""
        if self.static_cache == "auto":
            return None
        assert isinstance(self.static_cache, Capacity)
        cache = self.static_cache.to_bytes(rec)
        if 0 < cache < rec:
            raise ConfigError(
                f"{self.name('static_cache')}: {human_bytes(cache)} holds no record of {human_bytes(rec)} "
                f"({rec} bytes); use 0 to turn the static cache off or at least {rec} bytes"
            )
        pinned = min(cache // rec, n)
        if pinned < n and budget - pinned * rec < 2 * rec:
            raise ConfigError(
                f"{self.name('static_cache')}: {_describe(pinned * rec, rec)} leaves {self.name('ram_size')} "
                f"{_describe(budget, rec)} fewer than two records for blocks; the static cache is part of "
                f"{self.name('ram_size')}, so raise it, lower {self.name('static_cache')} or use 'auto'"
            )
        return pinned

    def _budget(self, option: str, rec: int) -> int:
        capacity: Capacity = getattr(self, option)
        nbytes = capacity.to_bytes(rec)
        if nbytes < 2 * rec:
            raise ConfigError(
                f"{self.name(option)}: {_describe(nbytes, rec)} holds fewer than two records of "
                f"{human_bytes(rec)} ({rec} bytes) each; the tier double-buffers blocks of at least one "
                f"record, so use at least {2 * rec} bytes (2records)"
            )
        return nbytes


def _describe(nbytes: int, rec: int) -> str:
    return f"{human_bytes(nbytes)} ({nbytes // rec} records of {rec} bytes)"


def _cache_option(value: object, what: str) -> Capacity | Literal["auto"]:
    """``"auto"`` or a parsed capacity (0 = off)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return units.parse_capacity(0 if value is None else value, what=what, allow_zero=True)  # type: ignore[arg-type]
    except ConfigError:
        raise ConfigError(f"{what}: expected 'auto', 0 (off), a size such as 512MiB or a record count such as "
                          f"1000records, found {value!r}") from None


def path_or_none(value: object, what: str) -> Path | None:
    """A directory option: ``None`` or a path (text or ``os.PathLike``); anything else is a ConfigError naming ``what``."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise ConfigError(f"{what}: expected a directory path, found {value!r}")


def _flag(value: object, what: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"{what}: expected True or False, found {value!r}")


#: The defaults, for entry points that show them (CLI help) or take them as keyword defaults.
DEFAULTS = SamplerOptions()
