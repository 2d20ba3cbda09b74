"""A compressed record must decode to exactly its size, and ``verify`` and the readers agree (issue 31).

numcodecs decodes a zstd, gzip or blosc frame that is shorter than the output buffer without an
error (the rest of the row keeps stale bytes). A crafted record of that kind, written with correct
checksums, passed ``verify`` (which compared crc32c values only) and was served by the sampler. Every
decode now goes through :func:`~shardkit.formats.codecs.decode_record`, and full ``verify`` decodes
each compressed shard's records through it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard

from shardkit.errors import CorruptShardError
from shardkit.formats import Dataset, verify
from shardkit.formats.codecs import ZstdCodec, decode_record, get_codec
from shardkit.readers import TieredSampler
from tests.helpers.datasets import make_records, write_dataset

RECORDS = make_records(25, seed=3)
FORGED = 13  # in shard 1 (records 10-19)


def _short(data: np.ndarray) -> bytes:
    """A valid zstd frame (with its checksum) of the first half of ``data``'s bytes."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return zstandard.ZstdCompressor(write_checksum=True).compress(raw[: raw.size // 2].tobytes())


def _long(data: np.ndarray) -> bytes:
    """A valid zstd frame (with its checksum) of ``data``'s bytes and 8 more."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return zstandard.ZstdCompressor(write_checksum=True).compress(raw.tobytes() + bytes(8))


FORGERIES: dict[str, Callable[[np.ndarray], bytes]] = {"shorter": _short, "longer": _long}


def _forge_on_write(monkeypatch: pytest.MonkeyPatch, forge: Callable[[np.ndarray], bytes],
                    which: Callable[[np.ndarray], bool]) -> None:  # fmt: skip
    """Make the writer store ``forge(x)`` for every array ``x`` that ``which`` picks: the writer then
    records the checksums of the forged bytes, so every crc32c check passes."""
    encode = ZstdCodec.encode

    def forged(self: ZstdCodec, record: np.ndarray) -> bytes:
        return forge(record) if which(record) else encode(self, record)

    monkeypatch.setattr(ZstdCodec, "encode", forged)


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_a_record_that_decodes_to_another_size_fails_verify_and_the_sampler_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with monkeypatch.context() as m:
        _forge_on_write(m, FORGERIES[kind], lambda x: x.shape == RECORDS.shape[1:] and np.array_equal(x, RECORDS[FORGED]))
        path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=10, compression="zstd")
    named = rf"shard 1 \(records 10-19\): record {FORGED} at offset \d+ does not decode to its 36 bytes"

    report = verify(path)
    assert [p.start for p in report.problems] == [10]
    assert f"record {FORGED} at offset" in report.problems[0].message
    assert "does not decode to its 36 bytes" in report.problems[0].message
    assert verify(path, quick=True).ok  # checksums and index are all as recorded: only decoding tells

    with Dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read([12, 14]), RECORDS[[12, 14]])  # its neighbours read
        with pytest.raises(CorruptShardError, match=named):
            ds.payload.read([FORGED])
    sampler = TieredSampler(path, ram_size="30records", batch_size=5, epochs=1, seed=0)
    try:
        with pytest.raises(CorruptShardError, match=named):
            for _ in sampler:
                pass
    finally:
        sampler.close()


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_a_field_chunk_that_decodes_to_another_size_fails_verify_and_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with monkeypatch.context() as m:
        _forge_on_write(m, FORGERIES[kind], lambda x: x.dtype == np.int64)  # the label field's chunks
        path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=10)
    chunk = str(path / "label" / "c" / "0")
    report = verify(path)
    assert len(report.problems) == 1 and report.problems[0].path == str(path / "label")
    assert f"{chunk}: field chunk 0" in report.problems[0].message
    with Dataset(path) as ds, pytest.raises(CorruptShardError, match=f"{chunk}: field chunk 0 .*does not decode"):
        ds.fields  # noqa: B018


@pytest.mark.parametrize("name", ["zstd", "gzip", "blosc-lz4"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_every_codec_refuses_a_frame_of_another_size(name: str, delta: int) -> None:
    codec = get_codec(name)
    assert codec is not None
    record = np.arange(100, dtype=np.uint8)
    frame = codec.encode(np.arange(100 + delta, dtype=np.uint8))
    out = np.full(100, 0xAB, dtype=np.uint8)
    with pytest.raises(CorruptShardError, match=r"f\.bin: record 7 does not decode to its 100 bytes"):
        decode_record(codec, frame, out, where="f.bin", what="record 7")
    decode_record(codec, codec.encode(record), out, where="f.bin", what=lambda: "record 7")
    np.testing.assert_array_equal(out, record)


def test_zstd_frames_without_a_declared_size_or_in_pieces_decode_when_exact() -> None:
    """The stream path: no content size in the header, or several frames (zarr readers accept both)."""
    codec = get_codec("zstd")
    assert codec is not None
    record = np.arange(1000, dtype=np.uint16)
    raw = record.tobytes()
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert zstandard.frame_content_size(unsized) == -1
    pieces = zstandard.ZstdCompressor().compress(raw[:700]) + zstandard.ZstdCompressor().compress(raw[700:])
    for frame in (unsized, pieces):
        out = np.zeros_like(record)
        decode_record(codec, frame, out, where="f.bin", what="record 0")
        np.testing.assert_array_equal(out, record)
    for bad in (unsized[:-3], pieces + zstandard.ZstdCompressor().compress(b"x"), b"not a frame"):
        with pytest.raises(CorruptShardError, match="record 0 does not decode"):
            decode_record(codec, bad, np.zeros_like(record), where="f.bin", what="record 0")
