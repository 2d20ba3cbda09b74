"""Audio records as a person checks them: a waveform and a spectrogram per record (matplotlib, the
``viz`` extra, imported only here), and WAV files to listen to (soundfile)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardkit._extras import import_extra

__all__ = ["audio_figure", "as_float", "write_wav"]


def as_float(record: np.ndarray) -> np.ndarray:
    """A record as float64 ``[T, C]`` in [-1, 1] (int16 scaled by 1/32768)."""
    a = np.asarray(record)
    x = a.astype(np.float64) / 32768.0 if a.dtype == np.int16 else a.astype(np.float64)
    return x[:, None] if x.ndim == 1 else x


def audio_figure(records: Sequence[np.ndarray], titles: Sequence[str], rate: int, out: Path) -> Path:
    """Write one PNG with, per record, its waveform (left) and spectrogram (right); ``MissingExtraError``
    without matplotlib."""
    import_extra("matplotlib", "viz", needed_by="shardkit show (audio plots)")
    from matplotlib.figure import Figure

    n = len(records)
    fig: Any = Figure(figsize=(11, 2.1 * n + 0.4), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False, width_ratios=[1, 1.3])
    for (wave_ax, spec_ax), record, title in zip(axes, records, titles):
        x = as_float(record)
        t = np.arange(x.shape[0]) / rate
        for c in range(x.shape[1]):
            wave_ax.plot(t, x[:, c], linewidth=0.6, label=f"channel {c}" if x.shape[1] > 1 else None)
        wave_ax.set_xlim(0, t[-1] if t.size else 1)
        wave_ax.set_ylim(-1.05, 1.05)
        wave_ax.set_title(f"{title}: waveform", fontsize=9, loc="left")
        wave_ax.set_xlabel("seconds", fontsize=8)
        wave_ax.set_ylabel("amplitude", fontsize=8)
        if x.shape[1] > 1:
            wave_ax.legend(fontsize=7, loc="upper right")
        nfft = min(512, max(16, 1 << int(np.log2(max(16, rate // 40)))))
        with np.errstate(divide="ignore"):  # silent (zero-padded) stretches are -inf dB, drawn as the floor
            _, _, _, image = spec_ax.specgram(x.mean(axis=1), NFFT=nfft, Fs=rate, noverlap=nfft // 2,
                                              cmap="magma", scale="dB", vmin=-120)
        spec_ax.set_title(f"{title}: spectrogram", fontsize=9, loc="left")
        spec_ax.set_xlabel("seconds", fontsize=8)
        spec_ax.set_ylabel("Hz", fontsize=8)
        fig.colorbar(image, ax=spec_ax, label="dB", pad=0.01)
        for ax in (wave_ax, spec_ax):
            ax.tick_params(labelsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return out


def write_wav(record: np.ndarray, rate: int, path: Path) -> Path:
    """Write a record as a WAV file (int16 as 16-bit PCM, float32 as 32-bit float)."""
    import soundfile as sf

    a = np.asarray(record)
    subtype = "PCM_16" if a.dtype == np.int16 else "FLOAT"
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), a, int(rate), subtype=subtype)
    return path
