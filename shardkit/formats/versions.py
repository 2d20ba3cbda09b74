"""Versions of a dataset: a reader keeps the version it opened while a later commit changes the dataset.

A replaced file is kept under ``.shardkit-versions/retired/``, named by the size and crc32c the old
metadata recorded, so a reader finds it by what its own metadata says. Layout and rules: docs/design.md §11.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from shardkit.errors import ChecksumError, MissingShardError, NotADatasetError, ShardkitError, TruncatedShardError, VersionGoneError
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest, read_object
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, parse_json, read_json_object
from shardkit.formats.outputs import PARTS_DIR
from shardkit.formats.spec import ATTRS_KEY, ZARR_JSON
from shardkit.stores import Location, Store, open_store

__all__ = ["VERSIONS_DIR", "DEFAULT_KEEP_VERSIONS", "VersionInfo", "version_key", "retired_key", "read_versioned", "older_copy",
           "read_document", "version_of", "list_versions", "digests_of", "prune", "unfinished"]

logger = logging.getLogger(__name__)

#: Directory (inside the dataset) holding the version documents and the retired files.
VERSIONS_DIR = ".shardkit-versions"
#: Older versions a commit keeps openable by default.
DEFAULT_KEEP_VERSIONS = 2
_RETIRED = "retired"
_VERSION_RE = re.compile(r"v(\d{6,})\.json")


def version_key(number: int) -> str:
    """Key (relative to the dataset root) of the root document of version ``number``."""
    return f"{VERSIONS_DIR}/v{number:06d}.json"


def retired_key(rel: str, nbytes: int, crc32c: int) -> str:
    """Key (relative to the root) of the retired copy of file ``rel`` whose bytes had that size and crc32c."""
    return f"{VERSIONS_DIR}/{_RETIRED}/{rel}@{nbytes}-{crc32c:08x}"


def _is_versioned(store: Store) -> bool:
    if store.is_local:
        return store.local_path(VERSIONS_DIR).is_dir()
    return next(iter(store.list(VERSIONS_DIR)), None) is not None


def read_versioned(store: Store, key: str, digest: FileDigest | None, *, what: str, max_nbytes: int | None = None) -> bytes:
    """The bytes of ``key`` as the reader's metadata recorded them (``digest``), from its retired copy
    when a later version replaced the file (VersionGoneError if that copy was pruned); a damaged file
    raises as :func:`~shardkit.formats.checksums.read_object`."""
    try:
        return read_object(store, key, digest, what=what, max_nbytes=max_nbytes)
    except (TruncatedShardError, ChecksumError, MissingShardError) as exc:
        if digest is None:
            raise
        older = older_copy(store, key, digest.nbytes, digest.crc32c, exc)
        return read_object(store, older, digest, what=what, max_nbytes=max_nbytes)


def read_document(store: Store, key: str, digest: FileDigest | None) -> dict[str, Any]:
    """A JSON document of the dataset (an array's ``zarr.json``) as this reader's version recorded it."""
    raw = read_versioned(store, key, digest, what="metadata document", max_nbytes=MAX_DOCUMENT_NBYTES)
    return parse_json(raw, store.describe(key))


def older_copy(store: Store, rel: str, nbytes: int, crc32c: int, cause: ShardkitError) -> str:
    """The key of the retired copy of ``rel`` with that size and crc32c, for a reader whose file did not
    match. VersionGoneError when a later commit replaced the file and the copy was pruned; ``cause``,
    re-raised, when the file is simply damaged."""
    key = retired_key(rel, nbytes, crc32c)
    if store.exists(key):
        return key
    if _is_versioned(store):
        try:
            now = digests_of(_current_attrs(store), store.url).get(rel)
        except ShardkitError:
            now = None
        if now is not None and now != (nbytes, crc32c):
            raise VersionGoneError(
                f"{store.describe(rel)}: a newer version of the dataset replaced this file, and the copy kept for "
                f"the version this reader opened was pruned ({cause}); reopen the dataset to read its current version"
            ) from None
    raise cause


@dataclass(frozen=True)
class VersionInfo:
    """One kept version of a dataset, as ``shardkit info`` shows it: its number (1 for the first
    commit), records, operation (``convert``, ``append``, ``merge``), when its root document was
    written (epoch seconds, or ``None``) and whether the root ``zarr.json`` describes it."""

    number: int
    records: int
    operation: str
    committed: float | None
    current: bool

    def to_json(self) -> dict[str, Any]:
        return {"version": self.number, "records": self.records, "operation": self.operation,
                "committed": self.committed, "current": self.current}


def version_of(attrs: dict[str, Any]) -> int:
    """The version number recorded in a dataset's ``shardkit`` attributes (1 when none is recorded)."""
    source = attrs.get("source")
    number = source.get("version", 1) if isinstance(source, dict) else 1
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else 1


def _version_docs(store: Store) -> dict[int, float | None]:
    """``{number: modification time}`` of every version document in the store."""
    out: dict[int, float | None] = {}
    for meta in store.list(VERSIONS_DIR):
        m = _VERSION_RE.fullmatch(meta.key[len(VERSIONS_DIR) + 1 :])
        if m is not None:
            out[int(m.group(1))] = meta.mtime
    return out


def _attrs_of(store: Store, key: str) -> dict[str, Any]:
    """The ``shardkit`` attributes of the root document ``key`` (bounded, strictly parsed JSON)."""
    where = store.describe(key)
    doc = read_json_object(store, key)
    return jv.mapping(jv.mapping(doc.get("attributes", {}), "attributes", where).get(ATTRS_KEY), ATTRS_KEY, where)


def _current_attrs(store: Store) -> dict[str, Any]:
    try:
        return _attrs_of(store, ZARR_JSON)
    except NotADatasetError:
        raise NotADatasetError(f"{store.describe(ZARR_JSON)}: a zarr group without 'shardkit' attributes") from None


def list_versions(location: Location) -> list[VersionInfo]:
    """Every version of the dataset at ``location`` whose root document is kept, oldest first."""
    store = open_store(location)
    docs = _version_docs(store)
    if not docs:
        return []
    current = version_of(_current_attrs(store))
    out = []
    for number in sorted(v for v in docs if v <= current):  # a later one belongs to an unfinished commit
        try:
            attrs = _attrs_of(store, version_key(number))
        except ShardkitError as exc:
            logger.warning("%s: version %d unreadable (%s)", store.url, number, exc)
            continue
        source = attrs.get("source") if isinstance(attrs.get("source"), dict) else {}
        history = source.get("history") if isinstance(source, dict) else None
        operation = "convert"
        if isinstance(history, list) and history and isinstance(history[-1], dict):
            operation = str(history[-1].get("operation", "convert"))
        records = attrs.get("num_records")
        out.append(VersionInfo(number, records if isinstance(records, int) else -1, operation, docs[number], number == current))
    return out


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


def _retired_by(store: Store, older: int, newer: int) -> list[str]:
    """Retired copies only versions up to ``older`` need: files whose content ``newer`` records differently."""
    old = digests_of(_attrs_of(store, version_key(older)), store.describe(version_key(older)))
    new = digests_of(_attrs_of(store, version_key(newer)), store.describe(version_key(newer)))
    return [retired_key(rel, n, c) for rel, (n, c) in old.items() if rel in new and new[rel] != (n, c)]


def prune(location: Location, keep: int = DEFAULT_KEEP_VERSIONS) -> list[int]:
    """Delete every version older than the newest ``keep + 1``; returns their numbers. Oldest first,
    retired copies before the document, so a prune cut short is finished by the next one."""
    store = open_store(location)
    docs = _version_docs(store)
    if not docs:
        return []
    current = version_of(_current_attrs(store))
    numbers = sorted(v for v in docs if v <= current)
    pruned = []
    for older, newer in itertools.pairwise(numbers):
        if older >= current - keep:
            break
        for key in _retired_by(store, older, newer):
            store.delete(key)
        store.delete(version_key(older))
        pruned.append(older)
    if pruned:
        if store.is_local:
            _remove_empty_dirs(store, f"{VERSIONS_DIR}/{_RETIRED}")
        logger.info("%s: pruned versions %s", store.url, ", ".join(map(str, pruned)))
    return pruned


def _remove_empty_dirs(store: Store, key: str) -> None:
    top = store.local_path(key)
    if not top.is_dir() or top.is_symlink():
        return
    for dirpath, _dirs, _files in os.walk(top, topdown=False):  # children before their parent
        if dirpath != str(top):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def unfinished(location: Location) -> list[str]:
    """What an interrupted conversion or append left in the dataset (its ``.shardkit-parts/<plan>``):
    one sentence each, saying how to finish it and that ``verify`` may report the files its commit
    already replaced in place (readers read their retired copies)."""
    store = open_store(location)
    if store.read_only:  # a read-only store (HTTP) cannot be listed, nor appended to through it
        return []
    plans = sorted({m.key.split("/")[1] for m in store.list(PARTS_DIR) if m.key.count("/") >= 2})
    if not plans:
        return []
    try:
        current = f"version {version_of(_current_attrs(store))}"
    except ShardkitError:
        current = "its previous version"
    out = []
    for plan in plans:
        where = store.describe(f"{PARTS_DIR}/{plan}")
        try:
            operation = read_json_object(store, f"{PARTS_DIR}/{plan}/plan.json").get("operation")
        except (ShardkitError, OSError):
            operation = None
        what = {"append": "an append", "convert": "a conversion in parts"}.get(str(operation), "a conversion or append")
        out.append(f"{what} into this dataset was interrupted ({where}); run the same command again to finish it. "
                   f"Until then the dataset opens at {current}, and verify may report the files its commit had "
                   "already replaced (their old bytes are kept for readers)")
    return out
