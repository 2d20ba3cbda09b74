"""crc32c of a whole from its parts' checksums (the shard cache checks a copy from the parts it
fetched, combined, instead of reading the copy again)."""

from __future__ import annotations

import itertools
import random

import pytest

from shardkit.formats.index import combine_crc32c, crc32c_of


@pytest.mark.parametrize(("n1", "n2"), [(0, 0), (0, 7), (7, 0), (1, 1), (100, 65536), (3 << 20, 12345), (5, (8 << 20) + 3)])
def test_combined_equals_the_whole(n1: int, n2: int) -> None:
    rng = random.Random(n1 * 31 + n2)
    a, b = rng.randbytes(n1), rng.randbytes(n2)
    assert combine_crc32c(crc32c_of(a), crc32c_of(b), n2) == crc32c_of(a + b)


def test_parts_in_any_size_combine_in_order() -> None:
    data = random.Random(1).randbytes(300_001)
    cuts = [0, 1, 4096, 65536, 65537, 200_000, 300_001]
    crc = 0
    for a, b in itertools.pairwise(cuts):
        crc = combine_crc32c(crc, crc32c_of(data[a:b]), b - a)
    assert crc == crc32c_of(data)
    assert combine_crc32c(crc32c_of(data[:10]), crc32c_of(data[10:20]), 10) != crc32c_of(data[10:20] + data[:10])
