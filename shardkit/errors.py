"""The one error hierarchy of shardkit: every deliberate error is a :class:`ShardkitError`.

Each also inherits the builtin a caller would catch (``FileNotFoundError`` for a missing shard,
``ValueError`` for a corrupt one, ...). Messages say which file, what was expected and what was found.
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
    """A path taken from the metadata would leave the dataset directory (absolute, ``..``, a symlink out)."""


class MissingShardError(ShardkitError, FileNotFoundError):
    """A file listed in the dataset metadata (payload shard or field chunk) does not exist."""


class CorruptShardError(ShardkitError, ValueError):
    """A dataset file (shard, field chunk, array document) is not what the metadata promises."""


class TruncatedShardError(CorruptShardError):
    """A shard or field chunk is shorter (or longer) than recorded."""


class CorruptIndexError(CorruptShardError):
    """A shard's index fails its crc32c, differs from the recorded one, or describes impossible records."""


class ChecksumError(CorruptShardError):
    """A file's (or the dataset attributes') checksum differs from the one recorded at write time."""


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
    """The files of the dataset version a reader holds were pruned: reopen it (:mod:`shardkit.formats.versions`)."""


class WorkerError(ConversionError):
    """A worker of a cluster conversion cannot do its part; the message names the worker and the path."""


class StoreError(ShardkitError, OSError):
    """An object-store request failed for good (permanent, or past the retry budget), naming the object
    and, for reads, the byte range."""


class StorePermissionError(StoreError, PermissionError):
    """The store refused the request (credentials, permission), or is read-only (``http(s)://``)."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """No object at that key (the store's equivalent of a missing file)."""


class ObjectChangedError(StoreError):
    """An object changed between two reads of one reader (its ETag or size differs)."""


class ObjectTooLargeError(StoreError):
    """An object is larger than the caller allows (checked before its bytes are read)."""
