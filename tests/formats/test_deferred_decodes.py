"""A read whose destination collects its decode jobs returns once its bytes are read (issue 36).

The sampler's block reader waited for every record of a block to be decoded before it read the next
block, so the decode threads idled between blocks. With ``Destination.decodes`` the read hands its
jobs to the caller (the pipeline's assembler waits for them before a batch is handed over).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import Dataset
from shardkit.formats.reader import Destination, finish_decodes
from shardkit.readers import TieredSampler
from tests.helpers.datasets import make_records, write_dataset

RECORDS = make_records(40, shape=(8, 8, 3), seed=5)


def _held_decoder(payload: Any, release: threading.Event) -> None:
    """Make ``payload``'s decoders wait for ``release`` (at most 30 s) before each record."""
    codec = payload.codec
    decode = codec.decode

    def held(data: Any, out: np.ndarray) -> None:
        release.wait(30)
        decode(data, out)

    codec.decode = held


@pytest.mark.parametrize("keys", [[3, 17, 5, 30, 12, 39, 0], [3, 17, 3, 30, 17, 17, 0]], ids=["distinct", "duplicates"])
def test_a_read_with_a_decodes_list_returns_before_its_records_are_decoded(tmp_path: Path, keys: list[int]) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=10, compression="zstd")
    with Dataset(path) as ds:
        payload = ds.payload
        payload.use_decoders(2)
        release = threading.Event()
        _held_decoder(payload, release)
        out = payload.empty(len(keys))
        dest = Destination.rows_of(out, len(keys))
        dest = Destination(dest.buffers, dest.which, dest.rows, dest.consecutive, decodes=[])
        if len(set(keys)) == len(keys):
            payload.read_into(np.array(keys), dest)  # returns while every decoder is held
            assert dest.decodes and not any(job.done() for job in dest.decodes)
            release.set()
        else:  # duplicates are copied from decoded rows: the read waits for its decodes first
            threading.Timer(0.2, release.set).start()
            payload.read_into(np.array(keys), dest)
        assert dest.decodes is not None
        finish_decodes(dest.decodes)
        np.testing.assert_array_equal(out, RECORDS[keys])


def test_the_sampler_overlaps_a_blocks_decoding_with_the_next_read(tmp_path: Path) -> None:
    """The reader reads the next block while the assembler waits for this one's decodes."""
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=10, compression="zstd")
    s = TieredSampler(path, batch_size=8, static_cache=0, decode_workers=2, seed=3, ram_size="4KiB")
    try:
        batches = list(s)
        keys = np.concatenate([b["key"] for b in batches])
        seen = np.concatenate([b[s.payload_name] for b in batches])
        assert sorted(keys.tolist()) == list(range(len(RECORDS)))
        np.testing.assert_array_equal(seen, RECORDS[keys])
        assert "decode" in s.stats.wait_seconds  # the assembler, not the reader, waited for the decoders
    finally:
        s.close()
