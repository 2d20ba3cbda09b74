"""Parts of a conversion: contiguous runs of the input sequence, each converted on its own (docs/design.md §11).

A :class:`PartPlan` cuts the input sequence into runs of ``part_size`` inputs. A part's records
follow every record of the parts before it, so it is converted in up to two tasks: :func:`count_part`
decodes it into a spill on the worker's disk and returns its record count, then :func:`write_part`,
once its offset is known, writes it on the global shard grid (directly when the offset is known from
the start). The files a part leaves until the commit: docs/design.md §11, "Plan directory".
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import Decoder, reason_category
from shardkit.converters.decoding import join_ended_pools
from shardkit.converters.pipeline import BackgroundWriter, ProgressFn, RecordSink, Tally, decode_into, input_cursor, split_cursor
from shardkit.errors import ConversionError, NotADatasetError, SchemaError, ShardkitError, WorkerError
from shardkit.formats import FieldSpec
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest, read_object
from shardkit.formats.codecs import RecordCodec, codec_from_json
from shardkit.formats.commit import Segment, StoredShard
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, encode_json, read_json_object
from shardkit.formats.outputs import PARTS_DIR
from shardkit.formats.spec import MAX_CRC32C, SkippedInput, chunk_key
from shardkit.formats.transfer import put_checked
from shardkit.formats.writer import ShardWriter, shard_runs, stacked
from shardkit.privdir import PrivateDir
from shardkit.processes import pid_alive
from shardkit.stores import Store, is_url, open_store
from shardkit.stores.atomic import write_bytes_atomic

__all__ = [
    "PARTS_DIR",
    "PartPlan",
    "PartJob",
    "Spilled",
    "PartManifest",
    "default_part_size",
    "count_part",
    "write_part",
    "read_manifest",
    "part_key",
    "worker_name",
]

logger = logging.getLogger(__name__)

#: Parts a corpus is cut into by default, when that keeps parts at most :data:`_MAX_SHARDS_PER_PART`
#: shards: enough to balance a cluster's workers (a slow part delays the end by 1/64 of the work).
_DEFAULT_PARTS = 64
#: Largest default part, in shards: bounds the spill (a part's records) a worker holds on its disk.
_MAX_SHARDS_PER_PART = 16
#: Progress files are rewritten at most this often (seconds).
_PROGRESS_EVERY = 1.0
#: Name of a file on its way to an object store: this prefix, then the pid of the task writing it.
_PIECE_PREFIX = "shardkit-piece-"
#: Spills of another plan untouched this long are deleted by the next part on that machine.
_STALE_SPILL_SECONDS = 24 * 3600.0


def default_part_size(inputs: int, records_per_shard: int) -> int:
    """Inputs per part: about 64 parts, each between one and 16 shards' worth (one record per input).
    More parts balance a cluster better; larger ones re-pack less at the commit."""

    s = max(1, records_per_shard)
    return max(1, min(_MAX_SHARDS_PER_PART * s, max(s, math.ceil(inputs / _DEFAULT_PARTS))))


@dataclass(frozen=True)
class PartPlan:
    """``inputs`` cut into consecutive runs of ``part_size`` (the last one shorter)."""

    inputs: int
    part_size: int

    def __post_init__(self) -> None:
        if self.part_size < 1:
            raise ConversionError(f"part size must be at least 1 input, found {self.part_size}")

    def ranges(self) -> list[tuple[int, int]]:
        """``[(first input, end)]`` of every part."""
        return [(a, min(a + self.part_size, self.inputs)) for a in range(0, self.inputs, self.part_size)]


def part_key(plan: str, part: int, suffix: str) -> str:
    """Path (relative to the output) of one file of part ``part`` of plan ``plan``."""
    return f"{PARTS_DIR}/{plan}/p{part:06d}{suffix}"


@dataclass(frozen=True)
class PartJob:
    """Everything a worker needs to convert one part (small and picklable: no corpus listing).

    ``first`` is the number of the part's first input in the whole sequence (provenance names inputs
    by ``first + index``); ``src`` and ``out`` are absolute and must be seen by the worker; ``workers``
    are decode processes inside this task (1 on a cluster); ``staged`` writes whole shards in the plan
    directory too (an append); ``guessed``: the part's offset is a guess made before the parts before
    it were counted, so its whole shards are staged too (a wrong guess costs only their re-pack at the
    commit, never a shard under another's name); ``progress`` defaults to the part's progress file in the output;
    ``scratch`` holds the private ``shardkit-upload-<uid>`` directory where files wait for their
    upload to an object store (default: the system temporary directory).
    """

    plan: str
    part: int
    first: int
    items: Sequence[Any]
    decoder: Decoder
    src: str
    out: str
    payload: str
    record: FieldSpec
    fields: Mapping[str, FieldSpec]
    records_per_shard: int
    compression: dict[str, Any] | None
    provenance: tuple[str, tuple[str, ...]] = ("", ())
    chunk_size: int = 4
    workers: int = 1
    strict: bool = False
    durable: bool = True
    staged: bool = False
    guessed: bool = False
    progress: ProgressFn | None = None
    scratch: str | None = None

    @property
    def names(self) -> list[str]:
        return [self.payload, *self.fields]

    @property
    def codec(self) -> RecordCodec | None:
        return None if self.compression is None else codec_from_json(self.compression)


def worker_name() -> str:
    """Who runs this task, for error messages: the Dask worker's address, else host and pid."""
    if "distributed" in sys.modules:
        try:
            from distributed import get_worker

            return f"Dask worker {get_worker().address} on {socket.gethostname()}"
        except (ImportError, ValueError):
            pass
    return f"{socket.gethostname()} (pid {os.getpid()})"


def _check_reach(job: PartJob) -> Store:
    """The output's store, after checking that this worker sees the corpus and the output."""
    if not is_url(job.src) and not os.path.exists(job.src):  # a URL corpus is reached as its shards are read
        raise WorkerError(
            f"{worker_name()} cannot see the corpus {job.src}: every worker must reach the corpus and the output "
            "at the same paths as the machine that runs the conversion (a shared file system)"
        )
    try:
        store = open_store(job.out)
        seen = store.exists(f"{PARTS_DIR}/{job.plan}/plan.json")
    except (OSError, ShardkitError) as exc:
        raise WorkerError(f"{worker_name()} cannot reach the output {job.out} ({exc})") from None
    if not seen:
        raise WorkerError(
            f"{worker_name()} cannot see the output {job.out} (no {PARTS_DIR}/{job.plan} there): every worker must "
            "reach the output at the same path or URL as the machine that runs the conversion"
        )
    return store


class ProgressFile:
    """A part's progress callback: its counts in a small file of the output, at most once a second."""

    def __init__(self, out: str, key: str) -> None:
        self.out = out
        self.key = key
        self._last = 0.0

    def __call__(self, done: int, total: int, records: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < _PROGRESS_EVERY:
            return
        self._last = now
        data = f"{done} {records}\n".encode()
        try:
            store = open_store(self.out)
            if store.is_local:
                write_bytes_atomic(store.local_path(self.key), data, durable=False)
            else:
                store.put(self.key, data)
        except (OSError, ShardkitError) as exc:
            raise WorkerError(f"{worker_name()} cannot write to the output ({self.out}/{self.key}: {exc})") from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProgressFile, (self.out, self.key))


def progress_key(plan: str, part: int) -> str:
    return f"{PARTS_DIR}/{plan}/progress/p{part:06d}"


def read_progress(store: Store, plan: str, part: int) -> tuple[int, int]:
    """``(inputs, records)`` a part reported so far (``(0, 0)`` when it has not started)."""
    try:
        inputs, records = store.get(progress_key(plan, part), max_nbytes=64).decode().split()
        return int(inputs), int(records)
    except (OSError, ShardkitError, ValueError):
        return 0, 0


def _progress(job: PartJob) -> ProgressFn:
    return job.progress or ProgressFile(job.out, progress_key(job.plan, job.part))


# ---------------------------------------------------------------------- spills
@dataclass(frozen=True)
class Spilled:
    """A part decoded into a spill on one machine: its record count and where the spill is."""

    part: int
    records: int
    host: str
    path: str
    worker: str = ""


def _spill_base() -> Path:
    """This user's spill directory in the temp dir: created 0700, refused unless ours and private."""
    with PrivateDir.create(Path(tempfile.gettempdir()) / f"shardkit-spill-{os.geteuid()}", what="a spill directory",
                           advice="Remove it or set TMPDIR") as base:
        return base.path


def _scratch(job: PartJob, *, sweep: bool = False) -> str:
    """This user's private directory for files on their way to an object store; with ``sweep``, files
    there that a killed task left (its pid is gone) are deleted first."""
    parent = Path(job.scratch) if job.scratch is not None else Path(tempfile.gettempdir())
    with PrivateDir.create(parent / f"shardkit-upload-{os.geteuid()}", what="the staging directory",
                           advice="Remove it, or choose another --staging-dir", tighten=True) as scratch:
        for name in os.listdir(scratch.fd) if sweep else []:
            pid = name[len(_PIECE_PREFIX) :].split("-", 1)[0] if name.startswith(_PIECE_PREFIX) else ""
            if pid.isdigit() and not pid_alive(int(pid)):
                scratch.unlink(name)
        return str(scratch.path)


def _remove_stale_spills(base: Path, plan: str) -> None:
    """Spills a killed task left half-written, and other plans' spills untouched for a day."""
    now = time.time()
    for entry in base.iterdir():
        name = entry.name
        if ".tmp-" in name:
            pid = name.rsplit(".tmp-", 1)[1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
        elif not name.startswith(plan) and now - entry.stat().st_mtime > _STALE_SPILL_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)


class _PartSink:
    """What both sinks of a part share (:class:`~shardkit.converters.pipeline.RecordSink`): the job,
    the records written, the field values kept for the end of the part and the skipped inputs."""

    def __init__(self, job: PartJob) -> None:
        self.job = job
        self.records_per_shard = job.records_per_shard
        self.records_written = 0
        self.fields: dict[str, list[np.ndarray]] = {k: [] for k in job.fields}
        self.skipped: list[SkippedInput] = []

    def _take(self, batch: dict[str, np.ndarray], count: int) -> np.ndarray:
        """Check the batch of ``count`` records against the job, keep its field values, and return
        its payload for the sink to write."""
        payload = self.job.record.check(self.job.payload, batch[self.job.payload], count)
        for name, spec in self.job.fields.items():
            self.fields[name].append(spec.check(name, batch[name], count))
        return payload

    def _fields_npz(self) -> bytes:
        """The part's field values as the bytes of an ``.npz``."""
        return _npz({name: stacked(self.fields[name], spec) for name, spec in self.job.fields.items()})

    def skip(self, path: str, reason: str, cursor: int) -> None:
        self.skipped.append(SkippedInput(path, reason))


class _SpillWriter(_PartSink):
    """A :class:`~shardkit.converters.pipeline.RecordSink` that keeps a part's records on local disk,
    in files private to this user (``0600``, in the private directory ``spill``)."""

    def __init__(self, job: PartJob, spill: PrivateDir) -> None:
        super().__init__(job)
        self.spill = spill
        self._fh = os.fdopen(spill.create_file("records.bin"), "wb")  # closed in finish() / abort()

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
        payload = self._take(batch, int(cursors.shape[0]))
        self._fh.write(payload.astype(payload.dtype.newbyteorder("<"), copy=False).tobytes())
        self.records_written += int(cursors.shape[0])

    def finish(self, tally: Tally) -> None:
        self._fh.close()
        self.spill.write_file("fields.npz", self._fields_npz())
        doc = {"part": self.job.part, "records": self.records_written, "skipped": [s.to_json() for s in self.skipped],
               "notes": dict(tally.notes), "skips": dict(tally.skips)}
        self.spill.write_file("spill.json", json.dumps(doc).encode())

    def abort(self) -> None:
        self._fh.close()


def _npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an ``.npz`` (no pickles: numeric arrays only)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
    return buffer.getvalue()


def _size(store: Store, key: str) -> int:
    """The size of ``key`` in ``store``, -1 when it is missing."""
    try:
        return store.head(key).size
    except FileNotFoundError:
        return -1


def _load_fields(data: bytes, specs: Mapping[str, FieldSpec], count: int, where: str) -> dict[str, np.ndarray]:
    """Field values saved by a part: exactly the declared fields, ``count`` rows each, no pickles."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: spec.check(name, npz[name], count) for name, spec in specs.items()}
    except (KeyError, ValueError, OSError, EOFError, SchemaError) as exc:
        raise NotADatasetError(f"{where}: field values of the part do not load ({exc})") from None


def count_part(job: PartJob) -> Spilled:
    """Decode a part into a spill on this machine's disk and return its record count (see the module docstring).

    A complete spill of the same plan and part left by an earlier run on this machine is reused.
    """
    _check_reach(job)
    base = _spill_base()
    _remove_stale_spills(base, job.plan)
    final = base / f"{job.plan}-p{job.part:06d}"
    done = _read_spill(final, job)
    if done is not None:
        return Spilled(job.part, done, socket.gethostname(), str(final), worker_name())
    tmp = base / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with PrivateDir.create(tmp, what="a spill directory", advice="Remove it or set TMPDIR", exclusive=True) as spill:
        sink = _SpillWriter(job, spill)
        try:
            tally = decode_into(job.decoder, job.items, sink, 0, names=job.names, chunk_size=job.chunk_size,
                                workers=job.workers, strict=job.strict, progress=_progress(job),
                                provenance=job.provenance, first_input=job.first)
            sink.finish(tally)
        except BaseException:
            sink.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            join_ended_pools()
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return Spilled(job.part, sink.records_written, socket.gethostname(), str(final), worker_name())


def _read_spill(path: Path, job: PartJob) -> int | None:
    """The record count of a complete spill of ``job`` at ``path``, or ``None`` (also when the directory
    is not a private one of this user: its records could have been planted)."""
    try:
        with PrivateDir.open(path, what="a spill directory", advice="Remove it") as spill:
            doc = json.loads(spill.read_file("spill.json", MAX_DOCUMENT_NBYTES))
            spill.check_file("records.bin")
            size = os.stat("records.bin", dir_fd=spill.fd, follow_symlinks=False).st_size
        records = int(doc["records"])
        if doc["part"] != job.part or size != records * job.record.nbytes:
            return None
        return records
    except (OSError, ShardkitError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------- writing a part at its offset
class _AlignedWriter(_PartSink):
    """A :class:`~shardkit.converters.pipeline.RecordSink` writing a part's records cut on the global grid.

    A closed file goes under its final chunk key when it is a whole global shard (and the part is not
    ``staged`` or ``guessed``), else it is a piece in the plan directory. After each file come its field values and a
    checkpoint with the input cursor after it, from which :meth:`resume` continues a killed part.
    """

    def __init__(self, job: PartJob, offset: int, store: Store, *, checkpoints: bool = True) -> None:
        super().__init__(job)
        self.offset = offset
        self.store = store
        self.checkpoints = checkpoints
        self.pieces: list[dict[str, Any]] = []
        self._writer: ShardWriter | None = None
        self._file: Path | None = None
        self._start = 0  # local record where the open file starts
        self.codec = job.codec
        #: Input cursor after the last record of the last closed file, and the records restored from checkpoints.
        self.cursor = 0
        self.resumed = 0
        self._open_fields: dict[str, list[np.ndarray]] = {k: [] for k in job.fields}
        self._saved_skips = 0
        self._restored_skips = 0

    def _open(self) -> ShardWriter:
        """The open file, or a new one after the last."""
        if self._writer is not None:
            return self._writer
        s = self.records_per_shard
        g = self.offset + self.records_written
        key = part_key(self.job.plan, self.job.part, f"-{len(self.pieces)}.shard")
        if self.store.is_local:
            self._file = self.store.local_path(key)
        else:
            fd, name = tempfile.mkstemp(prefix=f"{_PIECE_PREFIX}{os.getpid()}-", dir=_scratch(self.job))
            os.close(fd)
            self._file = Path(name)
        self._writer = ShardWriter(self._file, s - g % s, self.job.record, self.codec, durable=self.job.durable)
        self._key = key
        self._start = self.records_written
        return self._writer

    def _close(self, cursor: int | None) -> None:
        """Put the open file in its place; with the ``cursor`` after its last record, checkpoint it."""
        w, local = self._writer, self._file
        assert w is not None and local is not None
        sums = w.close()
        s, ndim = self.records_per_shard, 1 + len(self.job.record.shape)
        g = self.offset + self._start
        key = self._key
        if w.capacity == s and w.count == s and g % s == 0 and not (self.job.staged or self.job.guessed):
            key = chunk_key(self.job.payload, g // s, ndim)  # a whole global shard: its final name
        if self.store.is_local:
            if key != self._key:
                target = self.store.local_path(key)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(local, target)
        else:
            try:
                put_checked(self.store, key, local, sums.crc32c)
            finally:
                local.unlink(missing_ok=True)
        piece = {"key": key, "start": self._start, "count": w.count, "capacity": w.capacity, **dataclasses.asdict(sums)}
        self.pieces.append(piece)
        self._writer = self._file = None
        values = {name: np.concatenate(self._open_fields[name]) for name in self.job.fields}
        self._open_fields = {k: [] for k in self.job.fields}
        for name, v in values.items():
            self.fields[name].append(v)
        if cursor is not None and self.checkpoints and cursor != input_cursor(len(self.job.items)):
            # A file ending the part is followed at once by the part's manifest (finish): a checkpoint of
            # it would only add files and fsyncs to the serial end of the conversion.
            self._checkpoint(piece, values, cursor)

    def _checkpoint(self, piece: dict[str, Any], values: dict[str, np.ndarray], cursor: int) -> None:
        i = len(self.pieces) - 1
        data = _npz(values)
        put_checked(self.store, part_key(self.job.plan, self.job.part, f"-{i}.npz"), data)
        later = next((j for j in range(self._saved_skips, len(self.skipped)) if self.skipped[j].cursor >= cursor),
                     len(self.skipped))
        mine = self.skipped[self._saved_skips : later]
        self._saved_skips = later
        doc = {"part": self.job.part, "offset": self.offset, "cursor": cursor, "piece": piece,
               "fields": FileDigest.of(data).to_json(),
               "skipped": [{**s.to_json(), "cursor": s.cursor} for s in mine]}
        put_checked(self.store, part_key(self.job.plan, self.job.part, f"-{i}.json"), encode_json(doc))
        self.cursor = cursor

    def resume(self) -> int:
        """Continue after the intact checkpoints of an earlier run at this offset; returns the input cursor to
        decode from (0: from the start). Checkpoints after the first missing or damaged one are deleted."""
        ndim = 1 + len(self.job.record.shape)
        while True:
            key = part_key(self.job.plan, self.job.part, f"-{len(self.pieces)}.json")
            if not self.store.exists(key):
                break
            try:
                piece, values, cursor, skipped = self._read_checkpoint(key, ndim)
            except (ShardkitError, OSError, KeyError, TypeError, ValueError) as exc:
                logger.info("%s: checkpoint not used (%s); the part continues before it", self.store.describe(key), exc)
                break
            self.pieces.append(piece)
            for name, v in values.items():
                self.fields[name].append(v)
            self.skipped += skipped
            self._saved_skips = len(self.skipped)
            self.records_written += piece["count"]
            self.cursor = cursor
        self.resumed = self.records_written
        self._restored_skips = len(self.skipped)
        stale = len(self.pieces)
        while self.store.exists(key := part_key(self.job.plan, self.job.part, f"-{stale}.json")):
            self.store.delete(key)
            stale += 1
        if self.resumed:
            logger.info("%s: part %d resumes after %d records (input %d of %d)", self.store.url, self.job.part,
                        self.resumed, split_cursor(self.cursor)[0], len(self.job.items))
        return self.cursor

    def _read_checkpoint(self, key: str, ndim: int) -> tuple[dict[str, Any], dict[str, np.ndarray], int, list[SkippedInput]]:
        """A checkpoint, strictly checked: this part at this offset, the next file in order and present with its
        recorded size, a cursor after the previous one and inside the part, field values of exactly its records."""
        where = self.store.describe(key)
        doc = read_json_object(self.store, key)
        i = len(self.pieces)
        if jv.integer(doc.get("part"), "part", where) != self.job.part or \
                jv.integer(doc.get("offset"), "offset", where) != self.offset:
            raise NotADatasetError(f"{where}: a checkpoint of another part or offset")
        piece = _parse_piece(doc.get("piece"), i, where, self.records_per_shard, self.job.payload, ndim, self.job.plan,
                             self.job.part, self.offset, self.records_written, self.job.staged)
        cursor = jv.integer(doc.get("cursor"), "cursor", where)
        if not self.cursor < cursor <= input_cursor(len(self.job.items)):
            raise NotADatasetError(f"{where}: cursor {cursor} is not after {self.cursor} inside the part")
        skipped = []
        for raw in jv.array(doc.get("skipped"), "skipped", where):
            m = jv.mapping(raw, "skipped[]", where)
            at = jv.integer(m.get("cursor"), "skipped[].cursor", where)
            if not self.cursor <= at < cursor:
                raise NotADatasetError(f"{where}: a skip at cursor {at} outside the checkpoint")
            skipped.append(SkippedInput(jv.string(m.get("path"), "skipped[].path", where),
                                        jv.string(m.get("reason"), "skipped[].reason", where), at))
        if _size(self.store, piece["key"]) != piece["nbytes"]:
            raise NotADatasetError(f"{self.store.describe(piece['key'])}: missing or changed since its checkpoint")
        digest = FileDigest.from_json(doc.get("fields"), where=where, what="fields")
        bound = piece["count"] * sum(spec.nbytes for spec in self.job.fields.values()) + (64 << 10)
        if digest.nbytes > bound:
            raise NotADatasetError(f"{where}: field values of {digest.nbytes} bytes, at most {bound} expected")
        npz = part_key(self.job.plan, self.job.part, f"-{i}.npz")
        data = read_object(self.store, npz, digest, what="checkpoint field values", max_nbytes=digest.nbytes)
        return piece, _load_fields(data, self.job.fields, piece["count"], self.store.describe(npz)), cursor, skipped

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
        k = int(cursors.shape[0])
        payload = self.job.record.check(self.job.payload, batch[self.job.payload], k)
        values = {name: spec.check(name, batch[name], k) for name, spec in self.job.fields.items()}
        for writer, run in shard_runs(k, self._open):
            writer.append(payload[run])
            for name, v in values.items():
                self._open_fields[name].append(v[run])
            self.records_written += run.stop - run.start
            if writer.full:
                self._close(int(cursors[run.stop - 1]))

    def skip(self, path: str, reason: str, cursor: int) -> None:
        self.skipped.append(SkippedInput(path, reason, cursor))

    def finish(self, tally: Tally, inputs: tuple[int, int]) -> PartManifest:
        """Close the last file, save the field values, then the manifest (last: the part is done)."""
        if self._writer is not None:
            if self._writer.count:
                self._close(None)
            else:
                self.abort()
        data = self._fields_npz()
        put_checked(self.store, part_key(self.job.plan, self.job.part, ".npz"), data)
        skips = tally.skips + Counter(reason_category(s.reason) for s in self.skipped[: self._restored_skips])
        manifest = PartManifest(
            part=self.job.part, inputs=inputs, offset=self.offset, records=self.records_written,
            pieces=tuple(self.pieces), fields=FileDigest.of(data), skipped=tuple(self.skipped),
            notes=dict(tally.notes), skips=dict(skips), resumed=self.resumed,
        )
        put_checked(self.store, part_key(self.job.plan, self.job.part, ".json"), encode_json(manifest.to_json()))
        return manifest

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            if not self.store.is_local and self._file is not None:
                self._file.unlink(missing_ok=True)
            self._writer = self._file = None


@dataclass(frozen=True)
class PartManifest:
    """A finished part, as its manifest in the output says (written last: its presence means done).

    ``inputs`` is its input range ``[first, end)``, ``offset`` the global number of its first record;
    ``pieces`` are its files in record order (``key``, ``start`` within the part, ``count``,
    ``capacity``, checksums); ``fields`` the digest of ``p<part>.npz``; ``resumed`` the records this
    run restored from checkpoints (not stored).
    """

    part: int
    inputs: tuple[int, int]
    offset: int
    records: int
    pieces: tuple[dict[str, Any], ...]
    fields: FileDigest
    skipped: tuple[SkippedInput, ...] = ()
    notes: Mapping[str, int] = field(default_factory=dict)
    skips: Mapping[str, int] = field(default_factory=dict)
    resumed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "part": self.part, "inputs": list(self.inputs), "offset": self.offset, "records": self.records,
            "pieces": list(self.pieces), "fields": self.fields.to_json(),
            "skipped": [s.to_json() for s in self.skipped], "notes": dict(self.notes), "skips": dict(self.skips),
        }

    def movable(self, plan: str) -> bool:
        """Every file of the part is in the plan directory of ``plan``: the commit takes it at any offset
        (linking what lands on the shard grid, re-packing the rest)."""
        prefix = f"{PARTS_DIR}/{plan}/"
        return all(str(p["key"]).startswith(prefix) for p in self.pieces)

    def segment(self, store: Store, plan: str, specs: Mapping[str, FieldSpec], labels: Mapping[str, list[str]],
                first_skips: Sequence[SkippedInput] = (), table: int | None = None) -> Segment:
        """The part as a :class:`~shardkit.formats.commit.Segment` of the commit."""
        shards = tuple(StoredShard(store, p["key"], p["count"], p["capacity"], p["nbytes"], p["crc32c"],
                                   p["data_crc32c"], p["index_crc32c"], p["tail_crc32c"]) for p in self.pieces)
        key = part_key(plan, self.part, ".npz")
        digest, count = self.fields, self.records

        def load() -> dict[str, np.ndarray]:
            data = read_object(store, key, digest, what="part field values", max_nbytes=digest.nbytes)
            return _load_fields(data, specs, count, store.describe(key))

        return Segment(self.records, shards, load, labels, (*first_skips, *self.skipped), table)


def read_manifest(store: Store, plan: str, part: int, inputs: tuple[int, int], records_per_shard: int,
                  payload: str, ndim: int, *, staged: bool = False) -> PartManifest | None:
    """Part ``part``'s manifest, strictly checked, or ``None`` when the part is not finished.

    Keys are not trusted: each piece must be exactly the file this part writes there, pieces must
    follow each other, and every number is bounded.
    """
    key = part_key(plan, part, ".json")
    where = store.describe(key)
    if not store.exists(key):
        return None
    try:
        doc = read_json_object(store, key)
        m = _parse_manifest(doc, where, records_per_shard, payload, ndim, plan, staged)
    except (ShardkitError, KeyError, TypeError, ValueError) as exc:
        logger.warning("%s: unreadable part manifest (%s); the part is converted again", where, exc)
        return None
    if m.part != part or m.inputs != inputs:
        logger.warning("%s: manifest of another part; the part is converted again", where)
        return None
    for piece in m.pieces:
        if _size(store, piece["key"]) != piece["nbytes"]:
            logger.info("%s: a file of the part is missing or changed; the part is converted again", where)
            return None
    return m


def _parse_piece(raw: Any, i: int, where: str, s: int, payload: str, ndim: int, plan: str, part: int, offset: int,
                 start: int, staged: bool) -> dict[str, Any]:
    """File ``i`` of part ``part`` (at record ``offset``), starting at its record ``start``, strictly checked:
    its key must be exactly the one the part writes there, its numbers bounded."""
    p = jv.mapping(raw, f"pieces[{i}]", where)
    piece: dict[str, Any] = {
        k: jv.integer(p.get(k), f"pieces[{i}].{k}", where, hi=MAX_CRC32C if "crc" in k else None)
        for k in ("start", "count", "capacity", "nbytes", "crc32c", "data_crc32c", "index_crc32c", "tail_crc32c")
    }
    g = offset + piece["start"]
    whole = piece["count"] == piece["capacity"] == s and g % s == 0 and not staged
    # In the plan directory always (a guessed offset stages whole shards too); a whole shard may be under its
    # final name unless the plan is staged.
    expected = {part_key(plan, part, f"-{i}.shard"), *([chunk_key(payload, g // s, ndim)] if whole else [])}
    key = p.get("key")
    if key not in expected or piece["start"] != start or not 0 < piece["count"] <= piece["capacity"] <= s:
        raise NotADatasetError(f"{where}: pieces[{i}] is not what part {part} writes there")
    piece["key"] = key
    return piece


def _parse_manifest(doc: dict[str, Any], where: str, s: int, payload: str, ndim: int, plan: str,
                    staged: bool) -> PartManifest:
    part = jv.integer(doc.get("part"), "part", where)
    a, b = (jv.integer(x, "inputs[]", where) for x in jv.array(doc.get("inputs"), "inputs", where))
    offset = jv.integer(doc.get("offset"), "offset", where)
    records = jv.integer(doc.get("records"), "records", where)
    pieces = []
    start = 0
    for i, raw in enumerate(jv.array(doc.get("pieces"), "pieces", where)):
        piece = _parse_piece(raw, i, where, s, payload, ndim, plan, part, offset, start, staged)
        start += piece["count"]
        pieces.append(piece)
    if start != records:
        raise NotADatasetError(f"{where}: pieces hold {start} records, the manifest says {records}")
    skipped = tuple(SkippedInput(jv.string(jv.mapping(x, "skipped[]", where).get("path"), "skipped[].path", where),
                                 jv.string(x.get("reason"), "skipped[].reason", where))
                    for x in jv.array(doc.get("skipped", []), "skipped", where))
    counts = {k: {str(n): jv.integer(v, f"{k}[]", where) for n, v in jv.mapping(doc.get(k, {}), k, where).items()}
              for k in ("notes", "skips")}
    return PartManifest(part, (a, b), offset, records, tuple(pieces),
                        FileDigest.from_json(doc.get("fields"), where=where, what="fields"), skipped,
                        counts["notes"], counts["skips"])


def write_part(job: PartJob, offset: int, spilled: Spilled | None = None) -> PartManifest:
    """Write part ``job`` to the output with its first record at global number ``offset``: from the spill
    :func:`count_part` left when it is on this machine, else decoding from the last checkpoint."""
    store = _check_reach(job)
    if not store.is_local:
        _scratch(job, sweep=True)
    replay = spilled is not None and spilled.host == socket.gethostname() and _read_spill(Path(spilled.path), job) is not None
    sink = _AlignedWriter(job, offset, store, checkpoints=not replay)
    writer = BackgroundWriter(sink)
    try:
        if spilled is not None and replay:
            tally = _replay_spill(Path(spilled.path), job, writer)
        else:
            if spilled is not None:
                logger.info("part %d: its spill is on %s, not here (%s): decoding it again", job.part, spilled.host,
                            worker_name())
            start = sink.resume()
            writer.records_written = sink.records_written
            tally = decode_into(job.decoder, job.items, writer, start, names=job.names, chunk_size=job.chunk_size,
                                workers=job.workers, strict=job.strict, progress=_progress(job),
                                provenance=job.provenance, first_input=job.first)
        writer.drain()
        manifest = sink.finish(tally, (job.first, job.first + len(job.items)))
    except BaseException:
        writer.stop()
        sink.abort()
        raise
    finally:
        join_ended_pools()  # the decode workers exited while the last shard was closed
    if spilled is not None and spilled.host == socket.gethostname():
        shutil.rmtree(spilled.path, ignore_errors=True)
    return manifest


def _replay_spill(path: Path, job: PartJob, sink: RecordSink) -> Tally:
    """Feed a spill's records, fields and skips to ``sink`` (in batches of about one shard)."""
    doc = json.loads((path / "spill.json").read_text())
    n = int(doc["records"])
    fields = _load_fields((path / "fields.npz").read_bytes(), job.fields, n, str(path / "fields.npz"))
    dtype = np.dtype(job.record.dtype).newbyteorder("<")
    records = np.memmap(path / "records.bin", dtype=dtype, mode="r", shape=(n, *job.record.shape)) if n else None
    step = max(1, min(job.records_per_shard, (64 << 20) // max(1, job.record.nbytes)))
    for a in range(0, n, step):
        assert records is not None
        batch = {job.payload: np.asarray(records[a : a + step]), **{k: v[a : a + step] for k, v in fields.items()}}
        sink.write(batch, np.zeros(min(step, n - a), dtype=np.int64))
    for s in doc["skipped"]:
        sink.skip(str(s["path"]), str(s["reason"]), 0)
    del records
    return Tally(Counter(doc.get("notes", {})), Counter(doc.get("skips", {})))
