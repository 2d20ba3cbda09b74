"""Which dataset a sampler reads (the SHA-256 of its root ``zarr.json``), so it notices when the
dataset is replaced under it (docs/design.md §4, *Other duties*, dataset identity).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.errors import SamplerError
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES
from shardkit.stores import Location, StoreOptions, as_location, open_store

__all__ = ["DatasetIdentity", "dataset_fingerprint", "ROOT_DOCUMENT", "REMOTE_CHECK_SECONDS"]

#: Least time between two identity checks of a dataset in an object store (docs/design.md §4, dataset identity).
REMOTE_CHECK_SECONDS = 2.0

#: The dataset's root document (the zarr group metadata with shardkit's attributes).
ROOT_DOCUMENT = "zarr.json"

#: A local root document changed less than this long (ns) before it was last read is read again at
#: the next check even if its ``stat`` looks the same: file times are coarse (a clock tick), so a
#: same-size rewrite in the same tick would keep them (the "racy" case).
RACY_NS = 2_000_000_000

#: What ``stat`` says of a local root document: the directory entry's inode, the file's inode,
#: size, mtime and ctime (ns). Equal values mean the same file, unchanged since it was hashed.
_StatKey = tuple[int, int, int, int, int]


def _stat_key(root: Path) -> _StatKey | None:
    """The :data:`_StatKey` of ``root``'s root document, ``None`` when it cannot be stat-ed."""
    path = os.path.join(root, ROOT_DOCUMENT)
    try:
        entry, st = os.lstat(path), os.stat(path)
    except OSError:
        return None
    return entry.st_ino, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def dataset_fingerprint(path: Location) -> str:
    """SHA-256 (hex) of the dataset's root ``zarr.json``; ``FileNotFoundError`` if it has none."""
    return _fingerprint_and_tag(path)[0]


def _fingerprint_and_tag(path: Location, options: StoreOptions | None = None) -> tuple[str, str | None]:
    store = open_store(path, options)
    tag = None if store.is_local else store.head(ROOT_DOCUMENT).etag
    return hashlib.sha256(store.get(ROOT_DOCUMENT, max_nbytes=MAX_DOCUMENT_NBYTES)).hexdigest(), tag


@dataclass(frozen=True)
class DatasetIdentity:
    """A dataset location and the fingerprint (and, in an object store, the ETag of the root
    document) it had when a sampler opened it."""

    path: Path | str
    fingerprint: str
    etag: str | None = None
    #: How an object store is asked (the sampler's retry budget and timeouts).
    options: StoreOptions | None = None
    #: When a remote check last succeeded (monotonic seconds; mutable inside the frozen value).
    _checked: list[float] = field(default_factory=lambda: [time.monotonic()], compare=False, repr=False)
    #: A local root document's stat when its content last matched the fingerprint (``None``: read it
    #: at the next check). A sampler checks every dataset of its mixture after every block read.
    _stat: list[_StatKey | None] = field(default_factory=lambda: [None], compare=False, repr=False)

    @classmethod
    def of(cls, path: Location, options: StoreOptions | None = None) -> DatasetIdentity:
        """The identity ``path`` has now."""
        where = as_location(path)
        before = _stat_key(where) if isinstance(where, Path) else None  # before the read: a change after it is seen
        try:
            identity = cls(where, *_fingerprint_and_tag(where, options), options)
        except FileNotFoundError:
            raise SamplerError(f"{where}: expected a shardkit dataset, found no {ROOT_DOCUMENT}") from None
        identity._remember(before)
        return identity

    def _remember(self, key: _StatKey | None) -> None:
        """Skip reading the local root document while its stat stays ``key`` (unless ``key`` is racy)."""
        racy = key is None or max(key[3], key[4]) + RACY_NS >= time.time_ns()
        self._stat[0] = None if racy else key

    def _unchanged(self) -> tuple[bool, _StatKey | None]:
        """``(stat as remembered, the stat now)`` of a local dataset's root document."""
        if not isinstance(self.path, Path):
            return False, None
        now = _stat_key(self.path)
        return now is not None and now == self._stat[0], now

    def check(self) -> None:
        """Raise :class:`~shardkit.errors.SamplerError` unless the dataset is still the one opened."""
        if self.etag is not None and time.monotonic() - self._checked[0] < REMOTE_CHECK_SECONDS:
            return
        same, stat_now = self._unchanged() if self.etag is None else (False, None)
        if same:
            return
        try:
            if self.etag is not None and open_store(self.path, self.options).head(ROOT_DOCUMENT).etag == self.etag:
                self._checked[0] = time.monotonic()
                return
            now = _fingerprint_and_tag(self.path, self.options)[0]
        except FileNotFoundError:
            raise SamplerError(
                f"{self.path}: the dataset this sampler reads was removed or is being rewritten (its "
                f"{ROOT_DOCUMENT} is gone); create a new sampler once the new dataset is complete"
            ) from None
        if now != self.fingerprint:
            raise SamplerError(
                f"{self.path}: the dataset was replaced while this sampler was reading it (its {ROOT_DOCUMENT} "
                f"changed, e.g. by convert --overwrite); its records no longer match the fields loaded "
                f"when the sampler was created, so it stops here; create a new sampler to read the new dataset"
            )
        if self.etag is None:
            self._remember(stat_now)
