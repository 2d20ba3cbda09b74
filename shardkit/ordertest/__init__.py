"""``shardkit order-test``: is a loader's order a uniform shuffle? A battery of statistical tests.

Point it at the keys any loader emitted (``[epochs, N]`` integers, one row per epoch)::

    from shardkit.ordertest import run
    report = run(keys, labels=labels, batch_size=64)
    print(report.format())          # one line per test: statistic, null, p-value, verdict, power
    report.passed, report.result("adjacent_pairs").pvalue

The tests and their null distributions: :mod:`shardkit.ordertest.battery`; the statistics and their
proofs: :mod:`shardkit.ordertest.stats`; orders known not to be uniform:
:mod:`shardkit.ordertest.alternatives`; a picture: :func:`shardkit.ordertest.plot.plot_report`
(needs the ``viz`` extra).
"""

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
