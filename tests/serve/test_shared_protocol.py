"""The shared tier stack's wire protocol, run directory helpers and options, without a server."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit.errors import ConfigError, PeerTimeoutError, ProtocolError
from shardkit.readers.options import DEFAULTS
from shardkit.serve.order import blocks
from shardkit.serve.protocol import (
    HEADER,
    MAGIC,
    MAX_BODY,
    PROTOCOL_VERSION,
    Beat,
    Bye,
    Channel,
    Done,
    Hello,
    Message,
    PeerClosed,
    Refused,
    Release,
    Reservoir,
    ServerInfo,
    Welcome,
    encode,
)
from shardkit.serve.server import ServeOptions

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@pytest.fixture
def pair() -> Iterator[tuple[Channel, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    chan = Channel(a, send_timeout=0.5, peer="test peer")
    b.settimeout(10)
    yield chan, b
    chan.close()
    b.close()


def _hello(**kw: object) -> Hello:
    args: dict[str, object] = dict(token=b"t" * 32, fingerprint=b"f" * 32, pid=1, rank=0, world=1, group=None)
    return Hello(**{**args, **kw})  # type: ignore[arg-type]


messages = st.one_of(
    st.builds(Hello, st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32), U64,
              st.just(0), st.integers(1, 2**32 - 1),
              st.one_of(st.none(), st.text(min_size=1, max_size=60))),
    st.builds(Welcome, U64),
    st.builds(Refused, st.text(max_size=250)),
    st.builds(Reservoir, U64, U64, U64, U32, U64, st.booleans()),
    st.builds(Release, U64),
    st.just(Beat()), st.just(Bye()), st.just(Done()),
)  # fmt: skip


@given(messages)
def test_every_message_round_trips(msg: Message) -> None:
    frame = encode(msg)
    magic, version, mtype, length = HEADER.unpack(frame[: HEADER.size])
    assert (magic, version, mtype, length) == (MAGIC, PROTOCOL_VERSION, msg.TYPE, len(frame) - HEADER.size)
    assert length <= MAX_BODY
    assert type(msg).decode(frame[HEADER.size :]) == msg


@pytest.mark.parametrize(
    "cls,body,message",
    [
        (Welcome, b"\0" * 7, "expected a body of 8 bytes"),
        (Release, b"\0" * 9, "expected a body of 8 bytes"),
        (Beat, b"x", "expected a body of 0 bytes"),
        (Reservoir, b"\0" * 10, "expected a body of 37 bytes"),
        (Hello, b"\0" * 40, "at least 82 bytes"),
        (Hello, _hello().body() + b"extra", "group length 0 does not match"),
        (Hello, _hello(group="g").body()[:-1] + b"\xff", "expected UTF-8"),
        (Hello, Hello.FIXED.pack(b"t" * 32, b"f" * 32, 1, 3, 2) + b"\0\0", "0 <= rank < world"),
        (Hello, Hello.FIXED.pack(b"t" * 32, b"f" * 32, 1, 0, 0) + b"\0\0", "0 <= rank < world"),
        (Refused, b"\xc3", "expected UTF-8"),
    ],
)
def test_malformed_bodies_are_protocol_errors(cls: type[Message], body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        cls.decode(body)


def test_refused_reason_is_cut_to_the_limit_on_a_character_boundary() -> None:
    msg = Refused("é" * 2000)
    assert len(msg.body()) <= MAX_BODY
    assert Refused.decode(msg.body()).reason == "é" * (MAX_BODY // 2)


@pytest.mark.parametrize(
    "header,message",
    [
        (HEADER.pack(b"XXXX", PROTOCOL_VERSION, Beat.TYPE, 0), "not a shardkit frame"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, Beat.TYPE, 0), f"peer speaks protocol {PROTOCOL_VERSION + 1}"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 99, 0), "unknown message type 99"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, Refused.TYPE, MAX_BODY + 1), "at most 1024 allowed"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, Welcome.TYPE, 2**31), "at most 8 allowed"),
    ],
)
def test_header_is_checked_before_the_body_is_read(pair: tuple[Channel, socket.socket], header: bytes, message: str) -> None:
    """Only the header is sent: the error comes at once, without waiting for (or buffering) a body."""
    chan, peer = pair
    peer.sendall(header)
    with pytest.raises(ProtocolError, match=message):
        chan.recv(30)


def test_frames_arriving_in_pieces(pair: tuple[Channel, socket.socket]) -> None:
    chan, peer = pair
    frames = encode(Reservoir(7, 1, 2, 1, 5, True)) + encode(Beat()) + encode(_hello(group="grp"))
    got: list[Message] = []
    for i in range(len(frames)):
        peer.sendall(frames[i : i + 1])
        while (msg := chan.recv(0.01)) is not None:
            got.append(msg)
    assert got == [Reservoir(7, 1, 2, 1, 5, True), Beat(), _hello(group="grp")]
    assert chan.recv(0.01) is None  # a quiet peer: None after the timeout, no exception
    peer.close()
    with pytest.raises(PeerClosed):
        chan.recv(10)


def test_send_to_a_peer_that_never_reads_times_out(pair: tuple[Channel, socket.socket]) -> None:
    chan, _peer = pair
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"test peer took no data for 0\.5 s"):
        for _ in range(10_000_000):  # fills the socket buffer, then blocks at most send_timeout
            chan.send(Refused("x" * 1000))
    assert time.monotonic() - t0 < 600  # bounded (the loop above cannot end otherwise)


def _info() -> ServerInfo:
    return ServerInfo(version=PROTOCOL_VERSION, name="n", pid=12, dataset="/data/ds", fingerprint="a" * 64, slots=3,
                      slot_records=4, seed=2**64 - 1, num_records=10, record_nbytes=16, tiers=("ram",),
                      lease_seconds=1.5, started=0.0)


def test_server_info_round_trip_and_checks() -> None:
    info = _info()
    assert ServerInfo.from_json(info.to_json(), source="x") == info
    doc = json.loads(info.to_json())
    for key, value, message in [
        ("slots", 1, r"slots: expected an integer in \[2,"),
        ("slot_records", 11, r"slot_records: expected an integer in \[1, 10\]"),
        ("seed", 2**64, "seed: expected an integer"),
        ("fingerprint", "A" * 64, "fingerprint: expected 64 lowercase hex digits"),
        ("name", "a/b", "name: expected"),
        ("tiers", ["ram", "ram"], "tiers: expected"),
        ("dataset", "/a\0b", "dataset: expected an absolute path"),
        ("lease_seconds", 0, "lease_seconds: expected a finite positive number"),
    ]:
        with pytest.raises(ProtocolError, match=f"x: {message}"):
            ServerInfo.from_json(json.dumps({**doc, key: value}).encode(), source="x")
    with pytest.raises(ProtocolError, match="expected the keys"):
        ServerInfo.from_json(json.dumps({k: v for k, v in doc.items() if k != "pid"}).encode(), source="x")
    with pytest.raises(ProtocolError, match="at most 65536 expected"):
        ServerInfo.from_json(b" " * 65537, source="x")


def test_blocks_follow_the_ssd_reservoirs() -> None:
    assert blocks(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert blocks(10, 3, 4) == [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)]
    assert blocks(0, 3) == []


def test_options_name_the_option_as_written() -> None:
    with pytest.raises(ConfigError, match=r"^ram_size: expected a size"):
        ServeOptions.parse(ram_size="lots")
    with pytest.raises(ConfigError, match=r"^--ram-size: expected a size"):
        ServeOptions.parse(source="cli", ram_size="lots")
    with pytest.raises(ConfigError, match=r"^--lease: expected a positive duration"):
        ServeOptions.parse(source="cli", lease_seconds="0s")
    with pytest.raises(ConfigError, match=r"^max_connections: expected a whole number >= 1"):
        ServeOptions.parse(max_connections=0)
    with pytest.raises(ConfigError, match="unknown server option --ram; expected some of"):
        ServeOptions.parse(source="cli", ram="1GiB")
    o = ServeOptions.parse(ram_size="12records", lease_seconds="2min", slots="4", seed=2**63)
    assert (o.ram_size.records, o.lease_seconds, o.slots, o.seed) == (12, 120.0, 4, 2**63)
    values = {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name != "source"}
    assert ServeOptions.parse(**values) == o  # parsed values pass through unchanged
    assert ServeOptions().ram_size == DEFAULTS.ram_size  # the sampler's defaults, not a copy


def test_hello_group_limits() -> None:
    with pytest.raises(ProtocolError, match="group must be 1-256"):
        _hello(group="x" * 257)
    assert Hello.decode(_hello(group="x" * 256).body()).group == "x" * 256
