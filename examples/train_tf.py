"""Train a tiny classifier on a shardkit dataset through the TensorFlow adapter with ``model.fit``.

    python examples/train_tf.py out/imagefolder [--epochs 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from types import ModuleType

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def import_tensorflow_quietly() -> ModuleType:
    """Import TensorFlow without its start-up banners.

    While it loads, TensorFlow's C++ side writes notices straight to file descriptor 2 (absl's
    "All log messages before absl::InitializeLog()..." and the oneDNN notice), past
    TF_CPP_MIN_LOG_LEVEL. They are held back during the import only, and shown after all if the
    import fails.
    """
    with tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return tensorflow


tf = import_tensorflow_quietly()

from shardkit.adapters.tf import make_tf_dataset  # noqa: E402  (after TensorFlow, imported quietly above)
from shardkit.formats import open_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    with open_dataset(args.dataset) as ds:
        classes = len(ds.label_names or []) or int(ds.fields["label"].max()) + 1
        shape = ds.meta.record.shape
    data = make_tf_dataset(args.dataset, batch_size=args.batch_size, seed=0, as_tuple=("image", "label"),
                           scale="float")  # each fit epoch is one full pass = one new permutation
    print("element_spec:", data.element_spec)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input(shape=shape),
        tf.keras.layers.AveragePooling2D(pool_size=max(1, shape[0] // 8)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(classes),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.05),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(data, epochs=args.epochs, verbose=2, shuffle=False)  # shardkit already shuffles, exactly


if __name__ == "__main__":
    main()
