"""NextPass as the torch adapter uses it: bound to a consumer key, its iteration started ahead. (As
the tf adapter uses it, without key or start: tests/adapters/tf_script.py::next_sampler_cases.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from shardkit.adapters import _ahead
from shardkit.adapters._ahead import NextPass
from shardkit.errors import SamplerError


class _Fake:
    """A stand-in sampler: records when its iteration starts and its close; identity check on demand."""

    def __init__(self, epoch: int, changed: bool = False) -> None:
        self.epoch, self.changed, self.closed, self.started = epoch, changed, False, False
        self.identity = self

    def check(self) -> None:
        if self.changed:
            raise SamplerError("dataset changed")

    def __iter__(self) -> Iterator[int]:
        self.started = True
        return iter([self.epoch])

    def close(self) -> None:
        self.closed = True


def test_a_started_pass_is_taken_with_its_iteration_by_its_consumer_only() -> None:
    made: list[_Fake] = []
    release = threading.Event()

    def build(epoch: int) -> _Fake:
        release.wait(10)  # start() is asked for while the build is under way
        made.append(_Fake(epoch))
        return made[-1]

    ahead = NextPass(build)  # type: ignore[arg-type]
    ahead.prepare_in_background(4, (0, 2, 2))
    ahead.start()
    release.set()
    ahead.wait()
    assert made[0].started  # started by the build thread, as soon as it was built
    taken = ahead.take(4, (0, 2, 2))
    assert taken is not None and taken[0] is made[0] and list(taken[1] or []) == [4]

    ahead.prepare_in_background(5, (0, 2, 2))
    ahead.wait()
    assert ahead.take(5, (1, 2, 2)) is None and made[1].closed  # another consumer's
    ahead.prepare_in_background(6, (0, 2, 2))
    assert ahead.take(6, (0, 2, 2)) == (made[2], None) and not made[2].started  # not asked to start
    ahead.close()


def test_a_started_pass_is_not_checked_again_but_an_unstarted_one_is() -> None:
    """A started iteration checks the dataset with its own reads; one not started is checked on take."""
    changed = [True]

    def build(epoch: int) -> _Fake:
        return _Fake(epoch, changed[0])

    ahead = NextPass(build)  # type: ignore[arg-type]
    ahead.prepare(1, "k")
    ahead.start()
    taken = ahead.take(1, "k")
    assert taken is not None and taken[1] is not None
    ahead.prepare(2, "k")
    sampler = ahead._state.ready.sampler if ahead._state.ready is not None else None
    assert ahead.take(2, "k") is None and isinstance(sampler, _Fake) and sampler.closed
    ahead.close()


def test_a_build_still_running_at_exit_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the process's exit (the finalizer) the wait for a build under way is bounded; a build still
    running then is a SamplerError naming the pass, not silence. A build that ends later still closes
    its own sampler."""
    monkeypatch.setattr(_ahead, "JOIN_SECONDS", 0.2)
    made: list[_Fake] = []
    release = threading.Event()

    def build(epoch: int) -> _Fake:
        release.wait(30)
        made.append(_Fake(epoch))
        return made[-1]

    ahead = NextPass(build)  # type: ignore[arg-type]
    ahead.prepare_in_background(7, (0, 2, 2))
    with pytest.raises(SamplerError, match=r"next pass \(epoch 7\) was still being built"):
        ahead._finalizer()  # what multiprocessing's exit handlers run in a DataLoader worker
    release.set()
    for t in threading.enumerate():
        if t.name == "shardkit-next-pass":
            t.join(30)
    assert made and made[0].closed

    quick = NextPass(lambda epoch: _Fake(epoch))  # type: ignore[arg-type, return-value]
    quick.prepare_in_background(1)
    quick._finalizer()  # a build that ends in time: no error
