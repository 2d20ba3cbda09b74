"""``MappedFile.announce`` (formats/mapping.py): the kernel is asked to read ranges without the GIL."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import mapping
from shardkit.formats.mapping import MappedFile


@pytest.mark.parametrize("batched", [True, False])
def test_announce_asks_the_kernel_without_the_gil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool) -> None:
    """``MADV_WILLNEED`` waits for room in a busy device's queue: it goes through the ctypes calls
    (which let go of the GIL), batched where the kernel can, else range by range, never through
    ``mmap.madvise`` (which holds the GIL, stopping the assembler and the training loop)."""
    f = tmp_path / "data"
    f.write_bytes(os.urandom(8 * mmap.PAGESIZE))
    fd = os.open(f, os.O_RDONLY)
    try:
        m = MappedFile(fd)
    finally:
        os.close(fd)
    calls: list[tuple[str, int]] = []
    real_advise, real_populate = mapping._advise, mapping.populate

    def advise(mm: Any, start: Any, end: Any, advice: int) -> bool:
        calls.append(("batched", advice))
        return real_advise(mm, start, end, advice) if batched else False

    def one(mm: Any, offset: int, length: int, advice: int = mapping.MADV_POPULATE_WRITE) -> None:
        calls.append(("one", advice))
        real_populate(mm, offset, length, advice)

    monkeypatch.setattr(mapping, "_advise", advise)
    monkeypatch.setattr(mapping, "populate", one)
    try:
        m.announce(np.array([0, 3 * mapping.mmap.PAGESIZE]), np.array([100, 5 * mapping.mmap.PAGESIZE]))
        willneed = [kind for kind, advice in calls if advice == mapping.MADV_WILLNEED]
        assert willneed == (["batched"] if batched else ["batched", "one", "one"]), calls
    finally:
        m.close()
