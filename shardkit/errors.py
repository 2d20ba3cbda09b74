"""The one error hierarchy of shardkit.

Every error shardkit raises on purpose is a :class:`ShardkitError`. Each specific error also
inherits the builtin exception a caller would naturally catch (``FileNotFoundError`` for a missing
shard, ``ValueError`` for a corrupt one, ``ImportError`` for a missing extra, ...), so code that
does not know shardkit still handles it sensibly, and the CLI can turn any of them into one line on
stderr instead of a traceback.

Messages always say which file, what was expected and what was found.
"""

from __future__ import annotations

__all__ = [
    "ShardkitError",
    "DatasetNotFoundError",
    "NotADatasetError",
    "IncompleteDatasetError",
    "FormatVersionError",
    "UnsafePathError",
    "MissingShardError",
    "CorruptShardError",
    "TruncatedShardError",
    "CorruptIndexError",
    "ChecksumError",
    "SchemaError",
    "ConfigError",
    "InputFileError",
    "ConversionError",
    "MissingExtraError",
    "OutOfSpaceError",
    "SamplerError",
    "ProtocolError",
    "PeerTimeoutError",
    "InsecurePathError",
    "VersionGoneError",
    "WorkerError",
    "StoreError",
    "StorePermissionError",
    "ObjectNotFoundError",
    "ObjectChangedError",
    "ObjectTooLargeError",
]


class ShardkitError(Exception):
    """Base class of every error shardkit raises deliberately."""


class DatasetNotFoundError(ShardkitError, FileNotFoundError):
    """The dataset (or input corpus) path does not exist."""


class NotADatasetError(ShardkitError, ValueError):
    """The path exists but is not a shardkit dataset (no zarr group with ``shardkit`` attributes)."""


class IncompleteDatasetError(NotADatasetError):
    """The directory holds shard files but no final group metadata: a write was interrupted."""


class FormatVersionError(ShardkitError, ValueError):
    """The dataset was written by a newer format version than this shardkit understands."""


class UnsafePathError(NotADatasetError):
    """A path taken from the metadata (shard path, array or field name) would leave the dataset
    directory: absolute, ``..``, or a symlink that resolves outside it."""


class MissingShardError(ShardkitError, FileNotFoundError):
    """A file listed in the dataset metadata (payload shard or field chunk) does not exist."""


class CorruptShardError(ShardkitError, ValueError):
    """A dataset file (shard, field chunk, array document) exists but its bytes are not what the
    metadata promises."""


class TruncatedShardError(CorruptShardError):
    """A shard or field chunk is shorter (or longer) than recorded."""


class CorruptIndexError(CorruptShardError):
    """A shard's index fails its crc32c, differs from the one recorded in the metadata, or describes
    records that cannot be in the file."""


class ChecksumError(CorruptShardError):
    """A file's checksum differs from the one recorded at write time (shard data, field chunk, array
    document, or the dataset attributes themselves)."""


class SchemaError(ShardkitError, ValueError):
    """Records or fields do not match the dataset's record schema (shape, dtype, missing field)."""


class ConfigError(ShardkitError, ValueError):
    """An option or argument has an invalid value (unknown codec, negative size, bad tier list...)."""


class InputFileError(ShardkitError, ValueError):
    """One input file of a corpus cannot be used (corrupt, unsupported, outside the corpus...)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class ConversionError(ShardkitError, RuntimeError):
    """A conversion cannot proceed (corpus not recognised, conflicting previous run, --strict stop)."""


class MissingExtraError(ShardkitError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that provides it."""


class OutOfSpaceError(ShardkitError, OSError):
    """A tier or output directory ran out of space; nothing partially written is left behind."""


class SamplerError(ShardkitError, RuntimeError):
    """The sampler cannot continue (background creator failed, incompatible state dict...)."""


class ProtocolError(SamplerError):
    """A peer of the shared tier stack (``serve``) sent something the wire protocol does not allow."""


class PeerTimeoutError(SamplerError, TimeoutError):
    """A peer of the shared tier stack stayed silent past its deadline (stopped or hung)."""


class InsecurePathError(ShardkitError, PermissionError):
    """A path that must be private to this user is not: another owner, wider permissions, or a symlink."""


class VersionGoneError(ShardkitError, FileNotFoundError):
    """A reader holds a version of a dataset that later commits replaced and then pruned: the files of
    that version are gone and the dataset must be reopened (see :mod:`shardkit.formats.versions`)."""


class WorkerError(ConversionError):
    """A worker of a cluster conversion cannot do its part (cannot see the corpus or the output, or
    died too often); the message names the worker and the path."""


class StoreError(ShardkitError, OSError):
    """An object-store request failed for good: a permanent error, or transient errors (5xx,
    timeouts, resets, throttling, short responses) that outlasted the retry budget. The message names
    the object's URL and, for reads, the byte range."""


class StorePermissionError(StoreError, PermissionError):
    """The store refused the request (credentials missing or wrong, no permission), or the store is
    read-only (``http(s)://`` datasets)."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """No object at that key (the store's equivalent of a missing file)."""


class ObjectChangedError(StoreError):
    """An object changed between two reads of one reader (its ETag or size differs): bytes of two
    versions are never mixed."""


class ObjectTooLargeError(StoreError):
    """An object is larger than the caller allows (checked before its bytes are read)."""
