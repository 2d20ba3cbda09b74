"""Audio decoding and the fixed-length transform of the audio corpus kind.

Decoding uses soundfile (libsndfile: wav, flac, ogg/vorbis, aiff...). Channels are mixed to mono
(the mean, so a mono file duplicated into two channels is unchanged) or kept; resampling is
polyphase (``scipy.signal.resample_poly``: an anti-aliasing FIR filter applied at the rational rate
``up/down``), which keeps the band below the new Nyquist frequency and does not smear energy
across the spectrum as naive interpolation does. Each clip is then cut to a fixed number of samples:
zero-padded or trimmed at the end, or, with ``window=True``, cut into consecutive non-overlapping
windows (the last one zero-padded) so that no audio is thrown away.

Failures are :class:`~shardkit.errors.InputFileError` with categorised reasons (``missing``,
``unreadable``, ``empty``, ``unsupported``, ``corrupt``, ``channels``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.images import check_regular_file
from shardkit.errors import ConfigError, InputFileError

__all__ = ["AUDIO_EXTENSIONS", "AudioTransform", "read_audio", "resample"]

#: File extensions that audio class-folder scans treat as audio.
AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".aif", ".aiff"})


def read_audio(path: Path) -> tuple[np.ndarray, int]:
    """Decode ``path`` into ``float64 [frames, channels]`` in -1..1 and its sample rate."""
    import soundfile as sf

    check_regular_file(path)
    try:
        data, rate = sf.read(str(path), dtype="float64", always_2d=True)
    except PermissionError as exc:
        raise InputFileError(str(path), f"unreadable: {exc.strerror or exc}") from None
    except sf.LibsndfileError as exc:
        text = str(exc)
        lowered = text.lower()
        if "format" in lowered or "recognised" in lowered or "recognized" in lowered:
            raise InputFileError(str(path), f"unsupported: not an audio format libsndfile can read ({text})") from None
        raise InputFileError(str(path), f"corrupt: {text}") from None
    except Exception as exc:
        raise InputFileError(str(path), f"corrupt: {type(exc).__name__}: {exc}") from None
    if data.shape[0] == 0:
        raise InputFileError(str(path), "empty: the file holds no audio frames")
    if not np.all(np.isfinite(data)):
        raise InputFileError(str(path), "corrupt: non-finite samples (NaN or infinity)")
    return data, int(rate)


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Polyphase resampling along axis 0 (identity when the rates agree)."""
    if rate_in == rate_out:
        return x
    from scipy.signal import resample_poly

    g = math.gcd(rate_in, rate_out)
    out: np.ndarray = resample_poly(x, rate_out // g, rate_in // g, axis=0)
    return out


@dataclass(frozen=True)
class AudioTransform:
    """Decode, mix/keep channels, resample and cut to fixed-length records.

    Parameters
    ----------
    sample_rate
        Output rate in Hz.
    duration
        Record length in seconds (``round(duration * sample_rate)`` samples).
    channels
        1: mix to mono, records ``[T]``. C > 1: keep C channels, records ``[T, C]``; a mono file
        is duplicated, any other channel count is skipped (``channels: ...``).
    window
        Cut long files into consecutive windows instead of trimming.
    dtype
        ``"int16"`` (scaled by 32767, clipped) or ``"float32"``.
    """

    sample_rate: int = 16000
    duration: float = 1.0
    channels: int = 1
    window: bool = False
    dtype: str = "int16"

    def __post_init__(self) -> None:
        if self.sample_rate <= 0:
            raise ConfigError(f"--sample-rate: expected a positive rate in Hz, found {self.sample_rate}")
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ConfigError(f"--duration: expected a positive number of seconds, found {self.duration}")
        if self.channels < 1:
            raise ConfigError(f"--channels: expected 1 or more, found {self.channels}")
        if self.dtype not in ("int16", "float32"):
            raise ConfigError(f"--dtype: expected int16 or float32, found {self.dtype!r}")
        if self.num_samples < 1:
            raise ConfigError(f"--duration {self.duration} at {self.sample_rate} Hz is less than one sample")

    @property
    def num_samples(self) -> int:
        return int(round(self.duration * self.sample_rate))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_samples,) if self.channels == 1 else (self.num_samples, self.channels)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_samples"] = self.num_samples
        d["resampler"] = "scipy.signal.resample_poly"
        return d

    def _channels(self, data: np.ndarray, path: str) -> np.ndarray:
        if self.channels == 1:
            mono: np.ndarray = data.mean(axis=1)
            return mono
        if data.shape[1] == self.channels:
            return data
        if data.shape[1] == 1:
            return np.repeat(data, self.channels, axis=1)
        raise InputFileError(path, f"channels: file has {data.shape[1]} channels, expected 1 or {self.channels}")

    def _cast(self, x: np.ndarray) -> np.ndarray:
        if self.dtype == "int16":
            return np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int16)
        return x.astype(np.float32)

    def clips(self, data: np.ndarray, rate: int, path: str = "<audio>") -> list[np.ndarray]:
        """Turn decoded ``[frames, channels]`` audio into one or more fixed-length records."""
        x = resample(self._channels(data, path), rate, self.sample_rate)
        t = self.num_samples
        n = x.shape[0]
        count = max(1, math.ceil(n / t)) if self.window else 1
        out = []
        for k in range(count):
            piece = x[k * t : (k + 1) * t]
            if piece.shape[0] < t:
                pad = [(0, t - piece.shape[0])] + [(0, 0)] * (piece.ndim - 1)
                piece = np.pad(piece, pad)
            out.append(self._cast(piece))
        return out

    def load(self, path: Path) -> list[np.ndarray]:
        """Decode ``path`` and cut it into records."""
        data, rate = read_audio(path)
        return self.clips(data, rate, str(path))
