"""``publish``: put a finished local dataset into an object store, checked before it becomes visible.

Every file but the root document is uploaded (objects already there with the same size and crc32c
are kept: a resumed publication), then each object's size and recorded crc32c are compared with the
dataset's metadata, and only then the root document goes up (docs/design.md §9): a reader sees the
whole dataset or none. A different dataset already at the destination is refused unless replaced
on purpose (``overwrite``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardkit.errors import ConfigError, ConversionError
from shardkit.formats.metadata import DatasetMeta, read_dataset_meta
from shardkit.formats.outputs import PARTS_DIR, STAGING_DIR, clear_store, refuse_overlap, top_names
from shardkit.formats.provenance import Provenance
from shardkit.formats.spec import ZARR_JSON
from shardkit.formats.transfer import CRC_METADATA_KEY, remove_strays, upload_files, upload_root
from shardkit.formats.verify import VerifyReport, verify
from shardkit.formats.versions import VERSIONS_DIR
from shardkit.stores import Location, Store, is_url, location_string, open_store

__all__ = ["PublishReport", "publish"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishReport:
    """What :func:`publish` did: the destination ``url``; the ``files`` and ``nbytes`` it uploaded;
    ``kept`` files already there and identical; whether the very same dataset was already published
    (``already_published``: nothing uploaded); the published metadata, and ``verified``, the
    :func:`~shardkit.formats.verify.verify` report of the published dataset."""

    url: str
    files: int
    nbytes: int
    kept: int
    already_published: bool
    meta: DatasetMeta
    verified: VerifyReport


def publish(
    src: str | os.PathLike[str],
    dest: Location,
    *,
    overwrite: bool = False,
    full_verify: bool = False,
    progress: Callable[[int], None] | None = None,
) -> PublishReport:
    """Upload the complete local dataset ``src`` to ``dest`` (``s3://bucket/ds``, ``gs://``, ``az://``)
    and verify it.

    ``dest`` must be empty, or hold this same dataset (a publication that was interrupted, or done
    before: only what is missing is uploaded), or, with ``overwrite``, another shardkit dataset to
    replace; anything else is refused before a byte is uploaded. Before the root document goes up,
    every object's size and crc32c (recorded at upload) must equal the metadata's; afterwards the
    dataset is checked as ``shardkit verify --quick`` does (``full_verify``: every byte read back).
    ``progress`` gets the bytes of each file done.

    Raises ConfigError for a ``src`` that is not a local dataset directory or a read-only ``dest``,
    ConversionError for a destination holding something else or a failed check (the dataset is then
    not visible at ``dest``).
    """
    if isinstance(src, str) and is_url(src) and not src.startswith("file://"):
        raise ConfigError(f"publish: {location_string(src)}: expected a local dataset directory to upload")
    root = Path(src.removeprefix("file://") if isinstance(src, str) else src)
    meta = read_dataset_meta(root)  # a complete, valid dataset, or a named error
    refuse_overlap([root], dest, "publish")
    store = open_store(dest)
    if store.read_only:
        raise ConfigError(f"{store.url}: this store is read-only; publish to an s3://, gs:// or az:// URL")
    already = _check_destination(root, store, overwrite)
    sent = upload_files(root, store, progress=progress)
    _check_uploaded(root, store, meta, sent.crc32c)
    remove_strays(store, {*sent.crc32c, ZARR_JSON})
    root_put = upload_root(root, store)
    report = verify(store, quick=not full_verify)
    if not report.ok:
        raise ConversionError(f"{store.url}: published, but verify found {len(report.problems)} problem(s), the first: "
                              f"{report.problems[0]}; run `shardkit verify {store.url}`")
    files, nbytes = sent.files + root_put, sent.nbytes + (root / ZARR_JSON).stat().st_size * root_put
    logger.info("%s: published %s: %d files, %d bytes uploaded, %d kept", store.url, root, files, nbytes, sent.skipped)
    return PublishReport(store.url, files, nbytes, sent.skipped, already and files == 0, meta, report)


def _check_destination(root: Path, store: Store, overwrite: bool) -> bool:
    """Refuse a destination holding anything but this dataset (another one only with ``overwrite``,
    which deletes it); True when this very dataset is there already."""
    if store.exists(ZARR_JSON):
        if store.get(ZARR_JSON) == (root / ZARR_JSON).read_bytes():
            return True
        if not overwrite:
            raise ConversionError(f"{store.url}: a different dataset is already published here; pass --overwrite "
                                  "(Python: overwrite=True) to replace it, or choose another prefix. Nothing was uploaded")
        logger.info("%s: replacing the dataset published here", store.url)
        clear_store(store)  # a shardkit dataset (checked), root document first
        return False
    mine = {p.name for p in root.iterdir()} | {STAGING_DIR, PARTS_DIR, VERSIONS_DIR}
    others = top_names(store, mine)
    if others:
        raise ConversionError(f"{store.url}: holds other objects ({', '.join(others[:5])}) and no dataset; publish "
                              "to an empty prefix. Nothing was uploaded")
    return False


def _check_uploaded(root: Path, store: Store, meta: DatasetMeta, crcs: dict[str, int]) -> None:
    """Each object's size and recorded crc32c against the metadata (shards, field chunks, documents,
    the provenance table) before the root document makes the dataset visible."""
    expected = {info.path: (info.nbytes, info.crc32c) for info in meta.shards}
    expected |= {k: (d.nbytes, d.crc32c) for k, d in meta.files.items()}
    prov = Provenance.from_meta(meta, where=str(root / ZARR_JSON))
    if prov is not None:
        expected |= {k: (d.nbytes, d.crc32c) for k, d in prov.files.items()}
    for key, crc in crcs.items():  # files the metadata does not list (array documents of format 1.0)
        expected.setdefault(key, ((root / key).stat().st_size, crc))
    problems: list[str] = []
    for key, (size, crc) in sorted(expected.items()):
        try:
            found = store.head(key)
        except FileNotFoundError:
            problems.append(f"{key}: listed in the metadata but not uploaded (missing from {root})")
            continue
        recorded = found.metadata.get(CRC_METADATA_KEY)
        if found.size != size or (recorded is not None and recorded != str(crc)):
            problems.append(f"{key}: expected {size} bytes with crc32c {crc:#010x} as the metadata says, "
                            f"found {found.size} bytes with crc32c {recorded}")
    if problems:
        raise ConversionError(f"{store.url}: the upload does not match the metadata of {root} ({len(problems)} problem(s), "
                              f"the first: {problems[0]}); the dataset was not published (no {ZARR_JSON}). "
                              f"Check the source with `shardkit verify {root}`")
