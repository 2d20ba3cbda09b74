"""The sampler's options: one frozen, validated value that every entry point builds and passes down,
and the memory plan they resolve to (docs/design.md §2, *Seams*, and docs/design.md §7).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shardkit import units
from shardkit.declare import Parser, UserOptions, choice, count, nested, option
from shardkit.errors import ConfigError
from shardkit.formats import DEFAULT_GAP_BYTES
from shardkit.formats.ranged import DEFAULT_REMOTE_GAP_BYTES
from shardkit.formats.reader import SCATTER_MIN_BYTES
from shardkit.order.schedule import (
    BATCH_PREFETCH,
    BLOCK_RECORD_BYTES,
    DUPLICATE_RECORD_BYTES,
    MODES,
    PERMUTATIONS,
    STAGED_RECORD_BYTES,
    block_limits,
    consumer_records_bound,
    pool_batches,
    ram_block,
    span_block,
    ssd_block,
)
from shardkit.order.seeds import check_seed
from shardkit.stores import StoreOptions
from shardkit.tiers.buffers import HOLD_BATCHES
from shardkit.tiers.ssd import READ_CHUNK_BYTES
from shardkit.units import Capacity, human_bytes, parse_bytes

__all__ = ["TIERS", "parse_tiers", "path_or_none", "SamplerOptions", "TierSizes", "DEFAULTS", "resolve_decoders"]

#: Known tiers, ordered slow -> fast. ``disk`` (the dataset itself) is implicit.
TIERS = ("ssd", "ram")


def parse_tiers(tiers: str | Sequence[str], *, what: str = "tiers") -> tuple[str, ...]:
    """Normalise ``"ram"``, ``"ram,ssd"``, ``"ssd,ram"`` or ``["ram", "ssd"]`` to slow -> fast order
    (``ram`` is mandatory)."""
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
    """The sampler's whole memory plan for one dataset and consumer count (see
    :meth:`SamplerOptions.tier_sizes`): ``ram_bytes`` covers the batch buffers, the static cache
    and the SSD copy buffer (not the node-shared fields and epoch order).
    """

    #: The RAM budget in bytes.
    ram_bytes: int
    #: ``K2``, the largest RAM block in records (blocks double from ``first_block`` up to it).
    ram_block: int
    #: The SSD budget and ``K1``, the largest SSD reservoir (``None`` without the SSD tier).
    ssd_bytes: int | None
    ssd_block: int | None
    #: ``M``, records pinned by the static cache (0 = off; ``num_records`` = the whole dataset).
    static_records: int
    first_block: int = 1
    #: Batch buffers of the run (two blocks in flight and the batches the consumer holds).
    pool_batches: int = 1
    batch_size: int = 1
    #: ``N``.
    num_records: int = 0
    #: The disk -> SSD copy buffer (0 without the SSD tier; see :mod:`shardkit.tiers.ssd_slots`).
    ssd_copy_bytes: int = 0
    record_nbytes: int = 1
    #: Records the node cache pins on the node's local disk (0 = off; only with ``locality``).
    node_records: int = 0
    #: Small records: each block is read whole into one of two staging buffers of ``ram_block``
    #: records, in key order, and each batch is taken from it by rank (docs/design.md §4, *Staged
    #: blocks*); the pool is then only the batches in flight.
    staged: bool = False
    #: Blocks read from the dataset jump to ``ram_block`` after one of at least this many records
    #: (:func:`~shardkit.order.schedule.span_block`: a staged plan's blocks span the whole dataset
    #: early); ``None``: they double all the way.
    span_block: int | None = None

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
    def stage_bytes(self) -> int:
        """The two staging buffers of a staged plan (0 otherwise)."""
        return 2 * self.ram_block * self.record_nbytes if self.staged else 0

    @property
    def pool_bytes(self) -> int:
        """The pipeline's buffers: the batch pool and, in a staged plan, the staging buffers."""
        return self.pool_batches * self.batch_size * self.record_nbytes + self.stage_bytes

    @property
    def cache_bytes(self) -> int:
        return self.static_records * self.record_nbytes

    def describe(self) -> list[str]:
        """What the budget was spent on, one line each (``shardkit sample`` prints these)."""
        rec = self.record_nbytes
        lines = [
            f"blocks       {self.first_block} records first, doubling to {self.ram_block} records "
            f"({human_bytes(self.ram_block * rec)}, {self.ram_block / max(1, self.num_records):.1%} of the dataset)"
            + (f", at once after a block of {self.span_block}+ (it spans the dataset)" if self.span_block else ""),
            f"buffers      {self.pool_batches} batches of {self.batch_size} "
            f"({human_bytes(self.pool_batches * self.batch_size * rec)})"
            + (f", 2 staging blocks ({human_bytes(self.stage_bytes)})" if self.staged else ""),
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


#: A staged plan's batch buffers: those the consumer holds and receives ahead, the one being
#: assembled and one a block leaves open for the next.
STAGE_POOL_BATCHES = HOLD_BATCHES + BATCH_PREFETCH + 2
#: Blocks of fewer batches than this are read straight into their batch buffers (few buffers to
#: scatter into; a staging buffer would only add a copy).
STAGE_MIN_BATCHES = 2

#: The smallest disk -> SSD copy buffer worth taking out of the RAM budget (see tier_sizes).
MIN_COPY_BYTES = 1 << 20
#: The automatic static cache pins nothing when it would hold fewer than one record in this many
#: and fewer records than one block: it would spare under 1% of the reads, while every block record
#: is looked up in it (the leftover of a budget spent on blocks of small records is typically a few
#: thousand records of millions; large records' blocks are small, so their leftover is kept).
AUTO_CACHE_MIN_SHARE = 100

# Default budgets (values, so every SamplerOptions shares them).
_RAM_SIZE = Capacity(nbytes=512 << 20)
_SSD_SIZE = Capacity(nbytes=4 << 30)
_OFF = Capacity(nbytes=0)


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


def _tiers(value: Any, what: str) -> tuple[str, ...]:
    return parse_tiers(value, what=what)


def _capacity(value: Any, what: str) -> Capacity:
    return units.parse_capacity(value, what=what)


def _optional_capacity(value: Any, what: str) -> Capacity:
    return units.parse_capacity(0 if value is None else value, what=what, allow_zero=True)


def _count(minimum: int, optional: bool = False) -> Parser:
    """A whole count of at least ``minimum`` (``None`` kept when ``optional``)."""
    base = count(minimum)
    return (lambda value, what: None if value is None else base(value, what)) if optional else base


def _gap(value: Any, what: str) -> int:
    return DEFAULT_GAP_BYTES if value is None else parse_bytes(value, what=what, allow_zero=True)


def _remote_gap(value: Any, what: str) -> int:
    return parse_bytes(value, what=what, allow_zero=True)


def _cache_dir(value: object, what: str) -> Path | Literal["auto"] | None:
    """``"auto"`` (the default cache), ``None`` or ``"none"`` (no cache: ranged reads) or a directory."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "none"):
        return "auto" if value.strip().lower() == "auto" else None
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{what}: expected 'auto', 'none' or a directory path, found {value!r}")
    return path_or_none(value, what)


def _decode(value: Any, what: str) -> bool | str:
    """True (decode on the CPU), False (the stored bytes) or ``"cuda"``; the CLI's cpu/stored/cuda too."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "cpu", "false", "stored", "cuda"):
        v = value.strip().lower()
        return "cuda" if v == "cuda" else v in ("true", "cpu")
    raise ConfigError(f"{what}: expected True (decode on the CPU), False (the stored bytes and their lengths) or "
                      f"'cuda' (on the command line: cpu, stored or cuda), found {value!r}")


def _optional_bytes(value: Any, what: str) -> int | None:
    return None if value is None else parse_bytes(value, what=what)


def _seed(value: Any, what: str) -> int:
    return check_seed(value, what=what)


@dataclass(frozen=True)
class SamplerOptions(UserOptions):
    """Every option of the tiered sampler, validated and normalised on construction.

    Build one with keyword arguments (values are parsed: ``ram_size="2GiB"``, ``tiers="ram,ssd"``),
    or with :meth:`parse` when the values come from a user (it refuses unknown names), and derive
    variants with :meth:`replace` (validated again). The options of ``store`` (a
    :class:`~shardkit.stores.StoreOptions`) that have a flag are taken by name too
    (``remote_concurrency=8``) and read with :meth:`value`. ``source`` (``"python"`` or ``"cli"``)
    says how errors spell option names.
    """

    # ------------------------------------------------------------------ tiers
    tiers: tuple[str, ...] = option(
        ("ram",), "Tiers", _tiers, show=",".join,
        help="Tiers below the consumer: 'ram' or 'ram,ssd' (either order; a list in Python).")
    ram_size: Capacity = option(
        _RAM_SIZE, "Tiers", _capacity,
        help="Everything this consumer's sampler holds in RAM, bytes (2GiB, 500MB) or records (10000records), at "
             "least two records: batch buffers for the blocks in flight, then a static cache of what is left "
             "(the whole dataset when it fits: later epochs read nothing). `shardkit sample` prints the split.",
        doc="Blocks are sized for read speed (see :mod:`shardkit.order.schedule`); with the SSD tier the "
            "disk -> SSD copy buffer comes out of it too. Not in it: the per-record fields and the epoch order, "
            "which are per dataset and shared by the processes of a node (``node_sharing``).")
    ssd_size: Capacity = option(
        _SSD_SIZE, "Tiers", _capacity,
        help="SSD-tier budget (same syntax, at least --ram-size): two reservoirs of half of it. Only with "
             "--tiers ram,ssd.")
    ssd_dir: Path | None = option(
        None, "Tiers", path_or_none, cli_type=Path,
        help="Directory for the run's private SSD reservoirs (default: the system temp dir).")
    static_cache: Capacity | Literal["auto"] = option(
        "auto", "Tiers", _cache_option,
        help="The part of --ram-size that pins a random subset of records for the whole run, never evicted: "
             "auto (what the blocks do not need, unless that is under 1% of the records and of a block), bytes (256MiB), "
             "records (1000records), or 0 = off.",
        doc="CoorDL's MinIO policy; shared by the processes of a node that use the same dataset, seed and size "
            "(see :mod:`shardkit.tiers.static_cache`).")
    node_sharing: bool = option(
        True, "Tiers", _flag, cli_type=bool,
        help="Share per-dataset memory (fields, the exact epoch order, the static cache) among the processes of "
             "this machine through private files under /dev/shm; off keeps everything private to the process.",
        doc="See :mod:`shardkit.tiers.shm`.")
    # ------------------------------------------------------------------ order
    batch_size: int = option(256, "Order", count(1), cli_type=int, help="Records per batch of this consumer.")
    epochs: int | None = option(
        1, "Order", _count(0, optional=True), cli_type=int,
        help="Epochs per iteration (None in Python: forever); iterating again continues with the next ones.")
    start_epoch: int = option(0, "Order", count(0), cli_type=int, help="First epoch of the first iteration.")
    seed: int = option(
        0, "Order", _seed, cli_type=int, help="An integer in [0, 2**64); (seed, epoch) defines each epoch's order.",
        doc="See :mod:`shardkit.order.seeds`.")
    mode: str = option(
        "epoch", "Order", choice(*MODES),
        help="epoch: uniform random permutation per epoch; replacement: independent uniform reservoirs; "
             "sequential: storage order.")
    permutation: str = option(
        "auto", "Order", choice(*PERMUTATIONS),
        help="Epoch order: exact (numpy permutation, 8 bytes a record), feistel (on-demand bijection, "
             "statistically uniform) or auto (exact up to 1e8 records).",
        doc="See :mod:`shardkit.order.bijection`.")
    limit: int | None = option(
        None, "Order", _count(0, optional=True), cli_type=int,
        help="Stop after this many records emitted to this consumer (default: all epochs).")
    drop_last: bool = option(
        False, "Order", _flag, cli_type=bool,
        help="Drop the incomplete final global batch, so every consumer gets the same number of full batches "
             "(what DDP needs).")
    # ------------------------------------------------------------------ distribution
    rank: int = option(0, "Distribution", count(0), cli_type=int, help="This consumer's index c (0 <= c < world size).")
    world_size: int = option(1, "Distribution", count(1), cli_type=int,
                             help="Number of consumers W sharing each global batch.")
    locality: bool = option(
        False, "Distribution", _flag, cli_type=bool,
        help="Many nodes: each node pins a disjoint random part of the dataset (--static-cache in RAM, "
             "--node-cache on its disk) and the ranks take their keys of every global batch from their own "
             "node's cache where they can; every step keeps its set of records.",
        doc="docs/design.md §10, :mod:`shardkit.order.locality`.")
    nodes: int = option(
        1, "Distribution", count(1), cli_type=int,
        help="Nodes M the ranks run on (with --locality); node m has the consecutive ranks m*R .. (m+1)*R-1.")
    workers_per_rank: int = option(
        1, "Distribution", count(1), cli_type=int,
        help="Consumers per rank (DataLoader workers): consumer c is worker c mod k of rank c div k.")
    node_cache: Capacity = option(
        _OFF, "Distribution", _optional_capacity,
        help="With --locality and --tiers ram: records this node pins on its local disk on top of "
             "--static-cache, bytes or records; 0 = off.",
        doc="Written once per node and reused by every process of the node and by later runs "
            "(see :mod:`shardkit.tiers.node_cache`).")
    node_cache_dir: Path | None = option(
        None, "Distribution", path_or_none, cli_type=Path,
        help="Node-local directory of the node cache (default: the system temp dir).")
    # ------------------------------------------------------------------ storage
    gap_bytes: int = option(
        DEFAULT_GAP_BYTES, "Storage", _gap, show=human_bytes,
        help="Gaps between wanted records up to this size (bytes or 64KiB) are read rather than skipped, "
             "so requests stay large and sequential.")
    remote_gap_bytes: int = option(
        DEFAULT_REMOTE_GAP_BYTES, "Storage", _remote_gap, show=human_bytes,
        help="For a dataset in an object store read without a cache: gaps up to this size between wanted "
             "records are read rather than requested separately. Default 0: an epoch fetches its records' bytes "
             "once (at most 1.1x the dataset, measured with blocks of a quarter of it; a 1MiB gap fetched 3x) in "
             "one request per run of adjacent records.",
        doc="See docs/design.md §9 (*Ranged reads*) for the rule and the measurement.")
    store: StoreOptions = nested(
        StoreOptions, "Storage",
        help="For a dataset in an object store: how the store is driven (concurrency, timeouts, retries), "
             "a StoreOptions; its options that have a flag are sampler options too.")
    cache_dir: Path | Literal["auto"] | None = option(
        "auto", "Storage", _cache_dir, show=lambda v: "none" if v is None else str(v),
        help="For a dataset in an object store: the local directory whose node-shared cache keeps fetched "
             "shards, so an epoch fetches the dataset once and later epochs and runs read it locally (shared "
             "safely by concurrent processes). auto (default): the system temp dir, or $SHARDKIT_CACHE_DIR, "
             "with a budget sized from free space; none (None in Python): no cache, ranged reads of only the "
             "records each block needs, every epoch.",
        doc="Ignored for local datasets; kept after the run (remove ``<dir>/shardkit-cache-<uid>`` to free it); "
            "see :func:`shardkit.readers.sources.plan_remote_cache` for the budget rule and "
            ":mod:`shardkit.stores.cache`.")
    cache_size: int | None = option(
        None, "Storage", _optional_bytes,
        help="Budget of the cache in bytes (e.g. 50GiB). Default: with --cache-dir DIR the whole dataset; with "
             "auto the dataset's size if that leaves 10% of the disk and at least 1GiB free, else what fits.")
    decode_workers: int | None = option(
        None, "Storage", _count(0, optional=True), cli_type=int,
        help="Threads that decode compressed records (jpeg, png, webp, flac, zstd, ...) straight into the batch "
             "buffers while the next records are read; 0 decodes in the reading thread. Default: one per CPU this "
             "process may use.",
        doc="See docs/design.md §4 (*Decoding*).")
    decode: bool | str = option(
        True, "Storage", _decode, show=lambda v: {True: "cpu", False: "stored"}.get(v, v),
        help="cpu (True in Python): batches hold decoded records. stored (False): each record's stored bytes "
             "(a jpeg stream, ...) at the start of its row, the payload as uint8 [B, record bytes], and "
             "<payload>_nbytes [B] their lengths, to decode elsewhere. cuda: the torch adapter decodes JPEG "
             "batches on the GPU (torchvision.io.decode_jpeg); an error where there is no CUDA device.",
        doc="See docs/design.md §4 (*Decoding*).")

    KIND = "sampler option"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank >= self.world_size:
            name = self.name
            raise ConfigError(
                f"{name('rank')}: expected 0 <= {name('rank')} < {name('world_size')}={self.world_size}, "
                f"found {self.rank!r}"
            )
        self._check_layout()

    def _check_layout(self) -> None:
        """Consumers, workers per rank and nodes must nest (W = ranks * k, ranks = M * R); the node
        cache needs locality and the RAM tier alone."""
        name = self.name
        w, k, m = self.world_size, self.workers_per_rank, self.nodes
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
        if self.node_cache.to_bytes(1):
            if not self.locality:
                raise ConfigError(
                    f"{name('node_cache')}: a node's disk cache holds its part of the node partition, which only "
                    f"{name('locality')} uses; found {name('node_cache')}={self.node_cache} without {name('locality')}"
                )
            if "ssd" in self.tiers:
                raise ConfigError(
                    f"{name('node_cache')}: the node cache is this node's local-disk tier; with "
                    f"{name('tiers')}={','.join(self.tiers)} the SSD tier would copy the same records again. "
                    f"Use {name('tiers')}='ram' with {name('node_cache')}, or the SSD tier without it"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def given(cls, options: SamplerOptions | None = None, **overrides: Any) -> SamplerOptions:
        """What an entry point taking ``options`` and ``**overrides`` runs with: ``options`` (default:
        the defaults) with ``overrides`` applied, validated; an unknown name is a ConfigError."""
        if options is None:
            return cls.parse(**overrides)
        if not isinstance(options, SamplerOptions):
            raise ConfigError(f"options: expected a SamplerOptions, found {type(options).__name__}")
        return options.replace(**overrides)

    def replace(self, **values: Any) -> SamplerOptions:
        """A copy with ``values`` changed, validated again; unknown names are a ConfigError."""
        self.check_names(values, self.source)
        return dataclasses.replace(self, **values)

    def dataset_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~shardkit.formats.Dataset` for the bottom tier (the dataset
        itself): gap thresholds, and for an object store its concurrency and local cache. ``"auto"``
        is resolved by the sampler first (:func:`~shardkit.readers.sources.plan_remote_cache`); left
        unresolved it means no cache. ``ask_priority``: this consumer's worker index in its rank (the
        main process takes the workers' first batches in that order), the turn of its first block's
        asks to a cache copy another process fills; ``fillers``: the workers of the rank, which fill
        the cache together."""
        return {
            "ask_priority": self.rank % self.workers_per_rank,
            "fillers": self.workers_per_rank,
            "gap_bytes": self.gap_bytes,
            "remote_gap_bytes": self.remote_gap_bytes,
            "store_options": self.store,
            "cache_dir": None if self.cache_dir == "auto" else self.cache_dir,
            "cache_size": self.cache_size,
            "decode_workers": self.decoders(),
            "decode": self.decode is True,
        }

    def decoders(self) -> int:
        """``decode_workers`` resolved (see :func:`resolve_decoders`)."""
        return resolve_decoders(self.decode_workers)

    # ------------------------------------------------------------------ resolution
    def tier_sizes(self, record_nbytes: int, num_records: int, num_keys: int | None = None) -> TierSizes:
        """The memory plan for records of ``record_nbytes`` bytes (see :class:`TierSizes`).

        ``num_records`` is the length of an epoch's order; ``num_keys`` the distinct records behind
        it (default: the same; a mixture's differ). Raises :class:`~shardkit.errors.ConfigError`,
        naming the option and the record size, when a tier budget holds fewer than two records, the
        SSD budget is below the RAM budget, or a static cache that is not off holds no record or
        leaves ``ram_size`` fewer than two records for blocks.
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
            first, largest = block_limits(ram_block(ram, rec, b, bound), rec, b, n, self.gap_bytes, bound, ssd is None,
                                          self.workers_per_rank)
            return TierSizes(ram, largest, ssd, k1, n, first, BATCH_PREFETCH + HOLD_BATCHES + 1, b, n, copy_bytes, rec,
                             self._node_records(rec, n))  # fmt: skip
        if pinned in (None, 0) and rec < SCATTER_MIN_BYTES:
            staged = self._staged_plan(ram, rec, b, n, bound, ssd, k1, blocks_budget, copy_bytes)
            if staged is not None:
                return staged
        if pinned is not None:
            blocks_budget -= pinned * rec
        # Blocks of whole batches, read straight into the batch buffers: the pool is the memory.
        # SSD reservoirs are not whole batches, so their blocks may start inside one (one more each).
        # Each block record also costs BLOCK_RECORD_BYTES of bookkeeping (its key, its row, the
        # read's sort): counted here, or blocks of small records would take far more than the budget.
        aligned = ssd is None
        per_block = (max(0, blocks_budget - HOLD_BATCHES * b * rec) // (b * (rec + BLOCK_RECORD_BYTES))) // 2
        per_block -= 0 if aligned else 1
        if per_block >= 1:
            first, largest = block_limits(per_block * b, rec, b, n, self.gap_bytes, bound, aligned, self.workers_per_rank)
        else:
            # A budget of fewer batches than the pipeline holds: blocks smaller than a batch (the
            # batch buffers then exceed the budget; a batch cannot be smaller than the batch size).
            aligned = False
            first, largest = block_limits(ram_block(blocks_budget, rec, b, bound), rec, b, n, self.gap_bytes,
                                          bound, aligned, self.workers_per_rank)  # fmt: skip
        pool = pool_batches(largest, b, aligned)
        if pinned is None:  # auto: the budget the blocks do not need caches records
            pinned = min(n, max(0, blocks_budget - pool * b * rec - 2 * largest * BLOCK_RECORD_BYTES) // rec)
            if pinned * AUTO_CACHE_MIN_SHARE < n and pinned < largest:
                pinned = 0  # saves almost no reads, yet every block record would be looked up
        return TierSizes(ram, largest, ssd, k1, pinned, first, pool, b, n, copy_bytes, rec, self._node_records(rec, n))

    def _staged_plan(self, ram: int, rec: int, b: int, n: int, bound: int, ssd: int | None, k1: int | None,
                     budget: int, copy_bytes: int) -> TierSizes | None:
        """The plan of small records without a static cache (or with an automatic one that would pin
        nothing): two staging blocks and a pool of the batches in flight only, instead of two
        blocks of batch buffers (the same bytes: the scatter into hundreds of batch buffers was
        most of a block read's CPU). ``None`` when the budget holds fewer than
        :data:`STAGE_MIN_BATCHES` batches a block, or the automatic cache would pin records."""
        pool = STAGE_POOL_BATCHES
        extra = STAGED_RECORD_BYTES + (DUPLICATE_RECORD_BYTES if self.mode == "replacement" else 0)
        if n > 1 << 31:  # int64 keys and sort order
            extra = BLOCK_RECORD_BYTES
        per_block = max(0, budget - pool * b * rec) // (2 * (rec + extra)) // b
        if per_block < STAGE_MIN_BATCHES:
            return None
        aligned = ssd is None
        first, largest = block_limits(per_block * b, rec, b, n, self.gap_bytes, bound, aligned, self.workers_per_rank)
        pinned = 0
        if self.static_cache == "auto":
            pinned = min(n, max(0, budget - pool * b * rec - 2 * largest * (rec + extra)) // rec)
            if pinned * AUTO_CACHE_MIN_SHARE >= n or pinned >= largest:
                return None  # worth a cache: the plan that reads pinned records apart
        return TierSizes(ram, largest, ssd, k1, 0, first, pool, b, n, copy_bytes, rec, self._node_records(rec, n),
                         staged=True, span_block=span_block(n, rec, self.gap_bytes))

    def _node_records(self, rec: int, n: int) -> int:
        """Records ``node_cache`` pins on the node's disk (0 = off)."""
        return min(self._cache_records("node_cache", "node cache", rec), n)

    def _cache_records(self, option: str, what: str, rec: int) -> int:
        """Records cache ``option`` (a Capacity) holds; a budget of no record is an error."""
        cache = getattr(self, option).to_bytes(rec)
        if 0 < cache < rec:
            raise ConfigError(
                f"{self.name(option)}: {human_bytes(cache)} holds no record of {human_bytes(rec)} "
                f"({rec} bytes); use 0 to turn the {what} off or at least {rec} bytes"
            )
        return int(cache // rec)

    def _static_records(self, budget: int, rec: int, n: int) -> int | None:
        """Records an explicit ``static_cache`` pins (``None`` for ``"auto"``), checked against the
        part of ``ram_size`` it comes out of."""
        if self.static_cache == "auto":
            return None
        pinned = min(self._cache_records("static_cache", "static cache", rec), n)

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


#: The defaults, for entry points that show them (CLI help) or take them as keyword defaults.
DEFAULTS = SamplerOptions()
SamplerOptions.__doc__ = f"{SamplerOptions.__doc__}{SamplerOptions.describe()}"


def resolve_decoders(decode_workers: int | None) -> int:
    """A ``decode_workers`` option resolved: the CPUs this process may run on when not given."""
    if decode_workers is not None:
        return decode_workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
