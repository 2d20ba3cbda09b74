"""Whether a process still runs: the one check behind every "is its owner gone?" clean-up.

Stale files of a killed run (spill directories of conversion parts, node-shared regions, decode
workers whose parent died) are removed only once their owner is gone. A SIGKILLed process stays a
zombie until its parent reaps it, so a zombie counts as gone; a process of another user (``EPERM``
from a signal-0 probe) counts as running.
"""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
