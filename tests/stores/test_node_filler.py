"""One filler per node: a DataLoader's workers over an object store with a cache do not download
the shards themselves; a filler process forked before them does, and they read what it fetched and
ask it for the rest (docs/design.md §6, *One filler per node*)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardkit.stores import cache as cache_module
from shardkit.stores.cache import ShardCache
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import make_dataset

N = 40


def test_one_process_fetches_every_part_and_it_is_not_a_worker(s3: Any, tmp_path: Path) -> None:
    """Two workers, one cold epoch: exactly one process fetched parts, neither a worker nor the main
    process (before, each worker filled the copies it claimed first), and the epoch is whole."""
    pytest.importorskip("torch")
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "marks").mkdir()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(Path(__file__).with_name("loader_filler_script.py")), url, str(tmp_path / "cache"),
              str(tmp_path / "marks")]  # fmt: skip
    run = subprocess.run(script, capture_output=True, text=True, env=env, timeout=540, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(got["keys"]) == list(range(N))
    assert len(got["workers"]) == 2
    assert len(got["fetched"]) == 1, got
    assert got["fetched"][0] not in [got["main"], *got["workers"]]


def test_a_copy_watched_while_it_was_filled_is_not_read_again_to_check_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that opened a copy being filled trusts the filler's check once it completes (the
    same file, renamed only after the check); a copy it never watched is still checked."""
    filler = ShardCache(tmp_path, "ns")
    reader = ShardCache(tmp_path, "ns")
    fd = filler.claim("a", 4)
    assert fd is not None
    os.pwrite(fd, b"abcd", 0)
    watched = reader.open_partial("a")
    assert watched is not None
    assert filler.complete("a", fd, 4, lambda _: True)
    other = filler.claim("b", 4)
    assert other is not None
    os.pwrite(other, b"efgh", 0)
    assert filler.complete("b", other, 4, lambda _: True)
    monkeypatch.setattr(cache_module, "_VERIFIED", {})  # as in another process than the filler's
    checked: list[int] = []

    def verify(fd: int) -> bool:
        checked.append(fd)
        return True

    assert reader.open("a", verify) is not None
    assert checked == []
    assert reader.open("b", verify) is not None
    assert len(checked) == 1
    for f in watched:
        os.close(f)
    reader.close()
    filler.close()
