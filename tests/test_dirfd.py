"""shardkit.dirfd: lookups relative to a directory descriptor never follow a symlink, and a name
already gone is an ordinary outcome."""

from __future__ import annotations

import os
from pathlib import Path

from shardkit.dirfd import exists_at, unlink_at


def test_exists_and_unlink_at_a_directory_descriptor(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "file").write_bytes(b"x")
    os.symlink(target, tmp_path / "d" / "link")
    os.symlink(tmp_path / "missing", tmp_path / "d" / "dangling")
    fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert exists_at("file", fd) and exists_at("link", fd)
        assert exists_at("dangling", fd)  # the link itself is there, though its target is not
        assert not exists_at("nothing", fd)
        assert unlink_at("link", fd) is True
        assert target.read_bytes() == b"kept"  # the link went, never its target
        assert unlink_at("file", fd) is True
        assert unlink_at("file", fd) is False
        assert sorted(os.listdir(fd)) == ["dangling"]
    finally:
        os.close(fd)
