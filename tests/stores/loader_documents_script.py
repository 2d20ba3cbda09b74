"""Run by tests/stores/test_adapters_remote.py in a fresh interpreter, as a training script starts:
one epoch of a dataset in an object store through ``loader(num_workers=2)``, every batch checked
(labels and pairs included). Prints JSON: whether the modules a pass needs were imported while the
dataset was made (its helper read the documents meanwhile), the start method and the keys delivered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from shardkit.adapters._start import PRELOAD
from shardkit.adapters.torch import ShardIterableDataset
from tests.helpers.sampler_data import check_batch


def main() -> None:
    url, cache = sys.argv[1], Path(sys.argv[2])
    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=cache)
    preloaded = [name for name in PRELOAD if name in sys.modules]
    loader = ds.loader(num_workers=2, timeout=120)
    keys: list[int] = []
    for batch in loader:
        keys += check_batch({name: np.asarray(t.numpy()) for name, t in batch.items()}).tolist()
    ds.close()
    print(json.dumps({"preloaded": preloaded, "method": loader.multiprocessing_context.get_start_method(), "keys": keys}))


if __name__ == "__main__":
    main()
