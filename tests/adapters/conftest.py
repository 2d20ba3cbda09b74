"""Fixtures of the adapter tests: small generated datasets, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _adapter_data import N_KEYED, N_TRAIN, write_blobs, write_keyed, write_keyed_mixture


@pytest.fixture(scope="session")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_keyed(tmp_path_factory.mktemp("adapters") / "keyed", N_KEYED)


@pytest.fixture(scope="session")
def blob_train(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    path = tmp_path_factory.mktemp("adapters") / "blobs"
    images, labels = write_blobs(path, N_TRAIN, seed=1)
    return path, images, labels


@pytest.fixture(scope="session")
def keyed_mixture(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_keyed_mixture(tmp_path_factory.mktemp("adapters"))
