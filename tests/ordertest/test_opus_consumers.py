"""The order battery on a small Opus dataset through the sampler's tiers and the torch DataLoader with
workers (the pattern of test_jpeg_consumers.py): every batch holds its records' decoded samples, the
order is the epoch permutation, and a damaged Opus record is a named error in a DataLoader worker."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import open_dataset
from shardkit.ordertest import run
from shardkit.readers import TieredSampler, epoch_permutation
from tests.helpers.datasets import flip_byte, write_dataset

N, EPOCHS, BATCH, SEED = 64, 50, 8, 17
#: Tests the battery runs on 50 epochs of 64 keys.
TESTED = {"item_position", "adjacent_pairs", "joint_positions", "epoch_independence"}
#: The damaged record (far from its shard's checked tail).
BAD = 5


def _clips(n: int) -> np.ndarray:
    """10 ms int16 clips at 48 kHz, a distinct tone each (what a lossy audio codec is made for)."""
    t = np.arange(480) / 48000
    return np.stack([np.sin(2 * np.pi * (200 + 37 * i) * t) * 12000 for i in range(n)]).astype(np.int16)


@pytest.fixture(scope="module")
def opus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The Opus dataset and every record decoded (the reference each batch is checked against)."""
    path = write_dataset(tmp_path_factory.mktemp("opus") / "ds", _clips(N), records_per_shard=16,
                         compression="opus@48k", payload="audio")
    with open_dataset(path) as ds:
        assert ds.meta.compression == {"name": "opus", "bitrate": 32000, "sample_rate": 48000}
        return path, ds.payload.read(np.arange(N))


def _battery(epochs: Iterable[np.ndarray]) -> None:
    keys = np.stack(list(epochs))
    assert keys.shape == (EPOCHS, N)
    report = run(keys, batch_size=BATCH)
    assert report.passed, report.format()
    assert {r.name for r in report.tested} >= TESTED, report.format()


@pytest.mark.parametrize("tiers", [
    {"tiers": "ram", "static_cache": 0},
    {"tiers": "ram,ssd", "ssd_size": "32records", "static_cache": 0},
    {"tiers": "ram", "static_cache": "24records", "ram_size": "48records"},
])  # fmt: skip
def test_order_battery_through_every_tier(opus: tuple[Path, np.ndarray], tiers: dict[str, Any], tmp_path: Path) -> None:
    path, decoded = opus
    opts = {"ram_size": "16records", **tiers}
    s = TieredSampler(path, batch_size=BATCH, epochs=EPOCHS, seed=SEED, decode_workers=2, ssd_dir=tmp_path, **opts)
    keys = []
    try:
        for batch in s:
            k = np.asarray(batch["key"])
            np.testing.assert_array_equal(np.asarray(batch["audio"]), decoded[k])
            keys.append(k)
    finally:
        s.close()
    epochs = list(np.concatenate(keys).reshape(-1, N))
    for e, epoch in enumerate(epochs):
        np.testing.assert_array_equal(epoch, epoch_permutation(SEED, e, N))
    _battery(epochs)


def test_order_battery_through_the_torch_dataloader_with_workers(opus: tuple[Path, np.ndarray]) -> None:
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset

    path, decoded = opus
    loader = ShardIterableDataset(path, batch_size=BATCH, seed=SEED, static_cache=0, decode_workers=2).loader(num_workers=2)
    epochs = []
    for _ in range(EPOCHS):
        keys = []
        for b in loader:
            np.testing.assert_array_equal(b["audio"].numpy(), decoded[b["key"].numpy()])
            keys.append(b["key"].numpy())
        epochs.append(np.concatenate(keys))
    for e, epoch in enumerate(epochs):
        np.testing.assert_array_equal(epoch, epoch_permutation(SEED, e, N))
    _battery(epochs)


def test_a_damaged_opus_record_in_a_dataloader_worker_is_a_named_error(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset

    path = write_dataset(tmp_path / "ds", _clips(N), records_per_shard=32, compression="opus@48k", payload="audio")
    with open_dataset(path) as ds:
        offset = int(ds.payload.index(0).offsets[BAD])
        shard = ds.payload.shard_path(0)
    # Record BAD's identification header says 5 channels.
    head = shard.read_bytes().index(b"OpusHead", offset)
    flip_byte(shard, head + 9, 0x01 ^ 0x05)
    loader = ShardIterableDataset(path, batch_size=BATCH, seed=SEED, static_cache=0, decode_workers=2).loader(num_workers=2)
    with pytest.raises(errors.CorruptShardError, match=rf"record {BAD} at offset \d+ does not decode"):
        for _ in loader:
            pass
