"""The wire protocol between a :class:`~shardkit.readers.TierServer` and its jobs, and its ``info.json``.

Explicit binary messages, never pickles, each checked before it is acted on: docs/design.md §8
(*Protocol*) and docs/design.md §13.
"""

from __future__ import annotations

import json
import math
import re
import select
import socket
import struct
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import ClassVar, Self

from shardkit.errors import PeerTimeoutError, ProtocolError
from shardkit.stores import is_url

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY",
    "TOKEN_BYTES",
    "Message",
    "Hello",
    "Welcome",
    "Refused",
    "Reservoir",
    "Release",
    "Beat",
    "Bye",
    "Done",
    "encode",
    "Channel",
    "PeerClosed",
    "ServerInfo",
    "MixtureInfo",
    "MAX_INFO_BYTES",
]

#: Bumped whenever a message or ``info.json`` changes meaning; both sides refuse any other.
PROTOCOL_VERSION = 3
MAGIC = b"SKSV"
HEADER = struct.Struct("<4sHHI")
#: Largest body any message may have (a :class:`Refused` reason); checked before reading it.
MAX_BODY = 1024
#: Size of the run's secret token (the file holds it as hex).
TOKEN_BYTES = 32
#: Longest ``group`` name a job may send, in UTF-8 bytes.
MAX_GROUP_BYTES = 256
#: Largest ``info.json`` a job reads.
MAX_INFO_BYTES = 64 * 1024
_U16 = struct.Struct("<H")


class Message:
    """One message type: a frozen dataclass with a type code and an explicit body encoding."""

    TYPE: ClassVar[int]
    #: Fixed-size part of the body (the whole body for most types).
    FIXED: ClassVar[struct.Struct] = struct.Struct("<")

    def body(self) -> bytes:
        """The body bytes (default: the fields packed with :attr:`FIXED`, in declaration order)."""
        return self.FIXED.pack(*asdict(self).values())  # type: ignore[call-overload]

    @classmethod
    def max_body(cls) -> int:
        return cls.FIXED.size

    @classmethod
    def decode(cls, body: bytes) -> Self:
        """Rebuild the message from ``body``; :class:`~shardkit.errors.ProtocolError` if malformed."""
        if len(body) != cls.FIXED.size:
            raise ProtocolError(f"{cls.__name__}: expected a body of {cls.FIXED.size} bytes, found {len(body)}")
        return cls(*cls.FIXED.unpack(body))


@dataclass(frozen=True)
class Hello(Message):
    """A job asks to attach: it proves it may (``token``) and says what it expects and who it is."""

    TYPE = 1
    FIXED = struct.Struct(f"<{TOKEN_BYTES}s32sQII")
    token: bytes
    #: SHA-256 of the dataset's root metadata as this job opened it (raw 32 bytes).
    fingerprint: bytes
    pid: int
    rank: int
    world: int
    #: Consumers of one job share a group; ``None`` for a job of one consumer.
    group: str | None = None

    def __post_init__(self) -> None:
        if len(self.token) != TOKEN_BYTES or len(self.fingerprint) != 32:
            raise ProtocolError(f"Hello: token and fingerprint must be {TOKEN_BYTES} and 32 bytes")
        if not (1 <= self.world and 0 <= self.rank < self.world):
            raise ProtocolError(f"Hello: expected 0 <= rank < world, found rank {self.rank}, world {self.world}")
        if self.group is not None and not 0 < len(self.group.encode()) <= MAX_GROUP_BYTES:
            raise ProtocolError(f"Hello: group must be 1-{MAX_GROUP_BYTES} UTF-8 bytes, found {self.group!r}")

    def body(self) -> bytes:
        group = b"" if self.group is None else self.group.encode()
        return self.FIXED.pack(self.token, self.fingerprint, self.pid, self.rank, self.world) + _U16.pack(len(group)) + group

    @classmethod
    def max_body(cls) -> int:
        return cls.FIXED.size + _U16.size + MAX_GROUP_BYTES

    @classmethod
    def decode(cls, body: bytes) -> Self:
        head = cls.FIXED.size + _U16.size
        if len(body) < head:
            raise ProtocolError(f"Hello: expected at least {head} bytes, found {len(body)}")
        token, fingerprint, pid, rank, world = cls.FIXED.unpack_from(body)
        (glen,) = _U16.unpack_from(body, cls.FIXED.size)
        if len(body) != head + glen:
            raise ProtocolError(f"Hello: group length {glen} does not match the body ({len(body) - head} bytes)")
        group = _text(body[head:], "Hello group") if glen else None
        return cls(token, fingerprint, pid, rank, world, group)


@dataclass(frozen=True)
class Welcome(Message):
    """The server accepted the job; it will get reservoirs from the next epoch on."""

    TYPE = 2
    FIXED = struct.Struct("<Q")
    job: int


@dataclass(frozen=True)
class Refused(Message):
    """The server refused the job (and closes the connection); ``reason`` says why, for the user."""

    TYPE = 3
    reason: str

    def body(self) -> bytes:
        return self.reason.encode()[:MAX_BODY].decode(errors="ignore").encode()

    @classmethod
    def max_body(cls) -> int:
        return MAX_BODY

    @classmethod
    def decode(cls, body: bytes) -> Self:
        return cls(_text(body, "Refused reason"))


@dataclass(frozen=True)
class Reservoir(Message):
    """Slot ``slot`` of the ring holds ``count`` records of reservoir ``index`` of server epoch ``epoch``."""

    TYPE = 4
    FIXED = struct.Struct("<QQQIQ?")
    #: Publication number; the job releases the slot by it.
    seq: int
    epoch: int
    index: int
    slot: int
    count: int
    #: The epoch's last reservoir.
    last: bool


@dataclass(frozen=True)
class Release(Message):
    """The job copied everything it needs out of the slot published as ``seq``."""

    TYPE = 5
    FIXED = struct.Struct("<Q")
    seq: int


@dataclass(frozen=True)
class Beat(Message):
    """Heartbeat (both directions): the sender is alive."""

    TYPE = 6


@dataclass(frozen=True)
class Bye(Message):
    """The job detaches."""

    TYPE = 7


@dataclass(frozen=True)
class Done(Message):
    """Every epoch the server was asked for has been served."""

    TYPE = 8


_TYPES: dict[int, type[Message]] = {m.TYPE: m for m in (Hello, Welcome, Refused, Reservoir, Release, Beat, Bye, Done)}


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what}: expected UTF-8 text") from None


def encode(msg: Message) -> bytes:
    """One frame: header and body."""
    body = msg.body()
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg.TYPE, len(body)) + body


def _check_header(raw: bytes) -> tuple[type[Message], int]:
    magic, version, mtype, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a shardkit frame (magic {magic!r}, expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol {version}, this shardkit {PROTOCOL_VERSION}")
    cls = _TYPES.get(mtype)
    if cls is None:
        raise ProtocolError(f"unknown message type {mtype}")
    if length > min(cls.max_body(), MAX_BODY):
        raise ProtocolError(f"{cls.__name__}: body of {length} bytes announced, at most {min(cls.max_body(), MAX_BODY)} allowed")
    return cls, length


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF): an ordinary way for a conversation to end."""


class Channel:
    """Framed messages over a connected stream socket, with a size limit and deadlines.

    Receiving never blocks longer than its ``timeout`` and never buffers more than one frame plus
    one read; sending blocks at most ``send_timeout`` seconds (a stopped peer whose socket buffer is
    full raises :class:`~shardkit.errors.PeerTimeoutError`). ``send`` may be called from several
    threads; ``recv`` from one.
    """

    def __init__(self, sock: socket.socket, *, send_timeout: float, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.send_timeout = float(send_timeout)
        sock.settimeout(self.send_timeout)
        self._buf = bytearray()
        self._frame: tuple[type[Message], int] | None = None
        self._send_lock = threading.Lock()
        self._poll = select.poll()  # not select.select: that fails for descriptors >= 1024
        self._poll.register(sock, select.POLLIN)
        self.closed = False

    def send(self, msg: Message) -> None:
        """Send one message (OSError or PeerTimeoutError if the peer is gone or stuck)."""
        frame = encode(msg)
        with self._send_lock:
            if self.closed:
                raise PeerClosed(f"{self.peer}: connection closed")
            try:
                self.sock.sendall(frame)
            except TimeoutError:
                raise PeerTimeoutError(
                    f"{self.peer} took no data for {self.send_timeout:g} s: it is stopped or hung"
                ) from None

    def recv(self, timeout: float) -> Message | None:
        """The next message, or None if none is complete within ``timeout`` seconds.

        Raises :class:`PeerClosed` at EOF and :class:`~shardkit.errors.ProtocolError` on a frame the
        protocol does not allow (checked from its header, before its body is read).
        """
        deadline = time.monotonic() + timeout
        while True:
            msg = self._parse()
            if msg is not None:
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                if not self._poll.poll(max(1, math.ceil(left * 1000))):
                    return None
                # Read only the rest of the current header or body: the buffer never holds more than
                # one frame, whose size the header check has already bounded.
                data = self.sock.recv(HEADER.size + (self._frame[1] if self._frame else 0) - len(self._buf))
            except TimeoutError:
                continue
            except (OSError, ValueError):
                if self.closed:  # closed by another thread while we waited
                    raise PeerClosed(f"{self.peer}: connection closed") from None
                raise
            if not data:
                raise PeerClosed(f"{self.peer}: connection closed")
            self._buf += data

    def _parse(self) -> Message | None:
        if self._frame is None:
            if len(self._buf) < HEADER.size:
                return None
            self._frame = _check_header(bytes(self._buf[: HEADER.size]))
        cls, length = self._frame
        if len(self._buf) < HEADER.size + length:
            return None
        body = bytes(self._buf[HEADER.size : HEADER.size + length])
        del self._buf[: HEADER.size + length]
        self._frame = None
        return cls.decode(body)

    def credentials(self) -> tuple[int, int] | None:
        """``(pid, uid)`` of the process at the other end (Linux ``SO_PEERCRED``), None where unknown."""
        if not hasattr(socket, "SO_PEERCRED"):
            return None
        pid, uid, _gid = struct.unpack("3i", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid, uid

    def close(self) -> None:
        """Close the socket (idempotent; safe while another thread sends or receives)."""
        with self._send_lock:
            if self.closed:
                return
            self.closed = True
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ---------------------------------------------------------------------------------------------- info.json
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_SLOTS = 1 << 16
_MAX_RECORDS = 1 << 48
#: A weight as ``info.json`` spells it: an exact positive rational ``p`` or ``p/q``.
_WEIGHT = re.compile(r"[1-9][0-9]{0,30}(/[1-9][0-9]{0,30})?")


#: Most datasets a served mixture may name (bounds ``info.json`` parsing).
MAX_MIXTURE_DATASETS = 256


def _is_location(value: object) -> bool:
    """A dataset as ``info.json`` may name it: an absolute path or a URL of bounded length."""
    return (isinstance(value, str) and 0 < len(value) <= 4096 and "\0" not in value
            and (PurePosixPath(value).is_absolute() or is_url(value)))


@dataclass(frozen=True)
class MixtureInfo:
    """The mixture a server serves, as ``info.json`` states it (see :class:`ServerInfo`)."""

    datasets: tuple[str, ...]
    weights: tuple[str, ...]
    epoch_size: int

    @classmethod
    def parse(cls, doc: object, source: str) -> MixtureInfo:
        """Validate the ``mixture`` object of ``info.json``; ProtocolError naming ``source``."""
        if not isinstance(doc, dict) or set(doc) != {"datasets", "weights", "epoch_size"}:
            raise ProtocolError(f"{source}: mixture: expected an object with datasets, weights, epoch_size, found {doc!r}")
        datasets, weights, size = doc["datasets"], doc["weights"], doc["epoch_size"]
        if not (isinstance(datasets, list) and 0 < len(datasets) <= MAX_MIXTURE_DATASETS
                and all(_is_location(d) for d in datasets)):
            raise ProtocolError(f"{source}: mixture.datasets: expected 1-{MAX_MIXTURE_DATASETS} absolute paths or URLs")
        if not (isinstance(weights, list) and len(weights) == len(datasets)
                and all(isinstance(w, str) and _WEIGHT.fullmatch(w) for w in weights)):
            raise ProtocolError(f"{source}: mixture.weights: expected one weight per dataset such as '3' or '1/3'")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= _MAX_RECORDS:
            raise ProtocolError(f"{source}: mixture.epoch_size: expected an integer in [1, {_MAX_RECORDS}], found {size!r}")
        return cls(tuple(datasets), tuple(weights), size)


@dataclass(frozen=True)
class ServerInfo:
    """What a server publishes in ``info.json``: who it is, what it serves and its ring's geometry.

    A job validates every field (:meth:`from_json`) before using it, even from its private run directory.
    """

    version: int
    name: str
    pid: int
    #: Absolute path of the dataset directory.
    dataset: str
    #: SHA-256 (hex) of the dataset's root ``zarr.json``.
    fingerprint: str
    slots: int
    slot_records: int
    seed: int
    num_records: int
    record_nbytes: int
    tiers: tuple[str, ...]
    lease_seconds: float
    started: float
    #: What the server serves: datasets, exact weights (``"3"``, ``"1/3"``) and epoch size (``num_records``);
    #: ``dataset`` is the first dataset, ``fingerprint`` the mixture's (:mod:`shardkit.readers.sources`).
    mixture: MixtureInfo | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()  # tuples become JSON arrays

    @classmethod
    def from_json(cls, raw: bytes, *, source: str) -> ServerInfo:
        """Parse and validate ``raw`` (at most :data:`MAX_INFO_BYTES`); ProtocolError naming ``source``."""
        if len(raw) > MAX_INFO_BYTES:
            raise ProtocolError(f"{source}: {len(raw)} bytes, at most {MAX_INFO_BYTES} expected")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ProtocolError(f"{source}: expected a JSON object, found {type(doc).__name__}")
        fields = cls.__dataclass_fields__
        if set(doc) != set(fields):
            raise ProtocolError(f"{source}: expected the keys {sorted(fields)}, found {sorted(doc)}")

        def num(key: str, lo: int, hi: int) -> int:
            v = doc[key]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ProtocolError(f"{source}: {key}: expected an integer in [{lo}, {hi}], found {v!r}")
            return v

        def real(key: str, positive: bool) -> float:
            v = doc[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
                raise ProtocolError(f"{source}: {key}: expected a finite {'positive ' if positive else ''}number, found {v!r}")
            return float(v)

        version = num("version", 0, 1 << 16)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"{source}: the server speaks protocol {version}, this shardkit {PROTOCOL_VERSION}")
        name, dataset, fingerprint, tiers = doc["name"], doc["dataset"], doc["fingerprint"], doc["tiers"]
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ProtocolError(f"{source}: name: expected 1-64 characters of [A-Za-z0-9_-], found {name!r}")
        if not _is_location(dataset):
            raise ProtocolError(f"{source}: dataset: expected an absolute path or a URL, found {dataset!r}")
        if not isinstance(fingerprint, str) or not _HEX64.fullmatch(fingerprint):
            raise ProtocolError(f"{source}: fingerprint: expected 64 lowercase hex digits, found {fingerprint!r}")
        if not (isinstance(tiers, list) and tiers and all(t in ("ssd", "ram") for t in tiers) and len(set(tiers)) == len(tiers)):
            raise ProtocolError(f"{source}: tiers: expected a list drawn from 'ssd', 'ram', found {tiers!r}")
        num_records = num("num_records", 0, _MAX_RECORDS)
        mixture = None if doc["mixture"] is None else MixtureInfo.parse(doc["mixture"], source)
        return cls(
            version=version, name=name, pid=num("pid", 1, (1 << 31) - 1), dataset=dataset, fingerprint=fingerprint,
            slots=num("slots", 2, _MAX_SLOTS), slot_records=num("slot_records", 1, max(1, num_records)),
            seed=num("seed", 0, (1 << 64) - 1), num_records=num_records,
            record_nbytes=num("record_nbytes", 1, 1 << 40), tiers=tuple(tiers),
            lease_seconds=real("lease_seconds", True), started=real("started", False), mixture=mixture,
        )  # fmt: skip
