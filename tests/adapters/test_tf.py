"""TensorFlow adapter with the real framework and the real tiered sampler.

All TensorFlow work runs once, in one subprocess (``tf_script.py``): TensorFlow takes seconds to
import, and the two logical CPU devices of the MirroredStrategy must be set before its runtime
starts. The tests below assert on what that run observed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _adapter_data import N_KEYED, NUM_CLASSES, decode_keys, keyed_images

from shardkit.readers import SamplerOptions, epoch_permutation
from shardkit.stores import StoreOptions

if importlib.util.find_spec("tensorflow") is None:  # CI installs the extra; `.[dev]` alone skips these
    pytest.skip("the 'tensorflow' extra is not installed", allow_module_level=True)

HERE = Path(__file__).parent
SEED = 11
# One worker under pytest-xdist: the module's tests share one TensorFlow run (the `observed` fixture).
pytestmark = [pytest.mark.xdist_group("adapters-tf"), pytest.mark.slow]


@pytest.fixture(scope="module")
def observed(keyed: Path, blob_train: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("tf") / "observed.json"
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, str(HERE / "tf_script.py"), str(keyed), str(blob_train[0]), str(out), str(SEED)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_element_spec_is_complete(observed: dict) -> None:
    assert observed["spec"] == {
        "image": [[None, 8, 8, 3], "uint8"],
        "label": [[None], "int64"],
        "weight": [[None, 2], "float32"],
        "key": [[None], "int64"],
    }
    assert observed["spec_drop_last"]["image"] == [[8, 8, 8, 3], "uint8"]
    assert observed["spec_drop_last"]["key"] == [[8], "int64"]
    assert observed["drop_last_sizes"] == [8] * (N_KEYED // 8)
    assert observed["spec_tuple"] == [[[None, 3, 8, 8], "float32"], [[None], "int64"]]


def test_full_iterations_follow_the_sampler_order(observed: dict) -> None:
    for epoch, batches in enumerate(observed["passes"]):  # the second pass is the next epoch
        keys = np.concatenate([np.asarray(b["key"], dtype=np.int64) for b in batches])
        np.testing.assert_array_equal(keys, epoch_permutation(SEED, epoch, N_KEYED))
        for b in batches:
            k = np.asarray(b["key"], dtype=np.int64)
            np.testing.assert_array_equal(decode_keys(np.asarray(b["image"], dtype=np.uint8)), k)
            np.testing.assert_array_equal(b["label"], k % NUM_CLASSES)
            np.testing.assert_array_equal(b["weight"], np.stack([k, -k], 1).astype(np.float32))
        assert [len(b["key"]) for b in batches] == [8] * 12 + [7]


def test_payload_adopted_without_copy_and_kept_batches_intact(observed: dict) -> None:
    # A tensor that sees a write made after it was created: the same memory, not a copy.
    assert observed["adopt"] == {"tensor": True, "shares": 9, "odd": "ndarray"}
    keys = [np.asarray(b["key"], dtype=np.int64) for b in observed["kept"]]
    np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, 0, N_KEYED))
    for b, k in zip(observed["kept"], keys):
        np.testing.assert_array_equal(decode_keys(np.asarray(b["image"], dtype=np.uint8)), k)


def test_tuple_layout_and_scale(observed: dict) -> None:
    keys = epoch_permutation(SEED, 0, N_KEYED)[:8]
    x = np.asarray(observed["tuple_first"]["x"], dtype=np.float32)
    np.testing.assert_allclose(x, keyed_images(keys).transpose(0, 3, 1, 2) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(observed["tuple_first"]["y"], keys % NUM_CLASSES)


def test_mirrored_strategy_replicas_get_disjoint_slices(observed: dict) -> None:
    m = observed["mirrored"]
    assert m["num_replicas"] == 2
    assert m["contexts"] == [[0, 1, 8]]  # one input pipeline, per-replica batch 16 / 2
    a, b = (np.asarray(r, dtype=np.int64) for r in m["replicas"])
    assert not set(a) & set(b)
    np.testing.assert_array_equal(np.sort(np.concatenate([a, b])), np.arange(N_KEYED))
    # The pipeline's per-replica batches go to the replicas in turn.
    pi = epoch_permutation(SEED, 0, N_KEYED)
    np.testing.assert_array_equal(a, np.concatenate([pi[i : i + 8] for i in range(0, N_KEYED, 16)]))


def test_input_pipelines_are_sampler_consumers(observed: dict) -> None:
    pi = epoch_permutation(SEED, 0, N_KEYED)
    # global batch 8 over 2 replicas -> 4 records per pipeline batch; pipeline i takes slice i.
    for i, keys in enumerate(observed["pipelines"]):
        want = np.concatenate([pi[g + 4 * i : g + 4 * i + 4] for g in range(0, N_KEYED, 8)])
        np.testing.assert_array_equal(keys, want)


def test_locality_keeps_every_global_batch(observed: dict) -> None:
    """Two input pipelines with locality (each its own node): every step's union is the epoch order's
    slice, each pipeline gives 4 records per batch, and the split differs from the plain slicing."""
    local = observed["local_pipelines"]
    moved = False
    for epoch in range(2):
        pi = epoch_permutation(SEED, epoch, N_KEYED)
        a, b = local[0][epoch], local[1][epoch]
        assert len(a) == len(b) == N_KEYED // 8
        for g, (x, y) in enumerate(zip(a, b)):
            assert len(x) == len(y) == 4
            np.testing.assert_array_equal(np.sort(x + y), np.sort(pi[8 * g : 8 * g + 8]))
            moved |= x != list(pi[8 * g : 8 * g + 4])
    assert moved


def test_training_matches_in_memory_shuffle(observed: dict) -> None:
    """Tolerance: 0.03 absolute accuracy on 2000 held-out records (blobs' Bayes accuracy about
    0.85); the reference is tf.data's own full-size shuffle buffer over the same records."""
    acc = observed["acc"]
    assert acc["theirs"] > 0.75, acc
    assert abs(acc["ours"] - acc["theirs"]) <= 0.03, acc


def test_a_mixture_is_a_dataset_source(observed: dict, keyed_mixture: list[Path]) -> None:
    """make_tf_dataset(shardkit.mix(...)): elements carry the dataset index, the key in that dataset
    and its record, in the mixture's order with its exact counts."""
    from _adapter_data import MIX_SIZES

    import shardkit

    assert observed["mixture_spec"]["dataset"] == [[None], "int64"]
    batches = observed["mixture"]
    ds = np.concatenate([b["dataset"] for b in batches])
    keys = np.concatenate([b["key"] for b in batches])
    plan = shardkit.mix(list(zip(keyed_mixture, [3, 1])), epoch_size=40).plan(SEED)
    np.testing.assert_array_equal(np.stack([ds, keys], 1), plan.pairs(0))
    first = np.array([0, MIX_SIZES[0]])
    for b in batches:
        g = first[np.asarray(b["dataset"])] + np.asarray(b["key"])
        np.testing.assert_array_equal(decode_keys(np.asarray(b["image"], dtype=np.uint8)), g)


def test_autotuning_is_off_unless_the_user_turns_it_on(observed: dict) -> None:
    """make_tf_dataset turns tf.data's autotuning off (deleting an iterator would wait for its model
    thread's next wake-up) with every prefetch and presentation, and still delivers every batch;
    the user's own with_options can turn it on again."""
    states = observed["autotune"]
    batches = -(-N_KEYED // 8)
    for name in ("default", "no prefetch", "prefetch 2", "presented"):
        assert states[name] == [False, batches], (name, states)
    assert states["turned on by the user"] is True


def test_the_static_cache_goes_with_the_dataset(observed: dict) -> None:
    """The dataset holds the node-shared static cache across iterations and lets go of it when it (and
    every dataset derived from it) is deleted, although TensorFlow keeps the generator function."""
    regions = observed["cache_regions"]
    assert len(regions["during"]) == 1, regions
    assert regions["after"] == [], regions


def test_every_option_reaches_the_sampler(observed: dict) -> None:
    """make_tf_dataset takes every declared sampler option, as an override and in ``options=``
    (workers_per_rank is placed by the adapter: one consumer per input pipeline)."""
    reached = observed["options_reached"]
    assert sorted(reached) == sorted(SamplerOptions.declared())
    assert {n for n, ok in reached.items() if ok != [True, True]} == {"workers_per_rank"}


def test_every_store_option_reaches_the_store(observed: dict) -> None:
    """make_tf_dataset hands every store option to the stores its sampler opens, in ``store=`` and
    by the sampler option's flat name when it has one."""
    reached = observed["stores_reached"]
    assert sorted(reached) == sorted(StoreOptions.declared())
    flat = {key for _, key, _ in SamplerOptions.flat_options().values()}
    assert {k: ok for k, ok in reached.items() if ok != [True] * (1 + (k in flat))} == {}


def test_each_iteration_starts_with_a_sampler_built_ahead(observed: dict) -> None:
    """An iteration's first batch waits for no sampler to be built: make_tf_dataset builds the first
    iteration's (besides the holder), each finished iteration the next one's in the background. An abandoned iteration
    leaves none for the epoch it repeats, which then builds its own; batches follow the sampler order
    throughout, and every sampler built is closed once the dataset is deleted."""
    ahead = observed["built_ahead"]
    assert ahead["at_make"] == 2  # the holder and the first iteration's sampler
    its = ahead["iterations"]
    assert [it["built_in_iteration"] for it in its] == [0, 0, 0, 1]
    # Built in the background as an iteration ended: for epochs 1, 2 (taken by the abandoned one), 3.
    assert ahead["in_background"] == [False, False, True, True, False, True]
    for it, epoch in zip(its, [0, 1, 2, 2]):
        want = epoch_permutation(SEED, epoch, N_KEYED)
        np.testing.assert_array_equal(it["keys"], want[: len(it["keys"])])
    assert [len(it["keys"]) for it in its] == [N_KEYED, N_KEYED, 8, N_KEYED]
    assert ahead["all_closed"]


def test_a_sampler_built_ahead_is_used_only_when_it_fits(observed: dict) -> None:
    """The sampler built ahead serves only an iteration of its epoch on the unchanged dataset; any
    other is closed, as is one replaced, the one held when the dataset goes, and one whose build
    finished after the dataset went. An iteration waits for a build under way in the background."""
    cases = observed["next_sampler"]
    assert cases["same_epoch"] == [True, False, True]
    assert cases["other_epoch"] == [True, True]
    assert cases["replaced"] == [True, True]
    assert cases["replaced_by_newer"] == [True, True]
    assert cases["closed"] == [True, True]
    assert cases["close_during_build"] == [True, True, True]
    assert cases["take_waits"] == [True, True, True]
    assert cases["later_kept"] == [True, True, True, True]
    assert cases["none_after_close"] == [True, True]
