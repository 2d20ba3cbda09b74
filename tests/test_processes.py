"""shardkit.processes: pid_alive, the owner check behind every clean-up of a killed run's files, and
fork_state, the facts behind the start-method choices."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardkit.processes import FORK_UNSAFE_MODULES, fork_state, pid_alive


def test_running_dead_and_zombie_processes() -> None:
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while pid_alive(p.pid) and time.monotonic() < deadline:  # exits, then a zombie until reaped: both "gone"
        time.sleep(0.01)
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)


def test_fork_state_says_what_a_forked_child_would_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The facts behind both start-method choices: threads, native-runtime libraries, and an object
    store's runtime (never imported, never used; imported, used only once it says so)."""
    import threading

    from shardkit.adapters._start import forkable
    from shardkit.converters.main_guard import fork_is_safe
    from shardkit.stores import objectstore

    for name in FORK_UNSAFE_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(objectstore, "_used", False)
    state = fork_state()
    assert state.threads == 1 and state.native_runtimes == () and not state.store_runtime_started
    assert forkable() == state.fork and fork_is_safe() == (state.fork and state.linux)

    monkeypatch.setitem(sys.modules, "grpc", sys)
    monkeypatch.setattr(threading, "active_count", lambda: 3)
    state = fork_state()
    assert state.threads == 3 and state.native_runtimes == ("grpc",)
    assert not fork_is_safe() and forkable() == state.fork  # the adapters mind only the store's runtime

    monkeypatch.setattr(objectstore, "_used", True)
    assert fork_state().store_runtime_started and not forkable()
    monkeypatch.delitem(sys.modules, "shardkit.stores.objectstore")
    assert not fork_state().store_runtime_started  # an object store never imported was never used


def test_renewed_locks_are_forgotten_with_their_owner() -> None:
    """An owner registered for renewal after fork is dropped from the table once collected (the
    table holds it weakly), so short-lived readers do not pile up there."""
    import gc
    import threading

    from shardkit import processes

    class Owner:
        def __init__(self) -> None:
            self.lock = threading.Lock()

    owner = Owner()
    processes.renew_locks_after_fork(owner, "lock")
    key = id(owner)
    assert key in processes._RENEWED
    del owner
    gc.collect()
    assert key not in processes._RENEWED
