"""``shardkit info``: what a dataset holds."""

from __future__ import annotations

import json

import typer

from shardkit.cli.app import app
from shardkit.formats import open_dataset
from shardkit.units import human_bytes


@app.command()
def info(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
) -> None:
    """Summarise a dataset: records, record shape and dtype, shards, bytes, labels, kind."""
    with open_dataset(path) as ds:
        data = ds.info()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    lines = [
        f"dataset      {data['path']}",
        f"kind         {data['kind']}  (format {data['format']}, {data['created_by']})",
        f"records      {data['records']}",
        f"{data['payload']:<12} {tuple(data['shape'])} {data['dtype']}  ({human_bytes(data['record_bytes'])} each)",
        f"shards       {data['shards']} x {data['records_per_shard']} records, {human_bytes(data['bytes'])} total",
        f"compression  {data['compression']['name'] if data['compression'] else 'none'}",
    ]
    for name, spec in data["fields"].items():
        lines.append(f"field        {name} {tuple(spec['shape'])} {spec['dtype']}")
    for name, names in data["labels"].items():
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} total)" if len(names) > 10 else "")
        lines.append(f"labels       {name}: {shown}")
    if data["skipped"]:
        lines.append(f"skipped      {data['skipped']} inputs (see --json or the metadata for reasons)")
    if data["transform"]:
        lines.append(f"transform    {json.dumps(data['transform'])}")
    typer.echo("\n".join(lines))
