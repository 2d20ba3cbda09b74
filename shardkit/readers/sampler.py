"""The tiered sampler: an exactly uniform random order from sequential reads (DESIGN §4).

See :class:`TieredSampler`; its options are :class:`~shardkit.readers.config.SamplerOptions`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConfigError, OutOfSpaceError, SamplerError
from shardkit.formats import Dataset
from shardkit.readers.config import SamplerOptions, TierSizes
from shardkit.readers.identity import DatasetIdentity, dataset_fingerprint
from shardkit.readers.interface import Batch, ElementSpec
from shardkit.readers.locality import NodeLayout, NodePartition, local_consumer_plan, node_partition
from shardkit.readers.node_cache import NodeCache, entry_name, node_cache_dir
from shardkit.readers.pipeline import BatchReady, EpochEnd, Pipeline, RunDone, Segment
from shardkit.readers.schedule import ConsumerPlan, batches_per_consumer, consumer_plan, epoch_stream, truncate_plan
from shardkit.readers.static_cache import StaticCache, pinned_keys
from shardkit.readers.stats import SamplerStats
from shardkit.stores import Location, as_location
from shardkit.units import human_bytes, parse_count

__all__ = ["TieredSampler", "STATE_VERSION"]

logger = logging.getLogger(__name__)

#: Version of the :meth:`TieredSampler.state_dict` layout and of the orders it refers to. Version 2:
#: orders are drawn from :mod:`shardkit.readers.seeds` domains, so a version-1 position points into
#: an order that is no longer produced.
STATE_VERSION = 2
#: Bytes per SSD reservoir directory beyond the payload (zarr documents, index, fields).
_SSD_OVERHEAD = 1 << 20


class TieredSampler:
    """Batches of a shardkit dataset in an exactly uniform random order, with sequential reads.

    Tiers are ordered slow -> fast: the dataset on disk, an optional SSD tier (reservoirs of ``K1``
    records written as shardkit datasets under a private directory of ``ssd_dir``) and the RAM
    tier (two buffers of ``K2`` records). Records cross every tier boundary once per epoch, in
    ascending offset order within each file; the batch creator emits them in the epoch's order.
    Implements the :class:`~shardkit.readers.interface.Sampler` protocol.

    Parameters
    ----------
    dataset
        Dataset directory, object-store URL (``s3://bucket/ds``, ...; see :mod:`shardkit.stores.url`)
        or an opened :class:`~shardkit.formats.Dataset` (only its location is used; the sampler opens
        its own reader so it can count reads of the bottom tier).
    options
        A :class:`~shardkit.readers.config.SamplerOptions` (default: all defaults).
    **overrides
        Any option of :class:`~shardkit.readers.config.SamplerOptions` by name (``tiers``,
        ``ram_size``, ``ssd_size``, ``ssd_dir``, ``batch_size``, ``epochs``, ``seed``, ``mode``,
        ``rank``, ``world_size``, ``drop_last``, ``limit``, ``gap_bytes``, ``start_epoch``,
        ``static_cache``), applied on top of ``options``; the option documentation lives there.

    Notes
    -----
    Order: in ``epoch`` mode each epoch's order ``pi`` is ``schedule.epoch_permutation(seed,
    epoch, N)``; consumer ``c`` of ``W`` takes its slice of every global batch (see
    :mod:`shardkit.readers.schedule`), and its creators read only those keys.

    Batches are dicts of numpy arrays: the payload (``"image"``/``"audio"``) ``[n, ...]``, every
    per-record field, and ``"key"`` (int64 global record index). Each batch owns its arrays.

    Resume: :meth:`state_dict` holds ``(seed, epoch, position)``, where position counts records of
    ``pi`` consumed by all consumers together (a multiple of the global batch ``B * W`` except at
    the tail). ``pi`` does not depend on ``W``, so :meth:`load_state_dict` on a sampler with another
    world size continues the same order from that position, reading only the records that are left.

    Static cache: ``M`` records (a uniformly random subset P of the whole dataset drawn once from
    the seed, independent of the epoch orders) are read once at the start of the first epoch into
    one RAM array and kept until :meth:`close`; each RAM block copies its pinned keys from there and
    reads only the others. The order is unchanged. See :mod:`shardkit.readers.static_cache`.

    Many nodes (``locality=True``, DESIGN §10): node ``m`` of ``nodes`` pins its part of a node
    partition (a uniformly random subset of the keys, disjoint from every other node's, drawn from
    the seed and the node count) in the static cache and, with ``node_cache``, on its local disk.
    ``pi`` and its global batches stay what they are; inside each step's global batch every
    consumer takes exactly its usual number of keys, as many as possible from its own node's cache
    (:mod:`shardkit.readers.locality`), so storage serves only the misses. Every consumer computes
    the same assignment from the options alone, without communication: every rank must be given
    the same options (``static_cache``, ``node_cache``, ``nodes``, ``workers_per_rank``, seed).

    Dataset identity: the sampler checks before each epoch and after every block it reads that the
    dataset is still the one it opened, and stops with a :class:`~shardkit.errors.SamplerError`
    naming the path otherwise (see :mod:`shardkit.readers.identity`).
    """

    def __init__(
        self,
        dataset: Location | Dataset,
        options: SamplerOptions | None = None,
        **overrides: Any,
    ) -> None:
        if options is not None and not isinstance(options, SamplerOptions):
            raise ConfigError(f"options: expected a SamplerOptions, found {type(options).__name__}")
        opts = SamplerOptions.parse(**overrides) if options is None else options.replace(**overrides)
        self.options = opts
        #: The dataset: a local directory (Path) or an object-store URL (str).
        self.path: Path | str = as_location(dataset.path if isinstance(dataset, Dataset) else dataset)
        before = _fingerprint_or_none(self.path)
        self._ds = Dataset(self.path, **opts.dataset_options())  # metadata + small fields
        self.num_records = self._ds.num_records
        self.record_nbytes = self._ds.record_nbytes
        self.payload_name = self._ds.payload_name
        self.fields = self._ds.fields
        self._ds.close()  # payload reads go through each run's own reader
        #: The dataset as it was when the fields above were loaded (see shardkit.readers.identity).
        self.identity = DatasetIdentity.of(self.path, opts.dataset_options()["store_options"])
        if before != self.identity.fingerprint:
            raise SamplerError(f"{self.path}: the dataset changed while the sampler opened it; try again once it is complete")
        self.sizes: TierSizes = opts.tier_sizes(self.record_nbytes, self.num_records)
        self.ssd_dir: Path | None = None
        if self.sizes.ssd_block is not None:
            self.ssd_dir = opts.ssd_dir if opts.ssd_dir is not None else Path(tempfile.gettempdir())
            if not self.ssd_dir.is_dir():
                raise ConfigError(f"{opts.name('ssd_dir')}: expected an existing directory, found {str(self.ssd_dir)!r}")
            self._check_ssd_space()
        self.stats = SamplerStats()
        self._cache: StaticCache | None = None
        #: Where the consumers sit and which node pins which key (``locality`` only).
        self.layout: NodeLayout | None = None
        self.partition: NodePartition | None = None
        if opts.locality:
            self._cache = self._node_cache()
        elif self.sizes.static_records:
            self._cache = StaticCache(pinned_keys(opts.seed, self.num_records, self.sizes.static_records))
        self._start_epoch = opts.start_epoch
        self._epoch = opts.start_epoch
        self._position = 0
        self._run_ref: weakref.ref[_Run] | None = None

    def _node_cache(self) -> StaticCache | None:
        """This node's part of the node partition: depths ``[0, static)`` in RAM, the next
        ``node_cache`` records on the node's disk (see :mod:`shardkit.readers.node_cache`)."""
        o, sizes = self.options, self.sizes
        self.layout = NodeLayout(o.world_size, o.workers_per_rank, o.nodes)
        node = self.layout.node_of(o.rank)
        self.partition = node_partition(o.seed, self.num_records, o.nodes, sizes.static_records + sizes.node_records)
        ram = min(sizes.static_records, self.partition.per_node)
        ram_keys = self.partition.pinned_keys(node, 0, ram)
        disk_keys = self.partition.pinned_keys(node, ram)
        if not disk_keys.size:
            return StaticCache(ram_keys) if ram_keys.size else None
        if o.node_cache_dir is not None and not o.node_cache_dir.is_dir():
            raise ConfigError(f"{o.name('node_cache_dir')}: expected an existing directory, found {str(o.node_cache_dir)!r}")
        return NodeCache(
            ram_keys, disk_keys, dataset=self.path, directory=node_cache_dir(o.node_cache_dir),
            name=entry_name(self.identity.fingerprint, o.seed, o.nodes, node, ram, self.partition.per_node),
            stats=self.stats.cache, dataset_options=o.dataset_options(),
        )  # fmt: skip

    def _plan(self, stream: np.ndarray, position: int) -> ConsumerPlan:
        """This consumer's keys of ``stream`` from ``position``: its slices of the global batches, or
        with ``locality`` its node-aware share of them (same counts, same global batches)."""
        o = self.options
        if self.layout is not None and self.partition is not None:
            return local_consumer_plan(stream, position, o.batch_size, o.rank, self.layout, self.partition, o.drop_last).plan
        return consumer_plan(stream, position, o.batch_size, o.rank, o.world_size, o.drop_last)

    # ------------------------------------------------------------------ options
    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def rank(self) -> int:
        return self.options.rank

    @property
    def world_size(self) -> int:
        return self.options.world_size

    @property
    def tiers(self) -> tuple[str, ...]:
        return self.options.tiers

    @property
    def ram_block(self) -> int:
        """``K2``: records per RAM block."""
        return self.sizes.ram_block

    @property
    def ssd_block(self) -> int | None:
        """``K1``: records per SSD reservoir (``None`` without the SSD tier)."""
        return self.sizes.ssd_block

    @property
    def static_cache(self) -> int:
        """``M``: records pinned by the static cache (0 = off)."""
        return self.sizes.static_records

    @property
    def node(self) -> int | None:
        """The node this consumer runs on (``None`` without ``locality``)."""
        return None if self.layout is None else self.layout.node_of(self.options.rank)

    @property
    def reservoir_size(self) -> int:
        """``K``: records per reservoir of the top tier (``K1`` with the SSD tier, else ``K2``)."""
        return self.sizes.reservoir

    # ------------------------------------------------------------------ sizes
    def _check_ssd_space(self) -> None:
        assert self.ssd_dir is not None and self.ssd_block is not None
        need = 2 * (self.ssd_block * self.record_nbytes + _SSD_OVERHEAD)
        free = shutil.disk_usage(self.ssd_dir).free
        if free < need:
            name = self.options.name
            raise OutOfSpaceError(
                f"{self.ssd_dir}: the SSD tier needs {human_bytes(need)} (two reservoirs of {self.ssd_block} "
                f"records), the filesystem has {human_bytes(free)} free; lower {name('ssd_size')} or choose "
                f"another {name('ssd_dir')}"
            )

    def __len__(self) -> int:
        """Batches this consumer gets in one whole epoch."""
        o = self.options
        return batches_per_consumer(self.num_records, o.batch_size, o.rank, o.world_size, drop_last=o.drop_last)

    def element_spec(self) -> ElementSpec:
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``)."""
        rec = self._ds.meta.record
        spec: ElementSpec = {self.payload_name: (tuple(rec.shape), np.dtype(rec.dtype))}
        for name, values in self.fields.items():
            spec[name] = (tuple(values.shape[1:]), values.dtype)
        spec["key"] = ((), np.dtype(np.int64))
        return spec

    # ------------------------------------------------------------------ state
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch`` (ends a running iteration)."""
        e = parse_count(epoch, what="epoch")
        self._close_run()
        self._start_epoch = self._epoch = e
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state: where the global order stands (independent of world size)."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "mode": self.mode,
            "num_records": self.num_records,
            "epoch": self._epoch,
            "position": self._position,
            "start_epoch": self._start_epoch,
            "reservoir_size": self.reservoir_size if self.mode == "replacement" else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` on the next iteration (ends a running iteration)."""
        try:
            version, seed, mode = int(state["version"]), int(state["seed"]), str(state["mode"])
            n, epoch, pos = int(state["num_records"]), int(state["epoch"]), int(state["position"])
            start = int(state.get("start_epoch", epoch))
        except (KeyError, TypeError, ValueError) as exc:
            raise SamplerError(f"state dict: expected the keys of TieredSampler.state_dict(), problem: {exc}") from None
        if version < STATE_VERSION:
            raise SamplerError(
                f"state dict: version {version} was saved by an older shardkit whose orders were drawn from "
                f"other random streams; this shardkit (state version {STATE_VERSION}) cannot continue that "
                "order. Start the epoch afresh (set_epoch) or finish the run with the shardkit that saved it"
            )
        if version != STATE_VERSION:
            raise SamplerError(f"state dict: expected version {STATE_VERSION}, found {version} (saved by a newer shardkit?)")
        if seed != self.seed or mode != self.mode:
            raise SamplerError(
                f"state dict: was saved with seed={seed}, mode={mode!r}; this sampler has seed={self.seed}, "
                f"mode={self.mode!r} (the order would differ)"
            )
        if n != self.num_records:
            raise SamplerError(f"state dict: saved for {n} records, {self.path} has {self.num_records}")
        k = state.get("reservoir_size")
        if mode == "replacement" and k is not None and int(k) != self.reservoir_size:
            name = self.options.name
            raise SamplerError(
                f"state dict: replacement mode with reservoirs of {k} records, this sampler's are "
                f"{self.reservoir_size} (set the same {name('ram_size')}/{name('ssd_size')})"
            )
        if not 0 <= pos <= n or epoch < 0:
            raise SamplerError(f"state dict: position {pos} outside [0, {n}] or negative epoch {epoch}")
        self._close_run()
        self._epoch, self._position, self._start_epoch = epoch, pos, min(start, epoch)

    # ------------------------------------------------------------------ iteration
    def _end_epoch(self) -> int | None:
        epochs = self.options.epochs
        return None if epochs is None else self._start_epoch + epochs

    def _segments(self, first_epoch: int, first_position: int, end: int | None) -> Iterator[Segment]:
        """The run's per-epoch plans (computed lazily by the first creator thread); the dataset's
        identity is checked before each epoch."""
        o = self.options
        left = o.limit
        epoch, pos = first_epoch, first_position
        while end is None or epoch < end:
            self.identity.check()
            stream = epoch_stream(o.mode, o.seed, epoch, self.num_records, self.reservoir_size)
            plan = self._plan(stream, pos)
            complete = True
            if left is not None and plan.keys.size > left:
                plan = truncate_plan(plan, left, o.world_size)
                complete = False
            yield Segment(epoch, plan, complete)
            if left is not None:
                left -= plan.keys.size
                if left <= 0:
                    return
            epoch, pos = epoch + 1, 0

    def __iter__(self) -> _Run:
        self._close_run()
        end = self._end_epoch()
        if end is not None and self._epoch >= end:
            # The previous iteration finished: continue with the next window of epochs.
            self._start_epoch = self._epoch
            self._position = 0
            end = self._end_epoch()
        run = _Run(self, end)
        self._run_ref = weakref.ref(run)
        return run

    def _close_run(self) -> None:
        run = self._run_ref() if self._run_ref is not None else None
        if run is not None:
            run.close()
        self._run_ref = None

    @property
    def pinned_keys(self) -> np.ndarray:
        """The static cache's pinned keys P, ascending (empty when the cache is off)."""
        return self._cache.keys.copy() if self._cache is not None else np.empty(0, dtype=np.int64)

    def close(self) -> None:
        """Stop a running iteration, free its SSD directory and the static cache's RAM."""
        self._close_run()
        if self._cache is not None:
            self._cache.release()

    def __enter__(self) -> TieredSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for DataLoader workers started with spawn: rebuild from options + state.
        return {"path": str(self.path), "options": self.options, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["path"], d["options"])  # type: ignore[misc]
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        return (
            f"TieredSampler({str(self.path)!r}, tiers={','.join(self.tiers)}, mode={self.mode}, "
            f"K2={self.ram_block}, K1={self.ssd_block}, static_cache={self.static_cache}, batch_size={self.batch_size}, "
            f"rank={self.rank}/{self.world_size}, epoch={self._epoch}, position={self._position}"
            + (f", node={self.node}/{self.options.nodes})" if self.layout is not None else ")")
        )


class _Run:
    """One iteration: the consumer end of a :class:`Pipeline`.

    The background threads reference only the pipeline, never this object, so dropping the
    iterator (``break`` then garbage collection) triggers :func:`weakref.finalize`, which stops the
    threads and deletes the SSD directory.
    """

    def __init__(self, sampler: TieredSampler, end: int | None) -> None:
        self._s = sampler
        self._done = False
        self._pipeline: Pipeline | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        first_epoch, first_pos = sampler._epoch, sampler._position
        if (end is not None and first_epoch >= end) or sampler.options.limit == 0:
            self._done = True
            return
        sampler.identity.check()  # before the run opens the dataset's files
        self._pipeline = Pipeline(
            sampler.path,
            sampler._segments(first_epoch, first_pos, end),
            fields=sampler.fields,
            stats=sampler.stats,
            ram_block=sampler.ram_block,
            ssd_block=sampler.ssd_block,
            ssd_dir=sampler.ssd_dir,
            gap_bytes=sampler.options.gap_bytes,
            dataset_options=sampler.options.dataset_options(),
            static_cache=sampler._cache,
            identity=sampler.identity,
        )
        self._finalizer = weakref.finalize(self, self._pipeline.shutdown)

    def __iter__(self) -> _Run:
        return self

    def __next__(self) -> Batch:
        if self._done or self._pipeline is None:
            raise StopIteration
        s = self._s
        s.stats.start_clock()
        t0 = time.perf_counter()
        try:
            while True:
                match self._pipeline.get():
                    case BatchReady(batch=batch, epoch=epoch, position=position):
                        s._epoch, s._position = epoch, position
                        n = int(batch["key"].shape[0])
                        s.stats.add_delivered(n, batch[s.payload_name].nbytes, time.perf_counter() - t0)
                        return dict(batch)
                    case EpochEnd(segment=seg):
                        if seg.complete:
                            s._epoch, s._position = seg.epoch + 1, 0
                    case RunDone():
                        self.close()
                        raise StopIteration
        except BaseException:
            if not self._done:
                s.stats.add_stall(time.perf_counter() - t0)
                self.close()
            raise

    def close(self) -> None:
        """Stop the background work now (idempotent)."""
        self._done = True
        if self._finalizer is not None:
            self._finalizer()

    def __del__(self) -> None:  # pragma: no cover - finalize does the work; this makes it prompt
        try:
            self.close()
        except Exception:
            pass


def _fingerprint_or_none(path: Path | str) -> str | None:
    try:
        return dataset_fingerprint(path)
    except FileNotFoundError:
        return None  # opening the dataset says what is wrong
