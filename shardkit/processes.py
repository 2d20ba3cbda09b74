"""Facts about processes: whether one still runs (the one check behind every "is its owner gone?"
clean-up), and what a child forked from this one now would inherit (:func:`fork_state`, the facts
behind both the converters' and the DataLoader adapters' choice of a start method); thread locks
that a forked child gets new (:func:`renew_locks_after_fork`).

A zombie (a SIGKILLed process not yet reaped) counts as gone; a process of another user as running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

__all__ = ["pid_alive", "exit_when_gone", "FORK_UNSAFE_MODULES", "ForkState", "fork_state", "renew_locks_after_fork"]

#: Seconds between two checks of :func:`exit_when_gone`.
WATCH_INTERVAL = 0.5


def pid_alive(pid: int) -> bool:
    """``True`` while process ``pid`` runs (a zombie does not: see the module docstring)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def exit_when_gone(pid: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit(1)``) once process ``pid`` is gone.

    For pool workers, ``pid`` owning the pool: a ``ProcessPoolExecutor`` worker never notices a
    SIGKILLed owner by itself (it holds both ends of its queue) and would wait forever.
    """

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval)
        os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name=f"shardkit-exit-when-{pid}-gone")
    thread.start()
    return thread


#: Libraries that run native threads or runtimes of their own once used (thread pools, gRPC, an async
#: runtime): a child forked from a process that loaded one could inherit a lock held by a thread it
#: does not have.
FORK_UNSAFE_MODULES = ("torch", "tensorflow", "jax", "grpc", "obstore", "distributed")

#: The module whose object-store runtime does not survive ``fork()`` once used.
_OBJECT_STORE_MODULE = "shardkit.stores.objectstore"


@dataclass(frozen=True)
class ForkState:
    """What a child forked from this process now would inherit; each caller decides from it."""

    #: The platform offers the ``fork`` start method.
    fork: bool
    #: The platform is Linux.
    linux: bool
    #: Python threads running in this process, the caller's included.
    threads: int
    #: Those of :data:`FORK_UNSAFE_MODULES` that this process has imported.
    native_runtimes: tuple[str, ...]
    #: This process has used an object store, whose runtime (tokio) a forked child cannot use.
    store_runtime_started: bool


def fork_state() -> ForkState:
    """The :class:`ForkState` of this process now (imports nothing: an object store that was never
    imported was never used)."""
    store = sys.modules.get(_OBJECT_STORE_MODULE)
    return ForkState(
        fork="fork" in mp.get_all_start_methods(),
        linux=sys.platform.startswith("linux"),
        threads=threading.active_count(),
        native_runtimes=tuple(name for name in FORK_UNSAFE_MODULES if name in sys.modules),
        store_runtime_started=store is not None and bool(store.runtime_started()),
    )


#: Owners of locks renewed in a forked child (:func:`renew_locks_after_fork`): ``id(owner)`` ->
#: (a weak reference to it, its lock attributes). Plain dict operations, atomic under the GIL: a
#: lock guarding this table would itself need renewing.
_RENEWED: dict[int, tuple[weakref.ref[object], tuple[str, ...]]] = {}
_RLOCK_TYPE = type(threading.RLock())


def renew_locks_after_fork(owner: object, *names: str) -> None:
    """In every child forked from this process from now on, ``owner``'s attributes ``names`` (thread
    locks) are new, unheld locks of the same kind. Why: a lock another thread held at the fork stays
    held in the child, which has no such thread, so the child's first use of it would hang (a
    DataLoader worker forks from a process whose reader threads may hold one). ``owner``: an object
    or a module, forgotten once collected. Only for locks whose guarded state stays usable in the
    child as it was at the fork (counters, caches), not half-done updates it must not see."""
    key = id(owner)
    _RENEWED[key] = (weakref.ref(owner, lambda _: _RENEWED.pop(key, None)), names)


def _renew_locks_in_child() -> None:
    for ref, names in list(_RENEWED.values()):
        owner = ref()
        if owner is None:
            continue
        for name in names:
            old = getattr(owner, name, None)
            if old is not None:
                setattr(owner, name, threading.RLock() if isinstance(old, _RLOCK_TYPE) else threading.Lock())


os.register_at_fork(after_in_child=_renew_locks_in_child)
