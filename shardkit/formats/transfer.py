"""Putting dataset files into a store: checked uploads, and a whole local dataset copied to a store.

Every object shardkit uploads carries its crc32c as user metadata, so a resumed upload tells a
complete object from another with one HEAD; the root document goes last (docs/design.md §9).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from shardkit.errors import NotADatasetError
from shardkit.formats.index import crc32c_of, extend_crc32c
from shardkit.formats.metadata import DatasetMeta, read_dataset_meta
from shardkit.formats.spec import ZARR_JSON
from shardkit.stores import Location, ObjectMeta, Store, open_store
from shardkit.stores.atomic import fsync_dir

__all__ = ["CRC_METADATA_KEY", "file_crc32c", "object_matches", "put_checked", "remove_strays", "upload_dataset", "upload_files",
           "upload_root", "Uploaded", "copy_object", "link_file", "writing"]

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
    """True when ``key`` exists with exactly ``size`` bytes and the crc32c ``crc32c``: one HEAD for an
    object (one without shardkit's crc32c metadata does not match), a checksum for a local file."""
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


@dataclass(frozen=True)
class Uploaded:
    """What :func:`upload_files` did: the dataset's metadata, the files put and their bytes, the files
    already there (same size and crc32c), and each key's crc32c as uploaded or found."""

    meta: DatasetMeta
    files: int
    nbytes: int
    skipped: int
    crc32c: dict[str, int]


def upload_dataset(
    src: str | os.PathLike[str],
    dest: Location,
    *,
    progress: Callable[[int], None] | None = None,
    uploaded: Collection[str] = (),
) -> DatasetMeta:
    """Copy the complete local dataset ``src`` into ``dest`` (a URL or store), root document last, and
    return its metadata; objects already there are skipped (a resumed upload), ``progress`` gets the
    bytes of each file done. ``uploaded``: keys the caller has just put (they need not exist in ``src``)."""
    store = open_store(dest)
    done = upload_files(src, store, progress=progress, uploaded=uploaded)
    remove_strays(store, {*done.crc32c, *uploaded, ZARR_JSON})
    upload_root(src, store)
    return done.meta


def upload_files(
    src: str | os.PathLike[str],
    store: Store,
    *,
    progress: Callable[[int], None] | None = None,
    uploaded: Collection[str] = (),
) -> Uploaded:
    """Every file of the complete local dataset ``src`` but its root document (and shardkit's own
    ``.``-directories) into ``store``: the first half of :func:`upload_dataset`."""
    root = Path(src)
    meta = read_dataset_meta(root)  # a complete, valid dataset, or a named error
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".partial"))
    rels = [p.relative_to(root).as_posix() for p in files]
    if ZARR_JSON not in rels:
        raise NotADatasetError(f"{root}: no {ZARR_JSON}")
    put = nbytes = skipped = 0
    crcs: dict[str, int] = {}
    for path, rel in zip(files, rels):
        if rel == ZARR_JSON or rel.startswith(".") or rel in uploaded:
            continue
        size = path.stat().st_size
        crcs[rel], fresh = _upload_one(store, rel, path)
        put, nbytes, skipped = put + fresh, nbytes + size * fresh, skipped + (not fresh)
        if progress is not None:
            progress(size)
    logger.info("%s: uploaded %d files (%d bytes) to %s, %d already there", root, put, nbytes, store.url, skipped)
    return Uploaded(meta, put, nbytes, skipped, crcs)


def upload_root(src: str | os.PathLike[str], store: Store) -> bool:
    """Upload the root document of the local dataset ``src``, which makes the dataset visible: the
    last step of a publication. False when the same document was there already."""
    return _upload_one(store, ZARR_JSON, Path(src) / ZARR_JSON)[1]


def remove_strays(store: Store, keep: Collection[str]) -> int:
    """Delete every object under the dataset's own directories (the first path component of a key of
    ``keep``, the complete dataset's keys) that ``keep`` does not name, and return how many: shards a
    killed writer or publication uploaded past what this dataset holds. Run before the root document
    goes up, so a visible dataset's directories hold exactly what its metadata names; keys outside
    those directories (and shardkit's ``.``-directories) are never touched."""
    names = set(keep)
    dirs = sorted({k.split("/", 1)[0] for k in names if "/" in k and not k.startswith(".")})
    strays = [m.key for d in dirs for m in store.list(f"{d}/") if m.key not in names]
    for key in strays:
        store.delete(key)
    if strays:
        logger.info("%s: removed %d objects no index names (left by an interrupted write), the first %s",
                    store.url, len(strays), strays[0])
    return len(strays)


def _upload_one(store: Store, key: str, path: Path) -> tuple[int, bool]:
    """Put ``path`` as ``key`` unless an identical object is there; its crc32c and whether it was put."""
    crc = file_crc32c(path)
    if object_matches(store, key, path.stat().st_size, crc):
        logger.debug("%s: already uploaded", store.describe(key))
        return crc, False
    put_checked(store, key, path, crc)
    return crc, True


def link_file(src: Path, dst: Path, *, durable: bool = True) -> bool:
    """Make ``dst`` a hard link of ``src`` (a copy where the file system cannot link), atomically;
    True when it is a link, False when the bytes were copied."""
    tmp = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)
    linked = True
    try:
        os.link(src, tmp)
    except OSError as exc:
        linked = False
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, _CHUNK)
            if durable:
                fout.flush()
                os.fsync(fout.fileno())
    os.replace(tmp, dst)
    if durable:
        fsync_dir(dst.parent)
    return linked


def _bucket_root(a: Store, b: Store) -> tuple[Store, str, str] | None:
    """A store over the bucket both object stores ``a`` and ``b`` live in, and their prefixes in it."""
    ua, ub = urlsplit(a.url), urlsplit(b.url)
    if a.is_local or b.is_local or a.read_only or b.read_only or (ua.scheme, ua.netloc) != (ub.scheme, ub.netloc):
        return None
    return open_store(f"{ua.scheme}://{ua.netloc}", b.options), ua.path.strip("/"), ub.path.strip("/")


def copy_object(src: Store, src_key: str, dst: Store, dst_key: str, *, durable: bool = True) -> str:
    """Copy ``src_key`` of ``src`` to ``dst_key`` of ``dst`` and say how: ``"link"`` (a local hard link),
    ``"copy"`` (local, where no link is possible), ``"server"`` (a server-side copy inside one bucket) or
    ``"transfer"`` (uploaded, downloaded first from a remote source, as a last resort)."""
    if src.is_local and dst.is_local:
        return "link" if link_file(src.local_path(src_key), dst.local_path(dst_key), durable=durable) else "copy"
    if src is dst or (not src.is_local and src.url == dst.url):
        dst.copy(src_key, dst_key)
        return "server"
    shared = _bucket_root(src, dst)
    if shared is not None:
        root, a, b = shared
        root.copy("/".join(p for p in (a, src_key) if p), "/".join(p for p in (b, dst_key) if p))
        return "server"
    logger.info("%s -> %s: no server-side copy between these stores; transferring the bytes", src.describe(src_key), dst.describe(dst_key))
    if src.is_local:
        put_checked(dst, dst_key, src.local_path(src_key))
    else:
        with writing(dst, dst_key) as path:
            data = src.get(src_key)
            with open(path, "wb") as fh:
                fh.write(data)
    return "transfer"


@contextmanager
def writing(store: Store, key: str) -> Iterator[Path]:
    """A local path to write the file ``key`` of ``store`` through: the file's own (the writer makes it
    appear atomically), or a private temporary file uploaded when the block ends without an error."""
    if store.is_local:
        yield store.local_path(key)
        return
    fd, name = tempfile.mkstemp(prefix="shardkit-put-")
    os.close(fd)
    path = Path(name)
    try:
        yield path
        put_checked(store, key, path)
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".partial").unlink(missing_ok=True)
