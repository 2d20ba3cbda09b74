"""What both adapters share: the sampler's options, consumer arithmetic and payload presentation.

The adapters only *present* the sampler's batches; everything that decides which record goes where
lives in :mod:`shardkit.readers`. This module keeps the two adapters from growing two copies of the
same argument checks and of the global-batch arithmetic they need for ``len`` and resume.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardkit.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from shardkit.formats import Dataset
    from shardkit.readers import TieredSampler

__all__ = ["LAYOUTS", "SCALES", "SamplerOptions", "PayloadOptions", "batches_per_consumer", "consumer_pass"]

#: Payload layouts: ``NHWC`` is how records are stored; ``NCHW`` is what torchvision models expect.
LAYOUTS = ("NHWC", "NCHW")
#: Payload scaling: ``None`` keeps the stored dtype; ``"float"`` gives float32 (see PayloadOptions).
SCALES = (None, "float")


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{what}: expected a positive integer, found {value!r}")
    return int(value)


def batches_per_consumer(
    num_records: int, batch_size: int, consumer: int, num_consumers: int, drop_last: bool, start: int = 0
) -> int:
    """Batches consumer ``consumer`` of ``num_consumers`` gets from global position ``start`` to the
    end of the epoch (the sampler's global-batch semantics, see :mod:`shardkit.readers.schedule`)."""
    return _epoch_share(num_records, batch_size, consumer, num_consumers, drop_last, start)[0]


def _epoch_share(n: int, b: int, c: int, cs: int, drop_last: bool, start: int) -> tuple[int, int]:
    """(batches, size of its ragged last batch or 0) of consumer ``c`` in one epoch from ``start``."""
    rest = max(0, int(n) - int(start))
    full, tail = divmod(rest, b * cs)
    own_tail = 0 if drop_last else min(b, max(0, tail - c * b))
    return full + int(own_tail > 0), own_tail


def consumer_pass(
    num_records: int,
    batch_size: int,
    consumer: int,
    num_consumers: int,
    *,
    drop_last: bool,
    start: int,
    epochs: int,
    limit: int | None,
) -> tuple[int, int]:
    """(batches, records) one consumer yields in a pass of ``epochs`` epochs that begins at global
    position ``start`` of its first epoch, cut after ``limit`` records as the sampler does."""
    b = batch_size
    batches = records = 0
    for e in range(epochs):
        count, tail = _epoch_share(num_records, b, consumer, num_consumers, drop_last, start if e == 0 else 0)
        size = (count - 1) * b + tail if tail else count * b
        if limit is not None and records + size >= limit:
            left = limit - records
            full = count - 1 if tail else count
            used = -(-left // b) if left <= full * b else count
            return batches + used, limit
        batches += count
        records += size
    return batches, records


@dataclass(frozen=True)
class SamplerOptions:
    """Every :class:`~shardkit.readers.TieredSampler` option an adapter passes through unchanged.

    The consumer index and count are *not* here: each adapter works them out where it runs (a
    DataLoader worker, a torchrun rank, a tf.distribute input pipeline).
    """

    batch_size: int = 256
    tiers: str | Sequence[str] = "ram"
    ram_size: int | str = "512MiB"
    ssd_size: int | str = "4GiB"
    ssd_dir: str | os.PathLike[str] | None = None
    seed: int = 0
    mode: str = "epoch"
    epochs: int | None = 1
    drop_last: bool = False
    limit: int | None = None
    gap_bytes: int | None = None
    #: Name of a running ``shardkit serve`` to attach to instead of reading the dataset alone
    #: (see :mod:`shardkit.readers.shared`); ``seed`` then seeds this job's own order.
    shared: str | None = None

    def __post_init__(self) -> None:
        _positive_int(self.batch_size, "batch_size")
        if self.shared is not None and (self.mode != "epoch" or self.limit is not None):
            raise ConfigError(f"shared={self.shared!r}: only mode='epoch' without limit, found mode={self.mode!r}, "
                              f"limit={self.limit!r}")
        if self.epochs is not None:
            _positive_int(self.epochs, "epochs (None for endless)")
        if self.limit is not None:
            _positive_int(self.limit, "limit")

    def build(
        self,
        dataset: str | os.PathLike[str] | Dataset,
        *,
        consumer: int,
        num_consumers: int,
        start_epoch: int,
        state: dict[str, Any] | None = None,
    ) -> TieredSampler:
        """A sampler for one consumer whose first iteration runs ``epochs`` epochs from ``start_epoch``.

        ``state`` (a sampler state dict of epoch ``start_epoch``) resumes inside that epoch; its
        ``start_epoch`` is replaced so the iteration still runs ``epochs`` whole epochs' worth.
        """
        from shardkit.formats import Dataset
        from shardkit.readers import SharedSampler, TieredSampler  # the adapters know the readers only here

        if self.shared is not None:
            if state is not None and int(state.get("position", 0)):
                raise ConfigError(f"shared={self.shared!r}: a shared job cannot resume inside an epoch")
            return SharedSampler(  # type: ignore[return-value]
                self.shared, job_seed=self.seed, batch_size=self.batch_size, epochs=self.epochs,
                rank=consumer, world_size=num_consumers, drop_last=self.drop_last,
                dataset=dataset.path if isinstance(dataset, Dataset) else dataset,
            )  # fmt: skip
        kwargs: dict[str, Any] = {
            "tiers": self.tiers,
            "ram_size": self.ram_size,
            "ssd_size": self.ssd_size,
            "ssd_dir": self.ssd_dir,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
            "mode": self.mode,
            "rank": consumer,
            "world_size": num_consumers,
            "drop_last": self.drop_last,
            "limit": self.limit,
            "start_epoch": start_epoch,
        }
        if self.gap_bytes is not None:
            kwargs["gap_bytes"] = self.gap_bytes
        sampler = TieredSampler(dataset, **kwargs)
        if state is not None:
            sampler.load_state_dict({**state, "start_epoch": start_epoch})
        return sampler


@dataclass(frozen=True)
class PayloadOptions:
    """How the payload is presented: memory layout and scaling.

    ``layout="NCHW"`` moves the channel axis of image records ``(H, W, C)`` first, as torchvision
    and Keras ``channels_first`` models expect; it is refused for other record shapes (audio),
    where it has no meaning. ``scale="float"`` converts to float32: unsigned integers are divided
    by their maximum (uint8 images land in ``[0, 1]``), signed integers by ``-min`` (int16 audio
    lands in ``[-1, 1)``) and floating payloads are only cast. Both are done by the framework's own
    kernels after conversion, so the stored bytes stay zero-copy until the model needs them.
    """

    layout: str = "NHWC"
    scale: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout: expected one of {', '.join(LAYOUTS)}, found {self.layout!r}")
        if self.scale not in SCALES:
            raise ConfigError(f"scale: expected None or 'float', found {self.scale!r}")

    def check(self, record_shape: tuple[int, ...], where: str) -> None:
        """Refuse ``NCHW`` for records that are not ``(H, W, C)``."""
        if self.layout == "NCHW" and len(record_shape) != 3:
            raise ConfigError(
                f"{where}: layout='NCHW' needs image records of shape (H, W, C), found {record_shape}"
            )

    def shape(self, record_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-record payload shape after the layout change."""
        if self.layout == "NCHW":
            h, w, c = record_shape
            return (c, h, w)
        return tuple(record_shape)

    def dtype(self, stored: np.dtype) -> np.dtype:
        return np.dtype(np.float32) if self.scale == "float" else np.dtype(stored)

    def factor(self, stored: np.dtype) -> float:
        """Multiplier applied after the cast to float32."""
        stored = np.dtype(stored)
        if stored.kind == "u":
            return 1.0 / float(np.iinfo(stored).max)
        if stored.kind == "i":
            return 1.0 / float(-np.iinfo(stored).min)
        return 1.0

    @property
    def identity(self) -> bool:
        return self.layout == "NHWC" and self.scale is None

