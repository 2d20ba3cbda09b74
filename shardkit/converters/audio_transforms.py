"""Audio decoding with bounded memory, and the fixed-length transform of the audio corpus kind.

Decoding uses soundfile (libsndfile: wav, flac, ogg/vorbis, aiff...); :class:`AudioTransform` mixes
or keeps channels, resamples polyphase and cuts each clip to a fixed length. A header is never
trusted for sizes: only the frames the records need are read (docs/design.md §5, §13).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardkit.converters.base import MAX_RECORDS_PER_INPUT
from shardkit.converters.images import check_regular_file
from shardkit.errors import ConfigError, InputFileError

__all__ = [
    "AUDIO_COLUMNS",
    "AUDIO_EXTENSIONS",
    "AudioClips",
    "BLOCK_BYTES",
    "MAX_FILE_CHANNELS",
    "MAX_RATE",
    "MAX_RATE_FACTOR",
    "MIN_RATE",
    "AudioTransform",
    "Resampler",
]

#: Provenance columns of audio records: the file's sample rate, channels and length in frames.
AUDIO_COLUMNS = ("rate", "channels", "frames")
#: File extensions that audio class-folder scans treat as audio.
AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".aif", ".aiff"})
#: Lowest sample rate accepted, of a file or of the output: below 1 kHz nothing audible above 500 Hz
#: survives, so such a header is damaged or not audio.
MIN_RATE = 1_000
#: Highest sample rate accepted, of a file or of the output: the highest rate audio interfaces record;
#: it keeps the resampling ratio, hence the work and the frames read per output second, below 768.
MAX_RATE = 768_000
#: Most channels a file may have (more than any recording setup writes into one file).
MAX_FILE_CHANNELS = 256
#: Largest ``max(up, down)`` of the reduced resampling ratio (filter of ``20 * factor + 1`` taps): two
#: rates sharing no factor (47999 Hz to 16 kHz) would need a million taps, while every pair of standard
#: rates (8k, 11.025k, ..., 768k) stays below it (the worst, 768 kHz to 11.025 kHz, is 10240).
MAX_RATE_FACTOR = 1 << 15
#: Frames are read in blocks of about this many bytes (as float64 in the file's channels).
BLOCK_BYTES = 4 << 20
#: Kaiser window of the anti-aliasing filter: scipy's ``resample_poly`` default.
_WINDOW = ("kaiser", 5.0)


@functools.lru_cache(maxsize=16)
def _lowpass(up: int, down: int) -> np.ndarray:
    """The anti-aliasing filter of ``resample_poly`` for the reduced ratio ``up/down`` (cached)."""
    from scipy.signal import firwin

    half_len = 10 * max(up, down)
    h: np.ndarray = firwin(2 * half_len + 1, 1.0 / max(up, down), window=_WINDOW)
    h.setflags(write=False)
    return h


@dataclass(frozen=True)
class Resampler:
    """Polyphase resampling from ``rate_in`` to ``rate_out``, and the input span each output needs.

    Equal to ``scipy.signal.resample_poly(x, rate_out, rate_in)`` (the same filter, passed
    explicitly so that its length is known here): with the reduced ratio ``up/down``, the filter
    has ``2 * half_len + 1`` taps, ``half_len = 10 * max(up, down)``.
    """

    rate_in: int
    rate_out: int

    @property
    def up(self) -> int:
        return self.rate_out // math.gcd(self.rate_in, self.rate_out)

    @property
    def down(self) -> int:
        return self.rate_in // math.gcd(self.rate_in, self.rate_out)

    @property
    def identity(self) -> bool:
        return self.rate_in == self.rate_out

    def check(self, path: str) -> None:
        """InputFileError when the filter would exceed :data:`MAX_RATE_FACTOR`."""
        factor = max(self.up, self.down)
        if factor > MAX_RATE_FACTOR:
            raise InputFileError(
                path,
                f"unsupported: resampling {self.rate_in} Hz to {self.rate_out} Hz needs a filter of "
                f"{20 * factor + 1} taps (the rates share only the factor "
                f"{math.gcd(self.rate_in, self.rate_out)}); at most {20 * MAX_RATE_FACTOR + 1} are allowed",
            )

    def n_out(self, n_in: int) -> int:
        """Output samples for ``n_in`` input frames (as ``resample_poly`` gives)."""
        return -(-n_in * self.up // self.down)

    def span(self, j0: int, j1: int, n_in: int) -> tuple[int, int, int]:
        """Input frames ``[s, e)`` whose resampling gives outputs ``j0 .. j1 - 1`` at index ``j - o``.

        Output ``j`` is ``y[P + j]`` with ``y[m] = sum_k h[k] * xu[m * down - k]`` over the padded
        filter ``h`` of ``L`` taps, ``xu`` the input upsampled by ``up`` and ``P`` the samples
        ``resample_poly`` removes in front. So it uses input frames ``i`` with
        ``m * down - L < i * up <= m * down``. The span starts at a multiple of ``down`` so that it
        maps to a whole output offset ``o = s * up / down``; every term of the wanted outputs is
        inside it, and terms outside are exactly the zeros ``resample_poly`` pads with.
        """
        if self.identity:
            return j0, min(n_in, j1), j0
        up, down = self.up, self.down
        half_len = 10 * max(up, down)
        pre_pad = down - half_len % down
        taps = pre_pad + 2 * half_len + 1
        front = (half_len + pre_pad) // down
        lo = -(-((front + j0) * down - taps + 1) // up)
        hi = (front + j1 - 1) * down // up
        s = max(0, lo) // down * down
        return s, min(n_in, hi + 1), s // down * up

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Resample along axis 0."""
        if self.identity:
            return x
        from scipy.signal import resample_poly

        out: np.ndarray = resample_poly(x, self.up, self.down, axis=0, window=_lowpass(self.up, self.down))
        return out


class _Frames(Protocol):
    """Decoded audio that can be read by frame ranges."""

    frames: int
    channels: int

    def read(self, start: int, stop: int, convert: Callable[[np.ndarray], np.ndarray], width: int) -> np.ndarray:
        """Frames ``[start, stop)`` as float64, each block passed through ``convert`` (``width`` columns)."""

    def check_all(self) -> None:
        """Decode every frame once (bounded memory); InputFileError if the file does not."""


class _ArrayFrames:
    """Audio already in memory (``float64 [frames, channels]``)."""

    def __init__(self, data: np.ndarray, path: str) -> None:
        self.data = np.asarray(data, dtype=np.float64)
        if self.data.ndim == 1:
            self.data = self.data[:, None]
        self.frames, self.channels = self.data.shape
        self.path = path

    def read(self, start: int, stop: int, convert: Callable[[np.ndarray], np.ndarray], width: int) -> np.ndarray:
        block = self.data[start:stop]
        _check_finite(block, self.path)
        return convert(block)

    def check_all(self) -> None:
        _check_finite(self.data, self.path)


class _FileFrames:
    """An open ``soundfile.SoundFile``, read by seeking and reading blocks of frames."""

    def __init__(self, handle: Any, path: str) -> None:
        self.handle = handle
        self.path = path
        self.frames = int(handle.frames)
        self.channels = int(handle.channels)
        self.block = max(1, BLOCK_BYTES // (8 * self.channels))

    def _blocks(self, start: int, stop: int) -> Iterator[np.ndarray]:
        import soundfile as sf

        pos, want = start, 0
        try:
            self.handle.seek(start)
            while pos < stop:
                want = min(self.block, stop - pos)
                data = self.handle.read(want, dtype="float64", always_2d=True)
                if data.shape[0] < want:
                    raise InputFileError(
                        self.path,
                        f"corrupt: the audio ends after frame {pos + data.shape[0]} (the header claims "
                        f"{self.frames} frames)",
                    )
                _check_finite(data, self.path)
                pos += want
                yield data
        except (sf.LibsndfileError, RuntimeError, ValueError) as exc:
            raise InputFileError(
                self.path,
                f"corrupt: decoding failed in frames {pos}-{pos + want} (the header claims {self.frames} frames): {exc}",
            ) from None

    def read(self, start: int, stop: int, convert: Callable[[np.ndarray], np.ndarray], width: int) -> np.ndarray:
        out = np.empty((stop - start, width), dtype=np.float64)
        pos = 0
        for data in self._blocks(start, stop):
            out[pos : pos + data.shape[0]] = convert(data).reshape(data.shape[0], width)
            pos += data.shape[0]
        return out

    def check_all(self) -> None:
        for _ in self._blocks(0, self.frames):
            pass


def _check_finite(data: np.ndarray, path: str) -> None:
    if not np.all(np.isfinite(data)):
        raise InputFileError(path, "corrupt: non-finite samples (NaN or infinity)")


@contextmanager
def _open(path: Path, data: bytes | None = None) -> Iterator[tuple[_FileFrames, int]]:
    """Open ``path`` (or the bytes ``data`` named ``path``: a member of an archive) with soundfile; yield
    its frames and sample rate (header checked, nothing read)."""
    import soundfile as sf

    name = str(path)
    if data is None:
        check_regular_file(path)
    elif not data:
        raise InputFileError(name, "empty: zero-byte audio")
    try:
        handle = sf.SoundFile(name if data is None else io.BytesIO(data))
    except PermissionError as exc:
        raise InputFileError(name, f"unreadable: {exc.strerror or exc}") from None
    except sf.LibsndfileError as exc:
        text = str(exc)
        lowered = text.lower()
        if "format" in lowered or "recognised" in lowered or "recognized" in lowered:
            raise InputFileError(name, f"unsupported: not an audio format libsndfile can read ({text})") from None
        raise InputFileError(name, f"corrupt: {text}") from None
    except Exception as exc:
        raise InputFileError(name, f"corrupt: {type(exc).__name__}: {exc}") from None
    with handle:
        rate, channels = int(handle.samplerate), int(handle.channels)
        if not MIN_RATE <= rate <= MAX_RATE:
            raise InputFileError(
                name,
                f"unsupported: sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz (a damaged header, "
                "or not audio)",
            )
        if not 1 <= channels <= MAX_FILE_CHANNELS:
            raise InputFileError(name, f"unsupported: {channels} channels, at most {MAX_FILE_CHANNELS} are supported")
        frames = _FileFrames(handle, name)
        if frames.frames <= 0:
            raise InputFileError(name, "empty: the file holds no audio frames")
        yield frames, rate


@dataclass(frozen=True)
class AudioTransform:
    """Decode, mix/keep channels, resample and cut to fixed-length records (docs/design.md §5).

    Mixing to mono takes the mean; a clip is zero-padded or trimmed at the end, or with
    ``window=True`` cut into consecutive windows (the last one zero-padded). Rates outside
    :data:`MIN_RATE` .. :data:`MAX_RATE`, more than :data:`MAX_FILE_CHANNELS` channels, a rate pair
    beyond :data:`MAX_RATE_FACTOR` or too many windows are skipped (``unsupported``, ``too-long``).

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
        # Converters check options (naming them as the user wrote them) before building a
        # transform; these checks guard direct construction.
        if not MIN_RATE <= self.sample_rate <= MAX_RATE:
            raise ConfigError(f"AudioTransform: sample_rate must be {MIN_RATE}..{MAX_RATE} Hz, found {self.sample_rate}")
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ConfigError(f"AudioTransform: duration must be a positive number of seconds, found {self.duration}")
        if not 1 <= self.channels <= MAX_FILE_CHANNELS:
            raise ConfigError(f"AudioTransform: channels must be 1..{MAX_FILE_CHANNELS}, found {self.channels}")
        if self.dtype not in ("int16", "float32"):
            raise ConfigError(f"AudioTransform: dtype must be int16 or float32, found {self.dtype!r}")
        if self.num_samples < 1:
            raise ConfigError(f"AudioTransform: duration {self.duration} s at {self.sample_rate} Hz is less than one sample")

    @property
    def num_samples(self) -> int:
        return int(round(self.duration * self.sample_rate))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_samples,) if self.channels == 1 else (self.num_samples, self.channels)

    @property
    def record_nbytes(self) -> int:
        return self.num_samples * self.channels * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_samples"] = self.num_samples
        d["resampler"] = "scipy.signal.resample_poly"
        return d

    def _convert(self, file_channels: int, path: str) -> Callable[[np.ndarray], np.ndarray]:
        """Block converter from ``file_channels`` to the output channels (InputFileError if impossible)."""
        if self.channels == 1:
            return lambda block: block.mean(axis=1, keepdims=True)
        if file_channels == self.channels:
            return lambda block: block
        if file_channels == 1:
            return lambda block: np.repeat(block, self.channels, axis=1)
        raise InputFileError(path, f"channels: file has {file_channels} channels, expected 1 or {self.channels}")

    def _cast(self, x: np.ndarray) -> np.ndarray:
        if self.dtype == "int16":
            return np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int16)
        return x.astype(np.float32)

    def _records(self, source: _Frames, rate: int, path: str, start: int, limit: int | None) -> tuple[list[np.ndarray], bool]:
        """Records ``start .. start + limit - 1`` of ``source`` and whether more follow."""
        rs = Resampler(rate, self.sample_rate)
        rs.check(path)
        convert = self._convert(source.channels, path)
        t = self.num_samples
        n_out = rs.n_out(source.frames)
        total = max(1, -(-n_out // t)) if self.window else 1
        if total > MAX_RECORDS_PER_INPUT:
            raise InputFileError(
                path, f"too-long: {source.frames} frames give {total} windows, more than {MAX_RECORDS_PER_INPUT}"
            )
        stop = total if limit is None else min(total, start + max(1, limit))
        if start >= stop:
            return [], False
        if start == 0 and stop < total:
            source.check_all()  # write no window of a file that turns out to be broken later
        j0, j1 = start * t, min(stop * t, n_out)
        if j1 > j0:
            s, e, o = rs.span(j0, j1, source.frames)
            y = rs.apply(source.read(s, e, convert, self.channels))[j0 - o : j1 - o]
        else:
            y = np.zeros((0, self.channels))
        out = []
        for k in range(stop - start):
            piece = y[k * t : (k + 1) * t]
            if piece.shape[0] < t:
                piece = np.pad(piece, [(0, t - piece.shape[0]), (0, 0)])
            out.append(self._cast(piece[:, 0] if self.channels == 1 else piece))
        return out, stop < total

    def clips(self, data: np.ndarray, rate: int, path: str = "<audio>") -> list[np.ndarray]:
        """Every record of decoded ``[frames, channels]`` audio held in memory."""
        if not MIN_RATE <= rate <= MAX_RATE:
            raise InputFileError(path, f"unsupported: sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
        records, _ = self._records(_ArrayFrames(data, path), rate, path, 0, None)
        return records

    def read(self, path: Path, start: int = 0, limit: int | None = None, data: bytes | None = None) -> AudioClips:
        """Records ``start, start + 1, ...`` of ``path`` (or of the bytes ``data`` named ``path``; at most
        ``limit``), whether more follow, and what the file was; reads only the frames those records need
        (docs/design.md §5)."""
        with _open(path, data) as (frames, rate):
            records, more = self._records(frames, rate, str(path), start, limit)
            return AudioClips(records, more, rate, frames.channels, frames.frames)


@dataclass(frozen=True)
class AudioClips:
    """The records asked for of one audio file, whether it has more, and its rate, channels and
    length in frames (its provenance columns, :data:`AUDIO_COLUMNS`)."""

    records: list[np.ndarray]
    more: bool
    rate: int
    channels: int
    frames: int

    def provenance(self) -> dict[str, int]:
        return {"rate": self.rate, "channels": self.channels, "frames": self.frames}
