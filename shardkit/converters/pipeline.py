"""Run a converter: parallel decode, deterministic order, resumable writes, skips and a summary.

Order and determinism
    The converter's :meth:`~shardkit.converters.base.Converter.scan` fixes the input sequence. Tasks
    (chunks of consecutive inputs) go to a process pool and their results are consumed strictly in
    submission order, so records reach the writer in input order whatever ``workers`` is, and the
    payload shards are byte-identical for any worker count. ``workers=1`` decodes in the calling
    process (no inter-process copies at all).

Bounded memory
    At most ``3 x workers`` tasks are in flight; a new one is submitted only when the oldest result
    has been written. The writer streams records to the open shard file, so memory stays at about
    ``workers x chunk`` decoded inputs plus the writer's small per-shard field buffers, whatever
    the corpus size. (``Pool.imap`` would read the whole input iterable ahead and let results
    pile up when the writer is slower, so it is not used.)

Payload path
    Decode workers write each task's decoded payloads into a slot of a file-backed ring in
    ``/dev/shm`` and return only small fields; the parent copies the payloads out and reuses the
    slot (see :class:`_RingSpec`). Writes to the dataset run on a background thread
    (:class:`_BackgroundWriter`), so decoding never waits for a shard's fsync.

Resume
    Each record carries the *input cursor* after it; :class:`~shardkit.formats.DatasetWriter`
    stages it with every completed shard. Because one input may give several records (audio
    windows), the cursor counts ``input_index << WINDOW_BITS | windows_done``; a resumed run starts
    at that input and drops the windows already written, so shards are cut at exactly the same
    records as in an uninterrupted run. The config stored with the staging directory holds every
    output-shaping parameter and a fingerprint of the input sequence, so a resume with different
    parameters or a changed corpus is refused. ``workers`` and ``strict`` are not part of it: they
    do not change the output.

Bad inputs
    A decode that raises :class:`~shardkit.errors.InputFileError` becomes a skip (path + reason,
    in the summary and in the dataset metadata), or with ``strict`` stops the run with a
    :class:`~shardkit.errors.ConversionError` naming the file; completed shards stay staged.
    Any other exception in a worker is a bug or a crash, never a silent skip: it stops the run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import Converter, detect_kind, get_converter, reason_category
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import DatasetMeta, DatasetWriter
from shardkit.formats.spec import DEFAULT_SHARD_BYTES, records_per_shard_for
from shardkit.formats.writer import remove_output

__all__ = ["ConvertSummary", "convert", "run_converter", "default_workers", "WINDOW_BITS"]

logger = logging.getLogger(__name__)

#: Low bits of an input cursor that count records already written from the current input.
WINDOW_BITS = 20
_WINDOW_MASK = (1 << WINDOW_BITS) - 1
#: Tasks in flight per worker.
_INFLIGHT_PER_WORKER = 3
#: Records gathered before one call to ``DatasetWriter.write``.
_WRITE_BATCH = 64

#: Progress callback: ``(inputs_done, inputs_total, records_written)``.
ProgressFn = Callable[[int, int, int], None]


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion did.

    Attributes
    ----------
    output
        Dataset directory.
    kind
        Corpus kind.
    records
        Records in the finished dataset (including any written before a resume).
    skipped
        Skipped inputs by reason category (``{"corrupt": 2, "missing": 1}``); the full reasons are in
        the dataset metadata.
    bytes
        Size of the dataset directory.
    seconds
        Wall time of this run.
    records_this_run
        Records written by this run (``records`` minus what a resume found done).
    notes
        Things worth knowing that are not skips (``{"capped": 3}``: COCO images over ``max_boxes``).
    already_complete
        The same dataset was already there; nothing was done.
    """

    output: Path
    kind: str
    records: int
    skipped: Mapping[str, int]
    bytes: int
    seconds: float
    records_this_run: int = 0
    notes: Mapping[str, int] = field(default_factory=dict)
    already_complete: bool = False

    @property
    def records_per_second(self) -> float:
        return self.records_this_run / self.seconds if self.seconds > 0 else 0.0

    @property
    def num_skipped(self) -> int:
        return int(sum(self.skipped.values()))


def default_workers() -> int:
    """Cores available to this process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------- worker side
_WORKER: Converter | None = None

#: One decoded input: ``(index, "ok", records)``, ``(index, "skip", (path, reason))`` or
#: ``(index, "error", (path, message))``.
Outcome = tuple[int, str, Any]


def _parent_alive(pid: int) -> bool:
    # A SIGKILLed parent stays a zombie until its own parent reaps it: treat "Z" as dead.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _watch_parent(pid: int) -> None:
    while _parent_alive(pid):
        time.sleep(0.5)
    os._exit(1)


@dataclass(frozen=True)
class _RingSpec:
    """Where decoded payloads travel from workers to the parent: a file-backed ring of slots.

    Pickling every decoded 150 KB image through the pool's pipe cost about a quarter of two
    workers' time on 2 cores (measured: 2,000 images in 3.0-3.5 s returning arrays vs 2.6 s
    returning nothing). Instead each task gets a slot; the worker writes the chunk's payloads there
    and returns only small fields, and the parent copies the payloads out and frees the slot.
    """

    path: str
    slots: int
    per_slot: int
    record_nbytes: int

    def open(self, mode: str) -> np.memmap:
        shape = (self.slots, self.per_slot, self.record_nbytes)
        return np.memmap(self.path, dtype=np.uint8, mode=mode, shape=shape)  # type: ignore[call-overload,no-any-return]


@dataclass(frozen=True)
class _InRing:
    """Placeholder for a payload left in the ring: record ``index`` of the task's slot."""

    index: int


_RING: np.memmap | None = None


def _init_worker(conv: Converter, parent_pid: int, ring: _RingSpec | None = None) -> None:
    global _WORKER, _RING
    _WORKER = conv
    _RING = None if ring is None else ring.open("r+")
    # Ctrl-C goes to the whole process group; the parent decides, workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Pool workers hold both ends of their task queue, so they never see EOF when the parent is
    # SIGKILLed: without this watchdog they would wait forever (and keep the parent's pipes open).
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="shardkit-parent-watch").start()


def _decode_one(conv: Converter, index: int, item: Any) -> Outcome:
    try:
        return index, "ok", conv.decode(item)
    except InputFileError as exc:
        return index, "skip", (conv.item_path(item), exc.reason)
    except MemoryError:
        return index, "error", (conv.item_path(item), "out of memory while decoding")
    except Exception as exc:
        return index, "error", (conv.item_path(item), f"{type(exc).__name__}: {exc}")


def _decode_chunk(chunk: list[tuple[int, Any]], slot: int | None = None) -> list[Outcome]:
    conv = _WORKER
    if conv is None:  # pragma: no cover - initializer always ran
        raise RuntimeError("worker not initialised")
    outcomes = [_decode_one(conv, i, item) for i, item in chunk]
    if slot is not None and _RING is not None:
        ring = _RING[slot]
        j = 0
        for _, status, records in outcomes:
            if status != "ok":
                continue
            for rec in records:
                payload = np.ascontiguousarray(rec[conv.payload])
                if j >= ring.shape[0] or payload.nbytes != ring.shape[1]:
                    continue  # does not fit (e.g. many audio windows): travels pickled
                ring[j] = payload.reshape(-1).view(np.uint8)
                rec[conv.payload] = _InRing(j)
                j += 1
    return outcomes


def _take_from_ring(conv: Converter, outcomes: list[Outcome], ring: np.ndarray) -> None:
    """Replace ring placeholders by copies of the payloads (the slot is reused afterwards)."""
    spec = conv.record_spec()
    for _, status, records in outcomes:
        if status != "ok":
            continue
        for rec in records:
            ref = rec[conv.payload]
            if isinstance(ref, _InRing):
                rec[conv.payload] = ring[ref.index].view(spec.dtype).reshape(spec.shape).copy()


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
        if pid != os.getpid() and not _parent_alive(pid):
            path.unlink(missing_ok=True)


def _main_is_importable() -> bool:
    """Whether spawned workers can re-import ``__main__`` (they must, as for DataLoader workers)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is None or os.path.exists(path) or getattr(main, "__spec__", None) is not None


def _outcomes(conv: Converter, items: Sequence[Any], start: int, workers: int) -> Iterator[Outcome]:
    n = len(items)
    if workers > 1 and not _main_is_importable():
        # Worker processes start by re-importing the caller's main module (forkserver / spawn); a
        # program read from stdin or typed with ``python -c`` has no file to import from.
        logger.warning("the calling program has no importable main module (stdin?): decoding in this "
                       "process instead of %d workers", workers)
        workers = 1
    if workers <= 1:
        for i in range(start, n):
            yield _decode_one(conv, i, items[i])
        return
    chunk = max(1, int(conv.chunk_size))
    inflight = workers * _INFLIGHT_PER_WORKER
    _remove_stale_rings(_ring_dir())
    fd, ring_path = tempfile.mkstemp(prefix=f"shardkit-convert-{os.getpid()}-", suffix=".ring", dir=_ring_dir())
    ring_spec = _RingSpec(ring_path, inflight, chunk, conv.record_spec().nbytes)
    try:
        os.ftruncate(fd, ring_spec.slots * ring_spec.per_slot * ring_spec.record_nbytes)
    finally:
        os.close(fd)
    ring = ring_spec.open("r")
    free = list(range(inflight))
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(conv, os.getpid(), ring_spec)
    )
    pending: deque[tuple[int, Future[list[Outcome]]]] = deque()
    next_i = start
    try:
        while pending or next_i < n:
            while next_i < n and free:
                stop = min(n, next_i + chunk)
                slot = free.pop()
                pending.append((slot, pool.submit(_decode_chunk, [(k, items[k]) for k in range(next_i, stop)], slot)))
                next_i = stop
            slot, fut = pending.popleft()
            try:
                results = fut.result()
            except BrokenProcessPool:
                raise ConversionError(
                    "a decode worker process died (killed, out of memory or a crashing decoder); "
                    "completed shards are kept: re-run the same command to resume"
                ) from None
            _take_from_ring(conv, results, ring[slot])
            free.append(slot)
            yield from results
    finally:
        for _, f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        del ring
        os.unlink(ring_path)


# ---------------------------------------------------------------------- parent side
def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


class _NothingConverted(ConversionError):
    """Every input was skipped: an empty dataset would look complete, so none is written."""


def _strict_stop(path: str, reason: str) -> ConversionError:
    return ConversionError(
        f"{path}: {reason} (stopped by --strict; completed shards are kept: fix or remove the input, "
        "or re-run without --strict to skip it)"
    )


class _BackgroundWriter:
    """Run a :class:`DatasetWriter`'s writes and skips, in order, on one background thread.

    Decoding and writing then overlap: while the writer streams a batch and waits for a shard's
    fsync, the caller (or the decode processes feeding it) keeps decoding. Measured with
    ``benchmarks/convert.py``: with writes in the decoding thread, ``--workers 1`` was 15% slower
    than a bare decode loop, most of it the wait for each shard's fsync. At most ``_QUEUED``
    batches wait, so memory stays bounded. Operations keep their order (one thread, one FIFO), so
    the output is the same as writing inline; a failure is re-raised in the caller at its next call.
    """

    _QUEUED = 2

    def __init__(self, writer: DatasetWriter) -> None:
        self.writer = writer
        self.records_per_shard = writer.records_per_shard
        #: Records handed over so far (written or queued), counted from the resumed position.
        self.records_written = writer.records_written
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]] | None] = (
            queue.Queue(self._QUEUED)
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardkit-convert-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            if self._error is not None:
                continue  # drain without acting after a failure
            fn, args, kwargs = op
            try:
                fn(*args, **kwargs)
            except BaseException as exc:
                self._error = exc

    def _submit(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((fn, args, kwargs))

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
        self.records_written += int(cursors.shape[0])
        self._submit(self.writer.write, batch, cursors=cursors)

    def skip(self, path: str, reason: str, cursor: int) -> None:
        self._submit(self.writer.skip, path, reason, cursor=cursor)

    def drain(self) -> None:
        """Wait until every queued operation ran; re-raise the first failure."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> DatasetMeta:
        self.drain()
        return self.writer.close()

    def abort(self) -> None:
        """Finish what was queued (completed shards stay staged for a resume), then abort."""
        try:
            self.drain()
        except BaseException:
            pass
        self.writer.abort()


class _Batcher:
    """Gather records and hand them to the writer in batches, with their input cursors."""

    def __init__(self, writer: _BackgroundWriter, names: list[str]) -> None:
        self.writer = writer
        self.names = names
        self.rows: list[dict[str, np.ndarray]] = []
        self.cursors: list[int] = []

    def add(self, record: dict[str, np.ndarray], cursor: int) -> None:
        self.rows.append(record)
        self.cursors.append(cursor)
        # Write at least at every shard boundary, so a shard is completed (and staged for resume)
        # as soon as its last record is decoded.
        rps = self.writer.records_per_shard
        if len(self.rows) >= min(_WRITE_BATCH, rps - self.writer.records_written % rps):
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        batch = {name: np.stack([r[name] for r in self.rows]) for name in self.names}
        self.writer.write(batch, cursors=np.asarray(self.cursors, dtype=np.int64))
        self.rows, self.cursors = [], []


def run_converter(
    conv: Converter,
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    records_per_shard: int | None = None,
    progress: ProgressFn | None = None,
) -> ConvertSummary:
    """Convert with an already constructed converter (see :func:`convert`)."""
    t0 = time.perf_counter()
    out = Path(out)
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ConfigError(f"--workers: expected 1 or more, found {workers}")
    scan = conv.scan()
    items = scan.items
    n = len(items)
    if strict and scan.skipped:
        s = scan.skipped[0]
        raise _strict_stop(s.path, s.reason)
    if records_per_shard is None and conv.payload == "image" and n:
        # One record per input at most: a corpus smaller than a shard gets a shard (and a shard
        # index, which has one entry per slot) of its own size instead of a mostly empty one.
        full = records_per_shard_for(conv.record_spec().nbytes, shard_bytes)
        records_per_shard = min(full, n) if n < full else None
    config = {
        "converter": conv.config(),
        "inputs": conv.inputs_fingerprint(scan),
        "shard_bytes": None if records_per_shard else int(shard_bytes),
    }
    writer = DatasetWriter(
        out,
        kind=conv.kind,
        payload=conv.payload,
        record=conv.record_spec(),
        fields=conv.fields(),
        labels=conv.labels(),
        records_per_shard=records_per_shard,
        shard_bytes=shard_bytes,
        compression=compression,
        transform=conv.transform(),
        source=conv.source(),
        extra=conv.extra(),
        config=config,
        resume=True,
        overwrite=overwrite,
    )
    if writer.complete:
        meta = writer.meta
        logger.info("%s: already converted with the same parameters", out)
        return ConvertSummary(
            output=out, kind=meta.kind, records=meta.num_records,
            skipped=dict(Counter(reason_category(s.reason) for s in meta.skipped)),
            bytes=_dir_bytes(out), seconds=time.perf_counter() - t0, already_complete=True,
        )
    start = writer.input_cursor
    first_item, first_window = start >> WINDOW_BITS, start & _WINDOW_MASK
    resumed_records = writer.records_written
    # Writes run on a background thread so decoding never waits for the disk.
    sink = _BackgroundWriter(writer)
    if start == 0:
        for s in scan.skipped:
            sink.skip(s.path, s.reason, cursor=0)
    names = [conv.payload, *conv.fields()]
    batcher = _Batcher(sink, names)
    notes: Counter[str] = Counter()
    run_skips: Counter[str] = Counter(reason_category(sk.reason) for sk in scan.skipped) if start == 0 else Counter()
    if progress is not None:
        progress(first_item, n, resumed_records)
    try:
        for index, status, value in _outcomes(conv, items, first_item, workers):
            base = index << WINDOW_BITS
            if status == "ok":
                records = value
                k = len(records)
                if k > _WINDOW_MASK:
                    raise ConversionError(f"{conv.item_path(items[index])}: gives {k} records, more than {_WINDOW_MASK}")
                for w, rec in enumerate(records):
                    if index == first_item and w < first_window:
                        continue
                    note = rec.pop("_note", None)
                    if note is not None:
                        text = str(note)
                        notes[reason_category(text)] += 1
                        logger.warning("%s: %s", conv.item_path(items[index]), text)
                    batcher.add(rec, base + w + 1 if w < k - 1 else (index + 1) << WINDOW_BITS)
                if k == 0:
                    sink.skip(conv.item_path(items[index]), "empty: no records", cursor=base)
            elif status == "skip":
                path, reason = value
                if strict:
                    batcher.flush()
                    raise _strict_stop(path, reason)
                logger.info("skipped %s: %s", path, reason)
                run_skips[reason_category(reason)] += 1
                # The writer files a skip with the first shard whose cursor range covers it.
                sink.skip(path, reason, cursor=base)
            else:
                path, message = value
                raise ConversionError(f"{path}: unexpected failure while decoding: {message}")
            if progress is not None:
                progress(index + 1, n, sink.records_written + len(batcher.rows))
        batcher.flush()
        if sink.records_written == 0:
            raise _NothingConverted(
                f"{conv.src}: no input could be converted as kind {conv.kind!r} ({n} inputs, skipped: "
                + (", ".join(f"{k} {v}" for k, v in sorted(run_skips.items())) or "none")
                + "); is --kind right? Nothing was written"
            )
        meta = sink.close()
    except _NothingConverted:
        sink.abort()
        remove_output(out)
        raise
    except BaseException:
        sink.abort()
        raise
    seconds = time.perf_counter() - t0
    skipped = Counter(reason_category(s.reason) for s in meta.skipped)
    summary = ConvertSummary(
        output=out,
        kind=meta.kind,
        records=meta.num_records,
        skipped=dict(sorted(skipped.items())),
        bytes=_dir_bytes(out),
        seconds=seconds,
        records_this_run=meta.num_records - resumed_records,
        notes=dict(sorted(notes.items())),
    )
    logger.info(
        "%s: %d records, %d skipped, %.1f s", out, summary.records, summary.num_skipped, summary.seconds
    )
    return summary


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    kind: str | None = None,
    *,
    workers: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    records_per_shard: int | None = None,
    progress: ProgressFn | None = None,
    **options: Any,
) -> ConvertSummary:
    """Convert the corpus at ``src`` into a shardkit dataset at ``out``.

    Parameters
    ----------
    src
        Corpus root (COCO root or annotation file, class-folder root, CIFAR batch directory, audio
        class-folder root).
    out
        Output dataset directory. An interrupted conversion there with the same parameters is
        resumed; a finished one with the same parameters is left alone.
    kind
        Corpus kind (``coco``, ``imagefolder``, ``cifar10``, ``cifar100``, ``audio``); detected
        when ``None``.
    workers
        Decode processes (default: the cores available). The output does not depend on it. As
        with DataLoader workers, the processes re-import the calling script: guard its top-level
        code with ``if __name__ == "__main__":``. A program read from stdin decodes in-process.
    strict
        Stop at the first bad input (``ConversionError`` naming it) instead of skipping it.
    overwrite
        Delete a previous output at ``out`` first.
    compression
        Per-record codec name (``zstd``, ``gzip``, ``blosc-lz4``) or ``None``.
    shard_bytes, records_per_shard
        Target shard size in bytes, or an exact number of records per shard.
    progress
        Called as ``progress(inputs_done, inputs_total, records)`` after every input.
    **options
        Kind options: ``split``; images: ``size`` (``224`` or ``"HxW"``), ``resize``, ``crop``,
        ``interpolation``, ``max_pixels``; COCO: ``max_boxes``, ``image_dir``; audio:
        ``sample_rate``, ``duration``, ``channels``, ``window``, ``dtype``.

    Returns
    -------
    ConvertSummary
    """
    kind = kind or detect_kind(Path(src))
    conv = get_converter(kind)(Path(src), **options)
    return run_converter(
        conv, out, workers=workers, strict=strict, overwrite=overwrite, compression=compression,
        shard_bytes=shard_bytes, records_per_shard=records_per_shard, progress=progress,
    )
