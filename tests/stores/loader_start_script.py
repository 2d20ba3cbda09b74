"""Run by tests/stores/test_adapters_remote.py in a fresh interpreter, as a training script starts:
a dataset in an object store read through ``loader(num_workers=2)`` for two epochs. Prints JSON: the
start method the workers got, each epoch's keys, which workers ran ``worker_init_fn``, and the start
method of a loader whose ``multiprocessing_context`` the user chose."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np

from shardkit.adapters.torch import ShardIterableDataset
from shardkit.stores.objectstore import runtime_started
from tests.helpers.sampler_data import encode


def _started(directory: Path, worker: int) -> None:
    (directory / f"worker-{worker}").touch()


def main() -> None:
    url, cache, marks = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=cache)
    clean = not runtime_started()  # the dataset read its documents without starting the runtime here
    loader = ds.loader(num_workers=2, timeout=120, worker_init_fn=functools.partial(_started, marks))
    epochs = []
    for _ in range(2):
        keys: list[int] = []
        for batch in loader:
            k = batch["key"].numpy()
            np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
            keys += k.tolist()
        epochs.append(keys)
    method = loader.multiprocessing_context.get_start_method()
    chosen = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=cache)
    spawned = chosen.loader(num_workers=1, timeout=120, multiprocessing_context="spawn")
    spawned_keys = sorted(k for batch in spawned for k in batch["key"].tolist())
    print(json.dumps({"clean": clean, "method": method, "epochs": epochs, "user_method":
                      spawned.multiprocessing_context.get_start_method(), "user_keys": spawned_keys}))


if __name__ == "__main__":
    main()
