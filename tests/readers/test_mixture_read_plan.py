"""A mixture's block is read as one plan (issue 33, five-way mixtures): each dataset plans its own
shards, and the request bookkeeping (announcing the runs, building the scatter lists) runs once per
block, not once per dataset, so a block that touches five datasets costs about what one dataset's does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.formats import DatasetWriter, FieldSpec
from shardkit.formats import reader as reader_module
from shardkit.readers.sources import MixedDataset, MixedPayload
from tests.helpers.sampler_data import FIVE_WAY_SIZES, FIVE_WAY_STARTS, encode, five_way_mixture, make_dataset

SIZES, STARTS = FIVE_WAY_SIZES, FIVE_WAY_STARTS


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Calls of ``PayloadArray.<name>``, each recorded with the number of records of its plan."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(reader_module.PayloadArray, name)

    def counted(self: Any, plan: Any, *args: Any) -> Any:
        calls.append(plan.size)
        return real(self, plan, *args)

    monkeypatch.setattr(reader_module.PayloadArray, name, counted)
    return calls


@pytest.mark.parametrize("shape", [(4, 4, 1), (64, 64, 4)], ids=["small records, bounced", "large records, scattered"])
def test_a_five_way_block_is_read_as_one_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              shape: tuple[int, ...]) -> None:  # fmt: skip
    with five_way_mixture(tmp_path, shape) as (payload, stats, paths):
        plans = _count(monkeypatch, "_read_plan")
        keys = np.random.default_rng(4).integers(0, int(STARTS[-1]), 60)  # every dataset, duplicates included
        assert len(np.unique(np.searchsorted(STARTS, keys, side="right"))) == 5
        out = payload.read(keys)
        assert np.array_equal(out, encode(keys, shape))
        assert plans == [len(np.unique(keys))]  # one plan holding every distinct record of the block
        requests = [(f, off) for f, off, _ in stats.trace]
    for i in range(5):  # each dataset's requests still go to its own files: its shards in order, ascending offsets
        mine = [(int(f.split("/c/")[1].split("/")[0]), off) for f, off in requests if f.startswith(f"{paths[i]}/")]
        assert mine and mine == sorted(mine)
    assert len(requests) == len(set(requests))


def test_a_compressed_dataset_in_the_mixture_is_read_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset whose records are compressed decodes with its own codec: the parts are read one by
    one (each its own plan), and every record still lands in its row."""
    paths = [make_dataset(tmp_path / f"d{i}", n, first=int(STARTS[i])) for i, n in enumerate(SIZES[:2])]
    keys3 = np.arange(int(STARTS[2]), int(STARTS[3]))
    with DatasetWriter(tmp_path / "z", kind="test", payload="image", record=FieldSpec((4, 4, 1), "uint8"),
                       fields={"label": FieldSpec((), "int64"), "pair": FieldSpec((2,), "float32")},
                       records_per_shard=3, compression="zstd") as w:  # fmt: skip
        w.write({"image": encode(keys3), "label": keys3 * 3, "pair": np.stack([keys3, -keys3], 1).astype(np.float32)})
    paths.append(tmp_path / "z")
    with MixedDataset(shardkit.mix(list(zip(paths, [1] * 3)))) as md:
        payload = md.payload
        assert isinstance(payload, MixedPayload)
        plans = _count(monkeypatch, "_read_plan")
        keys = np.random.default_rng(5).permutation(int(STARTS[3]))
        assert np.array_equal(payload.read(keys), encode(keys))
        assert len(plans) == 3 and sum(plans) == keys.size
