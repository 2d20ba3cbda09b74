"""Framework adapters: thin layers from the tiered sampler's numpy batches to PyTorch and TensorFlow.

* :mod:`shardkit.adapters.torch` -- ``ShardIterableDataset`` (training, works with ``DataLoader``
  workers, ``pin_memory`` and ``torchrun`` ranks) and ``ShardMapDataset`` (evaluation by key).
* :mod:`shardkit.adapters.tf` -- ``make_tf_dataset``: a ``tf.data.Dataset`` with a complete
  ``element_spec``, usable by ``model.fit`` and ``tf.distribute`` input contexts.

Nothing is imported here on purpose: ``import shardkit`` (and ``import shardkit.adapters``) must never
import torch or tensorflow, which take seconds to load and may not be installed. Importing one of the
submodules without its framework raises :class:`~shardkit.errors.MissingExtraError` naming the pip
extra to install.
"""

from __future__ import annotations

__all__: list[str] = []
