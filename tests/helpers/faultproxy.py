"""A userspace HTTP/1.1 proxy that injects faults into an S3 server's answers, for the fault tests.

Runs an asyncio loop in a daemon thread, listens on a free loopback port, forwards every request to
the upstream server and its answer back. For each *ranged GET* (a data read) it asks ``plan(n)``
(``n`` counts ranged GETs from 0) what to do:

* ``"ok"``: forward unchanged;
* ``"503"``: answer ``503 Slow Down`` itself (throttling, S3 style) without asking upstream;
* ``"500"``: answer ``500 Internal Error``;
* ``"reset"``: drop the client connection without an answer (connection reset);
* ``"short"``: forward the head, then only half the body, then close (a body cut on the way);
* ``"lie"``: forward a head whose ``Content-Length`` is half the real one, and that half of the body
  (a server that answers 206 with fewer bytes than the range asked for);
* ``"flip"``: forward the answer with one body byte flipped (same length);
* ``"slow"``: wait ``slow_seconds`` before forwarding (a timeout when it exceeds the client's).

Counts what it did in :attr:`FaultProxy.done`, and records every GET as ``(path, ranged)`` in
:attr:`FaultProxy.gets` (so tests can tell whole-object downloads from ranged reads).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["FaultProxy"]

_REASONS = {"503": b"503 Slow Down", "500": b"500 Internal Server Error"}


class FaultProxy:
    def __init__(self, upstream_port: int, plan: Callable[[int], str], *, slow_seconds: float = 5.0,
                 stall_whole: float = 0.0) -> None:
        """``stall_whole``: seconds every whole-object GET answer larger than 64 KiB pauses after
        half its body (a download caught mid-way)."""
        self.stall_whole = stall_whole
        self.upstream = ("127.0.0.1", upstream_port)
        self.plan = plan
        self.slow_seconds = slow_seconds
        self.done: collections.Counter[str] = collections.Counter()
        self.gets: list[tuple[str, bool]] = []
        #: Each GET's ``Range`` header's ``(first, last)`` bytes, ``None`` for a whole object.
        self.ranges: list[tuple[int, int] | None] = []
        self._n = 0
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _next(self) -> str:
        with self._lock:
            n = self._n
            self._n += 1
        action = self.plan(n)
        self.done[action] += 1
        return action

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur: asyncio.StreamReader | None = None
        uw: asyncio.StreamWriter | None = None
        try:
            while True:
                head = await cr.readuntil(b"\r\n\r\n")
                body = await _read_body(cr, head)
                method = head.split(b" ", 1)[0].upper()
                ranged = method == b"GET" and b"\nrange:" in head.lower()
                if method == b"GET":
                    self.gets.append((head.split(b" ", 2)[1].decode("latin-1"), ranged))
                    self.ranges.append(_range_of(head))
                action = self._next() if ranged else "ok"
                if action in _REASONS:
                    cw.write(b"HTTP/1.1 " + _REASONS[action] + b"\r\nContent-Length: 0\r\nRetry-After: 0\r\n\r\n")
                    await cw.drain()
                    continue
                if action == "reset":
                    sock = cw.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    cw.close()
                    return
                if action == "slow":
                    await asyncio.sleep(self.slow_seconds)
                if uw is None:
                    ur, uw = await asyncio.open_connection(*self.upstream)
                assert ur is not None
                uw.write(head + body)
                await uw.drain()
                rhead = await ur.readuntil(b"\r\n\r\n")
                rbody = b"" if method == b"HEAD" else await _read_body(ur, rhead)
                if action == "short" and rbody:
                    cw.write(rhead + rbody[: len(rbody) // 2])
                    await cw.drain()
                    cw.close()
                    return
                if action == "lie" and rbody:
                    half = len(rbody) // 2
                    rhead = _set_length(rhead, half)
                    rbody = rbody[:half]
                if action == "flip" and rbody:
                    rbody = rbody[:-1] + bytes([rbody[-1] ^ 0xFF])
                if self.stall_whole and method == b"GET" and not ranged and len(rbody) > 1 << 16:
                    cw.write(rhead + rbody[: len(rbody) // 2])
                    await cw.drain()
                    await asyncio.sleep(self.stall_whole)
                    rhead, rbody = b"", rbody[len(rbody) // 2 :]
                cw.write(rhead + rbody)
                await cw.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        finally:
            for w in (cw, uw):
                if w is not None:
                    w.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    lines = head.lower().split(b"\r\n")
    status = lines[0]
    if status.startswith(b"http/") and (b" 204 " in status + b" " or b" 304 " in status + b" "):
        return b""
    for line in lines[1:]:
        if line.startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":", 1)[1]))
        if line.startswith(b"transfer-encoding:") and b"chunked" in line:
            out = bytearray()
            while True:
                size_line = await reader.readuntil(b"\r\n")
                out += size_line
                size = int(size_line.split(b";")[0], 16)
                out += await reader.readexactly(size + 2)
                if size == 0:
                    return bytes(out)
    return b""


def _set_length(head: bytes, n: int) -> bytes:
    out = []
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            line = b"Content-Length: " + str(n).encode()
        out.append(line)
    return b"\r\n".join(out)


def _range_of(head: bytes) -> tuple[int, int] | None:
    """The ``(first, last)`` bytes of a request head's ``Range: bytes=first-last``, if any."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"range":
            first, _, last = value.strip().removeprefix(b"bytes=").partition(b"-")
            return int(first), int(last)
    return None
