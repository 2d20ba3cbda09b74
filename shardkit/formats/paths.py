"""Paths taken from metadata stay inside the dataset directory (docs/design.md §13).

Metadata someone else may have written names the arrays and every shard file, so names are single
plain components (:func:`check_name`), shard paths are exactly their zarr chunk key, and every opened
file must resolve inside the dataset (:func:`resolve_inside`; symlinks that stay inside are allowed).
Every refusal is an :class:`~shardkit.errors.UnsafePathError` (a NotADatasetError, a ValueError).
"""

from __future__ import annotations

from shardkit.errors import UnsafePathError
from shardkit.formats.spec import ZARR_JSON
from shardkit.stores.local import resolve_inside

__all__ = ["check_name", "resolve_inside"]

_MAX_NAME = 255


def check_name(name: str, what: str, where: str) -> str:
    """Return ``name`` if it is a safe single path component, else raise UnsafePathError.

    Safe: not empty, no ``/`` or ``\\``, not ``.`` or ``..``, no NUL, not starting with ``.`` (that
    prefix is shardkit's own, e.g. ``.shardkit-staging``), and not ``zarr.json``.
    """
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
