"""The decode threads of one reader: a few threads that run the reader's decode jobs, and the jobs.

A job is a lock held until the job has run, so waiting for it is one C-level lock acquisition and
finishing it one release: no ``concurrent.futures.Future`` (whose condition variable, waiter lists
and the executor's idle semaphore are Python code run under the GIL by the decoders, the reading
thread and the assembler for every job), since the decoders return into Python between records
and every bytecode one of them runs under the GIL is one the other decoder may wait for.
"""

from __future__ import annotations

import _thread
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable

from shardkit.processes import renew_locks_after_fork

__all__ = ["DecodeJob", "DecodeThreads", "finish_decodes", "wait_decodes"]


class DecodeJob:
    """One call for the decode threads; :meth:`wait` returns once it ran, :meth:`result` also raises
    its error (an exception it raised, kept for the thread that waits)."""

    __slots__ = ("_call", "_done", "error")

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self.error: BaseException | None = None

    def run(self) -> None:
        """Run the call once (on a decode thread), keep its error, then mark the job done."""
        call, self._call = self._call, None
        try:
            if call is not None:
                call()
        except BaseException as exc:  # handed to the waiting thread, never a dead decode thread
            self.error = exc
        finally:
            self._done.release()

    def done(self) -> bool:
        """True once the job ran."""
        return not self._done.locked()

    def wait(self) -> None:
        """Block until the job ran (the lock is released for the other waiters at once)."""
        self._done.acquire()
        self._done.release()

    def result(self) -> None:
        """Wait for the job, then raise its error if it had one."""
        self.wait()
        if self.error is not None:
            raise self.error


def wait_decodes(jobs: Iterable[DecodeJob]) -> None:
    """Wait for every job of ``jobs`` (their errors left for :func:`finish_decodes`), the last
    submitted first: the jobs end about in order, so the waiting thread sleeps once, not once a job."""
    for job in reversed(list(jobs)):
        job.wait()


def finish_decodes(jobs: Iterable[DecodeJob]) -> None:
    """Wait for every decode job of a read, then raise the first one's error (in read order): on an
    error the read returns only once no decoder still writes into its rows."""
    jobs = list(jobs)
    wait_decodes(jobs)
    for job in jobs:
        if job.error is not None:
            raise job.error


def _serve(jobs: queue.SimpleQueue[DecodeJob | None]) -> None:
    """A decode thread: run jobs until a ``None`` asks it to end."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()


def _stop(jobs: queue.SimpleQueue[DecodeJob | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        jobs.put(None)


class DecodeThreads:
    """``workers`` daemon threads named ``<name>_<k>`` that run submitted calls in submission order
    (the first free thread takes the next). The threads end at :meth:`shutdown`, or once the object
    is collected; being daemons, they never hold up the interpreter's exit.

    A process forked from the owner inherits the object but none of its threads: its first
    :meth:`submit` starts threads of its own on a fresh queue (the parent's pending jobs are not the
    child's), so a reader used before a ``fork`` decodes in the child instead of waiting forever."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers = max(1, int(workers))
        self._name = name
        self._start()

    def _start(self) -> None:
        """Start the threads (and their queue) of this process."""
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue[DecodeJob | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_serve, args=(self._jobs,), name=f"{self._name}_{k}", daemon=True)
                         for k in range(self._workers)]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._threads)

    def _restart_in_child(self) -> None:
        """After a fork: drop the parent's queue and threads (none runs here) and start this process's."""
        with _FORK_LOCK:
            if self._pid != os.getpid():
                self._finalizer.detach()
                self._start()

    def submit(self, call: Callable[[], None]) -> DecodeJob:
        """Queue ``call`` and return its job."""
        if self._pid != os.getpid():
            self._restart_in_child()
        job = DecodeJob(call)
        self._jobs.put(job)
        return job

    def shutdown(self, wait: bool = True) -> None:
        """Let every thread end once the jobs queued before have run; with ``wait``, join them (in a
        forked child, the parent's threads were never this process's: nothing to join)."""
        self._finalizer()
        if wait and self._pid == os.getpid():
            current = threading.current_thread()
            for t in self._threads:
                if t is not current:
                    t.join()


#: Serialises a forked child's restarts; a new lock in every child (one held at the fork stays held).
_FORK_LOCK = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_FORK_LOCK")
