"""``shardkit show``: a contact sheet (images, boxes drawn) or waveform and spectrogram plots (audio)."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app

__all__ = ["show", "KEYS_HELP"]

KEYS_HELP = "Records by key: 3,10-12,40 (at most 256)."
RANDOM_HELP = "Pick N records uniformly at random, without replacement (seeded by --seed)."
LABEL_HELP = "Only records of this class (by name), the first ones unless --random."


def keys_option(text: str | None) -> list[int] | None:
    """``--keys`` parsed (``None`` when not given)."""
    from shardkit.viz import parse_keys

    return None if text is None else parse_keys(text, what="--keys")


@app.command()
def show(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    output: Path = typer.Option(None, "-o", "--output", metavar="PNG",
                                help="Image to write (default <dataset name>-show.png here)."),
    keys: str = typer.Option(None, "--keys", metavar="KEYS", help=KEYS_HELP),
    random: int = typer.Option(None, "--random", metavar="N", help=RANDOM_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of --random, an integer in [0, 2**64)."),
    label: str = typer.Option(None, "--label", metavar="NAME", help=LABEL_HELP),
    limit: int = typer.Option(16, "--limit", metavar="N", help="Records when neither --keys nor --random is given."),
    columns: int = typer.Option(None, "--columns", metavar="N", help="Frames per row of a contact sheet."),
    wav: Path = typer.Option(None, "--wav", metavar="DIR", help="Audio: also write each record as a WAV file here."),
) -> None:
    """Look at records: a contact sheet of images with key, class and COCO boxes, or a waveform and a
    spectrogram per audio record (needs the viz extra: pip install "shardkit[viz]")."""
    from shardkit.viz import show as run_show

    result = run_show(path, output, keys=keys_option(keys), random=random, seed=seed, label=label, limit=limit,
                      columns=columns, wav_dir=wav, naming="cli")
    typer.echo(f"wrote {result.path} ({len(result.keys)} records: {', '.join(map(str, result.keys))})")
    for w in result.wavs:
        typer.echo(f"wrote {w}")
