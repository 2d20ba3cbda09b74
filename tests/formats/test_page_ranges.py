"""The page ranges of rows (``formats/mapping.py: reserve_ranges``) and sorted distinct keys
(``formats/arrays.py: distinct_sorted``), which the static cache and the mapped files share."""

from __future__ import annotations

import mmap

import numpy as np

from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.mapping import reserve_ranges

_PAGE = mmap.PAGESIZE


def test_distinct_sorted_is_unique_as_int64() -> None:
    rng = np.random.default_rng(3)
    for size in (0, 1, 2, 50, 5000):
        values = rng.integers(-20, 20, size=size).astype(np.int32)
        got = distinct_sorted(values)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.unique(values))


def test_reserve_ranges_cover_the_rows_in_few_whole_pages() -> None:
    """The ranges reserved before cache rows are written: whole pages that cover every wanted row's
    bytes, no page reserved that no wanted row touches, one range for rows on neighbouring pages (a
    range per run of consecutive rows made a system call every few small records, issue #34)."""
    rng = np.random.default_rng(7)
    for _ in range(30):
        rec = int(rng.choice([1, 16, 32, 100, 5000, 3 * _PAGE]))
        m = int(rng.integers(1, 3000))
        rows = rng.integers(0, m, size=int(rng.integers(0, 2 * m)))
        at = _PAGE * int(rng.integers(0, 3))
        starts, ends, first = reserve_ranges(rows, at, rec)
        np.testing.assert_array_equal(distinct_sorted(rows), np.unique(rows))
        assert np.all(starts % _PAGE == 0) and np.all(ends % _PAGE == 0) and np.all(ends > starts)
        assert np.all(starts[1:] > ends[:-1])  # disjoint, ascending, not touching
        pages = {p for a, b in zip(starts.tolist(), ends.tolist()) for p in range(a // _PAGE, b // _PAGE)}
        wanted = {p for r in set(rows.tolist()) for p in range((at + r * rec) // _PAGE, (at + (r + 1) * rec - 1) // _PAGE + 1)}
        assert pages == wanted
        # first[i]: the smallest row of range i
        for a, b, f in zip(starts.tolist(), ends.tolist(), first.tolist()):
            inside = [r for r in set(rows.tolist()) if a <= at + r * rec < b]
            assert f == min(inside)
