"""The schedule's pass arithmetic (used by the adapters for len and resume) agrees with the real sampler."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from _adapter_data import N_KEYED

from shardkit.adapters._options import PayloadOptions
from shardkit.errors import ConfigError
from shardkit.order.schedule import pass_length
from shardkit.readers import TieredSampler


@pytest.mark.parametrize(
    ("batch_size", "consumers", "drop_last", "limit", "epochs", "start"),
    [
        *itertools.product([8, 50], [1, 3], [False, True], [None], [1, 2], [0, 40]),
        (8, 3, False, 30, 1, 0),
        (8, 1, False, 130, 2, 0),
        (8, 2, True, 16, 1, 0),
        (8, 1, False, 0, 1, 0),
    ],
)
def test_pass_length_matches_the_sampler(
    keyed: Path, batch_size: int, consumers: int, drop_last: bool, limit: int | None, epochs: int, start: int
) -> None:
    for c in range(consumers):
        s = TieredSampler(keyed, batch_size=batch_size, rank=c, world_size=consumers, drop_last=drop_last,
                          limit=limit, epochs=epochs)  # fmt: skip
        if start:
            s.load_state_dict({**s.state_dict(), "position": start})
        sizes = [int(b["key"].shape[0]) for b in s]
        got = pass_length(N_KEYED, batch_size, c, consumers, drop_last=drop_last, start=start,
                            epochs=epochs, limit=limit)  # fmt: skip
        assert got == (len(sizes), sum(sizes)), (c, sizes)


def test_payload_options() -> None:
    assert PayloadOptions(scale="float").factor(np.dtype("uint8")) == 1 / 255
    assert PayloadOptions(scale="float").factor(np.dtype("int16")) == 1 / 32768
    assert PayloadOptions(scale="float").factor(np.dtype("float32")) == 1.0
    with pytest.raises(ConfigError, match="NCHW"):
        PayloadOptions(layout="NCHW").check((16000,), "audio")
    with pytest.raises(ConfigError, match="layout"):
        PayloadOptions(layout="nhwc")
