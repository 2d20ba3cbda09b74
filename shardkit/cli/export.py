"""``shardkit export``: records written back as PNG (images) or WAV (audio) files."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app
from shardkit.cli.show import KEYS_HELP, LABEL_HELP, RANDOM_HELP, keys_option

__all__ = ["export"]


@app.command()
def export(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    output: Path = typer.Option(..., "-o", "--output", metavar="DIR", help="Directory for the files."),
    keys: str = typer.Option(None, "--keys", metavar="KEYS", help=KEYS_HELP),
    random: int = typer.Option(None, "--random", metavar="N", help=RANDOM_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of --random, an integer in [0, 2**64)."),
    label: str = typer.Option(None, "--label", metavar="NAME", help=LABEL_HELP),
    limit: int = typer.Option(16, "--limit", metavar="N", help="Records when neither --keys nor --random is given."),
) -> None:
    """Write records as files, exactly as stored: images as PNG, audio as WAV at the dataset's rate."""
    from shardkit.viz import export as run_export

    for p in run_export(path, output, keys=keys_option(keys), random=random, seed=seed, label=label, limit=limit,
                        naming="cli"):
        typer.echo(f"wrote {p}")
