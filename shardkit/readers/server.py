"""The server half of the shared tier stack: :class:`TierServer` and :func:`serve`.

The design (order, shared-memory ring, release bound, leases, lifetime and stale cleanup) is
described in :mod:`shardkit.readers.shared`, next to the job side.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import fcntl
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection, shared_memory
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from shardkit.errors import ConfigError, SamplerError
from shardkit.formats import DEFAULT_GAP_BYTES, Dataset
from shardkit.readers.config import parse_capacity, parse_tiers
from shardkit.readers.schedule import epoch_permutation
from shardkit.readers.shared import (
    PROTOCOL_VERSION,
    SHM_PREFIX,
    _untrack,
    check_name,
    dataset_fingerprint,
    run_dir,
)
from shardkit.readers.ssd import SsdSpace, _Stopped, write_reservoir
from shardkit.readers.stats import SamplerStats
from shardkit.stores import Location, as_location

__all__ = ["TierServer", "serve", "remove_stale_server"]

logger = logging.getLogger(__name__)

_POLL = 0.05
_ALIGN = 64


@dataclass
class _Job:
    id: int
    conn: connection.Connection
    pid: int
    group: str | None = None
    rank: int = 0
    world: int = 1
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(msg)


def _shm_dir() -> Path:
    return Path("/dev/shm")


def _unlink_segment(shm: shared_memory.SharedMemory) -> None:
    """Unlink an untracked segment (``SharedMemory.unlink`` would also unregister it from a tracker
    that no longer knows it)."""
    path = _shm_dir() / shm.name
    try:
        if path.parent.is_dir():
            path.unlink()
        else:  # pragma: no cover - non-Linux
            shm.unlink()
    except FileNotFoundError:
        pass


def remove_stale_server(name: str, rdir: Path) -> list[str]:
    """Remove what a dead server ``name`` left behind (caller holds ``rdir/lock``); return what went."""
    removed: list[str] = []
    info_path = rdir / "info.json"
    segments: set[str] = set()
    try:
        segments.add(str(json.loads(info_path.read_text())["shm"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    shm_dir = _shm_dir()
    if shm_dir.is_dir():
        prefix = f"{SHM_PREFIX}{name}."
        for p in shm_dir.iterdir():
            if p.name.startswith(prefix) and p.name[len(prefix):].isdigit():
                segments.add(p.name)
    for seg in sorted(segments):
        try:
            (shm_dir / seg).unlink()
            removed.append(str(shm_dir / seg))
        except FileNotFoundError:
            pass
    for f in ("sock", "info.json", "info.json.partial"):
        try:
            (rdir / f).unlink()
            removed.append(str(rdir / f))
        except FileNotFoundError:
            pass
    if removed:
        logger.info("server %s: removed leftovers of a dead server: %s", name, ", ".join(removed))
    return removed


class TierServer:
    """One tier stack for every job on this machine that attaches to ``name``.

    Parameters
    ----------
    dataset
        Dataset directory (the disk tier).
    name
        The name jobs attach to (``[A-Za-z0-9_-]``, at most 64 characters).
    tiers
        ``"ram"`` or ``"ram,ssd"``.
    ram_size
        The whole shared ring: ``slots`` slots of ``K = ram_size / (slots * record size)`` records.
    ssd_size, ssd_dir
        With the SSD tier: two SSD reservoirs of ``K1 = ssd_size / (2 * record size)`` records
        (one being served while the next is written), in a private directory under ``ssd_dir``.
    seed
        Seeds the server's epoch orders (the partition into reservoirs).
    epochs
        Epochs to serve, then tell every job it is done and stop (``None``: until closed).
    slots
        Ring size (>= 2). Bounds how far the server (and the fastest job) can run ahead of the
        slowest job: ``slots`` reservoirs.
    wait_for
        Jobs to wait for before the first epoch (later epochs start when at least one job is there).
    lease_seconds
        A job silent for this long (no release, no heartbeat) is dropped.
    gap_bytes
        Read coalescing threshold of the disk reader.
    base_dir
        Where the run directory goes (default ``/dev/shm`` or the temp dir).
    """

    def __init__(
        self,
        dataset: Location,
        *,
        name: str,
        tiers: str = "ram",
        ram_size: int | str = "512MiB",
        ssd_size: int | str = "4GiB",
        ssd_dir: str | os.PathLike[str] | None = None,
        seed: int = 0,
        epochs: int | None = None,
        slots: int = 3,
        wait_for: int = 1,
        lease_seconds: float = 30.0,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        base_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = check_name(name)
        self.path: Path | str = as_location(dataset, resolve=True)
        self.tiers = parse_tiers(tiers)
        for what, v, lo in (("seed", seed, 0), ("slots", slots, 2), ("wait_for", wait_for, 1), ("gap_bytes", gap_bytes, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ConfigError(f"{what}: expected an integer >= {lo}, found {v!r}")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 0):
            raise ConfigError(f"epochs: expected >= 0 or None (until closed), found {epochs!r}")
        if not lease_seconds > 0:
            raise ConfigError(f"lease_seconds: expected > 0, found {lease_seconds!r}")
        self.seed, self.slots, self.wait_for, self.gap_bytes = int(seed), int(slots), int(wait_for), int(gap_bytes)
        self.epochs = None if epochs is None else int(epochs)
        self.lease_seconds = float(lease_seconds)
        self.base_dir = base_dir
        ds = Dataset(self.path, gap_bytes=self.gap_bytes)  # a missing or broken dataset fails here, clearly
        self.fingerprint = dataset_fingerprint(self.path)
        try:
            self.num_records = ds.num_records
            self.record_nbytes = ds.record_nbytes
            self._record = (tuple(ds.meta.record.shape), np.dtype(ds.meta.record.dtype))
        finally:
            ds.close()
        n, rec = max(1, self.num_records), self.record_nbytes
        ram = parse_capacity(ram_size, rec, what="ram_size")
        #: K, records per slot (= per published reservoir block).
        self.slot_records = max(1, min(ram // (self.slots * rec), n))
        #: K1, records per SSD reservoir (None without the SSD tier).
        self.ssd_block: int | None = None
        self.ssd_dir: Path | None = None
        if "ssd" in self.tiers:
            self.ssd_block = max(1, min(parse_capacity(ssd_size, rec, what="ssd_size") // (2 * rec), n))
            self.ssd_dir = Path(ssd_dir) if ssd_dir is not None else Path(tempfile.gettempdir())
            if not self.ssd_dir.is_dir():
                raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.ssd_dir)!r}")
        self.stats = SamplerStats()
        #: Epochs read completely for at least one job.
        self.epochs_served = 0
        #: Reservoir blocks published.
        self.published = 0
        self.error: BaseException | None = None
        self.rundir = run_dir(self.name, base_dir)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._jobs: dict[int, _Job] = {}
        self._active: set[int] = set()
        self._pending: set[int] = set()
        self._holders: list[set[int]] = [set() for _ in range(self.slots)]
        self._slot_seq = [0] * self.slots
        self._seq = 0
        self._next_job = 1
        self._started_first = False
        self._finished = False
        self._lock_fd: int | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._listener: connection.Listener | None = None
        self._threads: list[threading.Thread] = []
        self._space: SsdSpace | None = None
        self._ssd_written = 0
        self._closed = False

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
        d = self.rundir
        if not d.parent.is_dir():
            raise ConfigError(f"base_dir: expected an existing directory, found {str(d.parent)!r}")
        d.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            who = ""
            try:
                info = json.loads((d / "info.json").read_text())
                who = f" (pid {info['pid']}, serving {info['dataset']})"
            except (OSError, ValueError, KeyError):
                pass
            raise ConfigError(
                f"a shardkit server named {self.name!r} is already running{who}; stop it or choose another --name"
            ) from None
        self._lock_fd = fd
        remove_stale_server(self.name, d)  # we hold the lock: anything left here belongs to a dead server

    def _create(self) -> None:
        k, rec, s = self.slot_records, self.record_nbytes, self.slots
        payload_bytes = s * k * rec
        keys_offset = -(-payload_bytes // _ALIGN) * _ALIGN
        size = keys_offset + s * k * 8
        shm_name = f"{SHM_PREFIX}{self.name}.{os.getpid()}"
        self._shm = shared_memory.SharedMemory(name=shm_name, create=True, size=size)
        _untrack(self._shm)  # our cleanup, not the resource tracker's (see shardkit.readers.shared)
        shape, dtype = self._record
        self._payload = np.ndarray((s, k, *shape), dtype=dtype, buffer=self._shm.buf, offset=0)
        self._keys = np.ndarray((s, k), dtype=np.int64, buffer=self._shm.buf, offset=keys_offset)
        self.disk = Dataset(self.path, stats=self.stats.disk, gap_bytes=self.gap_bytes)
        if self.ssd_block is not None:
            assert self.ssd_dir is not None
            self._space = SsdSpace(self.ssd_dir)
        self._listener = connection.Listener(str(self.rundir / "sock"), family="AF_UNIX")
        self.info = {
            "version": PROTOCOL_VERSION, "name": self.name, "pid": os.getpid(), "dataset": str(self.path),
            "fingerprint": self.fingerprint, "shm": shm_name, "slots": s, "slot_records": k,
            "payload_offset": 0, "keys_offset": keys_offset, "seed": self.seed, "num_records": self.num_records,
            "tiers": list(self.tiers), "lease_seconds": self.lease_seconds, "started": time.time(),
        }
        tmp = self.rundir / "info.json.partial"
        tmp.write_text(json.dumps(self.info, indent=1))
        os.replace(tmp, self.rundir / "info.json")
        for target, tname in ((self._accept_loop, "shardkit-serve-accept"), (self._produce, "shardkit-serve-producer")):
            t = threading.Thread(target=target, name=tname, daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("server %s: serving %s (N=%d, %d slots of %d records) at %s", self.name, self.path,
                    self.num_records, s, k, self.rundir)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the server has served its epochs (or failed); True if it has finished."""
        if not self._threads:
            return True
        producer = self._threads[-1]
        producer.join(timeout)
        if not producer.is_alive() and self.error is not None:
            err, self.error = self.error, None
            if isinstance(err, (ConfigError, SamplerError)):
                raise err
            raise SamplerError(f"server {self.name}: {type(err).__name__}: {err}") from err
        return not producer.is_alive()

    def close(self) -> None:
        """Stop serving; unlink the ring, the SSD directory and the run directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._listener is not None:
            try:  # wake accept()
                connection.Client(str(self.rundir / "sock"), family="AF_UNIX").close()
            except OSError:
                pass
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(10.0)
        with self._cv:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for job in jobs:
            try:
                job.conn.close()
            except OSError:
                pass
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        if self._shm is not None:
            self._payload = self._keys = None  # type: ignore[assignment]
            try:
                self._shm.close()
            except BufferError:
                logger.warning("server %s: ring still referenced; unlinking anyway", self.name)
            _unlink_segment(self._shm)
            self._shm = None
        if self._space is not None:
            self._space.close()
        if getattr(self, "disk", None) is not None:
            self.disk.close()
        if self._lock_fd is not None:
            for f in ("sock", "info.json", "info.json.partial", "lock"):
                try:
                    (self.rundir / f).unlink()
                except FileNotFoundError:
                    pass
            try:
                self.rundir.rmdir()
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None
        logger.info("server %s: stopped", self.name)

    def __enter__(self) -> TierServer:
        return self.start() if self._lock_fd is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def jobs(self) -> int:
        """Attached jobs (active + waiting for the next epoch)."""
        with self._cv:
            return len(self._jobs)

    # ------------------------------------------------------------------ jobs
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn = self._listener.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(_POLL)
                continue
            if self._stop.is_set():
                conn.close()
                return
            threading.Thread(target=self._serve_job, args=(conn,), name="shardkit-serve-job", daemon=True).start()

    def _serve_job(self, conn: connection.Connection) -> None:
        job: _Job | None = None
        try:
            if not self._wait_readable(conn, 10.0):
                conn.close()
                return
            hello = conn.recv()
            if not (isinstance(hello, tuple) and len(hello) == 7 and hello[0] == "hello"):
                conn.close()
                return
            _, version, fingerprint, pid, group, rank, world = hello
            if version != PROTOCOL_VERSION or fingerprint != self.fingerprint:
                conn.send(("refused", f"server {self.name!r} serves {self.path} with protocol {PROTOCOL_VERSION}; "
                                      f"the job expected another dataset or protocol"))
                conn.close()
                return
            with self._cv:
                clash = self._group_clash(group, int(rank), int(world))
                if clash is None:
                    job = _Job(self._next_job, conn, int(pid), group, int(rank), int(world))
                    self._next_job += 1
                    self._jobs[job.id] = job
                    self._pending.add(job.id)
                    self._cv.notify_all()
                finished = self._finished
            if job is None:
                conn.send(("refused", clash))
                conn.close()
                return
            job.send(("welcome", {"job": job.id}))
            if finished:
                job.send(("done",))  # every epoch has been served already
            logger.info("server %s: job %d (pid %d) attached; starts at the next epoch", self.name, job.id, job.pid)
            while not self._stop.is_set():
                if not self._wait_readable(conn, _POLL * 4):
                    continue
                msg = conn.recv()
                job.last_seen = time.monotonic()
                if msg[0] == "release":
                    self._release(job.id, int(msg[1]))
                elif msg[0] == "bye":
                    break
        except (EOFError, OSError):
            pass
        finally:
            if job is not None:
                self._drop(job.id, "detached")
            else:
                try:
                    conn.close()
                except OSError:
                    pass

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
        ready: set[int] = set()
        groups: dict[str, list[_Job]] = {}
        for jid in self._pending:
            job = self._jobs[jid]
            if job.group is None:
                ready.add(jid)
            else:
                groups.setdefault(job.group, []).append(job)
        for members in groups.values():
            if len(members) == members[0].world:
                ready.update(j.id for j in members)
        return ready

    def _wait_readable(self, conn: connection.Connection, timeout: float) -> bool:
        return bool(conn.poll(timeout))

    def _release(self, jid: int, seq: int) -> None:
        with self._cv:
            for slot in range(self.slots):
                if self._slot_seq[slot] == seq:
                    self._holders[slot].discard(jid)
                    if not self._holders[slot]:
                        self._cv.notify_all()
                    return

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
        try:
            job.conn.close()
        except OSError:
            pass
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
        try:
            epoch = 0
            while not self._stop.is_set() and (self.epochs is None or epoch < self.epochs):
                if not self._begin_epoch(epoch):
                    return
                if self._run_epoch(epoch):
                    self.epochs_served += 1
                epoch += 1
            self._finish()
        except _Stopped:
            return
        except BaseException as exc:
            self.error = exc
            logger.exception("server %s: producer failed: %s", self.name, exc)
            with self._cv:
                jobs = list(self._jobs.values())
            for job in jobs:
                try:
                    job.conn.close()
                except OSError:
                    pass

    def _begin_epoch(self, epoch: int) -> bool:
        need = self.wait_for if not self._started_first else 1
        with self._cv:
            while len(ready := self._activatable()) + len(self._active) < need:
                if self._stop.is_set():
                    return False
                self._expire_leases()
                self._cv.wait(_POLL * 4)
            self._active |= ready
            self._pending -= ready
            self._started_first = True
            logger.info("server %s: epoch %d for jobs %s", self.name, epoch, sorted(self._active))
        return True

    def _blocks(self, epoch: int) -> Any:
        """Yield ``(sorted keys, read(keys, out))`` per reservoir block of the epoch, in ``pi`` order."""
        pi = epoch_permutation(self.seed, epoch, self.num_records)
        k = self.slot_records
        if self.ssd_block is None:
            payload = self.disk.payload
            for a in range(0, pi.size, k):
                yield np.sort(pi[a : a + k]), payload.read
            return
        assert self._space is not None
        k1 = self.ssd_block
        starts = list(range(0, pi.size, k1))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardkit-serve-ssd")
        space = self._space

        def write(a: int) -> tuple[Path, np.ndarray]:
            self._ssd_written += 1
            dest = space.reservoir_path(self._ssd_written)
            keys = pi[a : a + k1]
            self.stats._wrote(write_reservoir(self.disk, keys, dest, self._stop))
            return dest, np.sort(keys)

        fut = pool.submit(write, starts[0]) if starts else None
        try:
            for i, a in enumerate(starts):
                assert fut is not None
                dest, stored = fut.result()
                fut = pool.submit(write, starts[i + 1]) if i + 1 < len(starts) else None
                res = Dataset(dest, stats=self.stats.ssd, gap_bytes=self.gap_bytes)
                try:
                    block_pi = pi[a : a + k1]
                    for b in range(0, block_pi.size, k):
                        keys = np.sort(block_pi[b : b + k])

                        def read(keys: np.ndarray, out: np.ndarray, res: Dataset = res, stored: np.ndarray = stored) -> np.ndarray:
                            return res.payload.read(np.searchsorted(stored, keys), out=out)

                        yield keys, read
                finally:
                    res.close()
                    space.remove(dest)
        finally:
            if fut is not None:
                try:
                    dest, _ = fut.result()
                    space.remove(dest)
                except BaseException:
                    pass
            pool.shutdown(wait=True)

    def _blocks_per_epoch(self) -> int:
        n, k = self.num_records, self.slot_records
        if self.ssd_block is None:
            return -(-n // k)
        k1 = self.ssd_block
        full, tail = divmod(n, k1)
        return full * -(-k1 // k) + (-(-tail // k) if tail else 0)

    def _run_epoch(self, epoch: int) -> bool:
        """Publish every reservoir block of ``epoch``; False if every job left (epoch abandoned)."""
        nblocks = self._blocks_per_epoch()
        blocks = self._blocks(epoch)
        try:
            for r, (keys, read) in enumerate(blocks):
                slot = self.published % self.slots
                with self._cv:
                    while self._holders[slot] and self._active and not self._stop.is_set():
                        self._expire_leases()
                        self._cv.wait(_POLL * 4)
                    if self._stop.is_set():
                        raise _Stopped()
                    if not self._active:
                        logger.info("server %s: every job left during epoch %d; skipping its rest", self.name, epoch)
                        return False
                    self._holders[slot].clear()
                n = int(keys.size)
                self._keys[slot, :n] = keys
                read(keys, self._payload[slot])
                last = r == nblocks - 1
                with self._cv:
                    self._seq += 1
                    seq = self._seq
                    self._slot_seq[slot] = seq
                    recipients = [self._jobs[j] for j in sorted(self._active) if j in self._jobs]
                    self._holders[slot] = {j.id for j in recipients}
                self.published += 1
                for job in recipients:
                    try:
                        job.send(("res", seq, epoch, r, slot, n, last))
                    except OSError:
                        self._drop(job.id, "went away")
            return True
        finally:
            blocks.close()

    def _finish(self) -> None:
        """After the last epoch: wait until every slot is released (or its holders gone), then say done."""
        with self._cv:
            while any(self._holders) and self._active and not self._stop.is_set():
                self._expire_leases()
                self._cv.wait(_POLL * 4)
            self._finished = True
            jobs = list(self._jobs.values())
        for job in jobs:
            try:
                job.send(("done",))
            except OSError:
                pass
        logger.info("server %s: served %d epochs", self.name, self.epochs_served)

    def __repr__(self) -> str:
        return (f"TierServer({str(self.path)!r}, name={self.name!r}, tiers={','.join(self.tiers)}, "
                f"slots={self.slots}x{self.slot_records}, K1={self.ssd_block}, seed={self.seed})")


class _Terminated(SystemExit):
    """SIGTERM received: leave through the normal cleanup path."""


def serve(dataset: Location, *, name: str, ready: Any = None, **options: Any) -> TierServer:
    """Run a :class:`TierServer` in the foreground until its epochs are served, SIGTERM or Ctrl-C.

    Cleans up in every case (the shared memory, the SSD directory and the run directory). ``ready``
    is called with the started server (the CLI prints where it listens). Returns the closed server
    (its :attr:`~TierServer.stats` hold what was read).
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
