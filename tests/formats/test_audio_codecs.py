"""Lossy audio codecs per record (opus, vorbis): exact shape and dtype back, SNR above the documented
floors on a pure tone, full-scale records that do not wrap around, records and rates they refuse, the
sample rate taken from the records, and damaged streams named by their record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import FieldSpec, open_dataset
from shardkit.formats.codecs import codec_from_json, codec_from_zarr, get_codec
from shardkit.formats.verify import verify
from shardkit.formats.writer import DatasetWriter
from tests.helpers.datasets import write_dataset

ROOT = Path(__file__).resolve().parents[2]
#: SNR floors (dB) of a 440 Hz half-scale tone at 16 kHz with the default settings (docs/codecs.md).
TONE_FLOOR = {"opus": 20.0, "vorbis": 30.0}


def tone(n: int, rate: int = 16000, freq: float = 440.0, shape: tuple[int, ...] = (16000,), dtype: str = "int16") -> np.ndarray:
    """``n`` records of a sine at ``freq`` Hz (half scale), each with its own phase; channels get other phases."""
    t = np.arange(shape[0]) / rate
    recs = []
    for i in range(n):
        cols = [np.sin(2 * np.pi * freq * t + i + c) * 0.5 for c in range(shape[1] if len(shape) == 2 else 1)]
        x = np.stack(cols, axis=-1) if len(shape) == 2 else cols[0]
        recs.append((x * 32767).astype(np.int16) if dtype == "int16" else x.astype(np.float32))
    return np.stack(recs)


def snr(a: np.ndarray, b: np.ndarray) -> float:
    x = a.astype(np.float64)
    return float(10 * np.log10(np.sum(x * x) / np.sum((x - b.astype(np.float64)) ** 2)))


@pytest.mark.parametrize("spec", ["opus@16k", "vorbis@16k"])
@pytest.mark.parametrize("shape,dtype", [((16000,), "int16"), ((8001, 2), "int16"), ((16000,), "float32")])
def test_round_trip_gives_the_exact_shape_and_dtype_above_the_snr_floor(
    tmp_path: Path, spec: str, shape: tuple[int, ...], dtype: str
) -> None:
    recs = tone(5, shape=shape, dtype=dtype)
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=2, compression=spec, payload="audio")
    with open_dataset(path) as ds:
        got = ds.payload.read(np.arange(5)[::-1])
        assert ds.meta.compression is not None and ds.meta.compression["sample_rate"] == 16000
    assert got.shape == recs.shape and got.dtype == recs.dtype
    for i, k in enumerate(range(4, -1, -1)):
        assert snr(recs[k], got[i]) >= TONE_FLOOR[spec.split("@")[0]]
    stored = sum(p.stat().st_size for p in (path / "audio" / "c").rglob("*") if p.is_file())
    assert stored < recs.nbytes / 2


@pytest.mark.parametrize("spec", ["opus:16k@16k", "vorbis:2@16k"])
def test_full_scale_records_are_clipped_never_wrapped(tmp_path: Path, spec: str) -> None:
    # A lossy stream overshoots full scale; libsndfile's own int16 read wraps +1.2 around to about -26000.
    square = np.where(np.arange(16000) % 64 < 32, 32767, -32768).astype(np.int16)
    path = write_dataset(tmp_path / "ds", square[None], records_per_shard=1, compression=spec, payload="audio")
    with open_dataset(path) as ds:
        got = ds.payload.read([0])[0]
        idx = ds.payload.index(0)
        stream = ds.payload.shard_path(0).read_bytes()[int(idx.offsets[0]) : int(idx.offsets[0] + idx.nbytes[0])]
    as_float = np.empty(square.shape, np.float32)
    get_codec(spec).decode(stream, as_float)  # type: ignore[union-attr]
    assert as_float.max() > 1 and as_float.min() < -1  # the stream does overshoot
    np.testing.assert_array_equal(got, np.clip(np.rint(as_float * np.float32(32767)), -32768, 32767).astype(np.int16))
    assert got.max() == 32767 and got.min() == -32768


@pytest.mark.parametrize("spec,shape,dtype,error", [
    ("opus@44.1k", (100,), "int16", r"sample_rate must be one of 8000, 12000, 16000, 24000, 48000 Hz .*found 44100"),
    ("vorbis@384k", (100,), "int16", r"sample_rate must be 1000-192000 Hz, found 384000"),
    ("opus@16k", (100, 9), "int16", r"compression 'opus' stores int16 or float32 audio \[T\] or \[T, C\] with C ≤ 8, "
                                    r"found records \[100, 9\] int16"),
    ("vorbis@16k", (100,), "uint8", r"found records \[100\] uint8"),
    ("opus@16k", (8, 8, 3), "int16", r"found records \[8, 8, 3\] int16"),
    ("opus", (100,), "int16", r"compression 'opus' needs the records' sample rate"),
])  # fmt: skip
def test_codecs_refuse_what_they_cannot_store(tmp_path: Path, spec: str, shape: tuple[int, ...], dtype: str, error: str) -> None:
    with pytest.raises((errors.SchemaError, errors.ConfigError), match=error):
        DatasetWriter(tmp_path / "ds", kind="test", payload="audio", record=FieldSpec(shape, dtype), compression=spec)
    assert not (tmp_path / "ds" / "zarr.json").exists()


def test_convert_refuses_opus_at_an_unsupported_rate_before_decoding(tmp_path: Path) -> None:
    from shardkit.converters import convert

    with pytest.raises(errors.ConfigError, match=r"compression 'opus': sample_rate must be one of .* found 44100"):
        convert(ROOT / "datasets" / "speech", tmp_path / "out", "audio", compression="opus", sample_rate=44100)
    assert not (tmp_path / "out" / "zarr.json").exists()


@pytest.mark.parametrize("argument,error", [
    ("opus:5k", r"bitrate must be 6000-256000"), ("opus:300000", r"bitrate must be"), ("opus:fast", r"expected opus:BITRATE"),
    ("vorbis:11", r"quality must be an integer in \[0, 10\]"), ("vorbis:x", r"expected vorbis:QUALITY"),
    ("opus:32k@fast", r"the rate after @"), ("vorbis:7@fast", r"compression 'vorbis': the rate after @"),
    ("vorbis:x@16k", r"expected vorbis:QUALITY \(0-10\) and optionally @RATE, found 'x@16k'"),
])  # fmt: skip
def test_compression_arguments_are_checked(argument: str, error: str) -> None:
    with pytest.raises(errors.ConfigError, match=error):
        get_codec(argument)


def test_arguments_configure_the_codec_and_the_records_give_the_rate() -> None:
    assert get_codec("opus:24k@48k").to_json() == {"name": "opus", "bitrate": 24000, "sample_rate": 48000}  # type: ignore[union-attr]
    assert get_codec("vorbis").to_json() == {"name": "vorbis", "quality": 4, "sample_rate": None}  # type: ignore[union-attr]
    assert get_codec("vorbis:6@44.1k").to_json() == {"name": "vorbis", "quality": 6, "sample_rate": 44100}  # type: ignore[union-attr]
    assert get_codec("opus@24k").to_json() == {"name": "opus", "bitrate": 32000, "sample_rate": 24000}  # type: ignore[union-attr]
    bound = get_codec("vorbis:7").for_records({"sample_rate": 22050})  # type: ignore[union-attr]
    assert bound.to_json() == {"name": "vorbis", "quality": 7, "sample_rate": 22050}
    assert codec_from_json(bound.to_json()).to_json() == bound.to_json()  # type: ignore[union-attr]
    assert codec_from_zarr(bound.zarr_inner_codecs(2), where="w").to_json() == bound.to_json()  # type: ignore[union-attr]
    with pytest.raises(errors.ConfigError, match=r"sample_rate 48000 Hz differs from the records' 16000 Hz"):
        get_codec("opus@48k").for_records({"sample_rate": 16000})  # type: ignore[union-attr]


def test_a_hostile_document_cannot_ask_libsndfile_for_a_rate_it_crashes_on() -> None:
    # libsndfile 1.2 segfaults encoding Vorbis at 384 kHz: the configuration is refused when read.
    codecs = [{"name": "shardkit.vorbis", "configuration": {"quality": 4, "sample_rate": 384000}}]
    with pytest.raises(errors.NotADatasetError, match="sample_rate must be 1000-192000 Hz"):
        codec_from_zarr(codecs, where="w")
    with pytest.raises(errors.NotADatasetError, match="no sample_rate"):
        codec_from_zarr([{"name": "shardkit.opus", "configuration": {"bitrate": 32000}}], where="w")


def _shard_file(path: Path) -> Path:
    return sorted(p for p in (path / "audio" / "c").rglob("*") if p.is_file())[0]


@pytest.mark.parametrize("spec", ["opus@16k", "vorbis@16k"])
def test_a_damaged_record_is_a_named_error_and_verify_sees_every_byte(tmp_path: Path, spec: str) -> None:
    recs = tone(20, shape=(4000,))  # damage far from the shard's checked tail (its last 4 KiB)
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=20, compression=spec, payload="audio")
    assert verify(path).ok
    with open_dataset(path) as ds:
        idx = ds.payload.index(0)
        offset, middle = int(idx.offsets[2]), int(idx.offsets[4] + idx.nbytes[4] // 2)
    shard = _shard_file(path)
    data = bytearray(shard.read_bytes())
    # Record 2's identification header ("OpusHead" / "\x01vorbis") says another channel count.
    head = data.index(b"OpusHead" if spec.startswith("opus") else b"\x01vorbis", offset)
    data[head + (9 if spec.startswith("opus") else 11)] = 5
    data[middle] ^= 0x10  # and a bit inside record 4's audio packets
    shard.write_bytes(bytes(data))
    with open_dataset(path) as ds:
        assert ds.payload.read([0, 1]).shape == (2, 4000)
        with pytest.raises(errors.CorruptShardError, match=rf"record 2 at offset {offset} does not decode"):
            ds.payload.read([15, 2])
    report = verify(path)
    assert not report.ok and any("crc32c" in p or "record 4" in p for p in map(str, report.problems))


def test_convert_reports_ratio_and_snr_and_info_shows_both(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    out = tmp_path / "opus"
    result = run_cli("convert", str(ROOT / "datasets" / "speech"), "-o", str(out), "--kind", "audio", "--compression", "opus:24k")
    assert result.returncode == 0, result.stderr
    with open_dataset(out) as ds:
        sample = ds.meta.source["compression_sample"]
        assert ds.meta.compression == {"name": "opus", "bitrate": 24000, "sample_rate": 16000}
        assert ds.payload.read(np.arange(ds.meta.num_records)).shape == (ds.meta.num_records, 16000)
    assert sample["records"] > 0 and sample["snr_db"] >= 10 and sample["min_snr_db"] <= sample["snr_db"]
    assert "psnr_db" not in sample
    for text in (result.stdout, run_cli("info", str(out)).stdout):
        assert "compression  opus (bitrate=24000, sample_rate=16000): " in text and "x (" in text
        assert f"quality      SNR {sample['snr_db']} dB on average, lowest {sample['min_snr_db']} dB" in text
    report = json.loads(run_cli("info", str(out), "--json").stdout)["compression_report"]
    assert report["snr_db"] == sample["snr_db"] and report["min_snr_db"] == sample["min_snr_db"]
    assert report["psnr_db"] is None and report["ratio"] > 4
    assert verify(out).ok


@pytest.mark.parametrize("spec", ["opus@16k", "vorbis@16k"])
def test_a_stream_of_another_length_channel_count_or_rate_is_refused(spec: str) -> None:
    # A stream from a longer clip would otherwise decode its first T frames without a word.
    name = spec.split("@")[0]
    at16k, at48k = get_codec(spec), get_codec(f"{name}@48k")
    assert at16k is not None and at48k is not None
    out = np.empty(4000, np.int16)
    for stream, error in ((at16k.encode(tone(1, shape=(4001,))[0]), "4001 frames x 1 channels"),
                          (at16k.encode(tone(1, shape=(4000, 2))[0]), "4000 frames x 2 channels"),
                          (at48k.encode(tone(1, shape=(4000,))[0]), "at 48000 Hz")):
        with pytest.raises(ValueError, match=error):
            at16k.decode(stream, out)


def test_a_libsndfile_without_ogg_opus_is_named_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import soundfile

    monkeypatch.setattr(soundfile, "available_subtypes", lambda fmt=None: {"VORBIS": "Vorbis"})
    with pytest.raises(errors.ConfigError, match=r"compression 'opus': this libsndfile .* has no Ogg Opus"):
        DatasetWriter(tmp_path / "ds", kind="test", payload="audio", record=FieldSpec((100,), "int16"), compression="opus@16k")
    assert not (tmp_path / "ds" / "zarr.json").exists()
