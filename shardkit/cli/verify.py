"""``shardkit verify``: check every shard against the metadata; exit 1 naming what is wrong."""

from __future__ import annotations

import typer

from shardkit.cli.app import app, echo_err
from shardkit.formats import verify as verify_dataset


@app.command()
def verify(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    quick: bool = typer.Option(
        False, "--quick", help="Only metadata, file sizes and shard indexes (no content checksums)."
    ),
) -> None:
    """Check every file against the metadata: shard sizes, indexes and checksums, field chunks, documents."""
    from tqdm import tqdm

    from shardkit.formats import open_dataset

    with open_dataset(path) as ds:
        total = ds.meta.payload_nbytes
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=None, leave=False) as bar:
        report = verify_dataset(path, quick=quick, progress=bar.update)
    for note in report.limitations:
        echo_err(f"note: {note}")
    for problem in report.problems:
        echo_err(f"FAILED {problem}")
    mode = "quick" if quick else "full"
    if not report.ok:
        echo_err(
            f"{report.path}: {len(report.problems)} problem(s) in {report.shards_checked} shards and "
            f"{report.files_checked} other files ({mode})"
        )
        raise typer.Exit(1)
    typer.echo(
        f"{report.path}: OK, {report.shards_checked} shards and {report.files_checked} other files "
        f"(format {report.format}, {mode}" + (f", {report.bytes_checked / 1e6:.1f} MB checksummed)" if not quick else ")")
    )
