"""Run a converter: parallel decode, deterministic order, resumable writes, skips and a summary.

Order and determinism
    The converter's :meth:`~shardkit.converters.base.Converter.scan` fixes the input sequence, and
    :func:`~shardkit.converters.decoding.outcomes` yields decoded records strictly in input order
    whatever ``workers`` is, so the payload shards are byte-identical for any worker count.

Bounded memory
    Decoding keeps a bounded number of tasks in flight (see :mod:`~shardkit.converters.decoding`),
    and the writer streams records to the open shard file, so memory stays at about
    ``workers x chunk`` decoded inputs plus the writer's small per-shard field buffers, whatever
    the corpus size. Writes run on a background thread (:class:`_BackgroundWriter`), so decoding
    never waits for a shard's fsync.

Resume
    :mod:`~shardkit.converters.staging` keeps each completed shard with the input cursor after it,
    next to the output; a re-run of the same command continues there (the same record boundaries,
    so the same bytes). The staged config holds every output-shaping parameter and a fingerprint of
    the input sequence, so a resume with different parameters or a changed corpus is refused.
    ``workers`` and ``strict`` are not part of it: they do not change the output.

Bad inputs
    A decode that raises :class:`~shardkit.errors.InputFileError` becomes a skip (path + reason,
    in the summary and in the dataset metadata), or with ``strict`` stops the run with a
    :class:`~shardkit.errors.ConversionError` naming the file; completed shards stay staged.
    Any other exception in a decoder is a bug or a crash, never a silent skip: it stops the run.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardkit.converters.base import MAX_RECORDS_PER_INPUT, PROVENANCE, Converter, Decoder, Record, ScanResult, reason_category
from shardkit.converters.decoding import Failed, Produced, Skipped, default_workers, outcomes
from shardkit.converters.main_guard import refuse_inside_worker_start
from shardkit.converters.options import OptionNaming
from shardkit.converters.progress import progress_bar
from shardkit.converters.registry import detect_kind, get_converter
from shardkit.converters.remote_output import RemoteOutput, is_remote_output
from shardkit.converters.staging import StagedWriter, Staging, input_cursor, split_cursor
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import DatasetMeta, FieldSpec, get_codec
from shardkit.formats.codecs import RecordCodec
from shardkit.formats.commit import CommitReport
from shardkit.formats.provenance import ProvenanceSpec
from shardkit.formats.spec import DEFAULT_SHARD_BYTES, ZARR_JSON, records_per_shard_for
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS
from shardkit.units import parse_bytes, parse_count

__all__ = [
    "ConvertSummary",
    "NothingConverted",
    "ProgressFn",
    "RecordSink",
    "Tally",
    "convert",
    "dataset_config",
    "decode_into",
    "dataset_fields",
    "dir_bytes",
    "provenance_row",
    "run_converter",
    "shard_layout",
    "strict_stop",
    "summary_of",
]

logger = logging.getLogger(__name__)

#: Records gathered before one call to the writer.
_WRITE_BATCH = 64

#: Progress callback: ``(inputs_done, inputs_total, records_written)``.
ProgressFn = Callable[[int, int, int], None]


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion did.

    Attributes
    ----------
    output
        Dataset directory, or the URL of a dataset in an object store.
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
        Things worth knowing that are not skips (``{"capped": 3}``: COCO images over ``max_boxes``),
        counted by this run.
    already_complete
        The same dataset was already there; nothing was done.
    changes
        What conversion changed, over every record of the dataset (clips trimmed, images upscaled
        ...; see :func:`shardkit.converters.provenance.summarize`), as stored in its metadata.
    skipped_inputs
        Every skipped input with its reason, ``(path, reason)``, in input order.
    version
        The dataset's version after this run (2 after the first append, ...).
    parts, parts_converted
        A conversion in parts (an executor, a cluster, an append): how many parts the plan has, and
        how many this run converted (the others were finished by an earlier, interrupted run).
    commit
        What the commit of a conversion in parts did (shards in place, linked, re-packed; time).
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


def _finished(staging: Staging, remote: RemoteOutput | None, overwrite: bool) -> DatasetMeta | None:
    """The dataset this same conversion already finished at the output, if any (``None`` with
    ``overwrite``); a dataset made with other parameters is a ConversionError."""
    if overwrite:
        return None
    if remote is None:
        return staging.finished()
    done = remote.finished()
    if done is None:
        return None
    stored = done.source.get("config_fingerprint")
    if stored != staging.fingerprint:
        raise ConversionError(
            f"{remote.url}: a dataset already exists here" + (" with different parameters" if stored else "")
            + "; use --overwrite to replace it"
        )
    return done


def _output_bytes(out: str | os.PathLike[str], meta: DatasetMeta) -> int:
    """Bytes of the output: the directory's files, or for an object store what the metadata lists."""
    if is_remote_output(out):
        return meta.payload_nbytes + sum(d.nbytes for d in meta.files.values())
    return dir_bytes(Path(out))


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
            f"{conv.src}: no input could be converted as kind {conv.name!r} ({inputs} inputs, skipped: "
            + (", ".join(f"{k} {v}" for k, v in sorted(skips.items())) or "none")
            + f"); is --kind right? {what}"
        )


def strict_stop(path: str, reason: str) -> ConversionError:
    return ConversionError(
        f"{path}: {reason} (stopped by --strict; completed shards are kept: fix or remove the input, "
        "or re-run without --strict to skip it)"
    )


class RecordSink(Protocol):
    """Where the decode loop hands records and skips: the staged writer of a conversion, or a part's writer."""

    @property
    def records_per_shard(self) -> int: ...

    @property
    def records_written(self) -> int: ...

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None: ...

    def skip(self, path: str, reason: str, cursor: int) -> None: ...


class _BackgroundWriter:
    """Run a :class:`StagedWriter`'s writes and skips, in order, on one background thread.

    Decoding and writing then overlap: while the writer streams a batch and waits for a shard's
    fsync, the caller (or the decode processes feeding it) keeps decoding. Measured with
    ``benchmarks/convert.py``: with writes in the decoding thread, ``--workers 1`` was 15% slower
    than a bare decode loop, most of it the wait for each shard's fsync. At most ``_QUEUED``
    batches wait, so memory stays bounded. Operations keep their order (one thread, one FIFO), so
    the output is the same as writing inline; a failure is re-raised in the caller at its next call.
    """

    _QUEUED = 2

    def __init__(self, writer: StagedWriter) -> None:
        self.writer = writer
        self.records_per_shard = writer.records_per_shard
        #: Records handed over so far (written or queued), counted from the resumed position.
        self.records_written = writer.records_written
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(self._QUEUED)
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
            fn, args = op
            try:
                fn(*args)
            except BaseException as exc:
                self._error = exc

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((fn, args))

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
        self.records_written += int(cursors.shape[0])
        self._submit(self.writer.write, batch, cursors)

    def skip(self, path: str, reason: str, cursor: int) -> None:
        self._submit(self.writer.skip, path, reason, cursor)

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

    def __init__(self, writer: RecordSink, names: list[str]) -> None:
        self.writer = writer
        self.names = names
        self.rows: list[dict[str, Any]] = []
        self.cursors: list[int] = []

    def add(self, record: dict[str, Any], cursor: int) -> None:
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
        self.writer.write(batch, np.asarray(self.cursors, dtype=np.int64))
        self.rows, self.cursors = [], []


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

    The one decode loop of every conversion: a whole corpus here (:func:`run_converter`) or one part
    of it on a worker (:mod:`shardkit.converters.parts`). ``provenance`` is the kind's name and its
    provenance columns; ``first_input`` is the number of ``items[0]`` in the whole input sequence (a
    record's provenance names its input by that number).
    """
    n = len(items)
    batcher = _Batcher(sink, names)
    tally = tally if tally is not None else Tally()
    for outcome in outcomes(decoder, items, split_cursor(start), workers, chunk_size):
        match outcome:
            case Produced(index=index, decoded=decoded):
                for note in decoded.notes:
                    tally.notes[note.category] += 1
                    logger.warning("%s: %s", decoder.item_path(items[index]), note)
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
    staging_dir: str | os.PathLike[str] | None = None,
) -> ConvertSummary:
    """Convert with an already constructed converter (see :func:`convert`; sizes already parsed).

    One function on purpose: the staging, the pool and the writer share one ``try``/``finally`` that
    decides what a failure at any step leaves behind (see :mod:`shardkit.converters.staging`).
    """
    refuse_inside_worker_start()
    t0 = time.perf_counter()
    out = str(out) if is_remote_output(out) else Path(out)
    workers = default_workers() if workers is None else workers
    scan = conv.scan()
    n = len(scan.items)
    if strict and scan.skipped:
        raise strict_stop(scan.skipped[0].path, scan.skipped[0].reason)
    spec = conv.record_spec()
    rps, size = shard_layout(conv, n, shard_bytes, records_per_shard)
    provenance = conv.provenance_spec(scan)
    fields = dataset_fields(conv, provenance)
    config = dataset_config(conv, scan, fields, provenance, rps, size, get_codec(compression))
    remote = RemoteOutput(str(out), staging_dir) if is_remote_output(out) else None
    local_out = remote.local if remote is not None else Path(out)
    staging = Staging(
        local_out, config, conv.payload, fields,
        shard_present=remote.shard_present if remote is not None else None,
        on_recorded=remote.shard_done if remote is not None else None,
    )
    done = _finished(staging, remote, overwrite)
    if done is not None:
        logger.info("%s: already converted with the same parameters", out)
        return summary_of(out, done, time.perf_counter() - t0, already_complete=True)
    if remote is not None:
        remote.check_destination(staging.names, overwrite=overwrite)
        if staging.finished() is not None:  # killed while publishing: finish that
            return summary_of(out, remote.publish(), time.perf_counter() - t0)
    resumed = staging.begin(overwrite=overwrite)
    sink = _BackgroundWriter(staging.writer(
        resumed, kind=conv.name, payload=conv.payload, record=spec, fields=fields, labels=conv.labels(),
        records_per_shard=rps, compression=compression, transform=conv.transform(), source=conv.source(),
        extra=conv.extra(), provenance=provenance,
    ))
    start = resumed[-1].cursor if resumed else 0
    resumed_records = sink.records_written
    if progress is not None:
        progress(split_cursor(start)[0], n, resumed_records)
    try:
        tally = Tally()
        if start == 0:
            for s in scan.skipped:
                logger.info("skipped %s: %s", s.path, s.reason)
                sink.skip(s.path, s.reason, 0)
                tally.skips[reason_category(s.reason)] += 1
        decode_into(conv.decoder, scan.items, sink, start, names=[conv.payload, *fields], chunk_size=conv.chunk_size,
                    workers=workers, strict=strict, progress=progress, tally=tally,
                    provenance=(conv.name, conv.provenance_columns))
        if sink.records_written == 0:
            raise NothingConverted(
                f"{conv.src}: no input could be converted as kind {conv.name!r} ({n} inputs, skipped: "
                + (", ".join(f"{k} {v}" for k, v in sorted(tally.skips.items())) or "none")
                + "); is --kind right? Nothing was written"
            )
        meta = sink.close()
        if remote is not None:
            meta = remote.publish()
    except NothingConverted:
        sink.abort()
        staging.discard()
        raise
    except BaseException:
        sink.abort()
        raise
    summary = summary_of(out, meta, time.perf_counter() - t0, records_this_run=meta.num_records - resumed_records,
                       notes=dict(sorted(tally.notes.items())))
    logger.info("%s: %d records, %d skipped, %.1f s", out, summary.records, summary.num_skipped, summary.seconds)
    if summary.skipped:
        listed = "listed above" if logger.isEnabledFor(logging.INFO) else (
            "--verbose lists them" if conv.naming == "cli" else "logging at level INFO lists them")
        logger.warning(
            "%s: %d inputs skipped (%s); %s, and attributes.shardkit.skipped in %s keeps every reason",
            out, summary.num_skipped, ", ".join(f"{k}: {v}" for k, v in summary.skipped.items()), listed,
            f"{out}/{ZARR_JSON}",
        )
    return summary


def summary_of(out: str | Path, meta: DatasetMeta, seconds: float, **extra: Any) -> ConvertSummary:
    """The summary of a finished dataset (``extra``: what only this run knows, or counts it overrides)."""
    skipped = Counter(reason_category(s.reason) for s in meta.skipped)
    values: dict[str, Any] = dict(
        output=out, kind=meta.kind, records=meta.num_records, skipped=dict(sorted(skipped.items())),
        bytes=_output_bytes(out, meta), seconds=seconds, changes=dict(meta.provenance.get("changes", {})),
        skipped_inputs=tuple((s.path, s.reason) for s in meta.skipped),
    )
    return ConvertSummary(**{**values, **extra})


def _label(name: str, naming: OptionNaming) -> str:
    cli = {"shard_bytes": "--shard-size"}
    return cli.get(name, "--" + name.replace("_", "-")) if naming == "cli" else name


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    kind: str | None = None,
    *,
    workers: int | str | None = None,
    strict: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    records_per_shard: int | str | None = None,
    progress: ProgressFn | bool | None = None,
    naming: OptionNaming = "python",
    executor: Executor | None = None,
    scheduler: str | None = None,
    append: bool = False,
    part_size: int | str | None = None,
    keep_versions: int | str = DEFAULT_KEEP_VERSIONS,
    staging_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> ConvertSummary:
    """Convert the corpus at ``src`` into a shardkit dataset at ``out``.

    Parameters
    ----------
    src
        Corpus root (COCO root or annotation file, class-folder root, CIFAR batch directory, audio
        class-folder root). A relative and an absolute path to the same corpus are the same
        conversion.
    out
        Output dataset directory, or an object-store URL (``s3://bucket/ds``, ``gs://``, ``az://``;
        see :mod:`shardkit.converters.remote_output`: shards are staged locally and uploaded as they
        complete, the metadata last). An interrupted conversion there with the same parameters is
        resumed; a finished one with the same parameters is left alone.
    kind
        Corpus kind (``coco``, ``imagefolder``, ``cifar10``, ``cifar100``, ``audio`` or one added
        through the ``shardkit.converters`` entry points); detected when ``None``.
    workers
        Decode processes (default: the cores available). The output does not depend on it. A
        script may call this at its top level without ``if __name__ == "__main__":``: the workers
        are then forked so they do not run the script again (decoded in-process where ``fork`` is
        not available, with a warning). A program read from stdin decodes in-process.
    strict
        Stop at the first bad input (``ConversionError`` naming it) instead of skipping it.
    overwrite
        Replace a previous shardkit output at ``out`` (its contents; the directory is kept).
    compression
        Per-record codec name (``zstd``, ``gzip``, ``blosc-lz4``) or ``None``.
    shard_bytes, records_per_shard
        Target shard size (bytes or a size such as ``"256MiB"``), or an exact number of records per
        shard.
    progress
        Called as ``progress(inputs_done, inputs_total, records)`` after every input. By default
        (``None``) a progress bar is drawn when standard error is a terminal (someone is watching);
        ``True`` always draws it, ``False`` never.
    naming
        How errors name options: ``"python"`` (``sample_rate``) or ``"cli"`` (``--sample-rate``).
    executor
        Any ``concurrent.futures.Executor`` (a process pool, ``dask.distributed.Client(...).get_executor()``):
        the corpus is converted in parts on it, each written straight to ``out``, then committed
        (:mod:`shardkit.converters.partrun`). The result is the same records, fields, labels and
        skips as without it. Its workers must see ``src`` and ``out`` at the same paths. Default:
        one conversion with ``workers`` local decode processes.
    scheduler
        Address of a Dask scheduler (``tcp://host:8786``): the parts run on that cluster (needs
        ``pip install "shardkit[dask]"``).
    append
        Add the corpus's records after those of the dataset at ``out`` (same kind, record, fields and
        transform, or it is refused naming the difference and nothing changes), as its next
        version; new class names extend the label list. A reader that opened the dataset before
        keeps reading the version it opened.
    part_size
        Inputs per part of a conversion in parts (default: about 64 parts, 1 to 16 shards each). Given
        without ``executor``, ``scheduler`` or ``append``, it asks for a conversion in parts on this
        machine: ``workers`` processes each convert whole parts and write their shards themselves,
        and the calling process only plans and commits (the same records, byte for byte, as one
        conversion). It pays when parts are several shards each: a part whose start is not yet known
        when it begins is decoded into a local spill first, and the commit re-packs the shard each
        part shares with the next (measured in ``benchmarks/convert.py``).
    keep_versions
        Older versions a commit keeps openable (their replaced files); older ones are deleted.
    staging_dir
        For an object-store ``out``: where the local staging directory lives (default: the system
        temporary directory); a re-run must see the same one to resume.
    **options
        Kind options, each parsed by the kind's option schema (``shardkit convert --help`` lists
        them): ``split``; images: ``size`` (``224`` or ``"HxW"``), ``resize``, ``crop``,
        ``interpolation``, ``max_pixels``; COCO: ``max_boxes``, ``image_dir``; audio:
        ``sample_rate`` (``16000`` or ``"16k"``), ``duration`` (``1.5`` or ``"1500ms"``),
        ``channels``, ``window``, ``dtype``.

    Returns
    -------
    ConvertSummary
    """
    nbytes = parse_bytes(shard_bytes, what=_label("shard_bytes", naming))
    rps = None if records_per_shard is None else parse_count(
        records_per_shard, what=_label("records_per_shard", naming), minimum=1
    )
    n_workers = None if workers is None else parse_count(workers, what=_label("workers", naming), minimum=1)
    n_part = None if part_size is None else parse_count(part_size, what=_label("part_size", naming), minimum=1)
    keep = parse_count(keep_versions, what=_label("keep_versions", naming))
    kind = kind or detect_kind(Path(src))
    conv = get_converter(kind)(Path(src), naming=naming, **options)

    def run(report: ProgressFn | None) -> ConvertSummary:
        if executor is None and scheduler is None and not append and n_part is None:
            return run_converter(
                conv, out, workers=n_workers, strict=strict, overwrite=overwrite, compression=compression,
                shard_bytes=nbytes, records_per_shard=rps, progress=report, staging_dir=staging_dir,
            )
        # partrun builds on this module (the decode loop, the summary): imported here, not at the top.
        from shardkit.converters.executors import dask_executor, local_pool
        from shardkit.converters.partrun import convert_in_parts

        def in_parts(ex: Executor | None) -> ConvertSummary:
            return convert_in_parts(
                conv, out, executor=ex, append=append, part_size=n_part,
                workers=default_workers() if n_workers is None else n_workers, strict=strict, overwrite=overwrite,
                compression=compression, shard_bytes=nbytes, records_per_shard=rps, progress=report,
                keep_versions=keep, naming=naming,
            )

        if scheduler is not None:
            if executor is not None:
                raise ConfigError(f"{_label('scheduler', naming)} and {_label('executor', naming)}: give one of them")
            with dask_executor(scheduler, naming=naming) as dask:
                return in_parts(dask)
        if executor is None and not append:  # only part_size given: the parts run on local processes
            with local_pool(default_workers() if n_workers is None else n_workers) as pool:
                return in_parts(pool)
        return in_parts(executor)

    if callable(progress):
        return run(progress)
    with progress_bar(conv.progress_unit, f"convert {kind}", disable=None if progress is None else not progress) as bar:
        return run(bar)
