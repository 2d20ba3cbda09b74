"""Decoding the input sequence in input order, in this process or in a pool of worker processes.

:func:`outcomes` yields one :data:`Outcome` per decode call, strictly in input order whatever the
number of workers, with a bounded number of tasks in flight; workers receive the converter's small
:class:`~shardkit.converters.base.Decoder` once and hand payloads back through a ring in ``/dev/shm``
(:class:`_RingSpec`). Worker start: :mod:`~shardkit.converters.main_guard`; docs/design.md §5.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import stat
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import Decoded, Decoder
from shardkit.converters.main_guard import GUARD, adopt_environment, start_method, worker_context
from shardkit.errors import ConversionError, InputFileError
from shardkit.processes import exit_when_gone, pid_alive

__all__ = ["Failed", "Outcome", "Produced", "RingSlots", "Skipped", "announce_inputs", "default_workers",
           "join_ended_pools", "keep_freed_memory", "outcomes"]

logger = logging.getLogger(__name__)

#: Tasks in flight per worker.
_INFLIGHT_PER_WORKER = 3
#: Payload bytes a pool task aims at (more inputs than the converter's ``chunk_size`` when its records
#: are small): each task costs both sides a pickle, a pipe round trip and a future, about 0.3 ms of CPU
#: per 224x224x3 image at 4 images a task, 0.15 ms at 16 (``benchmarks/convert.py``, ``--workers 2``).
_TASK_BYTES = 2 << 20
#: Most inputs in one task (bounds what one slow task holds back of the in-order stream).
_MAX_TASK_INPUTS = 32
#: Inputs decoded in this process (``workers=1``) whose files are announced ahead of the one decoded:
#: between half of it and all of it, announced half at a time.
_ANNOUNCE_AHEAD = 32
#: Bytes of an input file announced at most (its start): a huge file among the inputs is not read
#: into the page cache whole before its decode looks at it.
_ANNOUNCE_BYTES = 16 << 20


def task_inputs(chunk_size: int, record_nbytes: int) -> int:
    """Inputs per pool task: at least ``chunk_size``, more while their records stay under :data:`_TASK_BYTES`."""
    chunk = max(1, int(chunk_size))
    return max(chunk, min(_MAX_TASK_INPUTS, _TASK_BYTES // max(1, int(record_nbytes))))


def next_task_inputs(remaining: int, task: int, chunk_size: int, workers: int) -> int:
    """Inputs of the next pool task when ``remaining`` inputs are left to submit: ``task``
    (:func:`task_inputs`) while they give every worker two more such tasks, then fewer, down to
    ``chunk_size``, so that the workers run out of work together instead of one decoding a whole last
    task while the others wait (the end of a conversion waits for the slowest worker)."""
    tail = -(-remaining // (2 * max(1, workers)))
    return max(1, min(remaining, max(int(chunk_size), min(task, tail))))


@dataclass(frozen=True)
class Produced:
    """Input ``index`` gave ``decoded`` (possibly one part of its records)."""

    index: int
    decoded: Decoded


@dataclass(frozen=True)
class Skipped:
    """Input ``index`` (``path``) cannot be used, for ``reason`` (a category, ``": "``, details)."""

    index: int
    path: str
    reason: str


@dataclass(frozen=True)
class Failed:
    """Decoding input ``index`` (``path``) went wrong in a way that must stop the run."""

    index: int
    path: str
    message: str


#: What one decode call gave.
Outcome = Produced | Skipped | Failed


def default_workers() -> int:
    """Cores available to this process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def announce_inputs(decoder: Decoder, items: Iterable[Any]) -> None:
    """Ask the kernel to start reading the input files of ``items`` (:meth:`Decoder.input_files`) and
    return without waiting (``POSIX_FADV_WILLNEED``): a cold decode otherwise waits for its file's read
    with the CPU idle, a worker at a time. Only regular files are announced, each up to
    :data:`_ANNOUNCE_BYTES`; a path is looked at before it is opened, so a device or FIFO is never
    opened (and one swapped in after the look finds a non-blocking open that is checked again); a file
    that cannot be opened is left to its decode to report."""
    for item in items:
        for path in decoder.input_files(item):
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):  # a device is never opened here (an open can act)
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.posix_fadvise(fd, 0, _ANNOUNCE_BYTES, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def decode_one(decoder: Decoder, index: int, item: Any, start: int = 0) -> Outcome:
    """Decode records ``start, ...`` of input ``index``; every exception becomes an outcome."""
    try:
        return Produced(index, decoder.decode(item, start))
    except InputFileError as exc:
        if start == 0:
            return Skipped(index, decoder.item_path(item), exc.reason)
        # Its first records are written already: skipping it now would keep half of it.
        return Failed(index, decoder.item_path(item), f"{exc.reason} (after {start} of its records were written; "
                      "fix or remove the file, or re-run with --overwrite)")
    except MemoryError:
        return Failed(index, decoder.item_path(item), "out of memory while decoding")
    except ConversionError as exc:  # the decoder's own account of what must stop the run
        return Failed(index, decoder.item_path(item), str(exc))
    except Exception as exc:
        return Failed(index, decoder.item_path(item), f"unexpected failure while decoding: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- worker processes
@dataclass(frozen=True)
class _RingSpec:
    """Where decoded payloads travel from workers to the parent: a file-backed ring of slots, one per
    task (pickling every 150 KB image through the pipe cost about a quarter of two workers' time)."""

    path: str
    slots: int
    per_slot: int
    record_nbytes: int

    def open(self, mode: str) -> np.ndarray:
        """The ring mapped as a plain array (a ``np.memmap`` would run its ``__array_finalize__`` on every
        slice: about 5 per record, 10% of the parent's per-record work at ``workers=2``)."""
        shape = (self.slots, self.per_slot, self.record_nbytes)
        ring: np.ndarray = np.memmap(self.path, dtype=np.uint8, mode=mode, shape=shape)  # type: ignore[call-overload]
        return ring.view(np.ndarray)


@dataclass(frozen=True)
class _InRing:
    """Placeholder for a payload left in the ring: record ``index`` of the task's slot."""

    index: int


_DECODER: Decoder | None = None
_RING: np.ndarray | None = None

#: glibc ``mallopt`` parameters, and what a decode worker sets them to: blocks up to 32 MiB (glibc's
#: largest) come from the heap, and up to 64 MiB of freed heap is kept for the next input.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_WORKER_MMAP_THRESHOLD = 32 << 20
_WORKER_TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Let this process's malloc (glibc) reuse the memory a decode frees instead of returning it to the
    system at every input; ``False`` where there is no such malloc.

    An image decode allocates and frees about 1 MB of buffers per input, several at a time: with
    glibc's defaults the heap is trimmed after each input and the next one faults every 4 KiB page in
    again (about 260 page faults and 1.2-1.4 ms of system CPU per 500x375 JPEG in a worker, a fifth of
    its time; ``benchmarks/write.py``). Only in decode workers: the caller's process is left as it is.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _WORKER_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _WORKER_TRIM_THRESHOLD))


def _init_worker(decoder: Decoder, parent_pid: int, ring: _RingSpec | None = None,
                 environ: dict[str, str] | None = None) -> None:
    global _DECODER, _RING
    if environ is not None:
        adopt_environment(environ)
    keep_freed_memory()
    _DECODER = decoder
    _RING = None if ring is None else ring.open("r+")
    # Ctrl-C goes to the whole process group; the parent decides, workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Pool workers never see EOF when the parent is SIGKILLed: without this they would wait forever.
    exit_when_gone(parent_pid)


def _decode_chunk(chunk: list[tuple[int, Any, int]], slot: int | None = None) -> list[Outcome]:
    decoder = _DECODER
    if decoder is None:  # pragma: no cover - initializer always ran
        raise RuntimeError("worker not initialised")
    results = [decode_one(decoder, i, item, start) for i, item, start in chunk]
    if slot is not None and _RING is not None:
        ring = _RING[slot]
        j = 0
        for outcome in results:
            if not isinstance(outcome, Produced):
                continue
            for rec in outcome.decoded.records:
                payload = np.ascontiguousarray(rec[decoder.payload])
                if j >= ring.shape[0] or payload.nbytes != ring.shape[1]:
                    continue  # does not fit (e.g. many audio windows): travels pickled
                ring[j] = payload.reshape(-1).view(np.uint8)
                rec[decoder.payload] = _InRing(j)
                j += 1
    return results


def _take_from_ring(decoder: Decoder, results: list[Outcome], ring: np.ndarray) -> None:
    """Replace ring placeholders by read-only views of the payloads in the slot. The slot is reused once
    the consumer asks for the outcome after the task's last one, so it copies what it keeps before that
    (:func:`outcomes`); a copy here cost the parent a fresh array, and its page faults, per record."""
    spec = decoder.record
    for outcome in results:
        if not isinstance(outcome, Produced):
            continue
        for rec in outcome.decoded.records:
            ref = rec[decoder.payload]
            if isinstance(ref, _InRing):
                rec[decoder.payload] = ring[ref.index].view(spec.dtype).reshape(spec.shape)


def _ring_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _remove_stale_rings(directory: str) -> None:
    """Delete rings left by conversions that were killed (their pid no longer runs)."""
    for path in Path(directory).glob("shardkit-convert-*.ring"):
        try:
            pid = int(path.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            path.unlink(missing_ok=True)


class RingSlots:
    """Lets the consumer of :func:`outcomes` keep the ring slot whose payloads it is being handed, and give
    it back later from any thread, so that it can write payloads straight from the ring (a copy of every
    record into a batch buffer was the parent's largest per-record cost at ``workers=2``).

    While a task's outcomes are handed over, :attr:`current` is ``(slot, rows)``: ``rows`` are the slot's
    ring rows (``[records per slot, record bytes]`` uint8, read-only), a payload view being one of them.
    :meth:`keep` holds the slot until the function it returns is called; a slot is reused only once its
    outcomes were all handed over and every hold was given back. ``spare`` slots are added to the ring for
    the holds: the consumer must never hold more slots than that at once (the engine holds at most its
    writer's queue, the batch being written and the one being filled).
    """

    def __init__(self, spare: int) -> None:
        self.spare = int(spare)
        #: ``(slot, its ring rows)`` while that slot's outcomes are handed over, else ``None``.
        self.current: tuple[int, np.ndarray] | None = None
        self._lock = threading.Lock()
        self._holds: Counter[int] = Counter()
        self._handed: set[int] = set()  # every outcome handed over, holds outstanding
        self._back: deque[int] = deque()  # free again (appended by any thread)

    def keep(self) -> Callable[[], None]:
        """Hold the current slot; call the returned function (once, from any thread) to give it back."""
        if self.current is None:
            raise RuntimeError("no ring slot is being handed over")
        slot = self.current[0]
        with self._lock:
            self._holds[slot] += 1

        def give_back() -> None:
            with self._lock:
                self._holds[slot] -= 1
                if self._holds[slot] > 0:
                    return
                del self._holds[slot]
                if slot in self._handed:
                    self._handed.discard(slot)
                    self._back.append(slot)

        return give_back

    def _done(self, slot: int) -> bool:
        """Every outcome of ``slot`` was handed over: ``True`` if it is free now, else it comes back later."""
        with self._lock:
            if self._holds.get(slot, 0) > 0:
                self._handed.add(slot)
                return False
            return True

    def _returned(self) -> list[int]:
        """Slots given back since the last call."""
        out = []
        while self._back:
            out.append(self._back.popleft())
        return out


#: Threads shutting down pools whose outcomes were all handed over, not yet joined.
_ENDED: list[threading.Thread] = []
_ENDED_LOCK = threading.Lock()


def join_ended_pools() -> None:
    """Wait for the workers of the decode pools that :func:`outcomes` ended without waiting.

    A pool that gave all its outcomes tells its workers to exit and returns at once: they exit while
    the caller writes its last batch and closes its last shard, instead of the caller waiting for them
    first (the serial end of a conversion). The caller joins them here once that is done, and
    :func:`outcomes` does before it starts a pool (workers are forked only when no other thread runs).
    """
    with _ENDED_LOCK:
        ended = _ENDED[:]
        _ENDED.clear()
    for thread in ended:
        thread.join()


# ---------------------------------------------------------------------- the ordered stream
def _continued(first: Outcome, decode: Callable[[int, int], Outcome]) -> Iterator[Outcome]:
    """``first``, then the further parts of its input while it says there are more."""
    outcome = first
    yield outcome
    while isinstance(outcome, Produced) and outcome.decoded.next_start is not None:
        outcome = decode(outcome.index, outcome.decoded.next_start)
        yield outcome


def outcomes(
    decoder: Decoder,
    items: Sequence[Any],
    first: tuple[int, int],
    workers: int,
    chunk_size: int,
    slots: RingSlots | None = None,
) -> Iterator[Outcome]:
    """The outcomes of decoding ``items`` from input ``first[0]``, record ``first[1]`` (a resume may start
    inside an input), in order, by ``workers`` processes (1: here) given at least ``chunk_size`` inputs a
    task (:func:`task_inputs`; the last ones smaller, :func:`next_task_inputs`). A payload may be a
    read-only view of a worker's ring slot, valid until the next outcome is asked for: the consumer
    copies what it keeps, or holds the slot through ``slots``. Once every outcome is handed over the workers
    are told to exit and not waited for: the caller joins them with :func:`join_ended_pools`."""
    join_ended_pools()
    method = start_method(workers) if workers > 1 else None
    start_index, start_record = first
    if method is None:
        def here(index: int, start: int) -> Outcome:
            return decode_one(decoder, index, items[index], start)

        announced = start_index
        for i in range(start_index, len(items)):
            if announced - i <= _ANNOUNCE_AHEAD // 2:
                stop = min(len(items), i + _ANNOUNCE_AHEAD)
                announce_inputs(decoder, (items[k] for k in range(announced, stop)))
                announced = stop
            yield from _continued(here(i, start_record if i == start_index else 0), here)
        return
    yield from _pool_outcomes(decoder, items, first, workers, task_inputs(chunk_size, decoder.record.nbytes), method,
                              slots, chunk_size)


def _pool_outcomes(
    decoder: Decoder, items: Sequence[Any], first: tuple[int, int], workers: int, chunk: int, method: str,
    slots: RingSlots | None = None, chunk_size: int = 1,
) -> Iterator[Outcome]:
    n = len(items)
    inflight = workers * _INFLIGHT_PER_WORKER
    _remove_stale_rings(_ring_dir())
    fd, ring_path = tempfile.mkstemp(prefix=f"shardkit-convert-{os.getpid()}-", suffix=".ring", dir=_ring_dir())
    # The consumer's holds get slots of their own: tasks in flight never wait for a write.
    ring_spec = _RingSpec(ring_path, inflight + (0 if slots is None else slots.spare), chunk, decoder.record.nbytes)
    try:
        os.ftruncate(fd, ring_spec.slots * ring_spec.per_slot * ring_spec.record_nbytes)
    finally:
        os.close(fd)
    ring = ring_spec.open("r")
    free = list(range(ring_spec.slots))
    context = worker_context(method, (__name__, type(decoder).__module__))
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                               initargs=(decoder, os.getpid(), ring_spec, dict(os.environ)))
    pending: deque[tuple[int, Future[list[Outcome]]]] = deque()
    decoded_any = False

    def result(fut: Future[list[Outcome]]) -> list[Outcome]:
        nonlocal decoded_any
        try:
            out = fut.result()
        except BrokenProcessPool:
            if not decoded_any:
                raise ConversionError(
                    "a decode worker process died before it decoded anything (see the messages above: a worker "
                    f"that runs the calling script again needs its top-level code under `{GUARD}`); "
                    "completed shards are kept, and --workers 1 decodes without worker processes"
                ) from None
            raise ConversionError(
                "a decode worker process died (killed, out of memory or a crashing decoder); completed shards "
                "are kept: once the cause is gone, the same conversion resumes after them"
            ) from None
        decoded_any = True
        return out

    def more(index: int, start: int) -> Outcome:
        # Further records of one input: decoded by a worker, returned pickled (no ring slot).
        (outcome,) = result(pool.submit(_decode_chunk, [(index, items[index], start)], None))
        return outcome

    start_index, start_record = first
    next_i = start_index
    ended = False
    try:
        while pending or next_i < n:
            if slots is not None:
                free.extend(slots._returned())
            while next_i < n and free and len(pending) < inflight:
                stop = next_i + next_task_inputs(n - next_i, chunk, chunk_size, workers)
                slot = free.pop()
                task = [(k, items[k], start_record if k == start_index else 0) for k in range(next_i, stop)]
                announce_inputs(decoder, (item for _, item, _ in task))  # read while the tasks before it decode
                pending.append((slot, pool.submit(_decode_chunk, task, slot)))
                next_i = stop
            if not pending:  # every slot is held: the consumer broke its promise of at most ``spare`` holds
                raise RuntimeError(f"every ring slot is held by the consumer (spare: {ring_spec.slots - inflight})")
            slot, fut = pending.popleft()
            results = result(fut)
            _take_from_ring(decoder, results, ring[slot])
            if slots is None:
                free.append(slot)
                for outcome in results:
                    yield from _continued(outcome, more)
                continue
            slots.current = (slot, ring[slot])
            try:
                for outcome in results:
                    yield from _continued(outcome, more)
            finally:
                slots.current = None
            if slots._done(slot):
                free.append(slot)
        ended = True
    finally:
        for _, f in pending:
            f.cancel()
        if ended:  # every task done: the workers exit while the caller closes its shard
            closing = threading.Thread(target=pool.shutdown, name="shardkit-decode-pool-end", daemon=True)
            closing.start()
            with _ENDED_LOCK:
                _ENDED.append(closing)
        else:
            pool.shutdown(wait=True, cancel_futures=True)
        del ring
        os.unlink(ring_path)
