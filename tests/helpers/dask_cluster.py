"""A real Dask cluster on loopback for the tests: ``dask scheduler`` and ``dask worker --nworkers 1 --nthreads 1``.

Every process listens on a port the OS chose (the scheduler writes its address to a scheduler file;
workers and the dashboard use port 0), so tests of other helpers running the same suite at the same
time never collide. Each ``dask worker`` runs in its own session, so one worker can be SIGKILLed
with its nanny (:meth:`DaskCluster.kill_worker`) and started again (:meth:`DaskCluster.start_worker`).
Everything started here is stopped at the end (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Seconds to wait for the cluster to come up on a machine other test runs keep busy.
START_TIMEOUT = 180.0


def _dask() -> str:
    exe = shutil.which("dask")
    if exe is None:
        raise RuntimeError("the `dask` command is not on PATH (pip install 'shardkit[dask]')")
    return exe


class DaskCluster:
    """A scheduler and ``workers`` workers; :attr:`address` is the scheduler's ``tcp://127.0.0.1:PORT``.

    ``env`` is added to the processes' environment (the S3 settings of a test server, so workers
    can write to its buckets).
    """

    def __init__(self, root: Path, workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.scheduler_file = root / "scheduler.json"
        self.env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
        self.env.pop("DASK_SCHEDULER_ADDRESS", None)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.scheduler = self._spawn("scheduler", [
            "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
            "--scheduler-file", str(self.scheduler_file), "--idle-timeout", "3600",
        ])
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.address = self._wait_for_address()
        for i in range(workers):
            self.start_worker(i, wait=False)
        self.wait_for_workers(workers)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # the process owns it until it ends
        return subprocess.Popen([_dask(), *args], cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler exited: {(self.logs / 'scheduler.log').read_text()[-2000:]}")
            try:
                return str(json.loads(self.scheduler_file.read_text())["address"])
            except (OSError, ValueError, KeyError):
                time.sleep(0.2)
        raise TimeoutError("dask scheduler did not write its address")

    def start_worker(self, i: int, *, wait: bool = True) -> None:
        """Start worker ``i`` (again)."""
        self.workers[i] = self._spawn(f"worker{i}", [
            "worker", "--scheduler-file", str(self.scheduler_file), "--nworkers", "1", "--nthreads", "1",
            "--no-dashboard", "--name", f"w{i}", "--local-directory", str(self.root / f"w{i}"),
            "--host", "127.0.0.1",
        ])
        if wait:
            self.wait_for_workers(len([p for p in self.workers.values() if p.poll() is None]))

    def wait_for_workers(self, n: int) -> None:
        from distributed import Client

        with Client(self.address, timeout=START_TIMEOUT, set_as_default=False) as client:
            client.wait_for_workers(n, timeout=START_TIMEOUT)

    def worker_addresses(self) -> dict[str, str]:
        """``{worker name: address}`` of the workers connected now."""
        from distributed import Client

        with Client(self.address, timeout=START_TIMEOUT, set_as_default=False) as client:
            info = client.scheduler_info()["workers"]
        return {str(w["name"]): addr for addr, w in info.items()}

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` and its nanny (its whole session)."""
        proc = self.workers[i]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    def close(self) -> None:
        procs = [*self.workers.values(), self.scheduler]
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
