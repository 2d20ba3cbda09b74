"""The readers' check that a copy's pages are present (stores/prefetch.py ``all_present``)."""

from __future__ import annotations

import random

from shardkit.stores.prefetch import all_present


def _per_page(flags: bytes | bytearray, spans: list[tuple[int, int]]) -> bool:
    return all(all(flags[lo:hi]) for lo, hi in spans)


def test_all_present_is_the_per_page_check() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randrange(0, 40)
        flags = bytearray(rng.random() < 0.8 for _ in range(n))
        spans = sorted((a, a + rng.randrange(0, 6)) for a in (rng.randrange(0, n + 3) for _ in range(rng.randrange(0, 4))))
        for f in (flags, bytes(flags)):  # the filler's own flags and a map read from its file
            assert all_present(f, spans) == _per_page(f, spans), (list(flags), spans)


def test_all_present_edges() -> None:
    assert all_present(bytearray(b"\1\1\1"), [])
    assert all_present(bytearray(b"\0\1\1"), [(1, 3), (2, 2)])  # an empty span asks for nothing
    assert not all_present(bytearray(b"\1\1\0"), [(0, 1), (1, 3)])
    assert all_present(b"\1\1", [(0, 5)])  # pages past the map: as the slice check (none to look at)
