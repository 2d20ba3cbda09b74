"""Stopping background threads: one internal exception, :class:`Stopped`, and the queue calls that
wait in short slices and raise it once the run's stop event is set (docs/design.md §4, *Stopping*).
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Generic, Protocol, TypeVar

__all__ = ["Stopped", "POLL_SECONDS", "put", "get", "CurrentRun"]

#: How often a blocked thread re-checks its stop event: short enough that an abandoned run stops
#: within about a tenth of a second, long enough that an idle thread costs nothing measurable.
POLL_SECONDS = 0.05

T = TypeVar("T")


class Stopped(Exception):
    """Internal: the run was asked to stop while this thread waited or wrote (never a user error)."""


def put(q: queue.Queue[T], item: T, stop: threading.Event, poll: float = POLL_SECONDS) -> None:
    """``q.put(item)``, raising :class:`Stopped` as soon as ``stop`` is set."""
    while True:
        if stop.is_set():
            raise Stopped()
        try:
            q.put(item, timeout=poll)
            return
        except queue.Full:
            continue


def get(q: queue.Queue[T], stop: threading.Event, poll: float = POLL_SECONDS) -> T:
    """``q.get()``, raising :class:`Stopped` as soon as ``stop`` is set."""
    while True:
        if stop.is_set():
            raise Stopped()
        try:
            return q.get(timeout=poll)
        except queue.Empty:
            continue


class _Closeable(Protocol):
    def close(self) -> None: ...


R = TypeVar("R", bound=_Closeable)


class CurrentRun(Generic[R]):
    """A sampler's running iteration, held weakly: an abandoned one is garbage-collected and stops
    itself, one still referenced is stopped here when the next starts or the sampler closes."""

    def __init__(self) -> None:
        self._ref: weakref.ref[R] | None = None

    def start(self, run: R) -> R:
        """Remember ``run`` (weakly) as the running iteration and return it."""
        self._ref = weakref.ref(run)
        return run

    def close(self) -> None:
        """Stop the running iteration, if it is still alive (idempotent)."""
        run = self._ref() if self._ref is not None else None
        if run is not None:
            run.close()
        self._ref = None
