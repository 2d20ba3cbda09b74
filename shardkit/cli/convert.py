"""``shardkit convert``: turn a raw corpus into a dataset, with a progress bar and a summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from shardkit.cli.app import app, echo_err, setup_logging
from shardkit.errors import ConfigError
from shardkit.units import human_bytes, parse_bytes


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Corpus: COCO root (or instances_*.json), class folders, CIFAR batches, audio folders."),
    output: Path = typer.Option(..., "-o", "--output", help="Output dataset directory."),
    kind: str | None = typer.Option(None, "--kind", help="coco, imagefolder, cifar10, cifar100 or audio (default: detect)."),
    split: str | None = typer.Option(None, "--split", help="Split to convert (train, val, test, ...; default train or the only one)."),
    size: str | None = typer.Option(None, "--size", help="Image frame H or HxW (default 224; CIFAR: native 32)."),
    resize: str | None = typer.Option(None, "--resize", help="shorter (cover the frame) or longer (fit inside)."),
    crop: str | None = typer.Option(None, "--crop", help="center (centre, cut/pad both sides) or pad (keep all, pad right/bottom)."),
    interpolation: str | None = typer.Option(None, "--interpolation", help="nearest, box, bilinear, hamming, bicubic, lanczos."),
    max_boxes: int | None = typer.Option(None, "--max-boxes", help="COCO: boxes kept per image (default 100)."),
    image_dir: Path | None = typer.Option(None, "--image-dir", help="COCO: image folder (default <split>/ or images/<split>/)."),
    sample_rate: int | None = typer.Option(None, "--sample-rate", help="Audio: output rate in Hz (default 16000)."),
    duration: float | None = typer.Option(None, "--duration", help="Audio: record length in seconds (default 1.0)."),
    channels: int | None = typer.Option(None, "--channels", help="Audio: 1 mixes to mono (default); C keeps C channels."),
    window: bool = typer.Option(False, "--window", help="Audio: cut long files into several records instead of trimming."),
    dtype: str | None = typer.Option(None, "--dtype", help="Audio: int16 (default) or float32."),
    workers: int | None = typer.Option(None, "--workers", "-j", help="Decode processes (default: cores). Output does not depend on it."),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first bad input instead of skipping it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output (default: resume or refuse)."),
    compression: str | None = typer.Option(None, "--compression", help="Per-record codec: zstd, gzip, blosc-lz4 (default none)."),
    shard_size: str | None = typer.Option(None, "--shard-size", help="Target shard file size, e.g. 256MiB (default)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every skipped input."),
) -> None:
    """Convert a corpus into a dataset; resumable, deterministic whatever --workers."""
    from tqdm import tqdm

    from shardkit.converters import convert as run_convert
    from shardkit.converters import detect_kind

    setup_logging(verbose)
    options: dict[str, Any] = {
        "split": split,
        "size": size,
        "resize": resize,
        "crop": crop,
        "interpolation": interpolation,
        "max_boxes": max_boxes,
        "image_dir": str(image_dir) if image_dir else None,
        "sample_rate": sample_rate,
        "duration": duration,
        "channels": channels,
        "window": True if window else None,
        "dtype": dtype,
    }
    options = {k: v for k, v in options.items() if v is not None}
    if compression is not None and compression.lower() == "none":
        compression = None
    kind = kind or detect_kind(src)
    extra: dict[str, Any] = {}
    if shard_size is not None:
        extra["shard_bytes"] = parse_bytes(shard_size, what="--shard-size")
        if extra["shard_bytes"] <= 0:
            raise ConfigError(f"--shard-size: expected a positive size, found {shard_size!r}")
    unit = "file" if kind == "audio" else "img"
    bar: Any = None

    def progress(done: int, total: int, records: int) -> None:
        nonlocal bar
        if quiet:
            return
        if bar is None:
            bar = tqdm(total=total, initial=done, unit=unit, desc=f"convert {kind}", dynamic_ncols=True, smoothing=0.1)
            return
        bar.update(done - bar.n)

    t0 = time.perf_counter()
    try:
        summary = run_convert(
            src, output, kind, workers=workers, strict=strict, overwrite=overwrite,
            compression=compression, progress=progress, **extra, **options,
        )
    finally:
        if bar is not None:
            bar.close()
    if summary.already_complete:
        typer.echo(f"{summary.output}: already converted with the same parameters ({summary.records} records); nothing to do")
        return
    elapsed = max(summary.seconds, time.perf_counter() - t0)
    lines = [
        f"wrote        {summary.records} records to {summary.output}"
        + (f" ({summary.records - summary.records_this_run} from a previous run)" if summary.records != summary.records_this_run else ""),
        f"skipped      {summary.num_skipped}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in summary.skipped.items()) + ")" if summary.skipped else ""),
        f"bytes        {human_bytes(summary.bytes)}",
        f"time         {elapsed:.1f} s, {summary.records_this_run / elapsed if elapsed else 0:.1f} records/s",
    ]
    for k, v in summary.notes.items():
        lines.append(f"note         {k}: {v}")
    typer.echo("\n".join(lines))
    if summary.skipped and not verbose:
        echo_err(
            f"{summary.num_skipped} inputs skipped; run with --verbose to list them, or read "
            f"attributes.shardkit.skipped in {summary.output}/zarr.json"
        )
