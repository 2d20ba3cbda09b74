"""Executors that run the parts of a conversion: inline, local processes, any ``concurrent.futures.Executor``, a Dask cluster.

A conversion in parts needs ``submit``, how many tasks the executor runs at once (:func:`slots`) and,
on Dask, running a task near a given worker (:func:`submit`: a part is written where its spill is).
Dask (``pip install "shardkit[dask]"``) is imported only by :func:`dask_executor`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from shardkit._extras import import_extra
from shardkit.converters.decoding import keep_freed_memory
from shardkit.converters.main_guard import adopt_environment, start_method, worker_context
from shardkit.errors import ConfigError
from shardkit.processes import exit_when_gone

__all__ = ["InlineExecutor", "slots", "submit", "dask_executor", "local_pool", "scheduler_address"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variable Dask reads the scheduler address from (``dask.config`` ``scheduler-address``).
DASK_SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"


class InlineExecutor(Executor):
    """Runs each task in the calling thread when it is submitted: every part then knows its offset
    when it starts (nothing is spilled) and decodes with the conversion's own ``workers`` processes."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends stop the caller, as in a plain loop
            future.set_exception(exc)
        return future



def _dask_client(executor: Executor) -> Any | None:
    """The Dask client behind ``client.get_executor()``, or ``None`` for any other executor."""
    if type(executor).__module__.startswith("distributed."):
        return getattr(executor, "_client", None)
    return None


def slots(executor: Executor) -> int:
    """How many tasks ``executor`` runs at once: Dask's connected worker threads, a pool's size, 1
    inline, else 4."""
    if isinstance(executor, InlineExecutor):
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
    """``executor.submit(fn, *args)``; on a Dask cluster (``pure=False``: never a cached result)
    preferably on worker ``near`` (an address) but not only there (it may die)."""
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
def dask_executor(address: str, *, timeout: float | None = None, naming: str = "python") -> Iterator[Executor]:
    """A ``concurrent.futures`` executor on the Dask cluster at ``address`` (closed on exit).

    MissingExtraError without Dask; ConfigError naming the address when it is not one or no scheduler
    answers within ``timeout`` seconds (by default Dask's own ``distributed.comm.timeouts.connect``,
    30 s unless configured, e.g. ``DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT=5s``).
    """
    distributed = import_extra("distributed", "dask", needed_by="shardkit convert --scheduler")
    label = "--scheduler" if naming == "cli" else "scheduler"
    if timeout is None:
        import dask
        from dask.utils import parse_timedelta

        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect", "30s"), default="s")
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


def _start_part_worker(parent_pid: int, environ: dict[str, str]) -> None:
    """A part worker's start: the caller's environment (see adopt_environment), and exit with it."""
    adopt_environment(environ)
    keep_freed_memory()  # a part worker decodes as a decode worker does
    exit_when_gone(parent_pid)


@contextmanager
def local_pool(workers: int) -> Iterator[Executor]:
    """The executor of a conversion in parts on this machine: ``workers`` processes started as decode
    workers are (:func:`~shardkit.converters.main_guard.start_method`), each ending itself when this
    process is gone; :class:`InlineExecutor` for one worker or when workers cannot start."""
    method = start_method(workers) if workers > 1 else None
    if method is None:
        yield InlineExecutor()
        return
    pool = ProcessPoolExecutor(workers, mp_context=worker_context(method, ("shardkit.converters.parts",)),
                               initializer=_start_part_worker, initargs=(os.getpid(), dict(os.environ)))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
