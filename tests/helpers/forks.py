"""Forked children of the test process, waited for with a bound: a child that would hang is killed
and its status returned, never left to hang the suite."""

from __future__ import annotations

import os
import signal
import time

__all__ = ["wait_child"]


def wait_child(pid: int, seconds: float = 60.0) -> int:
    """The exit status of the forked child ``pid``; killed (SIGKILL) if it runs ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]
