"""zarr-python codecs for shardkit's image and audio records, so zarr-python reads a jpeg, png, webp,
jpegxl, flac, opus or vorbis dataset as it reads a zstd one (docs/design.md §3, *Image and audio codecs*).

zarr-python finds a codec by the name in the array document through the ``zarr.codecs`` entry-point
group; shardkit declares one entry point per name (``pyproject.toml``), each a class here that decodes
through the same :class:`~shardkit.formats.codecs.RecordCodec` the loader uses. A zarr user installs
``shardkit[codecs]``. Nothing in shardkit imports this module: it imports zarr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from zarr.abc.codec import ArrayBytesCodec

from shardkit.formats.codecs import RecordCodec, codec_from_zarr

__all__ = ["RecordStreamCodec", "ImagecodecsJpeg", "ImagecodecsPng", "ImagecodecsWebp", "ImagecodecsJpegxl", "ShardkitFlac", "ShardkitOpus",
           "ShardkitVorbis"]


@dataclass(frozen=True)
class RecordStreamCodec(ArrayBytesCodec):  # type: ignore[misc]
    """One inner chunk (one record, ``[1, *record]``) stored as one image or audio stream."""

    zarr_name = ""
    is_fixed_size = False
    configuration: dict[str, Any]

    def __init__(self, **configuration: Any) -> None:
        object.__setattr__(self, "configuration", dict(configuration))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecordStreamCodec:
        if data.get("name") != cls.zarr_name:
            raise ValueError(f"expected codec {cls.zarr_name!r}, found {data.get('name')!r}")
        return cls(**(data.get("configuration") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.zarr_name, "configuration": dict(self.configuration)}

    def _record_codec(self) -> RecordCodec:
        codec = codec_from_zarr([self.to_dict()], where=f"zarr codec {self.zarr_name}")
        assert codec is not None
        return codec

    async def _decode_single(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
        out = np.empty(chunk_spec.shape, dtype=chunk_spec.dtype.to_native_dtype())
        self._record_codec().decode(chunk_bytes.to_bytes(), out.reshape(out.shape[1:]) if out.shape[:1] == (1,) else out)
        return chunk_spec.prototype.nd_buffer.from_ndarray_like(out)

    async def _encode_single(self, chunk_array: Any, chunk_spec: Any) -> Any:
        record = np.ascontiguousarray(chunk_array.as_ndarray_like())
        blob = self._record_codec().encode(record.reshape(record.shape[1:]) if record.shape[:1] == (1,) else record)
        return chunk_spec.prototype.buffer.from_bytes(blob)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
        raise NotImplementedError("an image or audio stream's size depends on its content")


class ImagecodecsJpeg(RecordStreamCodec):
    zarr_name = "numcodecs.imagecodecs_jpeg"


class ImagecodecsPng(RecordStreamCodec):
    zarr_name = "numcodecs.imagecodecs_png"


class ImagecodecsWebp(RecordStreamCodec):
    zarr_name = "numcodecs.imagecodecs_webp"


class ImagecodecsJpegxl(RecordStreamCodec):
    zarr_name = "numcodecs.imagecodecs_jpegxl"


class ShardkitFlac(RecordStreamCodec):
    zarr_name = "shardkit.flac"


class ShardkitOpus(RecordStreamCodec):
    zarr_name = "shardkit.opus"


class ShardkitVorbis(RecordStreamCodec):
    zarr_name = "shardkit.vorbis"
