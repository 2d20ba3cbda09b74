"""``shardkit publish``: upload a local dataset to an object store, with progress and verification."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app, echo_out, setup_logging
from shardkit.errors import ConfigError
from shardkit.units import human_bytes, human_count


@app.command()
def publish(
    path: str = typer.Argument(..., metavar="DIR", help="The local dataset directory to upload."),
    url: str = typer.Argument(..., metavar="URL", help="Where to publish it: s3://bucket/ds, gs://bucket/ds, az://container/ds."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a different shardkit dataset already at URL."),
    check: str = typer.Option("quick", "--verify", metavar="quick|full", help=(
        "How the upload is verified: quick (every object's size and recorded crc32c against the metadata, "
        "every shard index read back) or full (also every byte read back and checksummed).")),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every file uploaded."),
) -> None:
    """Upload the dataset DIR to URL and verify it; the root document goes last, so readers see the
    whole dataset or none. Files already there (an interrupted publish) are not uploaded again."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from shardkit.formats import publish as run_publish
    from shardkit.formats.metadata import read_dataset_meta
    from shardkit.stores import is_url

    setup_logging(verbose)
    if check not in ("quick", "full"):
        raise ConfigError(f"--verify: expected quick or full, found {check!r}")
    full = check == "full"
    total = None
    if not is_url(path):  # publish() refuses a URL with a clear message
        meta = read_dataset_meta(Path(path))
        total = sum(s.nbytes for s in meta.shards) + sum(d.nbytes for d in meta.files.values())
    with logging_redirect_tqdm(), tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc="publish",
                                       disable=True if quiet else None, leave=False) as bar:
        report = run_publish(path, url, overwrite=overwrite, full_verify=full, progress=bar.update)
    if report.already_published:
        echo_out(f"{report.url}: already published ({report.meta.num_records} records); verified, nothing uploaded")
        return
    mode = "every byte read back" if full else "sizes, checksums and indexes"
    echo_out("\n".join([
        f"published    {path} ({report.meta.num_records} records) to {report.url}",
        f"uploaded     {human_count(report.files, 'file')}, {human_bytes(report.nbytes)}"
        + (f" ({human_count(report.kept, 'file')} already there)" if report.kept else ""),
        f"verified     {human_count(report.verified.shards_checked, 'shard')} and "
        f"{human_count(report.verified.files_checked, 'other file')} ({mode})",
    ]))
