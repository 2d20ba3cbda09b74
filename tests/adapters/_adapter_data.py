"""Generated datasets for the adapter tests (also imported by the subprocess scripts here).

Two kinds: *keyed* records whose payload spells their own key (so a test can prove that every
tensor carries the record it claims), and *colour blobs* whose class shows in the mean colour plus
noise (so a tiny model trains in seconds to a clearly non-trivial accuracy).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec
from shardkit.readers import SamplerOptions
from shardkit.stores import StoreOptions

SHAPE = (8, 8, 3)
#: Records of the keyed dataset: prime, so every batch size and worker count leaves a ragged tail.
N_KEYED = 103
N_TRAIN = 1200
NUM_CLASSES = 4
#: Class mean colours of the blob dataset; the noise is wide enough that accuracy is well below 100 %.
BLOB_MEANS = np.array([[135, 120, 120], [120, 135, 120], [120, 120, 135]], dtype=np.float64)
BLOB_NOISE = 60.0


def keyed_images(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys, dtype=np.int64)
    images = ((keys[:, None] * 31 + np.arange(int(np.prod(SHAPE)))) % 251).astype(np.uint8).reshape(-1, *SHAPE)
    images[:, 0, 0, 0] = keys // 256
    images[:, 0, 0, 1] = keys % 256
    return images


def decode_keys(images: np.ndarray, layout: str = "NHWC") -> np.ndarray:
    """The key each image spells (``images`` as uint8 NHWC or NCHW)."""
    images = np.asarray(images)
    if layout == "NCHW":
        hi, lo = images[:, 0, 0, 0], images[:, 1, 0, 0]
    else:
        hi, lo = images[:, 0, 0, 0], images[:, 0, 0, 1]
    return hi.astype(np.int64) * 256 + lo.astype(np.int64)


#: Sizes of the keyed mixture's datasets (their records spell keys 0..45, 46..62).
MIX_SIZES = (46, 17)


def write_keyed(path: Path, n: int, records_per_shard: int = 16, first: int = 0) -> Path:
    """``n`` keyed records; record ``i`` spells ``first + i`` (a mixture's datasets spell disjoint keys)."""
    keys = np.arange(first, first + n, dtype=np.int64)
    with DatasetWriter(
        path, kind="test", payload="image", record=FieldSpec(SHAPE, "uint8"),
        fields={"label": FieldSpec((), "int64"), "weight": FieldSpec((2,), "float32")},
        labels={"label": [f"c{i}" for i in range(NUM_CLASSES)]}, records_per_shard=records_per_shard,
    ) as w:  # fmt: skip
        w.write({
            "image": keyed_images(keys),
            "label": keys % NUM_CLASSES,
            "weight": np.stack([keys, -keys], axis=1).astype(np.float32),
        })  # fmt: skip
    return path


def blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images ``[n, 8, 8, 3]`` uint8 and labels: class mean colour + Gaussian pixel noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(BLOB_MEANS), size=n).astype(np.int64)
    pixels = BLOB_MEANS[labels][:, None, None, :] + rng.normal(0.0, BLOB_NOISE, size=(n, *SHAPE))
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8), labels


def write_blobs(path: Path, n: int, seed: int, records_per_shard: int = 128) -> tuple[np.ndarray, np.ndarray]:
    images, labels = blobs(n, seed)
    with DatasetWriter(
        path, kind="test", payload="image", record=FieldSpec(SHAPE, "uint8"),
        fields={"label": FieldSpec((), "int64")}, labels={"label": ["red", "green", "blue"]},
        records_per_shard=records_per_shard,
    ) as w:  # fmt: skip
        w.write({"image": images, "label": labels})
    return images, labels


def write_keyed_mixture(root: Path) -> list[Path]:
    """The datasets of a keyed mixture (sizes :data:`MIX_SIZES`), written once under ``root``."""
    paths, first = [], 0
    for i, n in enumerate(MIX_SIZES):
        p = root / f"mix{i}"
        if not (p / "zarr.json").exists():
            write_keyed(p, n, records_per_shard=8, first=first)
        paths.append(p)
        first += n
    return paths


#: For every store option (StoreOptions), a value other than its default; the sampler options that
#: are store options by their flat names (``remote_concurrency``) take their cases from here.
STORE_CASES: dict[str, object] = {
    "concurrency": 4,
    "request_bytes": "1MiB",
    "timeout": "5s",
    "connect_timeout": "2s",
    "retries": 3,
    "retry_seconds": "7s",
    "backoff_initial": "10ms",
    "backoff_max": "1s",
    "part_bytes": "8MiB",
    "multipart_threshold": "32MiB",
}

#: For every sampler option, keyword values that set it to something other than its default (with
#: the options it needs), valid for the keyed dataset; tests/adapters/test_option_declaration.py
#: checks that the keys are exactly the declared options, so a new option needs a case here.
OPTION_CASES: dict[str, dict[str, object]] = {
    "tiers": {"tiers": "ram,ssd"},
    "ram_size": {"ram_size": "8MiB"},
    "ssd_size": {"ssd_size": "1GiB"},
    "ssd_dir": {"ssd_dir": "/tmp/shardkit-option-case"},
    "static_cache": {"static_cache": "0"},
    "node_sharing": {"node_sharing": False},
    "batch_size": {"batch_size": 7},
    "epochs": {"epochs": 3},
    "start_epoch": {"start_epoch": 2},
    "seed": {"seed": 5},
    "mode": {"mode": "sequential"},
    "permutation": {"permutation": "feistel"},
    "limit": {"limit": 10},
    "drop_last": {"drop_last": True},
    "rank": {"rank": 1, "world_size": 2},
    "world_size": {"world_size": 2},
    "locality": {"locality": True},
    "nodes": {"nodes": 2, "world_size": 2, "locality": True},
    "workers_per_rank": {"workers_per_rank": 2, "world_size": 2},
    "node_cache": {"node_cache": "1MiB", "locality": True},
    "node_cache_dir": {"node_cache_dir": "/tmp/shardkit-option-case"},
    "gap_bytes": {"gap_bytes": "0"},
    "remote_gap_bytes": {"remote_gap_bytes": "4KiB"},
    "store": {"store": StoreOptions(retries=3, concurrency=4)},
    **{flat: {flat: STORE_CASES[key]} for flat, (_, key, _) in SamplerOptions.flat_options().items()},
    "cache_dir": {"cache_dir": "/tmp/shardkit-option-case"},
    "cache_size": {"cache_size": "1GiB"},
    "decode_workers": {"decode_workers": 3},
    "decode": {"decode": "stored"},
}
