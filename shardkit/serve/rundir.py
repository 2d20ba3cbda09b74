"""A server's run directory ``<base>/shardkit-serve-<uid>-<NAME>/``: its ``lock``, ``token``, ``ring``,
``sock`` and ``info.json``, in a :class:`~shardkit.privdir.PrivateDir` (docs/design.md §13).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Self

from shardkit.errors import ConfigError
from shardkit.privdir import PrivateDir

__all__ = ["RUN_PREFIX", "check_name", "run_dir_path", "RunDir"]

RUN_PREFIX = "shardkit-serve-"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_WHAT = "a shardkit run directory"
_ADVICE = "Remove it, or choose another --name or base directory"


def check_name(name: str) -> str:
    """A server name: 1-64 of ``[A-Za-z0-9_-]`` (it becomes part of a file name)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"name: expected 1-64 characters of [A-Za-z0-9_-], found {name!r}")
    return name


def run_dir_path(name: str, base_dir: str | os.PathLike[str] | None = None) -> Path:
    """The run directory of this user's server ``name``, by default in ``/dev/shm`` (RAM, so the ring is
    shared memory) when writable, else in the temp dir."""
    shm = Path("/dev/shm")
    if base_dir is None:
        base_dir = shm if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return Path(base_dir) / f"{RUN_PREFIX}{os.geteuid()}-{check_name(name)}"


class RunDir(PrivateDir):
    """An open, verified run directory; files (the socket too, where ``/proc`` allows) are reached through its descriptor."""

    @classmethod
    def claim(cls, path: Path) -> Self:
        """The server side: create ``path`` (0700) or take the existing one if it is safe."""
        if not path.parent.is_dir():
            raise ConfigError(f"base_dir: expected an existing directory, found {str(path.parent)!r}")
        return cls.create(path, what=_WHAT, advice=_ADVICE)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, what: str = _WHAT, advice: str = _ADVICE) -> Self:
        """The job side: open an existing run directory (FileNotFoundError if there is none)."""
        return super().open(path, what=what, advice=advice)

    def address(self, name: str = "sock") -> str:
        """The socket address of ``name``, through this descriptor where the OS allows it."""
        proc = f"/proc/self/fd/{self.fd}"
        return f"{proc}/{name}" if os.path.isdir(proc) else str(self.path / name)
