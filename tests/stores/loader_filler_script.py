"""Run by tests/stores/test_node_filler.py in a fresh interpreter, as a training script starts: a
dataset in an object store read through ``loader(num_workers=2)`` with a cache. Every process that
fetches a part of a shard (forked from this one, so the patch below is theirs too) writes its pid
into the marks directory, each worker its pid too. Prints JSON: this process's pid, the workers',
the pids that fetched parts, and the epoch's keys."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.adapters.torch import ShardIterableDataset
from shardkit.stores import prefetch
from tests.helpers.sampler_data import encode


def _worker(directory: Path, worker: int) -> None:
    (directory / f"worker-{os.getpid()}").touch()


def main() -> None:
    url, cache, marks = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    fetch = prefetch.ShardPrefetcher._fetch

    def marked(self: Any, fill: Any, lo: int, hi: int) -> bool:
        (marks / f"fetch-{os.getpid()}").touch()
        return fetch(self, fill, lo, hi)

    prefetch.ShardPrefetcher._fetch = marked  # type: ignore[method-assign]
    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=cache, ram_size="8records")
    loader = ds.loader(num_workers=2, timeout=120, worker_init_fn=functools.partial(_worker, marks))
    keys: list[int] = []
    for batch in loader:
        k = batch["key"].numpy()
        np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
        keys += k.tolist()
    ds.close()
    names = [p.name for p in marks.iterdir()]
    print(json.dumps({"main": os.getpid(), "keys": keys,
                      "workers": sorted(int(n.split("-")[1]) for n in names if n.startswith("worker-")),
                      "fetched": sorted(int(n.split("-")[1]) for n in names if n.startswith("fetch-"))}))


if __name__ == "__main__":
    main()
