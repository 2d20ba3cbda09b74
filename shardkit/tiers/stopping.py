"""Stopping background threads: one internal exception and the queue calls that honour a stop event.

The sampler's creator threads block on bounded queues (double buffering is what bounds memory). A
blocked thread must still notice when its run is abandoned (``break``, an exception, Ctrl-C,
garbage collection), so every blocking call waits in short slices and re-checks the run's
:class:`threading.Event`; when it is set the call raises :class:`Stopped`, which unwinds the thread
without being reported as an error. Everything that stops this way uses these two calls, so there
is one polling rule and one exception for "asked to stop".
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
    """A sampler's running iteration, held weakly.

    A run the caller abandons (``break`` out of the loop and drop the iterator) is garbage-collected
    and stops its own threads; one still referenced is stopped here when the sampler starts the
    next iteration or closes. Both samplers (:class:`~shardkit.readers.TieredSampler`,
    :class:`~shardkit.readers.SharedSampler`) keep their run this way.
    """

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
