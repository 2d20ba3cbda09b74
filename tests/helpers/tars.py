"""WebDataset shards for the converter tests: written by webdataset's own TarWriter (real shards),
plus hand-made tars (links, devices, unsafe names) for the hostile cases; shared by the local and the
object-store tests of the webdataset kind."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.importers import png, random_image

__all__ = ["H", "W", "png", "image", "write_shards", "write_tar", "member"]

#: Size of the images in :func:`write_shards`'s samples.
H, W = 12, 16


def image(seed: int) -> np.ndarray:
    """A seeded random ``H x W`` RGB image."""
    return random_image(seed, H, W)


def write_shards(root: Path, shards: int = 2, per_shard: int = 4) -> list[dict[str, Any]]:
    """Shards ``root/shards-00000{s}.tar`` written by webdataset's TarWriter; returns the samples in order
    (each with its ``shard`` name and decoded ``image``)."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    samples = []
    for s in range(shards):
        with wds.TarWriter(str(root / f"shards-{s:06d}.tar")) as sink:
            for i in range(per_shard):
                n = s * per_shard + i
                sample = {"__key__": f"sample{n:04d}", "png": png(image(n)), "cls": n % 3,
                          "json": {"width": W, "score": n / 4, "caption": "text is dropped"},
                          "emb.npy": np.arange(5, dtype=np.float32) * n, "txt": f"caption {n}"}
                sink.write(sample)
                samples.append({**sample, "shard": f"shards-{s:06d}.tar", "image": image(n)})
    return samples


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    """A GNU tar of ``members`` (``data`` None: a member without data, a link or a device)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)


def member(name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE,
           link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    """One member for :func:`write_tar`."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, data
