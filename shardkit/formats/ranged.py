"""Reading payload shards from an object store: coalesced byte ranges, many requests in flight.

Blocks are planned exactly like the local reader's and their runs fetched concurrently, every
response and each shard's identity checked before its records are served; with a local cache, shards
downloaded in parts are read from their local copies as soon as their pages land. The checks and
the reasons: docs/design.md §9.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from shardkit.errors import ConfigError, MissingShardError, ObjectChangedError, ShardkitError, TruncatedShardError
from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.checksums import FileDigest, fd_crc32c
from shardkit.formats.decode_threads import DecodeJob, finish_decodes, wait_decodes
from shardkit.formats.index import ShardIndex
from shardkit.formats.reader import (
    DEFAULT_GAP_BYTES,
    PLAN_RECORDS,
    SCATTER_MIN_BYTES,
    Destination,
    PayloadArray,
    ReadStats,
    SortedRequest,
    _Plan,
    _Rows,
    _Run,
    preadv_exact,
)
from shardkit.formats.spec import ZARR_JSON, ShardInfo, index_nbytes
from shardkit.formats.versions import older_copy, read_document
from shardkit.stores import ByteRange, Fetched, Store, prefetch
from shardkit.stores.cache import LAST_PRIORITY, PAGE_BYTES, ShardCache, map_pages
from shardkit.stores.prefetch import Delivery, PartialCopy, PrefetchItem, ShardPrefetcher, demand_gap_pages, grid_cell

__all__ = ["RangedPayloadArray", "DEFAULT_REMOTE_GAP_BYTES"]

#: Gaps up to this many bytes between wanted records of a remote shard are read rather than
#: requested separately. 0: a sparse block read by range fetches only its records (a gap is paid
#: for on every epoch's bill; adjacent records still share a request). Why: docs/design.md §9.
DEFAULT_REMOTE_GAP_BYTES = 0

#: Without a cache, the next block's first requests are started while the current block's last
#: ones are still in flight (its plan is known from the order), at most this many bytes of them,
#: and at most ``StoreOptions.concurrency`` requests: enough to keep every slot busy across the
#: switch, held in memory until that block is read (docs/design.md §9).
READAHEAD_BYTES = 32 << 20

#: With a cache, a block's records of a shard being downloaded are read from its partial copy once
#: their pages are local (asked for first), never fetched by range a second time (docs/design.md §9).
_RESOLVE_ATTEMPTS = 10


class RangedPayloadArray(PayloadArray):
    """The payload array ``array`` of the dataset at the root of ``store`` (docs/design.md §9).

    As :class:`~shardkit.formats.reader.PayloadArray`, with ``stats`` counting one ``read_calls`` per
    request. With a ``cache`` (a :class:`~shardkit.stores.cache.ShardCache` of this version), shards
    are downloaded in parts in the background, the pages a block needs first; records are read
    from the copy as soon as their pages are local (from verified complete copies later), counted
    in ``cache_stats``. ``document``: the array's ``zarr.json`` as another reader of the same
    version already read and checked it (no request then).
    """

    def __init__(
        self,
        store: Store,
        array: str,
        *,
        shards: list[ShardInfo],
        stats: ReadStats | None = None,
        gap_bytes: int = DEFAULT_REMOTE_GAP_BYTES,
        document_digest: FileDigest | None = None,
        cache: ShardCache | None = None,
        cache_stats: ReadStats | None = None,
        document: dict[str, Any] | None = None,
        checked_tails: Mapping[int, str] | None = None,
        ask_priority: int = 0,
        fillers: int = 1,
    ) -> None:
        self.store = store
        self.cache = cache
        self.cache_stats = cache_stats if cache_stats is not None else ReadStats()
        self.path = store.describe(array)
        doc_key = f"{array}/{ZARR_JSON}"
        if document is None:
            try:
                document = read_document(store, doc_key, document_digest)
            except MissingShardError:
                raise MissingShardError(f"{store.describe(doc_key)}: the payload array document is missing") from None
        #: The payload array's document as read (a reader of the same dataset version reuses it).
        self.document: dict[str, Any] = document
        doc = document
        checked = self._init_layout(doc, store.describe(doc_key), array, shards)
        self._init_state(checked, stats, DEFAULT_GAP_BYTES)
        self.gap_bytes = int(gap_bytes)
        self._scratch = np.empty(max(self.gap_bytes, 1), dtype=np.uint8)  # a run's gaps, read from a cache copy
        self._etags: dict[int, str | None] = {}
        #: Shards a newer version of the dataset replaced: read from the copy kept for this version.
        self._keys: dict[int, str] = {}
        self._pending_index: dict[int, bytes] = {}
        #: Shards whose tail_crc32c was checked (with the index, or by _check_tails).
        self._tails_checked: set[int] = set()
        for i, etag in (checked_tails or {}).items():  # checked by another reader, its ETag pinned here
            if 0 <= i < len(self.shards) and etag:
                self._etags[i] = etag
                self._tails_checked.add(i)
        self.prefetcher: ShardPrefetcher | None = None
        #: Blocks read so far: the first asks for its records' pages, later ones for whole parts.
        self._blocks_read = 0
        #: The priority of the first block's asks to a copy's filler (0 first; later blocks ask at
        #: ``LAST_PRIORITY``): this reader's turn among the node's consumers, so that a filler serves
        #: the block the first batch waits for before its siblings' (docs/design.md §9, *Shard cache*).
        self.ask_priority = min(max(int(ask_priority), 0), LAST_PRIORITY - 1)
        #: The processes that fill the cache together, each with its share of the background parts.
        self.fillers = max(1, int(fillers))
        #: The keys :meth:`read_ahead` announced for the next read, and that read's first requests
        #: once started (no cache only).
        self._next_keys: np.ndarray | None = None
        self._ahead: _Ahead | None = None
        #: Blocks opened ahead (:meth:`deliver_ahead`): each destination, its runs' deliveries and
        #: the block's plan when it covers the whole block (its read uses it: planned once).
        self._opened_ahead: list[tuple[Destination, dict[tuple[int, int, int], _Registered], _Planned | None]] = []
        #: The deliveries of the read under way that a :meth:`deliver_ahead` registered.
        self._taking: dict[tuple[int, int, int], _Registered] = {}
        #: The plan :meth:`deliver_ahead` made for the read under way (taken by :meth:`_plan`).
        self._planned: _Planned | None = None

    # ------------------------------------------------------------------ files and indexes
    def shard_path(self, i: int) -> NoReturn:
        raise ConfigError(f"{self.shard_location(i)}: a shard in an object store has no local path")

    def shard_location(self, i: int) -> str:
        return self.store.describe(self.shards[i].path)

    def _fd(self, i: int) -> int:
        return -1  # no file descriptors: every read is a request

    def _data_nbytes(self, i: int) -> int:
        return self.shards[i].nbytes - index_nbytes(self.records_per_shard)

    def _tail_nbytes(self, i: int) -> int:
        """The tail read with the index when it is fetched; 0 when the metadata fixes the index (then
        :meth:`_check_tails` fetches the tail alone before the first ranged read of the shard)."""
        if self._known_index(i) is not None:
            return 0
        return super()._tail_nbytes(i)

    def _check_tail(self, i: int, sample: bytes) -> None:
        super()._check_tail(i, sample)
        self._tails_checked.add(i)

    def _check_tails(self, shards: set[int]) -> None:
        """Check the ``tail_crc32c`` of every shard of ``shards`` not checked yet, before any of its
        records is fetched by range (one concurrent round trip, once per reader)."""
        todo = [i for i in sorted(shards) if i not in self._tails_checked and PayloadArray._tail_nbytes(self, i)]
        asks = [ByteRange(self._key(i), self._data_nbytes(i) - PayloadArray._tail_nbytes(self, i), self._data_nbytes(i),
                          self._etags.get(i)) for i in todo]  # fmt: skip
        for i, got in self._fetched(todo, asks):
            self._check_tail(i, bytes(got.data))

    def check_tails(self) -> dict[int, str]:
        """Check every shard's ``tail_crc32c`` now (one concurrent round trip) and return the shards
        checked with the ETag each response carried, for ``checked_tails`` of another reader of the
        same version: that reader pins those ETags (``If-Match`` on every later request of the shard),
        so the bytes it reads are those of the object checked here, and it asks for no tail pages
        before its first block (docs/design.md §6, worker start). A shard whose response carried no
        ETag is left out (the other reader checks it itself)."""
        self._check_tails(set(range(len(self.shards))))
        return {i: etag for i in sorted(self._tails_checked) if (etag := self._etags.get(i)) is not None}

    def _fetched(self, shards: list[int], asks: list[ByteRange]) -> Iterator[tuple[int, Fetched]]:
        """The responses to ``asks`` (``asks[k]`` reads shard ``shards[k]``), each checked and counted."""
        if asks:
            yield from self._checked(shards, asks, self.store.fetch(asks))

    def _known_index(self, i: int) -> bytes | None:
        """The index bytes of uncompressed shard ``i`` when the metadata fixes them: the dense
        layout's index, if its crc32c is the one recorded (the file's index must be exactly that)."""
        info = self.shards[i]
        if self.codec is not None or info.index_crc32c is None:
            return None
        dense = self._dense_index_bytes(info.count)  # built once per record count, not per call
        return dense if int.from_bytes(dense[-4:], "little") == info.index_crc32c else None

    def stored_index(self, i: int) -> ShardIndex:
        """The index bytes actually stored at the end of shard ``i``, fetched and checked (even when
        :meth:`index` can compute them), with the shard's tail in the same request, checked too."""
        info = self.shards[i]
        tail = PayloadArray._tail_nbytes(self, i)
        raw, size = self._fetch_index(i, info.nbytes - index_nbytes(self.records_per_shard) - tail)
        idx = self._decode_index(i, raw, size)  # checks the tail when the index is not known
        if tail and i not in self._tails_checked:
            self._check_tail(i, raw[:tail])
        return idx

    def _fetch_index(self, i: int, start: int) -> tuple[bytes, int]:
        info = self.shards[i]
        _, got = next(self._fetched([i], [ByteRange(self._key(i), start, info.nbytes, self._etags.get(i))]))
        return bytes(got.data), got.object_size

    def _index_bytes(self, i: int, isize: int) -> tuple[bytes, int]:
        """The shard's index: computed when the metadata fixes it, else prefetched or fetched."""
        info = self.shards[i]
        known = self._known_index(i)
        if known is not None:
            return known, info.nbytes
        pending = self._pending_index.pop(i, None)
        if pending is not None:
            return pending, info.nbytes
        return self._fetch_index(i, info.nbytes - isize - self._tail_nbytes(i))

    def _key(self, i: int) -> str:
        return self._keys.get(i, self.shards[i].path)

    def _check_response(self, i: int, got: Fetched, asked: ByteRange) -> None:
        """The object behind a response is the shard the metadata describes, in one version; when a
        newer version replaced it, :class:`_Replaced` asks the caller to read this version's kept copy."""
        info = self.shards[i]
        cause: ShardkitError | None = None
        try:
            self._pin(i, got.etag, asked.describe(self.shard_location(i)))
        except ObjectChangedError as exc:
            cause = exc
        if cause is None and got.object_size != info.nbytes:
            cause = TruncatedShardError(
                f"{self.shard_location(i)}: shard {i} (records {info.start}-{info.stop - 1}) should be {info.nbytes} "
                f"bytes, the store says {got.object_size}"
            )
        if cause is None:
            return
        if i in self._keys or info.crc32c is None:
            raise cause
        raise _Replaced(i, older_copy(self.store, info.path, info.nbytes, info.crc32c, cause))

    def _switch(self, replaced: _Replaced) -> None:
        """Read shard ``replaced.shard`` from the copy kept for this version from now on."""
        self._keys[replaced.shard] = replaced.key
        self._planned = None  # plans made ahead hold the older copy's offsets
        self._opened_ahead = [(d, registered, None) for d, registered, _ in self._opened_ahead]
        self._etags.pop(replaced.shard, None)
        self._indexes.pop(replaced.shard, None)
        self._pending_index.pop(replaced.shard, None)
        self._tails_checked.discard(replaced.shard)

    def index(self, i: int) -> ShardIndex:
        while True:
            try:
                return super().index(i)
            except _Replaced as moved:
                self._switch(moved)

    def _pin(self, i: int, etag: str | None, what: str) -> str | None:
        """Pin shard ``i``'s ETag at the first response that names one; a later response with
        another ETag is :class:`~shardkit.errors.ObjectChangedError`. Returns the pinned ETag."""
        pinned = self._etags.setdefault(i, etag) if etag is not None else self._etags.get(i)
        if pinned is not None and etag is not None and etag != pinned:
            raise ObjectChangedError(f"{what}: the shard changed while it was being read (ETag {pinned} became {etag})")
        return pinned

    def memmap(self, i: int) -> np.memmap:
        raise ConfigError(f"{self.shard_location(i)}: memmap needs a local shard file; read records with read()")

    # ------------------------------------------------------------------ reading
    def read_into(self, keys: np.ndarray | list[int], dest: Destination) -> None:
        """As :meth:`PayloadArray.read_into` (and so :meth:`~PayloadArray.read`); the indexes of every
        shard involved are fetched first, concurrently, so a block over many shards costs one round
        trip for them, not one each."""
        k = np.asarray(keys, dtype=np.int64).reshape(-1)
        if k.size > PLAN_RECORDS:
            self._next_keys = None  # read in several plans: the next read's requests would start too early
        if self.cache is not None and self.prefetcher is None and k.size and self._uncached(k):
            self.prefetcher = self._start_prefetch()
        self._taking, self._planned = self._take_opened(dest)
        try:
            while True:  # at most once more per shard a newer version replaced
                if self.prefetcher is not None:
                    self.prefetcher.raise_error()
                try:
                    if k.size and int(k.min()) >= 0 and int(k.max()) < self.num_records:
                        self._prefetch_indexes(distinct_sorted(k // self.records_per_shard).tolist())
                    super().read_into(k, dest)
                    self._blocks_read += 1
                    return
                except _Replaced as moved:
                    self._drop_ahead()
                    self._switch(moved)
                except BaseException:
                    self._drop_ahead()
                    raise
        finally:
            self._planned = None
            left, self._taking = self._taking, {}
            self._undeliver(reg.delivery for reg in left.values())  # not taken by the read: no copy after it

    def deliver_ahead(self, keys: np.ndarray, dest: Destination) -> bool:
        """``keys`` into ``dest`` is a later :meth:`read_into` (a block the pipeline opened ahead,
        docs/design.md §9): from now on this process's fetch threads copy those of its records
        whose bytes are all still to come into their rows as their chunks land, and that read
        takes the deliveries over (it reads back only the records not delivered). Nothing is
        asked for or fetched here. False when there is nothing to deliver into rows (no download
        under way, or records that are decoded or too small): the caller opens no block then."""
        pf = self.prefetcher
        if pf is None or self.codec is not None or self.record_nbytes < SCATTER_MIN_BYTES:
            return False
        if not any(pf.pending(i) for i in range(len(self.shards))):
            return False
        k = np.asarray(keys, dtype=np.int64).reshape(-1)
        if not k.size or k.size > PLAN_RECORDS or int(k.min()) < 0 or int(k.max()) >= self.num_records:
            return True
        # Planned as the read will plan it, over the shards whose index is at hand (no request here).
        at = np.flatnonzero(np.isin(k // self.records_per_shard,
                                    [i for i in range(len(self.shards)) if self._index_at_hand(i) and pf.pending(i)]))
        if not at.size:
            return True
        req = SortedRequest.of(k[at], self.num_records)
        rows = SortedRequest.byte_rows(dest)
        which, row = dest.rows_at(at[req.first])
        plan = super()._plan(req.distinct, which, row, rows)
        out = _Rows(rows, plan)
        registered: dict[tuple[int, int, int], _Registered] = {}
        copies: dict[int, PartialCopy | None] = {}
        try:
            for run in plan.as_runs(self.shard_location):
                if run.shard not in copies:
                    copies[run.shard] = pf.copy(run.shard)
                copy = copies[run.shard]
                delivery = self._deliver(copy, run, out) if copy is not None else None
                if delivery is not None:
                    registered[_run_id(run)] = _Registered(delivery, out.which[run.pos].copy(), out.row[run.pos].copy())
        except BaseException:
            self._undeliver(reg.delivery for reg in registered.values())
            raise
        finally:
            for c in copies.values():
                if c is not None:
                    c.close()
        if registered:
            whole = at.size == k.size  # the read plans these keys as this plan did: it takes this one
            self._opened_ahead.append((dest, registered, _Planned(req.distinct, which, row, plan) if whole else None))
        return True

    def _take_opened(self, dest: Destination) -> tuple[dict[tuple[int, int, int], _Registered], _Planned | None]:
        """The deliveries :meth:`deliver_ahead` registered for ``dest`` and the plan it made for
        the whole block, if it did (taken out of the list)."""
        for n, (d, registered, planned) in enumerate(self._opened_ahead):
            if d is dest:
                del self._opened_ahead[n]
                return registered, planned
        return {}, None

    def _plan(self, keys: np.ndarray, which: np.ndarray, row: np.ndarray, rows: list[np.ndarray]) -> _Plan:
        """As :meth:`PayloadArray._plan`, but a read of a block opened ahead takes the plan
        :meth:`deliver_ahead` made of the same keys into the same rows instead of planning again."""
        planned, self._planned = self._planned, None
        if planned is not None and planned.same(keys, which, row):
            return planned.plan
        return super()._plan(keys, which, row, rows)

    def _registered(self, run: _Run, rows: _Rows) -> _Registered | None:
        """The delivery registered ahead for exactly ``run`` into the same rows, taken (or None)."""
        reg = self._taking.pop(_run_id(run), None)
        if reg is None:
            return None
        if np.array_equal(reg.which, rows.which[run.pos]) and np.array_equal(reg.row, rows.row[run.pos]):
            return reg
        self._undeliver([reg.delivery])  # planned otherwise than announced: read as usual
        return None

    def _settle(self, run: _Run, reg: _Registered | None) -> list[_Run]:
        """``run``'s pieces still to read once its delivery registered ahead (if any) is taken back:
        no fetch thread copies into its rows after this (docs/design.md §9)."""
        if reg is None:
            return [run]
        self._undeliver([reg.delivery])
        return self._undelivered(run, reg.delivery)

    def _undeliver(self, deliveries: Iterable[Delivery]) -> None:
        """Take ``deliveries`` back (no copy into their rows once this returns)."""
        pf = self.prefetcher
        for d in deliveries:
            if pf is not None:
                pf.undeliver(d)

    def read_ahead(self, keys: np.ndarray) -> None:
        """``keys`` are what the next :meth:`read_into` will read: without a cache, its first requests
        are started while this read's last ones are in flight (a hint: any other read just fetches)."""
        if self.cache is None and hasattr(self.store, "start_fetch"):
            self._next_keys = np.array(keys, dtype=np.int64).reshape(-1)

    def schedule(self, blocks: Iterable[np.ndarray]) -> None:
        """``blocks`` are the keys of the coming reads, in order (an epoch's block schedule): with a
        cache, the download's background order becomes the parts in the order these blocks first
        need them, so the parts of the next blocks land before those of later ones (docs/design.md
        §9). Looks ahead only until every part of the shards still downloading is placed."""
        if self.cache is None:
            return
        pf = self.prefetcher
        part_bytes = prefetch.PART_BYTES  # the prefetcher's parts (read when called: tests shrink them)
        per = part_bytes // PAGE_BYTES
        todo = {i: len({grid_cell(p, map_pages(info.nbytes)) for p in range(0, map_pages(info.nbytes), per)})
                for i, info in enumerate(self.shards) if (self._cached_fd(i) is None if pf is None else pf.pending(i))}
        if pf is None and not todo:
            return  # every copy complete: nothing to download, no fetch threads to start
        seen: set[tuple[int, int]] = set()
        order: list[tuple[int, int, int]] = []
        left = sum(todo.values())
        self._prefetch_indexes(sorted(todo))  # one round trip for the indexes the metadata does not fix
        for keys in blocks:
            if not left:
                break
            k = distinct_sorted(keys)
            k = k[(k >= 0) & (k < self.num_records)]
            shard_of = k // self.records_per_shard
            cuts = np.flatnonzero(np.diff(shard_of)) + 1
            for part in np.split(k, cuts):
                i = int(part[0]) // self.records_per_shard if part.size else -1
                if i not in todo:
                    continue
                local = part - i * self.records_per_shard
                if self._known_index(i) is not None:  # the dense layout: record j at j * record_nbytes
                    offs = local * self.record_nbytes
                else:
                    idx = self.index(i)
                    offs = idx.offsets[local[idx.present[local]]].astype(np.int64)
                npages = map_pages(self.shards[i].nbytes)
                for p in distinct_sorted(offs // part_bytes).tolist():
                    lo, hi = grid_cell(p * per, npages)
                    if (i, lo) not in seen:
                        seen.add((i, lo))
                        order.append((i, lo, hi))
                        left -= 1
        if pf is None:  # started with its order: no part is picked before it
            self.prefetcher = self._start_prefetch(order)
        else:
            pf.schedule(order)

    def _uncached(self, keys: np.ndarray) -> bool:
        """Some shard of ``keys`` has no complete local copy (the download is started for it: a read
        that finds every copy complete starts no fetch threads)."""
        shards = distinct_sorted(np.clip(keys, 0, max(0, self.num_records - 1)) // self.records_per_shard).tolist()
        return any(self._cached_fd(i) is None for i in shards)

    def _read_plan(self, plan: _Plan, rows: list[np.ndarray], decodes: list[DecodeJob] | None = None) -> None:
        """Runs of shards with a complete local copy are read by the local reader's engine
        (:meth:`_read_complete`); the others run by run (see :meth:`_read_runs`). Each record goes to
        its destination row, decode jobs to ``decodes`` when given (the caller waits for them, see
        ``Destination.decodes``)."""
        out = _Rows(rows, plan)
        if decodes is not None:
            out.decodes = decodes
        try:
            looked = self.cache is not None and self.codec is None  # complete copies looked up here first
            done = self._read_complete(plan, rows, self._registered_runs(plan)) if looked else np.zeros(plan.num_runs, dtype=bool)
            if not done.all():
                runs = [run for run, d in zip(plan.as_runs(self.shard_location), done.tolist()) if not d]
                self._read_runs(runs, out, looked=looked)
        except BaseException:
            wait_decodes(out.decodes)  # no decoder writes into the rows once the error is raised
            raise
        if decodes is None:
            finish_decodes(out.decodes)

    def _registered_runs(self, plan: _Plan) -> np.ndarray | None:
        """Which runs of ``plan`` have a delivery registered ahead (a block opened ahead,
        :meth:`deliver_ahead`): they are settled run by run, reading only what was not delivered,
        even from a complete copy. None when there are none."""
        if not self._taking:
            return None
        return np.array([(int(plan.shard[a]), int(plan.offs[a]), b - a) in self._taking for a, b in plan.runs()], dtype=bool)

    def _read_complete(self, plan: _Plan, rows: list[np.ndarray], registered: np.ndarray | None = None) -> np.ndarray:
        """Read the runs of ``plan`` whose shard has a complete, checked local copy, as the local
        reader reads its shard files (announced, then one ``preadv`` a run into the rows, small
        records bounced), counted in ``cache_stats``; returns which runs were read. A warm epoch
        and a cold epoch's blocks after the download are only these reads, so they cost what a
        local dataset's do: no per-run Python of the remote path (docs/design.md §9).
        Compressed records keep the run-by-run path; so do ``registered`` runs."""
        done = np.zeros(plan.num_runs, dtype=bool)
        run_shard = plan.shard[plan.run_starts]
        files: dict[int, tuple[int, str]] = {}
        for i in distinct_sorted(run_shard).tolist():
            fd = self._cached_fd(i)
            if fd is not None:
                files[i] = (fd, f"{self.shard_location(i)} (local cache copy)")
        if not files:
            return done
        done = np.isin(run_shard, list(files))
        if registered is not None:
            done &= ~registered  # their delivered records are not read again (see _registered_runs)
        local = dataclasses.replace(plan, files=files.__getitem__)
        if plan.num_runs > 1:
            self._announce(local, skip={int(i) for i in run_shard[~done].tolist()})
        bounced = local.dense_runs() if self.record_nbytes < SCATTER_MIN_BYTES else np.zeros(plan.num_runs, dtype=bool)
        self._read_scattered(local, rows, np.flatnonzero(done & ~bounced))
        self._read_bounced(local, rows, np.flatnonzero(done & bounced))
        return done

    def _preadv_all(self, fd: int, path: str, buffers: list[memoryview], offset: int) -> None:
        """The local engine's reads are of cache copies here: counted in ``cache_stats``, not as requests."""
        preadv_exact(fd, buffers, offset, path, self.cache_stats)

    def _prefetch_indexes(self, shards: list[int]) -> None:
        missing = [i for i in shards if i not in self._indexes and self._known_index(i) is None]
        if len(missing) < 2:
            return
        isize = index_nbytes(self.records_per_shard)
        # each index with the shard's tail before it (checked with it: one request per shard)
        asks = [ByteRange(self._key(i), self.shards[i].nbytes - isize - self._tail_nbytes(i), self.shards[i].nbytes)
                for i in missing]  # fmt: skip
        self._pending_index.update({i: bytes(got.data) for i, got in self._fetched(missing, asks)})
        for i in missing:
            self.index(i)

    def _read_runs(self, runs: list[_Run], rows: _Rows, *, looked: bool = False) -> None:
        """Runs of shards the local cache holds are read from it; runs of shards being downloaded
        (here or by another process) are read from the partial copy once their pages are local,
        asked for first; the others are fetched by range (:meth:`_fetch_runs`). ``looked``: the
        caller just found no complete copy of these runs' shards (not looked up again)."""
        remote: list[_Run] = []
        filling: list[_Run] = []
        fds: dict[int, int | None] = {}  # looked up once per shard, not per run (a copy being filled is not found)
        taken: dict[int, _Registered] = {}  # runs of blocks opened ahead -> their deliveries (by id)
        for run in runs:
            reg = self._registered(run, rows) if self._taking else None
            if run.shard not in fds:
                fds[run.shard] = None if looked else self._cached_fd(run.shard)
            fd = fds[run.shard]
            if fd is not None:
                for rest in self._settle(run, reg):
                    self._read_cached(fd, rest, rows)
            elif self.prefetcher is not None:
                filling.append(run)
                if reg is not None:
                    taken[id(run)] = reg
            else:
                remote.extend(self._settle(run, reg))
        if filling:
            try:
                self._read_filling(filling, rows, remote, taken)
            finally:
                self._undeliver(reg.delivery for reg in taken.values())
        else:
            self._fetch_runs(remote, rows)

    def _read_filling(self, runs: list[_Run], rows: _Rows, remote: list[_Run], taken: dict[int, _Registered]) -> None:
        """Ask for every page the runs need (and each shard's tail, for the identity check) at once,
        fetch ``remote`` meanwhile, then read each run from its copy as its pages land. ``taken``:
        the deliveries registered ahead for some of the runs (by ``id``), used instead of new ones."""
        assert self.prefetcher is not None
        todo = runs
        for attempt in range(_RESOLVE_ATTEMPTS):
            copies: dict[int, PartialCopy | None] = {}
            waits: list[tuple[_Run, PartialCopy, list[tuple[int, int]], Delivery | None]] = []
            asked: dict[int, list[tuple[int, int]]] = {}
            registered: list[Delivery] = []  # each taken back before the read ends
            try:
                for run in todo:
                    pre = taken.pop(id(run), None)
                    if pre is not None:
                        registered.append(pre.delivery)
                    if run.shard not in copies:
                        copies[run.shard] = None if self._cached_fd(run.shard) is not None else self.prefetcher.copy(run.shard)
                    copy = copies[run.shard]
                    fd = self._cached_fd(run.shard) if copy is None else None
                    if fd is not None:
                        for rest in self._settle(run, pre):
                            self._read_cached(fd, rest, rows)
                    elif copy is None or attempt == _RESOLVE_ATTEMPTS - 1:
                        remote.extend(self._settle(run, pre))
                    else:
                        spans = _pages(run.offs, run.sizes)
                        if self._blocks_read:
                            spans = _whole_parts(spans, map_pages(copy.size))
                        if run.shard not in self._tails_checked:
                            spans += self._tail_pages(run.shard, map_pages(copy.size))
                        asked.setdefault(run.shard, []).extend(spans)
                        # Registered before the pages are asked for (or when the block was opened ahead).
                        delivery = pre.delivery if pre is not None else self._deliver(copy, run, rows)
                        if delivery is not None and pre is None:
                            registered.append(delivery)
                        waits.append((run, copy, spans, delivery))
                gap = demand_gap_pages()
                priority = LAST_PRIORITY if self._blocks_read else self.ask_priority
                for shard, spans in asked.items():  # one request per copy: the filler is woken once, not per run
                    copy = copies[shard]
                    assert copy is not None
                    # Merged across gaps when this process fills the copy; another process's filler
                    # merges the pages asked for in its map itself (ShardPrefetcher._pick), and a
                    # retry (pages that did not come) asks for exactly those.
                    copy.request(_merged(spans, gap if copy.owned and not attempt else 0), priority)
                self._fetch_runs(remote, rows)
                remote = []
                again: list[_Run] = []
                while waits:
                    # Runs are read as their pages land, in any order (parts arrive out of order).
                    now = self.prefetcher.ready([(copy, spans) for _, copy, spans, _ in waits])
                    ready = [w for w, r in zip(waits, now) if r]
                    waits = [w for w, r in zip(waits, now) if not r]
                    for run, copy, spans, delivery in ready:
                        try:
                            present = copy.wait(spans)
                        finally:
                            if delivery is not None:
                                copy.undeliver(delivery)  # no copy into the rows from here on
                        if not present:
                            again.append(run)
                            continue
                        if run.shard not in self._tails_checked and PayloadArray._tail_nbytes(self, run.shard):
                            self._check_tail(run.shard, self._tail_from(copy.fd, run.shard))
                        for rest in self._undelivered(run, delivery):
                            self._read_cached(copy.fd, rest, rows)
            finally:
                self._undeliver(registered)
                for c in copies.values():
                    if c is not None:
                        c.close()
            if not again:
                return
            todo = again

    def _deliver(self, copy: PartialCopy, run: _Run, rows: _Rows) -> Delivery | None:
        """Have this process's fetch threads copy ``run``'s records into their rows as their chunks
        land (uncompressed records of at least ``SCATTER_MIN_BYTES``, each exactly a whole,
        contiguous row): no read back from the copy for them (docs/design.md §9, *Shard cache*)."""
        rec = self.record_nbytes
        if not copy.owned or self.codec is not None or rec < SCATTER_MIN_BYTES or not bool(np.all(run.sizes == rec)):
            return None
        targets: list[memoryview] = []
        for p in run.pos.tolist():
            row = rows[p]
            if row.nbytes != rec or not row.flags.c_contiguous or not row.flags.writeable:
                return None
            targets.append(row.data.cast("B"))
        return copy.deliver(run.offs.tolist(), (run.offs + run.sizes).tolist(), targets)

    def _undelivered(self, run: _Run, delivery: Delivery | None) -> list[_Run]:
        """The pieces of ``run`` (consecutive records) still to read from the copy: those ``delivery``
        did not deliver whole from checked parts (the delivered ones count as read from the cache)."""
        if delivery is None:
            return [run]
        done = np.zeros(run.offs.size, dtype=bool)
        done[np.asarray(delivery.which, dtype=np.int64)[np.asarray(delivery.delivered(), dtype=bool)]] = True
        if done.any():
            self.cache_stats.add(run.path, int(run.offs[done][0]), int(run.sizes[done].sum()))
        todo = np.flatnonzero(~done)
        pieces = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1) if todo.size else []
        return [_Run(run.shard, run.path, run.offs[k], run.sizes[k], run.pos[k]) for k in pieces]

    def _tail_pages(self, i: int, npages: int) -> list[tuple[int, int]]:
        """The pages of shard ``i``'s tail (its identity check), with the rest of the copy (its
        index) when that is at most :func:`~shardkit.stores.prefetch.demand_gap_pages`: asked
        alone, the index would be a request of a page or two, made last (docs/design.md §9)."""
        n = PayloadArray._tail_nbytes(self, i)
        end = self._data_nbytes(i)
        if not n:
            return []
        spans = _pages(np.array([end - n]), np.array([n]))
        if npages - spans[-1][1] <= demand_gap_pages():
            spans[-1] = (spans[-1][0], npages)
        return spans

    def _tail_from(self, fd: int, i: int) -> bytes:
        n = PayloadArray._tail_nbytes(self, i)
        start = self._data_nbytes(i) - n
        data = os.pread(fd, n, start)
        if len(data) != n:
            raise TruncatedShardError(f"{self.shard_location(i)} (local cache copy): expected {n} bytes at {start}, read {len(data)}")
        return data

    def _cached_fd(self, i: int) -> int | None:
        """A descriptor of shard ``i``'s complete, verified local copy, or None."""
        if self.cache is None:
            return None
        return self.cache.open(_entry(i), functools.partial(self._verify_copy, i))

    def _fetch_runs(self, remote: list[_Run], rows: _Rows) -> None:
        """Fetch runs in requests of at most ``request_bytes``, each response scattered into its rows as
        it arrives, after each shard's identity is checked (:meth:`_check_tails`). Requests the
        previous read started ahead (:meth:`read_ahead`) are taken over; once this read's requests
        are queued, the next read's first ones are started behind them."""
        self._check_tails({run.shard for run in remote})
        ahead, self._ahead = self._ahead, None
        pieces, asks = self._asks(remote, ahead.asks if ahead is not None else ())
        taken: dict[int, int] = {}  # request of the read ahead -> request of this read
        if ahead is not None:
            wanted = {_ask_id(a): k for k, a in enumerate(asks)}
            taken = {j: wanted[_ask_id(a)] for j, a in enumerate(ahead.asks) if _ask_id(a) in wanted}
        served = set(taken.values())
        rest = [k for k in range(len(asks)) if k not in served]
        start = getattr(self.store, "start_fetch", None)
        pending: Iterator[Fetched] | None = None
        try:
            if start is not None:
                pending = start([asks[k] for k in rest])
                self._start_ahead()
            if ahead is not None:
                left = len(taken)
                for got in _shards_present(ahead.pending) if left else ():
                    k = taken.get(got.index)
                    if k is None:
                        continue  # asked for a read that did not come: dropped
                    i = pieces[k][0].shard
                    self._check_response(i, got, asks[k])
                    self.stats.add(self.shard_location(i), asks[k].start, asks[k].nbytes)
                    run, a, b = pieces[k]
                    self._scatter(run, a, b, asks[k].start, got.data, rows)
                    left -= 1
                    if not left:
                        break
                _close(ahead.pending)
            if pending is None:
                got_rest = self._fetched([pieces[k][0].shard for k in rest], [asks[k] for k in rest])
            else:
                got_rest = self._checked([pieces[k][0].shard for k in rest], [asks[k] for k in rest], pending)
            for _, got in got_rest:
                k = rest[got.index]
                run, a, b = pieces[k]
                self._scatter(run, a, b, asks[k].start, got.data, rows)
        finally:
            if ahead is not None:
                _close(ahead.pending)
            if pending is not None:
                _close(pending)

    def _asks(self, remote: list[_Run], started: Sequence[ByteRange] = ()) -> tuple[list[tuple[_Run, int, int]], list[ByteRange]]:
        """The requests of ``remote``: each run cut at record boundaries into requests of at most
        ``request_bytes`` (at least one record each), with ``(run, first record, end record)``; also
        cut where a request of ``started`` (fetched ahead) begins or ends, so those are requests of
        this read as they are (a run may have grown by a record the read ahead left out)."""
        pieces: list[tuple[_Run, int, int]] = []
        asks: list[ByteRange] = []
        limit = self.store.options.request_bytes
        cuts: dict[str, list[int]] = {}
        for r in started:
            cuts.setdefault(r.key, []).extend((r.start, r.end))
        for run in remote:
            ends = run.offs + run.sizes
            key = self._key(run.shard)
            breaks = np.flatnonzero(np.isin(run.offs, cuts[key])) if key in cuts else np.empty(0, np.int64)
            a = 0
            while a < run.offs.size:
                start = int(run.offs[a])
                # the last record that still ends within ``limit`` of the start (at least one record)
                b = max(a + 1, int(np.searchsorted(ends, start + limit, side="right")))
                cut = int(np.searchsorted(breaks, a, side="right"))
                if cut < breaks.size:
                    b = min(b, int(breaks[cut]))
                pieces.append((run, a, b))
                asks.append(ByteRange(key, start, int(ends[b - 1]), self._etags.get(run.shard)))
                a = b
        return pieces, asks

    def _start_ahead(self) -> None:
        """Start the first requests of the read :meth:`read_ahead` announced: at most
        ``concurrency`` of them and :data:`READAHEAD_BYTES`, only of shards whose index is at hand
        and whose identity is checked (nothing here may wait for a request)."""
        keys, self._next_keys = self._next_keys, None
        if keys is None or not keys.size or int(keys.min()) < 0 or int(keys.max()) >= self.num_records:
            return
        distinct = distinct_sorted(keys)
        if distinct.size > PLAN_RECORDS:
            return  # read in several plans: only the first plan's requests could be started
        shards = distinct_sorted(distinct // self.records_per_shard).tolist()
        ready = [i for i in shards if self._index_at_hand(i) and (i in self._tails_checked or not PayloadArray._tail_nbytes(self, i))]
        if not ready:
            return
        distinct = distinct[np.isin(distinct // self.records_per_shard, ready)]
        scratch = [np.zeros((1, self.record_nbytes), dtype=np.uint8)]  # fill values of absent records land here
        zeros = np.zeros(distinct.size, dtype=np.int64)
        plan = self._plan(distinct, zeros, zeros, scratch)
        if not plan.size:
            return
        _, asks = self._asks(plan.as_runs(self.shard_location))
        n, total = 0, 0
        for ask in asks[: max(1, self.store.options.concurrency)]:
            if n and total + ask.nbytes > READAHEAD_BYTES:
                break
            n, total = n + 1, total + ask.nbytes
        self._ahead = _Ahead(asks[:n], self.store.start_fetch(asks[:n]))  # type: ignore[attr-defined]

    def _index_at_hand(self, i: int) -> bool:
        return i in self._indexes or self._known_index(i) is not None

    def _checked(self, shards: list[int], asks: list[ByteRange], pending: Iterator[Fetched]) -> Iterator[tuple[int, Fetched]]:
        """The responses ``pending`` to ``asks`` (``asks[k]`` reads shard ``shards[k]``, requests
        already started), each checked and counted."""
        for got in _shards_present(pending):
            i, ask = shards[got.index], asks[got.index]
            self._check_response(i, got, ask)
            self.stats.add(self.shard_location(i), ask.start, ask.nbytes)
            yield i, got

    def _drop_ahead(self) -> None:
        """Cancel the requests started for the next read (it will fetch what it needs itself)."""
        ahead, self._ahead, self._next_keys = self._ahead, None, None
        if ahead is not None:
            _close(ahead.pending)

    def _read_cached(self, fd: int, run: _Run, rows: _Rows) -> None:
        """One run from the shard's local copy (complete, or with the run's pages present), counted
        in ``cache_stats``, not as requests. Uncompressed records of at least ``SCATTER_MIN_BYTES``
        are read by one ``preadv`` straight into their rows (one copy, page cache to row: no
        temporary to allocate, fill and copy again, docs/design.md §9); others are read as one span
        into a temporary, then scattered or decoded."""
        start = int(run.offs[0])
        end = int(run.offs[-1] + run.sizes[-1])
        what = f"{run.path} (local cache copy)"
        buffers = self._row_buffers(run, rows) if self.codec is None and self.record_nbytes >= SCATTER_MIN_BYTES else None
        if buffers is not None:
            preadv_exact(fd, buffers, start, what)
            self.cache_stats.add(run.path, start, end - start)
            return
        buf = np.empty(end - start, dtype=np.uint8)
        preadv_exact(fd, [buf.data], start, what)
        self.cache_stats.add(run.path, start, end - start)
        self._scatter(run, 0, run.offs.size, start, buf.data, rows)

    def _row_buffers(self, run: _Run, rows: _Rows) -> list[memoryview] | None:
        """The ``iovec`` list that reads ``run``'s span straight into its rows, gaps into scratch
        (one reused buffer: their bytes are dropped); None when a record is not exactly a whole,
        contiguous row (then the caller scatters from a temporary)."""
        rec = self.record_nbytes
        if not bool(np.all(run.sizes == rec)):
            return None
        offs = run.offs.tolist()
        gaps = [b - a - rec for a, b in itertools.pairwise(offs)]
        scratch = memoryview(bytearray(max(gaps))) if gaps and max(gaps) > 0 else None
        buffers: list[memoryview] = []
        for k, p in enumerate(run.pos.tolist()):
            row = rows[p]
            if row.nbytes != rec or not row.flags.c_contiguous or not row.flags.writeable:
                return None
            if k and gaps[k - 1] > 0:
                assert scratch is not None
                buffers.append(scratch[: gaps[k - 1]])
            buffers.append(row.data.cast("B"))
        return buffers

    # ------------------------------------------------------------------ the local cache
    def _start_prefetch(self, order: Sequence[tuple[int, int, int]] = ()) -> ShardPrefetcher:
        """Download every shard into the cache in parts, in the background: ``order`` first (see
        :meth:`schedule`), then ascending (docs/design.md §9)."""
        assert self.cache is not None
        # A shard a newer version replaced has another size: the prefetcher leaves it remote, and the
        # ranged path reads the copy kept for this version (see _check_response).
        items = [PrefetchItem(self._key(i), _entry(i), info.nbytes, self._data_nbytes(i)) for i, info in enumerate(self.shards)]

        def account(i: int, nbytes: int) -> None:
            self.stats.add(self.shard_location(i), 0, nbytes)

        return ShardPrefetcher(
            self.store, self.cache, items, verify=self._check_digest,
            pin=lambda i, etag: self._pin(i, etag, self.shard_location(i)), account=account, order=order,
            fillers=self.fillers,
        )

    def close(self) -> None:
        self._drop_ahead()
        opened, self._opened_ahead = self._opened_ahead, []
        self._undeliver(reg.delivery for _, registered, _ in opened for reg in registered.values())
        if self.prefetcher is not None:
            self.prefetcher.close()
        super().close()

    def _verify_copy(self, i: int, fd: int) -> bool:
        """A complete local copy of shard ``i`` has the checksums recorded in the metadata."""
        data_crc, crc, size = fd_crc32c(fd, self._data_nbytes(i))
        return size == self.shards[i].nbytes and self._check_digest(i, data_crc, crc)

    def _check_digest(self, i: int, data_crc: int, crc: int) -> bool:
        """``crc`` (of all of shard ``i``) and ``data_crc`` (of its records' bytes) are the recorded ones."""
        info = self.shards[i]
        return crc == info.crc32c and info.data_crc32c in (None, data_crc)

    def _scatter(self, run: _Run, a: int, b: int, start: int, data: memoryview, rows: _Rows) -> None:
        """Copy records ``a:b`` of ``run`` out of a response that begins at byte ``start``."""
        buf = np.frombuffer(data, dtype=np.uint8)
        offs = (run.offs[a:b] - start).tolist()
        sizes = run.sizes[a:b].tolist()
        pos = run.pos[a:b].tolist()
        if self.codec is None:
            for o, size, p in zip(offs, sizes, pos):
                rows[p] = buf[o : o + size]
            return
        # Decoded on the decode threads (when there are some) while the next responses arrive.
        at = run.pos[a:b]
        self._decode_records(run.shard, start, data, offs, sizes, rows.arrays, rows.which[at].tolist(), rows.row[at].tolist(),
                             rows.decodes)  # fmt: skip


class _Registered:
    """A run's records registered for delivery before its read (:meth:`RangedPayloadArray.deliver_ahead`),
    with the destination buffer and row of each (the read takes it over only for the same rows)."""

    def __init__(self, delivery: Delivery, which: np.ndarray, row: np.ndarray) -> None:
        self.delivery, self.which, self.row = delivery, which, row


@dataclasses.dataclass(frozen=True, eq=False)
class _Planned:
    """The plan :meth:`RangedPayloadArray.deliver_ahead` made of records ``keys`` (ascending,
    distinct) into rows ``row`` of buffers ``which``: the block's read takes it for the same."""

    keys: np.ndarray
    which: np.ndarray
    row: np.ndarray
    plan: _Plan

    def same(self, keys: np.ndarray, which: np.ndarray, row: np.ndarray) -> bool:
        return (np.array_equal(self.keys, keys) and np.array_equal(self.which, which)
                and np.array_equal(self.row, row))  # fmt: skip


def _run_id(run: _Run) -> tuple[int, int, int]:
    """A run of a plan by its shard, first offset and records (the same in a block's plan ahead and at its read)."""
    return run.shard, int(run.offs[0]), int(run.offs.size)


class _Ahead:
    """Requests started for the next read: what they ask for, and their responses to come."""

    def __init__(self, asks: list[ByteRange], pending: Iterator[Fetched]) -> None:
        self.asks = asks
        self.pending = pending


def _ask_id(ask: ByteRange) -> tuple[str, int, int, str | None]:
    return ask.key, ask.start, ask.end, ask.etag


def _close(pending: Iterator[Fetched]) -> None:
    """Cancel what ``pending`` has not delivered (a generator or a started fetch)."""
    close = getattr(pending, "close", None)
    if close is not None:
        close()


class _Replaced(Exception):
    """Shard ``shard`` was replaced by a newer version; this reader's version is at ``key``."""

    def __init__(self, shard: int, key: str) -> None:
        super().__init__(shard, key)
        self.shard = shard
        self.key = key


def _shards_present(fetched: Iterator[Fetched]) -> Iterator[Fetched]:
    """The responses, with a missing object reported as the missing shard it is."""
    try:
        yield from fetched
    except FileNotFoundError as exc:
        raise MissingShardError(f"{exc}: a payload shard listed in the dataset metadata is missing") from None


def _whole_parts(spans: list[tuple[int, int]], npages: int) -> list[tuple[int, int]]:
    """``spans`` (ascending pages of a copy of ``npages``) widened to the background's parts, merged.

    Only the first block asks for its records' own pages, merged across small gaps (a fast first
    batch; :func:`~shardkit.stores.prefetch.demand_gap_pages`); a later block asking
    page by page would turn the whole epoch into small requests, bound by the store's request rate
    (``benchmarks/remote.py``: 0.21-0.29x raw GET, against 0.5-0.6x with whole parts), while whole
    parts are requests of the background's size, fetched once either way.
    """
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        lo, hi = grid_cell(lo, npages)[0], grid_cell(max(lo, hi - 1), npages)[1]
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out




def _merged(spans: list[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """``spans`` (``[lo, hi)`` pages) ascending, those at most ``gap`` pages apart merged (the pages
    between with them: see :func:`~shardkit.stores.prefetch.demand_gap_pages`)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _pages(offs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """The pages (``[lo, hi)`` spans, ascending) that hold the records at ``offs`` (ascending), spans
    at most :func:`~shardkit.stores.prefetch.demand_gap_pages` apart merged into one request."""
    if not offs.size:
        return []
    los = (offs // PAGE_BYTES).tolist()
    his = ((offs + np.maximum(sizes, 1) - 1) // PAGE_BYTES + 1).tolist()
    gap = demand_gap_pages()
    out: list[tuple[int, int]] = []
    for lo, hi in zip(los, his):
        if out and lo <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _entry(i: int) -> str:
    """Cache entry name of shard ``i``."""
    return f"shard-{i:08d}"
