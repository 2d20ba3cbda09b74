"""The sampler's options on the command line, declared once for ``shardkit sample`` and ``shardkit profile``.

Each flag's default is the library's (:data:`~shardkit.readers.DEFAULTS`), and its help is written
once here, so the two commands spell, default and explain the sampler alike (``shardkit serve`` has
options of the same names that mean other things: the ring's size, not a consumer's budget).
"""

from __future__ import annotations

from typing import Any

import typer

from shardkit.readers import DEFAULTS
from shardkit.units import human_bytes

__all__ = ["sampler_option", "SAMPLER_FLAGS"]

#: Each option's default (the library's), flag and help.
_DECLARED: dict[str, tuple[Any, str, str]] = {
    "tiers": (
        ",".join(DEFAULTS.tiers), "--tiers",
        "Tiers below the consumer: 'ram' or 'ram,ssd' (either order).",
    ),
    "ram_size": (
        str(DEFAULTS.ram_size), "--ram-size",
        "Everything this consumer's sampler holds in RAM, bytes (2GiB, 500MB) or records (10000records), at "
        "least two records: batch buffers for the blocks in flight, then a static cache of what is left "
        "(the whole dataset when it fits: later epochs read nothing). `shardkit sample` prints the split.",
    ),
    "ssd_size": (
        str(DEFAULTS.ssd_size), "--ssd-size",
        "SSD-tier budget (same syntax, at least --ram-size): two reservoirs of half of it. Only with "
        "--tiers ram,ssd.",
    ),
    "ssd_dir": (
        None, "--ssd-dir",
        "Directory for the run's private SSD reservoirs (default: the system temp dir).",
    ),
    "batch_size": (
        DEFAULTS.batch_size, "--batch-size",
        "Records per batch of this consumer.",
    ),
    "epochs": (
        DEFAULTS.epochs, "--epochs",
        "Epochs to run.",
    ),
    "seed": (
        DEFAULTS.seed, "--seed",
        "An integer in [0, 2**64); (seed, epoch) defines each epoch's order.",
    ),
    "mode": (
        DEFAULTS.mode, "--mode",
        "epoch: uniform random permutation per epoch; replacement: independent uniform reservoirs; "
        "sequential: storage order.",
    ),
    "rank": (
        DEFAULTS.rank, "--rank",
        "This consumer's index c (0 <= c < world size).",
    ),
    "world_size": (
        DEFAULTS.world_size, "--world-size",
        "Number of consumers W sharing each global batch.",
    ),
    "static_cache": (
        str(DEFAULTS.static_cache), "--static-cache",
        "The part of --ram-size that pins a random subset of records for the whole run, never evicted: "
        "auto (what the blocks do not need), bytes (256MiB), records (1000records), or 0 = off.",
    ),
    "permutation": (
        DEFAULTS.permutation, "--permutation",
        "Epoch order: exact (numpy permutation, 8 bytes a record), feistel (on-demand bijection, "
        "statistically uniform) or auto (exact up to 1e8 records).",
    ),
    "locality": (
        DEFAULTS.locality, "--locality/--no-locality",
        "Many nodes: each node pins a disjoint random part of the dataset (--static-cache in RAM, "
        "--node-cache on its disk) and the ranks take their keys of every global batch from their own "
        "node's cache where they can; every step keeps its set of records.",
    ),
    "nodes": (
        DEFAULTS.nodes, "--nodes",
        "Nodes M the ranks run on (with --locality).",
    ),
    "workers_per_rank": (
        DEFAULTS.workers_per_rank, "--workers-per-rank",
        "Consumers per rank (DataLoader workers): consumer c is worker c mod k of rank c div k.",
    ),
    "node_cache": (
        str(DEFAULTS.node_cache), "--node-cache",
        "With --locality: records this node pins on its local disk on top of --static-cache, bytes or "
        "records; 0 = off.",
    ),
    "node_cache_dir": (
        None, "--node-cache-dir",
        "Node-local directory of the node cache (default: the system temp dir).",
    ),
    "gap_bytes": (
        human_bytes(DEFAULTS.gap_bytes), "--gap-bytes",
        "Gaps between wanted records up to this size (bytes or 64KiB) are read rather than skipped, "
        "so requests stay large and sequential.",
    ),
    "remote_gap_bytes": (
        human_bytes(DEFAULTS.remote_gap_bytes), "--remote-gap-bytes",
        "For a dataset in an object store: gaps up to this size are read rather than requested separately.",
    ),
    "remote_concurrency": (
        DEFAULTS.remote_concurrency, "--remote-concurrency",
        "For a dataset in an object store: requests in flight at once.",
    ),
    "remote_timeout": (
        f"{DEFAULTS.remote_timeout:g}s", "--remote-timeout",
        "For a dataset in an object store: a request slower than this counts as a transient failure.",
    ),
    "remote_retry": (
        f"{DEFAULTS.remote_retry:g}s", "--remote-retry",
        "For a dataset in an object store: retry transient failures (5xx, timeouts, resets) this long "
        "before failing with an error naming the object and byte range.",
    ),
    "cache_dir": (
        None, "--cache-dir",
        "For a dataset in an object store: keep fetched shards in this local directory, so later epochs "
        "read them locally (shared safely by concurrent runs).",
    ),
    "cache_size": (
        None, "--cache-size",
        "Budget of --cache-dir in bytes (e.g. 50GiB; default: the whole dataset).",
    ),
    "limit": (
        None, "--limit",
        "Stop after this many records (default: all epochs).",
    ),
}

#: The sampler options the command line offers.
SAMPLER_FLAGS = frozenset(_DECLARED)


def sampler_option(name: str) -> Any:
    """The typer option for sampler option ``name`` (``ram_size``, ``seed``, ...), for a command's
    signature; a new one each call, as typer expects one per parameter."""
    default, flag, help_text = _DECLARED[name]
    return typer.Option(default, flag, help=help_text)
