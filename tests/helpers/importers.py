"""Set-up shared by the importer tests (WebDataset, Parquet, MDS, LitData): small lossless images and a
digest of every file of an output, to show that a failed run changed nothing."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["png", "random_image", "tree_digest"]


def png(arr: np.ndarray) -> bytes:
    """``arr`` as PNG bytes (lossless: a converted record equals the array)."""
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "PNG")
    return out.getvalue()


def random_image(seed: int, h: int, w: int) -> np.ndarray:
    """A seeded random ``h x w`` RGB image."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative name."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}
