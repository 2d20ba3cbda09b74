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
During a conversion the root document does not exist (the writer deletes the old output first and
writes the root document last), which the check reports as a dataset that is gone.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from shardkit.errors import SamplerError

__all__ = ["DatasetIdentity", "dataset_fingerprint", "ROOT_DOCUMENT"]

#: The dataset's root document (the zarr group metadata with shardkit's attributes).
ROOT_DOCUMENT = "zarr.json"


def dataset_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the dataset's root ``zarr.json``; ``FileNotFoundError`` if it has none."""
    return hashlib.sha256((Path(path) / ROOT_DOCUMENT).read_bytes()).hexdigest()


@dataclass(frozen=True)
class DatasetIdentity:
    """A dataset path and the fingerprint it had when a sampler opened it."""

    path: Path
    fingerprint: str

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> DatasetIdentity:
        """The identity ``path`` has now."""
        path = Path(path)
        try:
            return cls(path, dataset_fingerprint(path))
        except FileNotFoundError:
            raise SamplerError(f"{path}: expected a shardkit dataset, found no {ROOT_DOCUMENT}") from None

    def check(self) -> None:
        """Raise :class:`~shardkit.errors.SamplerError` unless the dataset is still the one opened."""
        try:
            now = dataset_fingerprint(self.path)
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
