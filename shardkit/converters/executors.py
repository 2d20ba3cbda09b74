"""Executors that run the parts of a conversion: inline, local processes, any ``concurrent.futures.Executor``, a Dask cluster.

A conversion in parts (:mod:`shardkit.converters.partrun`) needs three things from an executor:
``submit``, how many tasks it runs at once (:func:`slots`, so no more are queued than run), and,
on a Dask cluster, running a task *near* a given worker (:func:`submit`, so a part is written where
its spill is). Anything else is the executor's own business: a Dask cluster re-runs the tasks of a
worker that died on another worker, a process pool does not (its error says so and a re-run
resumes).

Dask is an optional extra (``pip install "shardkit[dask]"``), imported only when
:func:`dask_executor` is called.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from shardkit._extras import import_extra
from shardkit.converters.main_guard import start_method, worker_context
from shardkit.errors import ConfigError
from shardkit.processes import exit_when_gone

__all__ = ["InlineExecutor", "slots", "submit", "dask_executor", "is_inline", "local_pool", "scheduler_address"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variable Dask reads the scheduler address from (``dask.config`` ``scheduler-address``).
DASK_SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"


class InlineExecutor(Executor):
    """Runs each task in the calling thread when it is submitted (one at a time).

    What a conversion in parts uses when no executor is given (``append`` without one): every part
    then knows its offset when it starts, so nothing is spilled, and each part decodes with the
    conversion's own ``workers`` processes.
    """

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends stop the caller, as in a plain loop
            future.set_exception(exc)
        return future


def is_inline(executor: Executor) -> bool:
    return isinstance(executor, InlineExecutor)


def _dask_client(executor: Executor) -> Any | None:
    """The Dask client behind ``client.get_executor()``, or ``None`` for any other executor."""
    if type(executor).__module__.startswith("distributed."):
        return getattr(executor, "_client", None)
    return None


def slots(executor: Executor) -> int:
    """How many tasks ``executor`` runs at once (the scheduler keeps that many in flight).

    Dask: the threads of every worker now connected; process and thread pools: their size; inline:
    1; anything else: 4.
    """
    if is_inline(executor):
        return 1
    client = _dask_client(executor)
    if client is not None:
        try:
            return max(1, int(sum(client.nthreads().values())))
        except Exception:  # a cluster being scaled: fall back to a small window
            return 2
    workers = getattr(executor, "_max_workers", None)
    return int(workers) if isinstance(workers, int) and workers > 0 else 4


def submit(executor: Executor, fn: Callable[..., T], *args: Any, near: str = "") -> Future[T]:
    """``executor.submit(fn, *args)``; on a Dask cluster preferably on worker ``near`` (an address).

    Tasks go to Dask with ``pure=False`` (every submission runs, none is served from a cached
    result) and ``allow_other_workers`` (a worker that died does not hold its tasks back).
    """
    client = _dask_client(executor)
    if client is None:
        return executor.submit(fn, *args)
    extra: dict[str, Any] = {"pure": False}
    if near:
        extra |= {"workers": [near], "allow_other_workers": True}
    return executor.submit(fn, *args, **extra)


def scheduler_address(given: str | None) -> str | None:
    """The Dask scheduler to use: ``given``, else ``$DASK_SCHEDULER_ADDRESS`` (as Dask's own tools do).

    ``given == "local"`` forces the local process pool even when the environment names a cluster.
    """
    if given is not None:
        return None if given.strip().lower() == "local" else given.strip()
    env = os.environ.get(DASK_SCHEDULER_ENV, "").strip()
    return env or None


@contextmanager
def dask_executor(address: str, *, timeout: float = 30.0, naming: str = "python") -> Iterator[Executor]:
    """A ``concurrent.futures`` executor on the Dask cluster at ``address`` (closed on exit).

    Raises
    ------
    MissingExtraError
        Dask is not installed (``pip install "shardkit[dask]"``).
    ConfigError
        The scheduler does not answer within ``timeout`` seconds (naming the address), or the address
        is not one.
    """
    distributed = import_extra("distributed", "dask", needed_by="shardkit convert --scheduler")
    label = "--scheduler" if naming == "cli" else "scheduler"
    try:
        client = distributed.Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ConfigError(f"{label} {address}: no Dask scheduler answered ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:
        raise ConfigError(f"{label} {address!r}: not a Dask scheduler address ({exc})") from None
    try:
        workers = len(client.scheduler_info().get("workers", {}))
        logger.info("Dask scheduler %s: %d workers", address, workers)
        if workers == 0:
            logger.warning("Dask scheduler %s has no workers yet; parts wait until one connects", address)
        yield client.get_executor()
    finally:
        client.close()


@contextmanager
def local_pool(workers: int) -> Iterator[Executor]:
    """The executor of a conversion in parts on this machine: ``workers`` processes, each converting
    whole parts and writing their shards itself (shut down on exit).

    The processes start the way decode workers do (:func:`~shardkit.converters.main_guard.start_method`:
    forkserver, or fork for a script without a main guard). One worker, or a caller whose workers
    could not start, gets :class:`InlineExecutor`: the parts are converted one after another here.
    Each worker ends itself when this process is gone (:func:`~shardkit.processes.exit_when_gone`),
    so a SIGKILLed conversion leaves no workers, fork server or resource tracker behind.
    """
    method = start_method(workers) if workers > 1 else None
    if method is None:
        yield InlineExecutor()
        return
    pool = ProcessPoolExecutor(workers, mp_context=worker_context(method, ("shardkit.converters.parts",)),
                               initializer=exit_when_gone, initargs=(os.getpid(),))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
