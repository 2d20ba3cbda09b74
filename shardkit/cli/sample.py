"""``shardkit sample``: run the tiered sampler over a dataset and report what it cost."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer

from shardkit.cli.app import app, echo_err, echo_out
from shardkit.cli.options import options_command
from shardkit.errors import ConfigError
from shardkit.readers import SamplerOptions, SamplerStats, TieredSampler
from shardkit.readers.sources import DATASET_FIELD, source_of
from shardkit.units import human_bytes


@app.command()
@options_command(SamplerOptions)
def sample(
    paths: list[str] = typer.Argument(
        ..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://); several for a mixture "
                  "(see --weights)."),
    weights: str = typer.Option(
        None, "--weights",
        help="Mix the datasets with these relative weights, comma-separated (3,1): every epoch holds exactly the "
             "largest-remainder rounding of each share, every record once before any twice, in a uniformly "
             "random arrangement. Default with several datasets: their sizes.",
    ),
    epoch_size: str = typer.Option(
        None, "--epoch-size", help="Records per epoch of a mixture (10000, 10k; default: the sum of the sizes).",
    ),
    order_out: Path = typer.Option(
        None, "--order-out",
        help="Write the emitted keys as .npy int64: shape (epochs, records) in epoch/sequential mode (this "
             "consumer's keys), one flat row in replacement mode; (epochs, records, 2) (dataset index, key) for "
             "a mixture.",
    ),
    *,
    options: SamplerOptions,
) -> None:
    """Sample batches like a training job would, with a progress bar and a throughput summary."""
    from tqdm import tqdm

    if order_out is not None and order_out.suffix != ".npy":
        raise ConfigError(f"--order-out: expected a file name ending in .npy, found {str(order_out)!r}")
    sampler = TieredSampler(source_of(paths, weights, epoch_size, source="cli"), options)
    total = len(sampler) * options.epochs if options.epochs is not None and options.limit is None else None
    keys: list[np.ndarray] = []
    epoch_of: list[int] = []
    with sampler, tqdm(total=total, unit="batch", desc="sample", dynamic_ncols=True) as bar:
        for batch in sampler:
            k = batch["key"]
            keys.append(k if sampler.mixture is None else np.stack([batch[DATASET_FIELD], k], axis=1))
            epoch_of.append(sampler.epoch)
            bar.update(1)
    if order_out is not None:
        flat = np.concatenate(keys) if keys else np.empty(0, dtype=np.int64)
        arr = flat[None, :] if options.mode == "replacement" else _by_epoch(keys, epoch_of)
        order_out.parent.mkdir(parents=True, exist_ok=True)
        np.save(order_out, arr.astype(np.int64))
    echo_out("\n".join(summary(sampler)))
    if order_out is not None:
        echo_err(f"wrote {order_out}")


def summary(sampler: TieredSampler) -> list[str]:
    """The lines ``shardkit sample`` prints: what was delivered, what each tier cost, and why reads
    can exceed deliveries."""
    st: SamplerStats = sampler.stats
    lines = [
        *(_mixture_lines(sampler) if sampler.mixture is not None else []),
        *sampler.memory_plan.describe(),
        *sampler.remote_cache.describe(),
        f"records      {st.records} in {st.batches} batches, {st.elapsed:.2f} s",
        f"throughput   {st.records_per_s:,.0f} records/s, {st.bytes_per_s / 2**20:,.1f} MiB/s",
        f"delivered    {human_bytes(st.bytes)} of payload",
    ]
    if sampler.node is not None:
        lines.append(f"node         {sampler.node} of {sampler.options.nodes}, pinning {sampler.pinned_keys.size} records")
    remote = isinstance(sampler.path, str)
    for name, t in st.tiers.items():
        if ((name == "ssd" and "ssd" not in sampler.tiers) or (name == "cache" and not sampler.pinned_keys.size)
                or (name == "remote_cache" and not (remote and sampler.options.cache_dir))):
            continue
        if name == "node":
            if t.read_calls:
                lines.append(f"{name:<12} {human_bytes(t.bytes_read)} read from the node cache on local disk "
                             f"in {t.read_calls} calls ({t.records} records)")  # fmt: skip
            continue
        shown = {"disk": "remote", "remote_cache": "local cache"}.get(name, name) if remote else name
        if name == "cache":
            lines.append(f"{shown:<12} {human_bytes(t.bytes_read)} served from RAM ({t.records} records)")
            continue
        what = {"ram": "delivered", "remote_cache": "read locally"}.get(name, "read")
        calls = "requests" if remote and name == "disk" else "calls"
        lines.append(f"{shown:<12} {human_bytes(t.bytes_read)} {what} in {t.read_calls} {calls} ({t.records} records)")
    if st.disk_bytes_by_epoch:
        calls = "requests" if remote else "calls"
        per = ", ".join(f"{e}: {human_bytes(b)} in {st.disk_requests_by_epoch.get(e, 0)} {calls}"
                        for e, b in sorted(st.disk_bytes_by_epoch.items()))
        lines.append(f"remote/epoch {per}" if remote else f"disk/epoch   {per}")
    if st.download_parts:
        lines.append(f"download     {human_bytes(st.download_bytes)} into the local cache in {st.download_parts} parts; "
                     f"readers waited {st.download_wait_seconds:.2f} s, fetch threads' CPU {st.download_cpu_seconds:.2f} s")
    if "ssd" in sampler.tiers:
        lines.append(f"ssd written  {human_bytes(st.ssd_bytes_written)}")
    lines.append(f"stall        {st.stall_seconds:.2f} s waiting for batches")
    extra = st.disk.bytes_read - st.disk.records * sampler.record_nbytes
    if sampler.mixture is not None and any(c > n for c, n in zip(sampler.mixture.counts, sampler.mixture.sizes)):
        lines.append("note         a record that occurs more than once in a block is read once and copied")
    if extra > 0:
        name = "remote_gap_bytes" if remote else "gap_bytes"
        gap, option = sampler.options.value(name), SamplerOptions.spell(name, "cli")
        why = "each shard's index, read once per pass"
        if gap:
            why += (f", and gaps of up to {human_bytes(gap)} between wanted records, read rather than skipped "
                    f"so requests stay large and sequential ({option} sets the limit)")
        lines.append(f"note         {'remote' if remote else 'disk'} reads exceed the records' own bytes by "
                     f"{human_bytes(extra)}: {why}")
    return lines


def _mixture_lines(sampler: TieredSampler) -> list[str]:
    """What a mixture's epoch holds: each dataset's weight and records per epoch."""
    m = sampler.mixture
    assert m is not None
    lines = [f"mixture      {m.epoch_size} records per epoch from {len(m.paths)} datasets"]
    for i, (p, w, c, n) in enumerate(zip(m.paths, m.weights, m.counts, m.sizes)):
        lines.append(f"  dataset {i}   {p}: weight {w}, {c} of its {n} records per epoch")
    return lines


def _by_epoch(keys: list[np.ndarray], epoch_of: list[int]) -> np.ndarray:
    """Rows per epoch (``[epochs, records]``, or ``[epochs, records, 2]`` for a mixture's (dataset,
    key) pairs); a row cut short by --limit is padded with -1."""
    rows: dict[int, list[np.ndarray]] = {}
    for k, e in zip(keys, epoch_of):
        rows.setdefault(e, []).append(k)
    joined = [np.concatenate(rows[e]) for e in sorted(rows)]
    width = max((r.shape[0] for r in joined), default=0)
    tail = joined[0].shape[1:] if joined else ()
    out = np.full((len(joined), width, *tail), -1, dtype=np.int64)
    for i, r in enumerate(joined):
        out[i, : r.shape[0]] = r
    return out
