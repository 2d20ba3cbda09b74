"""Whether a process still runs: the one check behind every "is its owner gone?" clean-up.

A zombie (a SIGKILLed process not yet reaped) counts as gone; a process of another user as running.
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
