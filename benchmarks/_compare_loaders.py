"""The loaders measured by ``benchmarks/compare.py``, each run in a child process of its own.

A loader is a function ``(cfg) -> epoch_fn`` where ``epoch_fn()`` iterates one epoch as
``(keys, labels, images)`` batches. The child times all epochs, checks that the labels it got match
the keys, and saves the emitted keys. Every child imports torch, like a training process would, so
memory figures are comparable.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

Batch = tuple[np.ndarray, np.ndarray, Any]
EpochFn = Callable[[], Iterable[Batch]]


@dataclass
class RunConfig:
    """Everything a child needs (serialised as JSON on its command line)."""

    loader: str
    n: int
    shape: list[int]
    batch: int
    workers: int
    epochs: int
    seed: int
    paths: dict[str, str]
    labels_file: str
    jpeg_list: str | None = None
    wds_buffer: int = 1000
    wds_initial: int = 100
    ram_size: str = "128MiB"
    ssd_size: str = "256MiB"
    ssd_dir: str | None = None
    decode: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- torch
def _dataloader(dataset: Any, cfg: RunConfig, **kw: Any) -> Any:
    import torch

    return torch.utils.data.DataLoader(
        dataset, batch_size=cfg.batch, num_workers=cfg.workers,
        persistent_workers=cfg.workers > 0 and cfg.epochs > 1, **kw,
    )


def _torch_epochs(loader: Any) -> EpochFn:
    def epoch() -> Iterator[Batch]:
        for images, labels, keys in loader:
            yield keys.numpy(), labels.numpy(), images

    return epoch


class _PerFile:
    """torch ``Dataset``: open the JPEG with Pillow, shorter side to 224, centre crop (ImageFolder +
    Resize + CenterCrop). With ``decode=False`` (order-only runs) it returns the key without reading,
    the order being the sampler's business."""

    def __init__(self, paths: list[str], labels: np.ndarray, decode: bool) -> None:
        self.paths, self.labels, self.decode = paths, labels, decode

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        import torch
        from _compare_corpus import perfile_transform

        img = perfile_transform(self.paths[i]) if self.decode else np.zeros(1, np.uint8)
        return torch.from_numpy(img), int(self.labels[i]), i


def make_perfile(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    import torch

    paths = json.loads(Path(cfg.jpeg_list).read_text()) if cfg.jpeg_list else [""] * cfg.n
    gen = torch.Generator()
    gen.manual_seed(cfg.seed)
    return _torch_epochs(_dataloader(_PerFile(paths, labels, cfg.decode), cfg, shuffle=True, generator=gen))


def _wds_sample(shape: tuple[int, ...]) -> Callable[[dict[str, Any]], tuple[np.ndarray, int, int]]:
    def decode(s: dict[str, Any]) -> tuple[np.ndarray, int, int]:
        return np.frombuffer(s["u8"], dtype=np.uint8).reshape(shape), int(s["cls"]), int(s["__key__"])

    return decode


def make_wds(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    import webdataset as wds

    urls = sorted(str(p) for p in Path(cfg.paths["wds"]).glob("shard-*.tar"))
    # shardshuffle=True means 100 in webdataset 1.x (it warns and substitutes); say 100 directly.
    ds = (wds.WebDataset(urls, shardshuffle=100, empty_check=False)
          .shuffle(cfg.wds_buffer, initial=cfg.wds_initial)
          .map(_wds_sample(tuple(cfg.shape))))
    return _torch_epochs(_dataloader(ds, cfg))


def _mds_class() -> Any:
    from streaming import StreamingDataset

    class RawMDS(StreamingDataset):  # type: ignore[misc]
        def __init__(self, *a: Any, shape: tuple[int, ...], **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._shape = shape

        def __getitem__(self, idx: int) -> tuple[np.ndarray, int, int]:
            s = super().__getitem__(idx)
            return np.frombuffer(s["image"], dtype=np.uint8).reshape(self._shape), int(s["label"]), int(s["key"])

    return RawMDS


def make_mds(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    kw = {"shuffle_block_size": int(cfg.extra["block"])} if cfg.extra.get("block") else {}
    ds = _mds_class()(local=cfg.paths["mds"], remote=None, shuffle=True, batch_size=cfg.batch,
                      shape=tuple(cfg.shape), **kw)
    return _torch_epochs(_dataloader(ds, cfg))


# ---------------------------------------------------------------------------------------------- shardkit
def make_random_batched(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    """Full random permutation, ``payload.read(perm[b:b+B])``: read() sorts each batch's keys and
    visits each shard once with ascending offsets (order inside the batch is the permutation's)."""
    from shardkit.formats import open_dataset

    ds = open_dataset(cfg.paths["shardkit"])
    out = ds.payload.empty(cfg.batch)
    lab = ds.fields["label"]

    def epoch_gen(e: int) -> Iterator[Batch]:
        perm = _permutation(cfg, e)
        for b in range(0, cfg.n, cfg.batch):
            keys = perm[b : b + cfg.batch]
            img = ds.payload.read(keys, out[: keys.size])
            yield keys, lab[keys], img

    return _counter(epoch_gen)


def make_random_pread(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    """Full random permutation, one ``os.preadv`` per record in permutation order (no sorting)."""
    from shardkit.formats import open_dataset

    ds = open_dataset(cfg.paths["shardkit"])
    pay = ds.payload
    rps = pay.records_per_shard
    fds = [os.open(pay.shard_path(i), os.O_RDONLY) for i in range(len(pay.shards))]
    offsets = [pay.index(i).offsets.astype(np.int64) for i in range(len(pay.shards))]
    out = pay.empty(cfg.batch)
    rows = out.reshape(cfg.batch, -1)
    lab = ds.fields["label"]

    def epoch_gen(e: int) -> Iterator[Batch]:
        perm = _permutation(cfg, e)
        for b in range(0, cfg.n, cfg.batch):
            keys = perm[b : b + cfg.batch]
            for j, k in enumerate(keys.tolist()):
                s = k // rps
                got = os.preadv(fds[s], [memoryview(rows[j])], int(offsets[s][k - s * rps]))
                if got != rows.shape[1]:
                    raise OSError(f"{pay.shard_path(s)}: short read of record {k}")
            yield keys, lab[keys], out[: keys.size]

    return _counter(epoch_gen)


def _permutation(cfg: RunConfig, epoch: int) -> np.ndarray:
    """The random-access order: a uniform permutation per epoch. Seeded apart from the sampler (which
    draws ``default_rng([seed, epoch])``) so the two rows are independent tests."""
    return np.random.default_rng([cfg.seed, epoch, 1]).permutation(cfg.n)


def _counter(epoch_gen: Callable[[int], Iterator[Batch]]) -> EpochFn:
    state = {"e": 0}

    def epoch() -> Iterator[Batch]:
        e = state["e"]
        state["e"] += 1
        return epoch_gen(e)

    return epoch


def make_sampler(cfg: RunConfig, labels: np.ndarray) -> EpochFn:
    """shardkit's TieredSampler: one sampler, all epochs in one iteration, split per epoch by count."""
    from shardkit.readers import TieredSampler

    tiers = cfg.extra["tiers"]
    kw: dict[str, Any] = {}
    if "ssd" in tiers:
        kw = {"ssd_size": cfg.ssd_size, "ssd_dir": cfg.ssd_dir}
    sampler = TieredSampler(cfg.paths["shardkit"], tiers=tiers, ram_size=cfg.ram_size, batch_size=cfg.batch,
                            epochs=cfg.epochs, seed=cfg.seed, **kw)
    it = iter(sampler)
    pending: list[Batch] = []
    _SAMPLERS.append(sampler)

    def epoch() -> Iterator[Batch]:
        left = cfg.n
        while left > 0:
            if pending:
                batch = pending.pop()
            else:
                d = next(it)
                batch = (d["key"], d["label"], d["image"])
            if batch[0].size > left:  # a batch spanning two epochs (not expected): split it
                pending.append(tuple(x[left:] for x in batch))  # type: ignore[arg-type]
                batch = tuple(x[:left] for x in batch)  # type: ignore[assignment]
            left -= batch[0].size
            yield batch

    return epoch


_SAMPLERS: list[Any] = []

LOADERS: dict[str, Callable[[RunConfig, np.ndarray], EpochFn]] = {
    "perfile": make_perfile,
    "random-batched": make_random_batched,
    "random-pread": make_random_pread,
    "wds": make_wds,
    "mds": make_mds,
    "sampler": make_sampler,
}


def run_child(cfg: RunConfig, result: Path) -> None:
    """Run ``cfg.epochs`` epochs, save keys ``[epochs, n]`` and timings to ``result`` (npz + json)."""
    import torch  # noqa: F401 - every child carries torch, like a training process

    warnings.filterwarnings("ignore")
    labels = np.load(cfg.labels_file)
    t0 = time.perf_counter()
    epoch_fn = LOADERS[cfg.loader](cfg, labels)
    keys = np.empty((cfg.epochs, cfg.n), dtype=np.int64)
    batch_sizes: list[int] = []
    bad_labels = 0
    first_batch = None
    checksum = 0
    for e in range(cfg.epochs):
        pos = 0
        for k, lab, img in epoch_fn():
            k = np.asarray(k, dtype=np.int64)
            if pos + k.size > cfg.n:
                raise RuntimeError(f"{cfg.loader}: epoch {e} emitted more than {cfg.n} records")
            keys[e, pos : pos + k.size] = k
            pos += k.size
            bad_labels += int(np.count_nonzero(np.asarray(lab) != labels[k]))
            if e == 0:
                batch_sizes.append(int(k.size))
                if first_batch is None:
                    first_batch = time.perf_counter() - t0
            if cfg.decode:
                # Touch the payload (one byte per record) so lazily produced data is really produced.
                arr = img.numpy() if hasattr(img, "numpy") else np.asarray(img)
                checksum += int(arr.reshape(arr.shape[0], -1)[:, -1].sum())
        if pos != cfg.n:
            raise RuntimeError(f"{cfg.loader}: epoch {e} emitted {pos} records, expected {cfg.n}")
    seconds = time.perf_counter() - t0
    extra: dict[str, Any] = {}
    for s in _SAMPLERS:
        st = s.stats
        extra = {"disk_bytes": st.disk.bytes_read, "ssd_bytes": st.ssd.bytes_read,
                 "ssd_written": st.ssd_bytes_written, "stall_s": st.stall_seconds,
                 "K2": s.ram_block, "K1": s.ssd_block}
        s.close()
    np.save(result.with_suffix(".npy"), keys)
    result.with_suffix(".json").write_text(json.dumps({
        "seconds": seconds, "first_batch_s": first_batch, "batch_sizes": batch_sizes, "bad_labels": bad_labels,
        "extra": extra, "checksum": checksum,
    }))


def main(argv: list[str]) -> None:
    cfg = RunConfig(**json.loads(Path(argv[0]).read_text()))
    run_child(cfg, Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
