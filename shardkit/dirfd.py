"""Names in a directory held open by descriptor (``dir_fd``).

The private directories of the node-shared regions (:mod:`shardkit.tiers.shm`), of the local
shard cache (:mod:`shardkit.stores.cache`) and of a shared tier stack's run
(:mod:`shardkit.serve.rundir`) are checked once when they are opened and then only used
through their descriptor, so a path swapped for a symlink afterwards changes nothing. These are the
lookups all of them need; a name that is already gone is an ordinary outcome (another process of
the node removed it first), not an error.
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
