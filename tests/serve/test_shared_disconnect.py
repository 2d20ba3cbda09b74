"""A server that drops a job's connection mid-exchange: the job gets a SamplerError saying what
happened, never a raw BrokenPipeError or ConnectionResetError (seen once during a connection flood).

The job connects to a stub server instead of the real one (its run directory, token and ring are
the real server's; only the socket address is swapped), so each failure is reproduced on a real
socket, at a point fixed by events rather than timing.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardkit.errors import SamplerError
from shardkit.readers import SharedSampler, TierServer
from shardkit.serve.protocol import HEADER, Channel
from shardkit.serve.rundir import RunDir
from tests.helpers.sampler_data import make_dataset

#: Guards against a hang only; nothing waits this long when the code is right.
_HANG = 60.0


class _Stub:
    """A listening Unix socket that accepts one connection and hands it to ``script``."""

    def __init__(self, path: Path, script: Callable[[socket.socket], None]) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.listener.settimeout(_HANG)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Callable[[socket.socket], None]) -> None:
        try:
            conn, _ = self.listener.accept()
            conn.settimeout(_HANG)
            with conn:
                script(conn)
        except BaseException as exc:  # reported by close()
            self.error = exc

    def close(self) -> None:
        self.thread.join(_HANG)
        self.listener.close()
        assert not self.thread.is_alive() and self.error is None, self.error


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    name = f"disc{os.getpid()}-{secrets.token_hex(4)}"
    with TierServer(make_dataset(tmp_path / "ds", 12), name=name, ram_size="6records", slots=2, lease_seconds=30):
        yield name


def _attach_to_stub(monkeypatch: pytest.MonkeyPatch, stub: _Stub) -> None:
    monkeypatch.setattr(RunDir, "address", lambda self, name="sock": str(stub.path))


def test_server_closes_before_the_hello_is_sent(server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub closes the connection as soon as it accepts it; the job's Hello then hits a closed
    socket (EPIPE). The job sends only once the stub has closed: the credentials check (between
    connecting and sending) waits for it."""
    closed = threading.Event()

    def close_at_once(conn: socket.socket) -> None:
        conn.close()
        closed.set()

    stub = _Stub(tmp_path / "stub.sock", close_at_once)
    _attach_to_stub(monkeypatch, stub)
    credentials = Channel.credentials

    def after_the_close(chan: Channel) -> tuple[int, int] | None:
        assert closed.wait(_HANG)
        return credentials(chan)

    monkeypatch.setattr(Channel, "credentials", after_the_close)
    job = SharedSampler(server, job_seed=1, batch_size=4)
    with pytest.raises(SamplerError, match=r"went away while presenting this job \(BrokenPipeError: Broken pipe\)"):
        iter(job)
    stub.close()


def test_server_resets_the_connection_while_the_job_waits(server: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub waits until the Hello has arrived and closes without reading it: unread data makes the
    close a reset, which the job sees while it waits for the Welcome."""

    def reset_after_hello(conn: socket.socket) -> None:
        assert len(conn.recv(HEADER.size, socket.MSG_PEEK)) > 0  # the Hello is there, left unread

    stub = _Stub(tmp_path / "stub.sock", reset_after_hello)
    _attach_to_stub(monkeypatch, stub)
    job = SharedSampler(server, job_seed=1, batch_size=4)
    with pytest.raises(SamplerError, match=r"went away while this job waited for its next message "
                                           r"\(ConnectionResetError: Connection reset by peer\)"):
        iter(job)
    stub.close()


def test_server_closes_cleanly_while_the_job_waits(server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_hello_then_close(conn: socket.socket) -> None:
        Channel(conn, send_timeout=_HANG, peer="job").recv(_HANG)

    stub = _Stub(tmp_path / "stub.sock", read_hello_then_close)
    _attach_to_stub(monkeypatch, stub)
    job = SharedSampler(server, job_seed=1, batch_size=4)
    with pytest.raises(SamplerError, match=r"went away while this job waited for its next message "
                                           r"\(it closed the connection\)"):
        iter(job)
    stub.close()
