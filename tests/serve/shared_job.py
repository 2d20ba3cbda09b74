"""A training job for the shared-server tests, run in its own process:

``python -m tests.readers.shared_job NAME OUT.npy --job-seed S --epochs E --batch B [--kill-after K]``

Checks every batch (payload belongs to its key), writes the keys as ``(epochs, N)`` int64 to OUT.
With ``--kill-after K`` it SIGKILLs itself after K batches (a crashing job); with ``--stop-after K``
it SIGSTOPs itself (a hung job that keeps its socket open).
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np

from shardkit.readers import SharedSampler
from tests.helpers.sampler_data import check_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--job-seed", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--dataset", default=None)
    a = p.parse_args()
    s = SharedSampler(a.name, job_seed=a.job_seed, batch_size=a.batch, epochs=a.epochs, dataset=a.dataset,
                      connect_timeout=30.0)
    keys, epochs = [], []
    for i, batch in enumerate(s):
        keys.append(check_batch(batch))
        epochs.append(s.epoch)
        if a.kill_after is not None and i + 1 >= a.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.stop_after is not None and i + 1 >= a.stop_after:
            os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: only the lease can tell
    flat = np.concatenate(keys)
    np.save(a.out, flat.reshape(a.epochs, -1))
    np.save(a.out.replace(".npy", "-epochs.npy"), np.array(sorted(set(epochs)), dtype=np.int64))


if __name__ == "__main__":
    main()
