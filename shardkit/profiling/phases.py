"""The measuring half of ``shardkit profile``: the pipeline alone, the step alone, both together
(DS-Analyzer's differential technique, docs/design.md §15). A step is any callable taking a batch."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConfigError
from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.readers.interface import Batch, ElementSpec
from shardkit.tiers.pipeline import gather_rows

__all__ = [
    "Step",
    "PhaseResult",
    "evict_page_cache",
    "load_step",
    "sleep_step",
    "synthetic_batch",
    "run_pipeline",
    "run_steps",
    "copy_rate",
    "populate_rate",
    "cpu_parallelism",
    "page_cache_capacity",
]

#: Threads :func:`cpu_parallelism` runs at most (a bigger machine is taken as that many cores).
MAX_PARALLEL = 8
#: A training step: called with every batch; its return value is ignored.
Step = Callable[[Batch], object]


@dataclass(frozen=True)
class PhaseResult:
    """What one phase measured: ``epoch_seconds`` between the consumer's last batches of consecutive
    epochs (the first from the first request), the stage timers (``busy``) and per-tier byte counts."""

    name: str
    seconds: float
    records: int
    batches: int
    epoch_seconds: tuple[float, ...]
    stall_seconds: float
    first_batch_seconds: float
    busy: dict[str, float] = field(default_factory=dict)
    storage_bytes: int = 0
    storage_calls: int = 0
    ssd_bytes: int = 0
    ssd_written: int = 0
    cache_bytes: int = 0
    step_seconds: float = 0.0
    #: Storage bytes and read calls (requests, for an object store) of each epoch, in epoch order.
    epoch_storage_bytes: tuple[int, ...] = ()
    epoch_storage_calls: tuple[int, ...] = ()
    #: A remote dataset's download into the local cache: parts (requests), bytes, and the time readers
    #: waited for parts to land (:attr:`SamplerStats.download_parts`).
    download_parts: int = 0
    download_bytes: int = 0
    download_wait_seconds: float = 0.0

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["busy_seconds"], out["epoch_seconds"] = out.pop("busy"), list(self.epoch_seconds)
        out["epoch_storage_bytes"], out["epoch_storage_calls"] = list(self.epoch_storage_bytes), list(self.epoch_storage_calls)
        return {**out, "records_per_s": self.records_per_s, "stall_fraction": self.stall_fraction}


def evict_page_cache(path: Path | str) -> bool:
    """Drop a local dataset's files from the page cache (``False`` for an object store); each file is
    flushed first, and files that cannot be opened are skipped (then read warm)."""
    if isinstance(path, str) or not hasattr(os, "posix_fadvise"):
        return False
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True


def load_step(spec: str) -> Step:
    """The step function ``module:function`` (the module is imported as Python would import it)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(f"--step: expected module:function (e.g. train:step), found {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"--step: cannot import module {module!r}: {exc}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"--step: module {module!r} has no function {name!r}")
    step: Step = fn
    return step


def sleep_step(seconds: float) -> Step:
    """A step that takes ``seconds`` without using the CPU (an accelerator's compute)."""

    def step(batch: Batch) -> None:
        if seconds > 0:
            time.sleep(seconds)

    step.__qualname__ = f"sleep_step({seconds:g})"
    return step


def synthetic_batch(spec: ElementSpec, batch_size: int) -> Batch:
    """A batch of the dataset's shapes and dtypes, already in memory (the compute phase's input)."""
    rng = np.random.default_rng(0)  # content does not matter; not an order, so no seeds domain
    batch: Batch = {}
    for name, (shape, dtype) in spec.items():
        arr = np.zeros((batch_size, *shape), dtype=dtype)
        if arr.dtype == np.uint8:
            arr[...] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
        batch[name] = arr
    return batch


def run_steps(step: Step, batch: Batch, count: int, bar: Any = None) -> tuple[float, float]:
    """Call ``step`` ``count`` times on ``batch``: ``(wall, cpu)`` seconds per step."""
    count = max(1, count)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        step(batch)
        if bar is not None:
            bar.update(1)
    return (time.perf_counter() - wall0) / count, (time.process_time() - cpu0) / count


def run_pipeline(name: str, path: Path | str, options: SamplerOptions, step: Step | None = None,
                 *, cold: bool, bar: Any = None) -> PhaseResult:  # fmt: skip
    """Run the sampler over ``options.epochs`` epochs (after dropping the page cache if ``cold``),
    calling ``step`` on every batch when given; what it measured."""
    if cold:
        evict_page_cache(path)
    sampler = TieredSampler(path, options)
    ends: dict[int, float] = {}
    step_s = 0.0
    with sampler:
        t0 = time.perf_counter()
        for batch in sampler:
            epoch = sampler.epoch
            if step is not None:
                s0 = time.perf_counter()
                step(batch)
                step_s += time.perf_counter() - s0
            ends[epoch] = time.perf_counter()
            if bar is not None:
                bar.update(1)
        total = time.perf_counter() - t0
    st = sampler.stats
    marks = [t0, *(ends[e] for e in sorted(ends))]
    return PhaseResult(
        name, total, st.records, st.batches, tuple(b - a for a, b in itertools.pairwise(marks)), st.stall_seconds,
        st.first_batch_seconds or 0.0, dict(st.busy_seconds), st.disk.bytes_read, st.disk.read_calls,
        st.ssd.bytes_read, st.ssd_bytes_written, st.cache.bytes_read, step_s,
        tuple(st.disk_bytes_by_epoch[e] for e in sorted(st.disk_bytes_by_epoch)),
        tuple(st.disk_requests_by_epoch.get(e, 0) for e in sorted(st.disk_bytes_by_epoch)),
        download_parts=st.download_parts, download_bytes=st.download_bytes,
        download_wait_seconds=st.download_wait_seconds,
    )  # fmt: skip


def copy_rate(record_nbytes: int, batch_size: int, budget: int = 32 << 20, repeats: int = 5) -> float:
    """Bytes per second of copying scattered cached records into a batch (the RAM tier)."""
    rows = max(batch_size, min(budget // max(1, record_nbytes), 4 * batch_size))
    src = np.ones((rows, record_nbytes), dtype=np.uint8)
    dst = np.empty((batch_size, record_nbytes), dtype=np.uint8)
    order = np.random.default_rng(0).permutation(rows)
    dst_rows = np.arange(batch_size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a in range(0, rows - batch_size + 1, batch_size):
            gather_rows(dst, dst_rows, src, order[a : a + batch_size])
        best = min(best, time.perf_counter() - t0)
    copied = (rows // batch_size) * batch_size * record_nbytes
    return copied / max(best, 1e-9)


def populate_rate(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of giving fresh shared memory its pages: the first-touch cost of filling a
    static cache (its regions are shared mappings populated ahead of the reads), paid once per byte
    pinned, on the first epoch only. Measured on an anonymous shared mapping, as the cache maps them
    (``MADV_POPULATE_WRITE``; writing a byte per page where the kernel lacks it)."""
    page = mmap.PAGESIZE
    nbytes = max(page, nbytes - nbytes % page)
    advice = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    best = float("inf")
    for _ in range(repeats):
        with mmap.mmap(-1, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            t0 = time.perf_counter()
            try:
                m.madvise(advice, 0, nbytes)
            except OSError:
                pages = np.frombuffer(m, dtype=np.uint8)
                pages[::page] = 1  # one write per page maps it
                del pages  # the mapping cannot close while a view exports it
            best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _spin_cpu(threads: int, seconds: float) -> float:
    """CPU seconds ``threads`` threads get in ``seconds`` of wall time, each hashing a buffer (which
    releases the GIL, like the pipeline's reads and copies)."""
    buf = bytes(1 << 20)
    got = [0.0] * threads
    start = threading.Barrier(threads + 1)

    def spin(i: int) -> None:
        start.wait()
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < seconds:
            hashlib.sha256(buf).digest()
        got[i] = time.thread_time() - c0

    pool = [threading.Thread(target=spin, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    for t in pool:
        t.join()
    return sum(got)


def cpu_parallelism(cores: int, seconds: float = 0.1, rounds: int = 3) -> float:
    """How many threads of this process run at once now: the CPU seconds ``cores`` busy
    threads get over what one gets in the same wall time (rounds interleaved, medians), between 1
    and that count. On an idle machine it is the core count; on one whose cores other processes
    keep busy, threads take turns, and work the model spreads over the cores runs one after another."""
    width = max(1, min(MAX_PARALLEL, cores))
    if width == 1:
        return 1.0
    one, many = [], []
    for _ in range(rounds):
        one.append(_spin_cpu(1, seconds))
        many.append(_spin_cpu(width, seconds))
    alone = float(np.median(one))
    return float(min(width, max(1.0, float(np.median(many)) / alone))) if alone > 0 else float(width)


def page_cache_capacity() -> int:
    """Memory the OS may use to cache files: ``MemAvailable`` (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@contextmanager
def progress(enabled: bool, desc: str, total: int | None) -> Iterator[Any]:
    """A tqdm bar for one phase (``None`` when off: the library does not print)."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=True) as bar:
        yield bar
