"""``MappedFile.cached``: which pages of a file are in the page cache (the staged read gathers records
from a shard's mapping only when they are, docs/design.md §4, *Staged blocks*)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from shardkit.formats.mapping import MappedFile


def test_a_file_reads_as_cached_once_its_pages_are_in_the_page_cache(tmp_path: Path) -> None:
    """A sparse file's never-touched pages are not in the page cache (whole range and sampled); once
    written they are; a range with one page left out is not, asked page by page."""
    page = mmap.PAGESIZE
    path = tmp_path / "f"
    with open(path, "wb") as fh:
        fh.truncate(64 * page)
    fd = os.open(path, os.O_RDWR)
    try:
        f = MappedFile(fd)
        assert not f.cached(0, 64 * page)
        assert not f.cached(0, 64 * page, sample=4)
        os.pwrite(fd, b"x" * (32 * page), 0)
        assert f.cached(0, 32 * page)
        assert f.cached(100, 32 * page - 100, sample=4)
        assert not f.cached(0, 33 * page)
        f.close()
    finally:
        os.close(fd)
