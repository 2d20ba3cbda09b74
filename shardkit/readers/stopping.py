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
from typing import TypeVar

__all__ = ["Stopped", "POLL_SECONDS", "put", "get"]

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
