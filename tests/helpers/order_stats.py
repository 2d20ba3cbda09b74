"""The statistics the order tests share: one implementation of the item x position chi-square.

Every test of an emitted order (tests/readers, tests/order, tests/serve, tests/adapters, tests/benchmarks) scores it with
:func:`item_position_chi2`, which is ``benchmarks/order_metrics.uniformity_chi2``: the Pearson
statistic of the item x position table summed over epochs, scaled by ``(N - 1) / N``, against
chi-square with ``(N - 1)^2`` degrees of freedom. The scaling matters: rows of a permutation matrix
are not independent multinomials, so the unscaled statistic has mean ``N (N - 1)`` under a perfect
shuffle and raises false alarms (see that function's notes for the derivation).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

__all__ = ["ALPHA", "om", "item_position_chi2", "item_position_pvalue"]

#: Significance level of every statistical test in the suite.
ALPHA = 1e-3


def _load_order_metrics() -> ModuleType:
    # benchmarks/ is not a package; load its metrics module once, under its own name.
    if "order_metrics" in sys.modules:
        return sys.modules["order_metrics"]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "order_metrics.py"
    spec = importlib.util.spec_from_file_location("order_metrics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["order_metrics"] = module
    spec.loader.exec_module(module)
    return module


#: ``benchmarks/order_metrics.py``.
om = _load_order_metrics()


def item_position_chi2(orders: np.ndarray):  # type: ignore[no-untyped-def]
    """The scaled item x position chi-square (``order_metrics.ChiSquare``) of ``[epochs, N]`` orders."""
    orders = np.asarray(orders)
    return om.uniformity_chi2(orders, orders.shape[1])


def item_position_pvalue(orders: np.ndarray) -> float:
    """Its p-value under chi-square((N - 1)^2)."""
    return float(item_position_chi2(orders).pvalue)
