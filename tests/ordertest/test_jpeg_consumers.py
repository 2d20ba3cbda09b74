"""The order battery on a JPEG dataset through every consumer: the sampler's tiers (ram, ram,ssd,
the static cache), the torch DataLoader with workers, tf.data and ``serve``; every batch holds its
records' decoded pixels, and a damaged JPEG record is a named error in a DataLoader worker and in
tf.data, never a crashed worker. The order is drawn on keys before any payload is read, so a codec
cannot change it; these check that the JPEG path end to end does not either."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import open_dataset
from tests.helpers.consumers import (
    BAD,
    BATCH,
    EPOCHS,
    TIERS,
    N,
    assert_a_worker_names_the_damaged_record,
    assert_permutations,
    battery,
    key_epochs,
    loader_epochs,
    tier_epochs,
)
from tests.helpers.datasets import flip_byte, write_dataset

pytest.importorskip("imagecodecs")

HERE = Path(__file__).parent
SEED = 13


def _images(n: int) -> np.ndarray:
    """Smooth, distinct 16x16 RGB images (gradients with a per-record offset): what JPEG is made for."""
    y, x = np.mgrid[0:16, 0:16]
    base = np.stack([x * 13, y * 11, (x + y) * 6], axis=-1)
    return np.stack([(base + 7 * i) % 256 for i in range(n)]).astype(np.uint8)


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The JPEG dataset and every record decoded (the reference each batch is checked against)."""
    path = write_dataset(tmp_path_factory.mktemp("jpeg") / "ds", _images(N), records_per_shard=16, compression="jpeg")
    with open_dataset(path) as ds:
        assert ds.meta.compression == {"name": "jpeg", "quality": 90}
        return path, ds.payload.read(np.arange(N))


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JPEG dataset whose record BAD's frame header says another image size."""
    path = write_dataset(tmp_path_factory.mktemp("corrupt") / "ds", _images(N), records_per_shard=32, compression="jpeg")
    with open_dataset(path) as ds:
        offset = int(ds.payload.index(0).offsets[BAD])
        shard = ds.payload.shard_path(0)
    flip_byte(shard, shard.read_bytes().index(b"\xff\xc0", offset) + 6, 0x01)
    return path


@pytest.mark.parametrize("tiers", TIERS)
def test_order_battery_through_every_tier(jpeg: tuple[Path, np.ndarray], tiers: dict[str, Any], tmp_path: Path) -> None:
    path, decoded = jpeg
    epochs = tier_epochs(path, decoded, "image", tiers, seed=SEED, ssd_dir=tmp_path)
    assert_permutations(epochs, SEED)
    battery(epochs)


def test_order_battery_through_the_torch_dataloader_with_workers(jpeg: tuple[Path, np.ndarray]) -> None:
    path, decoded = jpeg
    epochs = loader_epochs(path, decoded, "image", seed=SEED)
    assert_permutations(epochs, SEED)
    battery(epochs)


def test_a_damaged_jpeg_in_a_dataloader_worker_is_a_named_error(corrupt: Path) -> None:
    assert_a_worker_names_the_damaged_record(corrupt, SEED)


@pytest.mark.slow
def test_order_battery_through_tf_data_and_a_damaged_record(jpeg: tuple[Path, np.ndarray], corrupt: Path, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("the 'tensorflow' extra is not installed")
    path, _ = jpeg
    out = tmp_path / "observed.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(HERE / "jpeg_tf_script.py"), str(path), str(corrupt), str(out), str(SEED), str(EPOCHS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["pixels_ok"]
    epochs = list(np.concatenate([np.asarray(k) for k in got["keys"]]).reshape(-1, N))
    assert_permutations(epochs, SEED)
    battery(epochs)
    error = got["error"]
    assert error is not None and f"record {BAD} at offset" in error["message"] and "does not decode" in error["message"], error


def test_order_battery_through_serve(jpeg: tuple[Path, np.ndarray]) -> None:
    """A server decoding on its decode threads into the ring; a job's batches hold decoded pixels and
    its order passes the battery."""
    from shardkit.serve import SharedSampler, TierServer

    path, decoded = jpeg
    name = f"jpeg{os.getpid()}-{secrets.token_hex(3)}"  # unique: other runs share /dev/shm, maybe the pid too
    with TierServer(path, name=name, ram_size="16records", slots=2, epochs=EPOCHS, seed=SEED, decode_workers=2):
        with SharedSampler(name, job_seed=SEED, batch_size=BATCH, epochs=EPOCHS, dataset=path) as job:
            epochs = key_epochs(job, decoded, "image")
    battery(epochs)


def test_stored_bytes_are_refused_from_a_shared_tier_stack(jpeg: tuple[Path, np.ndarray]) -> None:
    """The ring holds decoded records and the protocol carries no stored lengths: asking a shared job
    for the stored bytes is an error, never decoded batches handed over silently."""
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset

    path, _ = jpeg
    for decode in (False, "cuda"):
        with pytest.raises(errors.ConfigError, match=r"shared='any': a shared tier stack hands its jobs decoded records"):
            ShardIterableDataset(path, batch_size=BATCH, shared="any", decode=decode)
