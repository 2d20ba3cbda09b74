"""The SSD tier's private run directory ``<ssd_dir>/shardkit-ssd-<pid>-<random>/`` (stale siblings
deleted at start-up); docs/design.md §4 (*The pipeline*, SSD reservoirs) and
docs/design.md §13.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from shardkit.errors import ConfigError
from shardkit.privdir import PrivateDir, create_run_dir, sweep_stale

__all__ = ["SsdSpace", "PREFIX", "remove_stale", "READ_CHUNK_BYTES"]

#: Name prefix of a run's private directory.
PREFIX = "shardkit-ssd-"
#: Disk -> SSD copies go through a reusable buffer of at most this size (two halves, one read while
#: the other is written): bounded memory whatever the reservoir size.
READ_CHUNK_BYTES = 64 << 20


def remove_stale(ssd_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the SSD directories under ``ssd_dir`` whose run is dead; return them."""
    return sweep_stale(ssd_dir, PREFIX)


class SsdSpace:
    """A run's private, locked SSD directory ``<ssd_dir>/shardkit-ssd-<pid>-<random>/``."""

    def __init__(self, ssd_dir: str | os.PathLike[str]) -> None:
        self.parent = Path(ssd_dir)
        if not self.parent.is_dir():
            raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.parent)!r}")
        remove_stale(self.parent)
        self._dir: PrivateDir = create_run_dir(self.parent, PREFIX)
        self.path = self._dir.path
        self._closed = threading.Lock()

    def create_file(self, name: str) -> int:
        """Create ``name`` in the run directory, ``0600`` whatever the umask, and return its
        descriptor (read and write). It must not exist; a symlink is never followed."""
        return self._dir.create_file(name)

    def close(self) -> None:
        """Delete everything and release the lock (idempotent)."""
        with self._closed:
            if self._dir.fd < 0:
                return
            self._dir.remove()
            self._dir.close()
