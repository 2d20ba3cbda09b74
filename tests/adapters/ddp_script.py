"""Run by test_torch.py under ``torch.distributed.run --nproc-per-node 2``: each rank iterates two
epochs through a 2-worker DataLoader and writes the keys it received to ``OUT/rank<r>.json``.

Usage: ddp_script.py DATASET OUT SEED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from shardkit.adapters.torch import ShardIterableDataset


def main() -> None:
    dataset, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    ds = ShardIterableDataset(dataset, batch_size=4, seed=seed, num_workers=2)
    loader = ds.loader(num_workers=2)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append([int(k) for batch in loader for k in batch["key"]])
    (out / f"rank{dist.get_rank()}.json").write_text(
        json.dumps({"rank": ds.rank, "world_size": ds.world_size, "epochs": epochs})
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
