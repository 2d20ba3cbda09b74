"""The server half of the shared tier stack: :class:`TierServer` and :func:`serve`.

Its tiers are the sampler's own :class:`~shardkit.tiers.pipeline.Pipeline`, which reads each
published block straight into a free ring slot (the server is its
:class:`~shardkit.tiers.pipeline.SlotSink`). Design: docs/design.md §8; security:
docs/design.md §13.
"""

from __future__ import annotations

import atexit
import hmac
import itertools
import logging
import os
import secrets
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from shardkit.converters.options import count, duration
from shardkit.declare import UserOptions, option, shared_option
from shardkit.errors import ConfigError, PeerTimeoutError, ProtocolError, SamplerError, ShardkitError
from shardkit.order.schedule import ArrayOrder, plan_shape
from shardkit.readers.options import SamplerOptions, TierSizes, path_or_none, resolve_decoders
from shardkit.readers.sources import Mixture, as_source
from shardkit.serve.order import partition
from shardkit.serve.protocol import (
    MAX_INFO_BYTES,
    PROTOCOL_VERSION,
    TOKEN_BYTES,
    Beat,
    Bye,
    Channel,
    Done,
    Hello,
    Message,
    MixtureInfo,
    PeerClosed,
    Refused,
    Release,
    Reservoir,
    ServerInfo,
    Welcome,
    encode,
)
from shardkit.serve.ring import Ring, RingLayout
from shardkit.serve.rundir import RunDir, check_name, run_dir_path
from shardkit.stopping import Stopped
from shardkit.stores import Location, location_string
from shardkit.tiers.pipeline import BlockRead, EpochEnd, Pipeline, Segment
from shardkit.tiers.ssd import READ_CHUNK_BYTES
from shardkit.tiers.stats import SamplerStats
from shardkit.units import Capacity

__all__ = ["ServeOptions", "SERVE_DEFAULTS", "TierServer", "serve"]

logger = logging.getLogger(__name__)

#: How often waiting threads wake up to look at the stop flag, leases and heartbeats.
_TICK = 0.2


@dataclass(frozen=True)
class ServeOptions(UserOptions):
    """Every option of :class:`TierServer`, validated and normalised on construction.

    Values use :mod:`shardkit.units` (``ram_size="2GiB"``, ``lease_seconds="2min"``); options a
    sampler has too share its declarations (:func:`~shardkit.declare.shared_option`).
    """

    tiers: tuple[str, ...] = shared_option(SamplerOptions, "tiers")
    ram_size: Capacity = shared_option(
        SamplerOptions, "ram_size", doc="",
        help="The shared-memory ring: --slots slots of ram-size/slots each (bytes like 2GiB, or 10000records).")
    ssd_size: Capacity = shared_option(
        SamplerOptions, "ssd_size", help="SSD-tier budget: two reservoirs of half of it. Only with --tiers ram,ssd.")
    ssd_dir: Path | None = shared_option(SamplerOptions, "ssd_dir")
    seed: int = shared_option(SamplerOptions, "seed", doc="",
                              help="Seeds the server's partition of every epoch into reservoirs.")
    epochs: int | None = shared_option(
        SamplerOptions, "epochs", default=None, cli_type=str,
        help="Serve this many epochs, then stop (default: until SIGTERM/Ctrl-C).")
    slots: int = option(3, "Server", count(2),
                        help="Ring slots (>= 2); a slow job holds the others back by at most this many reservoirs.")
    wait_for: int = option(1, "Server", count(1), help="Jobs to wait for before the first epoch.")
    lease_seconds: float = option(
        30.0, "Server", duration, flag="--lease", show=lambda s: f"{s:g}s",
        help="A job silent this long is dropped, and a job hearing nothing from the server this long gives up "
             "(30s, 2min).")
    gap_bytes: int = shared_option(SamplerOptions, "gap_bytes")
    max_connections: int = option(64, "Server", count(1), help="Connections served at once; more are refused.")
    base_dir: Path | None = option(None, "Server", path_or_none, flag=None,
                                   help="Where the run directory goes (default /dev/shm, else the temp dir).")
    decode_workers: int | None = shared_option(
        SamplerOptions, "decode_workers",
        help="Threads that decode compressed records (jpeg, png, webp, flac, zstd, ...) into the ring's slots while "
             "the next records are read; 0 decodes in the reading thread. Default: one per CPU this process may use. "
             "Jobs always receive decoded records (the ring has no room for stored lengths).")

    KIND = "server option"


#: Every server option's default, validated: what ``shardkit serve`` shows and passes when a flag is not given.
SERVE_DEFAULTS = ServeOptions()
ServeOptions.__doc__ = f"{ServeOptions.__doc__}{ServeOptions.describe()}"


class _Job:
    """One attached consumer: its channel and lease."""

    def __init__(self, jid: int, channel: Channel, hello: Hello, pid: int) -> None:
        self.id = jid
        self.channel = channel
        self.pid, self.group, self.rank, self.world = pid, hello.group, hello.rank, hello.world
        self.last_seen = self.last_sent = time.monotonic()

    def send(self, msg: Message) -> None:
        self.channel.send(msg)
        self.last_sent = time.monotonic()


class TierServer:
    """One tier stack for every job of this user on this machine that attaches to ``name``.

    Parameters
    ----------
    dataset
        Dataset directory (the disk tier), or a :class:`~shardkit.readers.sources.Mixture`, whose
        order (seeded with its own seed, else ``seed``) the server then reads.
    name
        The name jobs attach to (``[A-Za-z0-9_-]``, at most 64 characters).
    options, **values
        The options of :class:`ServeOptions` (each documented there: ``tiers``, ``ram_size`` = the
        whole ring of ``slots`` slots of ``K`` records, ``ssd_size``, ``ssd_dir``, ``seed``,
        ``epochs``, ``slots``, ``wait_for``, ``lease_seconds``, ``gap_bytes``, ``max_connections``,
        ``base_dir``) as one object (what the CLI builds) or as keywords, which replace its fields.
    """

    #: Seconds a new connection has to present its :class:`Hello`.
    handshake_seconds = 10.0

    def __init__(
        self, dataset: Location | Mixture, *, name: str, options: ServeOptions | None = None, **values: Any
    ) -> None:
        self.name = check_name(name)
        if options is None:
            options = ServeOptions.parse(**values)
        elif values:
            ServeOptions.parse(source=options.source, **values)  # unknown names are refused as such
            options = replace(options, **values)
        self.options = o = options
        self.tiers, self.seed, self.slots, self.epochs = o.tiers, o.seed, o.slots, o.epochs
        self.lease_seconds = o.lease_seconds
        #: What the server serves: a mixture of one dataset or more (see :mod:`shardkit.readers.sources`).
        m = self.source = as_source(dataset).resolved()  # a missing or broken dataset fails here, clearly
        self.path: Path | str = m.paths[0]
        if m.seed is not None:
            self.seed = m.seed  # the mixture's own seed defines its order
        self._plan = m.plan(self.seed)
        self.fingerprint = m.fingerprint()
        self.num_records = m.epoch_size
        self.record_nbytes = rec = m.record.nbytes
        record = (tuple(m.record.shape), np.dtype(m.record.dtype))
        n = max(1, self.num_records)
        #: K, records per slot (= per published reservoir block).
        self.slot_records = max(1, min(o.ram_size.to_bytes(rec) // (o.slots * rec), n))
        self.layout = RingLayout(o.slots, self.slot_records, *record)
        #: K1, records per SSD reservoir (None without the SSD tier).
        self.ssd_block: int | None = None
        self.ssd_dir: Path | None = None
        if "ssd" in self.tiers:
            self.ssd_block = max(1, min(o.ssd_size.to_bytes(rec) // (2 * rec), n))
            self.ssd_dir = o.ssd_dir if o.ssd_dir is not None else Path(tempfile.gettempdir())
            if not self.ssd_dir.is_dir():
                raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.ssd_dir)!r}")
        self.stats = SamplerStats()
        #: Epochs read completely for at least one job.
        self.epochs_served = 0
        #: Reservoir blocks published.
        self.published = 0
        self.error: BaseException | None = None
        #: Where the run directory is (created by :meth:`start`).
        self.rundir = run_dir_path(self.name, o.base_dir)
        self.info: ServerInfo | None = None
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._jobs: dict[int, _Job] = {}
        self._active: set[int] = set()
        self._pending: set[int] = set()
        self._holders: list[set[int]] = [set() for _ in range(self.slots)]
        self._slot_seq = [0] * self.slots
        self._next_job = 1
        self._started_first = False
        self._finished = False
        self._connections = 0
        self._conn_threads: set[threading.Thread] = set()
        self._run: RunDir | None = None
        self._lock_fd: int | None = None
        self._token = b""
        self._ring: Ring | None = None
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        #: Blocks the pipeline has taken a ring slot for (it runs at most ``slots`` ahead of publishing).
        self._reserved = 0
        self._pipeline: Pipeline | None = None

    # ------------------------------------------------------------------ start / stop
    def start(self) -> TierServer:
        """Claim the name, create the ring, listen, publish ``info.json``; then serve in the background."""
        self._claim()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        return self

    def _claim(self) -> None:
        run = RunDir.claim(self.rundir)
        fd = run.lock()
        if fd is None:
            who = ""
            with suppress(OSError, ShardkitError):
                info = ServerInfo.from_json(run.read_file("info.json", MAX_INFO_BYTES), source="info.json")
                who = f" (pid {info.pid}, serving {info.dataset})"
            run.close()
            raise ConfigError(
                f"a shardkit server named {self.name!r} is already running{who}; stop it or choose another --name"
            )
        self._run, self._lock_fd = run, fd
        removed = run.clear()  # we hold the lock: anything else here belongs to a dead server
        if removed:
            logger.info("server %s: removed leftovers of a dead server: %s", self.name, ", ".join(removed))

    def _create(self) -> None:
        run = self._run
        assert run is not None
        self._token = secrets.token_bytes(TOKEN_BYTES)
        run.write_file("token", self._token.hex().encode())
        self._ring = Ring.create(run, self.layout)
        self._listener = listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(run.address())
        os.chmod(run.address(), 0o600)
        listener.listen(min(self.options.max_connections, 128))
        listener.settimeout(_TICK)
        self.info = ServerInfo(
            version=PROTOCOL_VERSION, name=self.name, pid=os.getpid(), dataset=str(self.path),
            fingerprint=self.fingerprint, slots=self.slots, slot_records=self.slot_records, seed=self.seed,
            num_records=self.num_records, record_nbytes=self.record_nbytes, tiers=self.tiers,
            lease_seconds=self.lease_seconds, started=time.time(), mixture=MixtureInfo(
                tuple(map(str, self.source.paths)), tuple(map(str, self.source.weights)), self.source.epoch_size),
        )  # fmt: skip
        doc = self.info.to_json()
        if len(doc) > MAX_INFO_BYTES:
            raise ConfigError(f"server {self.name!r}: its info.json would be {len(doc)} bytes, jobs read at most "
                              f"{MAX_INFO_BYTES}; shorten the dataset paths")
        run.write_file("info.json", doc)  # last: a job never sees a half-started server
        for target, tname in ((self._accept_loop, "shardkit-serve-accept"), (self._produce, "shardkit-serve-producer")):
            t = threading.Thread(target=target, name=tname, daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("server %s: serving %s (N=%d, %d slots of %d records) at %s", self.name, self.path,
                    self.num_records, self.slots, self.slot_records, self.rundir)

    @property
    def mixture(self) -> Mixture | None:
        """The source when its order is a mixture's, ``None`` for one dataset read as it is."""
        return None if self._plan.single else self.source

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the server has served its epochs (or failed); True if it has finished."""
        if not self._threads:
            return True
        producer = self._threads[-1]
        producer.join(timeout)
        if not producer.is_alive() and self.error is not None:
            err, self.error = self.error, None
            if isinstance(err, ShardkitError):
                raise err
            raise SamplerError(f"server {self.name}: {type(err).__name__}: {err}") from err
        return not producer.is_alive()

    def close(self) -> None:
        """Stop serving; unlink the ring, the SSD directory and the run directory (idempotent)."""
        if self._stop.is_set():
            return
        atexit.unregister(self.close)
        with self._cv:
            self._stop.set()
            self._cv.notify_all()
            pipeline = self._pipeline
        if pipeline is not None:
            pipeline.shutdown()  # the producer's wait for a block ends; the SSD directory goes
        me = threading.current_thread()
        with self._cv:
            threads = [*self._threads, *self._conn_threads]
        for t in threads:
            if t is not me:
                t.join(10.0)
        with self._cv:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for job in jobs:
            job.channel.close()
        if self._listener is not None:
            self._listener.close()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._run is not None:
            if self._lock_fd is not None:
                self._run.remove()
                os.close(self._lock_fd)
                self._lock_fd = None
            self._run.close()
            self._run = None
        logger.info("server %s: stopped", self.name)

    def __enter__(self) -> TierServer:
        return self.start() if self._run is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def jobs(self) -> int:
        """Attached jobs (active + waiting for the next epoch)."""
        with self._cv:
            return len(self._jobs)

    @property
    def connections(self) -> int:
        """Open connections: attached jobs and connections still in their handshake."""
        with self._cv:
            return self._connections

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("server %s: accept failed: %s", self.name, exc)
                time.sleep(_TICK)
                continue
            try:
                self._admit(sock)
            except BaseException as exc:  # e.g. no thread could be started: one line, keep accepting
                logger.error("server %s: could not serve a connection: %s: %s", self.name, type(exc).__name__, exc)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        """Serve ``sock`` in its own thread, or turn it away beyond ``max_connections``."""
        t = threading.Thread(target=self._serve_connection, args=(sock,), name="shardkit-serve-job", daemon=True)
        with self._cv:
            full = self._connections >= self.options.max_connections
            if not full:
                self._connections += 1
                self._conn_threads.add(t)
        if full:
            self._turn_away(sock)
            return
        try:
            t.start()
        except BaseException:
            with self._cv:
                self._conn_threads.discard(t)
                self._connections -= 1
            raise

    def _turn_away(self, sock: socket.socket) -> None:
        """Refuse a connection beyond ``max_connections`` without reading from it."""
        limit = self.options.max_connections
        logger.warning("server %s: refused a connection: already %d connections (max_connections)", self.name, limit)
        with suppress(OSError), sock:
            sock.settimeout(1.0)
            sock.sendall(encode(Refused(f"server {self.name!r} already serves {limit} connections (max_connections)")))

    def _serve_connection(self, sock: socket.socket) -> None:
        """One connection's thread: handshake, then the job's messages; every way out logs one line at most."""
        channel = Channel(sock, send_timeout=self.lease_seconds, peer="a job")
        job: _Job | None = None
        why = "detached"
        try:
            job = self._handshake(channel)
            if job is not None:
                why = self._converse(job)
        except PeerClosed:
            pass
        except (ProtocolError, PeerTimeoutError) as exc:
            why = f"dropped: {exc}"
            logger.warning("server %s: %s: %s; connection closed", self.name, channel.peer, exc)
            if job is None:
                self._reply(channel, Refused(str(exc)))
        except OSError as exc:
            why = f"connection failed: {exc}"
        except BaseException as exc:
            why = f"dropped after an internal error: {type(exc).__name__}: {exc}"
            logger.error("server %s: connection thread failed: %s: %s", self.name, type(exc).__name__, exc)
        finally:
            if job is not None:
                self._drop(job.id, why)
            channel.close()
            with self._cv:
                self._connections -= 1
                self._conn_threads.discard(threading.current_thread())

    def _reply(self, channel: Channel, msg: Message) -> None:
        with suppress(OSError):
            channel.send(msg)

    def _handshake(self, channel: Channel) -> _Job | None:
        """Check the peer and its :class:`Hello`; register and welcome the job, or refuse (None)."""
        creds = channel.credentials()
        if creds is not None and creds[1] != os.geteuid():
            logger.warning("server %s: refused pid %d of uid %d (jobs must run as uid %d)", self.name, *creds, os.geteuid())
            return None
        hello = None
        deadline = time.monotonic() + self.handshake_seconds
        while hello is None and not self._stop.is_set() and time.monotonic() < deadline:
            hello = channel.recv(min(_TICK, max(0.0, deadline - time.monotonic())))
        if hello is None:
            if not self._stop.is_set():
                logger.warning("server %s: a connection sent no hello within %g s; closed", self.name, self.handshake_seconds)
            return None
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected Hello first, found {type(hello).__name__}")
        pid = creds[0] if creds is not None else hello.pid  # the kernel's word over the peer's
        channel.peer = f"job pid {pid}"
        if not hmac.compare_digest(hello.token, self._token):
            logger.warning("server %s: refused pid %d: wrong token", self.name, pid)
            self._reply(channel, Refused(f"server {self.name!r}: wrong token (not this run's secret)"))
            return None
        if not hmac.compare_digest(hello.fingerprint, bytes.fromhex(self.fingerprint)):
            self._reply(channel, Refused(
                f"server {self.name!r} serves {self.path}; the job opened another dataset (fingerprints differ)"))
            return None
        with self._cv:
            clash = self._group_clash(hello.group, hello.rank, hello.world)
            job = None
            if clash is None:
                job = _Job(self._next_job, channel, hello, pid)
                # Welcomed before any other thread can see the job: once it is listed, the epoch
                # thread may send it a Reservoir and the heartbeat thread a Beat, which must follow
                # the Welcome on the wire (a few bytes to a fresh socket: this does not block).
                job.send(Welcome(job.id))
                self._next_job += 1
                self._jobs[job.id] = job
                self._pending.add(job.id)
                self._cv.notify_all()
            finished = self._finished
        if job is None:
            self._reply(channel, Refused(clash or "refused"))
            return None
        if finished:
            job.send(Done())  # every epoch has been served already
        logger.info("server %s: job %d (pid %d) attached; starts at the next epoch", self.name, job.id, job.pid)
        return job

    def _converse(self, job: _Job) -> str:
        """Serve one attached job's messages; heartbeat it while the server has nothing to say."""
        beat_every = self.lease_seconds / 4
        while not self._stop.is_set():
            msg = job.channel.recv(min(_TICK, beat_every / 2))  # beats on time even for a short lease
            if msg is not None:
                job.last_seen = time.monotonic()
            match msg:
                case Release(seq=seq):
                    self._release(job.id, seq)
                case Bye():
                    return "detached"
                case Beat() | None:
                    pass
                case _:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a job")
            if time.monotonic() - job.last_sent >= beat_every:
                job.send(Beat())
        return "server stopped"

    def _group_clash(self, group: str | None, rank: int, world: int) -> str | None:
        """Why a consumer cannot join ``group`` (called with the condition held), or None."""
        if group is None:
            return None
        for j in self._jobs.values():
            if j.group != group:
                continue
            if j.world != world:
                return f"group {group!r} has world_size {j.world}, this consumer says {world}"
            if j.rank == rank:
                return f"group {group!r} already has a consumer of rank {rank} (pid {j.pid}); use another job_seed or group"
            if j.id in self._active:
                return f"group {group!r} is already running; a new consumer cannot join it mid-run"
        return None

    def _activatable(self) -> set[int]:
        """Pending jobs that may start now: single jobs, and groups whose every rank is attached."""
        pending = [self._jobs[jid] for jid in self._pending]
        attached = Counter(job.group for job in pending)  # a group's members all have one world size
        return {job.id for job in pending if job.group is None or attached[job.group] == job.world}

    def _release(self, jid: int, seq: int) -> None:
        with self._cv:
            if seq in self._slot_seq:
                holders = self._holders[self._slot_seq.index(seq)]
                holders.discard(jid)
                if not holders:
                    self._cv.notify_all()

    def _drop(self, jid: int, why: str) -> None:
        with self._cv:
            job = self._jobs.pop(jid, None)
            if job is None:
                return
            self._active.discard(jid)
            self._pending.discard(jid)
            for h in self._holders:
                h.discard(jid)
            self._cv.notify_all()
        job.channel.close()
        logger.info("server %s: job %d (pid %d) %s", self.name, jid, job.pid, why)

    def _expire_leases(self) -> None:
        """Drop jobs silent for longer than the lease (called with the condition held)."""
        now = time.monotonic()
        late = [j.id for j in self._jobs.values() if now - j.last_seen > self.lease_seconds]
        for jid in late:
            threading.Thread(target=self._drop, args=(jid, "lease expired"), daemon=True).start()
            job = self._jobs.get(jid)
            if job is not None:
                job.last_seen = now  # do not spawn twice while the drop waits for the lock

    # ------------------------------------------------------------------ producing
    def _produce(self) -> None:
        pipeline: Pipeline | None = None
        try:
            epoch = 0
            while not self._stop.is_set() and (self.epochs is None or epoch < self.epochs):
                if not self._begin_epoch(epoch):
                    return
                if pipeline is None:
                    pipeline = self._start_pipeline(epoch)
                if self._run_epoch(pipeline, epoch):
                    self.epochs_served += 1
                else:  # its blocks read ahead are not published: the next epoch starts afresh
                    self._stop_pipeline(pipeline)
                    pipeline = None
                epoch += 1
            self._finish()
        except Stopped:
            return
        except BaseException as exc:
            if self._stop.is_set():  # closing: the pipeline was shut down under the producer
                return
            self.error = exc
            logger.error("server %s: producer failed: %s: %s", self.name, type(exc).__name__, exc)
            with self._cv:
                jobs = list(self._jobs.values())
            for job in jobs:
                job.channel.close()
        finally:
            if pipeline is not None:
                self._stop_pipeline(pipeline)

    def _begin_epoch(self, epoch: int) -> bool:
        need = self.options.wait_for if not self._started_first else 1
        with self._cv:
            while len(ready := self._activatable()) + len(self._active) < need:
                if self._stop.is_set():
                    return False
                self._expire_leases()
                self._cv.wait(_TICK)
            self._active |= ready
            self._pending -= ready
            self._started_first = True
            logger.info("server %s: epoch %d for jobs %s", self.name, epoch, sorted(self._active))
        return True

    def _segments(self, first: int) -> Iterator[Segment]:
        """The epochs from ``first`` on as the pipeline's segments: each ``pi_e`` whole, for one consumer."""
        n = self.num_records
        shape = plan_shape(n, 0, max(1, n), 0, 1)
        for epoch in itertools.count(first) if self.epochs is None else range(first, self.epochs):
            yield Segment(epoch, shape, ArrayOrder(self._plan.slot_keys(epoch, partition(self.seed, epoch, n))))

    def _start_pipeline(self, epoch: int) -> Pipeline:
        """The tiers from ``epoch`` on: blocks of ``K`` records (inside SSD reservoirs of ``K1``)."""
        rec, k = self.record_nbytes, self.slot_records
        sizes = TierSizes(
            ram_bytes=self.slots * k * rec, ram_block=k, first_block=k, ssd_bytes=None if self.ssd_block is None
            else 2 * self.ssd_block * rec, ssd_block=self.ssd_block, static_records=0, num_records=self.num_records,
            ssd_copy_bytes=READ_CHUNK_BYTES if self.ssd_block is not None else 0, record_nbytes=rec,
        )  # fmt: skip
        with self._cv:
            if self._stop.is_set():
                raise Stopped()
            self._reserved = self.published
            self._pipeline = Pipeline(self.source, self._segments(epoch), fields={}, stats=self.stats, sizes=sizes,
                                      pool=None, ssd_dir=self.ssd_dir, gap_bytes=self.options.gap_bytes, sink=self,
                                      dataset_options={"decode_workers": resolve_decoders(self.options.decode_workers)})
            return self._pipeline

    def _stop_pipeline(self, pipeline: Pipeline) -> None:
        pipeline.shutdown()
        with self._cv:
            if self._pipeline is pipeline:
                self._pipeline = None

    def acquire(self, stop: threading.Event) -> tuple[int, np.ndarray]:
        """The ring slot ``i % slots`` for the pipeline's block ``i``, once every job released block ``i - slots``."""
        with self._cv:
            slot = self._reserved % self.slots
            while self._reserved - self.published >= self.slots or self._holders[slot]:
                if stop.is_set() or self._stop.is_set():
                    raise Stopped()
                self._expire_leases()
                self._cv.wait(_TICK)
            if stop.is_set() or self._stop.is_set():
                raise Stopped()
            self._reserved += 1
            assert self._ring is not None
            return slot, self._ring.payload[slot]

    def _run_epoch(self, pipeline: Pipeline, epoch: int) -> bool:
        """Publish every block of ``epoch`` the pipeline reads; False if every job left (epoch abandoned)."""
        assert self._ring is not None
        ring = self._ring
        r = 0
        while True:
            match pipeline.get():
                case BlockRead(slot=int(slot), keys=keys) as block:
                    if self._stop.is_set():
                        raise Stopped()
                    n = int(keys.size)
                    ring.keys[slot, :n] = keys
                    with self._cv:
                        if not self._active:
                            logger.info("server %s: every job left during epoch %d; skipping its rest", self.name, epoch)
                            return False
                        self.published += 1
                        seq = self._slot_seq[slot] = self.published  # jobs release the slot by it
                        recipients = [self._jobs[j] for j in sorted(self._active) if j in self._jobs]
                        self._holders[slot] = {j.id for j in recipients}
                        self._cv.notify_all()
                    msg = Reservoir(seq, epoch, r, slot, n, block.last)
                    r += 1
                    for job in recipients:
                        try:
                            job.send(msg)
                        except OSError as exc:  # PeerTimeoutError too (a TimeoutError)
                            self._drop(job.id, f"went away ({exc})")
                case EpochEnd():
                    return True
                case other:
                    raise SamplerError(f"server {self.name}: expected a block of epoch {epoch}, found {other!r} "
                                       "(internal error)")

    def _finish(self) -> None:
        """After the last epoch: wait until every slot is released (or its holders gone), then say done."""
        with self._cv:
            while any(self._holders) and self._active and not self._stop.is_set():
                self._expire_leases()
                self._cv.wait(_TICK)
            self._finished = True
            jobs = list(self._jobs.values())
        for job in jobs:
            with suppress(OSError, PeerTimeoutError):
                job.send(Done())
        logger.info("server %s: served %d epochs", self.name, self.epochs_served)

    def __repr__(self) -> str:
        return (f"TierServer({location_string(self.path)!r}, name={self.name!r}, tiers={','.join(self.tiers)}, "
                f"slots={self.slots}x{self.slot_records}, K1={self.ssd_block}, seed={self.seed})")


class _Terminated(SystemExit):
    """SIGTERM received: leave through the normal cleanup path."""


def serve(dataset: Location | Mixture, *, name: str, ready: Callable[[TierServer], Any] | None = None,
          **options: Any) -> TierServer:
    """Run a :class:`TierServer` in the foreground until its epochs are served, SIGTERM or Ctrl-C; clean up always.

    ``ready(server)`` is called once it listens. Returns the closed server (its :attr:`~TierServer.stats`).
    """
    server = TierServer(dataset, name=name, **options)
    in_main = threading.current_thread() is threading.main_thread()
    previous: Any = None

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(128 + signum)

    if in_main:
        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        server.start()
        if ready is not None:
            ready(server)
        while not server.wait(0.2):
            pass
    finally:
        server.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return server
