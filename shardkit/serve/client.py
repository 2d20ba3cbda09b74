"""The job half of the shared tier stack: :class:`SharedSampler`.

The design (order, ring, release bound, leases) is docs/design.md §8, its security model docs/design.md §13.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.closing import Closing
from shardkit.errors import ConfigError, InsecurePathError, PeerTimeoutError, ProtocolError, SamplerError, ShardkitError
from shardkit.formats import Dataset
from shardkit.order.schedule import BATCH_PREFETCH, batches_per_consumer, consumer_slice
from shardkit.order.seeds import check_seed
from shardkit.readers.sampler import _Run
from shardkit.readers.sources import MixedDataset, Mixture, as_source, mix
from shardkit.serve.order import job_permutation
from shardkit.serve.protocol import (
    MAX_GROUP_BYTES,
    MAX_INFO_BYTES,
    TOKEN_BYTES,
    Beat,
    Bye,
    Channel,
    Done,
    Hello,
    Message,
    PeerClosed,
    Refused,
    Release,
    Reservoir,
    ServerInfo,
    Welcome,
)
from shardkit.serve.ring import Ring, RingLayout
from shardkit.serve.rundir import RunDir, check_name, run_dir_path
from shardkit.stopping import POLL_SECONDS, CurrentRun, Stopped, put
from shardkit.stores import Location, as_location, location_string
from shardkit.tiers.buffers import HOLD_BATCHES, BatchPool
from shardkit.tiers.pipeline import BatchReady, RunDone, assemble_batch
from shardkit.tiers.stats import SamplerStats

__all__ = ["SharedSampler", "wait_for_server"]

logger = logging.getLogger(__name__)

_POLL = POLL_SECONDS


def _open_server(name: str, base_dir: str | os.PathLike[str] | None, timeout: float) -> tuple[RunDir, ServerInfo]:
    """The checked run directory and ``info.json`` of this user's live server ``name``, waited for up to ``timeout`` s."""
    path = run_dir_path(name, base_dir)
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = RunDir.open(path)
        except FileNotFoundError:
            what = "no run directory"
        else:
            try:
                if not run.lock_is_held():
                    what = "stale files of a dead server"
                else:
                    try:
                        raw = run.read_file("info.json", MAX_INFO_BYTES)
                    except FileNotFoundError:
                        what = "a server still starting"
                    else:
                        info = ServerInfo.from_json(raw, source=str(path / "info.json"))
                        if info.name != name:
                            raise ProtocolError(f"{path / 'info.json'}: names server {info.name!r}, expected {name!r}")
                        return run, info
            except BaseException:
                run.close()
                raise
            run.close()
        if time.monotonic() >= deadline:
            raise SamplerError(
                f"no shardkit server named {name!r} is running (looked in {path}: {what}); "
                f"start one with `shardkit serve DATASET --name {name}`"
            )
        time.sleep(_POLL)


def wait_for_server(name: str, *, base_dir: str | os.PathLike[str] | None = None, timeout: float = 0.0) -> ServerInfo:
    """The validated ``info.json`` of this user's live server ``name``, waiting up to ``timeout`` seconds."""
    run, info = _open_server(check_name(name), base_dir, timeout)
    run.close()
    return info


def _read_token(run: RunDir) -> bytes:
    raw = run.read_file("token", 2 * TOKEN_BYTES + 1).strip()
    try:
        token = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        token = b""
    if len(token) != TOKEN_BYTES:
        raise ProtocolError(f"{run.path / 'token'}: expected {2 * TOKEN_BYTES} hex digits")
    return token


class SharedSampler(Closing):
    """Batches from a running :class:`~shardkit.readers.TierServer`, in this job's own order.

    A plain iterator of batch dicts like :class:`~shardkit.readers.TieredSampler`: the payload
    (``"image"``/``"audio"``), every per-record field and ``"key"`` (design: docs/design.md §8).

    Parameters
    ----------
    name
        The server's name (``shardkit serve ... --name NAME``); only servers of this user are found.
    job_seed
        Seeds this job's permutation inside every reservoir (its own random domain, never the
        server's). Jobs need different seeds to see different orders. ``None`` draws a fresh
        random seed (then recorded in :attr:`job_seed`).
    batch_size
        Records per batch (per consumer). Batches span reservoir boundaries but never epoch
        boundaries: the last batch of an epoch may be short.
    epochs
        Whole server epochs per iteration; the first is the next one that starts after attaching.
    dataset
        Optional dataset path (or :class:`~shardkit.readers.sources.Mixture`): the server must serve
        exactly this dataset or mixture (fingerprint check). A server that serves a mixture gives
        every batch the mixture's ``dataset`` entry, and ``key`` is the record's key in its dataset.
    base_dir
        Where the server's run directory lives (default: ``/dev/shm`` or the temp dir).
    connect_timeout
        Seconds to wait for the server to appear (e.g. started at the same time).
    rank, world_size, drop_last, group
        Consumer ``rank`` of ``world_size`` consumers of *one* job (DataLoader workers, ranks): with
        the same ``job_seed`` they share the job's order and take its global batches as
        :class:`~shardkit.readers.TieredSampler` does (``drop_last`` drops the ragged final global
        batch). The members of ``group`` (default ``"job-<job_seed>"`` when ``world_size > 1``)
        start together, at the first epoch boundary after all have attached.

    Heartbeats run in a background thread, so a long training step (or evaluation) keeps the lease;
    a server silent for ``lease_seconds`` raises :class:`~shardkit.errors.PeerTimeoutError`.
    :meth:`close` (or leaving a ``with`` block, or finishing ``epochs``) detaches.
    """

    def __init__(
        self,
        name: str,
        *,
        job_seed: int | None = None,
        batch_size: int = 256,
        epochs: int | None = 1,
        dataset: Location | Dataset | Mixture | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        connect_timeout: float = 10.0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        group: str | None = None,
    ) -> None:
        self.name = check_name(name)
        self.job_seed = check_seed(secrets.randbits(63) if job_seed is None else job_seed, what="job_seed")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ConfigError(f"batch_size: expected a positive integer, found {batch_size!r}")
        self.batch_size = int(batch_size)
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 0):
            raise ConfigError(f"epochs: expected >= 0 or None (forever), found {epochs!r}")
        self.epochs = None if epochs is None else int(epochs)
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ConfigError(f"world_size: expected a positive integer, found {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ConfigError(f"rank: expected 0 <= rank < world_size={world_size}, found {rank!r}")
        self.rank, self.world_size, self.drop_last = int(rank), int(world_size), bool(drop_last)
        if group is None and self.world_size > 1:
            group = f"job-{self.job_seed}"
        if group is not None and (not isinstance(group, str) or not 0 < len(group.encode()) <= MAX_GROUP_BYTES):
            raise ConfigError(f"group: expected 1-{MAX_GROUP_BYTES} bytes of text, found {group!r}")
        #: Consumers of one job share a group (``None``: a job of one consumer).
        self.group = group
        self.base_dir = base_dir
        self.connect_timeout = float(connect_timeout)
        info = wait_for_server(self.name, base_dir=base_dir, timeout=self.connect_timeout)
        self.path: Path | str = as_location(info.dataset)
        self._info = info
        #: The server's lease: this job heartbeats every quarter of it, and gives up on a server
        #: silent for that long.
        self.lease_seconds = info.lease_seconds
        self._open(info, dataset)
        self._layout = RingLayout(info.slots, info.slot_records, *self._record)
        self.stats = SamplerStats()
        self._epoch: int | None = None
        #: Batch buffers, kept across iterations: a batch is a view of one, handed over without a copy.
        self._pool = BatchPool(self.batch_size, *self._record, BATCH_PREFETCH + 1 + HOLD_BATCHES)
        self._run: CurrentRun[_Run] = CurrentRun()

    @property
    def mixture(self) -> Mixture | None:
        """The served source when its order is a mixture's (batches carry ``dataset``), ``None``
        for one dataset read as it is."""
        return None if self.source.plan(0).single else self.source

    def _open(self, info: ServerInfo, dataset: Location | Dataset | Mixture | None) -> None:
        """Rebuild the served source from ``info.json``, check its fingerprint (and ``dataset``'s), open its fields."""
        mi = info.mixture
        if mi is None:
            raise SamplerError(f"server {self.name!r} (pid {info.pid}) does not say what it serves; refusing to attach")
        m = mix(list(zip(mi.datasets, mi.weights)), epoch_size=mi.epoch_size, seed=info.seed)
        if dataset is not None:
            wanted = as_source(dataset)
            if wanted.fingerprint() != info.fingerprint:
                served = info.dataset if m.plan(0).single else "a mixture"
                raise SamplerError(f"server {self.name!r} (pid {info.pid}) serves {served}, not "
                                   f"{', '.join(location_string(p) for p in wanted.paths)} (fingerprints differ); "
                                   "refusing to attach")
        if m.fingerprint() != info.fingerprint or m.epoch_size != info.num_records or m.record.nbytes != info.record_nbytes:
            raise SamplerError(f"{self.path}: a dataset changed since server {self.name!r} (pid {info.pid}) "
                               f"started; restart the server")
        with MixedDataset(m) as md:
            self.fields: dict[str, Any] = dict(md.fields)
            self._local_keys = md.local_keys
        #: The source the server serves; :attr:`mixture` says whether batches carry ``dataset``.
        self.source = m
        self.num_records = m.epoch_size
        self.record_nbytes = m.record.nbytes
        self.payload_name = m.payload_name
        self._record = (tuple(m.record.shape), np.dtype(m.record.dtype))

    @property
    def epoch(self) -> int | None:
        """Server epoch of the last batch emitted (``None`` before the first)."""
        return self._epoch

    def __len__(self) -> int:
        """Batches this consumer gets per epoch."""
        return batches_per_consumer(self.num_records, self.batch_size, self.rank, self.world_size,
                                    drop_last=self.drop_last)

    def _no_resume(self, what: str) -> SamplerError:
        return SamplerError(
            f"shared sampler {self.name!r}: {what} (epochs are the server's; a job that restarts "
            "attaches at the next epoch boundary)"
        )

    def state_dict(self) -> dict[str, Any]:
        """Shared samplers cannot resume: the server, not the job, decides which epoch comes next."""
        raise self._no_resume("no resume state")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refused, as :meth:`state_dict` is (the :class:`~shardkit.readers.Sampler` protocol's resume method)."""
        raise self._no_resume("cannot resume from a state")

    def set_epoch(self, epoch: int) -> None:
        """Refused: a shared job runs the server's next epochs, it cannot choose one."""
        raise self._no_resume(f"cannot start at epoch {epoch}")

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``)."""
        fields = {name: (tuple(values.shape[1:]), values.dtype) for name, values in self.fields.items()}
        return {self.payload_name: self._record, **fields, "key": ((), np.dtype(np.int64))}

    def order_of(self, epoch: int, reservoir: int, n: int) -> np.ndarray:
        """This job's permutation of a reservoir's ``n`` stored (ascending) keys."""
        return job_permutation(self.job_seed, epoch, reservoir, n)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.close()
        return self._run.start(_Run(self, _Link(self), self._pool))

    def _reached(self, epoch: int, position: int) -> None:
        """A batch of server epoch ``epoch`` was handed over (a job keeps no position: it cannot resume)."""
        self._epoch = epoch

    def close(self) -> None:
        """Detach from the server (idempotent)."""
        self._run.close()

    def __repr__(self) -> str:
        return (f"SharedSampler({self.name!r}, dataset={location_string(self.path)!r}, job_seed={self.job_seed}, "
                f"batch_size={self.batch_size}, epochs={self.epochs})")


class _Link:
    """The batch supply of one iteration (:class:`~shardkit.readers.sampler._Run`): a connection, the
    mapped ring, a heartbeat thread and a thread copying batches out of the ring. The threads never
    reference the iterator, so an abandoned one is collected and its finalizer detaches the job."""

    def __init__(self, s: SharedSampler) -> None:
        self._s = s
        self._done = False
        self._epochs_done = 0
        self._cur: tuple[Reservoir, np.ndarray] | None = None  # the reservoir being read, this job's order of it
        self._pos = 0  # next record of the current reservoir
        self._epos = 0  # its position in the job's epoch order
        self._g = 0  # the global batch this consumer fills
        self._stop = threading.Event()
        self._silence = s.lease_seconds
        self.error: BaseException | None = None
        self._ring, self._chan = self._connect()
        self._batches: queue.Queue[BatchReady | RunDone] = queue.Queue(maxsize=BATCH_PREFETCH)
        self._threads = [threading.Thread(target=target, name=tname, daemon=True) for target, tname in
                         ((self._heartbeat, "shardkit-shared-heartbeat"), (self._assemble, "shardkit-shared-batches"))]
        for t in self._threads:
            t.start()

    def _connect(self) -> tuple[Ring, Channel]:
        """Check the run directory again, map the ring, connect, present the token and be welcomed."""
        s = self._s
        run, info = _open_server(s.name, s.base_dir, s.connect_timeout)
        ring: Ring | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if info.pid != s._info.pid or info.fingerprint != s._info.fingerprint:
                raise SamplerError(f"server {s.name!r} was restarted with pid {info.pid}; create a new SharedSampler")
            token = _read_token(run)
            ring = Ring.attach(run, s._layout)
            run.check_file("sock", stat.S_ISSOCK)
            sock.settimeout(max(s.connect_timeout, self._silence))
            try:
                sock.connect(run.address())
            except OSError as exc:
                raise SamplerError(f"cannot connect to shardkit server {s.name!r}: {exc}") from None
            chan = Channel(sock, send_timeout=self._silence, peer=f"shardkit server {s.name!r} (pid {info.pid})")
            try:
                creds = chan.credentials()
            except OSError as exc:
                raise self._lost(exc, "checking who answered") from None
            if creds is not None and creds[1] != os.geteuid():
                raise InsecurePathError(f"{run.path / 'sock'}: answered by pid {creds[0]} of uid {creds[1]}, expected "
                                        f"a process of uid {os.geteuid()} (this user); refusing to attach")
            self._chan = chan
            self._send(Hello(token, bytes.fromhex(info.fingerprint), os.getpid(), s.rank, s.world_size, s.group),
                       "presenting this job")
            match self._recv():
                case Welcome():
                    return ring, chan
                case Refused(reason=reason):
                    raise SamplerError(f"shardkit server {s.name!r} refused this job: {reason}")
                case other:
                    raise ProtocolError(f"shardkit server {s.name!r}: expected Welcome, found {type(other).__name__}")
        except BaseException:
            sock.close()
            if ring is not None:
                ring.close()
            raise
        finally:
            run.close()

    # ------------------------------------------------------------------ messaging
    def _lost(self, exc: OSError, doing: str) -> SamplerError:
        """The SamplerError for a failure of the connection (a reset, a broken pipe, an early EOF)."""
        s = self._s
        what = "it closed the connection" if isinstance(exc, PeerClosed) else f"{type(exc).__name__}: {exc.strerror or exc}"
        return SamplerError(f"shardkit server {s.name!r} (pid {s._info.pid}) went away while {doing} ({what})")

    def _send(self, msg: Message, doing: str) -> None:
        """Send ``msg``; SamplerError (see :meth:`_lost`) if the socket fails."""
        try:
            self._chan.send(msg)
        except PeerTimeoutError:
            raise
        except OSError as exc:
            raise self._lost(exc, doing) from None

    def _recv(self) -> Message:
        """The server's next message other than a heartbeat; PeerTimeoutError after ``lease_seconds`` of silence."""
        s = self._s
        deadline = time.monotonic() + self._silence
        while True:
            if self._stop.is_set():
                raise Stopped()
            try:
                msg = self._chan.recv(_POLL)
            except ProtocolError as exc:
                raise ProtocolError(f"shardkit server {s.name!r}: {exc}") from None
            except OSError as exc:
                raise self._lost(exc, "this job waited for its next message") from None
            if msg is not None and not isinstance(msg, Beat):
                return msg
            now = time.monotonic()
            if msg is not None:
                deadline = now + self._silence
            elif now >= deadline:
                raise PeerTimeoutError(
                    f"shardkit server {s.name!r} (pid {s._info.pid}) sent nothing for {self._silence:g} s (its "
                    f"lease): it is stopped or hung; giving up"
                )

    def _heartbeat(self) -> None:
        period = max(0.05, self._silence / 4)
        while not self._stop.wait(period):
            try:
                self._chan.send(Beat())
            except (OSError, PeerTimeoutError):
                return  # the batch thread reports what happened to the server

    def _detach(self) -> None:
        """Tell the server we are gone and close the socket (any thread; idempotent)."""
        if self._chan.closed:
            return
        with suppress(OSError, PeerTimeoutError):
            self._chan.send(Bye())
        self._chan.close()

    # ------------------------------------------------------------------ background assembly
    def _assemble(self) -> None:
        try:
            while (item := self._next_batch()) is not None:
                put(self._batches, item, self._stop)
            self._detach()  # done: the server stops counting on us at once
            put(self._batches, RunDone(), self._stop)
        except Stopped:
            return
        except BaseException as exc:
            self.error = exc

    def get(self) -> BatchReady | RunDone:
        """The next batch, or :class:`RunDone`; raises what stopped the batch thread."""
        while True:
            try:
                return self._batches.get(timeout=_POLL)
            except queue.Empty:
                if self._threads[-1].is_alive() or not self._batches.empty():
                    continue
            exc = self.error
            if exc is None:
                raise SamplerError("shared sampler: batch thread ended unexpectedly")
            if isinstance(exc, ShardkitError):
                raise exc
            raise SamplerError(f"shared sampler: {type(exc).__name__}: {exc}") from exc

    def _next_reservoir(self) -> bool:
        """Wait for the next reservoir (into ``_cur``); False when the server is done."""
        layout = self._s._layout
        match self._recv():
            case Done():
                self._done = True
                return False
            case Reservoir(slot=slot, count=count) as res if slot < layout.slots and 0 < count <= layout.slot_records:
                self._cur = (res, self._s.order_of(res.epoch, res.index, count))
                self._pos = 0
                return True
            case other:
                raise ProtocolError(f"shardkit server {self._s.name!r}: unexpected or invalid {other!r}")

    def _next_batch(self) -> BatchReady | None:
        """This consumer's next batch, copied out of the ring into a pool buffer, or None when done."""
        pool = self._s._pool
        buf = pool.acquire(self._stop)
        try:
            batch = self._fill(buf.array)
        except BaseException:
            pool.release(buf)
            raise
        if batch is None:
            pool.release(buf)
            return None
        return BatchReady(*batch, buf)

    def _fill(self, out: np.ndarray) -> tuple[dict[str, np.ndarray], int, int] | None:
        """Copy this consumer's next batch into ``out``: ``(batch, epoch, position after it)``."""
        s = self._s
        keys = np.empty(s.batch_size, dtype=np.int64)
        filled = 0
        epoch = -1
        while True:
            if self._cur is None:
                if self._done or (s.epochs is not None and self._epochs_done >= s.epochs) or not self._next_reservoir():
                    break
            assert self._cur is not None
            res, order = self._cur
            n, epoch = res.count, res.epoch
            complete = False
            # Epoch positions [lo, hi) of our slice of global batch g; None: nothing more this epoch, pass it on.
            target = consumer_slice(self._g, s.num_records, s.batch_size, s.rank, s.world_size, drop_last=s.drop_last)
            skip = n - self._pos if target is None else min(max(0, target[0] - self._epos), n - self._pos)
            self._pos += skip
            self._epos += skip
            if target is not None and self._pos < n:
                hi = target[1]
                take = min(hi - self._epos, n - self._pos)
                idx = order[self._pos : self._pos + take]
                np.take(self._ring.payload[res.slot], idx, axis=0, out=out[filled : filled + take])
                keys[filled : filled + take] = self._ring.keys[res.slot][idx]
                self._pos += take
                self._epos += take
                filled += take
                if self._epos == hi:
                    self._g += 1
                    complete = True
            if self._pos == n:
                self._send(Release(res.seq), f"releasing reservoir {res.seq}")
                self._cur = None
                if res.last:
                    self._epochs_done += 1
                    self._epos = self._g = 0
                    if filled:
                        break  # batches never span epochs
            if complete:
                break
        if filled == 0:
            return None
        batch = assemble_batch(s.payload_name, out[:filled], s.fields, keys[:filled])
        batch["key"] = s._local_keys(batch["key"])  # global key -> the record's key in its dataset
        return batch, epoch, self._epos

    def shutdown(self) -> None:
        """Say goodbye, stop the threads, unmap the ring (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(10.0)
        self._detach()
        self._ring.close()
