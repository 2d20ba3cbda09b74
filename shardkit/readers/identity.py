"""Which dataset a sampler reads, so it notices when the dataset is replaced under it.

A sampler loads the small fields (labels, boxes) into RAM when it is created and reads payload from
the shard files for as long as it runs. If the directory is replaced in the meantime (``shardkit
convert --overwrite`` of the same path, a ``mv`` of another version into place), payload from the
new dataset would be paired with labels of the old one without any error. The sampler therefore
records the dataset's identity when it opens it and checks it again before each epoch and after
every block it reads from disk, and stops with a :class:`~shardkit.errors.SamplerError` that names
the path.

The identity is the SHA-256 of the root ``zarr.json``: it holds the schema, the record count and
every shard's checksum, so a dataset with different records has a different identity, while a
re-conversion that produces byte-identical data keeps it (nothing the sampler reads changed).
For a dataset in an object store the check is a HEAD request first: while the root document's ETag
is the one seen when the identity was taken, it has not changed; only a different ETag costs a GET
and a hash (an identical re-upload keeps the identity). A round trip after every block would add a
full request latency (20-100 ms) to each block, so remote checks run at most every
:data:`REMOTE_CHECK_SECONDS`; in between, every shard read carries ``If-Match`` with the ETag it
was first read with (:mod:`shardkit.formats.ranged`), so payload of a replaced shard is never
passed on either way, and cached shards are kept per dataset version.
During a conversion the root document does not exist (the writer deletes the old output first and
writes the root document last), which the check reports as a dataset that is gone.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.errors import SamplerError
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES
from shardkit.stores import Location, StoreOptions, as_location, open_store

__all__ = ["DatasetIdentity", "dataset_fingerprint", "ROOT_DOCUMENT", "REMOTE_CHECK_SECONDS"]

#: Least time between two identity checks of a dataset in an object store (see the module docstring).
REMOTE_CHECK_SECONDS = 2.0

#: The dataset's root document (the zarr group metadata with shardkit's attributes).
ROOT_DOCUMENT = "zarr.json"


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

    @classmethod
    def of(cls, path: Location, options: StoreOptions | None = None) -> DatasetIdentity:
        """The identity ``path`` has now."""
        where = as_location(path)
        try:
            return cls(where, *_fingerprint_and_tag(where, options), options)
        except FileNotFoundError:
            raise SamplerError(f"{where}: expected a shardkit dataset, found no {ROOT_DOCUMENT}") from None

    def check(self) -> None:
        """Raise :class:`~shardkit.errors.SamplerError` unless the dataset is still the one opened."""
        if self.etag is not None and time.monotonic() - self._checked[0] < REMOTE_CHECK_SECONDS:
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
