"""How DataLoader workers over an object store start (docs/design.md §6, worker start).

obstore's runtime (tokio) does not survive ``fork()`` once a process has used it, and a client made
anew in the child does not help (the runtime is global). Until the main process has used it, a
forked worker starts its own and works. So the main process reads what it needs before its workers
exist (the datasets' root documents, for the source) in a short-lived forked helper, which also
reads what every worker would read before its first record (array documents, small fields) so that
each is fetched once, not once per worker; and its workers
are forked (in milliseconds, torch already imported) as long as the runtime has not started here;
after that they start with ``spawn``. Not a fork server: it keeps the environment it started with,
so a worker would miss credentials or an endpoint set later in the process (a notebook, a test).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from shardkit.formats.dataset import Dataset, DatasetDocuments
from shardkit.formats.ranged import RangedPayloadArray
from shardkit.processes import fork_state
from shardkit.readers import identity
from shardkit.readers.sources import Mixture, as_source
from shardkit.stores import is_url

__all__ = ["PRELOAD", "remote", "source_of", "start_method", "worker_context"]

logger = logging.getLogger(__name__)

#: What a worker's first pass over an object store imports: imported once before workers are forked
#: instead of by each worker. Importing obstore does not start its runtime; ``numpy.ma`` is what
#: numpy's ``unique`` imports on its first call (planning the download's order, before the first ask).
PRELOAD = ("torch", "numpy.random", "numpy.ma", "obstore", "numcodecs", "shardkit.adapters.torch", "shardkit.readers.sampler",
           "shardkit.stores.objectstore", "shardkit.stores.prefetch", "shardkit.formats.ranged",
           "shardkit.tiers.pipeline")  # fmt: skip

#: Longest the main process waits for the helper that reads the root documents (then reads them itself).
HELPER_SECONDS = 600.0
#: Longest the helper is given to exit once it has answered (then it is killed), in a thread of its own.
HELPER_EXIT_SECONDS = 5.0
#: The helper sends a dataset's per-record fields along with its documents when they take at most
#: this many bytes in all (larger ones are read by each sampler, as node-shared fields once per node).
HELPER_FIELDS_BYTES = 16 << 20
#: Most shards whose tails the helper checks for the workers (one small request each, all at once);
#: above it each worker checks the tails its first block needs, as a reader does.
HELPER_TAIL_SHARDS = 1024


def remote(paths: Sequence[object]) -> bool:
    """Whether any of ``paths`` is in an object store (not a ``file:`` URL)."""
    return any(isinstance(p, str) and is_url(p) and not p.startswith("file:") for p in paths)


def forkable() -> bool:
    """Whether a child forked now can use object stores (this process has not started the runtime,
    :func:`~shardkit.processes.fork_state`); threads and other libraries do not matter here."""
    state = fork_state()
    return state.fork and not state.store_runtime_started


def source_of(dataset: object) -> Mixture:
    """:func:`~shardkit.readers.sources.as_source` of ``dataset``; for a URL in a process that has not
    used an object store yet, read in a forked helper process so that this one still has not, and
    its DataLoader workers can be forked. The helper is this process's own child running shardkit's
    code, so what it sends back (the source and the root documents' identities) is trusted. Should
    the helper fail, the source is made here (the same errors, raised from here). Its exit (the
    teardown of a copy of this process) is waited for in a thread, not here."""
    if not (isinstance(dataset, str) and remote([dataset])) or not forkable() or mp.current_process().daemon:
        return as_source(dataset)  # (a daemonic process may not start children)
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    helper = ctx.Process(target=_open_in_helper, args=(dataset, send), name="shardkit-open", daemon=True)
    try:
        helper.start()
    except Exception:  # the helper could not start: read here
        receive.close()
        send.close()
        return as_source(dataset)
    send.close()
    preload()  # while the helper waits for the store: what a pass needs here or in forked workers
    try:
        got = receive.recv() if receive.poll(HELPER_SECONDS) else None
    except Exception:  # the helper died without an answer: read here
        got = None
    finally:
        receive.close()
        threading.Thread(target=_reap, args=(helper,), name="shardkit-open-reap", daemon=True).start()
    if got is None:
        logger.debug("%s: reading the dataset's documents in a helper process failed; reading them here", dataset)
        return as_source(dataset)
    source: Mixture
    source, known = got
    for ident, documents, location in known:  # just read: this process's samplers and its workers' reuse them
        for array in (documents.fields or {}).values():
            array.setflags(write=False)  # shared by every sampler of this process, as node-shared fields are
        identity.remember(ident, documents, location)
    return source


def _reap(helper: BaseProcess) -> None:
    """Wait for the helper to exit (it has answered: its exit, tearing down a copy of this process,
    need not delay the caller), at most :data:`HELPER_EXIT_SECONDS`, then kill it."""
    helper.join(HELPER_EXIT_SECONDS)
    if helper.is_alive():
        helper.kill()
        helper.join()


def _open_in_helper(dataset: str, send: Connection) -> None:
    """In the forked helper: the source and, for each dataset, its identity and documents (root and
    array documents, and its fields up to :data:`HELPER_FIELDS_BYTES`), or nothing."""
    try:
        source = as_source(dataset)
        known = []
        for path in source.paths:
            entry = identity.remembered(path)
            if entry is not None:
                known.append((entry[0], _documents(path, entry[1], entry[2]), entry[2]))
        send.send((source, known))
    except BaseException:  # the parent reads the documents itself and raises what it finds
        send.send(None)
    finally:
        send.close()


def _documents(path: object, root: DatasetDocuments, location: str) -> DatasetDocuments:
    """In the helper: the documents of the dataset at ``path`` whose root document is ``root`` (just
    read, filed under ``location``): its array documents and small fields read and checked here,
    once, instead of by every worker and the main process; only ``root`` should that fail (each
    reader then reads the rest itself and reports what it finds)."""
    try:
        with Dataset(path, opened={location: root}) as ds:  # type: ignore[arg-type]
            documents = ds.documents
            if documents is None:
                return root
            tails = (_Tails(ds.payload) if isinstance(ds.payload, RangedPayloadArray)
                     and len(ds.payload.shards) <= HELPER_TAIL_SHARDS else None)
            fields = None
            if ds.meta.num_records * sum(spec.nbytes for spec in ds.meta.fields.values()) <= HELPER_FIELDS_BYTES:
                fields = ds.fields
            return DatasetDocuments(documents.meta, documents.payload_document, fields,
                                    None if tails is None else tails.result())
    except Exception:
        logger.debug("%s: reading the array documents in the helper failed", path, exc_info=True)
        return root


class _Tails:
    """In the helper: every shard's ``tail_crc32c`` checked in a thread (while the fields are read,
    so it adds no round trip), with the ETags to pin (:meth:`RangedPayloadArray.check_tails`). Each
    consumer's first block would otherwise ask for every shard's tail page, requests of their own
    queued behind the background parts already in flight."""

    def __init__(self, payload: RangedPayloadArray) -> None:
        self._payload = payload
        self._tails: dict[int, str] | None = None
        self._thread = threading.Thread(target=self._run, name="shardkit-open-tails", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._tails = self._payload.check_tails()
        except Exception:  # each reader checks the tails itself and reports what it finds
            logger.debug("%s: checking the shards' tails in the helper failed", self._payload.path, exc_info=True)

    def result(self) -> dict[int, str] | None:
        self._thread.join()
        return self._tails


def start_method(paths: Sequence[object]) -> str | None:
    """The start method for DataLoader workers over ``paths`` that the user did not choose: ``None``
    (PyTorch's default) for local datasets, ``fork`` while this process has not used an object
    store, else ``spawn`` (a worker then sees this process's environment as it is now)."""
    if not remote(paths):
        return None
    return "fork" if forkable() else "spawn"


def preload() -> None:
    """Import :data:`PRELOAD` here (a no-op once done)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra that is not installed: the worker imports what it needs
            logger.debug("not preloading %s", name, exc_info=True)


def worker_context(method: str) -> Any:
    """The multiprocessing context for ``method``: for ``fork``, :data:`PRELOAD` imported here first."""
    ctx = mp.get_context(method)
    if method == "fork":
        preload()
    return ctx
