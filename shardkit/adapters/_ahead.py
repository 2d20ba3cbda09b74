"""The next pass's sampler, built ahead in a background thread: one mechanism for both adapters
(docs/design.md §6). A pass's sampler costs round trips to an object store to build and its first
block to start; building it while the previous pass ends takes both off the next pass's first batch."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from shardkit.errors import SamplerError
from shardkit.readers.interface import Batch, Sampler

__all__ = ["NextPass"]

logger = logging.getLogger(__name__)

#: Longest a closing :class:`NextPass` (a DataLoader worker that exits) waits for a build under way.
JOIN_SECONDS = 10.0


@dataclass
class _Prepared:
    """A sampler built for a pass from ``epoch`` of consumer ``key``, and its iteration once started."""

    epoch: int
    key: Hashable
    sampler: Sampler
    run: Iterator[Batch] | None = None


@dataclass
class _State:
    """What the background threads share (never the :class:`NextPass` itself, so that its finalizer runs)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: _Prepared | None = None
    building: threading.Thread | None = None
    #: The epoch ``building`` builds the sampler of (named when it does not end in time).
    building_epoch: int | None = None
    #: Start the prepared sampler's iteration as soon as it is built (:meth:`NextPass.start`).
    start: bool = False
    closed: bool = False

    def close(self, wait: bool) -> None:
        """Close the prepared sampler; a build under way closes its own once built. With ``wait``
        (the process is ending, so a build still running then never will), first wait for that
        build up to :data:`JOIN_SECONDS`, and raise SamplerError naming it if it still runs."""
        with self.lock:
            self.closed = True
            ready, self.ready = self.ready, None
            building, epoch = self.building, self.building_epoch
        stuck = False
        if wait and building is not None:
            building.join(JOIN_SECONDS)
            stuck = building.is_alive()
        if ready is not None:
            ready.sampler.close()  # stops its iteration too
        if stuck:
            raise SamplerError(
                f"the sampler of the next pass (epoch {epoch}) was still being built {JOIN_SECONDS:.0f} s after "
                f"process {os.getpid()} began to exit; it is abandoned unclosed (what it opened goes with the process)"
            )


class NextPass:
    """The sampler of a consumer's next pass, prepared ahead (:meth:`prepare`, or
    :meth:`prepare_in_background` while a pass runs), its iteration started early on request
    (:meth:`start`: its first blocks are read while the current pass ends).

    :meth:`take` hands it to a pass that starts the epoch and consumer it was built for; a sampler
    whose iteration did not start is first checked against its dataset (``identity``: a replaced
    dataset needs a new sampler), a started one is checked by its own reads. Anything not taken is
    closed: when a newer one replaces it, on a mismatch, on :meth:`close`, and at the exit of the
    process (a DataLoader worker ends through multiprocessing's exit handlers). Any thread.
    """

    def __init__(self, build: Callable[[int], Sampler]) -> None:
        self._build = build
        self._state = _State()
        self._finalizer = multiprocessing.util.Finalize(self, self._state.close, args=(True,), exitpriority=10)

    def prepare(self, epoch: int, key: Hashable = None) -> None:
        """Build the sampler of a pass from ``epoch`` for consumer ``key`` now, replacing another."""
        with self._state.lock:
            self._state.start = False
        _prepare(self._state, self._build, epoch, key)

    def prepare_in_background(self, epoch: int, key: Hashable = None) -> None:
        """:meth:`prepare` in a thread of its own (one build at a time, the later kept), a failure only
        logged: the pass that needs the sampler builds its own and reports the error then."""
        state, build = self._state, self._build

        def run(earlier: threading.Thread | None) -> None:
            if earlier is not None:
                earlier.join()
            try:
                _prepare(state, build, epoch, key)
            except Exception:
                logger.debug("building the next pass's sampler ahead failed", exc_info=True)

        with state.lock:
            if state.closed:
                return
            state.start = False
            state.building_epoch = epoch
            state.building = threading.Thread(target=run, args=(state.building,), name="shardkit-next-pass", daemon=True)
            state.building.start()  # inside the lock: take() never finds a thread not yet started

    def start(self) -> None:
        """Start the prepared sampler's iteration, now or as soon as it is built (this one only: the
        next :meth:`prepare` or :meth:`take` forgets the request)."""
        state = self._state
        with state.lock:
            state.start = True
            ready = state.ready
            if ready is None or ready.run is not None or state.closed:
                return
            ready.run = iter(ready.sampler)

    def wait(self) -> None:
        """Until the sampler under way is built and its iteration started (or building failed)."""
        self.start()
        with self._state.lock:
            building = self._state.building
        if building is not None:
            building.join()

    def take(self, epoch: int, key: Hashable = None) -> tuple[Sampler, Iterator[Batch] | None] | None:
        """The sampler built for ``epoch`` and ``key`` (waiting for a build under way) and its
        iteration if started, or ``None`` (the caller builds its own; a mismatch is closed)."""
        state = self._state
        with state.lock:
            building, state.building = state.building, None
        if building is not None:
            building.join()
        with state.lock:
            ready, state.ready = state.ready, None
            state.start = False  # asked of the pass taken (or dropped) now
        if ready is None:
            return None
        if ready.epoch == epoch and ready.key == key:
            if ready.run is not None:
                return ready.sampler, ready.run
            try:
                identity = getattr(ready.sampler, "identity", None)
                if identity is not None:
                    identity.check()
                return ready.sampler, None
            except SamplerError:  # replaced since: a new sampler opens the dataset as it is now
                pass
        ready.sampler.close()
        return None

    def close(self) -> None:
        """Close the prepared sampler; one still being built is closed as soon as it is."""
        self._state.close(wait=False)


def _prepare(state: _State, build: Callable[[int], Sampler], epoch: int, key: Hashable) -> None:
    sampler: Sampler | None = build(epoch)
    old: _Prepared | None = None
    with state.lock:
        if not state.closed and sampler is not None:
            old, state.ready = state.ready, _Prepared(epoch, key, sampler)
            sampler = None
            if state.start:
                state.ready.run = iter(state.ready.sampler)
    for unused in (old.sampler if old is not None else None, sampler):
        if unused is not None:
            unused.close()
