"""Jobs in threads of the test process: the consumers of a shared tier server that a test runs
side by side, each one's result kept, and every error of any of them reported by the test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Jobs", "run_jobs"]

T = TypeVar("T")


class Jobs(Generic[T]):
    """``job(i)`` for each ``i`` of ``ids``, each in its own thread; start them together or in stages."""

    def __init__(self, job: Callable[[int], T], ids: Iterable[int]) -> None:
        self.results: dict[int, T] = {}
        self.errors: list[BaseException] = []
        self._job = job
        self._threads = {i: threading.Thread(target=self._run, args=(i,)) for i in ids}
        self._started: set[int] = set()

    def _run(self, i: int) -> None:
        try:
            self.results[i] = self._job(i)
        except BaseException as exc:  # reported by join(), in the test's thread
            self.errors.append(exc)

    def start(self, *ids: int) -> None:
        """Start the jobs ``ids`` (default: every job not started yet)."""
        for i in ids or [i for i in self._threads if i not in self._started]:
            self._started.add(i)
            self._threads[i].start()

    def join(self, timeout: float) -> dict[int, T]:
        """Wait for every job (up to ``timeout`` seconds each); fail the test with the jobs' errors, if any."""
        for t in self._threads.values():
            t.join(timeout)
        assert not self.errors, self.errors
        return self.results


def run_jobs(job: Callable[[int], T], ids: Iterable[int], timeout: float) -> dict[int, T]:
    """Run ``job(i)`` for every ``i`` at once, each in its own thread; their results by ``i``."""
    jobs = Jobs(job, ids)
    jobs.start()
    return jobs.join(timeout)
