"""Versions of a dataset: a reader keeps the version it opened while a later commit changes the dataset.

A dataset that grows (``convert --append``, see :mod:`shardkit.formats.commit`) stays an ordinary
format 1.1 dataset in place: the root ``zarr.json`` always describes the newest version, and zarr
readers see that. Growing it changes a few files in place: the last payload shard when it was not
full (it receives the first new records), the last chunk of each field array when it was not full,
and the array documents (their shape). Every other file is never rewritten: full shards and full
field chunks keep their bytes, and new ones get new names.

Layout, next to the data::

    DATASET/.shardkit-versions/
      v000001.json, v000002.json, ...   the root document of every kept version, byte for byte
      retired/<path>@<nbytes>-<crc32c>  the old bytes of a file a later version replaced

A commit saves each file it is about to replace under ``retired/``, named by the path and the size
and crc32c the *old* metadata recorded for it (a hard link on a local file system, a server-side
copy on an object store: no payload bytes move), before it writes the new bytes in place. A reader
of an older version finds a replaced file by exactly what its own metadata recorded: a shard whose
size, or a document or field chunk whose size or crc32c, is not what it expects is read from its
retired copy instead (:func:`retired_path`, :func:`read_versioned`). Files are found by content,
not by version number, so a reader needs nothing but its own metadata, and a file replaced twice
(two small appends filling one shard) leaves one copy per content.

Cleanup
    Each commit keeps the newest ``keep`` older versions openable (default
    :data:`DEFAULT_KEEP_VERSIONS`) and prunes the rest (:func:`prune`): a version's retired copies
    are the files whose content the next version changed, so pruning version ``m`` deletes
    ``retired/<k>@<m's digest of k>`` for every ``k`` that version ``m + 1`` records differently,
    and then ``v<m>.json``. A reader still holding a pruned version gets an error saying so
    (:class:`~shardkit.errors.VersionGoneError`) and must reopen the dataset.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.errors import (
    ChecksumError,
    MissingShardError,
    NotADatasetError,
    ShardkitError,
    TruncatedShardError,
    VersionGoneError,
)
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest, read_verified
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, parse_json_document, read_json
from shardkit.formats.paths import resolve_inside
from shardkit.formats.spec import ATTRS_KEY, ZARR_JSON

__all__ = [
    "VERSIONS_DIR",
    "DEFAULT_KEEP_VERSIONS",
    "VersionInfo",
    "version_key",
    "retired_key",
    "retired_path",
    "read_versioned",
    "older_copy",
    "read_document",
    "version_of",
    "list_versions",
    "digests_of",
    "prune",
]

logger = logging.getLogger(__name__)

#: Directory (inside the dataset) holding the version documents and the retired files.
VERSIONS_DIR = ".shardkit-versions"
#: Older versions a commit keeps openable by default.
DEFAULT_KEEP_VERSIONS = 2
_RETIRED = "retired"
_VERSION_RE = re.compile(r"v(\d{6,})\.json")


def version_key(number: int) -> str:
    """Path (relative to the dataset root) of the root document of version ``number``."""
    return f"{VERSIONS_DIR}/v{number:06d}.json"


def retired_key(rel: str, nbytes: int, crc32c: int) -> str:
    """Path (relative to the root) of the retired copy of file ``rel`` whose bytes had that size and crc32c."""
    return f"{VERSIONS_DIR}/{_RETIRED}/{rel}@{nbytes}-{crc32c:08x}"


def _is_versioned(root: Path) -> bool:
    return (root / VERSIONS_DIR).is_dir()


def retired_path(root: Path, rel: str, nbytes: int, crc32c: int) -> Path | None:
    """The retired copy of ``rel`` with that size and crc32c, if a later version replaced it and kept it."""
    path = resolve_inside(root, retired_key(rel, nbytes, crc32c), "retired dataset file")
    return path if path.is_file() else None


def read_versioned(root: Path, rel: str, digest: FileDigest | None, *, what: str, max_nbytes: int | None = None) -> bytes:
    """The bytes of ``rel`` as the reader's metadata recorded them (``digest``), from its retired copy
    when a later version replaced the file.

    Raises
    ------
    VersionGoneError
        The file changed and its copy for this version was pruned (the reader must reopen).
    MissingShardError, TruncatedShardError, ChecksumError, NotADatasetError
        As :func:`~shardkit.formats.checksums.read_verified`, when the file is simply damaged.
    """
    path = resolve_inside(root, rel, what)
    try:
        return read_verified(path, digest, what=what, max_nbytes=max_nbytes)
    except (TruncatedShardError, ChecksumError, MissingShardError) as exc:
        if digest is None:
            raise
        older = older_copy(root, rel, digest.nbytes, digest.crc32c, exc)
        return read_verified(older, digest, what=what, max_nbytes=max_nbytes)


def read_document(root: Path, rel: str, digest: FileDigest | None) -> dict[str, Any]:
    """A JSON document of the dataset (an array's ``zarr.json``) as this reader's version recorded it."""
    raw = read_versioned(root, rel, digest, what="metadata document", max_nbytes=MAX_DOCUMENT_NBYTES)
    return parse_json_document(raw, root / rel)


def older_copy(root: Path, rel: str, nbytes: int, crc32c: int, cause: ShardkitError) -> Path:
    """The retired copy of ``rel`` with that size and crc32c, for a reader whose file did not match.

    Raises
    ------
    VersionGoneError
        The current version records other bytes for ``rel`` (a later commit replaced it) and the
        copy was pruned.
    ShardkitError
        ``cause``, re-raised, when the file is simply damaged (the current version records the same
        bytes, or the dataset has no versions).
    """
    older = retired_path(root, rel, nbytes, crc32c)
    if older is not None:
        return older
    if _is_versioned(root):
        try:
            now = digests_of(_current_attrs(root), str(root)).get(rel)
        except ShardkitError:
            now = None
        if now is not None and now != (nbytes, crc32c):
            raise VersionGoneError(
                f"{root / rel}: a newer version of the dataset replaced this file, and the copy kept for the "
                f"version this reader opened was pruned ({cause}); reopen the dataset to read its current version"
            ) from None
    raise cause


@dataclass(frozen=True)
class VersionInfo:
    """One kept version of a dataset, as ``shardkit info`` shows it.

    Attributes
    ----------
    number
        Version number (1 for the first commit).
    records
        Records in that version.
    operation
        ``convert``, ``append`` or ``merge``.
    committed
        When its root document was written (seconds since the epoch, from the file's mtime).
    current
        It is the version the root ``zarr.json`` describes.
    """

    number: int
    records: int
    operation: str
    committed: float
    current: bool

    def to_json(self) -> dict[str, Any]:
        return {"version": self.number, "records": self.records, "operation": self.operation,
                "committed": self.committed, "current": self.current}


def version_of(attrs: dict[str, Any]) -> int:
    """The version number recorded in a dataset's ``shardkit`` attributes (1 when none is recorded)."""
    source = attrs.get("source")
    number = source.get("version", 1) if isinstance(source, dict) else 1
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else 1


def _version_numbers(root: Path) -> list[int]:
    top = root / VERSIONS_DIR
    if not top.is_dir():
        return []
    found = (_VERSION_RE.fullmatch(p.name) for p in top.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def _attrs_of(root: Path, number: int) -> dict[str, Any]:
    """The ``shardkit`` attributes of version ``number`` (bounded, strictly parsed JSON)."""
    path = resolve_inside(root, version_key(number), "version document")
    doc = read_json(path)
    attrs = jv.mapping(jv.mapping(doc.get("attributes", {}), "attributes", str(path)).get(ATTRS_KEY), ATTRS_KEY, str(path))
    return attrs


def list_versions(root: str | os.PathLike[str]) -> list[VersionInfo]:
    """Every version of the dataset at ``root`` whose root document is kept, oldest first.

    A dataset written without versions (a single conversion by an older shardkit) has none.
    """
    root = Path(root)
    current = version_of(_current_attrs(root)) if (root / VERSIONS_DIR).is_dir() else 0
    numbers = [v for v in _version_numbers(root) if v <= current]  # a later one belongs to an unfinished commit
    out = []
    for number in numbers:
        try:
            attrs = _attrs_of(root, number)
        except ShardkitError as exc:
            logger.warning("%s: version %d unreadable (%s)", root, number, exc)
            continue
        source = attrs.get("source") if isinstance(attrs.get("source"), dict) else {}
        history = source.get("history") if isinstance(source, dict) else None
        operation = "convert"
        if isinstance(history, list) and history and isinstance(history[-1], dict):
            operation = str(history[-1].get("operation", "convert"))
        records = attrs.get("num_records")
        mtime = (root / version_key(number)).stat().st_mtime
        out.append(VersionInfo(number, records if isinstance(records, int) else -1, operation, mtime, number == current))
    return out


def _current_attrs(root: Path) -> dict[str, Any]:
    doc = read_json(root / ZARR_JSON)
    attrs = doc.get("attributes", {}).get(ATTRS_KEY) if isinstance(doc.get("attributes"), dict) else None
    if not isinstance(attrs, dict):
        raise NotADatasetError(f"{root / ZARR_JSON}: a zarr group without 'shardkit' attributes")
    return attrs


def digests_of(attrs: dict[str, Any], where: str) -> dict[str, tuple[int, int]]:
    """``{path: (nbytes, crc32c)}`` of every file a version's attributes record: shards and ``files``."""
    out: dict[str, tuple[int, int]] = {}
    for i, shard in enumerate(jv.array(attrs.get("shards", []), "shards", where)):
        doc = jv.mapping(shard, f"shards[{i}]", where)
        out[jv.string(doc.get("path"), f"shards[{i}].path", where)] = (
            jv.integer(doc.get("nbytes"), f"shards[{i}].nbytes", where),
            jv.integer(doc.get("crc32c"), f"shards[{i}].crc32c", where),
        )
    for rel, digest in jv.mapping(attrs.get("files", {}), "files", where).items():
        d = FileDigest.from_json(digest, where=where, what=f"files[{rel!r}]")
        out[rel] = (d.nbytes, d.crc32c)
    return out


def _retired_by(root: Path, older: int, newer: int) -> Iterator[str]:
    """Retired copies that only version ``older`` (and versions before it) needed: the files whose
    content version ``newer`` records differently."""
    where_a, where_b = str(root / version_key(older)), str(root / version_key(newer))
    old = digests_of(_attrs_of(root, older), where_a)
    new = digests_of(_attrs_of(root, newer), where_b)
    for rel, (nbytes, crc) in old.items():
        if rel in new and new[rel] != (nbytes, crc):
            yield retired_key(rel, nbytes, crc)


def prune(root: str | os.PathLike[str], keep: int = DEFAULT_KEEP_VERSIONS) -> list[int]:
    """Delete every version older than the newest ``keep + 1`` (their retired files and documents).

    Returns the pruned version numbers. Versions are pruned oldest first, each one's retired copies
    before its document, so a prune cut short is finished by the next one.
    """
    root = Path(root)
    current = version_of(_current_attrs(root))
    numbers = [v for v in _version_numbers(root) if v <= current]
    pruned = []
    for older, newer in itertools.pairwise(numbers):
        if older >= current - keep:
            break
        for key in _retired_by(root, older, newer):
            path = resolve_inside(root, key, "retired dataset file")
            path.unlink(missing_ok=True)
        resolve_inside(root, version_key(older), "version document").unlink(missing_ok=True)
        pruned.append(older)
    if pruned:
        _remove_empty_dirs(root / VERSIONS_DIR / _RETIRED)
        logger.info("%s: pruned versions %s", root, ", ".join(map(str, pruned)))
    return pruned


def _remove_empty_dirs(top: Path) -> None:
    if not top.is_dir() or top.is_symlink():
        return
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        if dirpath != str(top):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
