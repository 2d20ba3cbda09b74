"""One consumer of a node-sharing test, run in its own process:

``python -m tests.readers.node_job DATASET OUT.json --rank R --world W --epochs E --barrier DIR [--kill]``

Builds a sampler (rank R of W, a static cache of ``--cache`` records), waits at a file barrier in
``DIR`` before every epoch so the processes run their epochs together, checks every batch, and
writes JSON: the keys of each epoch, disk records read per epoch, the field values it sees, which
shared regions this process created, and the shared files it maps. ``--kill`` SIGKILLs itself after
the first epoch (a crashed process never releases its regions).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np

from shardkit.readers import TieredSampler
from shardkit.tiers import shm as node
from tests.helpers.sampler_data import check_batch


def _barrier(directory: Path, name: str, parties: int, timeout: float = 120.0) -> None:
    (directory / f"{name}.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(f"{name}.*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: {len(list(directory.glob(f'{name}.*')))} of {parties} arrived")
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dataset")
    p.add_argument("out")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--cache", type=int, required=True)
    p.add_argument("--ram", type=int, required=True)
    p.add_argument("--barrier", required=True)
    p.add_argument("--kill", action="store_true")
    a = p.parse_args()
    created: list[str] = []
    real_attach = node.attach

    def spy(*args: object, **kw: object) -> node.SharedRegion | None:
        region = real_attach(*args, **kw)  # type: ignore[arg-type]
        if region is not None and region.created:
            created.append(region.name)
        return region

    node.attach = spy  # type: ignore[assignment]
    s = TieredSampler(a.dataset, ram_size=f"{a.ram}records", static_cache=f"{a.cache}records", batch_size=2,
                      rank=a.rank, world_size=a.world, seed=5, epochs=1)
    barrier = Path(a.barrier)
    keys, disk = [], []
    for e in range(a.epochs):
        _barrier(barrier, f"epoch{e}", a.world)
        before = s.stats.disk.records
        it = iter(s)
        got = [check_batch(next(it))]
        # Every process now holds this epoch's order region; without this a process slowed by a loaded
        # machine could start after the others had finished the epoch and freed it, and create it anew
        # (correct, but the test counts creations).
        _barrier(barrier, f"first{e}", a.world)
        got += [check_batch(b) for b in it]
        keys.append(np.concatenate(got).tolist())
        disk.append(s.stats.disk.records - before)
        if a.kill:
            maps = Path("/proc/self/maps").read_text()
            Path(a.out).write_text(json.dumps({"maps": maps}))
            os.kill(os.getpid(), signal.SIGKILL)
    maps = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if str(node.SHM_ROOT) in line]
    out = {
        "keys": keys, "disk": disk, "created": created, "maps": sorted(set(maps)),
        "fields": {k: np.asarray(v).tolist() for k, v in s.fields.items()},
        "writeable": {k: bool(v.flags.writeable) for k, v in s.fields.items()},
        "pinned": s.pinned_keys.tolist(),
        "mapped_files": s._cache is not None and s._cache.mapped is not None,
    }
    _barrier(barrier, "done", a.world)  # hold every region until all processes reported
    Path(a.out).write_text(json.dumps(out))
    s.close()


if __name__ == "__main__":
    main()
