"""The on-disk format (version 1.1): spec, writer, reader, metadata, checksums and verification."""

from shardkit.formats.codecs import available_codecs, get_codec
from shardkit.formats.dataset import Batch, Dataset, open_dataset
from shardkit.formats.metadata import DatasetMeta
from shardkit.formats.publish import PublishReport, publish
from shardkit.formats.reader import DEFAULT_GAP_BYTES, PayloadArray, ReadStats
from shardkit.formats.spec import FORMAT_MINOR, FORMAT_VERSION, FieldSpec, ShardInfo
from shardkit.formats.verify import VerifyReport, verify
from shardkit.formats.writer import DatasetWriter, ShardWriter

__all__ = ["FORMAT_VERSION", "FORMAT_MINOR", "Batch", "Dataset", "DatasetMeta", "DatasetWriter", "DEFAULT_GAP_BYTES", "FieldSpec",
           "PayloadArray", "PublishReport", "ReadStats", "ShardInfo", "ShardWriter", "VerifyReport", "available_codecs",
           "get_codec", "open_dataset", "publish", "verify"]
