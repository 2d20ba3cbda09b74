"""One tier stack shared by concurrent training jobs on one machine (hyper-parameter searches).

A :class:`~shardkit.readers.server.TierServer` (``shardkit serve PATH --name NAME``) reads the
dataset; any number of jobs attach by name with :class:`SharedSampler`. Reservoirs are read from
disk once for all attached jobs, and each job still sees an exactly uniform order of its own.

Design
------
**Order.** For server epoch ``e`` the server draws ``pi_e = epoch_permutation(seed, e, N)`` and cuts
it into consecutive blocks of ``K`` positions: reservoir ``r`` is the key set
``pi_e[r*K : (r+1)*K]``. That is a uniform random partition of the ``N`` keys into blocks of fixed
sizes, in a uniformly random sequence. Job ``j`` emits the keys of reservoir ``r`` in the order of
its own permutation ``default_rng([job_seed, e, r]).permutation(n_r)`` of the reservoir's stored
(ascending) keys. Blocks of a uniform random partition, each permuted uniformly and independently,
form an exactly uniform permutation: ``P(order) = prod_r 1/C(rest_r, n_r) * 1/n_r! = 1/N!``. So each
job's epoch order is exactly uniform; two jobs see the same reservoirs at the same time (their
orders are dependent at the reservoir level, each one marginally uniform), which is what lets one
read serve them all. Jobs with different ``job_seed`` emit different orders. With the SSD tier
the server's SSD reservoirs are ``K1`` consecutive positions of ``pi_e`` and the published blocks
are ``K`` consecutive positions inside each: still consecutive segments of ``pi_e`` of sizes fixed in
advance, so the argument is unchanged.

**Consumers of one job.** DataLoader workers and ranks of one job are ``W`` consumers with the same
``job_seed`` (and ``group``). Each attaches with its own connection, sees every reservoir, copies
only its slices of the job's global batches (the :class:`~shardkit.readers.TieredSampler`
global-batch semantics) and releases every slot. The server activates a group only when all ``W``
ranks are attached, at an epoch boundary, so they all start the same epoch; a consumer claiming a
rank already present in its group is refused.

**Payload path.** The server owns one :class:`multiprocessing.shared_memory.SharedMemory` segment
``shardkit-shm-<NAME>.<pid>``: a ring of ``slots`` (>= 2: double buffering) payload slots of ``K``
records, then ``slots`` key arrays of ``K`` int64. It reads each reservoir once, ascending offsets
(:meth:`~shardkit.formats.PayloadArray.read`, or from an SSD reservoir with the SSD tier), into a
free slot, writes the slot's sorted keys, and publishes ``(seq, epoch, r, slot, n, last)`` to every
active job over a Unix socket (:mod:`multiprocessing.connection`). Payload never goes through the
socket: only these small tuples and the jobs' ``release`` / heartbeat messages. A job copies each
batch out of the slot (one gather per batch), so batches own their memory.

**Release and the slow-job bound.** A slot's holders are the jobs that were active when it was
published. It is refilled only after every holder released it (a job releases a slot as soon as it
copied the reservoir's last record out). The server therefore runs at most ``slots`` reservoirs
(``slots * K`` records) ahead of the slowest job: faster jobs can be up to that far ahead of the
slowest, beyond which everyone proceeds at the slowest job's pace. That is the price of reading
once; a job that is too slow for the others should not share.

**Leases.** Each job holds a lease: its socket plus heartbeats (every ``lease_seconds / 4`` from a
background thread). A job that exits, crashes or is SIGKILLed closes its socket; the server sees
EOF at once and drops it from every slot's holders. A job whose process is alive but silent for
``lease_seconds`` (stopped, hung in C code holding the GIL) is dropped as well. A dropped job never
stalls the others.

A job that abandons its iterator (``break``) detaches as soon as the iterator is garbage
collected, or at once with :meth:`SharedSampler.close`.

**Epoch boundaries.** A job attaching while an epoch is under way is *pending* and becomes active at
the next server epoch (its first batch is the first batch of that epoch). With ``wait_for`` jobs the
server waits for that many before its first epoch (benchmarks, tests); otherwise it starts as soon
as one job is there and idles while none is. If every active job leaves mid-epoch, the rest of the
epoch is skipped (nobody would read it). A job runs ``epochs`` whole epochs, then detaches.

**Lifetime.** The server claims ``<base>/shardkit-serve-<NAME>/`` (base = ``/dev/shm`` when
writable, else the temp dir) and holds an exclusive ``flock`` on its ``lock`` file for its whole
life; the kernel drops the lock when the process dies, even by SIGKILL. The directory holds the
socket and ``info.json`` (pid, dataset path and fingerprint, segment name, geometry), written last,
so a job never sees a half-started server. On exit, on SIGTERM (``serve`` turns it into a clean
shutdown) the server unlinks its segment, its SSD directory and the run directory. At start, a run
directory whose lock is free is stale (SIGKILLed server): its segments ``shardkit-shm-<NAME>.*`` and
files are removed (and :class:`~shardkit.readers.ssd.SsdSpace` removes dead SSD directories). A
run directory whose lock is held is a live server: starting another one with that name raises
:class:`~shardkit.errors.ConfigError` naming it. Segments are not registered with Python's resource
tracker (it would unlink them behind the owner's back when a *job* exits); cleanup is ours.

**Dataset identity.** ``info.json`` carries a fingerprint (SHA-256 of the dataset's root
``zarr.json``, which lists every shard's checksum). A :class:`SharedSampler` given ``dataset=`` is
refused unless the server serves that exact dataset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing import connection, resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConfigError, SamplerError, ShardkitError
from shardkit.formats import Dataset
from shardkit.readers.pipeline import BATCH_PREFETCH, assemble_batch
from shardkit.readers.stats import SamplerStats
from shardkit.stores import as_location

__all__ = ["SharedSampler", "dataset_fingerprint", "run_dir", "default_base_dir", "PROTOCOL_VERSION"]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
RUN_PREFIX = "shardkit-serve-"
SHM_PREFIX = "shardkit-shm-"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_POLL = 0.05


def check_name(name: str) -> str:
    """A server name: 1-64 of ``[A-Za-z0-9_-]`` (it becomes part of file and segment names)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"name: expected 1-64 characters of [A-Za-z0-9_-], found {name!r}")
    return name


def default_base_dir() -> Path:
    """Where run directories live: ``/dev/shm`` when writable (RAM, cleared at boot), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def run_dir(name: str, base_dir: str | os.PathLike[str] | None = None) -> Path:
    """The run directory of server ``name``."""
    base = Path(base_dir) if base_dir is not None else default_base_dir()
    return base / f"{RUN_PREFIX}{check_name(name)}"


def dataset_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the dataset's root ``zarr.json`` (schema, shard list and shard checksums)."""
    root = Path(path) / "zarr.json"
    try:
        return hashlib.sha256(root.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise ConfigError(f"{root}: expected the root metadata of a shardkit dataset, found no file") from None


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without handing it to this process's resource tracker."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    _untrack(shm)
    return shm


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # Python 3.11 registers every segment it opens; the tracker would unlink it when *this* process
    # exits, pulling the ring from under the server and the other jobs. Cleanup is the server's.
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        logger.debug("could not unregister %s from the resource tracker", shm.name, exc_info=True)


def lock_is_held(lock_path: Path) -> bool:
    """True if some process holds an exclusive flock on ``lock_path`` (a live server)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def read_info(name: str, base_dir: str | os.PathLike[str] | None = None, timeout: float = 0.0) -> dict[str, Any]:
    """``info.json`` of the live server ``name``, waiting up to ``timeout`` seconds for it to start."""
    d = run_dir(name, base_dir)
    deadline = time.monotonic() + timeout
    while True:
        info_path = d / "info.json"
        try:
            info = json.loads(info_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            info = None
        if info is not None and lock_is_held(d / "lock"):
            if int(info.get("version", -1)) != PROTOCOL_VERSION:
                raise SamplerError(
                    f"{info_path}: server speaks protocol {info.get('version')}, this shardkit {PROTOCOL_VERSION}"
                )
            return dict(info)
        if time.monotonic() >= deadline:
            what = "stale files of a dead server" if info is not None else "no run directory"
            raise SamplerError(
                f"no shardkit server named {name!r} is running (looked in {d}: {what}); "
                f"start one with `shardkit serve DATASET --name {name}`"
            )
        time.sleep(_POLL)


class SharedSampler:
    """Batches from a running :class:`~shardkit.readers.server.TierServer`, in this job's own order.

    A plain iterator of batch dicts like :class:`~shardkit.readers.TieredSampler`: the payload
    (``"image"``/``"audio"``), every per-record field and ``"key"``. See the module docstring for
    the design and guarantees.

    Parameters
    ----------
    name
        The server's name (``shardkit serve ... --name NAME``).
    job_seed
        Seeds this job's permutation inside every reservoir (``[job_seed, epoch, reservoir]``).
        Jobs need different seeds to see different orders. ``None`` draws fresh OS entropy (then
        recorded in :attr:`job_seed`).
    batch_size
        Records per batch (per consumer). Batches span reservoir boundaries but never epoch
        boundaries: the last batch of an epoch may be short.
    epochs
        Whole server epochs per iteration; the first is the next one that starts after attaching.
    dataset
        Optional dataset path: the server must serve exactly this dataset (fingerprint check).
    base_dir
        Where the server's run directory lives (default: ``/dev/shm`` or the temp dir).
    connect_timeout
        Seconds to wait for the server to appear (e.g. started at the same time).
    rank, world_size, drop_last, group
        Consumer ``c = rank`` of ``W = world_size`` consumers of *one* job (DataLoader workers,
        ranks): with the same ``job_seed`` they share the job's order and take its global batches
        as :class:`~shardkit.readers.TieredSampler` does (consumer ``c`` takes positions
        ``[g*B*W + c*B, g*B*W + (c+1)*B)`` of global batch ``g``; ``drop_last`` drops the ragged
        final global batch). Every consumer attaches with its own connection and reads every
        reservoir's slot, copying only its positions. The ``W`` members of ``group`` (default
        ``"job-<job_seed>"`` when ``W > 1``) start together: the server activates a group only
        once all ``W`` ranks are attached, at the next epoch boundary.

    Notes
    -----
    The job heartbeats every quarter of the server's ``lease_seconds`` from a background thread,
    so a long training step does not lose the lease; a job that stops iterating without closing
    (e.g. a long evaluation between epochs) keeps its lease and holds the others back by at most
    the ring size. :meth:`close` (or leaving a ``with`` block, or finishing ``epochs``) detaches.
    """

    def __init__(
        self,
        name: str,
        *,
        job_seed: int | None = None,
        batch_size: int = 256,
        epochs: int | None = 1,
        dataset: str | os.PathLike[str] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        connect_timeout: float = 10.0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        group: str | None = None,
    ) -> None:
        self.name = check_name(name)
        if job_seed is None:
            job_seed = int(np.random.SeedSequence().entropy % (1 << 63))  # type: ignore[operator]
        if isinstance(job_seed, bool) or not isinstance(job_seed, (int, np.integer)) or job_seed < 0:
            raise ConfigError(f"job_seed: expected a non-negative integer, found {job_seed!r}")
        self.job_seed = int(job_seed)
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
        #: Consumers of one job share a group (``None``: a job of one consumer).
        self.group = None if group is None else str(group)
        self.base_dir = base_dir
        self.connect_timeout = float(connect_timeout)
        info = read_info(self.name, base_dir, timeout=self.connect_timeout)
        self.path: Path | str = as_location(info["dataset"])
        if dataset is not None:
            mine = dataset_fingerprint(dataset)
            if mine != info["fingerprint"]:
                raise SamplerError(
                    f"server {self.name!r} (pid {info['pid']}) serves {info['dataset']}, not {os.fspath(dataset)} "
                    f"(dataset fingerprints differ); refusing to attach"
                )
        self._info = info
        #: The server's lease: this job heartbeats every quarter of it.
        self.lease_seconds = float(info.get("lease_seconds", 30.0))
        ds = Dataset(self.path)
        try:
            self.num_records = ds.num_records
            self.record_nbytes = ds.record_nbytes
            self.payload_name = ds.payload_name
            self.fields = ds.fields
            self._record = (tuple(ds.meta.record.shape), np.dtype(ds.meta.record.dtype))
        finally:
            ds.close()
        self.stats = SamplerStats()
        self._epoch: int | None = None
        self._run_ref: weakref.ref[_SharedRun] | None = None

    @property
    def epoch(self) -> int | None:
        """Server epoch of the last batch emitted (``None`` before the first)."""
        return self._epoch

    def __len__(self) -> int:
        """Batches this consumer gets per epoch."""
        full, tail = divmod(self.num_records, self.batch_size * self.world_size)
        return full + (1 if tail > self.rank * self.batch_size and not self.drop_last else 0)

    def state_dict(self) -> dict[str, Any]:
        """Shared samplers cannot resume: the server, not the job, decides which epoch comes next."""
        raise SamplerError(
            f"shared sampler {self.name!r}: no resume state (epochs are the server's; a job that restarts "
            "attaches at the next epoch boundary)"
        )

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Per-record ``(shape, dtype)`` of every batch entry (payload, fields, ``key``)."""
        spec: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {self.payload_name: self._record}
        for fname, values in self.fields.items():
            spec[fname] = (tuple(values.shape[1:]), values.dtype)
        spec["key"] = ((), np.dtype(np.int64))
        return spec

    def order_of(self, epoch: int, reservoir: int, n: int) -> np.ndarray:
        """This job's permutation of a reservoir's ``n`` stored (ascending) keys."""
        return np.random.default_rng([self.job_seed, int(epoch), int(reservoir)]).permutation(int(n))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.close()
        run = _SharedRun(self)
        self._run_ref = weakref.ref(run)
        return run

    def close(self) -> None:
        """Detach from the server (idempotent)."""
        run = self._run_ref() if self._run_ref is not None else None
        if run is not None:
            run.close()
        self._run_ref = None

    def __enter__(self) -> SharedSampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SharedSampler({self.name!r}, dataset={str(self.path)!r}, job_seed={self.job_seed}, "
                f"batch_size={self.batch_size}, epochs={self.epochs})")


class _Link:
    """The background half of one iteration: a connection, the mapped ring, a heartbeat thread and
    a batch-assembler thread (so copying batches out of the ring overlaps the job's own work, as
    the batch creator does in :class:`~shardkit.readers.TieredSampler`). The threads reference
    only this object, never the iterator, so an abandoned iterator is garbage collected and its
    finalizer detaches the job (it would otherwise keep its lease and hold the other jobs back)."""

    def __init__(self, s: SharedSampler) -> None:
        self._s = s
        self._done = False
        self._closed = False
        self._epochs_done = 0
        self._cur: tuple[int, int, int, np.ndarray, bool, int] | None = None  # seq, slot, n, order, last, epoch
        self._pos = 0  # next record of the current reservoir
        self._epos = 0  # its position in the job's epoch order
        self._g = 0  # the global batch this consumer fills
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._shm: shared_memory.SharedMemory | None = None
        info = read_info(s.name, s.base_dir, timeout=s.connect_timeout)
        if info["pid"] != s._info["pid"] or info["fingerprint"] != s._info["fingerprint"]:
            raise SamplerError(f"server {s.name!r} was restarted with pid {info['pid']}; create a new SharedSampler")
        try:
            self._conn = connection.Client(str(run_dir(s.name, s.base_dir) / "sock"), family="AF_UNIX")
        except OSError as exc:
            raise SamplerError(f"cannot connect to shardkit server {s.name!r}: {exc}") from None
        self._send(("hello", PROTOCOL_VERSION, info["fingerprint"], os.getpid(), s.group, s.rank, s.world_size))
        reply = self._recv()
        if reply[0] != "welcome":
            self._conn.close()
            raise SamplerError(f"shardkit server {s.name!r} refused this job: {reply[1]}")
        self._shm = attach_segment(info["shm"])
        slots, k = int(info["slots"]), int(info["slot_records"])
        shape, dtype = s._record
        self._payload = np.ndarray((slots, k, *shape), dtype=dtype, buffer=self._shm.buf, offset=int(info["payload_offset"]))
        self._keys = np.ndarray((slots, k), dtype=np.int64, buffer=self._shm.buf, offset=int(info["keys_offset"]))
        self._batches: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=BATCH_PREFETCH)
        for target, tname in ((self._heartbeat, "shardkit-shared-heartbeat"), (self._assemble, "shardkit-shared-batches")):
            t = threading.Thread(target=target, name=tname, daemon=True)
            t.start()
            self._threads.append(t)

    # ------------------------------------------------------------------ messaging
    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _recv(self) -> tuple[Any, ...]:
        try:
            while not self._conn.poll(_POLL):
                if self._stop.is_set():
                    raise _Stopped()
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            raise SamplerError(f"shardkit server {self._s.name!r} went away") from None

    def _heartbeat(self) -> None:
        period = max(0.05, self._s.lease_seconds / 4)
        while not self._stop.wait(period):
            try:
                self._send(("beat",))
            except OSError:
                return

    def _detach(self) -> None:
        """Tell the server we are gone and close the socket (any thread; idempotent)."""
        with self._send_lock:
            if self._conn.closed:
                return
            try:
                self._conn.send(("bye",))
            except OSError:
                pass
            self._conn.close()

    # ------------------------------------------------------------------ background assembly
    def _put(self, item: tuple[Any, ...]) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped()
            try:
                self._batches.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def _assemble(self) -> None:
        try:
            while True:
                item = self._next_batch()
                if item is None:
                    self._detach()  # done: the server stops counting on us at once
                    self._put(("done",))
                    return
                self._put(item)
        except _Stopped:
            return
        except BaseException as exc:
            try:
                self._put(("error", exc))
            except _Stopped:
                pass

    def _target(self) -> tuple[int, int] | None:
        """Epoch positions ``[lo, hi)`` of this consumer's slice of global batch ``g`` (None: no more)."""
        s = self._s
        n, b, w = s.num_records, s.batch_size, s.world_size
        start = self._g * b * w
        if s.drop_last and start + b * w > n:
            return None
        lo = start + s.rank * b
        if lo >= n:
            return None
        return lo, min(lo + b, n)

    def _next_batch(self) -> tuple[Any, ...] | None:
        """Copy this consumer's next batch out of the ring: ``("batch", dict, epoch, seconds waited)``
        or None when done. Walks every reservoir (releasing each), copying only its own positions."""
        s = self._s
        shape, dtype = s._record
        b = s.batch_size
        out = np.empty((b, *shape), dtype=dtype)
        keys = np.empty(b, dtype=np.int64)
        filled = 0
        waited = 0.0
        epoch = -1
        while True:
            if self._cur is None:
                if self._done or (s.epochs is not None and self._epochs_done >= s.epochs):
                    break
                tw = time.perf_counter()
                msg = self._recv()
                waited += time.perf_counter() - tw
                if msg[0] == "done":
                    self._done = True
                    break
                if msg[0] != "res":
                    continue
                _, seq, ep, r, slot, n, last = msg
                self._cur = (int(seq), int(slot), int(n), s.order_of(ep, r, n), bool(last), int(ep))
                self._pos = 0
            seq, slot, n, order, last, ep = self._cur
            epoch = ep
            complete = False
            target = self._target()
            if target is None:
                skip = n - self._pos  # nothing more for us this epoch: pass the reservoir on
            else:
                lo, hi = target
                skip = min(max(0, lo - self._epos), n - self._pos)
            self._pos += skip
            self._epos += skip
            if target is not None and self._pos < n:
                lo, hi = target
                take = min(hi - self._epos, n - self._pos)
                idx = order[self._pos : self._pos + take]
                np.take(self._payload[slot], idx, axis=0, out=out[filled : filled + take])
                keys[filled : filled + take] = self._keys[slot][idx]
                self._pos += take
                self._epos += take
                filled += take
                if self._epos == hi:
                    self._g += 1
                    complete = True
            if self._pos == n:
                self._send(("release", seq))
                self._cur = None
                if last:
                    self._epochs_done += 1
                    self._epos = self._g = 0
                    if filled:
                        break  # batches never span epochs
            if complete:
                break
        if filled == 0:
            return None
        payload = out if filled == b else out[:filled].copy()
        return ("batch", assemble_batch(s.payload_name, payload, s.fields, keys[:filled]), epoch, waited)

    def close(self) -> None:
        """Say goodbye, stop the threads, unmap the ring (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(10.0)
        if getattr(self, "_conn", None) is not None:
            self._detach()
        if self._shm is not None:
            self._payload = self._keys = None  # type: ignore[assignment]
            try:
                self._shm.close()
            except BufferError:  # a view escaped (it should not): leave the mapping to the GC
                logger.debug("shared segment still exported; not unmapped", exc_info=True)
            self._shm = None



class _SharedRun:
    """One iteration of a :class:`SharedSampler` (the consumer end of a :class:`_Link`)."""

    def __init__(self, s: SharedSampler) -> None:
        self._s = s
        self._closed = False
        self._link = _Link(s)
        self._finalizer = weakref.finalize(self, self._link.close)

    def __iter__(self) -> _SharedRun:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._closed:
            raise StopIteration
        s, link = self._s, self._link
        s.stats._start()
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    item = link._batches.get(timeout=_POLL)
                    break
                except queue.Empty:
                    if not link._threads[-1].is_alive() and link._batches.empty():
                        raise SamplerError("shared sampler: batch thread ended unexpectedly") from None
        except BaseException:
            self.close()
            raise
        if item[0] == "batch":
            _, batch, epoch, _waited = item
            s._epoch = epoch
            s.stats._delivered(int(batch["key"].shape[0]), batch[s.payload_name].nbytes, time.perf_counter() - t0)
            return batch  # type: ignore[no-any-return]
        self.close()
        if item[0] == "error":
            exc = item[1]
            if isinstance(exc, ShardkitError):
                raise exc
            raise SamplerError(f"shared sampler: {type(exc).__name__}: {exc}") from exc
        raise StopIteration

    def close(self) -> None:
        """Detach now (idempotent)."""
        self._closed = True
        self._finalizer()


class _Stopped(Exception):
    """Internal: the iteration was closed while the batch thread waited."""
