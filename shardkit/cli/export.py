"""``shardkit export``: records written back as PNG (images) or WAV (audio) files."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app, echo_out
from shardkit.cli.selection import keys_option, selection_option

__all__ = ["export"]


@app.command()
def export(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    output: Path = typer.Option(..., "-o", "--output", metavar="DIR", help="Directory for the files."),
    keys: str = selection_option("keys"),
    random: int = selection_option("random"),
    seed: int = selection_option("seed"),
    label: str = selection_option("label"),
    limit: int = selection_option("limit"),
) -> None:
    """Write records as files, exactly as stored: images as PNG, audio as WAV at the dataset's rate."""
    from shardkit.viz import export as run_export

    for p in run_export(path, output, keys=keys_option(keys), random=random, seed=seed, label=label, limit=limit,
                        naming="cli"):
        echo_out(f"wrote {p}")
