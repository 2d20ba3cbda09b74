"""The decode loop every conversion runs, and what the conversion engine shares with it.

:func:`decode_into` decodes a run of inputs (a whole corpus, or one part of it) and hands the
records, in input order whatever ``workers`` is, to a :class:`RecordSink`; writes run on a
:class:`BackgroundWriter` thread. Each record carries the input cursor after it
(:func:`input_cursor`), from which a resumed part cuts shards at exactly the same records.
Determinism, bounded memory and bad inputs: docs/design.md §5.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardkit.converters.base import MAX_RECORDS_PER_INPUT, PROVENANCE, Converter, Decoder, Record, ScanResult, reason_category
from shardkit.converters.decoding import Failed, Produced, RingSlots, Skipped, outcomes
from shardkit.errors import ConversionError
from shardkit.formats import DatasetMeta, FieldSpec
from shardkit.formats.codecs import RecordCodec
from shardkit.formats.commit import CommitReport
from shardkit.formats.index import crc32c_of
from shardkit.formats.provenance import ProvenanceSpec
from shardkit.formats.spec import records_per_shard_for
from shardkit.formats.writer import prepare_field_codec

__all__ = [
    "WINDOW_BITS",
    "BackgroundWriter",
    "ConvertSummary",
    "NothingConverted",
    "ProgressFn",
    "RecordSink",
    "Tally",
    "config_fingerprint",
    "dataset_config",
    "decode_into",
    "dataset_fields",
    "dir_bytes",
    "input_cursor",
    "provenance_row",
    "shard_layout",
    "split_cursor",
    "strict_stop",
    "summary_of",
]

logger = logging.getLogger(__name__)

#: Records gathered before one call to the writer.
_WRITE_BATCH = 64

#: Progress callback: ``(inputs_done, inputs_total, records_written)``.
ProgressFn = Callable[[int, int, int], None]
#: Low bits of an input cursor that count records already written from the current input.
WINDOW_BITS = 20
_WINDOW_MASK = (1 << WINDOW_BITS) - 1


def input_cursor(index: int, records: int = 0) -> int:
    """The cursor at input ``index`` once ``records`` of its records are written."""
    if not 0 <= records <= _WINDOW_MASK:
        raise ConversionError(f"input {index} gives more than {_WINDOW_MASK} records")
    return (index << WINDOW_BITS) | records


def split_cursor(cursor: int) -> tuple[int, int]:
    """``(input index, records of it already written)`` of a cursor."""
    return cursor >> WINDOW_BITS, cursor & _WINDOW_MASK


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """crc32c of a conversion's config (``source.config_fingerprint``): the same conversion, whatever ran it."""
    return f"{crc32c_of(json.dumps(config, sort_keys=True).encode()):08x}"


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion did.

    Attributes
    ----------
    output, kind
        Dataset directory (or object-store URL) and corpus kind.
    records, records_this_run
        Records in the finished dataset, and those this run wrote (a resume finds some done).
    skipped, skipped_inputs
        Skipped inputs by reason category (``{"corrupt": 2}``), and each as ``(path, reason)``.
    bytes, seconds
        Size of the dataset directory; wall time of this run.
    notes
        Things worth knowing that are not skips (``{"capped": 3}``), counted by this run.
    already_complete
        The same dataset was already there; nothing was done.
    changes
        What conversion changed over every record (:func:`shardkit.converters.provenance.summarize`).
    version
        The dataset's version after this run (2 after the first append, ...).
    parts, parts_converted, commit
        A conversion in parts: parts in the plan, parts this run converted, what the commit did.
    """

    output: Path | str
    kind: str
    records: int
    skipped: Mapping[str, int]
    bytes: int
    seconds: float
    records_this_run: int = 0
    notes: Mapping[str, int] = field(default_factory=dict)
    already_complete: bool = False
    changes: Mapping[str, Any] = field(default_factory=dict)
    skipped_inputs: tuple[tuple[str, str], ...] = ()
    version: int = 1
    parts: int = 0
    parts_converted: int = 0
    commit: CommitReport | None = None

    @property
    def num_skipped(self) -> int:
        return int(sum(self.skipped.values()))


def _output_bytes(out: Path | str, meta: DatasetMeta) -> int:
    """Bytes of the output: the directory's files, or for an object store what the metadata lists."""
    if isinstance(out, Path):
        return dir_bytes(out)
    return meta.payload_nbytes + sum(d.nbytes for d in meta.files.values())


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (the summary's size)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


class NothingConverted(ConversionError):
    """Every input was skipped: an empty dataset would look complete, so none is written."""

    @classmethod
    def of(cls, conv: Converter, inputs: int, skips: Mapping[str, int], what: str = "Nothing was written") -> NothingConverted:
        return cls(
            f"{conv.describe()}: no input could be converted as kind {conv.name!r} ({inputs} inputs, skipped: "
            + (", ".join(f"{k} {v}" for k, v in sorted(skips.items())) or "none")
            + f"); {conv.nothing_hint} {what}"
        )


def strict_stop(path: str, reason: str) -> ConversionError:
    return ConversionError(
        f"{path}: {reason} (stopped by --strict; completed shards are kept: fix or remove the input, "
        "or re-run without --strict to skip it)"
    )


class RecordSink(Protocol):
    """Where the decode loop hands records (with the input cursor after each) and skips: a part's writer or spill."""

    @property
    def records_per_shard(self) -> int: ...

    @property
    def records_written(self) -> int: ...

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None: ...

    def skip(self, path: str, reason: str, cursor: int) -> None: ...


class BackgroundWriter:
    """Run a :class:`RecordSink`'s writes and skips, in order, on one background thread, so decoding
    never waits for a shard's fsync (15% at ``--workers 1``, ``benchmarks/convert.py``). At most
    ``_QUEUED`` batches wait; a failure is re-raised in the caller at its next call. The thread starts
    with the first operation, after the decode workers started: until then they may be forked
    (:func:`~shardkit.converters.main_guard.fork_is_safe`). Before its first write it makes the commit's
    field codec ready (:func:`~shardkit.formats.writer.prepare_field_codec`), beside the decoding instead
    of at the conversion's end."""

    _QUEUED = 2

    def __init__(self, sink: RecordSink) -> None:
        self.sink = sink
        self.records_per_shard = sink.records_per_shard
        #: Records handed over so far (written or queued), counted from the resumed position.
        self.records_written = sink.records_written
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...], Callable[[], None] | None] | None] = (
            queue.Queue(self._QUEUED))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardkit-convert-writer", daemon=True)
        self._started = False

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # only a head start: the commit reports a failure itself
            prepare_field_codec()
        while True:
            op = self._queue.get()
            if op is None:
                return
            fn, args, release = op
            try:
                if self._error is None:  # else drain without acting after a failure
                    fn(*args)
            except BaseException as exc:
                self._error = exc
            finally:
                if release is not None:
                    release()

    def _submit(self, fn: Callable[..., None], *args: Any, release: Callable[[], None] | None = None) -> None:
        if self._error is not None:
            raise self._error
        if not self._started:
            self._started = True
            self._thread.start()
        self._queue.put((fn, args, release))

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray,
              release: Callable[[], None] | None = None) -> None:
        """Queue ``batch``; ``release`` is called once the sink wrote it, or skipped it after a failure (its
        buffers may be reused then)."""
        self.records_written += int(cursors.shape[0])
        self._submit(self.sink.write, batch, cursors, release=release)

    def skip(self, path: str, reason: str, cursor: int) -> None:
        self._submit(self.sink.skip, path, reason, cursor)

    def drain(self) -> None:
        """Wait until every queued operation ran; re-raise the first failure."""
        if self._started and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Finish what was queued (completed shards are kept for a resume), swallowing a failure:
        the caller is already handling one."""
        with contextlib.suppress(BaseException):
            self.drain()


class _Batcher:
    """Gather records and hand them to the writer in batches, with their input cursors.

    Payloads from worker processes are views of the workers' ring. With ``slots``, consecutive rows of
    one ring slot are handed to the writer as they are (the slot is held until the writer wrote them): no
    copy of the payload in this process. Any other payload of exactly the record's shape and dtype is
    copied once, as it arrives, into a reused batch buffer: a ring view is valid only until the next
    outcome is asked for, and a fresh array per record and per batch cost the parent page faults on every
    one (``benchmarks/write.py``). Any other payload is kept as a copy and stacked (the sink casts or
    refuses it, naming the field). A buffer goes back to the pool once the sink wrote it; at most the
    writer's queue and one more are out at a time. Without ``payload`` and ``record`` every payload is
    kept as it is and stacked (records decoded in this process).
    """

    def __init__(self, writer: RecordSink, names: list[str], payload: str | None = None,
                 record: FieldSpec | None = None, slots: RingSlots | None = None) -> None:
        self.writer = writer
        self.names = names
        self.payload = payload if record is not None and payload in names else None
        self.shape = None if record is None else tuple(record.shape)
        self.dtype = None if record is None else np.dtype(record.dtype)
        self.rows: list[dict[str, Any]] = []
        self.cursors: list[int] = []
        self._buffers: list[np.ndarray] = []  # free batch buffers (appended to by the writer thread)
        self._buffer: np.ndarray | None = None  # the one being filled, while every row so far is in it
        self.slots = slots if self.payload is not None else None
        # The batch in the ring: the slot's rows, the first row and the one after the last, the slot's hold.
        self._ring: tuple[np.ndarray, int, int, Callable[[], None]] | None = None

    def _fits(self, value: Any) -> bool:
        return isinstance(value, np.ndarray) and value.shape == self.shape and value.dtype == self.dtype

    def _ring_row(self, value: Any) -> tuple[np.ndarray, int] | None:
        """``(the slot's rows, row)`` when ``value`` is a whole row of the ring slot being handed over."""
        current = None if self.slots is None else self.slots.current
        if current is None or not self._fits(value) or not value.flags.c_contiguous:
            return None
        rows = current[1]
        row, rest = divmod(value.__array_interface__["data"][0] - rows.__array_interface__["data"][0], rows.shape[1])
        return (rows, row) if rest == 0 and 0 <= row < rows.shape[0] else None

    def add(self, record: dict[str, Any], cursor: int) -> None:
        if self.payload is not None:
            value = record[self.payload]
            in_ring = self._ring_row(value)
            if self.rows and self._ring is not None and (
                    in_ring is None or in_ring[0] is not self._ring[0] or in_ring[1] != self._ring[2]):
                self.flush()  # a batch in the ring is consecutive rows of one slot
            fast = in_ring is None and self._fits(value)
            if self.rows and self._ring is None and (in_ring is not None or fast != (self._buffer is not None)):
                self.flush()  # a batch is all in the ring, all in a buffer or all stacked
            if in_ring is not None:
                assert self.slots is not None
                rows, row = in_ring
                self._ring = (rows, row, row + 1, self.slots.keep()) if self._ring is None else (
                    rows, self._ring[1], row + 1, self._ring[3])
                record = {k: v for k, v in record.items() if k != self.payload}
            elif fast:
                if self._buffer is None:
                    self._buffer = self._buffers.pop() if self._buffers else np.empty((_WRITE_BATCH, *value.shape),
                                                                                       value.dtype)
                self._buffer[len(self.rows)] = value
                record = {k: v for k, v in record.items() if k != self.payload}
            else:
                record[self.payload] = np.array(value)  # a copy: a view of the ring is reused after this call
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
        buffer, self._buffer = self._buffer, None
        ring, self._ring = self._ring, None
        k = len(self.rows)
        names = [n for n in self.names if (buffer is None and ring is None) or n != self.payload]
        batch = {name: np.stack([r[name] for r in self.rows]) for name in names}
        cursors = np.asarray(self.cursors, dtype=np.int64)
        if ring is not None:
            rows, first, end, give_back = ring
            assert self.payload is not None and self.shape is not None and self.dtype is not None and end - first == k
            batch[self.payload] = rows[first:end].view(self.dtype).reshape(k, *self.shape)
            self.rows, self.cursors = [], []
            if isinstance(self.writer, BackgroundWriter):
                self.writer.write(batch, cursors, release=give_back)
            else:
                try:
                    self.writer.write(batch, cursors)
                finally:
                    give_back()
            return
        if buffer is None:
            self.writer.write(batch, cursors)
            self.rows, self.cursors = [], []  # after the hand-over, as malloc reuses best
            return
        self.rows, self.cursors = [], []
        assert self.payload is not None
        batch[self.payload] = buffer[:k]
        if isinstance(self.writer, BackgroundWriter):
            self.writer.write(batch, cursors, release=lambda: self._buffers.append(buffer))
        else:
            self.writer.write(batch, cursors)
            self._buffers.append(buffer)


@dataclass
class Tally:
    """What the decode loop counted: notes and skips by category."""

    notes: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)


def decode_into(
    decoder: Decoder,
    items: Sequence[Any],
    sink: RecordSink,
    start: int,
    *,
    names: list[str],
    chunk_size: int,
    workers: int,
    strict: bool,
    progress: ProgressFn | None,
    provenance: tuple[str, tuple[str, ...]],
    first_input: int = 0,
    tally: Tally | None = None,
) -> Tally:
    """Decode ``items`` from cursor ``start`` and hand their records (fields ``names``) and skips to ``sink``.

    ``provenance`` is the kind's name and its provenance columns; ``first_input`` is the number of
    ``items[0]`` in the whole input sequence (a record's provenance names its input by it).
    """
    n = len(items)
    # Payloads from worker processes are views of the ring, copied once into reused buffers; decoded
    # here they are fresh arrays, stacked as they are (copying each at once let malloc give back and
    # fault in again its memory per record: twice the page faults at workers=1).
    # A writer thread holds a ring slot per queued batch and the one it writes; the batcher one more.
    slots = RingSlots(BackgroundWriter._QUEUED + 2 if isinstance(sink, BackgroundWriter) else 1) if workers > 1 else None
    batcher = (_Batcher(sink, names, decoder.payload, decoder.record, slots) if workers > 1
               else _Batcher(sink, names))
    tally = tally if tally is not None else Tally()
    for outcome in outcomes(decoder, items, split_cursor(start), workers, chunk_size, slots):
        match outcome:
            case Produced(index=index, decoded=decoded):
                for note in decoded.notes:
                    tally.notes[note.category] += 1
                    # The first of a category is shown; the others (a member dropped from every sample) with -v.
                    level = logging.WARNING if tally.notes[note.category] == 1 else logging.INFO
                    logger.log(level, "%s: %s", decoder.item_path(items[index]), note)
                done = decoded.next_start is None
                last = decoded.start + len(decoded.records)
                if last > MAX_RECORDS_PER_INPUT:
                    raise ConversionError(f"{decoder.item_path(items[index])}: gives more than {MAX_RECORDS_PER_INPUT} records")
                for w, rec in enumerate(decoded.records, decoded.start):
                    after = input_cursor(index + 1) if done and w == last - 1 else input_cursor(index, w + 1)
                    rec[PROVENANCE] = provenance_row(*provenance, rec, first_input + index, w)
                    batcher.add(rec, after)
                if done and last == 0:
                    sink.skip(decoder.item_path(items[index]), "empty: no records", input_cursor(index))
            case Skipped(index=index, path=path, reason=reason):
                if strict:
                    batcher.flush()
                    raise strict_stop(path, reason)
                logger.info("skipped %s: %s", path, reason)
                tally.skips[reason_category(reason)] += 1
                # The writer files a skip with the first shard whose cursor range covers it.
                sink.skip(path, reason, input_cursor(index))
                done = True
            case Failed(path=path, message=message):
                raise ConversionError(f"{path}: {message}")
        if done and progress is not None:
            progress(index + 1, n, sink.records_written + len(batcher.rows))
    batcher.flush()
    return tally


def provenance_row(kind: str, columns: tuple[str, ...], rec: Record, index: int, part: int) -> np.ndarray:
    """The record's provenance: its input and part number, then the kind's columns its decoder measured."""
    measured = rec.get(PROVENANCE) or {}
    unknown = set(measured) - set(columns)
    if unknown:
        raise ConversionError(f"kind {kind!r}: decoder gave provenance column(s) {sorted(unknown)} that the kind "
                              f"does not declare in provenance_columns {list(columns)}")
    return np.array([index, part, *(int(measured.get(c, 0)) for c in columns)], dtype=np.int64)


def dataset_fields(conv: Converter, provenance: ProvenanceSpec) -> dict[str, FieldSpec]:
    """Every small field of the dataset: the kind's, then the per-record provenance."""
    return {**conv.fields(), PROVENANCE: provenance.field_spec}


def dataset_config(conv: Converter, scan: ScanResult, fields: Mapping[str, FieldSpec], provenance: ProvenanceSpec,
                   records_per_shard: int, shard_bytes: int | None, codec: RecordCodec | None) -> dict[str, Any]:
    """Every parameter that shapes the output (the staging config and the dataset's fingerprint)."""
    return {
        "config": {"converter": conv.config(), "inputs": conv.inputs_fingerprint(scan), "shard_bytes": shard_bytes},
        "kind": conv.name,
        "payload": conv.payload,
        "record": conv.record_spec().to_json(),
        "fields": {k: v.to_json() for k, v in fields.items()},
        "provenance": list(provenance.columns),
        "records_per_shard": records_per_shard,
        "compression": None if codec is None else codec.to_json(),
    }


def shard_layout(conv: Converter, inputs: int, shard_bytes: int, records_per_shard: int | None) -> tuple[int, int | None]:
    """``(records per shard, the shard size that chose it)``; the size is ``None`` when the count was given
    or came from the corpus size (then it is what the config records)."""
    if records_per_shard is None and conv.one_record_per_input and inputs:
        # A corpus smaller than a shard gets a shard (and a shard index, which has one entry per
        # slot) of its own size instead of a mostly empty one.
        full = records_per_shard_for(conv.record_spec().nbytes, shard_bytes)
        records_per_shard = min(full, inputs) if inputs < full else None
    rps = records_per_shard or records_per_shard_for(conv.record_spec().nbytes, shard_bytes)
    return rps, None if records_per_shard else int(shard_bytes)


def summary_of(out: str | Path, meta: DatasetMeta, seconds: float, **extra: Any) -> ConvertSummary:
    """The summary of a finished dataset (``extra``: what only this run knows, or counts it overrides)."""
    skipped = Counter(reason_category(s.reason) for s in meta.skipped)
    values: dict[str, Any] = dict(
        output=out, kind=meta.kind, records=meta.num_records, skipped=dict(sorted(skipped.items())),
        bytes=_output_bytes(out, meta), seconds=seconds, changes=dict(meta.provenance.get("changes", {})),
        skipped_inputs=tuple((s.path, s.reason) for s in meta.skipped),
    )
    return ConvertSummary(**{**values, **extra})
