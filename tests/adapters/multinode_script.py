"""Run by test_multinode.py under torchrun: node-aware loading (``locality=True``) with the torch adapter.

Usage: multinode_script.py DATASET OUT SEED PHASE EPOCHS

``train``: launched as two torchrun agents of two ranks each (two simulated nodes on this host; each
node gets its own node-cache directory ``OUT/node<GROUP_RANK>``; the node count comes from torchrun's
environment). Each rank runs EPOCHS epochs and records its batches' keys and how many records it
read from storage and from its node's cache in each epoch; then, in epoch EPOCHS, the exact state
after the first global batch and every batch of that epoch. Writes ``OUT/rank<r>.json``.

``resume``: launched as one agent of two ranks with twice the batch size (the same global batch),
resumes from ``OUT/state.json`` and writes ``OUT/resumed<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from shardkit.adapters.torch import ShardIterableDataset

BATCH = 4
CACHE = {"static_cache": "5records", "node_cache": "13records"}


def _counts(ds: ShardIterableDataset) -> tuple[int, int]:
    """(records read from storage, records served from the node's caches) by this pass's sampler."""
    s = ds._sampler
    return (0, 0) if s is None else (int(s.stats.disk.records), int(s.stats.cache.records + s.stats.node.records))


def train(dataset: str, out: Path, seed: int, epochs: int) -> None:
    node = int(os.environ["GROUP_RANK"])
    cache_dir = out / f"node{node}"
    cache_dir.mkdir(exist_ok=True)
    ds = ShardIterableDataset(dataset, batch_size=BATCH, seed=seed, locality=True, node_cache_dir=cache_dir,
                              ram_size="40records", drop_last=True, **CACHE)  # fmt: skip
    loader = ds.loader(num_workers=0)
    record: dict[str, list] = {"epochs": [], "reads": [], "hits": []}  # type: ignore[type-arg]
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        record["epochs"].append([b["key"].tolist() for b in loader])
        # Every pass builds its sampler; the dataset holds the node's caches across passes.
        reads, hits = _counts(ds)
        record["reads"].append(reads)
        record["hits"].append(hits)
        # Training synchronises the ranks every step (all-reduce); here once per epoch is enough for
        # the test's accounting: which rank of a node first reads a pinned record must not depend on
        # one rank running an epoch ahead of the other.
        dist.barrier()
    ds.set_epoch(epochs)
    it = iter(loader)
    batches = [next(it)["key"].tolist()]
    state = ds.state_dict()  # exact: num_workers=0, after one global batch
    batches += [b["key"].tolist() for b in it]
    record.update(rank=ds.rank, world_size=ds.world_size, nodes=ds.nodes, node=node, state=state, last=batches)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    ds.close()


def resume(dataset: str, out: Path, seed: int) -> None:
    state = json.loads((out / "state.json").read_text())
    cache_dir = out / "resume-node"
    cache_dir.mkdir(exist_ok=True)
    ds = ShardIterableDataset(dataset, batch_size=2 * BATCH, seed=seed, locality=True, node_cache_dir=cache_dir,
                              ram_size="60records", drop_last=True, **CACHE)  # fmt: skip
    ds.load_state_dict(state)
    batches = [b["key"].tolist() for b in ds.loader(num_workers=0)]
    result = {"rank": ds.rank, "world_size": ds.world_size, "nodes": ds.nodes, "batches": batches}
    (out / f"resumed{dist.get_rank()}.json").write_text(json.dumps(result))
    ds.close()


def main() -> None:
    dataset, out, seed, phase, epochs = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo")
    try:
        if phase == "train":
            train(dataset, out, seed, epochs)
        else:
            resume(dataset, out, seed)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
