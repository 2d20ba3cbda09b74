"""Putting dataset files into a store: checked uploads, and a whole local dataset copied to a store.

Every object shardkit uploads carries its crc32c as user metadata (``shardkit-crc32c``), so a
resumed upload can tell an object that is already complete from one that is missing, partial or
different with one HEAD request, without downloading it (:func:`object_matches`). The dataset's root
document goes last (:func:`upload_dataset`), so a reader sees either the whole dataset or none:
until then opening the URL reports an incomplete dataset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from shardkit.errors import NotADatasetError
from shardkit.formats.index import crc32c_of, extend_crc32c
from shardkit.formats.metadata import DatasetMeta, read_dataset_meta
from shardkit.formats.spec import ZARR_JSON
from shardkit.stores import Location, ObjectMeta, Store, open_store

__all__ = ["CRC_METADATA_KEY", "file_crc32c", "object_matches", "put_checked", "upload_dataset"]

logger = logging.getLogger(__name__)

#: User-metadata key holding an uploaded object's crc32c (decimal).
CRC_METADATA_KEY = "shardkit-crc32c"
_CHUNK = 8 << 20


def file_crc32c(path: str | os.PathLike[str]) -> int:
    """crc32c of a local file, streamed in 8 MiB reads."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = extend_crc32c(crc, chunk)
    return crc


def object_matches(store: Store, key: str, size: int, crc32c: int) -> bool:
    """True when ``key`` exists with exactly ``size`` bytes and the crc32c ``crc32c``.

    Object stores answer from the size and the ``shardkit-crc32c`` metadata recorded at upload (one
    HEAD); an object without that metadata (uploaded by something else) does not match. Local files
    are checksummed.
    """
    try:
        meta = store.head(key)
    except FileNotFoundError:
        return False
    if meta.size != size:
        return False
    if store.is_local:
        return file_crc32c(store.local_path(key)) == crc32c
    return meta.metadata.get(CRC_METADATA_KEY) == str(crc32c)


def put_checked(store: Store, key: str, source: str | os.PathLike[str] | bytes, crc32c: int | None = None) -> ObjectMeta:
    """Upload a local file (or bytes) as ``key`` with its crc32c recorded in the object's metadata."""
    if isinstance(source, bytes):
        crc = crc32c_of(source) if crc32c is None else crc32c
        return store.put(key, source, metadata={CRC_METADATA_KEY: str(crc)})
    crc = file_crc32c(source) if crc32c is None else crc32c
    return store.put_file(key, source, metadata={CRC_METADATA_KEY: str(crc)})


def upload_dataset(
    src: str | os.PathLike[str],
    dest: Location,
    *,
    progress: Callable[[int], None] | None = None,
) -> DatasetMeta:
    """Copy the complete local dataset ``src`` into ``dest`` (a URL or store), root document last.

    Objects already at ``dest`` with the same size and crc32c are not uploaded again, so an
    interrupted upload resumes where it stopped. ``progress`` is called with the bytes of each file
    done. Returns the dataset's metadata.
    """
    root = Path(src)
    meta = read_dataset_meta(root)  # a complete, valid dataset, or a named error
    store = open_store(dest)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".partial"))
    rels = [p.relative_to(root).as_posix() for p in files]
    if ZARR_JSON not in rels:
        raise NotADatasetError(f"{root}: no {ZARR_JSON}")
    for path, rel in zip(files, rels):
        if rel == ZARR_JSON or rel.startswith("."):
            continue
        _upload_one(store, rel, path)
        if progress is not None:
            progress(path.stat().st_size)
    _upload_one(store, ZARR_JSON, root / ZARR_JSON)
    logger.info("%s: uploaded %d files to %s", root, len(files), store.url)
    return meta


def _upload_one(store: Store, key: str, path: Path) -> None:
    crc = file_crc32c(path)
    if object_matches(store, key, path.stat().st_size, crc):
        logger.debug("%s: already uploaded", store.describe(key))
        return
    put_checked(store, key, path, crc)
