"""Output directories: what shardkit itself keeps next to a dataset, and clearing one for ``--overwrite``.

Besides the zarr group, a dataset directory may hold directories of shardkit's own, all starting with
``.`` (no array or field may, see :mod:`shardkit.formats.paths`):

* :data:`STAGING_DIR`: an unfinished conversion in one process (its resume records);
* :data:`PARTS_DIR`: an unfinished conversion, append or merge in parts (plans, part manifests, pieces);
* ``.shardkit-versions``: older versions kept for their readers (:mod:`shardkit.formats.versions`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardkit.errors import ConversionError, ShardkitError
from shardkit.formats.metadata import read_json
from shardkit.formats.spec import ATTRS_KEY, ZARR_JSON

__all__ = ["STAGING_DIR", "PARTS_DIR", "looks_like_output", "remove_path", "clear_output"]

#: Directory inside an unfinished dataset that holds what is needed to resume a conversion in one
#: process (the format's reader knows the name too: it reports such a directory as an incomplete dataset).
STAGING_DIR = ".shardkit-staging"
#: Directory inside an output of the parts of conversions (or appends, merges) not committed yet.
PARTS_DIR = ".shardkit-parts"


def looks_like_output(path: Path) -> bool:
    """Empty, or a shardkit dataset, or an interrupted conversion."""
    if not any(path.iterdir()) or (path / STAGING_DIR).is_dir() or (path / PARTS_DIR).is_dir():
        return True
    doc = path / ZARR_JSON
    if doc.is_file():
        try:
            return ATTRS_KEY in read_json(doc).get("attributes", {})
        except ShardkitError:
            return False
    return False


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree (never following a symlink), if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def clear_output(path: Path) -> None:
    """Delete the contents of a previous shardkit output at ``path`` (``--overwrite``), keeping ``path``.

    Its ``zarr.json`` goes first, so a clearing cut short never leaves something that looks complete.

    Raises
    ------
    ConversionError
        ``path`` holds files that are not a shardkit output.
    """
    if not path.exists():
        return
    if not path.is_dir() or not looks_like_output(path):
        raise ConversionError(
            f"{path}: refusing to overwrite: expected an empty directory or a shardkit dataset, found other files"
        )
    remove_path(path / ZARR_JSON)
    for entry in sorted(path.iterdir()):
        remove_path(entry)
