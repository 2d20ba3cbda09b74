"""One filler per node: a reader of a copy another process fills trusts that filler's check once
the copy completes (docs/design.md §9, *One download per node*)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkit.stores import cache as cache_module
from shardkit.stores.cache import ShardCache


def test_a_copy_watched_while_it_was_filled_is_not_read_again_to_check_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that opened a copy being filled trusts the filler's check once it completes (the
    same file, renamed only after the check); a copy it never watched is still checked."""
    filler = ShardCache(tmp_path, "ns")
    reader = ShardCache(tmp_path, "ns")
    fd = filler.claim("a", 4)
    assert fd is not None
    os.pwrite(fd, b"abcd", 0)
    watched = reader.open_partial("a")
    assert watched is not None
    assert filler.complete("a", fd, 4, lambda _: True)
    other = filler.claim("b", 4)
    assert other is not None
    os.pwrite(other, b"efgh", 0)
    assert filler.complete("b", other, 4, lambda _: True)
    monkeypatch.setattr(cache_module, "_VERIFIED", {})  # as in another process than the filler's
    checked: list[int] = []

    def verify(fd: int) -> bool:
        checked.append(fd)
        return True

    assert reader.open("a", verify) is not None
    assert checked == []
    assert reader.open("b", verify) is not None
    assert len(checked) == 1
    for f in watched:
        os.close(f)
    reader.close()
    filler.close()
