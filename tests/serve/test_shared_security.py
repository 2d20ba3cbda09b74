"""Hostile peers and hostile files around the shared tier stack (``serve``).

Nothing received is ever unpickled; garbage, oversized frames, pickles, wrong tokens and too many
connections each end one connection (with one log line, no traceback) while a well-behaved job runs
to the end; the run directory is private or refused; every file in it is private; a job validates
``info.json`` and refuses tampered files; a stopped server is a timeout for its jobs, not a hang.
Timeouts below only guard against hangs; nothing asserts on timing.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import InsecurePathError, PeerTimeoutError, ProtocolError, SamplerError
from shardkit.readers import SharedSampler, TierServer
from shardkit.serve import job_order, wait_for_server
from shardkit.serve.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Hello, Release, Welcome, encode
from shardkit.serve.rundir import run_dir_path
from tests.helpers.sampler_data import check_batch, make_dataset

ROOT = Path(__file__).resolve().parents[2]
N = 30
K = 3  # ram_size 6 records over 2 slots


@pytest.fixture
def name() -> str:
    return f"sec{os.getpid()}-{secrets.token_hex(4)}"


class _Marker:
    """Unpickling this creates the file ``path``: proof that bytes were unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return (open, (self.path, "w"))


def _connect(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(run_dir_path(name) / "sock"))
    return s


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails if it never does)."""
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        pass
    except TimeoutError:
        pytest.fail("the server kept a hostile connection open")
    finally:
        s.close()
    return got


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _hello(srv: TierServer, token: bytes | None = None) -> bytes:
    if token is None:
        token = bytes.fromhex((srv.rundir / "token").read_text())
    return encode(Hello(token, bytes.fromhex(srv.fingerprint), os.getpid(), 0, 1, None))


def _welcomed(s: socket.socket) -> None:
    raw = b""
    while len(raw) < HEADER.size + Welcome.FIXED.size:
        raw += s.recv(HEADER.size + Welcome.FIXED.size - len(raw))
    assert HEADER.unpack(raw[: HEADER.size])[2] == Welcome.TYPE


# ---------------------------------------------------------------------------------------------- attacks
# Each takes the running server and the marker path; returns the text its server log must contain.


def _garbage(srv: TierServer, marker: Path) -> str:
    s = _connect(srv.name)
    s.sendall(b"GET / HTTP/1.1\r\n" + os.urandom(2000))
    _until_closed(s)
    return "not a shardkit frame"


def _oversized(srv: TierServer, marker: Path) -> str:
    s = _connect(srv.name)
    s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Hello.TYPE, 2**32 - 1))  # and no body: never waited for
    _until_closed(s)
    return "body of 4294967295 bytes announced"


def _pickle_old_framing(srv: TierServer, marker: Path) -> str:
    # Exactly what multiprocessing.connection sends (and the old server unpickled): length + pickle.
    payload = pickle.dumps(_Marker(marker))
    s = _connect(srv.name)
    s.sendall(struct.pack("!i", len(payload)) + payload)
    _until_closed(s)
    return "not a shardkit frame"


def _pickle_in_frame(srv: TierServer, marker: Path) -> str:
    payload = pickle.dumps(_Marker(marker), protocol=0)
    s = _connect(srv.name)
    s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Hello.TYPE, len(payload)) + payload)
    _until_closed(s)
    return "Hello"


def _pickle_after_hello(srv: TierServer, marker: Path) -> str:
    payload = pickle.dumps(_Marker(marker))
    s = _connect(srv.name)
    s.sendall(_hello(srv))  # a peer that knows the token is still never unpickled
    _welcomed(s)
    s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Release.TYPE, len(payload)) + payload)
    _until_closed(s)
    return "Release: body of"


def _second_hello(srv: TierServer, marker: Path) -> str:
    s = _connect(srv.name)
    s.sendall(_hello(srv))
    _welcomed(s)
    s.sendall(_hello(srv))
    _until_closed(s)
    return "unexpected Hello"


def _old_version(srv: TierServer, marker: Path) -> str:
    s = _connect(srv.name)
    frame = _hello(srv)
    s.sendall(frame[:4] + struct.pack("<H", PROTOCOL_VERSION - 1) + frame[6:])
    assert b"speaks protocol" in _until_closed(s)  # the peer is told why
    return "peer speaks protocol"


def _wrong_token(srv: TierServer, marker: Path) -> str:
    s = _connect(srv.name)
    s.sendall(_hello(srv, token=secrets.token_bytes(32)))
    assert b"wrong token" in _until_closed(s)
    return "wrong token"


def _too_many(srv: TierServer, marker: Path) -> str:
    srv.handshake_seconds = 600.0  # the idle connections below must not time out during the test
    _wait_until(lambda: srv.connections == 1, "only the job's connection")
    idle = [_connect(srv.name) for _ in range(3)]
    _wait_until(lambda: srv.connections == 4, "4 connections")
    assert b"already serves 4 connections" in _until_closed(_connect(srv.name))
    for s in idle:
        s.close()
    _wait_until(lambda: srv.connections == 1, "idle connections closed")
    return "already 4 connections"


def _silent(srv: TierServer, marker: Path) -> str:
    srv.handshake_seconds = 0.5
    idle = _connect(srv.name)
    partial = _connect(srv.name)
    partial.sendall(_hello(srv)[:7])  # half a header, then nothing (slowloris)
    assert _until_closed(idle) == b"" and _until_closed(partial) == b""
    return "sent no hello within 0.5 s"


ATTACKS: dict[str, Callable[[TierServer, Path], str]] = {
    "garbage": _garbage,
    "oversized": _oversized,
    "pickle_old_framing": _pickle_old_framing,
    "pickle_in_frame": _pickle_in_frame,
    "pickle_after_hello": _pickle_after_hello,
    "second_hello": _second_hello,
    "old_version": _old_version,
    "wrong_token": _wrong_token,
    "too_many": _too_many,
    "silent": _silent,
}


def test_marker_payload_works(tmp_path: Path) -> None:
    """The pickled payload the attacks send does create its file when unpickled (the check below means something)."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Marker(probe)))
    assert probe.exists()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_client_is_refused_and_the_server_keeps_serving(
    tmp_path: Path, name: str, attack: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    ds = make_dataset(tmp_path / "ds", N)
    marker = tmp_path / "unpickled"
    with caplog.at_level(logging.INFO, logger="shardkit.serve"):
        with TierServer(ds, name=name, ram_size="6records", slots=2, max_connections=4, lease_seconds=30) as srv:
            job = SharedSampler(name, job_seed=3, batch_size=4, epochs=2)
            it = iter(job)
            keys = [check_batch(next(it))]  # attached and running: the attack happens mid-epoch
            expected_log = ATTACKS[attack](srv, marker)
            keys += [check_batch(b) for b in it]
            orders = np.concatenate(keys).reshape(2, N)
            for e in range(2):
                np.testing.assert_array_equal(orders[e], job_order(0, 3, e, N, K))
            late = np.concatenate([check_batch(b) for b in SharedSampler(name, job_seed=4, batch_size=5)])
            np.testing.assert_array_equal(np.sort(late), np.arange(N))
    assert not marker.exists(), "the server unpickled bytes from a socket"
    assert "Traceback" not in capfd.readouterr().err
    server_lines = [r for r in caplog.records if r.name.startswith("shardkit.serve")]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in server_lines)
    warnings = [r.getMessage() for r in server_lines if r.levelno >= logging.WARNING]
    assert any(expected_log in w for w in warnings), warnings


# ---------------------------------------------------------------------------------------------- run directory
def test_run_dir_is_per_user_and_private(tmp_path: Path, name: str) -> None:
    """The run directory has the uid in its name and mode 0700; every file in it (token, ring =
    the shared memory, info, lock, socket) belongs to this user with no group/other access."""
    ds = make_dataset(tmp_path / "ds", 12)
    with TierServer(ds, name=name, ram_size="6records") as srv:
        d = srv.rundir
        assert d.name == f"shardkit-serve-{os.geteuid()}-{name}"
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        files = {p.name: p.lstat() for p in d.iterdir()}
        assert sorted(files) == ["info.json", "lock", "ring", "sock", "token"]
        for fname, fst in files.items():
            assert fst.st_uid == os.geteuid(), fname
            assert stat.S_IMODE(fst.st_mode) == 0o600, (fname, oct(fst.st_mode))
        assert files["ring"].st_size >= 2 * 3 * 16  # the payload ring lives here, not in a global name
        assert len((d / "token").read_text().strip()) == 64


def _planted(name: str, tmp_path: Path, how: str) -> tuple[Path, str]:
    d = run_dir_path(name)
    if how == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        d.symlink_to(target)
        return target, "is a symlink"
    d.mkdir(mode=0o700)
    if how == "mode":
        os.chmod(d, 0o755)
        return d, "has mode 0o755"
    os.chown(d, 4242, 4242)
    return d, "is owned by uid 4242"


@pytest.mark.parametrize("how", ["symlink", "mode", "owner"])
def test_unsafe_run_dir_is_refused(tmp_path: Path, name: str, how: str) -> None:
    """A run directory planted by someone else (a symlink, a 0755 directory, another owner) is
    refused by the server and by jobs, with a clear error, and nothing is written into it."""
    ds = make_dataset(tmp_path / "ds", 12)
    d = run_dir_path(name)
    inside, why = _planted(name, tmp_path, how)
    try:
        with pytest.raises(InsecurePathError, match=f"{d}: {why}.*Refusing to use it"):
            TierServer(ds, name=name, ram_size="6records").start()
        with pytest.raises(InsecurePathError, match=f"{d}: {why}"):
            SharedSampler(name, connect_timeout=0)
        assert list(inside.iterdir()) == []
        if how != "symlink":
            assert stat.S_IMODE(d.lstat().st_mode) == (0o755 if how == "mode" else 0o700)  # left as found
    finally:
        if d.is_symlink():
            d.unlink()
        else:
            d.rmdir()


def test_cli_refuses_unsafe_run_dir_in_one_line(tmp_path: Path, name: str) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    d = run_dir_path(name)
    d.mkdir(mode=0o700)
    os.chmod(d, 0o777)
    try:
        r = subprocess.run([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    finally:
        d.rmdir()
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: {d}: has mode 0o777") and r.stderr.count("\n") == 1, r.stderr


def _tamper_cases(tmp_path: Path) -> list[tuple[str, Callable[[Path, bytes], None], type[Exception], str]]:
    def edit(**changes: object) -> Callable[[Path, bytes], None]:
        def apply(d: Path, original: bytes) -> None:
            (d / "info.json").write_text(json.dumps({**json.loads(original), **changes}))
        return apply

    def write(data: bytes) -> Callable[[Path, bytes], None]:
        return lambda d, original: (d / "info.json").write_bytes(data)

    def symlink(d: Path, original: bytes) -> None:
        fake = tmp_path / "fake.json"
        fake.write_bytes(original)
        (d / "info.json").unlink()
        (d / "info.json").symlink_to(fake)

    def token_mode(d: Path, original: bytes) -> None:
        os.chmod(d / "token", 0o644)

    return [
        ("huge", write(b" " * (1 << 20)), InsecurePathError, "1048576 bytes, at most 65536"),
        ("not json", write(b"{\x00"), ProtocolError, "not valid JSON"),
        ("deep", write(b"[" * 60000), ProtocolError, "not valid JSON"),
        ("array", write(b"[]"), ProtocolError, "expected a JSON object"),
        ("pid type", edit(pid="1"), ProtocolError, "pid: expected an integer"),
        ("pid bool", edit(pid=True), ProtocolError, "pid: expected an integer"),
        ("relative dataset", edit(dataset="../elsewhere"), ProtocolError, "dataset: expected an absolute path"),
        ("empty", write(b""), ProtocolError, "not valid JSON"),
        ("lease nan", edit(lease_seconds=float("nan")), ProtocolError, "lease_seconds: expected a finite positive"),
        ("extra key", edit(shm="x"), ProtocolError, "expected the keys"),
        ("geometry", edit(slot_records=1), SamplerError, "refusing to attach"),
        ("version", edit(version=1), ProtocolError, "speaks protocol 1"),
        ("symlink", symlink, InsecurePathError, "is a symlink"),
        ("token mode", token_mode, InsecurePathError, "expected a private file"),
    ]


def test_job_validates_run_files(tmp_path: Path, name: str) -> None:
    """A job checks ``info.json`` (size bound, JSON, every field's type and range), the token file
    and the ring against what it computes itself; each tampered file is a clear error, and with the
    originals back a job runs to the end."""
    ds = make_dataset(tmp_path / "ds", 12)
    with TierServer(ds, name=name, ram_size="6records") as srv:
        d = srv.rundir
        original = (d / "info.json").read_bytes()
        for what, tamper, error, message in _tamper_cases(tmp_path):
            tamper(d, original)
            try:
                with pytest.raises(error, match=message):
                    next(iter(SharedSampler(name, job_seed=1, batch_size=4, connect_timeout=0)))
            finally:
                if (d / "info.json").is_symlink():
                    (d / "info.json").unlink()
                (d / "info.json").write_bytes(original)
                os.chmod(d / "info.json", 0o600)
                os.chmod(d / "token", 0o600)
            assert srv.jobs == 0, what
        keys = np.concatenate([check_batch(b) for b in SharedSampler(name, job_seed=1, batch_size=4)])
        np.testing.assert_array_equal(np.sort(keys), np.arange(12))


# ---------------------------------------------------------------------------------------------- hung peers
def test_stopped_server_is_a_timeout_not_a_hang(tmp_path: Path, name: str) -> None:
    """SIGSTOP of the server: an attached job raises PeerTimeoutError after the lease (3 s) instead
    of blocking forever, and so does a job trying to attach to it."""
    ds = make_dataset(tmp_path / "ds", 60)  # 20 reservoirs of 3: far more than the ring holds
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name,
                          "--ram-size", "6records", "--slots", "2", "--lease", "3s"], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_for_server(name, timeout=60)
        it = iter(SharedSampler(name, job_seed=1, batch_size=2))
        check_batch(next(it))
        os.kill(p.pid, signal.SIGSTOP)
        outcome: list[BaseException | None] = []

        def drain() -> None:
            try:
                for _ in it:
                    pass
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        t.join(90)
        assert not t.is_alive(), "the job blocked on a stopped server"
        assert isinstance(outcome[0], PeerTimeoutError), outcome
        assert f"server {name!r} (pid {p.pid}) sent nothing for 3 s" in str(outcome[0])
        assert isinstance(outcome[0], TimeoutError)  # catchable as the builtin too
        with pytest.raises(PeerTimeoutError, match="sent nothing"):
            next(iter(SharedSampler(name, job_seed=2, batch_size=2, connect_timeout=5)))
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert b"Traceback" not in err, err.decode(errors="replace")
    assert not run_dir_path(name).exists()


def test_jobs_map_the_ring_read_only(tmp_path: Path, name: str) -> None:
    """A job only copies out of the ring, so it maps it read-only: a bug in one job cannot corrupt
    the payload every other job is reading."""
    from shardkit.serve.ring import Ring
    from shardkit.serve.rundir import RunDir

    ds = make_dataset(tmp_path / "ds", 12)
    with TierServer(ds, name=name, ram_size="6records") as srv:
        run = RunDir.open(srv.rundir)
        try:
            ring = Ring.attach(run, srv.layout)
            assert not ring.payload.flags.writeable and not ring.keys.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                ring.payload[0, 0] = 1
            ring.close()
        finally:
            run.close()
