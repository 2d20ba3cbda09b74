"""The tiered sampler: an exactly uniform random order from sequential reads (DESIGN §4).

See :class:`TieredSampler`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConfigError, OutOfSpaceError, SamplerError
from shardkit.formats import DEFAULT_GAP_BYTES, Dataset
from shardkit.readers.config import parse_capacity, parse_tiers
from shardkit.readers.pipeline import BATCH_PREFETCH, Pipeline, Segment
from shardkit.readers.schedule import MODES, consumer_plan, epoch_stream
from shardkit.readers.static_cache import StaticCache, parse_static_cache, pinned_keys
from shardkit.readers.stats import SamplerStats

__all__ = ["TieredSampler", "STATE_VERSION"]

logger = logging.getLogger(__name__)

#: Version of the :meth:`TieredSampler.state_dict` layout.
STATE_VERSION = 1
#: Bytes per SSD reservoir directory beyond the payload (zarr documents, index, fields).
_SSD_OVERHEAD = 1 << 20


class TieredSampler:
    """Batches of a shardkit dataset in an exactly uniform random order, with sequential reads.

    Tiers are ordered slow -> fast: the dataset on disk, an optional SSD tier (reservoirs of ``K1``
    records written as shardkit datasets under a private directory of ``ssd_dir``) and the RAM
    tier (two buffers of ``K2`` records). Records cross every tier boundary once per epoch, in
    ascending offset order within each file; the batch creator emits them in the epoch's order.

    Parameters
    ----------
    dataset
        Dataset directory or an opened :class:`~shardkit.formats.Dataset` (only its path is used;
        the sampler opens its own reader so it can count disk reads).
    tiers
        ``"ram"`` or ``"ram,ssd"`` (any order, or a list); normalised to slow -> fast.
    ram_size
        This consumer's whole RAM-tier budget: bytes (int), a size string (``"512MiB"``, ``"2GiB"``)
        or a record count (``"10000records"``, ``"10000rec"``). It covers the two RAM blocks (double
        buffering) and, when the budget is at least twice their size, the batches in flight
        (``batch_size * 4`` records: two prefetched, one being built, one held by the consumer).
        ``K2`` = remaining budget / (2 * record size), at least 1.
    ssd_size, ssd_dir
        SSD-tier budget (same syntax; two reservoirs of ``K1`` = ``ssd_size / (2 * record size)``
        records) and the directory that holds the run's private sub-directory (default: the system
        temporary directory). Its free space is checked up front.
    batch_size
        Per-consumer batch size ``B``.
    epochs
        Epochs per iteration (``None`` = forever). An iteration runs epochs
        ``start_epoch .. start_epoch + epochs - 1``; iterating again after it finished continues
        with the next ``epochs`` epochs.
    seed, mode
        ``mode="epoch"``: each epoch's order ``pi`` is a uniform random permutation of all ``N``
        keys drawn from ``np.random.default_rng([seed, epoch])`` (PCG64 via SeedSequence).
        ``"replacement"``: each reservoir (``K`` = ``K1`` with the SSD tier, else ``K2``) is an
        independent uniform ``K``-subset drawn with Algorithm L and emitted in random order; an
        epoch is ``ceil(N / K)`` reservoirs truncated to ``N`` records (inclusion probability ``K/N``
        per reservoir). ``"sequential"``: storage order.
    rank, world_size
        This is consumer ``c = rank`` of ``W = world_size`` (the adapters pass
        ``rank * num_workers + worker_id`` and ``world_size * num_workers``). Global batch ``g`` is
        ``pi[g*B*W : (g+1)*B*W]``; consumer ``c`` takes ``pi[g*B*W + c*B : g*B*W + (c+1)*B]``, and its
        creators read only those keys. Slices of all consumers are disjoint and cover the epoch.
        With a ragged tail the last consumers get fewer records or none.
    drop_last
        Drop the incomplete final global batch, so every consumer gets ``len(self)`` full batches
        (what DDP needs).
    limit
        Stop an iteration after this many records have been emitted to this consumer (the last
        batch is cut short). Nothing beyond the limit is read.
    gap_bytes
        Gaps between wanted records up to this size are read rather than skipped (see
        :mod:`shardkit.formats.reader`; 64 KiB by default, so 150 KB records are never over-read).
    start_epoch
        First epoch of the first iteration (see also :meth:`set_epoch`).
    static_cache
        Static (never-evicted) cache, CoorDL's MinIO policy: ``0`` (default, off), bytes (int), a
        size string (``"256MiB"``) or a record count (``"1000 records"``). ``M`` = capacity /
        record size records (at most ``N``), a uniformly random subset P of the whole dataset drawn
        once from the seed (independent of the epoch orders), are read once at the start of the
        first epoch (ascending offsets) into one RAM array and kept until :meth:`close`. Each RAM
        block then copies its pinned keys from the cache and reads only the others from disk (or
        SSD), so every later epoch reads ``N - M`` records from disk. The budget is **separate
        from** ``ram_size`` (on top of it; the RAM blocks are sized as without the cache). The
        order is unchanged (still exactly ``pi``). With ranks, every consumer pins the same P (it
        depends on the seed only) and serves its own pinned keys from it. See
        :mod:`shardkit.readers.static_cache`.

    Notes
    -----
    Batches are dicts of numpy arrays: the payload (``"image"``/``"audio"``) ``[n, ...]``, every
    per-record field, and ``"key"`` (int64 global record index). Each batch owns its arrays.

    Resume: :meth:`state_dict` holds ``(seed, epoch, position)``, where position counts records of
    ``pi`` consumed by all consumers together (a multiple of the global batch ``B * W`` except at
    the tail). ``pi`` does not depend on ``W``, so :meth:`load_state_dict` on a sampler with another
    world size continues the same order from that position, reading only the records that are left.
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str] | Dataset,
        *,
        tiers: str | Sequence[str] = "ram",
        ram_size: int | str = "512MiB",
        ssd_size: int | str = "4GiB",
        ssd_dir: str | os.PathLike[str] | None = None,
        batch_size: int = 256,
        epochs: int | None = 1,
        seed: int = 0,
        mode: str = "epoch",
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        limit: int | None = None,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        start_epoch: int = 0,
        static_cache: int | str = 0,
    ) -> None:
        self._init_args = dict(
            tiers=tiers, ram_size=ram_size, ssd_size=ssd_size, ssd_dir=ssd_dir, batch_size=batch_size,
            epochs=epochs, seed=seed, mode=mode, rank=rank, world_size=world_size, drop_last=drop_last,
            limit=limit, gap_bytes=gap_bytes, start_epoch=start_epoch, static_cache=static_cache,
        )
        path = dataset.path if isinstance(dataset, Dataset) else Path(dataset)
        self.path = Path(path)
        self.tiers = parse_tiers(tiers)
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.world_size = _positive_int(world_size, "world_size")
        self.rank = _int(rank, "rank")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank: expected 0 <= rank < world_size={self.world_size}, found {rank}")
        self.epochs = None if epochs is None else _int(epochs, "epochs")
        if self.epochs is not None and self.epochs < 0:
            raise ConfigError(f"epochs: expected >= 0 or None (forever), found {epochs}")
        if mode not in MODES:
            raise ConfigError(f"mode: expected one of {', '.join(MODES)}, found {mode!r}")
        self.mode = mode
        self.seed = _int(seed, "seed")
        if self.seed < 0:
            raise ConfigError(f"seed: expected a non-negative integer, found {seed}")
        self.drop_last = bool(drop_last)
        self.limit = None if limit is None else _int(limit, "limit")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"limit: expected >= 0 records, found {limit}")
        self.gap_bytes = _int(gap_bytes, "gap_bytes")
        if self.gap_bytes < 0:
            raise ConfigError(f"gap_bytes: expected >= 0, found {gap_bytes}")
        start = _int(start_epoch, "start_epoch")
        if start < 0:
            raise ConfigError(f"start_epoch: expected >= 0, found {start_epoch}")

        self._ds = Dataset(self.path, gap_bytes=self.gap_bytes)  # metadata + small fields
        self.num_records = self._ds.num_records
        self.record_nbytes = self._ds.record_nbytes
        self.payload_name = self._ds.payload_name
        self.fields = self._ds.fields
        self._ds.close()  # payload reads go through each run's own reader
        rec = self.record_nbytes
        per_epoch = self._records_per_epoch()
        self.ram_bytes = parse_capacity(ram_size, rec, what="ram_size")
        reserve = (BATCH_PREFETCH + 2) * self.batch_size * rec
        blocks = self.ram_bytes - reserve if self.ram_bytes >= 2 * reserve else self.ram_bytes
        #: K2, records per RAM block.
        self.ram_block = max(1, min(blocks // (2 * rec), max(1, per_epoch)))
        #: K1, records per SSD reservoir (None without the SSD tier).
        self.ssd_block: int | None = None
        self.ssd_dir: Path | None = None
        if "ssd" in self.tiers:
            self.ssd_bytes = parse_capacity(ssd_size, rec, what="ssd_size")
            self.ssd_block = max(1, min(self.ssd_bytes // (2 * rec), max(1, per_epoch)))
            self.ssd_dir = Path(ssd_dir) if ssd_dir is not None else Path(tempfile.gettempdir())
            if not self.ssd_dir.is_dir():
                raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.ssd_dir)!r}")
            self._check_ssd_space()
            if self.ssd_block < self.ram_block:
                logger.info("SSD reservoirs (%d records) are smaller than RAM blocks (%d)", self.ssd_block, self.ram_block)
        #: M, records pinned by the static cache (0 = off).
        self.static_cache = parse_static_cache(static_cache, rec, self.num_records)
        self._cache: StaticCache | None = None
        if self.static_cache:
            self._cache = StaticCache(pinned_keys(self.seed, self.num_records, self.static_cache))
        self.stats = SamplerStats()
        self._start_epoch = start
        self._epoch = start
        self._position = 0
        self._run_ref: weakref.ref[_Run] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sizes
    def _records_per_epoch(self) -> int:
        """Upper bound of this consumer's records in one epoch."""
        gb = self.batch_size * self.world_size
        return math.ceil(self.num_records / gb) * self.batch_size if self.num_records else 0

    def _check_ssd_space(self) -> None:
        assert self.ssd_dir is not None and self.ssd_block is not None
        need = 2 * (self.ssd_block * self.record_nbytes + _SSD_OVERHEAD)
        free = shutil.disk_usage(self.ssd_dir).free
        if free < need:
            raise OutOfSpaceError(
                f"{self.ssd_dir}: the SSD tier needs {need / 2**20:.1f} MiB (two reservoirs of {self.ssd_block} "
                f"records), the filesystem has {free / 2**20:.1f} MiB free; lower ssd_size or choose another ssd_dir"
            )

    @property
    def reservoir_size(self) -> int:
        """``K``: records per reservoir of the top tier (``K1`` with the SSD tier, else ``K2``)."""
        return self.ssd_block if self.ssd_block is not None else self.ram_block

    def __len__(self) -> int:
        """Batches this consumer gets in one whole epoch."""
        n, b, w, c = self.num_records, self.batch_size, self.world_size, self.rank
        full, tail = divmod(n, b * w)
        return full + (1 if tail > c * b and not self.drop_last else 0)

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``)."""
        rec = self._ds.meta.record
        spec: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
            self.payload_name: (tuple(rec.shape), np.dtype(rec.dtype))
        }
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
        e = _int(epoch, "epoch")
        if e < 0:
            raise ConfigError(f"epoch: expected >= 0, found {epoch}")
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next iteration (ends a running iteration)."""
        try:
            version, seed, mode = int(state["version"]), int(state["seed"]), str(state["mode"])
            n, epoch, pos = int(state["num_records"]), int(state["epoch"]), int(state["position"])
            start = int(state.get("start_epoch", epoch))
        except (KeyError, TypeError, ValueError) as exc:
            raise SamplerError(f"state dict: expected the keys of TieredSampler.state_dict(), problem: {exc}") from None
        if version != STATE_VERSION:
            raise SamplerError(f"state dict: expected version {STATE_VERSION}, found {version}")
        if seed != self.seed or mode != self.mode:
            raise SamplerError(
                f"state dict: was saved with seed={seed}, mode={mode!r}; this sampler has seed={self.seed}, "
                f"mode={self.mode!r} (the order would differ)"
            )
        if n != self.num_records:
            raise SamplerError(f"state dict: saved for {n} records, {self.path} has {self.num_records}")
        k = state.get("reservoir_size")
        if mode == "replacement" and k is not None and int(k) != self.reservoir_size:
            raise SamplerError(
                f"state dict: replacement mode with reservoirs of {k} records, this sampler's are "
                f"{self.reservoir_size} (set the same ram_size/ssd_size)"
            )
        if not 0 <= pos <= n or epoch < 0:
            raise SamplerError(f"state dict: position {pos} outside [0, {n}] or negative epoch {epoch}")
        self._close_run()
        self._epoch, self._position, self._start_epoch = epoch, pos, min(start, epoch)

    # ------------------------------------------------------------------ iteration
    def _end_epoch(self) -> int | None:
        return None if self.epochs is None else self._start_epoch + self.epochs

    def _segments(self, first_epoch: int, first_position: int, end: int | None) -> Iterator[Segment]:
        """The run's per-epoch plans (computed lazily by the first creator thread)."""
        left = self.limit
        epoch, pos = first_epoch, first_position
        while end is None or epoch < end:
            stream = epoch_stream(self.mode, self.seed, epoch, self.num_records, self.reservoir_size)
            plan = consumer_plan(stream, pos, self.batch_size, self.rank, self.world_size, self.drop_last)
            complete = True
            if left is not None and plan.keys.size > left:
                plan = _truncate(plan, left, pos, self.batch_size, self.world_size)
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

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for DataLoader workers started with spawn: rebuild from arguments + state.
        return {"path": str(self.path), "args": self._init_args, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["path"], **d["args"])  # type: ignore[misc]
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        return (
            f"TieredSampler({str(self.path)!r}, tiers={','.join(self.tiers)}, mode={self.mode}, "
            f"K2={self.ram_block}, K1={self.ssd_block}, static_cache={self.static_cache}, batch_size={self.batch_size}, "
            f"rank={self.rank}/{self.world_size}, epoch={self._epoch}, position={self._position})"
        )


class _Run:
    """One iteration: the consumer end of a :class:`Pipeline`.

    The background threads reference only the pipeline, never this object, so dropping the
    iterator (``break`` then garbage collection) triggers :func:`weakref.finalize`, which stops the
    threads and deletes the SSD directory.
    """

    def __init__(self, sampler: TieredSampler, end: int | None) -> None:
        self._s = sampler
        self._emitted = 0
        self._done = False
        first_epoch, first_pos = sampler._epoch, sampler._position
        segments = sampler._segments(first_epoch, first_pos, end)
        if (end is not None and first_epoch >= end) or sampler.limit == 0:
            self._pipeline: Pipeline | None = None
            self._done = True
            self._finalizer = None
            return
        self._pipeline = Pipeline(
            sampler.path,
            segments,
            fields=sampler.fields,
            stats=sampler.stats,
            ram_block=sampler.ram_block,
            ssd_block=sampler.ssd_block,
            ssd_dir=sampler.ssd_dir,
            gap_bytes=sampler.gap_bytes,
            static_cache=sampler._cache,
        )
        self._finalizer = weakref.finalize(self, self._pipeline.shutdown)

    def __iter__(self) -> _Run:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._done or self._pipeline is None:
            raise StopIteration
        s = self._s
        s.stats._start()
        t0 = time.perf_counter()
        try:
            while True:
                item = self._pipeline.get()
                if item[0] == "batch":
                    _, batch, epoch, position = item
                    s._epoch, s._position = epoch, position
                    n = int(batch["key"].shape[0])
                    self._emitted += n
                    s.stats._delivered(n, batch[s.payload_name].nbytes, time.perf_counter() - t0)
                    return dict(batch)
                if item[0] == "end":
                    if item[1].complete:
                        s._epoch, s._position = item[1].epoch + 1, 0
                    continue
                # done
                self.close()
                raise StopIteration
        except BaseException:
            if not self._done:
                s.stats._stalled(time.perf_counter() - t0)
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


def _truncate(plan: Any, left: int, start: int, batch_size: int, world_size: int) -> Any:
    """Cut a plan after ``left`` keys (for ``limit``)."""
    from shardkit.readers.schedule import ConsumerPlan

    ends = np.cumsum(plan.batch_sizes)
    nb = int(np.searchsorted(ends, left, side="left")) + 1
    sizes = plan.batch_sizes[:nb].copy()
    positions = plan.positions[:nb].copy()
    cut = int(ends[nb - 1] - left)
    if cut:
        sizes[-1] -= cut
        if world_size == 1:
            positions[-1] -= cut  # exact: the rest of the batch is emitted after a resume
    return ConsumerPlan(keys=plan.keys[:left], batch_sizes=sizes, positions=positions)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what}: expected an integer, found {value!r}")
    return int(value)


def _positive_int(value: Any, what: str) -> int:
    v = _int(value, what)
    if v <= 0:
        raise ConfigError(f"{what}: expected a positive integer, found {value!r}")
    return v
