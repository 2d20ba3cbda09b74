"""The checked-in MDS and LitData fixtures (tests/data/mds, tests/data/litdata, each made by its
format's own writer with the script beside it): copying one to change it, its expected arrays, its
index, and the ``(shard file, row)`` of every row in index order, as each format lists them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DATA_ROOT", "Fixtures", "index", "mds_rows", "litdata_rows"]

DATA_ROOT = Path(__file__).resolve().parents[1] / "data"


class Fixtures:
    """The fixtures of one format (``"mds"`` or ``"litdata"``)."""

    def __init__(self, fmt: str) -> None:
        self.data = DATA_ROOT / fmt

    def copy(self, name: str, tmp_path: Path) -> Path:
        """A private copy of fixture ``name`` under ``tmp_path`` (to damage or edit)."""
        dst = tmp_path / name
        shutil.copytree(self.data / name, dst)
        return dst

    def expected(self, name: str) -> dict[str, np.ndarray]:
        """The arrays the fixture's writer was given (its ``expected.npz``)."""
        with np.load(self.data / name / "expected.npz") as npz:
            return {k: npz[k] for k in npz.files}


def index(src: Path) -> dict[str, Any]:
    """The ``index.json`` of a fixture directory."""
    doc: dict[str, Any] = json.loads((src / "index.json").read_text())
    return doc


def mds_rows(src: Path) -> list[tuple[str, int]]:
    """``(shard file, row)`` of every sample of an MDS index, in index order."""
    return [(s["zip_data"]["basename"] if s["compression"] else s["raw_data"]["basename"], j)
            for s in index(src)["shards"] for j in range(s["samples"])]


def litdata_rows(src: Path) -> list[tuple[str, int]]:
    """``(chunk file, item)`` of every item of a LitData index, in index order."""
    return [(c["filename"], j) for c in index(src)["chunks"] for j in range(c["chunk_size"])]
