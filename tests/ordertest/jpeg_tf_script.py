"""The tf.data half of test_jpeg_consumers.py, in its own process (TensorFlow takes seconds to import).

    python jpeg_tf_script.py JPEG_DATASET CORRUPT_DATASET OUT.json SEED EPOCHS

Writes the keys of every epoch, whether every batch held its records' decoded pixels, and what
iterating the corrupt dataset raised (its type and message).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from shardkit.adapters.tf import make_tf_dataset
from shardkit.formats import open_dataset


def main() -> None:
    path, corrupt, out, seed, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    with open_dataset(path) as ds:
        decoded = ds.payload.read(np.arange(ds.num_records))
    res: dict[str, object] = {}
    tfds = make_tf_dataset(path, batch_size=8, seed=seed, epochs=epochs, static_cache=0, decode_workers=2)
    keys, pixels_ok = [], True
    for batch in tfds:
        k = batch["key"].numpy()
        pixels_ok &= bool(np.array_equal(batch["image"].numpy(), decoded[k]))
        keys.append(k.tolist())
    res["keys"], res["pixels_ok"] = keys, pixels_ok
    try:
        for _ in make_tf_dataset(corrupt, batch_size=8, seed=seed, static_cache=0, decode_workers=2):
            pass
        res["error"] = None
    except Exception as exc:  # what tf.data raises for the sampler's error
        res["error"] = {"type": type(exc).__name__, "message": str(exc)}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
