"""PyTorch adapter: :class:`ShardIterableDataset` for training (the sampler's batches, so
``DataLoader(ds, batch_size=None)``) and :class:`ShardMapDataset` for evaluation by key (docs/design.md §6)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardkit._extras import import_extra
from shardkit.adapters._ahead import NextPass
from shardkit.adapters._handover import SharedBatchMemory, release_exited, shared_batch
from shardkit.adapters._options import PayloadOptions, SamplerFactory
from shardkit.adapters._start import forkable, remote, source_of, start_method, worker_context
from shardkit.errors import ConfigError, SamplerError
from shardkit.formats import Dataset, open_dataset
from shardkit.order.schedule import batches_per_consumer, pass_length, position_after
from shardkit.readers import DEFAULTS, Sampler, SamplerOptions, TieredSampler
from shardkit.readers.sources import Mixture
from shardkit.units import parse_count

if TYPE_CHECKING:
    import torch
else:
    torch = import_extra("torch", "torch", needed_by="shardkit.adapters.torch")
from torch.utils.data import Dataset as _TorchDataset
from torch.utils.data import IterableDataset as _TorchIterableDataset
from torch.utils.data import get_worker_info

__all__ = ["ShardIterableDataset", "ShardLoader", "ShardMapDataset", "accelerator_present", "to_tensors"]

logger = logging.getLogger(__name__)


def accelerator_present() -> bool:
    """Whether PyTorch sees an accelerator that pinned memory would feed (``torch.accelerator``,
    or CUDA on PyTorch releases without it)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())

TensorDict = dict[str, "torch.Tensor"]


def _tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy ``torch.from_numpy`` (the sampler never reuses a buffer a tensor references); a copy
    for a read-only or non-native-endian array, which torch cannot share safely."""
    if not array.flags.writeable or not array.dtype.isnative:
        array = np.array(array, dtype=array.dtype.newbyteorder("=") if not array.dtype.isnative else None)
    return torch.from_numpy(array)


def _present(payload: torch.Tensor, options: PayloadOptions, stored: np.dtype, batched: bool) -> torch.Tensor:
    if options.identity:
        return payload
    if options.layout == "NCHW":
        payload = payload.permute(0, 3, 1, 2) if batched else payload.permute(2, 0, 1)
    if options.scale == "float":
        # One kernel casts and lays out; the multiply then runs in place.
        payload = payload.to(torch.float32, memory_format=torch.contiguous_format)
        factor = options.factor(stored)
        if factor != 1.0:
            payload.mul_(factor)
        return payload
    return payload.contiguous()


def to_tensors(
    batch: Mapping[str, np.ndarray], payload: str, options: PayloadOptions = PayloadOptions(), batched: bool = True
) -> TensorDict:
    """Convert a sampler batch (or one record) to a dict of tensors; the payload is presented as
    ``options`` asks, every other field (``label`` int64, ``key`` int64, ...) is shared as is."""
    out: TensorDict = {}
    for name, array in batch.items():
        tensor = _tensor(np.asarray(array))
        if name == payload:
            tensor = _present(tensor, options, array.dtype, batched)
        out[name] = tensor
    return out


#: Shared epoch state (one int64 tensor in shared memory, see ShardIterableDataset._next_epoch):
#: the epoch set by the main process, the generation of the last load_state_dict, then per worker
#: the epoch after its last finished pass (-1: none since the epoch was set).
_BASE, _GENERATION, _SLOTS = 0, 1, 2
#: Workers of one rank whose finished passes are tracked one by one (more share the base value).
_MAX_TRACKED_WORKERS = 256


def _distributed_rank_world() -> tuple[int, int] | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _nodes(explicit: int | None, rank: int, world_size: int) -> int:
    """Nodes of a run: ``explicit``, else torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``, else 1. The
    assignment assumes each node's ranks are numbered consecutively; an environment that says
    otherwise (nodes of different sizes) is refused rather than guessed at."""
    if explicit is not None:
        nodes = parse_count(explicit, what="nodes", minimum=1)
        if world_size % nodes:
            raise ConfigError(f"nodes: expected a divisor of world_size={world_size}, found {explicit}")
        return nodes
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or os.environ.get("WORLD_SIZE") is None:
        return 1
    try:
        local_size, env_world = int(local), int(os.environ["WORLD_SIZE"])
        group = int(os.environ.get("GROUP_RANK", rank // max(1, local_size)))
    except ValueError:
        raise ConfigError(f"torchrun environment: expected integers, found LOCAL_WORLD_SIZE={local!r}") from None
    if env_world != world_size or local_size < 1 or world_size % local_size or rank // local_size != group:
        raise ConfigError(
            f"locality: torchrun says WORLD_SIZE={env_world}, LOCAL_WORLD_SIZE={local_size}, GROUP_RANK={group} for "
            f"rank {rank} of {world_size}, which is not nodes of equal size numbered consecutively; pass nodes= explicitly"
        )
    return world_size // local_size


def _check_ranks_agree(path: str, options: SamplerOptions, nodes: int, num_records: int) -> None:
    """Under torch.distributed, refuse to start if ranks were given different locality options: each
    derives the assignment alone, so a difference would deliver some records twice and others never.
    One all-reduce of a digest, at construction."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    fields = (options.seed, options.mode, options.batch_size, str(options.static_cache), str(options.node_cache),
              nodes, options.drop_last, num_records)  # fmt: skip
    digest = int.from_bytes(hashlib.sha256(repr(fields).encode()).digest()[:7], "little")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    low = torch.tensor([digest], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(low.item()) != int(high.item()):
        raise ConfigError(
            f"{path}: with locality every rank must be given the same seed, mode, batch_size, static_cache, node_cache "
            f"and nodes (each derives the whole assignment alone); this rank has {fields[:-1]}, another differs"
        )


class ShardIterableDataset(_TorchIterableDataset):
    """The tiered sampler as an ``IterableDataset`` of batches (or of records) as tensors.

    Parameters
    ----------
    path
        Dataset directory or URL, or a :func:`shardkit.mix` mixture (batches then carry ``dataset``,
        each record's dataset index, and ``key`` is the record's key in it).
    options, **overrides
        The sampler options (listed below): a :class:`~shardkit.readers.SamplerOptions`, and any of
        its options by name (``batch_size=64``, ``ram_size="2GiB"``), validated against its
        declaration. ``batch_size``, ``ram_size`` and ``ssd_size`` are *per consumer* (each
        DataLoader worker of each rank); the static cache is one per machine, held across passes.
        ``epochs`` is per pass (``iter(loader)``) from the current epoch; ``None``: one endless pass.
    rank, world_size
        Used when ``torch.distributed`` is not initialised (default: the options', 0 of 1). When it
        is, its rank and world size are used and explicit values must agree with them.
    layout, scale
        Payload presentation, see :class:`~shardkit.adapters._options.PayloadOptions`: ``"NHWC"``
        uint8 as stored (default), ``"NCHW"``, ``scale="float"`` for float32 in ``[0, 1]``.
    unbatched
        Yield one record at a time (no batch axis) for a custom ``collate_fn``; the sampler still
        reads in batches of ``batch_size``. Use ``DataLoader(ds, batch_size=b, ...)`` then.
    num_workers
        The DataLoader's ``num_workers``. Only ``len()`` and :meth:`state_dict_after` need it (the
        main process cannot see the workers); :meth:`loader` sets it for you.
    shared
        Name of a running ``shardkit serve`` to attach to (:class:`~shardkit.readers.SharedSampler`,
        ``seed`` as the job seed; mode ``"epoch"`` only, no resume inside an epoch).
    nodes
        With ``locality`` (many nodes, see Notes): nodes the ranks run on; by default the
        options' when not 1, else torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``; pass it to simulate
        nodes on one machine. Every rank must get the same locality options (checked once under
        torch.distributed).

    Notes
    -----
    Create the dataset after ``torch.distributed.init_process_group`` (spawned workers do not
    inherit the process group). ``num_workers=0`` is the fast path; workers help when per-record CPU
    work needs more cores, and stored bytes then reach the main process without a copy. Under DDP
    pass ``drop_last=True``, or a rank that stops early leaves the others waiting in a collective.
    With ``locality=True`` every step trains on the same records as without it (docs/design.md §10).
    A pass that runs to the end advances the epoch (shared by all workers, once all of them have
    finished); ``set_epoch(e)`` jumps. :meth:`loader` keeps its workers alive across epochs.
    Checkpoints: :meth:`state_dict` with ``num_workers=0``, else :meth:`state_dict_after` (exact at
    multiples of ``num_workers``); :meth:`load_state_dict` resumes with any number of workers or ranks.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Mixture,
        options: SamplerOptions | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        nodes: int | None = None,
        layout: str = "NHWC",
        scale: str | None = None,
        unbatched: bool = False,
        num_workers: int = 0,
        shared: str | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        #: What this dataset samples: a mixture of one dataset or more (:mod:`shardkit.readers.sources`);
        #: a URL's root documents are read so that DataLoader workers can still be forked (``_start``).
        self.source: Mixture = source_of(path)
        #: The (first) dataset's path or URL, for messages.
        self.path = os.fspath(self.source.paths[0])
        placed = {"rank": rank, "world_size": world_size}
        #: The sampler options of this rank (each consumer's sampler gets its own consumer index).
        self.options = SamplerOptions.given(options, **overrides, **{k: v for k, v in placed.items() if v is not None})
        locality = self.options.locality
        if nodes is None and self.options.nodes != DEFAULTS.nodes:
            nodes = self.options.nodes
        self.factory = SamplerFactory(self.options, shared=shared)
        self.payload_options = PayloadOptions(layout=layout, scale=scale)
        self.unbatched = bool(unbatched)
        if num_workers < 0:
            raise ConfigError(f"num_workers: expected >= 0, found {num_workers}")
        self.num_workers = int(num_workers)
        self.meta = self.source.metas[0]
        #: Records per epoch (a mixture's ``L``).
        self.num_records = self.source.epoch_size
        self.payload_options.check(tuple(self.meta.record.shape), str(self.path))
        self._explicit = (rank, world_size)
        self.rank, self.world_size = self._rank_world()
        #: Nodes the ranks run on (``locality``): explicit, or from torchrun's environment.
        self.nodes = _nodes(nodes, self.rank, self.world_size) if locality else 1
        if locality:
            if not self.source.plan(0).single:
                raise ConfigError("locality: not available for a mixture of datasets; read it without locality")
            _check_ranks_agree(self.path, self.options, self.nodes, self.meta.num_records)
        # Next epoch, in shared memory: set_epoch in the main process reaches persistent workers,
        # and the workers finishing a pass advance it for everyone (see _next_epoch).
        self._epoch = torch.full((_SLOTS + _MAX_TRACKED_WORKERS,), -1, dtype=torch.int64).share_memory_()
        self._epoch[_BASE] = self.options.start_epoch
        self._epoch[_GENERATION] = 0
        #: The load_state_dict generation this copy of the dataset was made with (a persistent
        #: worker's copy is frozen when the worker starts).
        self._generation = 0
        self._resume: dict[str, Any] | None = None
        #: The DataLoader's prefetch_factor (set by loader()): batches a worker has in flight.
        self._prefetch_factor = 2
        self._sampler: Sampler | None = None  # the sampler of a pass running in this process (num_workers=0)
        self._holder: Sampler | None = None
        #: Whether a DataLoader worker starts its next pass as soon as a pass ends (set by loader()
        #: for persistent workers), and that next pass's sampler in a worker.
        self._prepare_next = False
        self._next: NextPass | None = None
        #: A worker's shared-memory batch buffers, kept across its passes.
        self._memory: SharedBatchMemory | None = None
        #: The holder is built once this process's workers have started (see _hold_shared), in a
        #: thread of its own (_holder_thread); each _hold_shared starts a new generation of it.
        self._holder_pending = False
        self._holder_lock = threading.Lock()
        self._holder_thread: threading.Thread | None = None
        self._holder_generation = 0
        self._hold_shared()

    def _drop_holder(self) -> None:
        """Close the holder of the node-shared caches; a deferred build under way (generation
        bumped) closes its result itself instead of keeping it."""
        with self._holder_lock:
            holder, self._holder = self._holder, None
            self._holder_pending = False
            self._holder_generation += 1
        if holder is not None:
            holder.close()

    def _hold_shared(self, *, defer: bool = True) -> None:
        """Keep the node-shared static cache alive across passes, whose samplers each let go of it.
        Over an object store that this process has not used yet, building it (which reads the
        dataset) waits until the DataLoader's workers are forked, or a pass runs here
        (:meth:`_ensure_holder`): reading now would start the runtime that ``fork()`` breaks."""
        self._drop_holder()
        if self.factory.shared is not None:
            return
        if defer and remote(self.source.paths) and forkable():
            self._holder_pending = True
            return
        self._holder = self._new_holder()

    def _new_holder(self) -> Sampler:
        holder = self._rank_sampler(0)
        if isinstance(holder, TieredSampler):
            holder.hold_shared()
        return holder

    def _ensure_holder(self, *, background: bool = False) -> None:
        """Build the holder that :meth:`_hold_shared` deferred: here for a pass in this process,
        which waits for it; in a thread of its own (``background``) once a DataLoader's workers
        run, so that their first batch does not wait for this process to open the dataset (its
        store's runtime starting, its documents' round trips) while they read."""
        with self._holder_lock:
            if not self._holder_pending:
                return
            building = self._holder_thread
            if building is None:
                building = self._holder_thread = threading.Thread(
                    target=self._build_holder, args=(self._holder_generation, background), daemon=True,
                    name="shardkit-holder",
                )  # fmt: skip
                building.start()
        if not background:
            building.join()
            with self._holder_lock:
                failed = self._holder_pending and self._holder_thread is None
            if failed:  # the build failed: again here, raising its error
                self._hold_shared(defer=False)

    def _build_holder(self, generation: int, quiet: bool) -> None:
        """In the holder's thread: build it, and keep it unless :meth:`_hold_shared` or
        :meth:`close` came in between. A failure is logged when ``quiet`` (the workers' samplers
        open the same dataset and report it), else left to :meth:`_ensure_holder` to raise."""
        holder: Sampler | None = None
        try:
            holder = self._new_holder()
        except Exception:
            if quiet:
                logger.debug("%s: building the node-shared holder failed", self.path, exc_info=True)
        with self._holder_lock:
            self._holder_thread = None
            if holder is not None and self._holder_pending and self._holder_generation == generation:
                self._holder, holder = holder, None
                self._holder_pending = False
        if holder is not None:
            holder.close()

    def _rank_sampler(self, start_epoch: int) -> Sampler:
        """A sampler of this rank's first consumer (reads metadata only until iterated)."""
        workers = max(1, self.num_workers)
        return self.factory.build(self.source, consumer=self.rank * workers, num_consumers=self.world_size * workers,
                                  start_epoch=start_epoch, workers_per_rank=workers, nodes=self.nodes)

    def _rank_world(self) -> tuple[int, int]:
        rank, world = self._explicit
        found = _distributed_rank_world()
        if found is not None:
            if (rank is not None and rank != found[0]) or (world is not None and world != found[1]):
                raise ConfigError(
                    f"{self.path}: rank/world_size given as {rank}/{world} but "
                    f"torch.distributed says {found[0]}/{found[1]}"
                )
            return found
        return self.options.rank, self.options.world_size  # checked by SamplerOptions

    def _consumer(self) -> tuple[int, int, int]:
        """(consumer index, number of consumers, workers of this rank) for the calling process."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and workers != max(1, self.num_workers):
            logger.warning(
                "%s: DataLoader runs %d workers but the dataset was told num_workers=%d; records are "
                "still split correctly, but len() and state_dict_after() will be wrong. Pass "
                "num_workers=%d or build the loader with ds.loader().",
                self.path, workers, self.num_workers, workers,
            )  # fmt: skip
        rank, world = self._rank_world() if _distributed_rank_world() else (self.rank, self.world_size)
        return rank * workers + worker, world * workers, workers

    def _next_epoch(self, workers: int) -> int:
        """The epoch a pass starting now runs, for a rank of ``workers`` consumers.

        Each worker records the epoch after its finished pass in its own slot; the epoch advances
        only when every worker of the rank has finished, so a worker that starts late (spawn under
        load, or its siblings had a batch or two each) still reads the pass's epoch, not the next.
        """
        base = int(self._epoch[_BASE])
        if workers > _MAX_TRACKED_WORKERS:
            return base
        done = int(self._epoch[_SLOTS : _SLOTS + workers].min())
        return done if done > base else base

    def _finish_pass(self, done: int) -> None:
        """Record that this process finished a pass whose next epoch is ``done``."""
        info = get_worker_info()
        if info is None:  # the main process is the rank's only consumer
            self._epoch[_SLOTS:] = -1
            self._epoch[_BASE] = done
        elif info.num_workers > _MAX_TRACKED_WORKERS:
            # Every consumer writes the same value; a worker starting after another finished may
            # then read the next epoch (only with more workers than are tracked).
            if int(self._epoch[_BASE]) < done:
                self._epoch[_BASE] = done
        else:
            self._epoch[_SLOTS + info.id] = done

    def _set_next_epoch(self, epoch: int) -> None:
        self._epoch[_SLOTS:] = -1
        self._epoch[_BASE] = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next pass starts with."""
        return self._next_epoch(max(1, self.num_workers))

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at ``epoch`` (seen by all workers, also persistent ones)."""
        if epoch < 0:
            raise ConfigError(f"epoch: expected >= 0, found {epoch}")
        self._set_next_epoch(epoch)
        self._sampler = None  # its state belongs to the previous pass
        if self._resume is not None and int(self._resume["epoch"]) != epoch:
            self._resume = None  # the checkpointed epoch is over

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a sampler state (from :meth:`state_dict` or :meth:`state_dict_after`); call it
        before the first ``iter(loader)``. Only the next pass starts inside its epoch."""
        if "epoch" not in state or "position" not in state:
            raise SamplerError(f"{self.path}: state dict lacks 'epoch'/'position', found keys {sorted(state)}")
        self._resume = dict(state)
        self._set_next_epoch(int(state["epoch"]))
        # Persistent workers started before this cannot see the position: they refuse their next pass.
        self._generation = int(self._epoch[_GENERATION]) + 1
        self._epoch[_GENERATION] = self._generation
        self._sampler = None

    def state_dict(self) -> dict[str, Any]:
        """The exact sampler state after the batches yielded so far in this process (``num_workers=0``;
        with workers use :meth:`state_dict_after`). Unbatched, it is exact at multiples of ``batch_size``."""
        if self._sampler is not None:
            return dict(self._sampler.state_dict())
        if get_worker_info() is None and self.num_workers > 0:
            raise SamplerError(
                f"{self.path}: with num_workers={self.num_workers} the samplers live in the worker "
                "processes; use ds.state_dict_after(batches_taken_from_the_loader)"
            )
        return self._state_at(self.epoch, self._resume_position(self.epoch))

    def state_dict_after(self, num_batches: int, *, epoch: int | None = None) -> dict[str, Any]:
        """The sampler state after this rank took ``num_batches`` batches from the loader in this pass.

        Parameters
        ----------
        num_batches
            Batches the main process received since the pass (``iter(loader)``) began; count batches,
            not records, also in ``unbatched`` mode (there: DataLoader batches of the sampler's size
            are assumed, i.e. ``num_batches * batch_size`` records).
        epoch
            Epoch of the pass; defaults to :attr:`epoch`, which is right until the pass ends (a finished
            pass advances it). Pass the loop variable to be safe.

        The position is rounded down to whole global batches (``num_workers`` consecutive loader
        batches): exact at multiples of ``num_workers``, otherwise the remainder is delivered again
        after resuming (logged as a warning).
        """
        if num_batches < 0:
            raise ConfigError(f"num_batches: expected >= 0, found {num_batches}")
        epoch = self.epoch if epoch is None else int(epoch)
        workers = max(1, self.num_workers)
        start = self._resume_position(epoch)
        n = self.num_records
        per_pass = sum(
            batches_per_consumer(n, self.options.batch_size, self.rank * workers + w, self.world_size * workers,
                                 drop_last=self.options.drop_last, start=start)
            for w in range(workers)
        )  # fmt: skip
        if num_batches >= per_pass:
            if num_batches > per_pass:
                raise ConfigError(
                    f"{self.path}: num_batches={num_batches} but a pass of epoch {epoch} has only {per_pass} "
                    "batches for this rank; count batches per epoch (state_dict_after(..., epoch=e))"
                )
            return self._state_at(epoch + 1, 0)
        whole, extra = divmod(num_batches, workers)
        if extra:
            logger.warning(
                "%s: state after %d batches with %d workers rounds down to %d whole global batches; "
                "%d batches will be delivered again after resuming (checkpoint every multiple of %d)",
                self.path, num_batches, workers, whole, extra, workers,
            )  # fmt: skip
        position = position_after(start, whole, self.options.batch_size, workers * self.world_size, n)
        return self._state_at(epoch, position)

    def _resume_position(self, epoch: int) -> int:
        if self._resume is not None and int(self._resume["epoch"]) == epoch:
            return int(self._resume["position"])
        return 0

    def _state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """A sampler state dict for ``(epoch, position)`` in the sampler's own format."""
        template = self._resume
        if template is None:
            # A new sampler knows the reservoir size that a replacement-mode state records.
            with contextlib.closing(self._rank_sampler(epoch)) as sampler:
                template = dict(sampler.state_dict())
        return {**template, "epoch": int(epoch), "position": int(position), "start_epoch": int(epoch)}

    def __len__(self) -> int:
        """Batches (records when ``unbatched``) this rank's main process receives per pass, with
        :attr:`num_workers` workers; endless passes (``epochs=None``) have no length."""
        if self.options.epochs is None:
            raise TypeError(f"{self.path}: an endless pass (epochs=None) has no len()")
        workers = max(1, self.num_workers)
        return sum(
            pass_length(
                self.num_records, self.options.batch_size, self.rank * workers + w, self.world_size * workers,
                drop_last=self.options.drop_last, start=self._resume_position(self.epoch),
                epochs=self.options.epochs, limit=self.options.limit,
            )[1 if self.unbatched else 0]
            for w in range(workers)
        )  # fmt: skip

    def __iter__(self) -> Iterator[TensorDict]:
        if get_worker_info() is None:
            self._ensure_holder()
        consumer, consumers, workers = self._consumer()
        if int(self._epoch[_GENERATION]) != self._generation:
            raise SamplerError(
                f"{self.path}: load_state_dict() was called after this DataLoader's persistent workers started, "
                "and they cannot see the resume position; build a new loader (ds.loader()) after load_state_dict()"
            )
        epoch = self._next_epoch(workers)
        state = self._resume if self._resume is not None and int(self._resume["epoch"]) == epoch else None
        key = (consumer, consumers, workers)
        payload = self.meta.payload
        options = self.payload_options
        # In a DataLoader worker, batches of stored bytes are read into shared memory and handed
        # to the main process by handle (see shardkit.adapters._handover).
        in_worker = get_worker_info() is not None
        handover = in_worker and not self.unbatched and options.identity and self.factory.shared is None
        taken = self._next.take(epoch, key) if self._next is not None and state is None else None
        if self._next is not None and taken is None:
            self._next.close()
            self._next = None
        sampler = taken[0] if taken is not None else self._build(key, epoch, state, handover)
        run = taken[1] if taken is not None and taken[1] is not None else iter(sampler)
        self._sampler = sampler  # for state_dict() in the main process, stats in tests
        # A persistent worker prepares its next pass: the sampler once half of this pass is delivered
        # (not competing with this pass's start), its reading once this pass's sampler is closed, so
        # that its blocks take the buffers (and the budget) this pass's blocks had.
        build_at = -1
        if in_worker and self._prepare_next and self.options.epochs is not None and isinstance(sampler, TieredSampler):
            total = pass_length(self.num_records, self.options.batch_size, consumer, consumers,
                                drop_last=self.options.drop_last, start=0 if state is None else int(state["position"]),
                                epochs=self.options.epochs, limit=self.options.limit)[0]  # fmt: skip
            build_at = max(1, total // 2)
        following = epoch + (self.options.epochs or 0)
        delivered = 0
        with contextlib.closing(sampler):
            for batch in run:
                if delivered == build_at:
                    self._prepare_pass(following, key, handover)
                delivered += 1
                tensors = to_tensors(batch, payload, options)
                if handover:
                    yield shared_batch(batch, payload, tensors)
                elif self.unbatched:
                    count = next(iter(tensors.values())).shape[0]
                    for i in range(count):
                        yield {name: t[i] for name, t in tensors.items()}
                else:
                    yield tensors
            if self.options.epochs is not None:
                self._finish_pass(epoch + self.options.epochs)
        if build_at >= 0 and delivered <= build_at:  # a pass shorter than expected (or of one batch)
            self._prepare_pass(following, key, handover)
        if self._next is not None:
            self._next.start()

    def _prepare_pass(self, epoch: int, key: tuple[int, int, int], handover: bool) -> None:
        """Build consumer ``key``'s sampler for a pass from ``epoch`` in the background (:class:`NextPass`)."""
        if self._next is None:
            self._next = NextPass(lambda e: self._build(key, e, None, handover))
        self._next.prepare_in_background(epoch, key)

    def _build(self, key: tuple[int, int, int], epoch: int, state: dict[str, Any] | None, handover: bool) -> Sampler:
        """The sampler of consumer ``key`` for a pass from ``epoch`` (``state``: resume inside it),
        its batch buffers in shared memory when they are handed over by handle."""
        consumer, consumers, workers = key
        sampler = self.factory.build(
            self.source, consumer=consumer, num_consumers=consumers, start_epoch=epoch, state=state,
            workers_per_rank=workers, nodes=self.nodes,
        )  # fmt: skip
        if handover and isinstance(sampler, TieredSampler):
            if self._memory is None:  # one per worker: later passes reuse the buffers of earlier ones
                self._memory = SharedBatchMemory(extra_hold=self._prefetch_factor + 2)
            sampler.use_buffer_memory(self._memory)
        return sampler

    def loader(self, num_workers: int = 0, *, pin_memory: bool | None = None, **kwargs: Any) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` over this dataset (``batch_size=None`` unless ``unbatched``) with
        ``num_workers`` recorded for ``len()`` and :meth:`state_dict_after`; ``kwargs`` go to the
        DataLoader. ``pin_memory`` defaults to whether an accelerator is present.

        Workers are kept alive across epochs (``persistent_workers=True`` unless given): starting
        them costs seconds (imports, with ``spawn`` the whole interpreter), which would otherwise
        delay every epoch's first batch. Each pass reads from a sampler of its own, for the epoch
        that :meth:`set_epoch` or the previous pass left; a persistent worker builds and starts the
        next pass's sampler as soon as its pass ends, so the next epoch's first batches are read
        (and an object store's documents fetched) while the epoch ends, not when it is asked for.
        That costs the next epoch's first blocks (at most ``ram_size`` per worker) if no further
        pass comes, or if :meth:`set_epoch` then picks another epoch. Call :meth:`load_state_dict`
        before the loader's first pass (or build a new loader after it).
        Workers over an object store are forked (milliseconds) while this process has not used an
        object store (its runtime does not survive ``fork()``; the dataset reads its documents in a
        helper process to stay so), else started with ``spawn`` (a fork server would keep the
        environment it started with); ``multiprocessing_context`` overrides both."""
        if pin_memory is None:
            pin_memory = accelerator_present()
        kwargs["pin_memory"] = pin_memory
        if int(num_workers) > 0:
            kwargs.setdefault("persistent_workers", True)
        self._prepare_next = int(num_workers) > 0 and bool(kwargs.get("persistent_workers"))
        if kwargs.get("prefetch_factor") is not None:
            self._prefetch_factor = int(kwargs["prefetch_factor"])
        if int(num_workers) != self.num_workers:
            self.num_workers = int(num_workers)
            self._hold_shared()  # the consumers' budgets (and so their cache) depend on their number
        method = None
        if int(num_workers) > 0 and kwargs.get("multiprocessing_context") is None:
            method = start_method(self.source.paths)
            if method is not None:
                kwargs["multiprocessing_context"] = worker_context(method)
        if not self.unbatched:
            if kwargs.get("batch_size") is not None:
                raise ConfigError(
                    f"{self.path}: the sampler already batches (batch_size={self.options.batch_size}); "
                    "do not pass a DataLoader batch_size unless unbatched=True"
                )
            kwargs["batch_size"] = None
        return ShardLoader(self, num_workers=num_workers, choose_start=method is not None, **kwargs)

    def close(self) -> None:
        """Let go of the node-shared caches this dataset holds across passes."""
        self._drop_holder()
        if self._next is not None:
            self._next.close()
            self._next = None
        self._sampler = None

    def __getstate__(self) -> dict[str, Any]:
        # A running sampler (threads, buffers) never travels to a worker; each builds its own.
        state = dict(self.__dict__)
        state["_sampler"] = state["_holder"] = state["_next"] = state["_memory"] = None
        state["_holder_pending"] = False
        state["_holder_lock"] = state["_holder_thread"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._holder_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"ShardIterableDataset({self.path!r}, batch_size={self.options.batch_size}, "
            f"mode={self.options.mode!r}, rank={self.rank}/{self.world_size}, epoch={self.epoch})"
        )


class ShardLoader(torch.utils.data.DataLoader):
    """The ``DataLoader`` of :meth:`ShardIterableDataset.loader`: when it starts workers over an
    object store whose start method it chose, it checks the choice still holds (``fork`` only while
    this process has not used an object store since), and once they run lets the dataset build what
    it deferred until then (its node-shared holder, which reads the dataset). When its workers'
    iterator goes, the main process lets go of the batch buffers it kept mapped for them."""

    def __init__(self, dataset: ShardIterableDataset, *, choose_start: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._choose_start = choose_start
        self._watched: weakref.ref[Any] | None = None  # the iterator whose end releases the workers' buffers

    def __iter__(self) -> Any:
        dataset = self.dataset
        assert isinstance(dataset, ShardIterableDataset)
        starting = self._iterator is None or not self.persistent_workers  # else the running workers serve
        if self._choose_start and self.num_workers > 0 and starting:
            method = start_method(dataset.source.paths)
            loader: Any = self  # DataLoader's multiprocessing_context property is untyped
            context = loader.multiprocessing_context
            if method is not None and (context is None or context.get_start_method() != method):
                loader.multiprocessing_context = worker_context(method)
        iterator = super().__iter__()
        if self.num_workers > 0 and (self._watched is None or self._watched() is not iterator):
            # Its workers have been joined when it is collected (PyTorch shuts them down first).
            weakref.finalize(iterator, release_exited)
            self._watched = weakref.ref(iterator)
        dataset._ensure_holder(background=self.num_workers > 0)
        return iterator


#: Every sampler option, from its declaration, for help() and the IDE.
ShardIterableDataset.__doc__ = f"{ShardIterableDataset.__doc__}{SamplerOptions.describe()}"


class ShardMapDataset(_TorchDataset):
    """Map-style access by record key, for evaluation: ``ds[key]`` -> dict of tensors.

    Parameters
    ----------
    path
        Dataset directory.
    layout, scale
        Payload presentation, as for :class:`ShardIterableDataset` (per record: ``(C, H, W)`` for
        ``NCHW``).
    gap_bytes
        Coalescing threshold for the batched reads of ``__getitems__``.

    Notes
    -----
    A DataLoader batch (``__getitems__``) is one ``Dataset.read``: each shard visited once, offsets
    ascending. The dataset is opened lazily in each process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        layout: str = "NHWC",
        scale: str | None = None,
        gap_bytes: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.payload_options = PayloadOptions(layout=layout, scale=scale)
        self.gap_bytes = gap_bytes
        with open_dataset(self.path) as ds:
            self.meta = ds.meta
        self.payload_options.check(tuple(self.meta.record.shape), self.path)
        self._ds: Dataset | None = None
        self._pid = -1

    def _dataset(self) -> Dataset:
        if self._ds is None or self._pid != os.getpid():
            kwargs = {} if self.gap_bytes is None else {"gap_bytes": self.gap_bytes}
            self._ds = open_dataset(self.path, **kwargs)
            self._pid = os.getpid()
        return self._ds

    def __len__(self) -> int:
        return self.meta.num_records

    def __getitem__(self, key: int) -> TensorDict:
        record = self._dataset()[key]
        return to_tensors(record, self.meta.payload, self.payload_options, batched=False)

    def __getitems__(self, keys: list[int]) -> list[TensorDict]:
        n = self.meta.num_records
        wanted = np.asarray(keys, dtype=np.int64)
        bad = (wanted < -n) | (wanted >= n)
        if bad.any():
            raise IndexError(f"{self.path}: record {int(wanted[bad][0])} outside [0, {n})")
        batch = to_tensors(self._dataset().read(np.where(wanted < 0, wanted + n, wanted)), self.meta.payload,
                           self.payload_options)  # fmt: skip
        return [{name: t[i] for name, t in batch.items()} for i in range(len(wanted))]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ds"], state["_pid"] = None, -1
        return state

    def close(self) -> None:
        if self._ds is not None:
            self._ds.close()
            self._ds = None
