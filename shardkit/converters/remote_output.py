"""Converting into an object store: ``shardkit convert SRC -o s3://bucket/ds``.

The conversion runs exactly as for a local output (same staging, same resume, same bytes), into a
local *staging directory* that stands for the remote dataset; what changes is where finished files
go:

1. each shard, once complete and recorded in the staging area, is uploaded (multipart when large)
   with its crc32c in the object's metadata, and its local copy is deleted, so the local disk holds
   about one shard at a time plus the small staging records;
2. when every record is written, the field arrays and array documents are uploaded, every shard is
   checked to be in the store (size and crc32c, one HEAD each; a shard whose upload a kill cut short
   is uploaded again from its local copy), and the root ``zarr.json`` goes up last: until then a
   reader sees an incomplete dataset, never a partial one;
3. the staging directory is removed.

Resume: a re-run of the same command finds the staging directory again (its path is derived from
the URL) and continues after the last shard that is staged *and* either still local or already in
the store with the right size and crc32c; shards are cut at the same records, so the result is
byte-identical to an uninterrupted run. The staging directory is private (0700) under
``staging_dir`` (default: the system temporary directory); to resume on another machine, point
``--staging-dir`` at the same place or start over.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from shardkit.errors import ConversionError
from shardkit.formats import DatasetMeta, ShardInfo
from shardkit.formats.metadata import read_dataset_meta
from shardkit.formats.publish import object_matches, put_checked, upload_dataset
from shardkit.formats.spec import ZARR_JSON
from shardkit.privdir import PrivateDir
from shardkit.stores import Store, location_string, open_store

__all__ = ["RemoteOutput", "is_remote_output"]

logger = logging.getLogger(__name__)


def is_remote_output(out: str | os.PathLike[str]) -> bool:
    """True for an object-store URL (``file://`` and plain paths are local)."""
    from shardkit.stores import is_url

    return is_url(out) and not str(out).lower().startswith("file://")


class RemoteOutput:
    """The object-store destination of one conversion and its local staging directory.

    Parameters
    ----------
    url
        Destination dataset URL.
    staging_dir
        Parent of the local staging directory (default: the system temporary directory).
    """

    def __init__(self, url: str, staging_dir: str | os.PathLike[str] | None = None) -> None:
        self.store: Store = open_store(url)
        if self.store.read_only:
            raise ConversionError(f"{url}: cannot convert into a read-only store (http(s):// URLs are read-only)")
        self.url = self.store.url
        parent = Path(staging_dir) if staging_dir is not None else Path(tempfile.gettempdir())
        if not parent.is_dir():
            raise ConversionError(f"staging_dir: expected an existing directory, found {str(parent)!r}")
        with PrivateDir.create(parent / f"shardkit-upload-{os.geteuid()}", what="the staging directory",
                               advice="Remove it, or choose another --staging-dir", tighten=True) as base:
            #: The local directory the conversion writes (stable for one URL, so a re-run resumes).
            self.local = base.path / hashlib.sha256(self.url.encode()).hexdigest()[:24]

    # ------------------------------------------------------------------ before converting
    def finished(self) -> DatasetMeta | None:
        """The metadata of the dataset at the URL, if there is one (complete: its root document exists)."""
        if not self.store.exists(ZARR_JSON):
            return None
        meta = read_dataset_meta(self.store)
        if self.local.exists():  # a run killed after publishing, before removing its staging directory
            shutil.rmtree(self.local, ignore_errors=True)
        return meta

    def check_destination(self, names: list[str], *, overwrite: bool) -> None:
        """Refuse a prefix holding anything but this conversion's arrays (or, with ``overwrite``, a
        previous shardkit dataset, which is deleted: its root document first)."""
        objects = list(self.store.list(""))
        foreign = sorted({m.key for m in objects if m.key.split("/", 1)[0] not in (*names, ZARR_JSON)})
        has_root = any(m.key == ZARR_JSON for m in objects)
        if overwrite and (has_root or objects):
            if foreign and not has_root:
                raise ConversionError(
                    f"{self.url}: refusing to overwrite: expected a shardkit dataset, found {', '.join(foreign[:3])}"
                )
            if has_root:
                read_dataset_meta(self.store)  # a shardkit dataset, or a named error: never delete anything else
            self.store.delete(ZARR_JSON)
            for m in objects:
                self.store.delete(m.key)
            if self.local.exists():
                shutil.rmtree(self.local)
            return
        if has_root:
            raise ConversionError(f"{self.url}: a dataset already exists here; use --overwrite to replace it")
        if foreign:
            raise ConversionError(
                f"{self.url}: the prefix holds objects that are not a shardkit dataset ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose another prefix"
            )

    # ------------------------------------------------------------------ while converting
    def shard_present(self, info: ShardInfo) -> bool:
        """A staged shard counts when its local file is intact or the store has it (size + crc32c)."""
        local = self.local / info.path
        if local.is_file() and local.stat().st_size == info.nbytes:
            return True
        return object_matches(self.store, info.path, info.nbytes, info.crc32c)

    def shard_done(self, info: ShardInfo) -> None:
        """Upload a completed, staged shard and delete its local copy."""
        local = self.local / info.path
        if not local.is_file():
            return  # uploaded by a previous run (shard_present checked the store)
        put_checked(self.store, info.path, local, info.crc32c)
        local.unlink()
        logger.info("%s: uploaded shard %s", self.url, info.path)

    # ------------------------------------------------------------------ after converting
    def publish(self) -> DatasetMeta:
        """Upload what is left (fields, documents, shards a kill left local), root document last;
        then remove the staging directory."""
        meta = read_dataset_meta(self.local)
        missing = [s for s in meta.shards if not (self.local / s.path).is_file()
                   and not object_matches(self.store, s.path, s.nbytes, s.crc32c)]
        if missing:
            raise ConversionError(
                f"{self.url}: shard {missing[0].path} is neither in the store nor in the staging directory "
                f"{self.local}; re-run with --overwrite"
            )
        upload_dataset(self.local, self.store)
        shutil.rmtree(self.local, ignore_errors=True)
        logger.info("%s: published %d records", location_string(self.store), meta.num_records)
        return meta
