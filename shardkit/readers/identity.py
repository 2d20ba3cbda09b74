"""Which dataset a sampler reads (the SHA-256 of its root ``zarr.json``), so it notices when the
dataset is replaced under it (docs/design.md §4, *Other duties*, dataset identity).

A process remembers the remote datasets it opened (:func:`remember`): a later sampler of the same
dataset (the next pass of a DataLoader worker) takes the identity and documents from there
(:func:`reopen`) and checks them with one HEAD of the root document that runs while its first block
is read, instead of about six requests in a row before it. A first open reads the root document with
one GET whose bytes give both the fingerprint and the metadata, and whose answer gives the ETag
(:func:`open_root`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.errors import SamplerError
from shardkit.formats.dataset import DatasetDocuments
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, DatasetMeta, parse_dataset_meta, read_dataset_meta
from shardkit.processes import renew_locks_after_fork
from shardkit.stores import Location, Store, StoreOptions, as_location, open_store

__all__ = ["DatasetIdentity", "dataset_fingerprint", "forget", "open_root", "remember", "remembered", "reopen", "ROOT_DOCUMENT",
           "REMOTE_CHECK_SECONDS"]

#: Least time between two identity checks of a dataset in an object store (docs/design.md §4, dataset identity).
REMOTE_CHECK_SECONDS = 2.0

#: The dataset's root document (the zarr group metadata with shardkit's attributes).
ROOT_DOCUMENT = "zarr.json"

#: A local root document changed less than this long (ns) before it was last read is read again at
#: the next check even if its ``stat`` looks the same: file times are coarse (a clock tick), so a
#: same-size rewrite in the same tick would keep them (the "racy" case).
RACY_NS = 2_000_000_000

#: What ``stat`` says of a local root document: the directory entry's inode, the file's inode,
#: size, mtime and ctime (ns). Equal values mean the same file, unchanged since it was hashed.
_StatKey = tuple[int, int, int, int, int]


def _stat_key(root: Path) -> _StatKey | None:
    """The :data:`_StatKey` of ``root``'s root document, ``None`` when it cannot be stat-ed."""
    path = os.path.join(root, ROOT_DOCUMENT)
    try:
        entry, st = os.lstat(path), os.stat(path)
    except OSError:
        return None
    return entry.st_ino, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def dataset_fingerprint(path: Location) -> str:
    """SHA-256 (hex) of the dataset's root ``zarr.json``; ``FileNotFoundError`` if it has none."""
    return _fingerprint_and_tag(path)[0]


def _fingerprint_and_tag(path: Location, options: StoreOptions | None = None) -> tuple[str, str | None, int]:
    """The root document's fingerprint, ETag (remote) and size, from one read."""
    data, tag = _read_root(open_store(path, options))
    return hashlib.sha256(data).hexdigest(), tag, len(data)


def _read_root(store: Store) -> tuple[bytes, str | None]:
    """The root document's bytes and, in an object store, their ETag (one GET)."""
    return store.get_tagged(ROOT_DOCUMENT, max_nbytes=MAX_DOCUMENT_NBYTES)


@dataclass
class _CheckState:
    """What a :class:`DatasetIdentity` learns as it checks its dataset."""

    #: When a remote check last succeeded (monotonic seconds).
    checked: float = field(default_factory=time.monotonic)
    #: A local root document's stat when its content last matched the fingerprint (``None``: read it
    #: at the next check). A sampler checks every dataset of its mixture after every block read.
    stat: _StatKey | None = None
    #: A check under way in the background (:meth:`DatasetIdentity.reopened`); the next waiting
    #: :meth:`DatasetIdentity.check` takes its outcome.
    ahead: Future[None] | None = None
    #: Wakes a delayed check under way (:meth:`DatasetIdentity._start_ahead`) once it is cancelled.
    wake: threading.Event | None = None
    #: When the latest read began (the last ``check(wait=False)``): a success since then covers it.
    read_began: float = float("inf")


@dataclass(frozen=True)
class DatasetIdentity:
    """A dataset location and the fingerprint (and, in an object store, the ETag of the root
    document) it had when a sampler opened it."""

    path: Path | str
    fingerprint: str
    etag: str | None = None
    #: How an object store is asked (the sampler's retry budget and timeouts).
    options: StoreOptions | None = None
    #: Bytes of the root document (what remembering its documents costs, :func:`remember`).
    nbytes: int = field(default=0, compare=False)
    #: What changes as the dataset is checked (mutable inside the frozen value).
    _live: _CheckState = field(default_factory=_CheckState, compare=False, repr=False)

    @classmethod
    def of(cls, path: Location, options: StoreOptions | None = None) -> DatasetIdentity:
        """The identity ``path`` has now."""
        where = as_location(path)
        before = _stat_key(where) if isinstance(where, Path) else None  # before the read: a change after it is seen
        try:
            fingerprint, tag, nbytes = _fingerprint_and_tag(where, options)
        except FileNotFoundError:
            raise SamplerError(f"{where}: expected a shardkit dataset, found no {ROOT_DOCUMENT}") from None
        identity = cls(where, fingerprint, tag, options, nbytes)
        identity._remember(before)
        return identity

    def fresh(self) -> bool:
        """Whether a remote check (or the read that made this identity) succeeded so lately that the
        next :meth:`check` would not ask the store again."""
        return self._recent()

    def copied(self, options: StoreOptions | None = None) -> DatasetIdentity:
        """This identity for a new reader (asked with ``options``), as recently checked as this one."""
        copy = DatasetIdentity(self.path, self.fingerprint, self.etag, options if options is not None else self.options,
                               self.nbytes)
        copy._live.checked = self._live.checked
        return copy

    def _remember(self, key: _StatKey | None) -> None:
        """Skip reading the local root document while its stat stays ``key`` (unless ``key`` is racy)."""
        racy = key is None or max(key[3], key[4]) + RACY_NS >= time.time_ns()
        self._live.stat = None if racy else key

    def _unchanged(self) -> tuple[bool, _StatKey | None]:
        """``(stat as remembered, the stat now)`` of a local dataset's root document."""
        if not isinstance(self.path, Path):
            return False, None
        now = _stat_key(self.path)
        return now is not None and now == self._live.stat, now

    def reopened(self, options: StoreOptions | None = None) -> DatasetIdentity:
        """This identity for a new reader of the same remote dataset (asked with ``options``), its
        check (a HEAD of the root document) started now in a thread: the reader's first requests
        need not wait for it, but its first waiting :meth:`check` does, so nothing it read is used
        before the dataset is known to be unchanged."""
        fresh = DatasetIdentity(self.path, self.fingerprint, self.etag, options if options is not None else self.options,
                                self.nbytes)
        fresh._live.checked = float("-inf")  # never checked by this reader: its first waiting check waits
        fresh._start_ahead()
        return fresh

    def _start_ahead(self, delay: float = 0.0) -> None:
        """Start a remote check in a thread, after ``delay`` seconds unless a waiting :meth:`check`
        cancels it first (the read it was for ended sooner); the next :meth:`check` that needs it
        takes its outcome."""
        ahead: Future[None] = Future()
        woken = threading.Event()
        self._live.ahead, self._live.wake = ahead, woken if delay > 0 else None

        def run() -> None:
            if delay > 0:
                woken.wait(delay)
            if not ahead.set_running_or_notify_cancel():
                return  # cancelled: the read it was for ended before it was due
            try:
                self._check_now()
            except BaseException as exc:
                forget(self.path)  # the next reader opens the dataset as it is now
                ahead.set_exception(exc)
            else:
                ahead.set_result(None)

        threading.Thread(target=run, name="shardkit-identity-check", daemon=True).start()

    def _recent(self) -> bool:
        """Whether a remote check succeeded less than :data:`REMOTE_CHECK_SECONDS` ago."""
        return self.etag is not None and time.monotonic() - self._live.checked < REMOTE_CHECK_SECONDS

    def check(self, *, wait: bool = True) -> None:
        """Raise :class:`~shardkit.errors.SamplerError` unless the dataset is still the one opened; an
        object store is asked at most every :data:`REMOTE_CHECK_SECONDS`.

        ``wait=False`` is for before a read: a remote check that is due, or half due, is started in
        a thread instead of asked for here (else it starts once half due, should the read last that
        long), and one under way is left running. The waiting check after
        the read takes its outcome, and waits for it only when the last success is too old to cover
        the read, and not at all when a check succeeded since the read began; so a reader's round
        trip to the store overlaps its reading instead of stalling it (a warm epoch from the local
        cache reads a block in less than a round trip)."""
        if not wait:
            self._live.read_began = time.monotonic()
        ahead = self._live.ahead
        if ahead is not None and wait and self._cancel_delayed(ahead):  # not due yet: the read ended first
            ahead = None
        if ahead is not None:
            if not ahead.done() and (not wait or self._recent()):
                return  # under way, and the last success covers what was read so far
            ahead.result()  # waits for it; raises what the check raised, at every call
            if self._live.ahead is ahead:
                self._live.ahead = None
            if wait:
                return
        if self.etag is None:  # a local check is a stat, no round trip to overlap
            self._check_now()
            return
        age = time.monotonic() - self._live.checked
        if not wait:  # due or half due: now; else once half due, should the read last that long
            self._start_ahead(max(0.0, REMOTE_CHECK_SECONDS / 2 - age))
        elif age >= REMOTE_CHECK_SECONDS and self._live.checked < self._live.read_began:  # none since the read began
            self._check_now()

    def cancel(self) -> None:
        """Give up a delayed check that has not started (its reader is closing: nothing will take
        its outcome, and it would ask the store after the run ended); one under way runs out."""
        ahead = self._live.ahead
        if ahead is not None:
            self._cancel_delayed(ahead)

    def _cancel_delayed(self, ahead: Future[None]) -> bool:
        """Cancel ``ahead`` if it is a delayed check that has not started; whether it was."""
        wake = self._live.wake
        if wake is None or self._live.ahead is not ahead or not ahead.cancel():
            return False
        wake.set()
        self._live.ahead = self._live.wake = None
        return True

    def settle(self) -> None:
        """Wait for a check under way (:meth:`reopened`, or started by :meth:`check` before a read)
        and raise what it raised; nothing if none is. A check still running while an earlier one
        succeeded less than :data:`REMOTE_CHECK_SECONDS` ago is not waited for: that success covers
        what was read (a cold first block that outlasts half the pause starts the next check,
        whose round trip would otherwise delay the first batch). The outcome stays for the
        reader's next :meth:`check`, which takes it instead of asking again."""
        ahead = self._live.ahead
        if ahead is not None and not self._cancel_delayed(ahead) and not ahead.cancelled():
            if ahead.done() or not self._recent():
                ahead.result()  # raises what the check raised, at every waiting call

    def _check_now(self) -> None:
        """:meth:`check` without the pause between remote checks."""
        same, stat_now = self._unchanged() if self.etag is None else (False, None)
        if same:
            return
        try:
            if self.etag is not None and open_store(self.path, self.options).head(ROOT_DOCUMENT).etag == self.etag:
                self._live.checked = time.monotonic()
                return
            now = _fingerprint_and_tag(self.path, self.options)[0]
        except FileNotFoundError:
            raise SamplerError(
                f"{self.path}: the dataset this sampler reads was removed or is being rewritten (its "
                f"{ROOT_DOCUMENT} is gone); create a new sampler once the new dataset is complete"
            ) from None
        if now != self.fingerprint:
            raise SamplerError(
                f"{self.path}: the dataset was replaced while this sampler was reading it (its {ROOT_DOCUMENT} "
                f"changed, e.g. by convert --overwrite); its records no longer match the fields loaded "
                f"when the sampler was created, so it stops here; create a new sampler to read the new dataset"
            )
        if self.etag is None:
            self._remember(stat_now)


#: Remote datasets this process opened lately, by location: their identity, documents and the store
#: location the documents are filed under (:class:`~shardkit.formats.Dataset`'s ``opened``).
_OPENED: OrderedDict[str, tuple[DatasetIdentity, DatasetDocuments, str]] = OrderedDict()
_OPENED_LOCK = threading.Lock()
#: Datasets remembered at most, and the most bytes of their documents as stored (two root documents
#: of the largest size allowed and their array documents): the least recently opened are forgotten
#: first, the latest is always kept.
MAX_REMEMBERED = 32
MAX_REMEMBERED_NBYTES = 2 * MAX_DOCUMENT_NBYTES + (1 << 20)

# A child forked while another thread held the lock gets a free one (the entries stay valid).
renew_locks_after_fork(sys.modules[__name__], "_OPENED_LOCK")


def _cost(identity: DatasetIdentity, documents: DatasetDocuments) -> int:
    """Bytes of the documents kept for a dataset: its root document, the payload array's and the fields given with them."""
    array = 0 if documents.payload_document is None else len(json.dumps(documents.payload_document))
    return identity.nbytes + array + sum(f.nbytes for f in (documents.fields or {}).values())


def remember(identity: DatasetIdentity, documents: DatasetDocuments | None, location: str) -> None:
    """Keep a remote dataset's identity and the documents it was opened from (read while the root
    document was the identity's) for later readers of this process; a local one is not kept, and
    only the root document (``payload_document=None``) never replaces all of them for the same version."""
    if identity.etag is None or documents is None:
        return
    key = str(identity.path)
    with _OPENED_LOCK:
        known = _OPENED.get(key)
        if (known is not None and documents.payload_document is None and known[1].payload_document is not None
                and known[0].fingerprint == identity.fingerprint):
            _OPENED.move_to_end(key)
            return
        _OPENED[key] = (identity, documents, location)
        _OPENED.move_to_end(key)
        total = sum(_cost(i, d) for i, d, _ in _OPENED.values())
        while len(_OPENED) > 1 and (len(_OPENED) > MAX_REMEMBERED or total > MAX_REMEMBERED_NBYTES):
            _, (old, docs, _) = _OPENED.popitem(last=False)
            total -= _cost(old, docs)


def remembered(path: Location) -> tuple[DatasetIdentity, DatasetDocuments, str] | None:
    """What :func:`remember` keeps of ``path`` (identity, documents, store location), or ``None``."""
    with _OPENED_LOCK:
        return _OPENED.get(str(as_location(path)))


def forget(path: Location) -> None:
    """Drop what :func:`remember` kept of ``path`` (its check failed: it changed or is unreachable)."""
    with _OPENED_LOCK:
        _OPENED.pop(str(as_location(path)), None)


def reopen(
    path: Location, options: StoreOptions | None = None, *, expected: str | None = None
) -> tuple[DatasetIdentity, Mapping[str, DatasetDocuments]]:
    """The identity of ``path`` for a new reader and the documents to open it from (``Dataset``'s
    ``opened``): for a remote dataset :func:`remember`-ed with the fingerprint ``expected`` (any,
    when ``None``), its identity :meth:`~DatasetIdentity.reopened` (checked in the background) and
    its documents; else :meth:`DatasetIdentity.of` and none."""
    where = as_location(path)
    if isinstance(where, Path):
        return DatasetIdentity.of(where, options), {}
    with _OPENED_LOCK:
        known = _OPENED.get(where)
    if known is None or (expected is not None and known[0].fingerprint != expected):
        identity, meta, location = _open_remote(where, options, explain=False)
        return identity, {location: DatasetDocuments(meta, None)}
    identity, documents, location = known
    if documents.payload_document is None and identity.fresh():  # the root was read moments ago
        return identity.copied(options), {location: documents}
    return identity.reopened(options), {location: documents}


def open_root(path: Location, options: StoreOptions | None = None) -> tuple[DatasetIdentity, DatasetMeta]:
    """The identity and metadata of the dataset at ``path``, both from the same bytes of its root
    document: in an object store one GET (remembered for this process's readers, :func:`reopen`), a
    local one read twice with its fingerprint compared. A missing dataset raises what
    :func:`~shardkit.formats.metadata.read_dataset_meta` says of it."""
    where = as_location(path)
    if isinstance(where, str):
        identity, meta, _ = _open_remote(where, options, explain=True)
        return identity, meta
    store = open_store(where, options)
    try:
        identity = DatasetIdentity.of(where, options)
    except SamplerError:
        read_dataset_meta(store)  # says what is there instead (an interrupted conversion, nothing)
        raise
    meta = read_dataset_meta(store)
    if dataset_fingerprint(where) != identity.fingerprint:
        raise SamplerError(f"{where}: the dataset changed while its metadata was read; try again once it is complete")
    return identity, meta


def _open_remote(url: str, options: StoreOptions | None, *, explain: bool) -> tuple[DatasetIdentity, DatasetMeta, str]:
    """:func:`open_root` of a dataset in an object store, and the store location it is filed under;
    no root document: what is there instead (``explain``) or a :class:`SamplerError` as :meth:`DatasetIdentity.of`."""
    store = open_store(url, options)
    try:
        data, tag = _read_root(store)
    except FileNotFoundError:
        if explain:
            read_dataset_meta(store)  # says what is there instead (an interrupted upload, nothing)
            raise
        raise SamplerError(f"{url}: expected a shardkit dataset, found no {ROOT_DOCUMENT}") from None
    meta = parse_dataset_meta(data, store.describe(ROOT_DOCUMENT))
    identity = DatasetIdentity(url, hashlib.sha256(data).hexdigest(), tag, options, len(data))
    remember(identity, DatasetDocuments(meta, None), store.location)
    return identity, meta, store.location
