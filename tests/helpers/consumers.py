"""The order battery through the consumers of a dataset of encoded records (the sampler's tiers, the
torch DataLoader with workers): what tests/ordertest's per-codec consumer tests share. Each batch is
checked against the records decoded once, the keys gathered one row per epoch, and the order scored."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.ordertest import run
from shardkit.readers import TieredSampler, epoch_permutation

__all__ = ["N", "EPOCHS", "BATCH", "TESTED", "BAD", "TIERS", "battery", "checked_keys", "key_epochs", "tier_epochs",
           "loader_epochs", "assert_permutations", "assert_a_worker_names_the_damaged_record"]

N, EPOCHS, BATCH = 64, 50, 8
#: Tests the battery runs on 50 epochs of 64 keys (labels_per_batch needs labels: not given).
TESTED = {"item_position", "adjacent_pairs", "joint_positions", "epoch_independence"}
#: The damaged record of the corrupt datasets (far from its shard's checked tail).
BAD = 5
#: The tier set-ups every consumer test runs: ram, ram+ssd, and a static cache.
TIERS = [
    {"tiers": "ram", "static_cache": 0},
    {"tiers": "ram,ssd", "ssd_size": "32records", "static_cache": 0},
    {"tiers": "ram", "static_cache": "24records", "ram_size": "48records"},
]


def battery(epochs: Iterable[np.ndarray]) -> None:
    """The order battery passes on ``EPOCHS`` epochs of ``N`` keys and runs at least :data:`TESTED`."""
    keys = np.stack(list(epochs))
    assert keys.shape == (EPOCHS, N)
    report = run(keys, batch_size=BATCH)
    assert report.passed, report.format()
    assert {r.name for r in report.tested} >= TESTED, report.format()


def checked_keys(batches: Iterable[dict[str, Any]], decoded: np.ndarray, field: str) -> Iterator[np.ndarray]:
    """Each batch's keys, once its ``field`` is checked to be its records' decoded values (numpy arrays
    or CPU tensors alike)."""
    for batch in batches:
        k = np.asarray(batch["key"])
        np.testing.assert_array_equal(np.asarray(batch[field]), decoded[k])
        yield k


def key_epochs(batches: Iterable[dict[str, Any]], decoded: np.ndarray, field: str) -> list[np.ndarray]:
    """The checked keys of a run of several epochs (a sampler, a shared job), one row per epoch."""
    return list(np.concatenate(list(checked_keys(batches, decoded, field))).reshape(-1, N))


def tier_epochs(path: Path, decoded: np.ndarray, field: str, tiers: dict[str, Any], *, seed: int,
                ssd_dir: Path) -> list[np.ndarray]:
    """``EPOCHS`` epochs through a sampler with ``tiers`` (over a 16-record RAM tier unless they say),
    decoding on 2 workers; with a static cache, it must have served records."""
    opts = {"ram_size": "16records", **tiers}
    s = TieredSampler(path, batch_size=BATCH, epochs=EPOCHS, seed=seed, decode_workers=2, ssd_dir=ssd_dir, **opts)
    try:
        epochs = key_epochs(s, decoded, field)
        if tiers["static_cache"]:
            assert s.stats.cache.records > 0  # the static cache served records
    finally:
        s.close()
    return epochs


def _loader(path: Path, seed: int) -> Any:
    from shardkit.adapters.torch import ShardIterableDataset

    return ShardIterableDataset(path, batch_size=BATCH, seed=seed, static_cache=0, decode_workers=2).loader(num_workers=2)


def loader_epochs(path: Path, decoded: np.ndarray, field: str, *, seed: int) -> list[np.ndarray]:
    """``EPOCHS`` passes of a torch DataLoader with 2 workers, its batches checked; one row per epoch."""
    pytest.importorskip("torch")
    loader = _loader(path, seed)
    return [np.concatenate(list(checked_keys(loader, decoded, field))) for _ in range(EPOCHS)]


def assert_permutations(epochs: list[np.ndarray], seed: int) -> None:
    """Epoch ``e`` emitted ``epoch_permutation(seed, e, N)``."""
    for e, keys in enumerate(epochs):
        np.testing.assert_array_equal(keys, epoch_permutation(seed, e, N))


def assert_a_worker_names_the_damaged_record(path: Path, seed: int) -> None:
    """A DataLoader worker meeting record :data:`BAD` of ``path`` (damaged) raises a named
    CorruptShardError, never a crashed worker."""
    pytest.importorskip("torch")
    loader = _loader(path, seed)
    with pytest.raises(errors.CorruptShardError, match=rf"record {BAD} at offset \d+ does not decode"):
        for _ in loader:
            pass
