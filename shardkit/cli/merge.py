"""``shardkit merge``: one dataset from several datasets of the same schema."""

from __future__ import annotations

import typer

from shardkit.cli.app import app, echo_out, setup_logging
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS
from shardkit.units import human_bytes, parse_count


@app.command()
def merge(
    inputs: list[str] = typer.Argument(..., metavar="DATASET...", help=(
        "Datasets to merge, in this order: directories or URLs (s3://bucket/ds, gs://, az://).")),
    output: str = typer.Option(..., "-o", "--output", metavar="PATH", help="The new dataset: a directory or a URL."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a shardkit dataset at the output."),
    keep_versions: str = typer.Option(str(DEFAULT_KEEP_VERSIONS), "--keep-versions", metavar="N",
                                      help="Older versions kept openable after later appends."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log what is linked and re-packed."),
) -> None:
    """Merge datasets of one schema into a new dataset: their records in order, label names extended.

    Shards that land on the new shard grid unchanged are hard-linked (server-side copied on object
    stores), so their bytes never pass through this machine; the others are re-packed.
    """
    from shardkit.converters.merging import merge as run_merge

    setup_logging(verbose)
    keep = parse_count(keep_versions, what="--keep-versions")
    report = run_merge(inputs, output, overwrite=overwrite, keep_versions=keep)
    if report.already_committed:
        echo_out(f"{output}: already the merge of these datasets ({report.meta.num_records} records); nothing to do")
        return
    echo_out("\n".join([
        f"merged       {len(inputs)} datasets, {report.meta.num_records} records, into {output}",
        f"shards       {report.shards_linked} linked ({human_bytes(report.bytes_linked)}, no bytes copied), "
        f"{report.shards_repacked} re-packed ({human_bytes(report.bytes_repacked)})",
        "labels       " + ", ".join(f"{k}: {len(v)} names" for k, v in report.meta.labels.items()),
        f"time         {report.seconds:.1f} s",
    ]))
