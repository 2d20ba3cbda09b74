"""shardkit.processes.pid_alive: the owner check behind every clean-up of a killed run's files."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from shardkit.processes import pid_alive


def test_running_dead_and_zombie_processes() -> None:
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while pid_alive(p.pid) and time.monotonic() < deadline:  # exits, then a zombie until reaped: both "gone"
        time.sleep(0.01)
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)
