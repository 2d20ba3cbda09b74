"""Framework adapters: :mod:`shardkit.adapters.torch` and :mod:`shardkit.adapters.tf` (docs/design.md §6).

Nothing is imported here: ``import shardkit.adapters`` must never import torch or tensorflow.
"""

from __future__ import annotations

__all__: list[str] = []
