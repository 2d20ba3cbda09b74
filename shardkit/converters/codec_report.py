"""What a per-record codec does to a corpus: the PSNR (images) or SNR (audio) of a lossy codec on a sample of records (stored in
the dataset's metadata so ``info`` shows it next to the ratio), and ``--compression auto``, which picks a
lossless codec and tells the user the size every image option would have given (docs/design.md §5).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from shardkit.converters.base import Converter, ScanResult
from shardkit.errors import ShardkitError
from shardkit.formats import DatasetMeta
from shardkit.formats.codecs import RecordCodec, get_codec
from shardkit.formats.spec import index_nbytes
from shardkit.units import human_bytes

__all__ = ["SAMPLE_RECORDS", "sample_records", "codec_sample", "auto_codec", "compression_lines", "compression_summary", "IMAGE_OPTIONS"]

logger = logging.getLogger(__name__)

#: Records (one per input, spread over the corpus) a quality sample decodes.
SAMPLE_RECORDS = 32
#: What ``--compression auto`` measures on images (lossless ones are the candidates it picks from).
IMAGE_OPTIONS = ("jpeg:90", "webp:90", "jpegxl:90", "png", "webp:lossless", "jpegxl:lossless", "zstd")
#: Lossless options auto shows but does not pick: libjxl's lossless encoder takes seconds per 224x224
#: image on this class of machine (docs/design.md §5), too slow to pick without the user asking.
SLOW_ENCODERS = ("jpegxl:lossless",)
#: Lossy audio options auto shows beside the lossless ones (never picked).
AUDIO_LOSSY = ("opus", "vorbis")
#: The source metadata key of the quality sample.
SAMPLE_KEY = "compression_sample"


def sample_records(conv: Converter, scan: ScanResult, n: int = SAMPLE_RECORDS) -> np.ndarray:
    """The first record of up to ``n`` inputs spread evenly over the corpus, ``[k, *record]`` (inputs the
    decoder skips are left out; the conversion reports those)."""
    items = scan.items
    picks = sorted({int(i) for i in np.linspace(0, len(items) - 1, num=min(n, len(items)))}) if items else []
    decoder = conv.decoder
    out: list[np.ndarray] = []
    for i in picks:
        try:
            decoded = decoder.decode(items[i])
        except ShardkitError:
            continue
        if decoded.records:
            out.append(np.ascontiguousarray(decoded.records[0][conv.payload]))
    spec = conv.record_spec()
    return np.stack(out) if out else np.empty((0, *spec.shape), dtype=spec.dtype)


def _psnr(a: np.ndarray, b: np.ndarray, peak: float) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _snr(a: np.ndarray, b: np.ndarray) -> float:
    """Signal-to-noise ratio of ``b`` against ``a`` in dB (NaN for a silent record: no signal to compare)."""
    x = a.astype(np.float64)
    signal = float(np.sum(x * x))
    noise = float(np.sum((x - b.astype(np.float64)) ** 2))
    return math.nan if signal == 0 else math.inf if noise == 0 else 10 * math.log10(signal / noise)


def codec_sample(codec: RecordCodec, records: np.ndarray) -> dict[str, Any]:
    """Encode and decode ``records`` with ``codec``: their count, stored/decoded ratio, and the mean and
    lowest quality in dB, ``psnr_db``/``min_psnr_db`` (images) or ``snr_db``/``min_snr_db`` (audio: the
    codec's :attr:`~RecordCodec.quality_measure`; silent records have no SNR and are left out); the
    quality is ``None`` when every record came back exactly."""
    if not len(records):
        return {"records": 0}
    stored = 0
    scores: list[float] = []
    snr = codec.quality_measure == "snr"
    peak = float(np.iinfo(records.dtype).max) if records.dtype.kind in "ui" else 1.0
    out = np.empty_like(records[0])
    for rec in records:
        blob = codec.encode(rec)
        stored += len(blob)
        codec.decode(blob, out)
        scores.append(_snr(rec, out) if snr else _psnr(rec, out, peak))
    finite = [s for s in scores if math.isfinite(s)]
    key = "snr_db" if snr else "psnr_db"
    return {
        "records": len(records),
        "ratio": round(records.nbytes / max(1, stored), 3),
        key: round(float(np.mean(finite)), 2) if finite else None,
        f"min_{key}": round(min(finite), 2) if finite else None,
    }


def _quality_text(sample: dict[str, Any]) -> str | None:
    """``PSNR 39.3 dB (lowest 34.4)`` / ``SNR ...`` of a :func:`codec_sample`, ``None`` when lossless."""
    for key, label in (("psnr_db", "PSNR"), ("snr_db", "SNR")):
        if sample.get(key) is not None:
            return f"{label} {sample[key]} dB (lowest {sample[f'min_{key}']})"
    return None


def auto_codec(conv: Converter, scan: ScanResult) -> tuple[RecordCodec | None, list[str]]:
    """``--compression auto``: audio gets flac (int16) or zstd; images the smallest lossless option on a
    sample (no quality is lost without the user asking); the lines say what every option would give
    (for audio also opus and vorbis at their default settings, with their SNR)."""
    spec = conv.record_spec()
    records = sample_records(conv, scan)
    is_image = spec.dtype == "uint8" and len(spec.shape) == 3 and spec.shape[2] in (1, 3, 4)
    names = IMAGE_OPTIONS if is_image else (("flac", "zstd") if spec.dtype == "int16" else ("zstd",)) + AUDIO_LOSSY
    lines: list[str] = []
    best: tuple[float, RecordCodec] | None = None
    raw = max(1, records.nbytes) * max(1, len(scan.items)) / max(1, len(records))
    for name in names:
        codec = get_codec(name)
        assert codec is not None
        try:
            codec = codec.for_records(conv.transform())
            codec.check_record(spec.shape, spec.dtype, str(conv.src))
        except ShardkitError:
            continue  # not for these records (opus at 44.1 kHz, jpeg for audio, ...)
        s = codec_sample(codec, records)
        ratio = float(s.get("ratio") or 1.0)
        quality = _quality_text(s)
        lines.append(f"{name:<16} {ratio:5.2f}x  about {human_bytes(int(raw / ratio))}  {quality or 'lossless'}")
        if quality is None and name not in SLOW_ENCODERS and (best is None or ratio > best[0]):
            best = (ratio, codec)
    chosen = None if best is None else best[1]
    lines.append(f"auto chose {chosen.to_json() if chosen else 'none'} (the smallest fast lossless option; "
                 f"pass --compression NAME for another)")
    return chosen, lines


def compression_summary(meta: DatasetMeta) -> dict[str, Any] | None:
    """The dataset's codec, its achieved ratio (decoded / stored record bytes) and, for a lossy codec,
    the PSNR (images) or SNR (audio) measured on a sample at conversion (``info --json``'s
    ``compression_report``); ``None`` for a dataset stored decoded."""
    if meta.compression is None:
        return None
    decoded = meta.num_records * meta.record.nbytes
    stored = sum(max(0, s.nbytes - index_nbytes(meta.records_per_shard)) for s in meta.shards)
    sample = meta.source.get(SAMPLE_KEY)
    if not isinstance(sample, dict) or (sample.get("psnr_db") is None and sample.get("snr_db") is None):
        sample = {}  # lossless, or converted before samples were kept
    return {
        "codec": dict(meta.compression),
        "stored_bytes": stored,
        "decoded_bytes": decoded,
        "ratio": round(decoded / stored, 2) if stored else None,
        "psnr_db": sample.get("psnr_db"),
        "min_psnr_db": sample.get("min_psnr_db"),
        "snr_db": sample.get("snr_db"),
        "min_snr_db": sample.get("min_snr_db"),
        "sampled_records": sample.get("records"),
    }


def compression_lines(meta: DatasetMeta) -> list[str]:
    """The dataset's codec, achieved ratio (decoded / stored record bytes) and, for a lossy codec, the
    PSNR measured on a sample at conversion (what ``convert`` and ``info`` print)."""
    summary = compression_summary(meta)
    if summary is None or meta.compression is None:
        return ["compression  none"]
    config = ", ".join(f"{k}={v}" for k, v in meta.compression.items() if k != "name")
    decoded, stored = summary["decoded_bytes"], summary["stored_bytes"]
    ratio = f"{decoded / stored:.2f}x ({human_bytes(stored)} stored for {human_bytes(decoded)} decoded)" if stored else "no records"
    lines = [f"compression  {meta.compression['name']}" + (f" ({config})" if config else "") + f": {ratio}"]
    for key, label in (("psnr_db", "PSNR"), ("snr_db", "SNR")):
        if summary[key] is not None:
            lines.append(f"quality      {label} {summary[key]} dB on average, lowest {summary[f'min_{key}']} dB, "
                         f"over {summary['sampled_records']} sampled records")
    return lines
