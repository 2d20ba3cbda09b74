"""The order battery on a small Opus dataset through the sampler's tiers and the torch DataLoader with
workers (the pattern of test_jpeg_consumers.py, sharing tests/helpers/consumers.py): every batch holds
its records' decoded samples, the order is the epoch permutation, and a damaged Opus record is a named
error in a DataLoader worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import open_dataset
from tests.helpers.consumers import (
    BAD,
    TIERS,
    N,
    assert_a_worker_names_the_damaged_record,
    assert_permutations,
    battery,
    loader_epochs,
    tier_epochs,
)
from tests.helpers.datasets import flip_byte, write_dataset

SEED = 17


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


@pytest.mark.parametrize("tiers", TIERS)
def test_order_battery_through_every_tier(opus: tuple[Path, np.ndarray], tiers: dict[str, Any], tmp_path: Path) -> None:
    path, decoded = opus
    epochs = tier_epochs(path, decoded, "audio", tiers, seed=SEED, ssd_dir=tmp_path)
    assert_permutations(epochs, SEED)
    battery(epochs)


def test_order_battery_through_the_torch_dataloader_with_workers(opus: tuple[Path, np.ndarray]) -> None:
    path, decoded = opus
    epochs = loader_epochs(path, decoded, "audio", seed=SEED)
    assert_permutations(epochs, SEED)
    battery(epochs)


def test_a_damaged_opus_record_in_a_dataloader_worker_is_a_named_error(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = write_dataset(tmp_path / "ds", _clips(N), records_per_shard=32, compression="opus@48k", payload="audio")
    with open_dataset(path) as ds:
        offset = int(ds.payload.index(0).offsets[BAD])
        shard = ds.payload.shard_path(0)
    # Record BAD's identification header says 5 channels.
    head = shard.read_bytes().index(b"OpusHead", offset)
    flip_byte(shard, head + 9, 0x01 ^ 0x05)
    assert_a_worker_names_the_damaged_record(path, SEED)
