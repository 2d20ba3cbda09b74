"""``shardkit show``: a contact sheet (images, boxes drawn) or waveform and spectrogram plots (audio)."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit._extras import pip_install
from shardkit.cli.app import app, echo_out, help_text
from shardkit.cli.selection import keys_option, selection_option

__all__ = ["show"]

@app.command(help=help_text(
    "Look at records: a contact sheet of images with key, class and COCO boxes, or a waveform and a spectrogram "
    f"per audio record (needs the viz extra: {pip_install('viz')})."
))
def show(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    output: Path = typer.Option(None, "-o", "--output", metavar="PNG",
                                help="Image to write (default <dataset name>-show.png here)."),
    keys: str = selection_option("keys"),
    random: int = selection_option("random"),
    seed: int = selection_option("seed"),
    label: str = selection_option("label"),
    limit: int = selection_option("limit"),
    columns: int = typer.Option(None, "--columns", metavar="N", help="Frames per row of a contact sheet."),
    wav: Path = typer.Option(None, "--wav", metavar="DIR", help="Audio: also write each record as a WAV file here."),
) -> None:
    """Look at records (the help text, in the decorator, names the extra it needs)."""
    from shardkit.viz import show as run_show

    result = run_show(path, output, keys=keys_option(keys), random=random, seed=seed, label=label, limit=limit,
                      columns=columns, wav_dir=wav, naming="cli")
    echo_out(f"wrote {result.path} ({len(result.keys)} records: {', '.join(map(str, result.keys))})")
    for w in result.wavs:
        echo_out(f"wrote {w}")
