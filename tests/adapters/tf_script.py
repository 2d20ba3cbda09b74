"""Every TensorFlow check that needs a live runtime, in one process (TensorFlow takes seconds to
import, and logical CPU devices must be configured before the runtime starts).

Usage: tf_script.py KEYED BLOBS OUT.json SEED. Writes raw observations; test_tf.py asserts on them.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
import tensorflow as tf
from _adapter_data import OPTION_CASES, STORE_CASES, blobs, write_keyed_mixture

import shardkit
from shardkit.adapters._ahead import NextPass
from shardkit.adapters.tf import adopt_payload, make_tf_dataset
from shardkit.errors import SamplerError
from shardkit.formats.reader import aligned_empty
from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.stores import LocalStore, StoreOptions
from shardkit.tiers import shm as node

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def spec_of(ds: tf.data.Dataset) -> object:
    def one(s: tf.TensorSpec) -> list:
        return [list(s.shape.as_list()), s.dtype.name]

    es = ds.element_spec
    if isinstance(es, dict):
        return {k: one(v) for k, v in es.items()}
    return [one(v) for v in es]


def autotune_states(keyed: str) -> dict[str, object]:
    """``autotune.enabled`` of the datasets make_tf_dataset returns (each prefetch and presentation),
    and of one the user turned it on again for; the batches an untuned dataset still delivers."""
    variants: dict[str, dict[str, Any]] = {
        "default": {}, "no prefetch": {"prefetch": False}, "prefetch 2": {"prefetch": 2},
        "presented": {"scale": "float", "as_tuple": ("image", "label")},
    }  # fmt: skip
    states: dict[str, object] = {}
    for name, kw in variants.items():
        ds = make_tf_dataset(keyed, batch_size=8, **kw)
        states[name] = [ds.options().autotune.enabled, sum(1 for _ in ds)]
    tuned = tf.data.Options()
    tuned.autotune.enabled = True
    states["turned on by the user"] = make_tf_dataset(keyed, batch_size=8).with_options(tuned).options().autotune.enabled
    return states


def main() -> None:
    keyed, blob_path, out, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    res: dict[str, object] = {}

    # Every sampler option reaches the sampler make_tf_dataset builds, as an override and in options=.
    seen: list[SamplerOptions] = []
    init = TieredSampler.__init__

    def spy(self: TieredSampler, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(self.options)

    TieredSampler.__init__ = spy  # type: ignore[method-assign]
    reached = {}
    for name, case in OPTION_CASES.items():
        want = SamplerOptions(**case).value(name)  # type: ignore[arg-type]
        make_tf_dataset(keyed, **case)
        by_keyword = seen[-1].value(name)
        make_tf_dataset(keyed, options=SamplerOptions(**case))  # type: ignore[arg-type]
        reached[name] = [str(by_keyword) == str(want), str(seen[-1].value(name)) == str(want)]
    TieredSampler.__init__ = init  # type: ignore[method-assign]
    res["options_reached"] = reached

    # Every store option reaches the stores the sampler opens: in store=, and by its flat name if it has one.
    opened: list[StoreOptions] = []
    store_init = LocalStore.__init__

    def store_spy(self: LocalStore, root: str, options: StoreOptions = StoreOptions()) -> None:
        store_init(self, root, options)
        opened.append(options)

    LocalStore.__init__ = store_spy  # type: ignore[method-assign]
    flat = {key: name for name, (_, key, _) in SamplerOptions.flat_options().items()}
    stores_reached = {}
    for key, value in STORE_CASES.items():
        want = getattr(StoreOptions(**{key: value}), key)  # type: ignore[arg-type]
        cases = [{"store": StoreOptions(**{key: value})}] + ([{flat[key]: value}] if key in flat else [])  # type: ignore[arg-type]
        stores_reached[key] = []
        for case in cases:
            opened.clear()
            make_tf_dataset(keyed, **case)
            stores_reached[key].append(want in [getattr(o, key) for o in opened])
    LocalStore.__init__ = store_init  # type: ignore[method-assign]
    res["stores_reached"] = stores_reached
    gc.collect()

    # Element spec and two full iterations (the second continues with the next epoch).
    ds = make_tf_dataset(keyed, batch_size=8, seed=seed)
    res["spec"] = spec_of(ds)
    passes = []
    for _ in range(2):
        batches = [{k: v.numpy().tolist() for k, v in b.items()} for b in ds]
        passes.append(batches)
    res["passes"] = passes
    res["spec_drop_last"] = spec_of(make_tf_dataset(keyed, batch_size=8, drop_last=True, seed=seed))
    fixed = [b["key"].shape[0] for b in make_tf_dataset(keyed, batch_size=8, drop_last=True, seed=seed)]
    res["drop_last_sizes"] = fixed
    tup = make_tf_dataset(keyed, batch_size=8, as_tuple=("image", "label"), layout="NCHW", scale="float", seed=seed)
    res["spec_tuple"] = spec_of(tup)
    x, y = next(iter(tup))
    res["tuple_first"] = {"x": x.numpy().tolist(), "y": y.numpy().tolist()}

    # Zero copy: the payload tensor adopts an aligned array (writes show through); other arrays are
    # left to TensorFlow's copy. Batches the consumer keeps are never overwritten by buffer reuse.
    aligned = aligned_empty(2, (8, 8, 3), np.dtype(np.uint8))
    aligned[:] = 0
    adopted = adopt_payload({"image": aligned}, "image")["image"]
    aligned[1, 2, 3, 0] = 9
    odd = np.zeros(200, np.uint8)[1:193].reshape(1, 8, 8, 3)
    res["adopt"] = {"tensor": isinstance(adopted, tf.Tensor), "shares": int(adopted[1, 2, 3, 0]),
                    "odd": type(adopt_payload({"image": odd}, "image")["image"]).__name__}
    kept = list(make_tf_dataset(keyed, batch_size=4, seed=seed, ram_size="4KiB", static_cache=0))
    res["kept"] = [{"key": b["key"].numpy().tolist(), "image": b["image"].numpy().tolist()} for b in kept]

    # Two replicas of a MirroredStrategy on 2 logical CPUs; global batch 16 -> 8 per replica.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    contexts = []

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append([ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.get_per_replica_batch_size(16)])
        return make_tf_dataset(keyed, global_batch_size=16, input_context=ctx, seed=seed)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    replicas: list[list[int]] = [[], []]
    for batch in dist:
        for r, keys in enumerate(strategy.experimental_local_results(batch["key"])):
            replicas[r].extend(int(k) for k in keys.numpy())
    res["mirrored"] = {"replicas": replicas, "contexts": contexts, "num_replicas": strategy.num_replicas_in_sync}

    # Two input pipelines (what a two-worker strategy creates), built by hand.
    pipelines = []
    for i in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        pipelines.append([int(k) for b in make_tf_dataset(keyed, global_batch_size=8, input_context=ctx, seed=seed)
                          for k in b["key"].numpy()])  # fmt: skip
    res["pipelines"] = pipelines

    # A mixture (weights 3:1, 40 records per epoch): its spec and one epoch of (dataset, key, image).
    from pathlib import Path

    m = shardkit.mix(list(zip(write_keyed_mixture(Path(out).parent), [3, 1])), epoch_size=40)
    mds = make_tf_dataset(m, batch_size=8, seed=seed)
    res["mixture_spec"] = spec_of(mds)
    res["mixture"] = [{k: b[k].numpy().tolist() for k in ("dataset", "key", "image")} for b in mds]

    # locality: two input pipelines are two nodes (nodes defaults to num_input_pipelines); two
    # iterations (Keras epochs) of each, batches kept apart.
    local = []
    for i in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        ds_i = make_tf_dataset(keyed, global_batch_size=8, input_context=ctx, seed=seed, locality=True,
                               static_cache="30records", drop_last=True)  # fmt: skip
        local.append([[b["key"].numpy().tolist() for b in ds_i] for _ in range(2)])
    res["local_pipelines"] = local

    # Training: shardkit dataset vs tf.data's own full in-memory shuffle, same model and seeds.
    images, labels = blobs(1200, seed=1)
    test_images, test_labels = blobs(2000, seed=99)

    def model() -> tf.keras.Model:
        tf.keras.utils.set_random_seed(0)
        inputs = tf.keras.Input((8, 8, 3))
        feats = tf.keras.layers.Lambda(lambda t: (tf.reduce_mean(t, axis=(1, 2)) - 0.5) * 16.0)(inputs)
        m = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(feats))
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        m.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
        return m

    ours = model()
    ours.fit(make_tf_dataset(blob_path, batch_size=32, as_tuple=("image", "label"), scale="float", seed=3),
             epochs=4, verbose=0)  # fmt: skip
    theirs = model()
    ref = (tf.data.Dataset.from_tensor_slices((images.astype(np.float32) / 255, labels))
           .shuffle(len(labels), seed=3, reshuffle_each_iteration=True).batch(32))  # fmt: skip
    theirs.fit(ref, epochs=4, verbose=0)
    x_test = test_images.astype(np.float32) / 255
    res["acc"] = {
        "ours": float(ours.evaluate(x_test, test_labels, verbose=0)[1]),
        "theirs": float(theirs.evaluate(x_test, test_labels, verbose=0)[1]),
    }
    res["autotune"] = autotune_states(keyed)
    res["cache_regions"] = cache_regions_with_the_dataset(keyed, seed + 101)
    res["built_ahead"] = samplers_built_ahead(keyed, seed)
    res["next_sampler"] = next_sampler_cases()
    with open(out, "w") as f:
        json.dump(res, f)


def cache_regions_with_the_dataset(keyed: str, seed: int) -> dict[str, list[str]]:
    """The node-shared static-cache regions a dataset adds, while it lives and once it is deleted
    (TensorFlow keeps the generator function to the end of the process; the cache must not stay).
    A copy of the dataset of its own: regions are named by the dataset (a cache of it all by the
    dataset alone, not the seed), and an earlier part of the script may still hold the original's."""
    shm = node.SHM_ROOT / f"shardkit-{os.geteuid()}"
    copy = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(keyed))), "keyed")
    shutil.copytree(keyed, copy)
    keyed = copy

    def regions() -> set[str]:
        names = (p.name for p in shm.iterdir()) if shm.is_dir() else ()
        return {n for n in names if n.startswith("cache-") and not n.endswith(".lock")}

    before = regions()
    ds = make_tf_dataset(keyed, batch_size=8, seed=seed).map(lambda b: b)  # a derived dataset keeps it too
    for _ in ds:
        pass
    during = regions() - before
    del ds
    gc.collect()
    return {"during": sorted(during), "after": sorted(regions() & during)}


def samplers_built_ahead(keyed: str, seed: int) -> dict[str, object]:
    """Samplers built while iterations run: per iteration, how many were built before its first batch
    arrived and its keys; whether every sampler built was closed once the dataset is deleted."""
    import threading

    built: list[TieredSampler] = []
    in_background: list[bool] = []  # per sampler built: by the adapter's background build
    closed: set[int] = set()
    init, close = TieredSampler.__init__, TieredSampler.close

    def init_spy(self: TieredSampler, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)
        in_background.append(threading.current_thread().name == "shardkit-next-pass")

    def close_spy(self: TieredSampler) -> None:
        closed.add(id(self))
        close(self)

    TieredSampler.__init__, TieredSampler.close = init_spy, close_spy  # type: ignore[method-assign]
    try:
        # No prefetch: the generator runs only as far as batches are taken (the abandoned iteration
        # below must not reach its end ahead of the consumer).
        ds = make_tf_dataset(keyed, batch_size=8, seed=seed, prefetch=False)
        at_make = len(built)
        iterations = []

        def iteration(ds: tf.data.Dataset, limit: int | None = None) -> None:
            # Samplers the iteration itself built (in TensorFlow's thread, before its first batch).
            before, keys, first = len(built), [], None
            for i, b in enumerate(ds):
                if first is None:
                    first = in_background[before:].count(False)
                keys += b["key"].numpy().tolist()
                if limit is not None and i + 1 == limit:
                    break
            iterations.append({"built_in_iteration": first, "keys": keys})

        iteration(ds)  # epoch 0, with the sampler make_tf_dataset built
        iteration(ds)  # epoch 1, with the one the first iteration built as it ended
        iteration(ds, limit=1)  # abandoned: epoch 2 is not over
        iteration(ds)  # epoch 2 again: no sampler was built ahead for it, this iteration builds its own
        del ds
        gc.collect()
        for t in threading.enumerate():  # a build still under way closes its sampler when it ends
            if t.name == "shardkit-next-pass":
                t.join(30)
        return {"at_make": at_make, "iterations": iterations, "in_background": in_background,
                "all_closed": all(id(s) in closed for s in built)}
    finally:
        TieredSampler.__init__, TieredSampler.close = init, close  # type: ignore[method-assign]


class _Fake:
    """A stand-in sampler for NextPass: records its close; its identity check fails on demand."""

    def __init__(self, epoch: int, changed: bool = False) -> None:
        self.epoch, self.changed, self.closed = epoch, changed, False
        self.identity = self

    def check(self) -> None:
        if self.changed:
            raise SamplerError("dataset changed")

    def close(self) -> None:
        self.closed = True


def next_sampler_cases() -> dict[str, object]:
    """NextPass as the tf adapter uses it (no key, never started): epoch match, a replaced dataset,
    close, and a close that lands while a build is under way (forced with events: the build waits
    until close has returned)."""
    import threading

    made: list[_Fake] = []
    changed = [False]

    def build(epoch: int) -> _Fake:
        made.append(_Fake(epoch, changed[0]))
        return made[-1]

    out: dict[str, object] = {}
    def sampler(taken: object) -> object:
        """The sampler of what take() returned (a pair with the iteration not started) or None."""
        assert taken is None or (isinstance(taken, tuple) and taken[1] is None), taken
        return None if taken is None else taken[0]

    ahead = NextPass(build)  # type: ignore[arg-type]
    ahead.prepare(3)
    got = sampler(ahead.take(3))
    out["same_epoch"] = [got is made[0], made[0].closed, ahead.take(3) is None]
    ahead.prepare(4)
    out["other_epoch"] = [ahead.take(5) is None, made[1].closed]
    changed[0] = True
    ahead.prepare(6)
    out["replaced"] = [ahead.take(6) is None, made[2].closed]
    changed[0] = False
    ahead.prepare(7)
    ahead.prepare(8)  # replaces the one for 7
    out["replaced_by_newer"] = [made[3].closed, sampler(ahead.take(8)) is made[4]]
    ahead.prepare(9)
    ahead.close()
    out["closed"] = [made[5].closed, ahead.take(9) is None]

    building, closed = threading.Event(), threading.Event()

    def slow_build(epoch: int) -> _Fake:
        building.set()
        closed.wait(10)
        return build(epoch)

    racing = NextPass(slow_build)  # type: ignore[arg-type]
    t = threading.Thread(target=racing.prepare, args=(10,))
    t.start()
    building.wait(10)
    racing.close()
    closed.set()
    t.join(10)
    out["close_during_build"] = [made[-1].epoch == 10, made[-1].closed, racing.take(10) is None]

    # In the background: take() waits for the build under way (the build goes on only once take
    # was called, so a take that did not wait would find nothing); of two builds the later is kept.
    take_called = threading.Event()

    class Waiting(NextPass):
        def take(self, epoch: int, key: object = None) -> object:  # type: ignore[override]
            take_called.set()
            return super().take(epoch, key)  # type: ignore[arg-type]

    def gated_build(epoch: int) -> _Fake:
        take_called.wait(10)
        return build(epoch)

    background = Waiting(gated_build)  # type: ignore[arg-type]
    background.prepare_in_background(11)
    got = sampler(background.take(11))
    out["take_waits"] = [got is made[-1], made[-1].epoch == 11, not made[-1].closed]
    background.prepare_in_background(12)
    background.prepare_in_background(13)
    got = sampler(background.take(13))
    out["later_kept"] = [made[-2].epoch == 12, made[-2].closed, got is made[-1], made[-1].epoch == 13]
    background.close()
    background.prepare_in_background(14)  # after close: nothing is built
    out["none_after_close"] = [made[-1].epoch == 13, background.take(14) is None]
    return out


if __name__ == "__main__":
    main()
