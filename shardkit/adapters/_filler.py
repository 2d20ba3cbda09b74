"""The node's one filler of a DataLoader over an object store (docs/design.md §6, *One filler per node*).

When a loader's workers start, the main process first forks a filler process (it has not used an
object store yet: the same condition that lets the workers be forked, ``_start``). The filler opens
the datasets from the documents the main process already read, claims every shard's copy in the
local cache and starts the download at once, so the link is busy while the workers fork and build
their samplers, and each shard is fetched by one process of the node: the workers, finding every
copy claimed, read what is present and ask the filler for the rest through the copies' maps,
exactly as a second rank or a ``serve`` client does. The filler exits once every copy is complete
(or when the dataset is closed, or its parent is gone); a copy it leaves unfinished is resumed by
the next process that needs it, so its failure never fails a pass (the workers report errors).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

from shardkit.formats.dataset import Dataset
from shardkit.formats.ranged import RangedPayloadArray
from shardkit.processes import exit_when_gone
from shardkit.readers import SamplerOptions, identity
from shardkit.readers.sources import Mixture, plan_remote_cache
from shardkit.stores.prefetch import ShardPrefetcher

__all__ = ["NodeFiller", "start_filler", "READY_SECONDS"]

logger = logging.getLogger(__name__)

#: Longest the main process waits for the filler to claim the copies before it starts the workers
#: (a worker that claims a copy first fills it itself: slower, never wrong).
READY_SECONDS = 2.0


class NodeFiller:
    """The main process's handle on a running filler: :attr:`claimed` copies it fills (None: it did
    not say in time), :meth:`close` stops it (its copies are resumed by whoever needs them next)."""

    def __init__(self, process: Any, conn: Connection, claimed: int | None) -> None:
        self.process, self.conn, self.claimed = process, conn, claimed

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def close(self) -> None:
        self.conn.close()  # the filler's watch thread sees the end of its pipe and stops it
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_filler(source: Mixture, options: SamplerOptions) -> NodeFiller | None:
    """Fork the filler of ``source``'s remote datasets with ``options``'s cache, and wait (at most
    :data:`READY_SECONDS`) until it claimed the copies; None when it is not started (the caller
    checked that a forked child can use object stores) or found nothing to fill."""
    if options.cache_dir is None or mp.current_process().daemon:
        return None
    ctx = mp.get_context("fork")
    conn, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_fill, args=(source, options, child, os.getpid()), name="shardkit-filler", daemon=True)
    try:
        process.start()
    except Exception:  # no filler: the workers fill, as without one
        logger.debug("the node's filler process could not start", exc_info=True)
        conn.close()
        child.close()
        return None
    child.close()
    claimed: int | None = None
    try:
        if conn.poll(READY_SECONDS):
            claimed = conn.recv()
    except (EOFError, OSError):  # it ended without an answer (nothing to fill, or it failed)
        claimed = 0
    filler = NodeFiller(process, conn, claimed)
    if claimed == 0:
        filler.close()
        return None
    logger.debug("node filler %d claimed %s copies", process.pid, claimed)
    return filler


def _fill(source: Mixture, options: SamplerOptions, conn: Connection, parent: int) -> None:
    """In the filler: claim and download every copy, tell the parent how many, then wait for them."""
    exit_when_gone(parent)
    with ExitStack() as stack:
        prefetchers: list[ShardPrefetcher] = []
        try:
            for payload in _payloads(source, options, stack):
                pf = payload.download()
                if pf is not None:
                    prefetchers.append(pf)
            claimed = sum(pf.filling() for pf in prefetchers)
            conn.send(claimed)
        except Exception:
            logger.debug("the node's filler failed to start its download", exc_info=True)
            conn.send(0)
            return
        if not claimed:
            return

        def stop_when_told() -> None:
            try:
                conn.recv()
            except (EOFError, OSError):
                pass
            for pf in prefetchers:
                pf.close()

        threading.Thread(target=stop_when_told, name="shardkit-filler-stop", daemon=True).start()
        for pf in prefetchers:
            for i in range(len(pf.items)):
                try:
                    pf.wait(i)
                except Exception:  # a reader of the copy meets the same error and reports it
                    logger.debug("filler: downloading %s failed", pf.items[i].key, exc_info=True)


def _payloads(source: Mixture, options: SamplerOptions, stack: ExitStack) -> list[RangedPayloadArray]:
    """The remote datasets' payloads of ``source`` with the cache a sampler of ``options`` would use,
    opened from the documents this process inherited (no request)."""
    cache = plan_remote_cache(source, options)
    if cache.directory is None:
        return []
    if options.cache_dir == "auto":
        options = options.replace(cache_dir=cache.directory, cache_size=cache.budget)
    out = []
    for path in source.paths:
        known = identity.remembered(path)
        opened = {known[2]: known[1]} if known is not None else None
        ds = stack.enter_context(Dataset(path, **options.dataset_options(), opened=opened))
        if isinstance(ds.payload, RangedPayloadArray) and ds.payload.cache is not None:
            out.append(ds.payload)
    return out
