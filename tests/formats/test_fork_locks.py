"""A child forked while another thread holds one of the readers' locks gets it free: the child has
no such thread, so an inherited held lock would hang its first use (a DataLoader worker forks from
a process whose reader threads may be reading). Each check is bounded: a child that would hang is
killed and reported, never left to hang the suite."""

from __future__ import annotations

import os
import signal
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import decode_threads as decode_threads_mod
from shardkit.formats import open_dataset
from shardkit.readers import identity as identity_mod
from shardkit.stores import cache as cache_mod
from shardkit.stores import url as url_mod
from tests.helpers.datasets import write_dataset
from tests.helpers.forks import wait_child

#: How long the child tries each lock; a lock still held after this would have hung it.
ACQUIRE_SECONDS = 5.0


def _fork_while_held(lock: Any, use: Callable[[], Any]) -> int:
    """Fork while another thread holds ``lock``; the child calls ``use`` (which takes the lock as
    the child finds it) and exits 0. Returns the child's exit status."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(int(4 * ACQUIRE_SECONDS))  # (a hang ends the child, never the suite)
                use()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        return wait_child(pid)
    finally:
        release.set()
        holder.join(30)


def _acquired(owner: object, name: str) -> Callable[[], None]:
    """Take ``owner``'s lock ``name`` as it is when called (in the child: the renewed one), bounded."""

    def take() -> None:
        lock = getattr(owner, name)
        if not lock.acquire(timeout=ACQUIRE_SECONDS):
            raise TimeoutError(f"{name} is still held")
        lock.release()

    return take


@pytest.fixture
def payload(tmp_path: Path) -> Any:
    records = (np.arange(40 * 64) % 251).astype(np.uint8).reshape(40, 64)
    with open_dataset(write_dataset(tmp_path / "ds", records, records_per_shard=10)) as ds:
        yield ds.payload


def test_a_reader_closes_in_a_child_forked_while_its_lock_is_held(payload: Any) -> None:
    """``PayloadArray._lock`` (held while a reader thread opens, maps or closes shards): the child's
    close, which takes it, ends."""
    assert _fork_while_held(payload._lock, payload.close) == 0


@pytest.mark.parametrize("name", ["_check_lock", "_lock"])
def test_a_readers_locks_are_free_in_a_forked_child(payload: Any, name: str) -> None:
    assert _fork_while_held(getattr(payload, name), _acquired(payload, name)) == 0


def test_read_counters_count_in_a_forked_child(payload: Any) -> None:
    """``ReadStats._lock``, taken by every read's counters."""
    stats = payload.stats
    assert _fork_while_held(stats._lock, lambda: stats.add("x", 0, 1)) == 0


@pytest.mark.parametrize(("module", "name"), [(cache_mod, "_VERIFIED_LOCK"), (url_mod, "_stores_lock"),
                                             (identity_mod, "_OPENED_LOCK"), (decode_threads_mod, "_FORK_LOCK")])
def test_module_locks_of_the_read_path_are_free_in_a_forked_child(module: Any, name: str) -> None:
    """The cache's table of checked copies, the table of open stores and of opened datasets' documents,
    used by a worker's first pass, and the lock of a forked child's decode-thread restarts."""
    assert _fork_while_held(getattr(module, name), _acquired(module, name)) == 0
