"""A SIGKILLed ``shardkit convert --part-size N --workers 2`` leaves no process and no semaphore behind.

Its pool workers are children of the fork server, not of the killed process, and they hold the fork
server's and the resource tracker's pipes open: unless they end themselves, all of them stay (about
170 MB and a few ``/dev/shm/sem.*`` per kill).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from shardkit.processes import pid_alive
from tests.helpers.parts import class_corpus

REPO = Path(__file__).resolve().parents[2]
#: Generous bound for the leftovers to go (they poll every 0.5 s); not a performance claim.
_DEADLINE = 60.0


def _wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _semaphores(proc: psutil.Process) -> set[str]:
    """The POSIX semaphores ``proc`` has mapped (``/dev/shm/sem.*``)."""
    return {m.path for m in proc.memory_maps() if os.path.basename(m.path).startswith("sem.")}


def test_sigkilled_conversion_in_parts_leaves_nothing_running(tmp_path: Path) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape", "plant"])
    started = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "stderr", "wb") as err:
        job = subprocess.Popen([sys.executable, "-m", "tests.converters.cli_job", "convert", str(src), "-o",
                                str(tmp_path / "out"), "--kind", "blockingimages", "--size", "16", "--part-size", "2",
                                "--workers", "2", "-q"], cwd=REPO, env=env, stderr=err, start_new_session=True)
    main = psutil.Process(job.pid)
    tree: list[psutil.Process] = []
    try:
        # Both workers are inside a part (their decoders never return): the run is in the middle.
        _wait_for("two workers converting", lambda: (started.is_dir() and len(list(started.iterdir())) >= 2)
                  or job.poll() is not None, 240)
        assert job.poll() is None, (tmp_path / "stderr").read_text()
        tree = main.children(recursive=True)
        semaphores = _semaphores(main)
        workers = {int(p.name) for p in started.iterdir()}
        assert workers <= {p.pid for p in tree} and semaphores  # resource tracker, fork server, 2 workers
        job.send_signal(signal.SIGKILL)
        job.wait()
        _wait_for("the processes of the killed run to end", lambda: not any(pid_alive(p.pid) for p in tree), _DEADLINE)
        _wait_for("its semaphores to be removed", lambda: not any(os.path.exists(s) for s in semaphores), _DEADLINE)
    finally:
        _kill_leaving_no_semaphores([main, *tree])


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()  # psutil checks it is still the same process (no pid reuse)
        except psutil.NoSuchProcess:
            pass


def _kill_leaving_no_semaphores(procs: list[psutil.Process]) -> None:
    """Whatever the test found, end what it started: everything but the resource tracker first, which
    then removes the run's semaphores and exits by itself once their pipes are closed."""

    def is_tracker(proc: psutil.Process) -> bool:
        try:
            return "resource_tracker" in " ".join(proc.cmdline())
        except psutil.Error:
            return False

    trackers = [p for p in procs if is_tracker(p)]
    _kill([p for p in procs if p not in trackers])
    try:
        psutil.wait_procs(trackers, timeout=_DEADLINE)
    finally:
        _kill(trackers)
