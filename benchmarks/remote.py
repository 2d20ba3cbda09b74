"""Reading a dataset from an object store: shardkit against the raw bandwidth and its peers, in one run.

Everything runs against a local SeaweedFS server (``weed mini`` from the dev extra), behind a small
userspace TCP proxy that delays every client-to-server packet by ``D`` ms (the kernel's netem is not
available here), so each request pays ``D`` more round-trip time, as on a real object store (20-100
ms). Every reader goes through that proxy (at 0 ms too), and the proxy counts the requests it
relays and the bytes the server sends back, so shardkit and the peers are counted the same way.
For each added latency and each of ``--rounds`` repetitions:

* **raw GET**: every shard object fetched whole with parallel GETs (best of 8/16/32 in flight): the
  baseline every ratio refers to (the raw GET of the *same* repetition);
* **Streaming**, **LitData**: MosaicML Streaming and LitData reading the same records (same bytes)
  from the same server with their shuffles on, into an empty local cache: epoch 1 (cold) and epoch 2
  (from their cache); run in the bench venv, see ``benchmarks/_remote_peers.py``;
* **shardkit, no cache**: ``TieredSampler`` in the exact uniform order with ``cache_dir=None`` (the
  opt-out: ranged reads), epochs 1 and 2;
* **raw ranged GET** (``rawranged``): the no-cache path's shape without shardkit: one ranged GET
  per record, in a random order, 32 in flight, through obstore directly (what the server gives
  requests of one record: the bound of any sparse ranged read that fetches no extra bytes);
* **shardkit, cache_dir**: the same with a cache on the local disk (what the default does, in a
  directory emptied first): epoch 1 is cold, epoch 2 warm;
* **loader(2)**: both through ``ShardIterableDataset(...).loader(num_workers=2)``, epochs 1 and 2
  (``iter(loader)`` twice, as a training loop does): their CPU is that of the main process and its workers
  (``TreeCPU``: live workers from ``/proc/<pid>/stat``, exited ones from ``RUSAGE_CHILDREN``), also
  split into main and workers;
* ``--sweep``: the bare no-cache epoch at several ``remote_gap_bytes`` thresholds.

With ``--bandwidth MBPS`` the proxy also caps the bytes it answers at MBPS MB/s in aggregate (one
link shared fairly by every connection, raw GET's included): a node reading an object store over a
link of bounded bandwidth. On a machine whose cores the server, proxy and reader share, the uncapped
ratio measures the reader's CPU per GB against a GET loop that drops the bytes; under a cap the
machine is not the bound, and ``link use`` (bytes answered over what the link could carry in the
epoch's time) says whether a reader keeps the link busy, with the idle link time split into before
the link got busy, in between, and after (from the proxy's bytes per 0.1 s, kept in ``--json``).

Each measurement reports MB/s of payload delivered, its ratio to raw GET, the time to the first batch
(64 records), the bytes and requests the proxy relayed during the epoch, the reader's CPU per GB and
the server's and proxy's (``server_cpu_s_per_GB``: they share the machine's cores with the reader, so a
reader that costs the machine more CPU per GB leaves the server less), and whether the records
equal a local run's (:class:`_remote_peers.EpochCheck`: the key in each record's first bytes and a
1-in-4096 byte sample; "order" when the sequence is also the local run's). The output is a markdown
table for RESULTS.md (medians over the rounds with min-max) and, with ``--json``, every measurement.

The bench venv (the peers' own environment; shardkit is not installed in it, the peer script
imports only numpy and the peers)::

    python benchmarks/remote.py --make-bench-venv /work/benchvenv
    # = python3 -m venv /work/benchvenv && /work/benchvenv/bin/pip install <pyproject's [bench] extra>

``SHARDKIT_BENCH_PYTHON`` names its interpreter (default ``/work/benchvenv/bin/python``).

Usage (run from the repository root with shardkit importable)::

    python benchmarks/remote.py --quick                       # 800 records, 1 round: a smoke run
    python benchmarks/remote.py --records 2000 --latency 0,50 --rounds 3
    python benchmarks/remote.py --json remote.json --markdown remote.md   # 8,000 x 128 KiB, the full table
    python benchmarks/remote.py --systems raw,cache --sweep 0,256KiB,1MiB,4MiB
    python benchmarks/remote.py --bandwidth 100 --no-peers --systems raw,cache,loader-cache   # a 100 MB/s link

Numbers move between runs on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _remote_peers import EpochCheck, counter_delta, read_counters  # noqa: E402

RECORD_SHAPE = (128, 256, 4)  # 128 KiB, the record size of ANCHORS.md's peer measurements
BATCH = 64
BENCH_PYTHON = Path(os.environ.get("SHARDKIT_BENCH_PYTHON", "/work/benchvenv/bin/python"))

#: Every system the run can measure, in the order of a round and of the tables.
SYSTEMS = {
    "raw": "raw GET",
    "streaming": "Streaming",
    "litdata": "LitData",
    "nocache": "shardkit, no cache",
    "cache": "shardkit, cache_dir",
    "loader-nocache": "loader(2), no cache",
    "loader-cache": "loader(2), cache_dir",
    "rawranged": "raw ranged GET",
}
PEERS = ("streaming", "litdata")


# ---------------------------------------------------------------------- the counting, delaying proxy
class RequestCounter:
    """Counts the HTTP/1.1 requests in a client's byte stream, fed in arbitrary pieces.

    Parses each request head (up to the blank line), takes its method, and skips its body by
    ``Content-Length`` or ``Transfer-Encoding: chunked``. A head longer than :attr:`MAX_HEAD` (not
    HTTP as expected) stops the counting and sets :attr:`lost` rather than buffering without bound.
    """

    MAX_HEAD = 1 << 16

    def __init__(self) -> None:
        self.by_method: collections.Counter[str] = collections.Counter()
        self.lost = False
        self._buf = bytearray()
        self._body = 0  # body bytes still to skip
        self._state = "head"  # "head", "body", "chunk-size", "chunk-data", "trailer"

    @property
    def requests(self) -> int:
        return sum(self.by_method.values())

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.lost:
            if self._state in ("body", "chunk-data"):
                take = min(self._body, len(view))
                view = view[take:]
                self._body -= take
                if self._body == 0:
                    self._state = "head" if self._state == "body" else "chunk-size"
                continue
            self._buf += view
            view = memoryview(b"")
            try:
                while self._state not in ("body", "chunk-data") and self._parse_one():
                    pass
            except ValueError:  # a length that is not a number: not the HTTP this counts
                self.lost = True
            if self._state in ("body", "chunk-data"):
                view = memoryview(bytes(self._buf))  # the body's first bytes and what follows
                self._buf.clear()

    def _parse_one(self) -> bool:
        """Consume one head or one chunk line from the buffer; False when it needs more bytes."""
        sep = b"\r\n\r\n" if self._state == "head" else b"\r\n"
        end = self._buf.find(sep)
        if end < 0:
            self.lost = len(self._buf) > self.MAX_HEAD
            return False
        text = bytes(self._buf[:end])
        del self._buf[: end + len(sep)]
        if self._state == "head":
            head = text.decode("latin-1").split("\r\n")
            self.by_method[head[0].split(" ", 1)[0]] += 1
            fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            if "chunked" in fields.get("transfer-encoding", "").lower():
                self._state = "chunk-size"
            elif int(fields.get("content-length", "0") or 0) > 0:
                self._state, self._body = "body", int(fields["content-length"])
        elif self._state == "trailer":
            if not text:
                self._state = "head"
        elif text:  # a chunk size (an empty line is the CRLF that ends a chunk's data)
            size = int(text.split(b";", 1)[0], 16)
            self._state, self._body = ("trailer", 0) if size == 0 else ("chunk-data", size)
        return True


class _Counts:
    """The proxy's totals: requests by method (all connections) and bytes from the server."""

    def __init__(self) -> None:
        self.counters: list[RequestCounter] = []
        self.bytes = 0

    def snapshot(self) -> dict[str, int]:
        methods: collections.Counter[str] = collections.Counter()
        for c in self.counters:
            methods.update(c.by_method)
        out = {"bytes": self.bytes, "requests": sum(methods.values()), "lost": sum(c.lost for c in self.counters)}
        out.update({f"requests_{m}": v for m, v in methods.items()})
        return out


class LinkCap:
    """A link of ``rate`` bytes a second shared by every connection of the proxy, in FIFO order.

    Each piece a connection sends reserves the link's next free slot of ``len / rate`` seconds and
    waits for the slot's start, so the bytes sent by time t never exceed ``rate`` times the time
    since the link got busy plus one piece, and connections take turns piece by piece (a piece is
    at most :attr:`PIECE` bytes). An idle link earns no credit, as a wire does not. One timer per
    piece keeps the proxy's CPU small next to the bytes it copies.
    """

    PIECE = 256 << 10

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0  # time.monotonic() at which the link's last reserved slot ends

    async def take(self, n: int) -> None:
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate
        if start > now:
            await asyncio.sleep(start - now)


class Timeline:
    """Bytes the proxy answered per :attr:`BIN` seconds of ``time.monotonic()`` (one clock for every
    process of the machine, so a reader's epoch start and end select its bins)."""

    BIN = 0.1

    def __init__(self) -> None:
        self.bins: collections.Counter[int] = collections.Counter()

    def add(self, n: int) -> None:
        self.bins[int(time.monotonic() / self.BIN)] += n

    def between(self, t0: float, t1: float) -> list[int]:
        """Bytes per bin from the bin of ``t0`` to that of ``t1``, zeros included."""
        a, b = int(t0 / self.BIN), int(t1 / self.BIN)
        return [self.bins.get(i, 0) for i in range(a, b + 1)]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                seen: Callable[[bytes], None], cap: LinkCap | None = None) -> None:
    """Copy ``reader`` to ``writer``, showing each chunk to ``seen``; with ``delay``, every chunk
    leaves ``delay`` s after it came; with ``cap`` (no delay), each piece of at most
    :attr:`LinkCap.PIECE` bytes waits for its slot on the capped link and is shown to ``seen`` as
    it leaves."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def sender() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.ensure_future(sender()) if delay else None
    try:
        while data := await reader.read(1 << 20):
            if task is not None:
                seen(data)
                queue.put_nowait((time.monotonic() + delay, data))
                continue
            view = memoryview(data)
            step = cap.PIECE if cap is not None else len(view)
            for i in range(0, len(view), step):
                piece = view[i : i + step]
                if cap is not None:
                    await cap.take(len(piece))
                seen(piece)
                writer.write(piece)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        if task is not None:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(task, return_exceptions=True)
        else:
            writer.close()


def run_proxy(listen: int, upstream: int, delay_ms: float, control: int, timeline_port: int = 0,
              mbps: float = 0.0) -> None:
    """Serve forever: each connection to ``listen`` is relayed to ``upstream``, requests delayed by
    ``delay_ms``, answers capped at ``mbps`` MB/s in aggregate (0: no cap); a connection to
    ``control`` gets the counts so far as one JSON line, one to ``timeline_port`` that sends
    "T0 T1" (``time.monotonic()`` seconds) gets the bytes answered per 0.1 s between them."""
    counts = _Counts()
    timeline = Timeline()
    cap = LinkCap(mbps * 1e6) if mbps > 0 else None

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream, limit=1 << 22)
        except OSError:
            cw.close()
            return
        requests = RequestCounter()
        counts.counters.append(requests)

        def answered(data: bytes) -> None:
            counts.bytes += len(data)
            timeline.add(len(data))

        await asyncio.gather(_pump(cr, uw, delay_ms / 1000, requests.feed), _pump(ur, cw, 0.0, answered, cap),
                             return_exceptions=True)

    async def report(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(json.dumps(counts.snapshot()).encode() + b"\n")
        await w.drain()
        w.close()

    async def report_timeline(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        t0, t1 = (float(x) for x in (await r.readline()).split())
        w.write(json.dumps(timeline.between(t0, t1)).encode() + b"\n")
        await w.drain()
        w.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen, limit=1 << 22, backlog=1024)
        ctl = await asyncio.start_server(report, "127.0.0.1", control)
        servers = [server, ctl]
        if timeline_port:
            servers.append(await asyncio.start_server(report_timeline, "127.0.0.1", timeline_port))
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


class DelayProxy:
    """The proxy in its own process (its own GIL) on a free port, with its control ports; with
    ``mbps`` its answers share a link capped at that many MB/s (:class:`LinkCap`)."""

    def __init__(self, upstream: int, delay_ms: float, mbps: float | None = None) -> None:
        self.port, self.control, self.timeline_port = _free_port(), _free_port(), _free_port()
        self.mbps = mbps
        self.proc = subprocess.Popen([sys.executable, __file__, "--proxy", str(self.port), str(upstream),
                                      str(delay_ms), str(self.control), str(self.timeline_port), str(mbps or 0)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                self.counters()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError("delay proxy did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> dict[str, int]:
        return read_counters(self.control)

    def timeline(self, t0: float, t1: float) -> list[int]:
        """Bytes answered per 0.1 s from ``time.monotonic()`` ``t0`` to ``t1`` (the bins of both included)."""
        with socket.create_connection(("127.0.0.1", self.timeline_port), timeout=10) as s:
            s.sendall(f"{t0!r} {t1!r}\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return list(json.loads(data))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ---------------------------------------------------------------------- data
def make_dataset(path: Path, n: int, records_per_shard: int) -> Path:
    """``n`` records of 128 KiB: record ``i`` is ``pattern[i % 64]`` with ``i`` in its first 8 bytes
    (the same bytes as the peers' copies, see ``_remote_peers.records``)."""
    from shardkit.formats import DatasetWriter, FieldSpec

    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(RECORD_SHAPE, "uint8"),
                       fields={"label": FieldSpec((), "int64")}, records_per_shard=records_per_shard) as w:
        for a in range(0, n, 64):
            k = np.arange(a, min(a + 64, n))
            recs = pattern[: k.size].copy()
            recs.reshape(k.size, -1)[:, :8] = k[:, None].view(np.uint8).reshape(k.size, 8)  # key in the first bytes
            w.write({"image": recs, "label": k % 1000})
    return path


def bench_requirements(pyproject: Path) -> list[str]:
    """The ``bench`` extra of ``pyproject`` (what the bench venv installs; shardkit itself is not)."""
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["bench"])


def make_bench_venv(path: Path) -> None:
    """Create the peers' venv at ``path`` with the ``bench`` extra (pip's constraint file and local
    wheels on this machine give torch 2.14.1 from the disk)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", *bench_requirements(ROOT / "pyproject.toml")],
                   check=True)


# ---------------------------------------------------------------------- measurements
Measurement = dict[str, Any]


def _cpu_s() -> float:
    """CPU seconds (user + system) this process used so far (all its threads): survives load
    better than wall time; the server and the proxy run in other processes."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def process_cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` used so far, with ``children`` also
    those of the children it has reaped, from ``/proc/<pid>/stat`` (0.0 where it cannot be read, e.g.
    once it is gone): the server's and the proxy's share of the two cores, a DataLoader worker's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(x) for x in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (``/proc/<pid>/task/*/children``, Linux); [] elsewhere."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(x) for x in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


class TreeCPU:
    """CPU seconds of this process and every process it started after this object was made (the
    DataLoader's workers, the forked helper that reads the documents): this process from
    ``getrusage(RUSAGE_SELF)``, children it has reaped from ``getrusage(RUSAGE_CHILDREN)``, and each
    live descendant from ``/proc/<pid>/stat`` (its threads and its own reaped children). Processes that
    were already running (the server and proxy when the loader runs in this interpreter) are left
    out while they run (one reaped in between would be counted). A worker's CPU is counted while
    it lives (persistent workers live across epochs), so a difference of two readings is what the
    tree spent in between."""

    def __init__(self) -> None:
        self.before = set(_descendants(os.getpid()))
        self.reaped0 = self._reaped()

    @staticmethod
    def _reaped() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def split(self) -> tuple[float, float]:
        """(this process, the processes it started): CPU seconds so far."""
        kids = sum(process_cpu_s(p, children=True) for p in _descendants(os.getpid()) if p not in self.before)
        return _cpu_s(), kids + self._reaped() - self.reaped0


def raw_whole_objects(url: str, keys: list[str], concurrency: int) -> tuple[float, float]:
    """MB/s of fetching every object whole with ``concurrency`` parallel GETs, and CPU s per GB."""
    from shardkit.stores import open_store

    store = open_store(url)
    t0, c0 = time.perf_counter(), _cpu_s()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(lambda k: len(store.get(k)), keys))
    return total / 1e6 / (time.perf_counter() - t0), (_cpu_s() - c0) / (total / 1e9)


def raw_get(url: str, keys: list[str], proxy: DelayProxy) -> Measurement:
    """The best of 8, 16 and 32 GETs in flight; bytes and requests of that best pass."""
    best: Measurement = {}
    for c in (8, 16, 32):
        before, started = proxy.counters(), time.monotonic()
        mbs, cpu = raw_whole_objects(url, keys, c)
        ended = time.monotonic()
        d = counter_delta(before, proxy.counters())
        if mbs > best.get("MB/s", 0.0):
            best = {"MB/s": mbs, "concurrency": c, "fetched_MB": d["bytes"] / 1e6, "requests": d["requests"],
                    "cpu_s_per_GB": cpu, "started": started, "ended": ended}
    return best


def raw_ranged(url: str, keys: list[str], proxy: DelayProxy | None, counts: list[int], record_bytes: int,
               concurrency: int = 32, seed: int = 0) -> Measurement:
    """The no-cache path's shape without shardkit: one ranged GET per record (``counts[i]`` records
    of ``record_bytes`` at the start of object ``keys[i]``), in a random order, ``concurrency`` in
    flight (``StoreOptions.concurrency``'s default), straight through obstore's async API. What the
    server gives requests of one record each, which bounds any reader that fetches a sparse block
    by range without over-fetching (docs/design.md §9)."""
    import random

    from shardkit.stores import open_store
    from shardkit.stores.objectstore import import_obstore

    obs = import_obstore()
    inner = open_store(url).inner  # the client shardkit configured (endpoint, credentials); nothing else of it
    asks = [(k, j * record_bytes, (j + 1) * record_bytes) for k, n in zip(keys, counts) for j in range(n)]
    random.Random(seed).shuffle(asks)

    async def run() -> int:
        slots = asyncio.Semaphore(concurrency)

        async def one(key: str, start: int, end: int) -> int:
            async with slots:
                got = await obs.get_async(inner, key, options={"range": (start, end)})
                return len(memoryview(await got.bytes_async()))

        return sum(await asyncio.gather(*(one(*a) for a in asks)))

    before = proxy.counters() if proxy else {}
    t0, c0 = time.perf_counter(), _cpu_s()
    total = asyncio.run(run())
    dt = time.perf_counter() - t0
    m: Measurement = {"MB/s": total / 1e6 / dt, "seconds": dt, "concurrency": concurrency, "ranges": len(asks),
                      "payload_MB": total / 1e6, "requests_per_s": len(asks) / dt,
                      "cpu_s_per_GB": (_cpu_s() - c0) / (total / 1e9)}
    if proxy:
        d = counter_delta(before, proxy.counters())
        m["fetched_MB"], m["requests"] = d["bytes"] / 1e6, d["requests"]
    return m


def _epochs(iterate: Callable[[], Iterable[dict[str, Any]]], n: int, passes: int,
            proxy: DelayProxy | None, tree: TreeCPU | None = None) -> list[Measurement]:
    """Time ``passes`` passes of ``iterate()``: MB/s, first batch, the proxy's counts, the check.
    With ``tree``, ``cpu_s_per_GB`` is that of the whole process tree (``TreeCPU``), split into
    ``cpu_main_s_per_GB`` and ``cpu_workers_s_per_GB``."""
    out = []
    for _ in range(passes):
        before = proxy.counters() if proxy else {}
        check = EpochCheck(n)
        nbytes = 0
        first = None
        t0, c0, started = time.perf_counter(), _cpu_s(), time.monotonic()
        split0 = tree.split() if tree else (0.0, 0.0)
        for batch in iterate():
            if first is None:
                first = time.perf_counter() - t0
            payload = np.asarray(batch["image"])
            nbytes += payload.nbytes
            check.add(batch["key"], payload)
        dt = time.perf_counter() - t0
        m: Measurement = {"MB/s": nbytes / 1e6 / dt, "seconds": dt, "first_batch_s": first or 0.0,
                          "cpu_s_per_GB": (_cpu_s() - c0) / (nbytes / 1e9) if nbytes else 0.0,
                          "started": started, "ended": time.monotonic(), **check.summary()}
        if tree and nbytes:
            main_s, kids_s = (b - a for a, b in zip(split0, tree.split()))
            m.update(cpu_s_per_GB=(main_s + kids_s) / (nbytes / 1e9), cpu_main_s_per_GB=main_s / (nbytes / 1e9),
                     cpu_workers_s_per_GB=kids_s / (nbytes / 1e9))
        if proxy:
            d = counter_delta(before, proxy.counters())
            m["fetched_MB"], m["requests"] = d["bytes"] / 1e6, d["requests"]
        out.append(m)
    return out


def shardkit_options(ram: int, ssd: Path, tiers: str, cache_dir: Path | None, **kw: Any) -> dict[str, Any]:
    """The sampler options of every shardkit measurement (the public names of ``SamplerOptions``).

    No cache is ``cache_dir=None``, the explicit opt-out (ranged reads); the library's default, a cache
    in the temp dir, is what the ``cache_dir`` rows measure in a directory emptied first.
    """
    return {"tiers": tiers, "ram_size": ram, "ssd_size": 4 * ram, "ssd_dir": ssd,
            "batch_size": BATCH, "epochs": 1, "seed": 1, "cache_dir": cache_dir, **kw}


def shardkit_bare(location: str | Path, n: int, passes: int, proxy: DelayProxy | None, **opts: Any) -> list[Measurement]:
    """``passes`` passes of one ``TieredSampler`` (``epochs=1`` per pass: each pass is the next epoch)."""
    from shardkit.readers import TieredSampler
    from shardkit.stores import prefetch

    started: list[Any] = []  # each pass's prefetcher (the pipeline closes it with the pass)
    init = prefetch.ShardPrefetcher.__init__

    def watched(self: Any, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        started.append(self)

    prefetch.ShardPrefetcher.__init__ = watched  # type: ignore[method-assign]
    s = TieredSampler(location, **opts)
    try:
        ms = _epochs(lambda: s, n, passes, proxy)
    finally:
        s.close()
        prefetch.ShardPrefetcher.__init__ = init  # type: ignore[method-assign]
    for m, pf in zip(ms, started):
        m.update(_download_summary(pf, m["ended"]))
        m["parts_in_flight"] = _in_flight_bins(pf, m["started"], m["ended"])
    return ms


def _in_flight_bins(pf: Any, started: float, ended: float) -> list[tuple[int, int]]:
    """(asked-for, background) parts in flight at the end of each :attr:`Timeline.BIN` bin from the
    bin of ``started`` to that of ``ended``, beside the proxy's bytes per bin (the prefetcher's
    times are ``time.monotonic()`` seconds since its start)."""
    events = pf.stats.in_flight
    out: list[tuple[int, int]] = []
    state, i = (0, 0), 0
    for b in range(int(started / Timeline.BIN), int(ended / Timeline.BIN) + 1):
        end = (b + 1) * Timeline.BIN
        while i < len(events) and pf._t0 + events[i][0] < end:
            state = (events[i][1], events[i][2])
            i += 1
        out.append(state)
    return out


def _download_summary(pf: Any, ended: float) -> Measurement:
    """From a pass's prefetcher: the tail (seconds from its last part landed to the epoch's end:
    time nothing overlapped the reads) and where the fetch threads' time went."""
    st = pf.stats
    if not st.in_flight:
        return {}
    last = pf._t0 + st.in_flight[-1][0]
    return {"tail_s": ended - last, "download_s": st.in_flight[-1][0], "reader_wait_s": st.reader_wait_s,
            "receive_s": st.receive_s, "write_s": st.write_s, "crc_s": st.crc_s, "settle_s": st.settle_s,
            "parts_demanded": st.parts_demanded, "parts_background": st.parts_background,
            # the background width last chosen from the link, and the parts' mean wait for their first byte
            "width": st.width,
            "first_byte_s": st.first_byte_s / max(1, st.parts_demanded + st.parts_background),
            # the fetch threads' own CPU (writing, checksums, bookkeeping; not the store client's I/O threads)
            "fetch_cpu_s_per_GB": st.cpu_s / (st.bytes / 1e9) if st.bytes else 0.0,
            # record bytes the fetch threads copied straight into waiting blocks (not read back from the copy)
            "delivered_MB": st.delivered_bytes / 1e6, "deliver_s": st.deliver_s}


def shardkit_loader(location: str | Path, n: int, passes: int, proxy: Any, workers: int,
                    **opts: Any) -> list[Measurement]:
    """``passes`` passes of ``ShardIterableDataset(...).loader(num_workers=workers)``; epoch 1's time,
    first batch, requests and bytes count from the dataset's construction (``setup_s`` of them), so
    work moved there is not hidden; ``start_method``: how the workers started. CPU is that of the
    main process and every process it starts (``TreeCPU``), epoch 1's from its first ``iter``."""
    from shardkit.adapters.torch import ShardIterableDataset

    before = proxy.counters() if proxy else {}
    tree = TreeCPU()
    t0 = time.perf_counter()
    ds = ShardIterableDataset(str(location), **opts)
    try:
        loader = ds.loader(num_workers=workers)
        setup = time.perf_counter() - t0
        during = counter_delta(before, proxy.counters()) if proxy else {}
        ms = _epochs(lambda: loader, n, passes, proxy, tree)
        context = loader.multiprocessing_context
    finally:
        ds.close()
    if ms:
        first = ms[0]
        seconds = first["seconds"] + setup
        first.update({"MB/s": first["MB/s"] * first["seconds"] / seconds, "seconds": seconds, "setup_s": setup,
                      "first_batch_s": first["first_batch_s"] + setup, "started": first["started"] - setup})
        if "requests" in first:
            first["requests"] += during.get("requests", 0)
            first["fetched_MB"] += during.get("bytes", 0) / 1e6
    for m in ms:
        m["start_method"] = context.get_start_method() if context is not None else "none"
    return ms


class _ProxyCounters:
    """A running :class:`DelayProxy`'s counters, read through its control port (from another process)."""

    def __init__(self, control: int) -> None:
        self.control = control

    def counters(self) -> dict[str, int]:
        return read_counters(self.control)


def shardkit_loader_fresh(location: str | Path, n: int, passes: int, proxy: DelayProxy | None, workers: int,
                          **opts: Any) -> list[Measurement]:
    """:func:`shardkit_loader` in a new interpreter, as a training script starts (this process has
    used an object store, which decides how workers start: see shardkit.adapters._start)."""
    job = {"location": str(location), "n": n, "passes": passes, "workers": workers,
           "control": proxy.control if proxy else None,
           "opts": {k: str(v) if isinstance(v, Path) else v for k, v in opts.items()}}
    out = subprocess.run([sys.executable, __file__, "--loader-child", json.dumps(job)], capture_output=True,
                         text=True, timeout=3600, check=False)
    if out.returncode != 0:
        return [{"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _loader_child(job: dict[str, Any]) -> None:
    control = job["control"]
    ms = shardkit_loader(job["location"], job["n"], job["passes"], None if control is None else _ProxyCounters(control),
                         job["workers"], **job["opts"])
    print(json.dumps(ms))


def peer_prepare(system: str, endpoint: str, bucket: str, n: int, work: Path) -> str | None:
    """Write and upload the peer's copy straight to the server; an error message, or None."""
    if not BENCH_PYTHON.exists():
        return f"{BENCH_PYTHON} not found (make it with --make-bench-venv, or set SHARDKIT_BENCH_PYTHON)"
    out = _peer_cmd("prepare", system, endpoint, bucket, n, work)
    return out.get("error")


def peer_read(system: str, endpoint: str, bucket: str, n: int, work: Path, epochs: int, proxy: DelayProxy) -> Any:
    return _peer_cmd("read", system, endpoint, bucket, n, work, str(epochs), str(proxy.control))


def _peer_cmd(cmd: str, system: str, endpoint: str, bucket: str, n: int, work: Path, *extra: str) -> dict[str, Any]:
    args = [str(BENCH_PYTHON), str(HERE / "_remote_peers.py"), cmd, system, endpoint, bucket, f"peer-{system}", str(n),
            str(work), *extra]
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600, env=env, check=False)
    if out.returncode != 0:
        # The exception's last line (a Rust error's Debug output spans lines: keep its start too).
        lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
        errors = [i for i, ln in enumerate(lines) if "Error" in ln or "error" in ln]
        text = " ".join(lines[errors[-1]: errors[-1] + 6]) if errors else f"exit {out.returncode}"
        return {"error": text.replace("|", "/")[:300]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def link_profile(bins: list[int], started: float, ended: float, mbps: float | None) -> Measurement:
    """Where a measurement left the link idle, from the proxy's bytes per 0.1 s bin (``bins`` from
    the bin of ``started`` to that of ``ended``, ``time.monotonic()`` seconds).

    ``link_MB`` is the bytes per bin in MB (the timeline). With a cap of ``mbps``: ``link_use`` is
    the bytes answered over what the link could carry in the measurement's time, and the link time
    not used (``idle_s`` = seconds x (1 - use)) is split into ``idle_start_s`` (before the first bin
    at half the cap or more: requests not yet made or not yet answered), ``idle_end_s`` (after the
    last such bin: the consumer reading what has landed) and ``idle_mid_s`` (between them: the link
    waiting on the reader, its RAM budget, or the consumer). First and last bins count only the
    part of them inside the measurement."""
    width = Timeline.BIN
    first_bin = int(started / width)
    out: Measurement = {"link_MB": [round(b / 1e6, 2) for b in bins]}
    if not mbps or not bins or ended <= started:
        return out
    full = mbps * 1e6 * width
    spans = [min(ended, (first_bin + i + 1) * width) - max(started, (first_bin + i) * width) for i in range(len(bins))]
    unused = [max(0.0, span / width * full - b) / (mbps * 1e6) for span, b in zip(spans, bins)]
    busy = [i for i, b in enumerate(bins) if b >= full / 2]
    lo, hi = (busy[0], busy[-1]) if busy else (len(bins), len(bins) - 1)
    out.update({"link_use": sum(bins) / (mbps * 1e6 * (ended - started)), "idle_s": sum(unused),
                "idle_start_s": sum(unused[:lo]), "idle_mid_s": sum(unused[lo : hi + 1]),
                "idle_end_s": sum(unused[hi + 1 :])})
    return out


# ---------------------------------------------------------------------- tables
def same_as_local(m: Measurement, local: list[Measurement]) -> str:
    """"order" (the local run's sequence), "records" (its records in another order) or "NO"."""
    e = m["epoch"] - 1
    if not m.get("complete") or e >= len(local):
        return "NO"
    if m.get("ordered") == local[e]["ordered"]:
        return "order"
    return "records" if m.get("unordered") == local[e]["unordered"] else "NO"


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def summarize(runs: list[Measurement]) -> list[dict[str, Any]]:
    """One row per (latency, system, epoch) over the rounds, in run order: medians, min-max, and
    whether every round equalled the local run. Measurements with an ``error`` are listed as such."""
    groups: dict[tuple[float, str, int], list[Measurement]] = {}
    for m in runs:
        groups.setdefault((m["latency_ms"], m["system"], m.get("epoch", 1)), []).append(m)
    rows = []
    for (lat, system, epoch), ms in groups.items():
        ok = [m for m in ms if "error" not in m]
        row: dict[str, Any] = {"latency_ms": lat, "system": system, "epoch": epoch, "rounds": len(ok)}
        if not ok:
            row["error"] = ms[-1]["error"]
            rows.append(row)
            continue
        row["MB/s"] = [m["MB/s"] for m in ok]
        row["ratio"] = [m["ratio"] for m in ok if "ratio" in m]
        row["first_batch_s"] = [m["first_batch_s"] for m in ok if "first_batch_s" in m]
        row["fetched_MB"] = [m["fetched_MB"] for m in ok if "fetched_MB" in m]
        row["requests"] = [m["requests"] for m in ok if "requests" in m]
        for key in ("cpu_s_per_GB", "server_cpu_s_per_GB", "link_use", "idle_start_s", "idle_mid_s", "idle_end_s"):
            row[key] = [m[key] for m in ok if key in m]
        checks = [m["same_as_local"] for m in ok if "same_as_local" in m]
        row["same_as_local"] = "" if not checks else ("NO" if "NO" in checks else max(checks, key=["order", "records"].index))
        rows.append(row)
    return rows


def _epoch_label(system: str, epoch: int) -> str:
    if system == "raw":
        return ""
    if (system.endswith("cache") and not system.endswith("nocache")) or system in PEERS:
        return f"{epoch} ({'cold' if epoch == 1 else 'warm'})"
    return str(epoch)


def markdown_table(rows: list[dict[str, Any]], data_mb: float) -> str:
    """The detail table: MB/s and ratio as median (min-max), the rest medians. CPU is the reader's
    (its process tree for the loader) and the server's and proxy's, s per GB delivered; with a
    ``--bandwidth`` cap, the share of the link the measurement used and its idle link time (s) before
    the link got busy, in between, and after it was last busy (:func:`link_profile`)."""
    lines = ["| added latency | system | epoch | MB/s | ratio to raw GET | first batch (s) | fetched MB/epoch (x data) "
             "| requests/epoch | same as local | CPU s/GB (reader; server+proxy) | link use (idle s: start/mid/end) |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]

    def med(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(statistics.median(r[key]), fmt) if r.get(key) else ""

    for r in rows:
        head = f"| {r['latency_ms']:g} ms | {SYSTEMS.get(r['system'], r['system'])} | {_epoch_label(r['system'], r['epoch'])} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} | | | | | | | |")
            continue
        fetched = statistics.median(r["fetched_MB"]) if r["fetched_MB"] else None
        cpu = med(r, "cpu_s_per_GB", ".2f")
        server = med(r, "server_cpu_s_per_GB", ".2f")
        link = ""
        if r.get("link_use"):
            link = (f"{_spread(r['link_use'], '.2f')} ({med(r, 'idle_start_s', '.1f')}/{med(r, 'idle_mid_s', '.1f')}/"
                    f"{med(r, 'idle_end_s', '.1f')})")
        cells = [
            _spread(r["MB/s"], ",.0f"),
            _spread(r["ratio"], ".2f") if r["ratio"] else "",
            f"{statistics.median(r['first_batch_s']):.2f}" if r["first_batch_s"] else "",
            f"{fetched:,.0f} ({fetched / data_mb:.2f}x)" if fetched is not None else "",
            f"{statistics.median(r['requests']):,.0f}" if r["requests"] else "",
            r["same_as_local"],
            f"{cpu}; {server}" if server else cpu,
            link,
        ]
        lines.append(f"{head} {' | '.join(cells)} |")
    return "\n".join(lines)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """The issue's layout: per latency, raw GET MB/s and each system's epoch-1 ratio (median and
    min-max over the rounds), cold epochs for the caching systems."""
    systems = [s for s in SYSTEMS if s != "raw" and any(r["system"] == s for r in rows)]
    lines = ["| added latency | raw GET MB/s | " + " | ".join(SYSTEMS[s] for s in systems) + " |",
             "|---|---:|" + "---:|" * len(systems)]
    for lat in sorted({r["latency_ms"] for r in rows}):
        at = {r["system"]: r for r in rows if r["latency_ms"] == lat and r["epoch"] == 1}
        raw = at.get("raw")
        cells = [_spread(raw["MB/s"], ",.0f") if raw and "MB/s" in raw else "error"]
        for s in systems:
            r = at.get(s)
            cells.append("error" if r is None or "error" in r or not r["ratio"] else _spread(r["ratio"], ".2f"))
        lines.append(f"| {lat:g} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the run
def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="800 records (100 MB) in 8 shards, 1 round: a smoke run")
    p.add_argument("--records", type=int, default=None, help="records of 128 KiB (default 8000)")
    p.add_argument("--records-per-shard", type=int, default=None, help="default 256 (32 MiB shards)")
    p.add_argument("--latency", "--latencies", dest="latencies", default="0,20,50", help="added request latencies in ms")
    p.add_argument("--rounds", type=int, default=None, help="repetitions, each with its own raw GET (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"which to measure, comma separated from {', '.join(SYSTEMS)} (raw always runs)")
    p.add_argument("--peers", action="store_true", help="(kept for old command lines: the peers run by default)")
    p.add_argument("--no-peers", action="store_true", help="leave out Streaming and LitData")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the loader(...) rows")
    p.add_argument("--tiers", default="ram", help="the sampler's tiers, e.g. ram or ram,ssd")
    p.add_argument("--ram-fraction", type=float, default=0.25, help="RAM budget as a fraction of the dataset")
    p.add_argument("--sweep", default="", help="remote_gap_bytes values to sweep, e.g. 0,256KiB,1MiB,4MiB")
    p.add_argument("--bandwidth", type=float, default=None, metavar="MBPS",
                   help="cap the proxy's answers at MBPS MB/s in aggregate, every reader and raw GET alike "
                        "(a link of that bandwidth; default: no cap)")
    p.add_argument("--json", type=Path, help="write every measurement and the tables here")
    p.add_argument("--markdown", type=Path, help="write the tables here")
    p.add_argument("--make-bench-venv", type=Path, metavar="PATH", help="create the peers' venv at PATH and exit")
    p.add_argument("--loader-process", choices=("fresh", "same"), default="fresh",
                   help="run the loader(...) rows in a new interpreter, as a training script starts (default), "
                        "or in this one (which has used an object store already)")
    p.add_argument("--proxy", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--loader-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.loader_child:
        _loader_child(json.loads(a.loader_child))
        return
    if a.proxy:
        run_proxy(int(a.proxy[0]), int(a.proxy[1]), float(a.proxy[2]), int(a.proxy[3]), int(a.proxy[4]),
                  float(a.proxy[5]))
        return
    if a.make_bench_venv:
        make_bench_venv(a.make_bench_venv)
        return
    a.records = a.records or (800 if a.quick else 8000)
    a.records_per_shard = a.records_per_shard or (100 if a.quick else 256)
    a.rounds = a.rounds or (1 if a.quick else 3)
    systems = [s for s in a.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; expected names from {', '.join(SYSTEMS)}")
    if a.no_peers:
        systems = [s for s in systems if s not in PEERS]
    systems = ["raw"] + [s for s in SYSTEMS if s in systems and s != "raw"]
    latencies = [float(x) for x in a.latencies.split(",") if x]

    from shardkit.formats.transfer import upload_dataset
    from shardkit.stores import open_store
    from shardkit.units import parse_bytes
    from tests.helpers.seaweed import SeaweedServer

    started = time.perf_counter()
    load_before = _uptime()
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-remote-"))
    server = SeaweedServer(work / "seaweed").start()
    os.environ.update(server.env())
    rec_bytes = int(np.prod(RECORD_SHAPE))
    data_mb = a.records * rec_bytes / 1e6
    ram = int(a.ram_fraction * a.records) * rec_bytes
    results: dict[str, Any] = {"records": a.records, "record_bytes": rec_bytes, "records_per_shard": a.records_per_shard,
                               "data_MB": data_mb, "ram_size": ram, "tiers": a.tiers, "rounds": a.rounds,
                               "latencies_ms": latencies, "systems": systems, "workers": a.workers,
                               "bandwidth_MBps": a.bandwidth,
                               "load_before": load_before, "runs": []}
    runs: list[Measurement] = results["runs"]
    try:
        local = make_dataset(work / "ds", a.records, a.records_per_shard)
        url = f"s3://{server.bucket}/bench"
        upload_dataset(local, url)
        keys = [m.key for m in open_store(url).list("image")]
        shard_keys = sorted((k for k in keys if k.startswith("image/c/")), key=lambda k: int(k.split("/")[2]))
        shard_records = [min(a.records_per_shard, a.records - i * a.records_per_shard) for i in range(len(shard_keys))]
        ssd = work / "ssd"
        ssd.mkdir()
        cap = f"link capped at {a.bandwidth:g} MB/s" if a.bandwidth else "no bandwidth cap"
        print(f"dataset: {a.records} x 128 KiB = {data_mb:.0f} MB in {len(keys)} shards; RAM budget {ram / 1e6:.0f} MB; "
              f"{a.rounds} round(s) at {', '.join(f'{x:g}' for x in latencies)} ms, {cap}; load: {load_before}", flush=True)
        # The reference: the same sampler on the local copy (its order and records, epochs 1 and 2).
        reference = shardkit_bare(local, a.records, 2, None, **shardkit_options(ram, ssd, a.tiers, None))
        peer_error: dict[str, str] = {}
        for system in [s for s in systems if s in PEERS]:
            err = peer_prepare(system, server.endpoint, server.bucket, a.records, work / "peers")
            if err:
                peer_error[system] = err
                print(f"{SYSTEMS[system]}: {err}", flush=True)

        def record(lat: float, rnd: int, system: str, ms: list[Measurement], raw: float, proxy: DelayProxy) -> None:
            for e, m in enumerate(ms, 1):
                m.update(latency_ms=lat, round=rnd, system=system, epoch=e)
                if "started" in m and "ended" in m:
                    m.update(link_profile(proxy.timeline(m["started"], m["ended"]), m["started"], m["ended"], a.bandwidth))
                if "MB/s" in m:
                    m["ratio"] = m["MB/s"] / raw
                if "ordered" in m:
                    m["same_as_local"] = same_as_local(m, reference)
                runs.append(m)
                if "error" in m:
                    print(f"  {SYSTEMS.get(system, system):<22} error: {m['error']}", flush=True)
                else:
                    workers = (f" (main {m['cpu_main_s_per_GB']:.2f}, workers {m['cpu_workers_s_per_GB']:.2f})"
                               if "cpu_workers_s_per_GB" in m else "")
                    tail = (f"  tail {m['tail_s']:.2f} s of {m['seconds']:.2f}; parts {m['parts_demanded']} asked + "
                            f"{m['parts_background']} background, width {m.get('width', 0)}, first byte {m.get('first_byte_s', 0):.2f} s; "
                            f"fetch threads {m['fetch_cpu_s_per_GB']:.2f} CPU s/GB; "
                            f"{m.get('delivered_MB', 0):.0f} MB delivered from the parts"
                            if "tail_s" in m else "")
                    link = (f"  link use {m['link_use']:.2f}, idle {m['idle_start_s']:.1f}/{m['idle_mid_s']:.1f}/"
                            f"{m['idle_end_s']:.1f} s (start/mid/end)" if "link_use" in m else "")
                    print(f"  {SYSTEMS.get(system, system):<22} epoch {e}: {m['MB/s']:7.0f} MB/s  ratio {m['ratio']:.2f}  "
                          f"first batch {m.get('first_batch_s', 0):.2f} s  {m.get('fetched_MB', 0):.0f} MB in "
                          f"{m.get('requests', 0)} requests  {m.get('same_as_local', '')}  "
                          f"CPU {m.get('cpu_s_per_GB', 0):.2f} s/GB{workers} (server+proxy "
                          f"{m.get('server_cpu_s_per_GB', 0):.2f}){link}{tail}", flush=True)

        for lat in latencies:
            proxy = DelayProxy(server.port, lat, a.bandwidth)

            def server_cpu(proxy: DelayProxy = proxy) -> float:
                """The server's and the proxy's CPU so far: with the reader's, what a GB costs the machine."""
                return (process_cpu_s(server.proc.pid) if server.proc else 0.0) + process_cpu_s(proxy.proc.pid)

            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            try:
                for rnd in range(1, a.rounds + 1):
                    t_round = time.perf_counter()
                    others = server_cpu()
                    raw_m = raw_get(url, keys, proxy)
                    raw_m["server_cpu_s_per_GB"] = (server_cpu() - others) / 3 / (data_mb / 1e3)  # three passes
                    raw = raw_m["MB/s"]
                    print(f"\n+{lat:g} ms, round {rnd}: raw GET {raw:.0f} MB/s ({raw_m['concurrency']} in flight)", flush=True)
                    record(lat, rnd, "raw", [raw_m], raw, proxy)
                    for system in systems[1:]:
                        others = server_cpu()
                        ms: list[Measurement]
                        if system == "rawranged":
                            ms = [raw_ranged(url, shard_keys, proxy, shard_records, rec_bytes)]
                        elif system in PEERS:
                            if system in peer_error:
                                ms = [{"error": peer_error[system]}]
                            else:
                                got = peer_read(system, proxy.endpoint, server.bucket, a.records, work / "peers", 2, proxy)
                                ms = got.get("epochs") or [{"error": got.get("error", "no result")}]
                        else:
                            cache = work / "cache" if system.endswith("-cache") or system == "cache" else None
                            if cache is not None:
                                shutil.rmtree(cache, ignore_errors=True)
                                cache.mkdir()
                            opts = shardkit_options(ram, ssd, a.tiers, cache)
                            if system.startswith("loader"):
                                run = shardkit_loader_fresh if a.loader_process == "fresh" else shardkit_loader
                                ms = run(url, a.records, 2, proxy, a.workers, **opts)
                            else:
                                ms = shardkit_bare(url, a.records, 2, proxy, **opts)
                        if ms and system not in PEERS:  # (the peers' cache is written by the peer script)
                            ms[0]["server_cpu_s_per_GB"] = (server_cpu() - others) / (data_mb / 1e3)
                        record(lat, rnd, system, ms, raw, proxy)
                    for g in [x for x in a.sweep.split(",") if x]:
                        gap = parse_bytes(g, what="--sweep", allow_zero=True)
                        ms = shardkit_bare(url, a.records, 1, proxy,
                                           **shardkit_options(ram, ssd, a.tiers, None, remote_gap_bytes=gap))
                        record(lat, rnd, f"gap {g}", ms, raw, proxy)
                    print(f"  (round took {time.perf_counter() - t_round:.0f} s)", flush=True)
                    write_results(a, results, started, final=False)
            finally:
                proxy.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + write_results(a, results, started, final=True))


def write_results(a: argparse.Namespace, results: dict[str, Any], started: float, *, final: bool) -> str:
    """The tables of what was measured so far, written to ``--markdown`` and ``--json`` (after each
    round too, so a run cut short leaves its tables)."""
    results["duration_s"] = time.perf_counter() - started
    results["load_after"] = _uptime()
    rows = summarize(results["runs"])
    done = "Run took" if final else "Cut short (tables so far) after"
    header = (f"{a.records:,} records of 128 KiB ({results['data_MB']:,.0f} MB) in shards of {a.records_per_shard}, "
              f"RAM budget {results['ram_size'] / 1e6:,.0f} MB, tiers={a.tiers}, batch {BATCH}, loader workers "
              f"{a.workers}; {f'link capped at {a.bandwidth:g} MB/s' if a.bandwidth else 'no bandwidth cap'}; "
              f"medians of {a.rounds} round(s), (min-max); ratio = MB/s over raw GET of the same round; "
              f"bytes and requests counted by the proxy. {done} {results['duration_s']:.0f} s. "
              f"Load before: {results['load_before']}; after: {results['load_after']}")
    text = f"{header}\n\n{summary_table(rows)}\n\n{markdown_table(rows, results['data_MB'])}\n"
    results["markdown"] = text
    if a.markdown:
        a.markdown.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return text


if __name__ == "__main__":
    main()
