"""What both adapters share: how a consumer's sampler is built, and how payload is presented.
Which record goes where is decided in :mod:`shardkit.readers` and :mod:`shardkit.order.schedule`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.errors import ConfigError
from shardkit.formats import Dataset
from shardkit.readers import Sampler, SamplerOptions, TieredSampler
from shardkit.readers.sources import Mixture

__all__ = ["LAYOUTS", "SCALES", "SamplerFactory", "PayloadOptions"]

#: Payload layouts: ``NHWC`` is how records are stored; ``NCHW`` is what torchvision models expect.
LAYOUTS = ("NHWC", "NCHW")
#: Payload scaling: ``None`` keeps the stored dtype; ``"float"`` gives float32 (see PayloadOptions).
SCALES = (None, "float")


@dataclass(frozen=True)
class SamplerFactory:
    """Builds the sampler of one consumer from the user's ``options`` (whose consumer index and count
    are replaced per consumer), reading alone or attached to the ``shardkit serve`` named ``shared``
    (``options.seed`` then seeds this job's order; only ``mode="epoch"`` without ``limit``)."""

    options: SamplerOptions
    shared: str | None = None

    def __post_init__(self) -> None:
        o = self.options
        if self.shared is not None and (o.mode != "epoch" or o.limit is not None):
            raise ConfigError(
                f"shared={self.shared!r}: only mode='epoch' without limit, found mode={o.mode!r}, limit={o.limit!r}"
            )
        if self.shared is not None and o.decode is not True:
            raise ConfigError(
                f"shared={self.shared!r}: a shared tier stack hands its jobs decoded records (its ring holds one decoded "
                f"record a slot and its protocol carries no stored lengths), found decode={o.decode!r}: use decode=True "
                "with shared, or read the stored bytes without shared"
            )
        if self.shared is not None and o.locality:
            raise ConfigError(
                f"shared={self.shared!r}: a shared tier stack serves one machine's jobs; locality (many nodes) "
                "works with the job's own sampler: drop shared or locality"
            )

    def build(
        self,
        dataset: str | os.PathLike[str] | Dataset | Mixture,
        *,
        consumer: int,
        num_consumers: int,
        start_epoch: int,
        state: dict[str, Any] | None = None,
        workers_per_rank: int = 1,
        nodes: int | None = None,
    ) -> Sampler:
        """A sampler for one consumer whose first iteration runs ``epochs`` epochs from ``start_epoch``;
        ``state`` (of epoch ``start_epoch``) resumes inside it. ``workers_per_rank`` and ``nodes``
        place the consumer for ``locality``; ``nodes=None`` keeps the options' value."""
        placed = {"workers_per_rank": workers_per_rank, "nodes": self.options.nodes if nodes is None else nodes}
        options = self.options.replace(rank=consumer, world_size=num_consumers, start_epoch=start_epoch, **placed)
        if self.shared is not None:
            from shardkit.serve import SharedSampler  # a job of a server only: not in every worker

            if state is not None and int(state.get("position", 0)):
                raise ConfigError(f"shared={self.shared!r}: a shared job cannot resume inside an epoch")
            return SharedSampler(
                self.shared, job_seed=options.seed, batch_size=options.batch_size, epochs=options.epochs,
                rank=options.rank, world_size=options.world_size, drop_last=options.drop_last,
                dataset=dataset,
            )  # fmt: skip
        sampler = TieredSampler(dataset, options)
        if state is not None:
            sampler.load_state_dict({**state, "start_epoch": start_epoch})
        return sampler


@dataclass(frozen=True)
class PayloadOptions:
    """How the payload is presented: ``layout="NCHW"`` moves the channel axis of image records
    ``(H, W, C)`` first (refused for other shapes); ``scale="float"`` gives float32, unsigned integers
    divided by their maximum (uint8 in ``[0, 1]``), signed by ``-min`` (int16 in ``[-1, 1)``)."""

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

