"""Both adapters read datasets in an object store: the torch IterableDataset through DataLoader
workers (started with spawn, once for every epoch: obstore's runtime does not survive fork, which
gives a clear error instead of a hang), the map-style dataset, and the tf.data pipeline."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import StoreError
from shardkit.stores import open_store
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import encode, make_dataset

N = 30


@pytest.fixture
def url(s3: Any, tmp_path: Path) -> str:
    return upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))


def test_torch_loader_with_workers(url: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset, ShardMapDataset

    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=tmp_path)
    loader = ds.loader(num_workers=2)
    assert loader.multiprocessing_context is not None
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.persistent_workers  # spawned once, kept for every epoch
    epochs = []
    for _ in range(2):
        keys = []
        for batch in loader:
            k = batch["key"].numpy()
            np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
            keys.append(k)
        epochs.append(np.concatenate(keys))
        assert sorted(epochs[-1].tolist()) == list(range(N))
    assert ds.epoch == 2 and epochs[0].tolist() != epochs[1].tolist()  # the spawned workers saw the new epoch
    mapped = ShardMapDataset(url)
    np.testing.assert_array_equal(mapped[7]["image"].numpy(), encode(np.array([7]))[0])


def test_tf_dataset(url: str) -> None:
    pytest.importorskip("tensorflow")
    from shardkit.adapters.tf import make_tf_dataset

    keys = []
    for batch in make_tf_dataset(url, batch_size=4, epochs=1, seed=3):
        k = batch["key"].numpy()
        np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
        keys.append(k)
    assert sorted(np.concatenate(keys).tolist()) == list(range(N))


def _child(url: str, q: Any) -> None:
    try:
        open_store(url).get("zarr.json")
        q.put("no error")
    except StoreError as exc:
        q.put(str(exc))


def test_forked_process_gets_a_clear_error(url: str) -> None:
    open_store(url).get("zarr.json")  # this process has used obstore's runtime now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(url, q))
    p.start()
    p.join(60)
    assert not p.is_alive(), "a forked child hung instead of failing"
    message = q.get(timeout=5)
    assert "forked" in message and "spawn" in message
