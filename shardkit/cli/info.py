"""``shardkit info``: what a dataset holds."""

from __future__ import annotations

import json
import time
from typing import Any

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
    lines += _history_lines(data)
    typer.echo("\n".join(lines))


def _history_lines(data: dict[str, Any]) -> list[str]:
    """The dataset's versions (those kept openable marked) and what each one added, part by part."""
    kept = {v["version"]: v for v in data["versions"]}
    lines = []
    if data["history"] or kept:
        lines.append(f"version      {data['version']}" + (f" (kept: {', '.join(map(str, sorted(kept)))})" if kept else ""))
    for entry in data["history"]:
        if not isinstance(entry, dict):
            continue
        number = entry.get("version")
        start, stop = (entry.get("records") or [0, 0])[:2]
        when = kept.get(number, {}).get("committed")
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) if isinstance(when, (int, float)) else "pruned"
        source = entry.get("source")
        what = source.get("path") if isinstance(source, dict) else None
        if what is None and isinstance(entry.get("inputs"), list):
            what = ", ".join(map(str, entry["inputs"]))
        lines.append(f"  v{number:<4}     {entry.get('operation', '?'):<8} records {start}-{stop}  {stamp}  {what or ''}")
        parts = entry.get("parts")
        if isinstance(parts, list) and len(parts) > 1:
            shown = ", ".join(f"{p[0]}-{p[1]}:{p[2]}" for p in parts[:6] if isinstance(p, list) and len(p) == 3)
            lines.append(f"              {len(parts)} parts (inputs:records) {shown}{', ...' if len(parts) > 6 else ''}")
    return lines
