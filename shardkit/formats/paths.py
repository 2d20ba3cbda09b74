"""Paths taken from metadata stay inside the dataset directory (docs/design.md §13): names are single
plain components, and every opened file resolves inside the dataset, else UnsafePathError.
"""

from __future__ import annotations

from shardkit.errors import UnsafePathError
from shardkit.formats.spec import ZARR_JSON
from shardkit.stores.local import resolve_inside

__all__ = ["check_name", "resolve_inside"]

_MAX_NAME = 255


def check_name(name: str, what: str, where: str) -> str:
    """Return ``name`` if it is a safe single path component, else raise UnsafePathError: not empty, no
    ``/``, ``\\`` or NUL, not ``zarr.json``, no leading ``.`` (shardkit's own prefix, also ``.`` and ``..``)."""
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
