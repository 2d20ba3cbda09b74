"""Resuming a conversion: its output directory, its staging area and the record of completed shards.

Resume is the conversion's business, not the writer's: :class:`~shardkit.formats.DatasetWriter` only
writes, hands each completed shard to a callback and can start after shards already on disk. This
module keeps, next to the output, what a re-run of the same command needs to continue.

Layout (inside the output directory ``OUT``)::

    OUT/.shardkit-staging/config.json          every output-shaping parameter (written first)
    OUT/.shardkit-staging/fields-000000.npz     per completed shard: its field values,
    OUT/.shardkit-staging/shard-000000.json     then its ShardInfo, input cursor and skips (the commit)

Input cursor
    Records reach the writer in input order; one input may give several records (audio windows),
    so each record carries the cursor *after* it: ``input_index << WINDOW_BITS | records_done`` inside
    its input, or ``(input_index + 1) << WINDOW_BITS`` after its input's last record
    (:func:`input_cursor`). A staged shard keeps the cursor after its last record; a resumed run
    decodes from there, and shards are cut at exactly the same records as in one uninterrupted run.
    A skip is filed with the first shard whose cursor lies after it, so skips keep their order too.

Killed at any instant
    Every step leaves a state that the same command resumes, and the result is byte-identical to an
    uninterrupted conversion (``tests/converters/test_staging.py`` kills a run after each file-system
    step in turn):

    * the output directory, then the staging directory, then ``config.json`` (atomic rename) are
      created first; a staging directory without ``config.json`` holds nothing (no shard is staged
      before the config) and is started afresh;
    * a shard counts once its file is in place *and* its ``shard-*.json`` is written (after its
      ``fields-*.npz``); anything else in the payload directory, any ``*.partial`` file and any field
      array (field arrays are only written by the final commit) is deleted on resume;
    * the dataset's ``zarr.json`` is renamed into place last, then the staging directory is removed;
      a dataset whose fingerprint matches is complete, and a staging directory left next to it is
      removed by the re-run.

    Shards are fsynced; staging records are not (a power cut that loses one only redoes that shard).

The output directory
    A conversion writes into an empty or missing directory, or one it wrote before. Anything else
    (other files) is refused, and ``--overwrite`` deletes only a shardkit output. A directory that
    existed before the conversion is never deleted, not even when it was empty: ``--overwrite`` and a
    conversion that produced nothing clear its contents and keep the directory itself (its owner,
    permissions or mount point are the user's).
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConversionError, ShardkitError
from shardkit.formats import DatasetMeta, DatasetWriter, FieldSpec, ShardInfo
from shardkit.formats.index import crc32c_of
from shardkit.formats.metadata import read_dataset_meta, read_json, write_json_atomic
from shardkit.formats.outputs import PARTS_DIR, STAGING_DIR, clear_output, remove_path
from shardkit.formats.provenance import TABLE_ARRAYS
from shardkit.formats.spec import ZARR_JSON, SkippedInput
from shardkit.formats.writer import WrittenShard
from shardkit.stores.atomic import write_bytes_atomic

__all__ = [
    "STAGING_DIR",
    "WINDOW_BITS",
    "StagedShard",
    "StagedWriter",
    "Staging",
    "clear_output",
    "config_fingerprint",
    "input_cursor",
    "split_cursor",
]

logger = logging.getLogger(__name__)

#: Low bits of an input cursor that count records already written from the current input.
WINDOW_BITS = 20
_WINDOW_MASK = (1 << WINDOW_BITS) - 1
_CONFIG = "config.json"
_PARTIAL = ".partial"


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """crc32c of a conversion's config (``source.config_fingerprint``): the same conversion, whatever ran it."""
    return f"{crc32c_of(json.dumps(config, sort_keys=True).encode()):08x}"


def input_cursor(index: int, records: int = 0) -> int:
    """The cursor at input ``index`` once ``records`` of its records are written."""
    if not 0 <= records <= _WINDOW_MASK:
        raise ConversionError(f"input {index} gives more than {_WINDOW_MASK} records")
    return (index << WINDOW_BITS) | records


def split_cursor(cursor: int) -> tuple[int, int]:
    """``(input index, records of it already written)`` of a cursor."""
    return cursor >> WINDOW_BITS, cursor & _WINDOW_MASK


@dataclass(frozen=True)
class StagedShard:
    """A completed shard recorded in the staging area.

    Attributes
    ----------
    shard
        Its info and field values.
    cursor
        Input cursor after its last record.
    skipped
        Inputs skipped before that cursor and after the previous shard's.
    """

    shard: WrittenShard
    cursor: int
    skipped: tuple[SkippedInput, ...]


class Staging:
    """The staging area of one conversion in its output directory ``out``.

    Parameters
    ----------
    out
        Output dataset directory.
    config
        Every parameter that shapes the output (JSON-serialisable); a staging area or dataset made
        with another config is refused instead of mixing two conversions.
    payload, fields
        The dataset's payload array name and its small fields.
    shard_present
        Whether a staged shard's file still counts (default: it is in ``out`` with its recorded size).
        A conversion into an object store also accepts a shard already uploaded
        (:mod:`shardkit.converters.remote_output`).
    on_recorded
        Called with each shard's info once it is staged (an object-store output uploads it then).
    """

    def __init__(
        self,
        out: Path,
        config: Mapping[str, Any],
        payload: str,
        fields: Mapping[str, FieldSpec],
        *,
        shard_present: Callable[[ShardInfo], bool] | None = None,
        on_recorded: Callable[[ShardInfo], None] | None = None,
    ) -> None:
        self.out = Path(out)
        self.dir = self.out / STAGING_DIR
        self.config: dict[str, Any] = json.loads(json.dumps(config))
        self.payload = payload
        self.fields = dict(fields)
        #: Every array the dataset may hold: the payload, the fields and the provenance table (written
        #: with the metadata, so cleared on resume like the field arrays).
        self.names = [payload, *fields, *TABLE_ARRAYS]
        #: Whether this run created ``out`` (then, and only then, it may delete it).
        self.created_out = False
        self._shard_present = shard_present or self._local_shard_present
        self._on_recorded = on_recorded

    @property
    def fingerprint(self) -> str:
        """crc32c of the config: stored in the finished dataset to recognise the same conversion."""
        return config_fingerprint(self.config)

    # ------------------------------------------------------------------ before writing
    def finished(self) -> DatasetMeta | None:
        """The metadata of a dataset at ``out`` made by this same conversion, or ``None`` if none is there.

        A staging directory left by a run killed between its last two steps is removed.

        Raises
        ------
        ConversionError
            A dataset made with other parameters (or not by a conversion) is there.
        """
        if not (self.out / ZARR_JSON).exists():
            return None
        existing = read_dataset_meta(self.out)
        stored = existing.source.get("config_fingerprint")
        if stored != self.fingerprint:
            raise ConversionError(
                f"{self.out}: a dataset already exists here" + (" with different parameters" if stored else "")
                + "; use --overwrite to replace it"
            )
        if self.dir.exists():
            remove_path(self.dir)
        return existing

    def begin(self, *, overwrite: bool = False) -> list[StagedShard]:
        """Claim ``out`` for this conversion; returns the shards a previous run of it completed.

        Raises
        ------
        ConversionError
            ``out`` holds other files, a dataset, or an interrupted conversion with other parameters.
        """
        if overwrite:
            clear_output(self.out)
        if self.out.exists() and not self.out.is_dir():
            raise ConversionError(f"{self.out}: output exists and is not a directory")
        if (self.out / ZARR_JSON).exists():
            raise ConversionError(f"{self.out}: a dataset already exists here; use --overwrite to replace it")
        stored = self._stored_config()
        if stored is not None and stored != self.config:
            raise ConversionError(
                f"{self.out}: an interrupted conversion with different parameters is here; "
                "re-run with the same parameters to resume, or use --overwrite to start fresh"
            )
        if (self.out / PARTS_DIR).is_dir():
            raise ConversionError(
                f"{self.out}: an interrupted conversion in parts ({PARTS_DIR}: --part-size, --scheduler or --append) "
                "is here; re-run that command to resume it, or use --overwrite to start fresh"
            )
        if self.out.exists():
            ours = {STAGING_DIR, ZARR_JSON + _PARTIAL, *self.names}
            foreign = sorted(e.name for e in self.out.iterdir() if e.name not in ours)
            if foreign:
                raise ConversionError(
                    f"{self.out}: output directory is not empty and is not a shardkit dataset (found "
                    f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose another directory"
                )
        if stored is None:
            self._start()
            return []
        return self._load()

    def _stored_config(self) -> dict[str, Any] | None:
        """The staged config, or ``None`` when no staging area (or one without its config) is there."""
        path = self.dir / _CONFIG
        if not path.is_file():
            return None
        try:
            return read_json(path)
        except ShardkitError as exc:
            raise ConversionError(
                f"{path}: unreadable staging config ({exc}); use --overwrite to start fresh"
            ) from None

    def _start(self) -> None:
        """A fresh staging area (whatever a killed run left before its config is discarded)."""
        if not self.out.exists():
            self.out.mkdir(parents=True)
            self.created_out = True
        for name in (STAGING_DIR, ZARR_JSON + _PARTIAL, *self.names):
            remove_path(self.out / name)
        self.dir.mkdir()
        write_json_atomic(self.dir / _CONFIG, self.config)

    def _load(self) -> list[StagedShard]:
        """The staged shards that are intact, in order; everything after them is deleted."""
        shards: list[StagedShard] = []
        while (staged := self._read_staged(len(shards))) is not None:
            shards.append(staged)
        keep = {staged.shard.info.path for staged in shards}
        payload = self.payload
        for path in sorted((self.out / payload).rglob("*")) if (self.out / payload).is_dir() else []:
            if path.is_file() and path.relative_to(self.out).as_posix() not in keep:
                path.unlink()
        for name in self.names:
            if name != payload:
                remove_path(self.out / name)  # field arrays are only written by the final commit
        remove_path(self.out / (ZARR_JSON + _PARTIAL))
        for path in self.dir.iterdir():
            if path.name.endswith(_PARTIAL) or (
                path.name.startswith(("shard-", "fields-")) and _shard_number(path.name) >= len(shards)
            ):
                path.unlink()
        if shards:
            logger.info(
                "%s: resuming after %d complete shards (%d records, input %d)",
                self.out, len(shards), shards[-1].shard.info.stop, split_cursor(shards[-1].cursor)[0],
            )
        return shards

    def _read_staged(self, i: int) -> StagedShard | None:
        """Staged shard ``i``, or ``None`` if it is missing or damaged (then it is redone)."""
        info_path, fields_path = self._record_paths(i)
        if not info_path.exists() or not fields_path.exists():
            return None
        try:
            doc = read_json(info_path)
            info = ShardInfo.from_json(doc["shard"], where=str(info_path))
            if info.data_crc32c is None or info.index_crc32c is None:
                return None  # staged by a shardkit before format 1.1: redo it to get its checksums
            cursor = int(doc["input_cursor"])
            skipped = tuple(SkippedInput(str(s["path"]), str(s["reason"])) for s in doc["skipped"])
            with np.load(fields_path) as npz:
                parts = {name: spec.check(name, npz[name], info.count) for name, spec in self.fields.items()}
        except (ShardkitError, KeyError, TypeError, ValueError, OSError, EOFError):
            # Staging records are not fsynced: one lost to a power cut only means this shard is redone.
            logger.info("%s: staging record of shard %d unreadable; redoing it", self.out, i)
            return None
        if not self._shard_present(info):
            return None
        return StagedShard(WrittenShard(info, parts), cursor, skipped)

    def _local_shard_present(self, info: ShardInfo) -> bool:
        shard_file = self.out / info.path
        return shard_file.is_file() and shard_file.stat().st_size == info.nbytes

    def _record_paths(self, i: int) -> tuple[Path, Path]:
        return self.dir / f"shard-{i:06d}.json", self.dir / f"fields-{i:06d}.npz"

    # ------------------------------------------------------------------ while writing
    def record(self, i: int, staged: StagedShard) -> None:
        """Stage completed shard ``i``: its fields, then its info, cursor and skips (the commit)."""
        info_path, fields_path = self._record_paths(i)
        buffer = io.BytesIO()
        np.savez(buffer, **staged.shard.fields)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
        write_bytes_atomic(fields_path, buffer.getvalue(), durable=False)
        doc = {
            "shard": staged.shard.info.to_json(),
            "input_cursor": staged.cursor,
            "skipped": [s.to_json() for s in staged.skipped],
        }
        write_json_atomic(info_path, doc, durable=False)
        if self._on_recorded is not None:
            self._on_recorded(staged.shard.info)

    def writer(self, resumed: Sequence[StagedShard], **dataset: Any) -> StagedWriter:
        """A :class:`StagedWriter` continuing after ``resumed`` (``dataset``: DatasetWriter's arguments)."""
        return StagedWriter(self, resumed, dataset)

    # ------------------------------------------------------------------ after writing
    def commit_done(self) -> None:
        """The dataset's metadata is in place: the staging area is not needed any more."""
        remove_path(self.dir)

    def discard(self) -> None:
        """Delete what this conversion wrote (it produced nothing worth keeping).

        ``out`` itself goes only if this run created it.
        """
        if not self.out.exists():
            return
        if self.created_out:
            shutil.rmtree(self.out)
        else:
            for name in (ZARR_JSON, STAGING_DIR, ZARR_JSON + _PARTIAL, *self.names):
                remove_path(self.out / name)


def _shard_number(name: str) -> int:
    digits = name.split("-", 1)[1].split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


class StagedWriter:
    """A :class:`~shardkit.formats.DatasetWriter` whose completed shards are staged for a resume.

    Records come with their input cursors and skips with the cursor of their input; each completed
    shard is recorded with the cursor after its last record and the skips before that cursor.
    """

    def __init__(self, staging: Staging, resumed: Sequence[StagedShard], dataset: Mapping[str, Any]) -> None:
        self.staging = staging
        self._pending: list[SkippedInput] = []
        self._cursors = np.zeros(0, dtype=np.int64)
        self._base = 0
        self._closing = False
        source = {**dataset.get("source", {}), "config_fingerprint": staging.fingerprint}
        self.writer = DatasetWriter(
            staging.out, **{**dataset, "source": source},
            start=[s.shard for s in resumed], on_shard=self._on_shard,
        )
        for staged in resumed:
            for s in staged.skipped:
                self.writer.skip(s.path, s.reason)
        self.cursor = resumed[-1].cursor if resumed else 0

    @property
    def records_per_shard(self) -> int:
        return self.writer.records_per_shard

    @property
    def records_written(self) -> int:
        return self.writer.records_written

    def skip(self, path: str, reason: str, cursor: int) -> None:
        """Input ``path`` at ``cursor`` (``index << WINDOW_BITS``) was skipped for ``reason``."""
        self._pending.append(SkippedInput(str(path), str(reason), cursor))

    def write(self, batch: Mapping[str, np.ndarray], cursors: np.ndarray) -> None:
        """Append records with the input cursor after each of them."""
        self._base = self.writer.records_written
        self._cursors = np.asarray(cursors, dtype=np.int64)
        self.writer.write(batch)

    def _on_shard(self, shard: WrittenShard) -> None:
        cursor = int(self._cursors[shard.info.stop - 1 - self._base])
        mine = [s for s in self._pending if s.cursor < cursor]
        later = [s for s in self._pending if s.cursor >= cursor]
        self.staging.record(len(self.writer.shards) - 1, StagedShard(shard, cursor, tuple(mine)))
        # At the commit, inputs skipped after the last record belong to the last shard too (the
        # staged record leaves them out: a resume from its cursor meets them again).
        self._pending = [] if self._closing else later
        for s in mine + later if self._closing else mine:
            self.writer.skip(s.path, s.reason)
        self.cursor = cursor

    def close(self) -> DatasetMeta:
        """Finish the last shard and commit the dataset (its metadata last), then drop the staging area."""
        self._closing = True
        if self.writer.records_written == (self.writer.shards[-1].stop if self.writer.shards else 0):
            for s in self._pending:
                self.writer.skip(s.path, s.reason)
            self._pending = []
        meta = self.writer.close()
        self.staging.commit_done()
        return meta

    def abort(self) -> None:
        """Stop: the open shard is deleted, completed shards stay staged for a resume."""
        self.writer.abort()
