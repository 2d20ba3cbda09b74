"""``shardkit merge``: one dataset from several datasets of the same schema."""

from __future__ import annotations

import typer

from shardkit.cli.app import app, echo_out, setup_logging
from shardkit.formats.commit import CommitReport
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

    Shards that land on the new shard grid unchanged are hard-linked (server-side copied inside one
    bucket), so their bytes never pass through this machine; the others are re-packed. The summary
    says which, and how many bytes were uploaded to an object-store output.
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
        f"shards       {shard_ways(report)}",
        *([f"uploaded     {human_bytes(report.bytes_uploaded)}"] if report.remote else []),
        "labels       " + ", ".join(f"{k}: {len(v)} names" for k, v in report.meta.labels.items()),
        f"time         {report.seconds:.1f} s",
    ]))


#: How a shard taken unchanged from an input got to the output, for people (``CommitReport.linked_by``).
_WAYS = {
    "link": "linked ({}, no bytes copied)",
    "copy": "copied ({}; no hard link possible across file systems)",
    "server": "copied by the server ({}, not through this machine)",
    "transfer": "uploaded ({})",
    "kept": "already there from an interrupted run ({})",
}


def shard_ways(report: CommitReport) -> str:
    """How the new shards of a commit were made, saying "linked" only for hard links and "uploaded"
    for bytes that went to an object store: ``3 linked (1.2 MiB, no bytes copied), 1 re-packed (4 KiB)``."""
    parts = [f"{report.shards_in_place} in place"] if report.shards_in_place else []
    parts += [f"{n} " + _WAYS[how].format(human_bytes(report.bytes_linked_by.get(how, 0)))
              for how, n in report.linked_by.items() if n]
    repacked = "re-packed and uploaded" if report.remote else "re-packed"
    parts.append(f"{report.shards_repacked} {repacked} ({human_bytes(report.bytes_repacked)})")
    return ", ".join(parts)
