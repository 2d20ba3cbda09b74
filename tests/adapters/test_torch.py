"""PyTorch adapter with the real framework and the real tiered sampler.

The expected order is computed independently from the sampler's documented schedule: epoch ``e``
is ``epoch_permutation(seed, e, N)``, and with ``in_order`` DataLoaders a single rank receives its
consumers' slices round-robin, which is exactly ``pi`` for one rank.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _adapter_data import N_KEYED, NUM_CLASSES, SHAPE, blobs, decode_keys

torch = pytest.importorskip("torch", reason="the 'torch' extra is not installed")  # CI installs it

from torch.utils.data import DataLoader  # noqa: E402

from shardkit.adapters.torch import ShardIterableDataset, ShardMapDataset  # noqa: E402
from shardkit.errors import ConfigError, SamplerError  # noqa: E402
from shardkit.readers import epoch_permutation  # noqa: E402

HERE = Path(__file__).parent
SEED = 7


def _check_batch(batch: dict[str, torch.Tensor], layout: str = "NHWC") -> np.ndarray:
    """Every entry describes the same records; returns their keys."""
    keys = batch["key"].numpy()
    assert batch["key"].dtype == torch.int64 and batch["label"].dtype == torch.int64
    np.testing.assert_array_equal(decode_keys(batch["image"].numpy(), layout), keys)
    np.testing.assert_array_equal(batch["label"].numpy(), keys % NUM_CLASSES)
    np.testing.assert_array_equal(batch["weight"].numpy(), np.stack([keys, -keys], 1).astype(np.float32))
    return keys


class _StatsDataset(ShardIterableDataset):
    """Appends one marker item per consumer with what its sampler read from disk and delivered."""

    def __iter__(self):  # type: ignore[override]
        yield from super().__iter__()
        s = self._sampler.stats
        info = torch.utils.data.get_worker_info()
        yield {"stats": torch.tensor([0 if info is None else info.id, s.disk.records, s.records])}


def _pass(loader: DataLoader) -> tuple[list[np.ndarray], dict[int, int], dict[int, int]]:
    """One pass of a _StatsDataset loader: each batch's keys (checked), and per consumer the records
    its sampler read from disk and delivered."""
    keys, disk, delivered = [], {}, {}
    for batch in loader:
        if "stats" in batch:
            wid, read, got = batch["stats"].tolist()
            disk[wid], delivered[wid] = read, got
            continue
        assert batch["image"].dtype == torch.uint8 and tuple(batch["image"].shape[1:]) == SHAPE
        keys.append(_check_batch(batch))
    return keys, disk, delivered


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_exactly_once_per_epoch_in_sampler_order(keyed: Path, workers: int) -> None:
    """The uncached contract (static cache off): every epoch each consumer reads exactly what it
    delivers. test_cache_held_across_passes proves the cached default."""
    ds = _StatsDataset(keyed, batch_size=8, seed=SEED, static_cache=0)
    loader = ds.loader(num_workers=workers)
    for epoch in range(2):  # no set_epoch: a finished pass advances the shared epoch
        keys, disk, delivered = _pass(loader)
        order = np.concatenate(keys)
        np.testing.assert_array_equal(order, epoch_permutation(SEED, epoch, N_KEYED))
        # No worker re-reads another's records: each read exactly what it delivered.
        assert len(disk) == max(1, workers)
        assert disk == delivered and sum(disk.values()) == N_KEYED
        assert len(keys) == len(ds)  # len() counts batches of all workers, ragged tails included
    assert ds.epoch == 2


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_cache_held_across_passes(keyed: Path, workers: int, persistent: bool) -> None:
    """Default budget covers the dataset: the first pass reads every record once (filling the node's
    cache), later passes read nothing from storage though every pass builds new samplers (in fresh
    worker processes too, without persistent workers), because the dataset object holds the cache;
    the order is unchanged."""
    ds = _StatsDataset(keyed, batch_size=8, seed=SEED)
    loader = ds.loader(num_workers=workers, **({"persistent_workers": False} if workers and not persistent else {}))
    assert loader.persistent_workers == persistent
    for epoch in range(3):
        keys, disk, delivered = _pass(loader)
        np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, epoch, N_KEYED))
        assert sum(delivered.values()) == N_KEYED
        assert disk == (delivered if epoch == 0 else dict.fromkeys(delivered, 0)), (epoch, disk)


def test_two_ranks_explicit_with_workers_are_disjoint_and_cover(keyed: Path) -> None:
    per_rank = []
    for rank in range(2):
        ds = ShardIterableDataset(keyed, batch_size=4, seed=SEED, rank=rank, world_size=2, num_workers=3)
        ds.set_epoch(3)
        batches = [_check_batch(b) for b in ds.loader(num_workers=3)]
        assert len(batches) == len(ds)
        per_rank.append(np.concatenate(batches))
    assert not set(per_rank[0]) & set(per_rank[1])
    # Rank r's slice of global batch g (6 consumers of 4 records) is pi[24g + 12r : 24g + 12r + 12].
    pi = epoch_permutation(SEED, 3, N_KEYED)
    expected = [np.concatenate([pi[g + 12 * r : g + 12 * r + 12] for g in range(0, N_KEYED, 24)]) for r in range(2)]
    for got, want in zip(per_rank, expected):
        np.testing.assert_array_equal(got, want)


def test_torchrun_two_ranks_gloo(keyed: Path, tmp_path: Path) -> None:
    """Two ranks under ``torch.distributed.run`` (gloo, CPU), two workers each, two epochs."""
    out = tmp_path / "ranks"
    out.mkdir()
    path = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "ddp_script.py"), str(keyed), str(out), str(SEED)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world_size"] == 2
    for epoch in range(2):
        keys = [np.asarray(res["epochs"][epoch], dtype=np.int64) for res in results]
        assert not set(keys[0]) & set(keys[1])
        np.testing.assert_array_equal(np.sort(np.concatenate(keys)), np.arange(N_KEYED))
        # Ranks hold alternating runs of the epoch's order: global batch = 2 ranks x 2 workers x 4.
        pi = epoch_permutation(SEED, epoch, N_KEYED)
        for r in range(2):
            want = np.concatenate([pi[g + 8 * r : g + 8 * r + 8] for g in range(0, N_KEYED, 16)])
            np.testing.assert_array_equal(keys[r], want)


def test_layout_scale_and_pin_memory(keyed: Path) -> None:
    ds = ShardIterableDataset(keyed, batch_size=16, layout="NCHW", seed=SEED)
    batch = next(iter(DataLoader(ds, batch_size=None, num_workers=1, pin_memory=True)))
    assert tuple(batch["image"].shape) == (16, 3, 8, 8) and batch["image"].is_contiguous()
    _check_batch(batch, layout="NCHW")

    ds = ShardIterableDataset(keyed, batch_size=16, layout="NCHW", scale="float", seed=SEED)
    batch = next(iter(ds))
    image = batch["image"]
    assert image.dtype == torch.float32 and tuple(image.shape) == (16, 3, 8, 8) and image.is_contiguous()
    raw = next(iter(ShardIterableDataset(keyed, batch_size=16, seed=SEED)))["image"]
    torch.testing.assert_close(image, raw.permute(0, 3, 1, 2).float() / 255.0)
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0


def test_tensors_share_the_batch_memory(keyed: Path) -> None:
    """Zero copy: the payload tensor is the sampler's array (writing one shows in the other)."""
    from shardkit.adapters.torch import to_tensors

    batch = {"image": np.zeros((2, *SHAPE), np.uint8), "key": np.arange(2)}
    tensors = to_tensors(batch, "image")
    batch["image"][1, 2, 3, 0] = 9
    assert int(tensors["image"][1, 2, 3, 0]) == 9
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    assert to_tensors({"x": readonly}, "image")["x"].shape == (3,)  # copied, no warning


def test_nchw_moves_the_channel_axis_first() -> None:
    """``layout="NCHW"`` presents ``(H, W, C)`` records as ``(C, H, W)``, batched or one record."""
    from shardkit.adapters._options import PayloadOptions
    from shardkit.adapters.torch import to_tensors

    nchw = PayloadOptions(layout="NCHW")
    assert tuple(to_tensors({"image": np.zeros((2, 224, 200, 3), np.uint8)}, "image", nchw)["image"].shape) == (2, 3, 224, 200)
    assert tuple(to_tensors({"image": np.zeros((224, 200, 3), np.uint8)}, "image", nchw, batched=False)["image"].shape) == (3, 224, 200)


def test_unbatched_with_own_collate(keyed: Path) -> None:
    ds = ShardIterableDataset(keyed, batch_size=8, unbatched=True, seed=SEED, num_workers=2)
    sample = next(iter(ds))
    assert tuple(sample["image"].shape) == SHAPE and sample["key"].dim() == 0
    loader = ds.loader(num_workers=2, batch_size=10)
    keys = np.concatenate([_check_batch(b) for b in loader])
    np.testing.assert_array_equal(np.sort(keys), np.arange(N_KEYED))
    assert len(ds) == N_KEYED


def test_resume_without_workers_continues_exactly(keyed: Path) -> None:
    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED)
    ds.set_epoch(1)
    it = iter(ds)
    first = np.concatenate([next(it)["key"].numpy() for _ in range(5)])
    state = ds.state_dict()
    assert state["epoch"] == 1 and state["position"] == 40
    json.dumps(state)  # checkpointable

    fresh = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    fresh.load_state_dict(state)
    assert len(fresh) == 8  # 63 records left, 2 workers of 8: 4 global batches x 2
    rest = np.concatenate([_check_batch(b) for b in fresh.loader(num_workers=2)])
    np.testing.assert_array_equal(np.concatenate([first, rest]), epoch_permutation(SEED, 1, N_KEYED))
    # The next pass starts the next epoch from its beginning.
    again = np.concatenate([b["key"].numpy() for b in fresh.loader(num_workers=2)])
    np.testing.assert_array_equal(again, epoch_permutation(SEED, 2, N_KEYED))


def test_resume_with_workers_from_batch_count(keyed: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = ShardIterableDataset(keyed, batch_size=4, seed=SEED, num_workers=3)
    with pytest.raises(SamplerError, match="state_dict_after"):
        ds.state_dict()
    taken = []
    for i, batch in enumerate(ds.loader(num_workers=3)):
        taken.append(batch["key"].numpy())
        if i + 1 == 6:
            break
    state = ds.state_dict_after(6, epoch=0)
    assert state["epoch"] == 0 and state["position"] == 24

    resumed = ShardIterableDataset(keyed, batch_size=4, seed=SEED)  # another worker count
    resumed.load_state_dict(state)
    rest = np.concatenate([b["key"].numpy() for b in resumed.loader(num_workers=0)])
    np.testing.assert_array_equal(np.concatenate([*taken, rest]), epoch_permutation(SEED, 0, N_KEYED))

    with caplog.at_level(logging.WARNING, logger="shardkit.adapters.torch"):
        assert ds.state_dict_after(7, epoch=0)["position"] == 24  # rounds down to whole global batches
    assert "delivered again" in caplog.text
    assert ds.state_dict_after(len(ds), epoch=0) | {"start_epoch": 0} == {**state, "epoch": 1, "position": 0}
    with pytest.raises(ConfigError):
        ds.state_dict_after(len(ds) + 1, epoch=0)


def test_set_epoch_reaches_persistent_workers(keyed: Path) -> None:
    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    loader = ds.loader(num_workers=2, persistent_workers=True)
    for epoch in (5, 2):
        ds.set_epoch(epoch)
        keys = np.concatenate([b["key"].numpy() for b in loader])
        np.testing.assert_array_equal(keys, epoch_permutation(SEED, epoch, N_KEYED))


def test_map_dataset(keyed: Path) -> None:
    ds = ShardMapDataset(keyed)
    assert len(ds) == N_KEYED
    record = ds[17]
    assert tuple(record["image"].shape) == SHAPE and int(record["key"]) == 17 and int(record["label"]) == 1
    assert int(ds[-1]["key"]) == N_KEYED - 1
    with pytest.raises(IndexError):
        ds[N_KEYED]
    loader = DataLoader(ds, batch_size=10, num_workers=2)
    keys = np.concatenate([_check_batch(b) for b in loader])
    np.testing.assert_array_equal(keys, np.arange(N_KEYED))
    chw = ShardMapDataset(keyed, layout="NCHW", scale="float")[5]["image"]
    assert chw.shape == (3, 8, 8) and chw.dtype == torch.float32


def test_bad_options_are_config_errors(keyed: Path) -> None:
    with pytest.raises(ConfigError, match="layout"):
        ShardIterableDataset(keyed, layout="CHW")
    with pytest.raises(ConfigError, match="scale"):
        ShardIterableDataset(keyed, scale="int")
    with pytest.raises(ConfigError, match="rank"):
        ShardIterableDataset(keyed, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="batch_size"):
        ShardIterableDataset(keyed).loader(batch_size=4)


def test_audio_refuses_nchw(tmp_path: Path) -> None:
    from shardkit.formats import DatasetWriter, FieldSpec

    with DatasetWriter(tmp_path / "a", kind="test", payload="audio", record=FieldSpec((16,), "int16")) as w:
        w.write({"audio": np.full((5, 16), -32768, np.int16)})
    with pytest.raises(ConfigError, match="NCHW"):
        ShardIterableDataset(tmp_path / "a", layout="NCHW")
    batch = next(iter(ShardIterableDataset(tmp_path / "a", batch_size=5, scale="float")))
    assert batch["audio"].dtype == torch.float32 and float(batch["audio"].min()) == -1.0


# ---------------------------------------------------------------------- training
class _MeanColourLogReg(torch.nn.Module):
    """Multinomial logistic regression on the centred mean colour (the blobs' class signal)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [n, H, W, C] float in [0, 1]
        return self.linear((images.mean(dim=(1, 2)) - 0.5) * 16.0)


def _train_logreg(batches, epochs: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = _MeanColourLogReg()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        for x, y in batches(epoch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def _accuracy(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(images).float() / 255).argmax(1).numpy() == labels).mean())


def test_training_matches_in_memory_shuffle(blob_train) -> None:
    """Tolerance: 0.03 absolute accuracy on 2000 held-out records. The blobs' Bayes accuracy is about
    0.85; both runs see every record once per epoch, in different uniform orders, so they converge to
    the same decision boundary and differ only by SGD noise."""
    path, images, labels = blob_train
    test_images, test_labels = blobs(2000, seed=99)
    ds = ShardIterableDataset(path, batch_size=32, scale="float", seed=3, num_workers=2)
    loader = ds.loader(num_workers=2)
    ours = _train_logreg(lambda e: ((b["image"], b["label"]) for b in loader), epochs=4, seed=0)

    reference = torch.utils.data.TensorDataset(torch.from_numpy(images).float() / 255, torch.from_numpy(labels))
    ref_loader = DataLoader(reference, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(3))
    theirs = _train_logreg(lambda e: iter(ref_loader), epochs=4, seed=0)

    acc_ours, acc_theirs = _accuracy(ours, test_images, test_labels), _accuracy(theirs, test_images, test_labels)
    assert acc_theirs > 0.85, acc_theirs  # the task is learnable at all
    assert abs(acc_ours - acc_theirs) <= 0.03, (acc_ours, acc_theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_is_a_dataset_source(keyed_mixture: list[Path], workers: int) -> None:
    """ShardIterableDataset(shardkit.mix(...)) with DataLoader workers: batches carry ``dataset`` and
    the record's key in it; the workers' slices, in order, are the mixture's epoch; a resumed
    dataset with another worker count continues the same order."""
    from _adapter_data import MIX_SIZES

    import shardkit

    m = shardkit.mix(list(zip(keyed_mixture, [3, 1])), epoch_size=50)
    plan = m.plan(SEED)
    first = np.array([0, MIX_SIZES[0]])
    ds = ShardIterableDataset(m, batch_size=4, seed=SEED, num_workers=workers)
    assert len(ds) == 13
    got = []
    for batch in ds.loader(num_workers=workers):
        d, k = batch["dataset"].numpy(), batch["key"].numpy()
        np.testing.assert_array_equal(decode_keys(batch["image"].numpy()), first[d] + k)
        got.append(np.stack([d, k], 1))
    np.testing.assert_array_equal(np.concatenate(got), plan.pairs(0))
    state = ds.state_dict_after(6, epoch=1)
    resumed = ShardIterableDataset(m, batch_size=4, seed=SEED, num_workers=0)
    resumed.load_state_dict(state)
    rest = [np.stack([b["dataset"].numpy(), b["key"].numpy()], 1) for b in resumed.loader(num_workers=0)]
    np.testing.assert_array_equal(np.concatenate(rest), plan.pairs(1)[24:])


# ---------------------------------------------------------------------- persistent workers
def _keys_of(loader: DataLoader) -> np.ndarray:
    return np.concatenate([_check_batch(b) for b in loader])


def test_workers_persist_across_epochs_by_default(keyed: Path) -> None:
    """loader() keeps its workers alive across epochs unless told otherwise; two epochs through
    persistent workers are two different full permutations, each exactly the one the non-persistent
    path gives for the same seed, and len(), epoch and state_dict_after() stay right."""
    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    loader = ds.loader(num_workers=2)
    assert loader.persistent_workers
    assert not ds.loader(num_workers=0).persistent_workers  # DataLoader refuses it without workers
    fresh = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    fresh_loader = fresh.loader(num_workers=2, persistent_workers=False)
    assert not fresh_loader.persistent_workers
    seen = []
    for epoch in range(2):
        assert ds.epoch == epoch
        batches = [_check_batch(b) for b in loader]
        assert len(batches) == len(ds)
        assert ds.state_dict_after(len(batches), epoch=epoch)["epoch"] == epoch + 1
        keys = np.concatenate(batches)
        np.testing.assert_array_equal(np.sort(keys), np.arange(N_KEYED))  # each record exactly once
        np.testing.assert_array_equal(keys, _keys_of(fresh_loader))
        np.testing.assert_array_equal(keys, epoch_permutation(SEED, epoch, N_KEYED))
        seen.append(keys)
    assert not np.array_equal(seen[0], seen[1])
    assert ds.epoch == fresh.epoch == 2


class _LateWorker(ShardIterableDataset):
    """Worker 1 starts its pass only after worker 0 has finished its own (``done`` exists), the
    order a slow worker start (spawn under load) can produce."""

    def __init__(self, *args: object, done: Path, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.done = done

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1:
            for _ in range(6000):  # waits for an event, up to 60 s; the order does not depend on timing
                if self.done.exists():
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("worker 0 never finished its pass")
        yield from super().__iter__()
        if info is not None and info.id == 0:
            self.done.touch()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_starting_after_another_finished_reads_the_same_epoch(keyed: Path, tmp_path: Path,
                                                                         persistent: bool) -> None:
    """One batch per worker: worker 0 finishes its pass (with prefetching it is asked for its end)
    before worker 1 starts; worker 1 must still deliver the pass's epoch, not the next one."""
    ds = _LateWorker(keyed, batch_size=64, seed=SEED, num_workers=2, done=tmp_path / "done")
    loader = ds.loader(num_workers=2, persistent_workers=persistent)
    for epoch in range(2):
        (tmp_path / "done").unlink(missing_ok=True)
        np.testing.assert_array_equal(_keys_of(loader), epoch_permutation(SEED, epoch, N_KEYED))
        assert ds.epoch == epoch + 1


def test_load_state_dict_after_persistent_workers_started_is_refused(keyed: Path) -> None:
    """Persistent workers hold the dataset as it was when they started: a resume state loaded later
    would reach the epoch but not the position, so the next pass says to build a new loader."""
    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    loader = ds.loader(num_workers=2)
    _keys_of(loader)
    ds.load_state_dict(ds.state_dict_after(4, epoch=1))
    with pytest.raises(SamplerError, match="new loader"):
        _keys_of(loader)
    rest = _keys_of(ds.loader(num_workers=2))
    np.testing.assert_array_equal(rest, epoch_permutation(SEED, 1, N_KEYED)[32:])


def test_workers_first_batches_do_not_wait_for_the_holder(keyed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over an object store the main process builds its node-shared holder (which opens the dataset)
    only once the workers run, and in a thread of its own: the whole first epoch is delivered while
    that build is held back (here on purpose, as a slow store would), and the holder is kept once it
    is built. The dataset is local; it is declared remote to take the object-store path."""
    import shardkit.adapters.torch as adapter

    monkeypatch.setattr(adapter, "remote", lambda paths: True)
    monkeypatch.setattr(adapter, "forkable", lambda: True)
    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2, static_cache=0)
    assert ds._holder_pending and ds._holder is None
    build, started, gate = ds._new_holder, threading.Event(), threading.Event()

    def held_back() -> object:
        started.set()
        if not gate.wait(30):
            raise RuntimeError("the holder's build was never let go")
        return build()

    monkeypatch.setattr(ds, "_new_holder", held_back)
    loader = ds.loader(num_workers=2)
    keys = np.concatenate([_check_batch(b) for b in loader])  # the holder is held back all along
    np.testing.assert_array_equal(keys, epoch_permutation(SEED, 0, N_KEYED))
    assert started.is_set() and ds._holder is None
    gate.set()
    building = ds._holder_thread
    if building is not None:
        building.join(60)
    assert ds._holder is not None and not ds._holder_pending
    ds.close()
    assert ds._holder is None
