"""``shardkit verify``: check every shard against the metadata; exit 1 naming what is wrong."""

from __future__ import annotations

import typer

from shardkit.cli.app import app, echo_err, echo_out
from shardkit.formats import verify as verify_dataset
from shardkit.units import human_bytes, human_count


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
    # IEC units as everywhere in shardkit: tqdm scales by 1024 and prints the prefix before the unit "iB".
    with tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc="verify", disable=None,
              leave=False) as bar:
        report = verify_dataset(path, quick=quick, progress=bar.update)
    for note in report.limitations:
        echo_err(f"note: {note}")
    for problem in report.problems:
        echo_err(f"FAILED {problem}")
    for note in report.unfinished:
        echo_err(f"note: {note}")
    mode = "quick" if quick else "full"
    if not report.ok:
        echo_err(
            f"{report.path}: {len(report.problems)} problem(s) in {human_count(report.shards_checked, 'shard')} and "
            f"{human_count(report.files_checked, 'other file')} ({mode})"
        )
        raise typer.Exit(1)
    echo_out(
        f"{report.path}: OK, {human_count(report.shards_checked, 'shard')} and {human_count(report.files_checked, 'other file')} "
        f"(format {report.format}, {mode}" + (f", {human_bytes(report.bytes_checked)} checksummed)" if not quick else ")")
    )
