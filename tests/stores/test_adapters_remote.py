"""Both adapters read datasets in an object store: the torch IterableDataset through DataLoader
workers (started once for every epoch: forked while the main process has not used obstore, whose
runtime does not survive fork, else with spawn; a fork after use gives a clear error instead
of a hang; each worker prepares its next pass before it is asked for), the map-style dataset, and
the tf.data pipeline."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import StoreError
from shardkit.stores import open_store
from tests.helpers.datasets import upload
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.sampler_data import encode, make_dataset

N = 30


@pytest.fixture
def url(s3: Any, tmp_path: Path) -> str:
    return upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))


def _environment_seen(marks: Path, worker_id: int) -> None:
    """worker_init_fn: write what this worker's environment says of the test's variable."""
    (marks / f"worker-{worker_id}").write_text(os.environ.get("SHARDKIT_TEST_LATE_VARIABLE", "missing"))


def test_torch_loader_with_workers(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers over an object store in a process that used one are spawned, and see the environment
    as it is when they start: a fork server running from before (here started on purpose) would give
    them the environment it started with, without credentials or an endpoint set since."""
    pytest.importorskip("torch")
    import functools
    from multiprocessing import forkserver

    from shardkit.adapters.torch import ShardIterableDataset, ShardMapDataset

    forkserver.ensure_running()
    monkeypatch.setenv("SHARDKIT_TEST_LATE_VARIABLE", "set after the fork server started")
    marks = tmp_path / "marks"
    marks.mkdir()
    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=tmp_path)
    loader = ds.loader(num_workers=2, worker_init_fn=functools.partial(_environment_seen, marks))
    assert loader.multiprocessing_context is not None
    # This process used obstore (the upload): its workers cannot be forked, they are spawned (they see
    # this process's environment as it is now: a fork server would keep the one it started with).
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.persistent_workers  # started once, kept for every epoch
    epochs = []
    for _ in range(2):
        keys = []
        for batch in loader:
            k = batch["key"].numpy()
            np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
            keys.append(k)
        epochs.append(np.concatenate(keys))
        assert sorted(epochs[-1].tolist()) == list(range(N))
    assert ds.epoch == 2 and epochs[0].tolist() != epochs[1].tolist()  # the workers saw the new epoch
    assert [p.read_text() for p in sorted(marks.iterdir())] == ["set after the fork server started"] * 2
    mapped = ShardMapDataset(url)
    np.testing.assert_array_equal(mapped[7]["image"].numpy(), encode(np.array([7]))[0])


def test_a_fresh_process_forks_its_workers(url: str, tmp_path: Path) -> None:
    """A training script that has not touched an object store before making the dataset gets forked
    workers (no interpreter start, no torch import per worker): the dataset read its documents in a
    helper process and builds its holder only once they run. They deliver the same batches in the
    same order as spawned workers, run the user's ``worker_init_fn``, and the script
    exits; a ``multiprocessing_context`` the user chose is kept."""
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset

    (tmp_path / "cache").mkdir()
    (tmp_path / "marks").mkdir()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(Path(__file__).with_name("loader_start_script.py")), url, str(tmp_path / "cache"),
              str(tmp_path / "marks")]  # fmt: skip
    run = subprocess.run(script, capture_output=True, text=True, env=env, timeout=540, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["clean"] and got["method"] == "fork"
    assert sorted(p.name for p in (tmp_path / "marks").iterdir()) == ["worker-0", "worker-1"]
    assert got["user_method"] == "spawn" and got["user_keys"] == list(range(N))

    ds = ShardIterableDataset(url, batch_size=4, epochs=1, seed=3, cache_dir=tmp_path / "cache")
    loader = ds.loader(num_workers=2, timeout=120)
    here = [[k for batch in loader for k in batch["key"].tolist()] for _ in range(2)]
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert got["epochs"] == here
    assert all(sorted(keys) == list(range(N)) for keys in here)


_SLOW_HELPER_EXIT = """
import json, multiprocessing, sys, time
from shardkit.adapters import _start
_start.HELPER_EXIT_SECONDS = 300.0
_start.preload = lambda: None  # (what a pass imports: not needed here)
answer = _start._open_in_helper

def answer_then_exit_slowly(dataset, send):
    answer(dataset, send)
    time.sleep(120)  # in the helper, after its answer: an exit that takes long

_start._open_in_helper = answer_then_exit_slowly
source = _start.source_of(sys.argv[1])
alive = [p.name for p in multiprocessing.active_children()]
for p in multiprocessing.active_children():
    p.kill()
print(json.dumps({"records": source.epoch_size, "alive": alive}))
"""


def test_the_start_helper_is_not_waited_for_once_it_answered(url: str) -> None:
    """A fresh process's dataset takes the start helper's answer and goes on: the helper's exit
    (tearing down a copy of the process) is waited for in a thread, not before the DataLoader's
    workers can start."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _SLOW_HELPER_EXIT, url], capture_output=True, text=True, env=env,
                         timeout=540, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"records": N, "alive": ["shardkit-open"]}


try:
    import torch

    from shardkit.adapters.torch import ShardIterableDataset
except ImportError:  # the torch extra is missing: the tests that need it skip
    ShardIterableDataset = object  # type: ignore[assignment,misc]


class _MarksPreparedPass(ShardIterableDataset):  # type: ignore[misc,valid-type]
    """Ends each worker's pass with a marker sent only once the worker's next pass is prepared (its
    sampler built and reading), so the main process knows when the epoch boundary is reached."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from super().__iter__()
        if self._next is not None:
            self._next.wait()
        yield {"prepared": torch.tensor([int(self._next is not None)])}


def test_persistent_workers_ask_the_store_nothing_at_the_next_epochs_start(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shards in the cache, epoch 2's first batch needs no request to the store: each
    persistent worker built its next pass's sampler (dataset documents, identity) during epoch 1
    and started reading it before the epoch ended. Every GET is counted by a proxy. 8 batches per
    worker: a worker builds its next sampler after its 4th batch, and when the main process has
    its first batch no worker was asked for more than 3 (DataLoader's prefetch_factor 2, plus one)."""
    pytest.importorskip("torch")
    n = 64
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=8), s3.url("ds"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        (tmp_path / "cache").mkdir()
        ds = _MarksPreparedPass(url, batch_size=4, epochs=1, seed=3, cache_dir=tmp_path / "cache")
        loader = ds.loader(num_workers=2)
        orders = []
        for epoch in range(2):
            it = iter(loader)
            gets = len(proxy.gets)
            first = next(it)
            if epoch == 1:
                assert proxy.gets[gets:] == [], "the store was asked at the start of epoch 2"
            keys, prepared = [], []
            for batch in [first, *it]:
                if "prepared" in batch:
                    prepared.append(int(batch["prepared"]))
                    continue
                k = batch["key"].numpy()
                np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
                keys.append(k)
            assert prepared == [1, 1]
            orders.append(np.concatenate(keys))
            assert sorted(orders[-1].tolist()) == list(range(n))
        assert orders[0].tolist() != orders[1].tolist()
        del it, loader
        ds.close()
    finally:
        proxy.close()


def test_tf_dataset(url: str) -> None:
    pytest.importorskip("tensorflow")
    from shardkit.adapters.tf import make_tf_dataset

    keys = []
    for batch in make_tf_dataset(url, batch_size=4, epochs=1, seed=3):
        k = batch["key"].numpy()
        np.testing.assert_array_equal(batch["image"].numpy(), encode(k))
        keys.append(k)
    assert sorted(np.concatenate(keys).tolist()) == list(range(N))


def _child(url: str, q: Any) -> None:
    try:
        open_store(url).get("zarr.json")
        q.put("no error")
    except StoreError as exc:
        q.put(str(exc))


def test_forked_process_gets_a_clear_error(url: str) -> None:
    open_store(url).get("zarr.json")  # this process has used obstore's runtime now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(url, q))
    p.start()
    p.join(60)
    assert not p.is_alive(), "a forked child hung instead of failing"
    message = q.get(timeout=5)
    assert "forked" in message and "spawn" in message


def test_forked_workers_take_the_documents_and_fields_the_helper_read(s3: Any, tmp_path: Path) -> None:
    """A fresh process's start helper reads the array documents and the small fields once, and the
    forked workers and the main process's holder open the dataset from them: no process fetches
    them again (before, every worker and the holder did: sequential round trips before each
    worker's first read). Every GET is counted by a proxy; the batches' labels and pairs are still
    the records'."""
    pytest.importorskip("torch")
    from shardkit.adapters._start import PRELOAD

    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    try:
        (tmp_path / "cache").mkdir()
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint,
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        script = [sys.executable, str(Path(__file__).with_name("loader_documents_script.py")), url, str(tmp_path / "cache")]
        run = subprocess.run(script, capture_output=True, text=True, env=env, timeout=540, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["method"] == "fork" and sorted(got["keys"]) == list(range(N))
        assert got["preloaded"] == list(PRELOAD)  # imported while the helper read, not after it in loader()
        paths = [path.split("?")[0] for path, _ in proxy.gets]
        seen = [p.split("/ds/")[-1] for p in paths]
        assert seen.count("image/zarr.json") == 1, seen
        for name in ("label", "pair"):  # the helper's open reads and checks it; its field read uses that copy
            assert seen.count(f"{name}/zarr.json") == 1, seen
        for name in ("label", "pair"):
            chunks = [p for p in paths if f"/ds/{name}/c/" in p]
            assert chunks and len(chunks) == len(set(chunks)), (name, paths)  # each chunk fetched once
    finally:
        proxy.close()


def test_the_helper_documents_carry_small_fields_and_open_without_a_request(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the start helper sends: the array documents and the fields (up to HELPER_FIELDS_BYTES);
    a dataset opened from them, and its node-shared fields, make no request for a field."""
    from shardkit.adapters import _start
    from shardkit.formats import Dataset
    from shardkit.readers import identity
    from shardkit.tiers.shm import node_fields

    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        ident, _ = identity.open_root(url)
        entry = identity.remembered(url)
        assert entry is not None
        gets = len(proxy.gets)
        documents = _start._documents(url, entry[1], entry[2])
        seen = [path.split("?")[0].split("/ds/")[-1] for path, _ in proxy.gets[gets:]]
        for name in ("label", "pair"):  # read once: the open's checked copy serves the field's read
            assert seen.count(f"{name}/zarr.json") == 1, seen
        assert documents.payload_document is not None and documents.fields is not None
        np.testing.assert_array_equal(documents.fields["label"], np.arange(N) * 3)
        monkeypatch.setattr(_start, "HELPER_FIELDS_BYTES", N * 8)  # label alone fits, label and pair do not
        assert _start._documents(url, entry[1], entry[2]).fields is None
        gets = len(proxy.gets)
        with Dataset(url, opened={entry[2]: documents}) as ds:
            fields, regions = node_fields(ds, f"helper-test-{os.getpid()}-{ident.fingerprint}")
            np.testing.assert_array_equal(fields["pair"][:, 0], np.arange(N, dtype=np.float32))
            np.testing.assert_array_equal(ds.fields["label"], np.arange(N) * 3)
            for region in regions:
                region.release()
        assert proxy.gets[gets:] == []
    finally:
        proxy.close()


def test_the_helper_checks_the_tails_once_and_readers_pin_its_etags(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start helper checks every shard's tail_crc32c and sends the ETag each response carried: a
    dataset opened from its documents makes no tail request before reading a shard (before, every
    worker asked for every shard's tail page with its first block), and reads each shard under the
    helper's ETag, so a shard replaced since the helper's check is refused, never served."""
    from shardkit.adapters import _start
    from shardkit.errors import ShardkitError
    from shardkit.formats import Dataset
    from shardkit.readers import identity

    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        identity.open_root(url)
        entry = identity.remembered(url)
        assert entry is not None
        documents = _start._documents(url, entry[1], entry[2])
        shards = -(-N // 4)
        assert documents.tails is not None and sorted(documents.tails) == list(range(shards))
        gets = len(proxy.gets)
        with Dataset(url, opened={entry[2]: documents}) as ds:
            batch = ds.read([0, 1, 2, 3])  # shard 0's records: one ranged GET, no tail first
            np.testing.assert_array_equal(batch["image"], encode(np.arange(4)))
        shard0 = [p for p, _ in proxy.gets[gets:] if "/ds/image/c/0/" in p]
        assert len(shard0) == 1, proxy.gets[gets:]
        store = open_store(url)
        key = {int(m.key.split("/")[2]): m.key for m in store.list("image/c/")}
        store.put(key[1], store.get(key[2]))  # another shard's bytes under shard 1's name
        with Dataset(url, opened={entry[2]: documents}) as ds, pytest.raises(ShardkitError):
            ds.read([4])
    finally:
        proxy.close()


def test_the_helper_leaves_the_tails_of_many_shards_to_the_readers(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above HELPER_TAIL_SHARDS shards the helper checks no tails (one request per shard at the start
    of every loader would grow with the dataset); each reader checks the tails its blocks need."""
    from shardkit.adapters import _start
    from shardkit.readers import identity

    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=4), s3.url("ds"))
    monkeypatch.setattr(_start, "HELPER_TAIL_SHARDS", 1)
    identity.open_root(url)
    entry = identity.remembered(url)
    assert entry is not None
    documents = _start._documents(url, entry[1], entry[2])
    assert documents.tails is None
