"""Paths taken from metadata stay inside the dataset directory.

A dataset is input someone else may have written: its metadata names the payload array, the field
arrays and every shard file, and a reader opens whatever those names point at. So:

* an array or field name is one plain path component (:func:`check_name`): not empty, no ``/`` or
  ``\\``, not ``.`` or ``..``, no NUL, not starting with ``.`` (that prefix is shardkit's own, e.g.
  ``.shardkit-staging``), and not ``zarr.json``;
* a shard path must be exactly the zarr chunk key of its shard (checked by the payload reader), so
  it is built only from a checked name, ``c`` and digits;
* every file a reader opens is resolved (symlinks followed) and must lie inside the resolved dataset
  directory (:func:`resolve_inside`): a field directory that is a symlink to ``/etc`` or a shard
  file linked to ``~/.ssh/id_rsa`` is refused. Symlinks that stay inside the dataset are allowed.

Every refusal is an :class:`~shardkit.errors.UnsafePathError` (a NotADatasetError, a ValueError).
"""

from __future__ import annotations

from shardkit.errors import UnsafePathError
from shardkit.formats.spec import ZARR_JSON
from shardkit.stores.local import resolve_inside

__all__ = ["check_name", "resolve_inside"]

_MAX_NAME = 255


def check_name(name: str, what: str, where: str) -> str:
    """Return ``name`` if it is a safe single path component, else raise UnsafePathError."""
    bad = (
        not name
        or len(name) > _MAX_NAME
        or name in (".", "..", ZARR_JSON)
        or name.startswith(".")
        or any(c in name for c in "/\\\x00")
    )
    if bad:
        raise UnsafePathError(
            f"{where}: {what} {name!r} is not a plain name inside the dataset (expected one path component "
            "without '/', '\\\\', NUL or a leading '.')"
        )
    return name
