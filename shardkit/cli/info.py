"""``shardkit info``: what a dataset holds, and where any one of its records came from."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import typer

from shardkit.cli.app import app, echo_out
from shardkit.errors import ConfigError
from shardkit.formats import Dataset, open_dataset
from shardkit.formats.versions import unfinished
from shardkit.units import human_bytes, human_count

__all__ = ["info", "record_lines", "shard_line"]


def shard_line(shards: int, records: int, capacity: int) -> str:
    """``"3 shards, 49 records (capacity 20 per shard)"``: what the shard files hold."""
    return f"{human_count(shards, 'shard')}, {human_count(records, 'record')} (capacity {capacity} per shard)"


def _field_text(ds: Dataset, name: str, value: Any, boxes: int | None) -> str:
    """A field's value for a person: class names next to label ids, boxes without their padding rows."""
    value = np.asarray(value)
    if boxes is not None and value.ndim >= 1 and value.shape[0] == ds.meta.fields[name].shape[0] and name != "orig_size":
        value = value[:boxes]  # rows past num_boxes are padding
    names = ds.meta.labels.get(name)
    if names is not None and value.dtype.kind in "iu":
        def show(k: int) -> str:
            return f"{k} ({names[k]})" if 0 <= k < len(names) else str(k)

        text = show(int(value)) if value.ndim == 0 else "[" + ", ".join(show(int(k)) for k in value.reshape(-1)) + "]"
    elif value.dtype.kind == "f":
        text = str(np.round(value.astype(np.float64), 1).tolist())
    else:
        text = str(value.tolist())
    return text if len(text) <= 160 else text[:157] + "..."


def record_lines(ds: Dataset, key: int) -> list[str]:
    """Where record ``key`` came from, what was done to it, and its small fields."""
    from shardkit.converters.provenance import describe

    if not 0 <= key < ds.num_records:
        raise ConfigError(f"--record: expected a record key from 0 to {ds.num_records - 1}, found {key}")
    lines = [f"record       {key} of {ds.num_records}"]
    source = ds.source(key)
    if source is None:
        lines.append("source       not recorded (this dataset was written without provenance)")
    else:
        lines.append(f"source       {source.path}")
        part = f", record {source.values['part']} of it" if source.values.get("part") else ""
        lines.append(f"input        {source.input} (in the converter's input order{part})")
        for step in describe(ds.meta.payload, ds.meta.transform, source.values):
            lines.append(f"conversion   {step}")
    record = ds[key]
    boxes = int(record["num_boxes"]) if "num_boxes" in record and np.ndim(record["num_boxes"]) == 0 else None
    for name in ds.fields:
        lines.append(f"{name:<12} {_field_text(ds, name, record[name], boxes)}")
    return lines


@app.command()
def info(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    record: int | None = typer.Option(None, "--record", metavar="K",
                               help="Where record K came from, what conversion did to it, and its fields."),
) -> None:
    """Summarise a dataset: records, record shape and dtype, shards, bytes, labels, kind, what conversion changed."""
    from shardkit.converters.provenance import change_lines

    with open_dataset(path) as ds:
        if record is not None:
            if as_json:
                source = ds.source(record) if 0 <= record < ds.num_records else None
                echo_out(json.dumps({"record": record, "lines": record_lines(ds, record),
                                       "source": None if source is None else {
                                           "path": source.path, "name": source.name, "input": source.input,
                                           "values": source.values}}, indent=2))
            else:
                echo_out("\n".join(record_lines(ds, record)))
            return
        data = ds.info()
        data["unfinished"] = unfinished(ds.store)
        from shardkit.converters.codec_report import compression_lines, compression_summary  # only here: info stays quick to import

        compression = compression_lines(ds.meta)
        data["compression_report"] = compression_summary(ds.meta)
    if as_json:
        echo_out(json.dumps(data, indent=2))
        return
    lines = [
        f"dataset      {data['path']}",
        f"kind         {data['kind']}  (format {data['format']}, {data['created_by']})",
        f"records      {data['records']}",
        f"{data['payload']:<12} {tuple(data['shape'])} {data['dtype']}  ({human_bytes(data['record_bytes'])} each)",
        f"shards       {shard_line(data['shards'], data['records'], data['records_per_shard'])}, "
        f"{human_bytes(data['bytes'])} in all",
        *compression,
    ]
    for name, spec in data["fields"].items():
        lines.append(f"field        {name} {tuple(spec['shape'])} {spec['dtype']}")
    for name, names in data["labels"].items():
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} total)" if len(names) > 10 else "")
        lines.append(f"labels       {name}: {shown}")
    if data["skipped"]:
        lines.append(f"skipped      {data['skipped']} inputs (--json lists each with its reason)")
    for line in change_lines(data["changes"]):
        lines.append(f"changed      {line}")
    if data["transform"]:
        lines.append(f"transform    {json.dumps(data['transform'])}")
    if "provenance" in data:
        lines.append(f"provenance   {', '.join(data['provenance']['columns'])} of each record's source "
                     f"({data['provenance']['inputs']} inputs): shardkit info {data['path']} --record K")
    lines += _history_lines(data)
    lines += [f"unfinished   {note}" for note in data["unfinished"]]
    echo_out("\n".join(lines))


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
