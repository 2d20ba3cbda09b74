"""Audio folders: resampling keeps the tone, channels, windows, splits, bad files skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters.audio_transforms import AudioTransform
from shardkit.formats import open_dataset
from tests.helpers.corpora import tone, write_wav


def _dominant(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x.astype(np.float64) * np.hanning(x.shape[0])))
    k = int(np.argmax(spec))
    # Parabolic interpolation of the peak for sub-bin accuracy.
    a, b, c = np.log(spec[k - 1 : k + 2] + 1e-12)
    k += 0.5 * (a - c) / (a - 2 * b + c)
    return k * rate / x.shape[0]


@pytest.mark.parametrize("rate_in,freq", [(44100, 1234.0), (8000, 440.0), (22050, 3000.0), (16000, 777.0)])
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_dominant_frequency_survives_resampling(rate_in: int, freq: float, dtype: str) -> None:
    t = AudioTransform(sample_rate=16000, duration=1.0, dtype=dtype)
    (clip,) = t.clips(tone(freq, rate_in, 1.0)[:, None], rate_in)
    assert clip.shape == (16000,) and clip.dtype == np.dtype(dtype)
    assert abs(_dominant(clip, 16000) - freq) / freq < 0.01
    scale = 32767 if dtype == "int16" else 1.0
    assert abs(np.abs(clip[1000:-1000]).max() / scale - 0.5) < 0.02  # amplitude kept, no aliasing loss


def test_resampling_removes_content_above_the_new_nyquist() -> None:
    # 7 kHz at 44.1 kHz resampled to 8 kHz: naive decimation would alias it to 1 kHz.
    t = AudioTransform(sample_rate=8000, duration=1.0, dtype="float32")
    (clip,) = t.clips(tone(7000, 44100, 1.0)[:, None], 44100)
    assert np.abs(clip[500:-500]).max() < 0.01


def test_channels_window_and_padding() -> None:
    stereo = np.stack([tone(300, 8000, 2.5), tone(600, 8000, 2.5)], axis=1)
    mono = AudioTransform(8000, 1.0, 1, False, "float32").clips(stereo, 8000)
    assert len(mono) == 1 and np.allclose(mono[0], stereo[:8000].mean(axis=1), atol=1e-6)
    keep = AudioTransform(8000, 1.0, 2, True, "float32").clips(stereo, 8000)
    assert len(keep) == 3 and keep[0].shape == (8000, 2)
    assert np.allclose(keep[2][:4000], stereo[16000:]) and (keep[2][4000:] == 0).all()
    dup = AudioTransform(8000, 1.0, 2, False, "int16").clips(tone(300, 8000, 0.5)[:, None], 8000)
    assert (dup[0][:, 0] == dup[0][:, 1]).all() and (dup[0][4000:] == 0).all()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audio") / "speech"
    for w, word in enumerate(["no", "yes"]):
        for i in range(4):
            write_wav(root / word / f"{word}{i}.wav", tone(300 + 100 * w + 10 * i, 8000, 0.8), 8000)
    write_wav(root / "yes" / "long.flac", tone(500, 8000, 2.2), 8000, subtype="PCM_16")
    write_wav(root / "_background_noise_" / "noise.wav", tone(50, 8000, 3.0), 8000)
    (root / "no" / "text.wav").write_text("not audio at all\n")
    (root / "no" / "zero.wav").write_bytes(b"")
    (root / "no" / "README.md").write_text("x")
    (root / "validation_list.txt").write_text("no/no1.wav\nyes/yes1.wav\n")
    (root / "testing_list.txt").write_text("no/no2.wav\n")
    return root


def test_speech_commands_layout(corpus: Path, tmp_path: Path) -> None:
    s = shardkit.convert(corpus, tmp_path / "train", workers=1)
    assert s.kind == "audio"
    # train = everything not listed: no0, no3, yes0, yes2, yes3, long + 3 bad files.
    assert s.records == 6 and dict(s.skipped) == {"empty": 1, "unsupported": 2}
    with open_dataset(tmp_path / "train") as ds:
        assert ds.label_names == ["no", "yes"]
        assert ds.meta.record.shape == (16000,) and ds.meta.record.dtype == "int16"
        reasons = {Path(x.path).name: x.reason for x in ds.meta.skipped}
        assert reasons["text.wav"].startswith("unsupported") and reasons["README.md"].startswith("unsupported")
        a = ds.read([0])["audio"][0]
        assert abs(_dominant(a[:12800], 16000) - 300) < 3  # no0: 300 Hz, 0.8 s then zero padding
        assert (a[12900:] == 0).all()
    v = shardkit.convert(corpus, tmp_path / "val", split="val", workers=1)
    assert v.records == 2
    w = shardkit.convert(corpus, tmp_path / "win", window=True, duration=1.0, dtype="float32", workers=1)
    assert w.records == 5 + 3  # five 0.8 s clips -> 1 record each, long.flac (2.2 s) -> 3 windows


def test_audio_options_validated(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(shardkit.errors.ConfigError, match=r"^dtype: expected one of int16, float32"):
        shardkit.convert(corpus, tmp_path / "x", dtype="int8")
    with pytest.raises(shardkit.errors.ConfigError, match="does not accept"):
        shardkit.convert(corpus, tmp_path / "x", size=32)
