"""What a sampler reads: a mixture of one or more datasets with weights (docs/design.md §12).

A single dataset is the mixture of one (:func:`as_source`), so every reader handles one kind of
source: one global key space read through :class:`MixedDataset`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shardkit.closing import Closing
from shardkit.declare import Source, option_name
from shardkit.errors import ConfigError, SchemaError
from shardkit.formats import Dataset, FieldSpec, PayloadArray
from shardkit.formats.metadata import DatasetMeta, read_dataset_meta
from shardkit.formats.reader import Destination, ReadStats, SortedRequest, SortScratch, read_distinct_parts
from shardkit.order.mixture import MixturePlan, parse_weights
from shardkit.order.seeds import check_seed
from shardkit.readers.identity import DatasetIdentity, open_root
from shardkit.stores import Location, Store, StoreOptions, as_location, open_store
from shardkit.stores.cache import cache_root, cached_bytes, footprint
from shardkit.units import human_bytes, parse_count

if TYPE_CHECKING:
    from shardkit.readers.options import SamplerOptions

__all__ = [
    "DATASET_FIELD",
    "Mixture",
    "mix",
    "as_source",
    "source_of",
    "check_schema",
    "MixedPayload",
    "MixedField",
    "DatasetIndex",
    "MixedDataset",
    "MixedIdentity",
    "gather_fields",
    "local_keys",
    "CACHE_DIR_ENV",
    "MIN_FREE_BYTES",
    "MIN_FREE_FRACTION",
    "RemoteCache",
    "default_cache_dir",
    "plan_remote_cache",
]

logger = logging.getLogger(__name__)

#: The batch entry that carries each record's dataset index in a mixture.
DATASET_FIELD = "dataset"


# ---------------------------------------------------------------------------------------------- schema
def _schema_of(meta: DatasetMeta) -> list[tuple[str, object]]:
    """The schema as ``(what, value)`` pairs in the order differences are reported."""
    items: list[tuple[str, object]] = [
        ("payload name", meta.payload),
        (f"{meta.payload} record shape", tuple(meta.record.shape)),
        (f"{meta.payload} record dtype", meta.record.dtype),
        ("fields", sorted(meta.fields)),
    ]
    for name in sorted(meta.fields):
        spec: FieldSpec = meta.fields[name]
        items += [(f"field {name!r} shape", tuple(spec.shape)), (f"field {name!r} dtype", spec.dtype)]
    return items


def check_schema(paths: Sequence[Path | str], metas: Sequence[DatasetMeta], indexed: bool = True) -> None:
    """Raise :class:`~shardkit.errors.SchemaError` naming the first difference from the first dataset
    (payload, fields, shapes, dtypes; compression and shard size may differ). Differing label names
    are logged. With ``indexed`` no dataset may have a field named :data:`DATASET_FIELD`."""
    ref = dict(_schema_of(metas[0]))
    for path, meta in zip(paths[1:], metas[1:]):
        for what, value in _schema_of(meta):
            expected = ref.get(what)
            if expected != value:
                raise SchemaError(
                    f"{path}: {what} differs from the mixture's first dataset {paths[0]}: expected {expected!r}, "
                    f"found {value!r}; every dataset of a mixture needs the same record schema"
                )
        if meta.labels != metas[0].labels:
            logger.warning("%s: label names differ from %s; integer labels mean different classes in the two", path, paths[0])
    if indexed and DATASET_FIELD in metas[0].fields:
        raise SchemaError(
            f"{paths[0]}: has a field named {DATASET_FIELD!r}, which a mixture's batches use for the dataset index"
        )


# ---------------------------------------------------------------------------------------------- mixture
@dataclass(frozen=True)
class Mixture:
    """Datasets with relative weights, as one sampler source (build it with :func:`mix`)."""

    #: The datasets in the order of their index: directories (``Path``) or object-store URLs (``str``).
    paths: tuple[Path | str, ...]
    #: Exact relative weights (:func:`~shardkit.order.mixture.parse_weights`).
    weights: tuple[Fraction, ...]
    #: ``L``, records per epoch (default: the sum of the datasets' sizes).
    epoch_size: int
    #: The mixture's seed, or ``None`` to take the sampler's ``seed``.
    seed: int | None
    #: ``N_i``, records per dataset (from the metadata).
    sizes: tuple[int, ...]
    metas: tuple[DatasetMeta, ...] = field(repr=False, compare=False)
    #: Each dataset's identity when the mixture was made (:func:`~shardkit.readers.identity.dataset_fingerprint`).
    fingerprints: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def resolved(self) -> Mixture:
        """The same mixture with absolute dataset paths."""
        return dataclasses.replace(self, paths=tuple(as_location(p, resolve=True) for p in self.paths))

    def plan(self, seed: int) -> MixturePlan:
        """The mixed order for ``seed`` (this mixture's own seed when it has one)."""
        s = self.seed if self.seed is not None else seed
        return MixturePlan.create(self.sizes, self.weights, self.epoch_size, s)

    @property
    def counts(self) -> tuple[int, ...]:
        """``n_i``, records of dataset ``i`` per epoch."""
        return MixturePlan.create(self.sizes, self.weights, self.epoch_size, 0).counts

    @property
    def payload_name(self) -> str:
        return self.metas[0].payload

    @property
    def record(self) -> FieldSpec:
        return self.metas[0].record

    def describe(self) -> str:
        """``a.ds x3 (n=750/1000), b.ds x1 (n=250/200)``: weights and counts, for logs and the CLI."""
        return ", ".join(
            f"{p} weight {w} ({c} of {n} records per epoch)"
            for p, w, c, n in zip(self.paths, self.weights, self.counts, self.sizes)
        )

    def __str__(self) -> str:
        return "mix(" + ", ".join(f"{p}:{w}" for p, w in zip(self.paths, self.weights)) + ")"

    def fingerprint(self) -> str:
        """SHA-256 (hex) of what defines the mixture's records and counts: every dataset's identity
        when the mixture was made (:attr:`fingerprints`), the weights and the epoch size."""
        doc = {"datasets": list(self.fingerprints), "weights": [str(w) for w in self.weights],
               "epoch_size": self.epoch_size}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def mix(
    datasets: Sequence[tuple[object, object]],
    epoch_size: int | str | None = None,
    seed: int | None = None,
) -> Mixture:
    """A mixture of datasets with relative weights, usable wherever a dataset is.

    Parameters
    ----------
    datasets
        ``[(dataset, weight), ...]``: dataset directories or URLs (or opened datasets) and positive
        relative weights (``3``, ``0.25``, ``"1/3"``).
    epoch_size
        ``L``, records per epoch (a count: ``10000``, ``"10k"``); default: the sum of the sizes.
    seed
        Seed of the mixed order; ``None`` (default) takes the sampler's ``seed``.

    Every epoch holds exactly ``n_i`` records of dataset ``i`` (``w_i L / sum(w)``, rounded by largest
    remainder) in a uniformly random arrangement (:mod:`shardkit.order.mixture`). Datasets that do
    not share one record schema are a :class:`~shardkit.errors.SchemaError`.
    """
    if isinstance(datasets, (str, bytes, os.PathLike)) or not isinstance(datasets, Sequence) or not datasets:
        raise ConfigError(f"datasets: expected a list of (dataset, weight) pairs, found {datasets!r}")
    paths: list[Path | str] = []
    for i, item in enumerate(datasets):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"datasets: entry {i} must be a (dataset, weight) pair, found {item!r}")
        paths.append(_location(item[0], i))
    weights = parse_weights([w for _, w in datasets])
    opened = [open_root(p) for p in paths]  # one GET of each root document in an object store
    fingerprints = tuple(identity.fingerprint for identity, _ in opened)
    metas = tuple(meta for _, meta in opened)
    sizes = tuple(m.num_records for m in metas)
    for p, n in zip(paths, sizes):
        if n < 1:
            raise ConfigError(f"{p}: holds no records; every dataset of a mixture needs at least one")
    length = sum(sizes) if epoch_size is None else parse_count(epoch_size, what="epoch_size", minimum=1)
    s = None if seed is None else check_seed(seed)
    plan = MixturePlan.create(sizes, weights, length, 0)  # validates the epoch size
    check_schema(paths, metas, indexed=not plan.single)
    return Mixture(paths=tuple(paths), weights=weights, epoch_size=length, seed=s, sizes=sizes, metas=metas,
                   fingerprints=fingerprints)


@functools.singledispatch
def _location(ds: object, i: int) -> Path | str:
    """Entry ``i`` of :func:`mix`: a dataset directory or URL (an opened Dataset: its location)."""
    if isinstance(ds, (str, os.PathLike, Store)):
        return as_location(ds)
    raise ConfigError(f"datasets: entry {i} must name a dataset directory or URL, found {ds!r}")


@_location.register(Dataset)
def _dataset_location(ds: Dataset, i: int) -> Path | str:
    return as_location(ds.store)  # ds.path is for messages (secrets redacted)


@functools.singledispatch
def as_source(dataset: object) -> Mixture:
    """What a sampler, server or adapter reads: a :class:`Mixture` as it is, a dataset (directory,
    URL or opened :class:`~shardkit.formats.Dataset`) as the mixture of one with ``L = N``, whose
    order is the dataset's own (see :mod:`shardkit.order.mixture`)."""
    return mix([(dataset, 1)])


@as_source.register(Mixture)
def _mixture_source(dataset: Mixture) -> Mixture:
    return dataset


def source_of(
    paths: Sequence[Location],
    weights: str | Sequence[object] | None = None,
    epoch_size: int | str | None = None,
    seed: int | None = None,
    *,
    source: Source = "python",
) -> Location | Mixture:
    """What a command reads: one path without weights or epoch size is the dataset itself, else a
    :class:`Mixture` (``weights``: a comma-separated string or a sequence, default the datasets'
    sizes). Errors name the options as the user wrote them (``--weights`` on the command line)."""
    if not paths:
        raise ConfigError("expected at least one dataset")
    if len(paths) == 1 and weights is None and epoch_size is None:
        return paths[0]
    name = {o: option_name(o, source) for o in ("weights", "epoch_size", "seed")}
    if weights is None:
        ws: list[object] = [read_dataset_meta(open_store(p)).num_records for p in paths]
    else:
        ws = [w.strip() for w in weights.split(",")] if isinstance(weights, str) else list(weights)
        if len(ws) != len(paths):
            raise ConfigError(f"{name['weights']}: expected one weight per dataset ({len(paths)}), found {len(ws)}: {weights!r}")
    parse_weights(ws, what=name["weights"])
    size = None if epoch_size is None else parse_count(epoch_size, what=name["epoch_size"], minimum=1)
    return mix(list(zip(paths, ws)), epoch_size=size, seed=None if seed is None else check_seed(seed, what=name["seed"]))


# ---------------------------------------------------------------------------------------------- disk tier
class MixedPayload:
    """The payload of every dataset of a mixture, addressed by global key (``offsets[i] + k``): what
    the tiers use of :class:`~shardkit.formats.PayloadArray`, each dataset's part read in one pass."""

    def __init__(self, datasets: Sequence[Dataset], offsets: np.ndarray) -> None:
        self._parts = [d.payload for d in datasets]
        self.offsets = np.asarray(offsets, dtype=np.int64)
        first = self._parts[0]
        self.record, self.record_nbytes, self.dtype = first.record, first.record_nbytes, first.dtype
        self.fill_value = first.fill_value
        self.num_records = int(self.offsets[-1])
        self.path = first.path
        self.stats = first.stats
        #: Every part a local dataset's own reader sharing these counters: one read plan (:meth:`read_into`).
        self._one_plan = all(type(p) is PayloadArray and p.stats is self.stats for p in self._parts)
        self._scratch = SortScratch()

    def empty(self, n: int) -> np.ndarray:
        return self._parts[0].empty(n)

    def stop_with(self, event: threading.Event) -> None:
        """Every part's reads give up once ``event`` is set (:meth:`PayloadArray.stop_with`)."""
        for p in self._parts:
            p.stop_with(event)

    def split(self, keys: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(dataset, request indices, local keys)`` for each dataset that ``keys`` touch."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.size and (int(keys.min()) < 0 or int(keys.max()) >= self.num_records):
            bad = int(keys[(keys < 0) | (keys >= self.num_records)][0])
            raise IndexError(f"mixture: global key {bad} outside [0, {self.num_records})")
        ds = _dataset_of(self.offsets, keys)
        for i in np.unique(ds).tolist():
            idx = np.flatnonzero(ds == i)
            yield int(i), idx, keys[idx] - self.offsets[i]

    def read_into(self, keys: np.ndarray | list[int], dest: Destination) -> None:
        """Records ``keys`` straight into their destinations, each dataset's part in one ascending
        pass per shard. Local datasets share one read plan: the block's global keys are sorted once
        (dataset i's keys are then one contiguous slice), each slice planned by its dataset and the
        plans read as one (:func:`~shardkit.formats.reader.read_distinct_parts`), so a mixture's block
        costs what one dataset's does; a mixture with remote datasets reads each part with its own ``read_into``."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        n = keys.size
        dest.check(n, tuple(self.record.shape), self.dtype, "mixture")
        if not self._one_plan:
            for i, idx, local in self.split(keys):
                self._parts[i].read_into(local, Destination(dest.buffers, dest.which[idx], dest.rows[idx]))
            return
        if n == 0:
            return
        if int(keys.min()) < 0 or int(keys.max()) >= self.num_records:
            bad = int(keys[(keys < 0) | (keys >= self.num_records)][0])
            raise IndexError(f"mixture: global key {bad} outside [0, {self.num_records})")
        req = SortedRequest.of(keys, self.num_records, self._scratch)
        rows = req.byte_rows(dest)
        cuts = np.searchsorted(req.distinct, self.offsets[1:-1]).tolist()
        spans = list(zip([0, *cuts], [*cuts, req.distinct.size]))
        read_distinct_parts(self._parts, [req.distinct[lo:hi] - self.offsets[i] for i, (lo, hi) in enumerate(spans)],
                            [req.first[lo:hi] for lo, hi in spans], dest, rows)  # fmt: skip
        req.copy_duplicates(dest, rows)
        self.stats.add_records(n)

    def read(self, keys: np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Records ``keys`` into ``out[j]`` (:meth:`read_into` with one buffer)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if out is None:
            out = self.empty(keys.size)
        self.read_into(keys, Destination.rows_of(out, keys.size))
        return out

    def close(self) -> None:
        for p in self._parts:
            p.close()


class MixedField:
    """One small field of every dataset, gathered by global key without concatenating the arrays."""

    def __init__(self, parts: Sequence[np.ndarray], offsets: np.ndarray) -> None:
        self._parts = list(parts)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self.shape: tuple[int, ...] = (int(self._offsets[-1]), *parts[0].shape[1:])
        self.dtype = parts[0].dtype

    def __getitem__(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        ds = _dataset_of(self._offsets, keys)
        out = np.empty((keys.size, *self.shape[1:]), dtype=self.dtype)
        for i in np.unique(ds).tolist():
            sel = ds == i
            out[sel] = self._parts[i][keys[sel] - self._offsets[i]]
        return out

    def __len__(self) -> int:
        return self.shape[0]


class DatasetIndex:
    """The ``dataset`` field: each global key's dataset index, computed, not stored."""

    def __init__(self, offsets: np.ndarray) -> None:
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self.shape = (int(self._offsets[-1]),)
        self.dtype = np.dtype(np.int64)

    def __getitem__(self, keys: np.ndarray) -> np.ndarray:
        return _dataset_of(self._offsets, np.asarray(keys, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]


@dataclass(frozen=True)
class MixedIdentity:
    """The identities of every dataset of a mixture: :meth:`check` checks them all."""

    parts: tuple[DatasetIdentity, ...]

    @classmethod
    def of(cls, paths: Sequence[Path | str], options: StoreOptions | None = None) -> MixedIdentity:
        return cls(tuple(DatasetIdentity.of(p, options) for p in paths))

    def check(self, *, wait: bool = True) -> None:
        for part in self.parts:
            part.check(wait=wait)

    def cancel(self) -> None:
        for part in self.parts:
            part.cancel()


def _dataset_of(offsets: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each global key's dataset index (``offsets``: first global key of each dataset)."""
    return (np.searchsorted(offsets, keys, side="right") - 1).astype(np.int64, copy=False)


def local_keys(offsets: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each global key's record key within its dataset (``offsets``: first global key of each)."""
    g = np.asarray(keys, dtype=np.int64)
    out: np.ndarray = g - offsets[_dataset_of(offsets, g)]
    return out


def gather_fields(parts: Sequence[Mapping[str, Any]], offsets: np.ndarray, indexed: bool) -> dict[str, Any]:
    """The small fields of a source's datasets by global key (one dataset's as they are), with
    :data:`DATASET_FIELD`, each record's dataset index, when ``indexed``."""
    out: dict[str, Any] = (
        dict(parts[0]) if len(parts) == 1 else {name: MixedField([f[name] for f in parts], offsets) for name in parts[0]}
    )
    if indexed:
        out[DATASET_FIELD] = DatasetIndex(offsets)
    return out


class MixedDataset(Closing):
    """The disk tier of a mixture: what the tiers use of :class:`~shardkit.formats.Dataset`, over
    global keys, every dataset opened with ``options`` and one set of read counters."""

    def __init__(self, mixture: Mixture, *, stats: ReadStats | None = None, **options: Any) -> None:
        stats = stats if stats is not None else ReadStats()
        self.mixture = mixture
        self.path = mixture.paths[0]
        self._datasets = [Dataset(p, stats=stats, **options) for p in mixture.paths]
        self.offsets = np.concatenate([[0], np.cumsum(mixture.sizes)]).astype(np.int64)
        # One dataset's global keys are its own: its payload serves them as it is (the SSD tier
        # then copies it in the kernel, and locality reads its shards from the node's disk).
        self.payload: PayloadArray | MixedPayload = (
            self._datasets[0].payload if len(self._datasets) == 1 else MixedPayload(self._datasets, self.offsets)
        )
        self.meta = self._datasets[0].meta
        self.payload_name = self.meta.payload
        self.record_nbytes = self.meta.record.nbytes
        self.num_records = int(self.offsets[-1])
        self._fields: dict[str, Any] | None = None

    @property
    def stats(self) -> ReadStats:
        return self._datasets[0].stats

    @property
    def fields(self) -> dict[str, Any]:
        """Every small field by global key (:func:`gather_fields`)."""
        if self._fields is None:
            indexed = not self.mixture.plan(0).single
            self._fields = gather_fields([d.fields for d in self._datasets], self.offsets, indexed)
        return self._fields

    def local_keys(self, keys: np.ndarray) -> np.ndarray:
        """Each global key's record key within its dataset."""
        return local_keys(self.offsets, keys)

    def close(self) -> None:
        for d in self._datasets:
            d.close()


# ---------------------------------------------------------------------------------------------- remote cache
#: The environment variable that moves the default cache (``cache_dir="auto"``) out of the system
#: temp directory (the test suite points it at a temporary directory of its own).
CACHE_DIR_ENV = "SHARDKIT_CACHE_DIR"
#: The default cache leaves at least this much of its disk free, and at least this share of it.
MIN_FREE_BYTES = 1 << 30
MIN_FREE_FRACTION = 0.10


@dataclass(frozen=True)
class RemoteCache:
    """Where a sampler keeps the shards of its remote datasets (:func:`plan_remote_cache`): a cache
    directory and its budget, or ``directory=None`` for ranged reads, with the reason."""

    #: The directory the cache lives in (``<directory>/shardkit-cache-<uid>``), or None: no cache.
    directory: Path | None
    #: The budget of the whole cache root in bytes (``None``: no limit).
    budget: int | None
    #: ``"default"``, ``"explicit"``, ``"off"`` (opted out), ``"no space"`` or ``"local"`` (nothing remote).
    kind: str
    #: Bytes of the source's remote datasets (their shard objects).
    dataset_bytes: int = 0
    #: One line on why, for the plan (``shardkit sample``) and the log.
    reason: str = ""

    @property
    def root(self) -> Path | None:
        """The cache root, ``<directory>/shardkit-cache-<uid>`` (what to remove to free the cache)."""
        return None if self.directory is None else cache_root(self.directory)

    def describe(self) -> list[str]:
        """The memory plan's line about the remote tier (none for a local source)."""
        if self.kind == "local":
            return []
        if self.directory is None:
            return [f"remote cache none: ranged reads of each block's records, every epoch ({self.reason})"]
        budget = "no limit" if self.budget is None else human_bytes(self.budget)
        return [f"remote cache {self.root}, budget {budget} for a dataset of {human_bytes(self.dataset_bytes)} "
                f"({self.reason})"]


def default_cache_dir() -> Path:
    """The directory of the default cache: ``$SHARDKIT_CACHE_DIR`` if set, else the system temp dir."""
    return Path(os.environ.get(CACHE_DIR_ENV) or tempfile.gettempdir())


def plan_remote_cache(mixture: Mixture, options: SamplerOptions) -> RemoteCache:
    """Which local cache the sampler uses for ``mixture``'s datasets in object stores.

    ``cache_dir="auto"`` (the default) puts a node-shared cache in :func:`default_cache_dir`, with
    ``cache_size`` as its budget or else the rule: the remote datasets' bytes if the disk keeps
    :data:`MIN_FREE_FRACTION` of its size and :data:`MIN_FREE_BYTES` free, else what fits (copies
    already in the cache count as room), else no cache (room for less than the largest shard).
    ``cache_dir=None`` is no cache; a directory is used with ``cache_size`` (default: no limit).
    Why the default is a cache: docs/design.md §9.
    """
    remote = [m for p, m in zip(mixture.paths, mixture.metas) if isinstance(p, str)]
    shards = [footprint(max(0, s.nbytes)) for m in remote for s in m.shards]
    nbytes = sum(max(0, s.nbytes) for m in remote for s in m.shards)
    opt = options.name("cache_dir")
    if not remote:
        return RemoteCache(None, None, "local")
    if options.cache_dir is None:
        return RemoteCache(None, None, "off", nbytes, f"{opt} is none")
    if options.cache_dir != "auto":
        return RemoteCache(Path(options.cache_dir), options.cache_size, "explicit", nbytes, f"set by {opt}")
    directory = default_cache_dir()
    if not directory.is_dir():
        raise ConfigError(f"{CACHE_DIR_ENV}: expected an existing directory for the default cache, "
                          f"found {str(directory)!r}")
    if options.cache_size is not None:
        return RemoteCache(directory, options.cache_size, "default", nbytes, f"default, {options.name('cache_size')}")
    usage = shutil.disk_usage(directory)
    keep = max(MIN_FREE_BYTES, int(usage.total * MIN_FREE_FRACTION))
    cached = cached_bytes(directory)
    room = usage.free + cached - keep
    if room < max(shards, default=0) or room <= 0:
        why = (f"{human_bytes(usage.free)} free on {directory}, the default cache keeps "
               f"{human_bytes(keep)} free; set {opt} to a directory with room, or {options.name('cache_size')}")
        return RemoteCache(None, None, "no space", nbytes, why)
    if room >= sum(shards):
        return RemoteCache(directory, sum(shards), "default", nbytes, "default: the whole dataset fits")
    return RemoteCache(directory, room, "default", nbytes,
                       f"default: what fits, keeping {human_bytes(keep)} of the disk free")
