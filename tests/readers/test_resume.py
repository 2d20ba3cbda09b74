"""Resume mid-epoch: the remaining order equals an uninterrupted run, only what is left is read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import SamplerError
from shardkit.readers import TieredSampler, epoch_permutation
from tests.helpers.sampler_data import check_batch, collect, make_dataset

STACKS = {
    "ram": dict(tiers="ram", ram_size="6records"),
    "ram+ssd": dict(tiers="ram,ssd", ram_size="4records", ssd_size="10records"),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("stop_after", [1, 4, 7])
def test_resume_equals_uninterrupted(tmp_path: Path, ssd_dir: Path, stack: str, stop_after: int) -> None:
    n = 29
    ds = make_dataset(tmp_path / "ds", n)
    kw = dict(ssd_dir=ssd_dir, batch_size=4, epochs=2, seed=9, **STACKS[stack])
    full = np.concatenate(collect(TieredSampler(ds, **kw)))

    s = TieredSampler(ds, **kw)
    head = []
    for i, batch in enumerate(s):
        head.append(check_batch(batch))
        if i + 1 == stop_after:
            break
    state = json.loads(json.dumps(s.state_dict()))  # JSON round trip
    assert (state["epoch"], state["position"]) == (0, stop_after * 4)
    s.close()

    r = TieredSampler(ds, **kw)
    r.load_state_dict(state)
    tail = collect(r)
    np.testing.assert_array_equal(np.concatenate(head + tail), full)
    consumed = stop_after * 4
    assert r.stats.disk.records == 2 * n - consumed  # reads only what is left


@pytest.mark.parametrize("stack", list(STACKS))
def test_resume_with_another_world_size(tmp_path: Path, ssd_dir: Path, stack: str) -> None:
    """Two ranks run 3 global batches; three ranks continue the same global order."""
    n, b = 50, 3
    ds = make_dataset(tmp_path / "ds", n)
    kw = dict(ssd_dir=ssd_dir, batch_size=b, epochs=1, seed=21, **STACKS[stack])
    pi = epoch_permutation(21, 0, n)
    got: dict[int, list[np.ndarray]] = {}
    states = []
    for r in range(2):
        s = TieredSampler(ds, rank=r, world_size=2, **kw)
        it = iter(s)
        got[r] = [check_batch(next(it)) for _ in range(3)]
        states.append(s.state_dict())
        s.close()
    assert states[0] == states[1] and states[0]["position"] == 18
    head = np.concatenate([got[r][g] for g in range(3) for r in range(2)])
    np.testing.assert_array_equal(head, pi[:18])
    cont: dict[int, list[np.ndarray]] = {}
    for r in range(3):
        s = TieredSampler(ds, rank=r, world_size=3, **kw)
        s.load_state_dict(states[0])
        cont[r] = collect(s)
        assert s.stats.disk.records == sum(x.size for x in cont[r])
    rebuilt = [cont[r][g] for g in range(max(map(len, cont.values()))) for r in range(3) if g < len(cont[r])]
    np.testing.assert_array_equal(np.concatenate(rebuilt), pi[18:])


def test_state_dict_validation(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    s = TieredSampler(ds, batch_size=2, seed=1)
    state = s.state_dict()
    for bad in ({**state, "seed": 2}, {**state, "num_records": 11}, {**state, "position": 99}, {"seed": 1}):
        with pytest.raises(SamplerError):
            s.load_state_dict(bad)
    s.load_state_dict({**state, "epoch": 4, "position": 6, "start_epoch": 4})
    keys = np.concatenate(collect(s))
    np.testing.assert_array_equal(keys, epoch_permutation(1, 4, 10)[6:])
