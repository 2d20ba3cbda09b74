"""Output directories: what shardkit itself keeps next to a dataset, and clearing one for ``--overwrite``.

shardkit's own directories start with ``.`` (no array or field may): :data:`STAGING_DIR`,
:data:`PARTS_DIR` and ``.shardkit-versions`` (docs/design.md §3). An output that overlaps an input is
refused before anything is deleted (:func:`refuse_overlap`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shardkit.errors import ConversionError, ShardkitError
from shardkit.formats.metadata import PARTS_NAME, STAGING_NAME, read_dataset_meta, read_json
from shardkit.formats.spec import ATTRS_KEY, ZARR_JSON
from shardkit.stores import Location, Store, as_location, location_string

__all__ = ["STAGING_DIR", "PARTS_DIR", "looks_like_output", "remove_path", "clear_output", "top_names", "clear_store", "refuse_overlap"]

#: Resume state of a conversion in one process (readers report a dataset holding it as incomplete).
STAGING_DIR = STAGING_NAME
#: Parts of conversions, appends or merges not committed yet.
PARTS_DIR = PARTS_NAME


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
    """Delete the contents of a previous shardkit output at ``path`` (``--overwrite``), keeping ``path``,
    its ``zarr.json`` first so a clearing cut short never looks complete; ConversionError for other files."""
    if not path.exists():
        return
    if not path.is_dir() or not looks_like_output(path):
        raise ConversionError(f"{path}: refusing to overwrite: expected an empty directory or a shardkit dataset, found other files")
    remove_path(path / ZARR_JSON)
    for entry in sorted(path.iterdir()):
        remove_path(entry)


def top_names(store: Store, allowed: Iterable[str] = ()) -> list[str]:
    """The top-level names in ``store`` that are not in ``allowed``, sorted."""
    ok = set(allowed)
    if store.is_local:
        root = store.local_path()
        names = {e.name for e in root.iterdir()} if root.is_dir() else set()
    else:
        names = {m.key.split("/", 1)[0] for m in store.list("")}
    return sorted(names - ok)


def clear_store(store: Store) -> None:
    """:func:`clear_output` for any store (a directory or prefix holding anything else is refused)."""
    if store.is_local:
        clear_output(store.local_path())
        return
    objects = list(store.list(""))
    if not objects:
        return
    if any(m.key == ZARR_JSON for m in objects):
        read_dataset_meta(store)  # a shardkit dataset, or a named error: never delete anything else
    elif top_names(store, (STAGING_DIR, PARTS_DIR, ".shardkit-versions")):
        raise ConversionError(f"{store.url}: refusing to overwrite: expected a shardkit dataset, found other objects")
    store.delete(ZARR_JSON)
    for m in objects:
        store.delete(m.key)


#: URL schemes that name the same kind of store under two spellings.
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "azure": "az"}


def _place(location: Location) -> tuple[str, str, tuple[str, ...]]:
    """Where ``location`` is, spelled one way: ``("file", "", parts of the resolved path)`` (symlinks,
    ``..``, relative paths and trailing slashes resolved) or ``(scheme, bucket, prefix parts)``."""
    where = as_location(location, resolve=True)
    if isinstance(where, Path):
        return "file", "", where.parts
    parts = urlsplit(where)
    scheme = parts.scheme.lower()
    prefix = tuple(p for p in unquote(parts.path).split("/") if p not in ("", "."))
    return _SCHEME_ALIASES.get(scheme, scheme), parts.netloc.lower(), prefix


def _identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of ``path``, or None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities(path: Path) -> set[tuple[int, int]]:
    """The identities of ``path`` and of every existing ancestor (a bind mount has one identity)."""
    return {i for i in map(_identity, (path, *path.parents)) if i is not None}


def _inside(inner: tuple[str, str, tuple[str, ...]], outer: tuple[str, str, tuple[str, ...]]) -> bool:
    return inner[:2] == outer[:2] and inner[2][: len(outer[2])] == outer[2]


def refuse_overlap(inputs: Sequence[Location], out: Location, operation: str) -> None:
    """ConversionError (naming both) for an output that is, contains or lies inside one of ``inputs``,
    however each is spelled: local paths resolved and compared by device and inode, URLs by scheme
    alias, bucket (case-insensitive) and prefix."""
    target = _place(out)
    for given in inputs:
        source = _place(given)
        clash = _inside(target, source) or _inside(source, target)
        if not clash and source[0] == target[0] == "file":
            source_path, target_path = Path(*source[2]), Path(*target[2])
            clash = (_identity(source_path) in _identities(target_path) or _identity(target_path) in _identities(source_path))
        if clash:
            raise ConversionError(
                f"{operation}: the output {location_string(out)} is, contains or lies inside the input "
                f"{location_string(given)}; write the result somewhere else. Nothing was changed"
            )
