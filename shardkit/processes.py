"""Whether a process still runs: the one check behind every "is its owner gone?" clean-up.

Stale files of a killed run (spill directories of conversion parts, node-shared regions, decode
workers whose parent died) are removed only once their owner is gone. A SIGKILLed process stays a
zombie until its parent reaps it, so a zombie counts as gone; a process of another user (``EPERM``
from a signal-0 probe) counts as running.

Worker processes of a pool end themselves when the process that started the pool is gone
(:func:`exit_when_gone`).
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["pid_alive", "exit_when_gone"]

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


def _exit_when_gone(pid: int, interval: float) -> None:
    while pid_alive(pid):
        time.sleep(interval)
    os._exit(1)


def exit_when_gone(pid: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit(1)``) once process ``pid`` is gone.

    For the initializer of pool workers, ``pid`` being the process that owns the pool. A worker of a
    ``ProcessPoolExecutor`` holds both ends of its task queue and (with ``forkserver``) is the child of
    the fork server, not of that process, so it never notices a SIGKILLed owner by itself: it would
    wait forever, and keep the fork server, the resource tracker and their semaphores alive with it.
    Polling ``pid`` works whatever the start method; ``os._exit`` skips clean-ups that would wait
    for the dead owner.
    """
    thread = threading.Thread(target=_exit_when_gone, args=(pid, interval), daemon=True,
                              name=f"shardkit-exit-when-{pid}-gone")
    thread.start()
    return thread
