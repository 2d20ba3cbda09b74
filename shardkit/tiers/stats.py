"""Instrumentation of the tiered sampler (DS-Analyzer style: where do bytes and waiting time go)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from shardkit.formats import ReadStats

__all__ = ["STAGES", "SamplerStats"]

#: The pipeline stages :attr:`SamplerStats.busy_seconds` times, from storage to the consumer.
STAGES = ("disk", "disk_cpu", "ssd_fill", "ssd", "ssd_cpu", "assembly", "handover")


@dataclass
class SamplerStats:
    """Counters of one sampler, cumulative over its lifetime (:attr:`elapsed`: wall time from the
    first ``__next__`` of the first iteration to the last batch)."""

    #: :class:`~shardkit.formats.ReadStats` per tier: reads from the dataset, from SSD reservoirs, and
    #: bytes copied into batches. Set ``stats.disk.trace = []`` to record every disk request.
    disk: ReadStats = field(default_factory=ReadStats)
    ssd: ReadStats = field(default_factory=ReadStats)
    ram: ReadStats = field(default_factory=ReadStats)
    #: Reads served from the static cache, and (``locality``) from the node's local-disk cache.
    cache: ReadStats = field(default_factory=ReadStats)
    node: ReadStats = field(default_factory=ReadStats)
    #: Reads served from a ``cache_dir``'s local copies of an object store's shards.
    remote_cache: ReadStats = field(default_factory=ReadStats)
    #: Time the consumer spent inside ``__next__`` waiting for a batch: zero means storage kept up.
    stall_seconds: float = 0.0
    #: Records, payload bytes and batches delivered to the consumer.
    records: int = 0
    bytes: int = 0
    batches: int = 0
    #: Payload bytes written into SSD reservoirs.
    ssd_bytes_written: int = 0
    #: Bytes read from the dataset for each epoch (``N - M`` records' after the first with a static
    #: cache of ``M``).
    disk_bytes_by_epoch: dict[int, int] = field(default_factory=dict)
    #: Read calls on the dataset for each epoch (requests, for a dataset in an object store).
    disk_requests_by_epoch: dict[int, int] = field(default_factory=dict)
    #: Time each pipeline stage of :data:`STAGES` spent working (not waiting): ``disk`` reading the
    #: dataset, ``ssd_fill`` copying it to SSD, ``ssd`` reading reservoirs, ``assembly`` building
    #: batches, ``handover`` the consumer's side; ``disk_cpu``/``ssd_cpu`` the reading thread's CPU
    #: time. ``shardkit profile`` builds its rates from them.
    busy_seconds: dict[str, float] = field(default_factory=dict)
    #: Time the SSD tier's two stages waited for each other: ``ssd_fill`` the copy to SSD for a free
    #: slot (the RAM tier still reads both), ``ssd`` the RAM tier for the next reservoir to be
    #: written. The larger one says which stage the tier runs at the rate of.
    wait_seconds: dict[str, float] = field(default_factory=dict)
    #: A remote dataset downloaded into a local cache (``cache_dir``), summed over the passes: parts
    #: fetched (requests, also counted in :attr:`disk_requests_by_epoch`), their bytes, the time
    #: readers waited for parts to land, and the fetch threads' CPU time.
    download_parts: int = 0
    download_bytes: int = 0
    download_wait_seconds: float = 0.0
    download_cpu_seconds: float = 0.0
    #: Time from the consumer's first request to its first batch (the pipeline's start-up).
    first_batch_seconds: float | None = None
    _t0: float | None = field(default=None, repr=False)
    _t1: float | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tiers(self) -> dict[str, ReadStats]:
        return {"disk": self.disk, "ssd": self.ssd, "ram": self.ram, "cache": self.cache, "node": self.node,
                "remote_cache": self.remote_cache}

    @property
    def elapsed(self) -> float:
        if self._t0 is None:
            return 0.0
        return (self._t1 if self._t1 is not None else time.perf_counter()) - self._t0

    @property
    def records_per_s(self) -> float:
        e = self.elapsed
        return self.records / e if e > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        e = self.elapsed
        return self.bytes / e if e > 0 else 0.0

    def start_clock(self) -> None:
        """Start :attr:`elapsed` at the consumer's first request (later calls do nothing)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def add_delivered(self, records: int, nbytes: int, stalled: float) -> None:
        """Count one batch handed to the consumer and the time it waited for it."""
        with self._lock:
            self.records += records
            self.bytes += nbytes
            self.batches += 1
            self.stall_seconds += stalled
            self._t1 = time.perf_counter()
            if self.first_batch_seconds is None and self._t0 is not None:
                self.first_batch_seconds = self._t1 - self._t0

    def add_stall(self, seconds: float) -> None:
        """Count time the consumer waited without getting a batch (the run ended or failed)."""
        with self._lock:
            self.stall_seconds += seconds

    def add_epoch_disk(self, epoch: int, nbytes: int, calls: int = 0) -> None:
        """Count bytes read from the dataset for ``epoch``, in ``calls`` read calls (requests)."""
        with self._lock:
            self.disk_bytes_by_epoch[epoch] = self.disk_bytes_by_epoch.get(epoch, 0) + int(nbytes)
            self.disk_requests_by_epoch[epoch] = self.disk_requests_by_epoch.get(epoch, 0) + int(calls)

    def add_download(self, parts: int, nbytes: int, wait_seconds: float, cpu_seconds: float) -> None:
        """Count one pass's download into the local cache (see :attr:`download_parts`)."""
        with self._lock:
            self.download_parts += int(parts)
            self.download_bytes += int(nbytes)
            self.download_wait_seconds += wait_seconds
            self.download_cpu_seconds += cpu_seconds

    def add_busy(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` of work of pipeline stage ``stage`` (one of :data:`STAGES`)."""
        with self._lock:
            self.busy_seconds[stage] = self.busy_seconds.get(stage, 0.0) + seconds

    def add_wait(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` stage ``stage`` waited for the other (see :attr:`wait_seconds`)."""
        with self._lock:
            self.wait_seconds[stage] = self.wait_seconds.get(stage, 0.0) + seconds

    def add_written(self, nbytes: int) -> None:
        """Count payload bytes written into an SSD reservoir."""
        with self._lock:
            self.ssd_bytes_written += nbytes
