"""A conversion in parts: plan, run the parts on an executor, commit (docs/design.md §11).

:func:`convert_in_parts` is what ``convert(..., executor=...)``, ``--scheduler`` and ``--append`` run:

1. scan the corpus (here, once) and, for ``append``, check that the new records fit the dataset
   (kind, record, fields, transform, compression, records per shard, kind metadata): a mismatch is
   refused before anything is written, naming the difference;
2. cut the input sequence into a :class:`~shardkit.converters.parts.PartPlan`; the plan's id is a
   hash of everything that shapes the output (and, for ``append``, of the version it appends to), so
   a re-run of the same command finds the same plan directory and every part finished there;
3. run the parts (:class:`_Runner`): each part is counted into a spill and written at its offset,
   or written directly when its offset is already known; at most as many tasks are in flight as the
   executor runs at once, parts that can be written first;
4. commit (:func:`shardkit.formats.commit.commit`): records numbered in input order across parts,
   boundary shards re-packed, fields and skips concatenated, label names extended, metadata last;
   then the plan directory is removed.

A re-run after a kill at any instant finishes the job without converting a finished part again:
manifests are written last, and the commit is idempotent.

One at a time
    On a local (or shared) file system the run holds an exclusive ``flock`` on the output directory
    from before it looks for another unfinished conversion until its commit and cleanup are done
    (:class:`_OutputLock`): a second conversion or append into the same dataset is refused at once,
    before it writes anything. An object store has no such lock; there an append's parts write only
    in its own plan directory (``staged``, :mod:`shardkit.converters.parts`), and the commit checks
    the dataset's version before it changes any of its files, so of two appends planned on one
    version the second is refused and removes its plan directory; the dataset is never mixed.
"""

from __future__ import annotations

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
from shardkit.converters.executors import InlineExecutor, is_inline, slots, submit
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
    dataset_config,
    dataset_fields,
    shard_layout,
    strict_stop,
    summary_of,
)
from shardkit.converters.staging import config_fingerprint
from shardkit.errors import ConversionError, ShardkitError, WorkerError
from shardkit.formats import DatasetMeta, FieldSpec, get_codec
from shardkit.formats.codecs import RecordCodec, codec_from_json
from shardkit.formats.commit import InputTable, Segment, commit
from shardkit.formats.metadata import DEFAULT_FIELD_CHUNK, encode_json, read_dataset_meta
from shardkit.formats.outputs import PARTS_DIR, STAGING_DIR, clear_store, top_names
from shardkit.formats.provenance import TABLE_ARRAYS, ProvenanceSpec
from shardkit.formats.publish import put_checked
from shardkit.formats.spec import ZARR_JSON, SkippedInput
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS, VERSIONS_DIR, prune, version_of
from shardkit.stores import Store, as_location, is_url, open_store

__all__ = ["convert_in_parts", "check_appendable"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the parts' progress files.
_POLL = 0.5


def check_appendable(base: DatasetMeta, conv: Converter, codec: RecordCodec | None, records_per_shard: int | None,
                     where: str) -> None:
    """Refuse to append ``conv``'s records to the dataset ``base`` unless they are the same kind of records.

    Raises
    ------
    ConversionError
        Naming the first difference: kind, payload, record shape or dtype, fields, transform, kind
        metadata, compression or records per shard (the last two only when given explicitly).
    """
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
                f"{where}: cannot append {conv.src}: its {what} {_show(new)} differs from the dataset's {_show(have)}; "
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
               records_per_shard: int | None, codec: RecordCodec | None, part_size: int | None) -> _Plan:
    n = len(scan.items)
    if base is not None:
        rps, size = base.records_per_shard, None
        codec = None if base.compression is None else codec_from_json(base.compression)
    else:
        rps, size = shard_layout(conv, n, shard_bytes, records_per_shard)
    provenance = conv.provenance_spec(scan)
    fields = dataset_fields(conv, provenance)
    config = dataset_config(conv, scan, fields, provenance, rps, size, codec)
    ranges = PartPlan(n, part_size or default_part_size(n, rps)).ranges()
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


class _OutputLock:
    """An exclusive ``flock`` on a local output directory, held by one conversion in parts or append.

    Taken before the run reads the dataset and looks for another unfinished conversion, released
    after its commit and cleanup: the check and the writing of the plan are one step for every
    process that honours the lock (any process of this machine, and of a shared file system with
    working locks). The lock goes with its holder, so a killed run never blocks the next one.
    Object stores have none (see the module docstring).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (once; nothing to take for an object store or a directory not made yet).

        Raises
        ------
        ConversionError
            Another run holds it.
        """
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

    def release(self) -> None:
        """Let go of the lock (explicitly: worker processes forked meanwhile share it until they exit)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _claim(plan: _Plan, lock: _OutputLock, *, overwrite: bool) -> bool:
    """Make the plan directory, holding ``lock``; returns whether the output directory was created by this run.

    Raises
    ------
    ConversionError
        The output holds something else: files that are not a shardkit output, a dataset (for a new
        conversion, without ``overwrite``), another unfinished conversion.
    """
    store, where = plan.store, plan.store.url
    local = store.local_path() if store.is_local else None
    created = local is not None and not local.exists()
    if plan.base is None:
        if overwrite:
            clear_store(store)
        elif store.exists(ZARR_JSON):
            raise ConversionError(f"{where}: a dataset already exists here; use --overwrite to replace it, "
                                  "or --append to add these records to it")
        if local is not None and local.exists() and not local.is_dir():
            raise ConversionError(f"{where}: output exists and is not a directory")
        if local is not None and (local / STAGING_DIR).exists():
            raise ConversionError(f"{where}: an interrupted conversion (one process, {STAGING_DIR}) is here; re-run it "
                                  "the same way to resume it, or use --overwrite to start fresh")
        # What this conversion writes before its root document (a commit cut short leaves them).
        foreign = top_names(store, (PARTS_DIR, VERSIONS_DIR, plan.conv.payload, *plan.fields, *TABLE_ARRAYS,
                                    f"{ZARR_JSON}.partial"))
        if foreign:
            raise ConversionError(f"{where}: the output is not empty and is not a shardkit dataset (found "
                                  f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose another one")
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    lock.acquire()  # held from here: no other run can claim the output between this check and the plan
    others = sorted({m.key.split("/")[1] for m in store.list(PARTS_DIR) if m.key.count("/") >= 2} - {plan.id})
    if others:
        there = store.describe(f"{PARTS_DIR}/{others[0]}")
        raise ConversionError(
            f"{where}: an interrupted conversion or append with other parameters is in {there}; re-run that "
            f"command to finish it, or delete {there} to discard it (the dataset itself is unchanged)"
        )
    doc = {"operation": plan.operation, "fingerprint": plan.fingerprint, "ranges": plan.ranges,
           "base_version": None if plan.base is None else version_of(plan.base.to_json())}
    put_checked(store, f"{plan.dir}/plan.json", encode_json(doc))
    if local is not None:
        (local / plan.dir / "progress").mkdir(parents=True, exist_ok=True)
    return created


class _Runner:
    """Run every part of a plan on an executor (see the module docstring): counting, writing, progress."""

    def __init__(self, plan: _Plan, executor: Executor, *, workers: int, strict: bool, progress: ProgressFn | None) -> None:
        self.plan = plan
        self.executor = executor
        self.inline = is_inline(executor)
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

    def job(self, part: int) -> PartJob:
        conv, (a, b) = self.plan.conv, self.plan.ranges[part]
        items = self.plan.scan.items
        own: ProgressFn | None = None
        if self.inline:
            def own(done: int, total: int, records: int) -> None:
                self.seen[part] = (done, records)
                self.report()
        return PartJob(
            plan=self.plan.id, part=part, first=a, items=[items[i] for i in range(a, b)], decoder=conv.decoder,
            src=str(conv.src), out=self.plan.out, payload=conv.payload, record=conv.record_spec(),
            fields=self.plan.fields, records_per_shard=self.plan.records_per_shard,
            compression=None if self.plan.codec is None else self.plan.codec.to_json(),
            provenance=(conv.name, conv.provenance_columns),
            chunk_size=conv.chunk_size, workers=self.workers, strict=self.strict, staged=self.plan.base is not None,
            progress=own,
        )

    def offset(self, part: int) -> int | None:
        """Global number of the part's first record, once every part before it is counted."""
        total = self.base_records
        for q in range(part):
            if q not in self.counts:
                return None
            total += self.counts[q]
        return total

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
        converted again gave another count: decoding changed under a resumed plan). They are redone."""
        wrong = [p for p, m in self.done.items() if self.offset(p) not in (None, m.offset)]
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
                return ("write" if self.offset(p) is not None else "count"), p
        return None

    def submit(self, kind: str, part: int) -> None:
        job = self.job(part)
        if kind == "count":
            future: Future[Any] = submit(self.executor, count_part, job)
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
            self.records_converted += result.records

    def report(self, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if not force and now - self._last_poll < _POLL:
            return
        self._last_poll = now
        if not self.inline:
            for p in range(len(self.plan.ranges)):
                if p not in self.done:
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
        source={**conv.source(), "config_fingerprint": plan.fingerprint}, extra=conv.extra(),
        created_by=f"shardkit {__version__}", provenance={"columns": list(plan.provenance.columns)},
    )


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
) -> ConvertSummary:
    """Convert ``conv``'s corpus in parts on ``executor`` (inline when ``None``) and commit them at ``out``.

    See :func:`shardkit.converters.convert` for the parameters; with ``append`` the records are added
    after the dataset's at ``out`` as its next version.
    """
    refuse_inside_worker_start()
    t0 = time.perf_counter()
    store = open_store(as_location(out, resolve=False) if is_url(out) else Path(os.path.abspath(out)))
    if store.read_only:
        raise ConversionError(f"{store.url}: cannot convert into a read-only store (http(s):// URLs are read-only)")
    output: Path | str = store.local_path() if store.is_local else store.url
    codec = get_codec(compression)
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
        plan = _make_plan(conv, scan, store, base, shard_bytes=shard_bytes, records_per_shard=records_per_shard,
                          codec=codec, part_size=part_size)
        if not overwrite and (done := _already_done(plan)) is not None:
            logger.info("%s: already holds this %s", store.url, plan.operation)
            committed = done.source.get("plan")
            if isinstance(committed, str) and committed.isalnum():  # a run killed after its commit, before its cleanup
                _cleanup(store, committed, keep_versions)
            return summary_of(output, done, time.perf_counter() - t0, already_complete=True,
                              version=version_of(done.to_json()), parts=len(plan.ranges))
        created = _claim(plan, lock, overwrite=overwrite)
        executor = executor or InlineExecutor()
        runner = _Runner(plan, executor, workers=workers, strict=strict, progress=progress)
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
                            keep_versions=keep_versions, executor=None if is_inline(executor) else executor,
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
                             notes=dict(sorted(notes.items())), version=report.version, parts=len(plan.ranges),
                             parts_converted=runner.converted, commit=report, **this_run)
        logger.info("%s: version %d, %d records (%d parts, %d converted now), %.1f s", store.url, report.version,
                    summary.records, summary.parts, runner.converted, summary.seconds)
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
