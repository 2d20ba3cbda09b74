"""Hostile audio: headers that claim hours or absurd rates and channel counts get bounded memory and a named
skip; long files are streamed window by window; reading a span gives exactly the whole-file result."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from scipy.signal import resample_poly

import shardkit
from shardkit.converters.audio import AudioDecoder
from shardkit.converters.audio_transforms import BLOCK_BYTES, MAX_RATE, MIN_RATE, AudioTransform, Resampler
from shardkit.errors import InputFileError
from shardkit.formats import open_dataset
from tests.helpers.corpora import tone, write_wav

HOUR_FRAMES = 3600 * 44100
# One worker under pytest-xdist: a 20-minute recording (the `long_recording` fixture) is written once.
pytestmark = pytest.mark.xdist_group("converters-audio-bounds")


def claim_frames(path: Path, frames: int) -> None:
    """Rewrite the total-samples field of a FLAC's STREAMINFO (36 bits at byte 18) to ``frames``."""
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO is the first metadata block
    word = int.from_bytes(data[18:26], "big")
    word = (word & ~((1 << 36) - 1)) | frames
    data[18:26] = word.to_bytes(8, "big")
    path.write_bytes(bytes(data))


def hour_claiming_flac(path: Path) -> None:
    """1.4 MB of 8-channel noise whose header claims an hour (10 GiB as float64)."""
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, (44100, 8))
    write_wav(path, noise, 44100, subtype="PCM_16")
    claim_frames(path, HOUR_FRAMES)
    assert sf.info(str(path)).frames == HOUR_FRAMES and sf.info(str(path)).channels == 8


@contextmanager
def peak_memory() -> Iterator[list[int]]:
    """The peak of traced allocations (numpy's included) inside the block, in bytes."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Frame counts of every ``SoundFile.read`` call."""
    counts: list[int] = []
    real = sf.SoundFile.read

    def spy(self, frames=-1, *args, **kwargs):
        counts.append(frames)
        return real(self, frames, *args, **kwargs)

    monkeypatch.setattr(sf.SoundFile, "read", spy)
    return counts


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "corpus"
    write_wav(root / "a" / "good.wav", tone(440, 16000, 1.0), 16000)
    hour_claiming_flac(root / "a" / "hour.flac")
    write_wav(root / "a" / "one_hz.wav", np.zeros(500_000), 1)  # 500000 s at 1 Hz: 8e9 samples at 16 kHz
    write_wav(root / "a" / "fast.wav", np.zeros(100), 800_000)
    write_wav(root / "a" / "prime.wav", tone(300, 47_999, 0.2), 47_999)  # coprime with 16 kHz
    write_wav(root / "b" / "many.wav", np.zeros((10, 300)), 16000)
    return root


def _reasons(out: Path) -> dict[str, str]:
    with open_dataset(out) as ds:
        return {Path(s.path).name: s.reason for s in ds.meta.skipped}


def test_hostile_headers_are_skipped_with_reasons_and_bounded_memory(hostile: Path, tmp_path: Path, reads) -> None:
    with peak_memory() as peak:
        s = shardkit.convert(hostile, tmp_path / "out", duration=0.5, workers=1)
    assert peak[0] < 64 << 20, peak  # reading the hour would be 10 GiB; resampling 1 Hz 64 GB
    assert s.records == 2  # good.wav, and the first half second of hour.flac: only those frames are read
    reasons = _reasons(tmp_path / "out")
    assert reasons["one_hz.wav"] == (f"unsupported: sample rate 1 Hz is outside {MIN_RATE}..{MAX_RATE} Hz "
                                     "(a damaged header, or not audio)")
    assert reasons["fast.wav"].startswith("unsupported: sample rate 800000 Hz is outside")
    assert reasons["many.wav"] == "unsupported: 300 channels, at most 256 are supported"
    assert reasons["prime.wav"].startswith("unsupported: resampling 47999 Hz to 16000 Hz needs a filter of 959981 taps")
    # The frames requested: the half second the record needs (plus the filter's reach), in blocks.
    assert sum(reads) < 0.5 * 44100 + 1000 + 16000 and max(reads) <= BLOCK_BYTES // 8


def test_window_mode_streams_and_skips_a_file_shorter_than_its_header(hostile: Path, tmp_path: Path) -> None:
    with peak_memory() as peak:
        s = shardkit.convert(hostile, tmp_path / "win", duration=0.5, window=True, workers=1)
    assert peak[0] < 64 << 20, peak
    assert s.records == 2  # good.wav: 2 windows; hour.flac holds 1 s of the 3600 it claims
    reason = _reasons(tmp_path / "win")["hour.flac"]
    assert reason.startswith("corrupt:") and f"(the header claims {HOUR_FRAMES} frames)" in reason


@pytest.fixture(scope="module")
def long_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 minutes of a chirp at 8 kHz (a real-length recording, 9.6 M frames)."""
    root = tmp_path_factory.mktemp("long") / "corpus"
    t = np.arange(20 * 60 * 8000) / 8000
    write_wav(root / "talk" / "long.flac", 0.4 * np.sin(2 * np.pi * (200 + 0.2 * t) * t), 8000)
    write_wav(root / "talk" / "short.wav", tone(500, 8000, 0.3), 8000)
    return root


def _reference_windows(path: Path, rate_out: int, t: int) -> np.ndarray:
    """The whole file resampled at once and cut into windows (the definition the streaming must meet)."""
    x, rate = sf.read(str(path), dtype="float64")
    g = math.gcd(rate, rate_out)
    y = resample_poly(x, rate_out // g, rate // g)
    count = max(1, -(-y.shape[0] // t))
    y = np.pad(y, (0, count * t - y.shape[0]))
    return np.clip(np.rint(y.reshape(count, t) * 32767.0), -32768, 32767).astype(np.int16)


def test_long_files_are_decoded_a_bounded_number_of_windows_at_a_time(long_recording: Path, reads) -> None:
    audio = AudioTransform(16000, 1.0, 1, True, "int16")
    decoder = AudioDecoder(long_recording, audio)
    assert decoder.per_call == (4 << 20) // 32000
    first = decoder.decode(("talk/long.flac", 0))
    assert len(first.records) == decoder.per_call and first.more and first.next_start == decoder.per_call
    # One pass over the file to check it decodes to the end, then only the span of these windows.
    span = sum(reads) - 20 * 60 * 8000
    assert 0 < span < decoder.per_call * 8000 + 1000 and max(reads) <= BLOCK_BYTES // 8
    reads.clear()
    with peak_memory() as peak:
        last = decoder.decode(("talk/long.flac", 0), start=1199)
    assert [r["audio"].shape for r in last.records] == [(16000,)] and not last.more
    assert sum(reads) < 8000 + 1000 and peak[0] < 8 << 20  # no pass over the file when continuing


@pytest.mark.parametrize("workers", [1, 2])
def test_streamed_windows_equal_the_whole_file_resampled(long_recording: Path, tmp_path: Path, workers: int) -> None:
    with peak_memory() as peak:
        s = shardkit.convert(long_recording, tmp_path / "out", window=True, duration=1.0, workers=workers,
                             records_per_shard=500)
    # Whole-file decoding held ~270 MB here (9.6 M frames as float64, resampled to 19.2 M, 1200 windows).
    assert workers > 1 or peak[0] < 96 << 20, peak
    want = _reference_windows(long_recording / "talk" / "long.flac", 16000, 16000)
    assert want.shape == (1200, 16000) and s.records == 1200 + 1
    with open_dataset(tmp_path / "out") as ds:
        got = ds.read(np.arange(1200))["audio"]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ds.read([1200])["audio"][0],
                                      _reference_windows(long_recording / "talk" / "short.wav", 16000, 16000)[0])


RATES = [8000, 11025, 16000, 22050, 44100, 48000, 96000, 32000, 12345, 44056]


def test_the_span_of_any_outputs_gives_exactly_the_whole_file_result() -> None:
    rng = np.random.default_rng(7)
    for trial in range(60):
        rate_in, rate_out = (int(r) for r in rng.choice(RATES, 2))
        rs = Resampler(rate_in, rate_out)
        n_in = int(rng.integers(1, 30000))
        x = rng.standard_normal((n_in, 2))
        full = resample_poly(x, rs.up, rs.down, axis=0) if not rs.identity else x
        assert full.shape[0] == rs.n_out(n_in)
        j0 = int(rng.integers(0, full.shape[0]))
        j1 = int(rng.integers(j0 + 1, full.shape[0] + 1))
        s, e, o = rs.span(j0, j1, n_in)
        assert 0 <= s <= e <= n_in
        np.testing.assert_array_equal(rs.apply(x[s:e])[j0 - o : j1 - o], full[j0:j1], err_msg=str((rate_in, rate_out, trial)))


def test_in_memory_clips_check_the_rate_too() -> None:
    with pytest.raises(InputFileError, match="sample rate 1 Hz"):
        AudioTransform().clips(np.zeros((100, 1)), 1)
    (clip,) = AudioTransform(8000, 0.5, 1, False, "float32").clips(tone(300, 44100, 2.0)[:, None], 44100)
    x = tone(300, 44100, 2.0)
    np.testing.assert_array_equal(clip, resample_poly(x, 80, 441)[:4000].astype(np.float32))
