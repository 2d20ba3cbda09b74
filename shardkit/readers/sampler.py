"""The tiered sampler: an exactly uniform random order from sequential reads (docs/design.md §4).

See :class:`TieredSampler`; its options are :class:`~shardkit.readers.options.SamplerOptions`.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardkit.closing import Closing
from shardkit.errors import ConfigError, OutOfSpaceError, SamplerError, ShardkitError
from shardkit.formats import Dataset
from shardkit.formats.dataset import DatasetDocuments
from shardkit.formats.media_codecs import cuda_decoder, stored_nbytes, stored_nbytes_field
from shardkit.order.locality import NodeLayout, NodePartition, local_shape, node_partition
from shardkit.order.mixture import PlanOrder
from shardkit.order.schedule import (
    ArrayOrder,
    EpochOrder,
    HeadFirstOrder,
    batches_per_consumer,
    epoch_order,
    head_keys,
    plan_shape,
    resolve_permutation,
)
from shardkit.readers.identity import remember, reopen
from shardkit.readers.interface import Batch, ElementSpec
from shardkit.readers.options import SamplerOptions, TierSizes
from shardkit.readers.sources import (
    MixedIdentity,
    Mixture,
    RemoteCache,
    as_source,
    gather_fields,
    local_keys,
    plan_remote_cache,
)
from shardkit.stopping import CurrentRun
from shardkit.stores import Location, location_string
from shardkit.tiers import shm as node
from shardkit.tiers.buffers import BatchPool, BufferMemory
from shardkit.tiers.mapped import MAX_MAPPED_SHARDS
from shardkit.tiers.node_cache import NodeDiskCache, entry_name, node_cache_dir
from shardkit.tiers.pipeline import BatchReady, BlockRead, EpochEnd, Pipeline, RunDone, Segment
from shardkit.tiers.static_cache import StaticCache
from shardkit.tiers.stats import SamplerStats
from shardkit.units import human_bytes, parse_count

__all__ = ["TieredSampler", "STATE_VERSION", "BatchSupply", "RunOwner"]

logger = logging.getLogger(__name__)

#: Version of the :meth:`TieredSampler.state_dict` layout and of its orders (2: drawn from
#: :mod:`shardkit.order.seeds` domains; a version-1 position points into an order no longer made).
STATE_VERSION = 2
#: Bytes per SSD reservoir beyond the payload: none in the slot file itself (see
#: :mod:`shardkit.tiers.ssd_slots`); a margin for the filesystem's own blocks.
_SSD_OVERHEAD = 1 << 20


class TieredSampler(Closing):
    """Batches of a shardkit dataset in an exactly uniform random order, with sequential reads.

    Tiers are ordered slow -> fast: the dataset on disk, an optional SSD tier (reservoirs written as
    shardkit datasets under a private directory of ``ssd_dir``) and the RAM tier. Records cross
    every tier boundary once per epoch, in ascending offset order within each file, straight into
    the batch the consumer receives; the batches come in the epoch's order. Implements the
    :class:`~shardkit.readers.interface.Sampler` protocol.

    Parameters
    ----------
    dataset
        Dataset directory, object-store URL (``s3://bucket/ds``, ...; see :mod:`shardkit.stores.url`)
        or an opened :class:`~shardkit.formats.Dataset` (only its location is used; the sampler opens
        its own reader so it can count reads of the bottom tier).
    options
        A :class:`~shardkit.readers.options.SamplerOptions` (default: all defaults).
    **overrides
        Any option of :class:`~shardkit.readers.options.SamplerOptions` by name (``ram_size``,
        ``batch_size``, ...), applied on top of ``options``; the options are documented there.


    Notes
    -----
    Batches are dicts of numpy arrays: the payload (``"image"``/``"audio"``) ``[n, ...]``, every
    per-record field, and ``"key"`` (int64 record index). The payload is a view of a batch buffer,
    never overwritten while anything references it. ``ram_size`` covers everything the sampler holds
    in RAM, split as :attr:`memory_plan` says. :meth:`state_dict` holds ``(seed, epoch, position)``
    in the order shared by all consumers, so a sampler with another world size resumes it. With
    ``locality`` every rank must be given the same options. A dataset replaced under the sampler
    stops it with a :class:`~shardkit.errors.SamplerError`. Design: docs/design.md §4 and §10.

    Memory beyond ``ram_size`` (docs/design.md §4, *The schedule*, memory per record): per dataset
    record, 8 bytes of exact permutation (node-shared; none with ``permutation="feistel"``) and the
    per-record fields' own bytes (node-shared); no shard index for local uncompressed datasets (16
    bytes a record otherwise); per record of the blocks in flight, about 48 bytes of bookkeeping.
    """

    def __init__(
        self,
        dataset: Location | Dataset | Mixture,
        options: SamplerOptions | None = None,
        **overrides: Any,
    ) -> None:
        opts = SamplerOptions.given(options, **overrides)
        source = as_source(dataset)
        #: What this sampler reads: a mixture of one dataset or more (see :mod:`shardkit.readers.sources`).
        self.source: Mixture = source
        opts = _source_options(source, opts, "seed" in overrides)
        #: The local cache of the remote datasets' shards, or ranged reads, and why (the options then
        #: name the resolved directory and budget, so a pickled sampler's workers share the cache).
        self.remote_cache: RemoteCache = plan_remote_cache(source, opts)
        if opts.cache_dir == "auto" and self.remote_cache.kind != "local":
            opts = opts.replace(cache_dir=self.remote_cache.directory, cache_size=self.remote_cache.budget)
        for line in self.remote_cache.describe():
            logger.info("%s: %s", location_string(source.paths[0]), line)
        self.options = opts
        if opts.decode == "cuda":
            cuda_decoder()  # an explicit error where there is no CUDA device: never a silent CPU fallback
        regions = self._open(source)
        self.sizes: TierSizes = opts.tier_sizes(self.record_nbytes, self.num_records, self.num_keys)
        #: ``"exact"`` or ``"feistel"``: how ``epoch`` mode draws its slot orders for this source.
        self.permutation = resolve_permutation(opts.permutation, self.num_records)
        self.ssd_dir: Path | None = None
        if self.sizes.ssd_block is not None:
            self.ssd_dir = opts.ssd_dir if opts.ssd_dir is not None else Path(tempfile.gettempdir())
            if not self.ssd_dir.is_dir():
                raise ConfigError(f"{opts.name('ssd_dir')}: expected an existing directory, found {str(self.ssd_dir)!r}")
            self._check_ssd_space()
        rec = self._record
        self.stats = SamplerStats()
        self._cache: StaticCache | None = None
        #: Where the consumers sit and which node pins which key (``locality`` only).
        self.layout: NodeLayout | None = None
        self.partition: NodePartition | None = None
        self._node_disk: NodeDiskCache | None = None
        #: The node this consumer runs on (``None`` without ``locality``).
        self.node = NodeLayout(opts.world_size, opts.workers_per_rank, opts.nodes).node_of(opts.rank) if opts.locality else None
        if opts.locality and not self.sizes.full_cache:
            self._cache = self._node_caches(tuple(rec.shape), np.dtype(rec.dtype))
        elif self.sizes.static_records:
            self._cache = StaticCache(
                opts.seed, self.num_keys, self.sizes.static_records, tuple(rec.shape), np.dtype(rec.dtype),
                bijection=self.permutation == "feistel", share_key=self._share_key,
                files=self._mappable and self.ssd_dir is None,
            )  # fmt: skip
        self._pool = BatchPool(opts.batch_size, tuple(rec.shape), np.dtype(rec.dtype).newbyteorder("<"),
                               self.sizes.pool_batches, row_offset=self._row_offset)  # fmt: skip
        self._start_epoch = opts.start_epoch
        self._epoch = opts.start_epoch
        self._position = 0
        self._run: CurrentRun[_Run] = CurrentRun()
        self._finalizer = weakref.finalize(self, _release, self._cache, regions)

    def _open(self, m: Mixture) -> list[node.SharedRegion]:
        """The source's datasets: identities, node-shared fields by global key, its order; returns
        the fields' regions."""
        opts = self.options
        #: The (first) dataset: a local directory (Path) or an object-store URL (str).
        self.path: Path | str = m.paths[0]
        self._plan = m.plan(opts.seed)
        #: Records per epoch ``L`` (the order's length) and the global keys behind them (``sum N_i``).
        self.num_records, self.num_keys = m.epoch_size, sum(m.sizes)
        self.record_nbytes, self.payload_name, self._record = m.record.nbytes, m.payload_name, m.record
        # A remote dataset this process opened before is opened from its documents, its identity
        # check under way (see shardkit.readers.identity).
        store_options = opts.dataset_options()["store_options"]
        reopened = [reopen(p, store_options, expected=made) for p, made in zip(m.paths, m.fingerprints)]
        #: The datasets as they were when the fields below were loaded (see shardkit.readers.identity).
        self.identity = MixedIdentity(tuple(part for part, _ in reopened))
        #: Documents the runs' readers open the remote datasets from (``Dataset``'s ``opened``).
        self._documents: dict[str, DatasetDocuments] = {}
        for _, known in reopened:
            self._documents.update(known)
        fields: list[dict[str, np.ndarray]] = []
        regions: list[node.SharedRegion] = []
        keys: list[str] = []
        offsets: set[int] = set()
        codecs = []
        shards = []
        for p, part, made in zip(m.paths, self.identity.parts, m.fingerprints):
            if part.fingerprint != made:
                raise SamplerError(f"{p}: the dataset changed since the sampler opened it; try again once it is complete")
            try:  # closed here: payload reads go through each run's own reader
                with Dataset(p, **opts.dataset_options(), opened=self._documents) as ds:
                    if ds.documents is not None:
                        self._documents[ds.store.location] = ds.documents
                        remember(part, ds.documents, ds.store.location)
                    key = node.dataset_key(p, part.fingerprint) if opts.node_sharing else None
                    f, r = node.node_fields(ds, key)
                    if opts.decode is not True:
                        f = {**f, stored_nbytes_field(ds.meta.payload): stored_nbytes(ds)}
                    codec = ds.payload.codec if opts.decode is True else None
                    codecs.append(ds.payload.codec)
                    shards.append(len(ds.payload.shards))
                    offsets.add(0 if codec is None else codec.row_offset(tuple(ds.payload.record.shape)))
            except ShardkitError:
                part.settle()  # fields of a dataset replaced since its documents were read: say that
                raise
            fields.append(f)
            regions += r
            keys.append(key or "")
        self._share_key = "\0mixture\0".join(keys) if opts.node_sharing else None
        #: One local dataset of uncompressed records read as it is: a static cache that holds it
        #: whole may be its mapped files, node-shared or not (docs/design.md §4, *Static cache*).
        self._mappable = (self._plan.single and len(m.paths) == 1 and isinstance(self.path, Path) and codecs == [None]
                          and shards[0] <= MAX_MAPPED_SHARDS)
        #: Where a batch buffer starts past a page: what every dataset's decoder writes fastest (JPEG's
        #: colour conversion: docs/design.md §4, *Decoding*), else page aligned.
        self._row_offset = offsets.pop() if len(offsets) == 1 else 0
        self.fields = gather_fields(fields, self._plan.offsets, indexed=not self._plan.single)
        #: Global key -> the record's key in its dataset (batches carry the latter).
        self._local_keys = functools.partial(local_keys, self._plan.offsets)
        return regions

    @property
    def maps_whole_cache(self) -> bool:
        """Whether a static cache that holds this source whole, with no SSD tier, is the dataset's
        mapped shard files (no memory of its own to fill: docs/design.md §4, *Static cache*)."""
        return self._mappable

    @property
    def mixture(self) -> Mixture | None:
        """The source when its order is a mixture's (several datasets, or one not read exactly once
        per epoch; batches then carry ``dataset``), ``None`` for one dataset read as it is."""
        return None if self._plan.single else self.source

    def _node_caches(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> StaticCache | None:
        """This node's part of the node partition: the static cache's share, and the next
        ``node_cache`` records on its disk (docs/design.md §10)."""
        o, sizes = self.options, self.sizes
        self.layout = NodeLayout(o.world_size, o.workers_per_rank, o.nodes)
        me = self.layout.node_of(o.rank)
        self.partition = node_partition(o.seed, self.num_records, o.nodes, sizes.static_records + sizes.node_records)
        ram = min(sizes.static_records, self.partition.per_node)
        disk_keys = self.partition.pinned_keys(me, ram)
        if disk_keys.size:
            if o.node_cache_dir is not None and not o.node_cache_dir.is_dir():
                raise ConfigError(f"{o.name('node_cache_dir')}: expected an existing directory, found {str(o.node_cache_dir)!r}")
            self._node_disk = NodeDiskCache(
                disk_keys, dataset=self.path, directory=node_cache_dir(o.node_cache_dir),
                name=entry_name(self.identity.parts[0].fingerprint, o.seed, o.nodes, me, ram, self.partition.per_node),
                stats=self.stats.node, dataset_options=o.dataset_options(),
            )  # fmt: skip
        count = min(ram, len(range(me, self.num_records, o.nodes)))
        if not count:
            return None
        return StaticCache(o.seed, self.num_records, count, shape, dtype, part=(o.nodes, me), share_key=self._share_key)

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
    def memory_plan(self) -> TierSizes:
        """How ``ram_size`` is spent: blocks, batch buffers, static cache, SSD copy buffer."""
        return self.sizes

    @property
    def block_schedule(self) -> tuple[int, int]:
        """``(first, largest)`` RAM block in records: the run's first block, then blocks doubling
        up to the largest (see :func:`~shardkit.order.schedule.block_bounds`)."""
        return self.sizes.first_block, self.sizes.ram_block

    @property
    def cache_fraction(self) -> float:
        """Fraction of the dataset the static cache pins: the share of every epoch after the first
        that is served from RAM instead of storage (1.0: nothing is read after the first epoch)."""
        return self.sizes.cache_fraction

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
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``; a mixture's
        ``dataset``)."""
        rec = self._record
        spec: ElementSpec = {self.payload_name: (tuple(rec.shape), np.dtype(rec.dtype))}
        if self.options.decode is not True:  # the stored bytes (see stored_nbytes)
            spec[self.payload_name] = ((rec.nbytes,), np.dtype(np.uint8))
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
        self._run.close()
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
            "permutation": self.permutation if self.mode == "epoch" else None,
            "mixture": self._mixture_state(),
        }

    def _mixture_state(self) -> dict[str, Any] | None:
        """What a mixture's order depends on besides the seed: sizes, counts, epoch size (``None``
        for one dataset read once per epoch, whose order ``num_records`` and the seed define)."""
        if self._plan.single:
            return None
        return {"sizes": list(self._plan.sizes), "counts": list(self._plan.counts), "epoch_size": self._plan.epoch_size}

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
        mixture = state.get("mixture")
        if mixture != self._mixture_state():
            raise SamplerError(
                f"state dict: saved for {'a mixture ' + str(mixture) if mixture else 'one dataset'}, this sampler reads "
                f"{'a mixture ' + str(self._mixture_state()) if self._mixture_state() else 'one dataset'} (another order)"
            )
        if n != self.num_records:
            raise SamplerError(f"state dict: saved for {n} records, {self.path} has {self.num_records}")
        kind = state.get("permutation") or "exact"
        if mode == "epoch" and kind != self.permutation:
            raise SamplerError(
                f"state dict: was saved with the {kind} permutation, this sampler draws the {self.permutation} "
                f"one (a different order); set {self.options.name('permutation')}={kind!r}"
            )
        k = state.get("reservoir_size")
        if mode == "replacement" and k is not None and int(k) != self.reservoir_size:
            name = self.options.name
            raise SamplerError(
                f"state dict: replacement mode with reservoirs of {k} records, this sampler's are "
                f"{self.reservoir_size} (set the same {name('ram_size')}/{name('ssd_size')})"
            )
        if not 0 <= pos <= n or epoch < 0:
            raise SamplerError(f"state dict: position {pos} outside [0, {n}] or negative epoch {epoch}")
        self._run.close()
        self._epoch, self._position, self._start_epoch = epoch, pos, min(start, epoch)

    # ------------------------------------------------------------------ iteration
    def _end_epoch(self) -> int | None:
        epochs = self.options.epochs
        return None if epochs is None else self._start_epoch + epochs

    def _segments(self, first_epoch: int, first_position: int, end: int | None,
                  drawing: list[HeadFirstOrder] | None = None) -> Iterator[Segment]:  # fmt: skip
        """The run's per-epoch plans (computed lazily by the first creator thread); the dataset's
        identity is checked before each epoch. Orders still drawn in the background are added to
        ``drawing`` (the run cancels them when it stops)."""
        o = self.options
        left = o.limit
        epoch, pos = first_epoch, first_position
        while end is None or epoch < end:
            self._check_before_read()
            shape = plan_shape(self.num_records, pos, o.batch_size, o.rank, o.world_size, o.drop_last)
            order, release = self._order(epoch, drawing)
            if self.layout is not None and self.partition is not None:
                shape = local_shape(shape, order, self.layout, self.partition, o.drop_last)
            complete = True
            if left is not None and shape.length > left:
                shape = shape.truncated(left)
                complete = False
            last = (end is not None and epoch + 1 >= end) or (left is not None and shape.length >= left)
            yield Segment(epoch, shape, order, complete, release, last)
            if left is not None:
                left -= shape.length
                if left <= 0:
                    return
            epoch, pos = epoch + 1, 0

    def _order(self, epoch: int, drawing: list[HeadFirstOrder] | None = None) -> tuple[EpochOrder, Callable[[], None] | None]:
        """Epoch ``epoch``'s order: the exact permutation computed once per node when sharing is on,
        else this process's own (see :func:`~shardkit.order.schedule.epoch_order`); one drawn in the
        background is added to ``drawing``."""
        o = self.options
        if o.mode == "epoch" and self.permutation == "exact":
            head = head_keys(o.seed, epoch, self.num_records)
            if head.size:  # a large dataset: the first blocks start while the rest is drawn
                deferred = HeadFirstOrder(head, self.num_records, lambda: self._slot_order(epoch))
                if drawing is not None:
                    drawing.append(deferred)
                return PlanOrder(self._plan, epoch, deferred), deferred.release
        slots, release = self._slot_order(epoch)
        return PlanOrder(self._plan, epoch, slots), release

    def _slot_order(self, epoch: int) -> tuple[EpochOrder, Callable[[], None] | None]:
        """Epoch ``epoch``'s whole slot order and what releases it (see :meth:`_order`)."""
        o = self.options
        if o.mode == "epoch" and self.permutation == "exact" and o.node_sharing:
            shared = node.node_permutation(o.seed, epoch, self.num_records)
            if shared is not None:
                array, region = shared
                return ArrayOrder(array), region.release
        return epoch_order(o.mode, o.seed, epoch, self.num_records, self.reservoir_size, self.permutation), None

    def __iter__(self) -> _Run:
        self._run.close()
        end = self._end_epoch()
        if end is not None and self._epoch >= end:
            # The previous iteration finished: continue with the next window of epochs.
            self._start_epoch = self._epoch
            self._position = 0
            end = self._end_epoch()
        drawing: list[HeadFirstOrder] = []  # this run's orders drawn in the background
        pipeline = self._pipeline(end, drawing)
        supply = None if pipeline is None else _Settled(pipeline, self.identity, drawing)
        return self._run.start(_Run(self, supply, self._pool, stored=self.options.decode is not True))

    def _pipeline(self, end: int | None, drawing: list[HeadFirstOrder] | None = None) -> Pipeline | None:
        """The background half of an iteration up to epoch ``end`` (``None`` when nothing is left);
        its orders still drawn in the background are added to ``drawing``."""
        first_epoch, first_pos = self._epoch, self._position
        if (end is not None and first_epoch >= end) or self.options.limit == 0:
            return None
        self._check_before_read()  # before the run opens the dataset's files
        return Pipeline(
            self.source,
            self._segments(first_epoch, first_pos, end, drawing),
            fields=self.fields,
            stats=self.stats,
            sizes=self.sizes,
            pool=self._pool,
            ssd_dir=self.ssd_dir,
            gap_bytes=self.options.gap_bytes,
            dataset_options={**self.options.dataset_options(), "opened": self._documents},
            static_cache=self._cache,
            node_disk=self._node_disk,
            identity=self.identity,
            key_map=self._local_keys,
        )

    def _check_before_read(self) -> None:
        """Check the datasets' identity before reading, leaving a check under way running: the run
        waits for it after its first read and before its first batch (:class:`_Settled`)."""
        for part in self.identity.parts:
            part.check(wait=False)

    def _reached(self, epoch: int, position: int) -> None:
        """The consumer is at ``position`` of ``epoch`` (what :meth:`state_dict` saves)."""
        self._epoch, self._position = epoch, position

    @property
    def pinned_keys(self) -> np.ndarray:
        """The keys this consumer's caches pin, ascending: the static cache's P, and with
        ``locality`` the node's part on its disk too (empty when nothing is pinned)."""
        parts = [c.keys() if isinstance(c, StaticCache) else c.keys for c in (self._cache, self._node_disk) if c is not None]
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def use_buffer_memory(self, memory: BufferMemory) -> None:
        """Put the batch buffers in ``memory`` (:class:`~shardkit.tiers.buffers.BufferMemory`) from
        the next iteration on; a running iteration's buffers stay where they are."""
        pool = self._pool
        self._pool = BatchPool(pool.rows, pool.record_shape, pool.dtype, self.sizes.pool_batches, memory=memory,
                               row_offset=pool.row_offset)  # fmt: skip

    def hold_shared(self) -> None:
        """Attach the node-shared memory (fields, static cache) now and keep it until :meth:`close`,
        so the static cache stays filled across the per-pass samplers an adapter builds."""
        if self._cache is not None:
            self._cache.attach()

    def close(self) -> None:
        """Stop a running iteration, free its SSD directory and let go of the static cache (the
        node's last user frees its RAM; iterating again starts a new cache)."""
        self._run.close()
        if self._cache is not None:
            self._cache.release()
        if self._node_disk is not None:
            self._node_disk.close()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for DataLoader workers started with spawn: rebuild from options + state.
        return {"path": self.source, "options": self.options, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["path"], d["options"])  # type: ignore[misc]
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        return (
            f"TieredSampler({location_string(self.path)!r}, tiers={','.join(self.tiers)}, mode={self.mode}, "
            f"blocks={self.sizes.first_block}..{self.ram_block}, K1={self.ssd_block}, static_cache={self.static_cache}, "
            f"batch_size={self.batch_size}, "
            f"rank={self.rank}/{self.world_size}, epoch={self._epoch}, position={self._position}"
            + (f", node={self.node}/{self.options.nodes})" if self.options.locality else ")")
        )


class BatchSupply(Protocol):
    """Where an iteration's batches come from: a :class:`Pipeline`, or the batches a shared job
    copies out of the server's ring (:mod:`shardkit.serve.client`)."""

    def get(self) -> BatchReady | BlockRead | EpochEnd | RunDone:
        """The next item; raises the background failure, if any."""
        ...

    def shutdown(self) -> None:
        """Stop the background work and free what it holds (idempotent, any thread)."""
        ...


class RunOwner(Protocol):
    """The sampler an iteration belongs to: its counters, its payload's name, where it stands."""

    stats: SamplerStats
    payload_name: str

    def _reached(self, epoch: int, position: int) -> None: ...


class _Settled:
    """A pipeline whose first batch waits for the dataset identity checks still under way (a sampler
    opened from remembered documents, :func:`~shardkit.readers.identity.reopen`): batches served from
    caches alone, without a read that would check it, come from an unchanged dataset too."""

    def __init__(self, supply: BatchSupply, identity: MixedIdentity, drawing: list[HeadFirstOrder] | None = None) -> None:
        self._supply = supply
        self._identity: MixedIdentity | None = identity
        #: The run's orders still drawn in the background: cancelled first when it stops, so no
        #: thread waits for a draw that cannot be interrupted (docs/design.md §4, *The schedule*).
        self._drawing = drawing if drawing is not None else []

    def get(self) -> BatchReady | BlockRead | EpochEnd | RunDone:
        item = self._supply.get()
        if self._identity is not None and isinstance(item, BatchReady):
            parts, self._identity = self._identity.parts, None
            for part in parts:
                part.settle()
        return item

    def shutdown(self) -> None:
        for order in self._drawing:
            order.cancel()
        self._supply.shutdown()


class _Run:
    """One iteration: the consumer end of a :class:`BatchSupply`. The background threads never
    reference it, so dropping the iterator finalizes it, which stops the supply."""

    def __init__(self, owner: RunOwner, supply: BatchSupply | None, pool: BatchPool | None, *, stored: bool = False) -> None:
        self._s = owner
        #: Batches carry the records' stored bytes (``decode`` off): the payload is handed over as uint8 rows.
        self._stored = stored
        self._pool = pool
        self._done = supply is None
        self._supply = supply
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(self, supply.shutdown) if supply is not None else None

    def __iter__(self) -> _Run:
        return self

    def __next__(self) -> Batch:
        if self._done or self._supply is None:
            raise StopIteration
        s, pool = self._s, self._pool
        s.stats.start_clock()
        if pool is not None:
            pool.consumer_waits()
        t0 = time.perf_counter()
        try:
            while True:
                match self._supply.get():
                    case BatchReady(batch=batch, epoch=epoch, position=position, buffer=buffer):
                        t1 = time.perf_counter()
                        if buffer is not None and pool is not None:
                            pool.hand_over(buffer)  # from now on, references decide its reuse
                        s._reached(epoch, position)
                        out = dict(batch)
                        if self._stored:  # the rows as bytes: each record's stored stream first
                            rows = out[s.payload_name]
                            out[s.payload_name] = rows.reshape(rows.shape[0], -1).view(np.uint8)
                        s.stats.add_busy("handover", time.perf_counter() - t1)
                        s.stats.add_delivered(int(batch["key"].shape[0]), batch[s.payload_name].nbytes, t1 - t0)
                        return out
                    case EpochEnd(epoch=epoch, complete=complete):
                        if complete:
                            s._reached(epoch + 1, 0)
                    case RunDone():
                        self.close()
                        raise StopIteration
                    case other:
                        raise SamplerError(f"expected a batch, found {type(other).__name__} (internal error)")
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


def _source_options(m: Mixture, opts: SamplerOptions, seed_given: bool) -> SamplerOptions:
    """The options a source is sampled with: its own seed (when it has one); other modes than
    ``epoch``, and ``locality``, only for one dataset read once per epoch."""
    single = m.plan(0).single
    if opts.locality and not single:  # the node partition is drawn over one dataset's keys
        raise ConfigError(f"{opts.name('locality')}: not available for a mixture of datasets; read it without locality")
    if opts.mode != "epoch" and not single:
        raise ConfigError(
            f"{opts.name('mode')}: a mixture is sampled in 'epoch' mode (exact counts and walks per epoch), "
            f"found {opts.mode!r}"
        )
    if m.seed is not None and m.seed != opts.seed:
        if seed_given or opts.seed != 0:
            raise ConfigError(
                f"{opts.name('seed')}: the mixture was made with seed={m.seed}, the sampler was given {opts.seed}; "
                "give the seed once (to shardkit.mix, or to the sampler with mix(..., seed=None))"
            )
        opts = opts.replace(seed=m.seed)
    return opts


def _release(cache: StaticCache | None, regions: list[node.SharedRegion]) -> None:
    """Let go of a sampler's node-shared memory (its finalizer: never references the sampler)."""
    if cache is not None:
        cache.release()
    for region in regions:
        region.release()
