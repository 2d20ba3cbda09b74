"""``shardkit order-test``: is a loader's order a uniform shuffle? A battery of statistical tests
(docs/design.md §15). ``run(keys, labels=labels, batch_size=64)`` on ``[epochs, N]`` emitted keys
gives a :class:`Report` (``report.format()``, ``report.passed``, ``report.result(name)``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit.ordertest.settings import DEFAULTS, Settings

if TYPE_CHECKING:
    from shardkit.ordertest.battery import BATTERY, run, run_prepared
    from shardkit.ordertest.keys import OrderKeys, load_npy, prepare
    from shardkit.ordertest.report import Report, Result

__all__ = ["run", "run_prepared", "prepare", "load_npy", "Report", "Result", "OrderKeys", "Settings", "DEFAULTS", "BATTERY"]

#: Where each name lives; imported on first use, so that reading the defaults (``shardkit order-test
#: --help``, any CLI start) does not import SciPy.
_LAZY = {
    "BATTERY": "battery", "run": "battery", "run_prepared": "battery",
    "OrderKeys": "keys", "load_npy": "keys", "prepare": "keys",
    "Report": "report", "Result": "report",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.ordertest' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shardkit.ordertest.{module}"), name)
