"""The conversion engine: plan parts, run them on an executor, commit (docs/design.md §11).

:func:`convert_in_parts` runs every conversion: ``convert`` in one process (:func:`run_converter`: the
corpus is one part, converted inline), ``--part-size``, an executor, ``--scheduler`` and ``--append``,
into a directory or an object store alike. A re-run after a kill at any instant finishes the job and
gives a byte-identical result; two runs into one output never mix (docs/design.md §11).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit._version import __version__
from shardkit.converters.base import PROVENANCE, Converter, ScanResult, reason_category
from shardkit.converters.codec_report import SAMPLE_KEY, auto_codec, codec_sample, sample_records
from shardkit.converters.decoding import default_workers
from shardkit.converters.executors import InlineExecutor, dask_executor, local_pool, slots, submit
from shardkit.converters.main_guard import refuse_inside_worker_start
from shardkit.converters.options import OptionNaming
from shardkit.converters.parts import (
    PartJob,
    PartManifest,
    PartPlan,
    Spilled,
    count_part,
    default_part_size,
    read_manifest,
    read_progress,
    write_part,
)
from shardkit.converters.pipeline import (
    ConvertSummary,
    NothingConverted,
    ProgressFn,
    config_fingerprint,
    dataset_config,
    dataset_fields,
    shard_layout,
    strict_stop,
    summary_of,
)
from shardkit.converters.progress import progress_bar
from shardkit.converters.registry import detect_kind, get_converter
from shardkit.converters.runoptions import ConversionOptions
from shardkit.declare import option_name
from shardkit.errors import ConfigError, ConversionError, ShardkitError, WorkerError
from shardkit.formats import DatasetMeta, FieldSpec, get_codec
from shardkit.formats.codecs import RecordCodec, codec_from_json
from shardkit.formats.commit import InputTable, Segment, commit
from shardkit.formats.metadata import DEFAULT_FIELD_CHUNK, encode_json, read_dataset_meta
from shardkit.formats.outputs import PARTS_DIR, STAGING_DIR, clear_store, remove_path, top_names
from shardkit.formats.provenance import TABLE_ARRAYS, ProvenanceSpec
from shardkit.formats.spec import DEFAULT_SHARD_BYTES, ZARR_JSON, SkippedInput
from shardkit.formats.transfer import put_checked
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS, VERSIONS_DIR, prune, version_of
from shardkit.stores import Store, as_location, is_url, open_store

__all__ = ["convert", "convert_in_parts", "check_appendable", "run_conversion", "run_converter"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the parts' progress files.
_POLL = 0.5


def check_appendable(base: DatasetMeta, conv: Converter, codec: RecordCodec | None, records_per_shard: int | None,
                     where: str) -> None:
    """Refuse to append ``conv``'s records to the dataset ``base`` unless they are the same kind of records:
    ConversionError naming the first difference (compression and records per shard only when given)."""
    checks: list[tuple[str, Any, Any]] = [
        ("kind", base.kind, conv.name),
        ("payload", base.payload, conv.payload),
        ("record shape", base.record.shape, conv.record_spec().shape),
        ("record dtype", base.record.dtype, conv.record_spec().dtype),
        ("fields", {k: v.to_json() for k, v in base.fields.items() if k != PROVENANCE},
         {k: v.to_json() for k, v in conv.fields().items()}),
        ("transform", base.transform, json.loads(json.dumps(conv.transform()))),
        ("kind metadata (extra)", base.extra, json.loads(json.dumps(conv.extra()))),
    ]
    if codec is not None:
        checks.append(("compression", base.compression, codec.to_json()))
    if records_per_shard is not None:
        checks.append(("records per shard", base.records_per_shard, records_per_shard))
    for what, have, new in checks:
        if have != new:
            raise ConversionError(
                f"{where}: cannot append {conv.describe()}: its {what} {_show(new)} differs from the dataset's {_show(have)}; "
                "convert it with the dataset's options, or into a new dataset. Nothing was changed"
            )


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class _Plan:
    """One conversion in parts: where, what, and its id."""

    conv: Converter
    scan: ScanResult
    store: Store
    base: DatasetMeta | None
    records_per_shard: int
    codec: RecordCodec | None
    fingerprint: str
    ranges: list[tuple[int, int]]
    id: str
    provenance: ProvenanceSpec
    fields: dict[str, FieldSpec]

    @property
    def dir(self) -> str:
        """The plan directory (a key prefix of the output)."""
        return f"{PARTS_DIR}/{self.id}"

    @property
    def out(self) -> str:
        """The output as workers open it: an absolute path or a URL."""
        return str(as_location(self.store))

    @property
    def operation(self) -> str:
        return "append" if self.base is not None else "convert"


def _make_plan(conv: Converter, scan: ScanResult, store: Store, base: DatasetMeta | None, *, shard_bytes: int,
               records_per_shard: int | None, codec: RecordCodec | None, part_size: int | None,
               single: bool = False) -> _Plan:
    n = len(scan.items)
    if base is not None:
        rps, size = base.records_per_shard, None
        codec = None if base.compression is None else codec_from_json(base.compression)
    else:
        rps, size = shard_layout(conv, n, shard_bytes, records_per_shard)
    if codec is not None:  # before any input is decoded: an image codec refuses audio records, and so on
        record = conv.record_spec()
        codec.check_record(record.shape, record.dtype, store.url)
    provenance = conv.provenance_spec(scan)
    fields = dataset_fields(conv, provenance)
    config = dataset_config(conv, scan, fields, provenance, rps, size, codec)
    ranges = PartPlan(n, max(1, n) if single else part_size or default_part_size(n, rps)).ranges()
    identity = {"config": config, "ranges": ranges,
                "base": None if base is None else {"version": version_of(base.to_json()), "records": base.num_records,
                                                   "attributes_crc32c": base.to_json().get("attributes_crc32c")}}
    plan_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return _Plan(conv, scan, store, base, rps, codec, config_fingerprint(config), ranges, plan_id, provenance, fields)


def _already_done(plan: _Plan) -> DatasetMeta | None:
    """The dataset, if it already holds this conversion (or, for an append, already ends with it)."""
    if not plan.store.exists(ZARR_JSON):
        return None
    meta = read_dataset_meta(plan.store)
    history = meta.source.get("history")
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else meta.source
    return meta if last.get("config_fingerprint") == plan.fingerprint else None


#: Descriptors of the output locks this process holds: a forked child (a decode worker) closes its
#: copies at once, so a worker outliving its killed owner never keeps the output locked for a re-run.
_HELD_LOCKS: set[int] = set()


def _close_locks_in_child() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent keeps its lock
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


class _OutputLock:
    """An exclusive ``flock`` on a local output directory, from before the run looks for another
    unfinished conversion until its commit and cleanup (docs/design.md §11, "One at a time")."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (once; not for an object store or a directory not made yet); ConversionError
        when another run holds it."""
        if self.fd is not None or not self.store.is_local or not self.store.local_path().is_dir():
            return
        path = self.store.local_path()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConversionError(
                f"{self.store.url}: another conversion or append into this dataset is running (it holds the lock on "
                f"{path}); wait for it to finish, then run this command again. Nothing was changed"
            ) from None
        self.fd = fd
        _HELD_LOCKS.add(fd)

    def release(self) -> None:
        """Let go of the lock (explicitly, whoever else shares the open file)."""
        if self.fd is not None:
            _HELD_LOCKS.discard(self.fd)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _claim(plan: _Plan, lock: _OutputLock, *, overwrite: bool) -> bool:
    """Make the plan directory, holding ``lock``; returns whether this run created the output directory.

    ConversionError when the output holds something else: files that are not a shardkit output, a
    dataset (for a new conversion, without ``overwrite``), another unfinished conversion.
    """
    store, where = plan.store, plan.store.url
    local = store.local_path() if store.is_local else None
    created = local is not None and not local.exists()
    if plan.base is None:
        if overwrite:
            clear_store(store)
        elif store.exists(ZARR_JSON):
            made = read_dataset_meta(store).source.get("config_fingerprint") is not None
            raise ConversionError(f"{where}: a dataset already exists here{' with different parameters' if made else ''}; "
                                  "use --overwrite to replace it, or --append to add these records to it")
        if local is not None and local.exists() and not local.is_dir():
            raise ConversionError(f"{where}: output exists and is not a directory")
        # What this conversion writes before its root document (a commit cut short leaves them).
        foreign = top_names(store, (PARTS_DIR, VERSIONS_DIR, STAGING_DIR, plan.conv.payload, *plan.fields,
                                    *TABLE_ARRAYS, f"{ZARR_JSON}.partial"))
        if foreign:
            raise ConversionError(f"{where}: the output is not empty and is not a shardkit dataset (found "
                                  f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose another one")
        if local is not None and (local / STAGING_DIR / "config.json").exists():
            raise ConversionError(f"{where}: an interrupted conversion by an earlier shardkit ({STAGING_DIR}) is here; "
                                  "this version cannot resume it: finish it with the shardkit that started it, or use "
                                  "--overwrite to start fresh")
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    lock.acquire()  # held from here: no other run can claim the output between this check and the plan
    if plan.base is None and local is not None:
        remove_path(local / STAGING_DIR)  # left by an earlier shardkit killed before it staged anything
    others = sorted({m.key.split("/")[1] for m in store.list(PARTS_DIR) if m.key.count("/") >= 2} - {plan.id})
    if others:
        there = store.describe(f"{PARTS_DIR}/{others[0]}")
        raise ConversionError(
            f"{where}: an interrupted conversion or append with other parameters is in {there} (different "
            "parameters, or an interrupted conversion in parts (--part-size, --scheduler or --append)); re-run that "
            f"command to finish it, or delete {there} to discard it (the dataset itself is unchanged)"
        )
    doc = {"operation": plan.operation, "fingerprint": plan.fingerprint, "ranges": plan.ranges,
           "base_version": None if plan.base is None else version_of(plan.base.to_json())}
    put_checked(store, f"{plan.dir}/plan.json", encode_json(doc))
    if local is not None:
        (local / plan.dir / "progress").mkdir(parents=True, exist_ok=True)
    return created


class _Runner:
    """Run every part of a plan on an executor (see the module docstring): counting, writing, progress.

    With ``guess``, a part whose offset is not known yet is written at once at a guessed offset (one
    record per input after the parts counted so far, :meth:`guessed_offset`), every file in the plan directory, instead of being
    counted into a spill and written again: each worker writes whole shards of its own and the commit
    links them, re-packing only what a wrong guess put off the shard grid. Only for kinds whose inputs
    give one record each (``records_follow_inputs``): the guess is exact unless inputs were skipped.
    """

    def __init__(self, plan: _Plan, executor: Executor, *, workers: int, strict: bool, progress: ProgressFn | None,
                 scratch: str | None = None, guess: bool = False) -> None:
        self.plan = plan
        self.guess = guess and plan.conv.records_follow_inputs
        self.scratch = scratch
        self.executor = executor
        self.inline = isinstance(executor, InlineExecutor)
        self.workers = workers if self.inline else 1
        self.strict = strict
        self.progress = progress
        self.n_inputs = len(plan.scan.items)
        self.base_records = plan.base.num_records if plan.base else 0
        self.done: dict[int, PartManifest] = {}
        self.counts: dict[int, int] = {}
        self.spilled: dict[int, Spilled] = {}
        self.running: dict[Future[Any], tuple[str, int]] = {}
        self.busy: set[int] = set()
        self.seen: dict[int, tuple[int, int]] = {}
        self.converted = 0
        self.records_converted = 0
        self._last_poll = 0.0

    def job(self, part: int, guessed: bool = False) -> PartJob:
        conv, (a, b) = self.plan.conv, self.plan.ranges[part]
        items = self.plan.scan.items
        own: ProgressFn | None = None
        if self.inline:
            def own(done: int, total: int, records: int) -> None:
                self.seen[part] = (done, records)
                self.report()
        return PartJob(
            plan=self.plan.id, part=part, first=a, items=[items[i] for i in range(a, b)], decoder=conv.decoder,
            src=conv.source_location(), out=self.plan.out, payload=conv.payload, record=conv.record_spec(),
            fields=self.plan.fields, records_per_shard=self.plan.records_per_shard,
            compression=None if self.plan.codec is None else self.plan.codec.to_json(),
            provenance=(conv.name, conv.provenance_columns),
            chunk_size=conv.chunk_size, workers=self.workers, strict=self.strict, staged=self.plan.base is not None,
            guessed=guessed, progress=own, scratch=self.scratch,
        )

    def offset(self, part: int) -> int | None:
        """Global number of the part's first record, once every part before it is counted."""
        total = self.base_records
        for q in range(part):
            if q not in self.counts:
                return None
            total += self.counts[q]
        return total

    def guessed_offset(self, part: int) -> int:
        """Where part ``part`` starts if every input after the counted parts gives one record."""
        total, q = self.base_records, 0
        while q < part and q in self.counts:
            total += self.counts[q]
            q += 1
        return total + self.plan.ranges[part][0] - self.plan.ranges[q][0]

    def resume(self) -> None:
        """Parts a previous run finished (their manifests, checked; offsets are checked by :meth:`misplaced`)."""
        ndim = 1 + len(self.plan.conv.record_spec().shape)
        for p, rng in enumerate(self.plan.ranges):
            m = read_manifest(self.plan.store, self.plan.id, p, rng, self.plan.records_per_shard, self.plan.conv.payload,
                              ndim, staged=self.plan.base is not None)
            if m is not None:
                self.finished(p, m)
        if self.done:
            logger.info("%s: %d of %d parts already converted", self.plan.store.url, len(self.done), len(self.plan.ranges))

    def misplaced(self) -> list[int]:
        """Finished parts written at an offset that is not theirs, once every count is known (a part
        converted again gave another count: decoding changed under a resumed plan). They are redone, unless
        every file of theirs is in the plan directory (written at a guessed offset): the commit places those."""
        wrong = [p for p, m in self.done.items()
                 if self.offset(p) not in (None, m.offset) and not m.movable(self.plan.id)]
        for p in wrong:
            logger.warning("%s: part %d was written at record %d, its place is %s: converting it again",
                           self.plan.store.url, p, self.done[p].offset, self.offset(p))
            del self.done[p]
        return wrong

    def finished(self, part: int, manifest: PartManifest) -> None:
        self.done[part] = manifest
        self.counts[part] = manifest.records
        self.seen[part] = (manifest.inputs[1] - manifest.inputs[0], manifest.records)

    def next_task(self) -> tuple[str, int] | None:
        """What to submit next: a counted part whose offset is known, else the first part not started
        (written directly when its offset is known, counted otherwise)."""
        todo = [p for p in range(len(self.plan.ranges)) if p not in self.done and p not in self.busy]
        for p in todo:
            if p in self.spilled and self.offset(p) is not None:
                return "write", p
        for p in todo:
            if p not in self.spilled:
                return ("write" if self.offset(p) is not None else "guess" if self.guess else "count"), p
        return None

    def submit(self, kind: str, part: int) -> None:
        job = self.job(part, guessed=kind == "guess")
        if kind == "count":
            future: Future[Any] = submit(self.executor, count_part, job)
        elif kind == "guess":
            future = submit(self.executor, write_part, job, self.guessed_offset(part))
        else:
            spill = self.spilled.get(part)
            future = submit(self.executor, write_part, job, self.offset(part), spill,
                            near=spill.worker if spill is not None else "")
        self.running[future] = (kind, part)
        self.busy.add(part)

    def collect(self, future: Future[Any]) -> None:
        kind, part = self.running.pop(future)
        self.busy.discard(part)
        result = future.result()
        if kind == "count":
            self.spilled[part] = result
            self.counts[part] = result.records
        else:
            self.spilled.pop(part, None)
            self.finished(part, result)
            self.converted += 1
            self.records_converted += result.records - result.resumed

    def report(self, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if not force and not self.inline and now - self._last_poll < _POLL:
            return  # parts elsewhere report through their progress files: polled at most every _POLL
        self._last_poll = now
        if not self.inline:
            for p in range(len(self.plan.ranges)):
                if p not in self.done and (p in self.busy or p in self.spilled):  # others have not started
                    got = read_progress(self.plan.store, self.plan.id, p)
                    old = self.seen.get(p, (0, 0))
                    self.seen[p] = (max(old[0], got[0]), max(old[1], got[1]))
        inputs = sum(v[0] for v in self.seen.values())
        records = sum(v[1] for v in self.seen.values())
        self.progress(min(inputs, self.n_inputs), self.n_inputs, records)

    def run(self) -> dict[int, PartManifest]:
        """Every part, finished; the first failure (of the lowest part) once the running tasks ended."""
        self.resume()
        window = slots(self.executor)
        failures: dict[int, BaseException] = {}
        try:
            while len(self.done) < len(self.plan.ranges) or (not failures and self.misplaced()):
                while not failures and len(self.running) < window and (task := self.next_task()) is not None:
                    self.submit(*task)
                if not self.running:
                    break
                finished, _ = wait(list(self.running), timeout=_POLL, return_when=FIRST_COMPLETED)
                for future in finished:
                    part = self.running[future][1]
                    try:
                        self.collect(future)
                    except Exception as exc:
                        failures[part] = exc
                self.report()
        except BaseException:
            for future in self.running:
                future.cancel()
            raise
        self.report(force=True)
        if failures:
            raise _failure(failures)
        return self.done


def _failure(failures: dict[int, BaseException]) -> BaseException:
    part = min(failures)
    exc = failures[part]
    if isinstance(exc, ShardkitError):
        return exc
    if isinstance(exc, BrokenProcessPool):
        return WorkerError("a worker process died (killed, out of memory or a crashing decoder); finished parts are "
                           "kept: re-run the same command to resume")
    return WorkerError(f"part {part} failed on its worker: {type(exc).__name__}: {exc}; finished parts are kept: "
                       "re-run the same command to resume")


def _template(plan: _Plan) -> DatasetMeta:
    conv = plan.conv
    if plan.base is not None:
        return plan.base
    return DatasetMeta(
        kind=conv.name, payload=conv.payload, record=conv.record_spec(), num_records=0,
        records_per_shard=plan.records_per_shard, fields=plan.fields, field_chunk=DEFAULT_FIELD_CHUNK,
        labels={}, compression=None if plan.codec is None else plan.codec.to_json(), transform=conv.transform(),
        source={**conv.source(), "config_fingerprint": plan.fingerprint, **_quality_sample(plan)}, extra=conv.extra(),
        created_by=f"shardkit {__version__}", provenance={"columns": list(plan.provenance.columns)},
    )


def _quality_sample(plan: _Plan) -> dict[str, Any]:
    """For a lossy codec, its PSNR on a sample of the corpus's records (``info`` shows it)."""
    if plan.codec is None or not plan.codec.is_lossy():
        return {}
    return {SAMPLE_KEY: codec_sample(plan.codec, sample_records(plan.conv, plan.scan))}


def convert_in_parts(
    conv: Converter,
    out: str | os.PathLike[str],
    *,
    executor: Executor | None = None,
    append: bool = False,
    part_size: int | None = None,
    workers: int = 1,
    strict: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    shard_bytes: int,
    records_per_shard: int | None = None,
    progress: ProgressFn | None = None,
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
    naming: OptionNaming = "python",
    single: bool = False,
    local: bool = False,
    staging_dir: str | os.PathLike[str] | None = None,
) -> ConvertSummary:
    """Convert ``conv``'s corpus in parts on ``executor`` (inline when ``None``) and commit them at ``out``
    (parameters: :func:`shardkit.converters.convert`); ``single``: the whole corpus is one part; ``local``:
    ``executor`` is this machine's worker processes, each writing whole parts of its own (written at a
    guessed offset when theirs is not known yet)."""
    refuse_inside_worker_start()
    t0 = time.perf_counter()
    store = open_store(as_location(out, resolve=False) if is_url(out) else Path(os.path.abspath(out)))
    if store.read_only:
        raise ConversionError(f"{store.url}: cannot convert into a read-only store (http(s):// URLs are read-only)")
    output: Path | str = store.local_path() if store.is_local else store.url
    if staging_dir is not None and not store.is_local and not Path(staging_dir).is_dir():
        raise ConversionError(f"staging_dir: expected an existing directory, found {str(staging_dir)!r}")
    auto = compression is not None and compression.strip().lower() == "auto"
    codec = None if auto else get_codec(compression)
    codec = None if codec is None else codec.for_records(conv.transform())  # audio codecs: the records' sample rate
    lock = _OutputLock(store)
    try:
        lock.acquire()  # an append's dataset is there: held before its metadata is read
        base = None
        if append:
            if not store.exists(ZARR_JSON):
                raise ConversionError(f"{store.url}: no dataset to append to; convert the first corpus without --append")
            base = read_dataset_meta(store)
            check_appendable(base, conv, codec, records_per_shard, store.url)
        scan = conv.scan()
        if strict and scan.skipped:
            raise strict_stop(scan.skipped[0].path, scan.skipped[0].reason)
        for s in scan.skipped:
            logger.info("skipped %s: %s", s.path, s.reason)
        if auto and base is None:
            codec, lines = auto_codec(conv, scan)
            for line in lines:
                logger.warning("--compression auto: %s", line)
        plan = _make_plan(conv, scan, store, base, shard_bytes=shard_bytes, records_per_shard=records_per_shard,
                          codec=codec, part_size=part_size, single=single)
        n_parts = 0 if single else len(plan.ranges)
        if not overwrite and (done := _already_done(plan)) is not None:
            logger.info("%s: already holds this %s", store.url, plan.operation)
            committed = done.source.get("plan")
            if isinstance(committed, str) and committed.isalnum():  # a run killed after its commit, before its cleanup
                _cleanup(store, committed, keep_versions)
            return summary_of(output, done, time.perf_counter() - t0, already_complete=True,
                              version=version_of(done.to_json()), parts=n_parts)
        created = _claim(plan, lock, overwrite=overwrite)
        executor = executor or InlineExecutor()
        runner = _Runner(plan, executor, workers=workers, strict=strict, progress=progress,
                         scratch=None if staging_dir is None else str(staging_dir), guess=local)
        manifests = runner.run()
        new_records = sum(m.records for m in manifests.values())
        tally: Counter[str] = Counter(reason_category(s.reason) for s in scan.skipped)
        notes: Counter[str] = Counter()
        for m in manifests.values():
            tally.update(m.skips)
            notes.update(m.notes)
        if new_records == 0:
            _cleanup(store, plan.id, keep_versions, prune_versions=False)
            if created and store.is_local:
                shutil.rmtree(store.local_path(), ignore_errors=True)
            raise NothingConverted.of(conv, len(scan.items), tally,
                                      "Nothing was appended" if append else "Nothing was written")
        segments = _segments(plan, manifests)
        history = {"operation": plan.operation, "config_fingerprint": plan.fingerprint, "source": conv.source(),
                   "inputs": len(scan.items), "parts": [[*plan.ranges[p], manifests[p].records] for p in sorted(manifests)]}
        prov = plan.provenance
        try:
            report = commit(store, _template(plan), segments, base=base, plan=plan.id, history=history,
                            keep_versions=keep_versions, executor=None if isinstance(executor, InlineExecutor) else executor,
                            inputs=[InputTable(prov.inputs, prov.root)], summarize=prov.summarize)
        except ConversionError:
            if base is not None and _moved_on(store, base, plan.id):
                # Another commit came first (an object store has no lock): this plan's parts were cut for a
                # version that is gone, so they go too, and the same command plans the append again.
                _cleanup(store, plan.id, keep_versions, prune_versions=False)
            raise
        _cleanup(store, plan.id, keep_versions)
        this_run = {"skipped": dict(sorted(tally.items()))} if append else {}  # an append reports its own skips
        summary = summary_of(output, report.meta, time.perf_counter() - t0, records_this_run=runner.records_converted,
                             notes=dict(sorted(notes.items())), version=report.version, parts=n_parts,
                             parts_converted=0 if single else runner.converted, commit=report, **this_run)
        logger.info("%s: version %d, %d records (%d parts, %d converted now), %.1f s", store.url, report.version,
                    summary.records, len(plan.ranges), runner.converted, summary.seconds)
        if summary.skipped:
            listed = "listed above" if logger.isEnabledFor(logging.INFO) else (
                "--verbose lists them" if naming == "cli" else "logging at level INFO lists them")
            logger.warning(
                "%s: %d inputs skipped (%s); %s, and attributes.shardkit.skipped in %s keeps every reason",
                output, summary.num_skipped, ", ".join(f"{k}: {v}" for k, v in summary.skipped.items()), listed,
                f"{output}/{ZARR_JSON}",
            )
        return summary
    finally:
        lock.release()


def _moved_on(store: Store, base: DatasetMeta, plan_id: str) -> bool:
    """The dataset is at another version than ``base``'s, and not by committing ``plan_id``."""
    try:
        now = read_dataset_meta(store)
    except ShardkitError:
        return False
    return version_of(now.to_json()) != version_of(base.to_json()) and now.source.get("plan") != plan_id


def _cleanup(store: Store, plan_id: str, keep_versions: int, *, prune_versions: bool = True) -> None:
    """After the commit of ``plan_id``: its plan directory goes (the parts are in the dataset now), and
    old versions are pruned."""
    if store.is_local:
        shutil.rmtree(store.local_path(f"{PARTS_DIR}/{plan_id}"), ignore_errors=True)
        parts = store.local_path(PARTS_DIR)
        if parts.is_dir() and not any(parts.iterdir()):
            parts.rmdir()
    else:
        for m in list(store.list(f"{PARTS_DIR}/{plan_id}")):
            store.delete(m.key)
    if prune_versions:
        prune(store, keep_versions)


def _segments(plan: _Plan, manifests: dict[int, PartManifest]) -> list[Segment]:
    conv = plan.conv
    labels = conv.labels()
    first_skips = [SkippedInput(s.path, s.reason) for s in plan.scan.skipped]
    return [manifests[p].segment(plan.store, plan.id, plan.fields, labels, first_skips if p == 0 else (), table=0)
            for p in sorted(manifests)]


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
    """Convert with an already constructed converter in this process (see :func:`convert`; sizes already
    parsed): the corpus is one part of :func:`convert_in_parts`, decoded by ``workers`` processes."""
    return convert_in_parts(
        conv, out, executor=InlineExecutor(), workers=default_workers() if workers is None else workers, strict=strict,
        overwrite=overwrite, compression=compression, shard_bytes=shard_bytes, records_per_shard=records_per_shard,
        progress=progress, naming=conv.naming, single=True, staging_dir=staging_dir,
    )


def _label(name: str, naming: OptionNaming) -> str:
    return "--shard-size" if naming == "cli" and name == "shard_bytes" else option_name(name, naming)


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
        class-folder root).
    out
        Output dataset directory, or an object-store URL (``s3://bucket/ds``, ``gs://``, ``az://``).
        An interrupted conversion there with the same parameters is resumed; a finished one is left alone.
    kind
        Corpus kind (``coco``, ``imagefolder``, ``cifar10``, ``cifar100``, ``audio`` or one added
        through the ``shardkit.converters`` entry points); detected when ``None``.
    workers
        Decode processes (default: the cores available); the output does not depend on it. A script
        without ``if __name__ == "__main__":`` works too (:mod:`shardkit.converters.main_guard`).
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
        Called as ``progress(inputs_done, inputs_total, records)`` after every input. ``None``: a
        progress bar when standard error is a terminal; ``True`` always, ``False`` never.
    naming
        How errors name options: ``"python"`` (``sample_rate``) or ``"cli"`` (``--sample-rate``).
    executor
        Any ``concurrent.futures.Executor`` (a process pool, ``dask.distributed.Client(...).get_executor()``):
        the corpus is converted in parts on it (same result); its workers must see ``src`` and ``out``
        at the same paths.
    scheduler
        Address of a Dask scheduler (``tcp://host:8786``): the parts run on that cluster (needs
        ``pip install "shardkit[dask]"``).
    append
        Add the corpus's records after those of the dataset at ``out`` (same kind, record, fields and
        transform, or refused naming the difference) as its next version; new class names extend the
        label list.
    part_size
        Inputs per part (default: about 64 parts, 1 to 16 shards each). Alone, it asks for a
        conversion in parts on this machine, ``workers`` processes each converting whole parts (same
        bytes; pays when parts are several shards each, see ``benchmarks/convert.py``).
    keep_versions
        Older versions a commit keeps openable (their replaced files); older ones are deleted.
    staging_dir
        For an object-store ``out``: where each shard is written before its upload (a private
        ``shardkit-upload-<uid>`` directory inside it; default: the system temporary directory).
    **options
        Kind options (``shardkit convert --help`` lists them): ``split``; images: ``size`` (``224``
        or ``"HxW"``), ``resize``, ``crop``, ``interpolation``, ``max_pixels``; COCO: ``max_boxes``,
        ``image_dir``; audio: ``sample_rate`` (``"16k"``), ``duration`` (``"1500ms"``), ``channels``,
        ``window``, ``dtype``.
    """
    run = ConversionOptions.parse(
        source=naming, workers=workers, strict=strict, overwrite=overwrite, compression=compression,
        shard_bytes=shard_bytes, records_per_shard=records_per_shard, progress=progress, executor=executor,
        scheduler=scheduler, append=append, part_size=part_size, keep_versions=keep_versions, staging_dir=staging_dir,
    )
    where: str | Path = src if isinstance(src, str) and is_url(src) else Path(src)
    kind = kind or detect_kind(where)
    conv = get_converter(kind)(where, naming=naming, **options)
    return run_conversion(conv, out, f"convert {kind}", naming=naming, **run.run_keywords())


def run_conversion(
    conv: Converter,
    out: str | os.PathLike[str],
    title: str,
    *,
    workers: int | None,
    strict: bool,
    overwrite: bool,
    compression: str | None,
    shard_bytes: int,
    records_per_shard: int | None,
    progress: ProgressFn | bool | None,
    naming: OptionNaming,
    executor: Executor | None,
    scheduler: str | None,
    append: bool,
    part_size: int | None,
    keep_versions: int,
    staging_dir: str | os.PathLike[str] | None,
) -> ConvertSummary:
    """Run ``conv`` (options already parsed) where :func:`convert`'s arguments say: in this process with
    ``workers`` decode processes, or in parts on local processes (each writing whole shards of its own),
    an executor or a Dask scheduler; the progress bar is titled ``title``. :func:`convert` and
    :func:`shardkit.converters.write.write` share it."""
    n_workers, n_part, nbytes, rps, keep = workers, part_size, shard_bytes, records_per_shard, keep_versions

    count = default_workers() if n_workers is None else n_workers

    def run(report: ProgressFn | None) -> ConvertSummary:
        def in_parts(ex: Executor | None, local: bool = False) -> ConvertSummary:
            return convert_in_parts(
                conv, out, executor=ex, append=append, part_size=n_part, workers=count, strict=strict,
                overwrite=overwrite, compression=compression, shard_bytes=nbytes, records_per_shard=rps,
                progress=report, keep_versions=keep, naming=naming, staging_dir=staging_dir, local=local,
            )

        if executor is None and scheduler is None and not append and n_part is None:
            return run_converter(
                conv, out, workers=n_workers, strict=strict, overwrite=overwrite, compression=compression,
                shard_bytes=nbytes, records_per_shard=rps, progress=report, staging_dir=staging_dir,
            )

        if scheduler is not None:
            if executor is not None:
                raise ConfigError(f"{_label('scheduler', naming)} and {_label('executor', naming)}: give one of them")
            with dask_executor(scheduler, naming=naming) as dask:
                return in_parts(dask)
        if executor is None and not append:  # only part_size given: the parts run on local processes
            with local_pool(count) as pool:
                return in_parts(pool, local=not isinstance(pool, InlineExecutor))
        return in_parts(executor)

    if callable(progress):
        return run(progress)
    with progress_bar(conv.progress_unit, title, disable=None if progress is None else not progress) as bar:
        return run(bar)
