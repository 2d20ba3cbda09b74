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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shardkit import units
from shardkit.errors import ConfigError
from shardkit.formats import DEFAULT_GAP_BYTES
from shardkit.formats.ranged import DEFAULT_REMOTE_GAP_BYTES
from shardkit.readers.schedule import MODES, consumer_records_bound, ram_block, ssd_block
from shardkit.readers.seeds import check_seed
from shardkit.stores import DEFAULT_OPTIONS
from shardkit.units import Capacity, human_bytes, parse_bytes, parse_count

__all__ = ["TIERS", "Source", "option_name", "parse_tiers", "SamplerOptions", "TierSizes", "DEFAULTS"]

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
class TierSizes:
    """The options' budgets resolved for one dataset and consumer count (see :meth:`SamplerOptions.tier_sizes`).

    Attributes
    ----------
    ram_bytes, ram_block
        The RAM budget in bytes and ``K2``, records per RAM block.
    ssd_bytes, ssd_block
        The SSD budget and ``K1``, records per SSD reservoir (``None`` without the SSD tier).
    static_records
        ``M``, records the static cache pins (0 = off).
    node_records
        Records the node cache pins on the node's local disk (0 = off; only with ``locality``).
    """

    ram_bytes: int
    ram_block: int
    ssd_bytes: int | None
    ssd_block: int | None
    static_records: int
    node_records: int = 0

    @property
    def reservoir(self) -> int:
        """``K``: records per reservoir of the top tier (``K1`` with the SSD tier, else ``K2``)."""
        return self.ssd_block if self.ssd_block is not None else self.ram_block


# Default budgets (values, so every SamplerOptions shares them).
_RAM_SIZE = Capacity(nbytes=512 << 20)
_SSD_SIZE = Capacity(nbytes=4 << 30)
_OFF = Capacity(nbytes=0)


@dataclass(frozen=True)
class SamplerOptions:
    """Every option of the tiered sampler, validated and normalised on construction.

    Build one with keyword arguments (values are parsed: ``ram_size="2GiB"``, ``tiers="ram,ssd"``),
    or with :meth:`parse` when the values come from a user (it refuses unknown names), and derive
    variants with :meth:`replace` (validated again). Fields hold the normalised values.

    Attributes
    ----------
    tiers
        ``("ram",)`` or ``("ssd", "ram")``; given as ``"ram"``, ``"ram,ssd"`` (any order) or a list.
    ram_size
        This consumer's whole RAM-tier budget: bytes (int), a size (``"512MiB"``) or a record count
        (``"10000records"``). It covers the two RAM blocks (double buffering) and, when the budget
        is at least twice their size, the batches in flight (``batch_size * 4`` records). ``K2`` =
        remaining budget / (2 * record size); it must hold at least two records.
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
        RAM on top of ``ram_size`` for records pinned for the whole run (CoorDL's MinIO policy):
        ``0`` (off), bytes, a size or a record count. See :mod:`shardkit.readers.static_cache`.
        With ``locality`` it holds this node's part of the node partition.
    locality
        Many nodes (DESIGN §10, :mod:`shardkit.readers.locality`): each node pins a disjoint random
        part of the dataset (``static_cache`` in RAM, ``node_cache`` on its local disk) and every
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
        With ``locality``: records this node pins on its local disk on top of ``static_cache``
        (``0`` off, bytes, a size or a record count), written once per node into a private
        directory under ``node_cache_dir`` (default: the system temporary directory) and reused by
        every process of the node and by later runs. See :mod:`shardkit.readers.node_cache`.
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
    static_cache: Capacity = _OFF
    locality: bool = False
    nodes: int = 1
    workers_per_rank: int = 1
    node_cache: Capacity = _OFF
    node_cache_dir: Path | None = None
    source: Source = field(default="python", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.source not in ("python", "cli"):
            raise ConfigError(f"source: expected 'python' or 'cli', found {self.source!r}")
        name = self.name
        values: dict[str, Any] = {
            "tiers": parse_tiers(self.tiers, what=name("tiers")),
            "ram_size": units.parse_capacity(self.ram_size, what=name("ram_size")),
            "ssd_size": units.parse_capacity(self.ssd_size, what=name("ssd_size")),
            "ssd_dir": _path_or_none(self.ssd_dir, name("ssd_dir")),
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
            "cache_dir": _path_or_none(self.cache_dir, name("cache_dir")),
            "cache_size": None if self.cache_size is None else parse_bytes(self.cache_size, what=name("cache_size")),
            "start_epoch": parse_count(self.start_epoch, what=name("start_epoch"), minimum=0),
            "static_cache": units.parse_capacity(0 if self.static_cache is None else self.static_cache,
                                           what=name("static_cache"), allow_zero=True),
            "locality": _flag(self.locality, name("locality")),
            "nodes": parse_count(self.nodes, what=name("nodes"), minimum=1),
            "workers_per_rank": parse_count(self.workers_per_rank, what=name("workers_per_rank"), minimum=1),
            "node_cache": units.parse_capacity(0 if self.node_cache is None else self.node_cache,
                                               what=name("node_cache"), allow_zero=True),
            "node_cache_dir": _path_or_none(self.node_cache_dir, name("node_cache_dir")),
        }  # fmt: skip
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
        """Consumers, workers per rank and nodes must nest: W = ranks * k, ranks = M * R."""
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
        if values["node_cache"].to_bytes(1) and not values["locality"]:
            raise ConfigError(
                f"{name('node_cache')}: a node's disk cache holds its part of the node partition, which only "
                f"{name('locality')} uses; found {name('node_cache')}={values['node_cache']} without {name('locality')}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def parse(cls, *, source: Source = "python", **values: Any) -> SamplerOptions:
        """Options from user-given values (any accepted spelling); unknown names are a ConfigError."""
        _check_names(values, source)
        return cls(source=source, **values)

    def replace(self, **values: Any) -> SamplerOptions:
        """A copy with ``values`` changed, validated again; unknown names are a ConfigError."""
        _check_names(values, self.source)
        return dataclasses.replace(self, **values)

    def name(self, option: str) -> str:
        """``option`` as the user wrote it (see :func:`option_name`)."""
        return option_name(option, self.source)

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
    def tier_sizes(self, record_nbytes: int, num_records: int) -> TierSizes:
        """The budgets in bytes and the block sizes for records of ``record_nbytes`` bytes.

        Raises :class:`~shardkit.errors.ConfigError`, naming the option and the record size, when a
        tier budget holds fewer than two records (each tier double-buffers blocks of at least one
        record, so a smaller budget cannot be honoured), when the SSD budget is below the RAM
        budget (the SSD tier exists to hold more than RAM), or when a static cache that is not off
        holds no record at all.
        """
        rec = int(record_nbytes)
        bound = consumer_records_bound(num_records, self.batch_size, self.world_size)
        ram = self._budget("ram_size", rec)
        ssd: int | None = None
        k1: int | None = None
        if "ssd" in self.tiers:
            ssd = self._budget("ssd_size", rec)
            if ssd < ram:
                raise ConfigError(
                    f"{self.name('ssd_size')}: {_describe(ssd, rec)} is smaller than {self.name('ram_size')} "
                    f"{_describe(ram, rec)}; the SSD tier feeds the RAM tier, so give it at least as much"
                )
            k1 = ssd_block(ssd, rec, bound)
        return TierSizes(
            ram_bytes=ram,
            ram_block=ram_block(ram, rec, self.batch_size, bound),
            ssd_bytes=ssd,
            ssd_block=k1,
            static_records=self._cache_records("static_cache", rec, num_records),
            node_records=self._cache_records("node_cache", rec, num_records),
        )

    def _cache_records(self, option: str, rec: int, num_records: int) -> int:
        """Records a cache budget holds (0 = off); a budget that holds no record is an error."""
        capacity: Capacity = getattr(self, option)
        cache = capacity.to_bytes(rec)
        if 0 < cache < rec:
            raise ConfigError(
                f"{self.name(option)}: {human_bytes(cache)} holds no record of {human_bytes(rec)} "
                f"({rec} bytes); use 0 to turn the cache off or at least {rec} bytes"
            )
        return min(cache // rec, int(num_records))

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


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplerOptions)) - {"source"}


def parse_capacity(value: int | str | Capacity, record_nbytes: int, *, what: str) -> int:
    """A positive budget in bytes (:func:`shardkit.units.capacity_bytes`).

    Kept only for ``readers/server.py``, which calls it with this signature; remove it once the
    serve stack builds its budgets through :mod:`shardkit.units` or :class:`SamplerOptions`.
    """
    return units.capacity_bytes(value, record_nbytes, what=what)


def _check_names(values: dict[str, Any], source: Source) -> None:
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        names = ", ".join(option_name(u, source) for u in unknown)
        raise ConfigError(f"unknown sampler option {names}; expected some of {', '.join(sorted(_FIELDS))}")


def _describe(nbytes: int, rec: int) -> str:
    return f"{human_bytes(nbytes)} ({nbytes // rec} records of {rec} bytes)"


def _path_or_none(value: object, what: str) -> Path | None:
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
