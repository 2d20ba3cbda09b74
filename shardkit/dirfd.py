"""Names in a directory held open by descriptor (``dir_fd``), as private directories are used.

A name already gone is an ordinary outcome (another process removed it first), not an error.
"""

from __future__ import annotations

import os

__all__ = ["exists_at", "unlink_at"]


def exists_at(name: str, dir_fd: int) -> bool:
    """Whether ``name`` is in the directory (a symlink counts as itself: it is never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def unlink_at(name: str, dir_fd: int) -> bool:
    """Remove ``name`` from the directory (a symlink itself, never its target); ``False`` if it was not there."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True
