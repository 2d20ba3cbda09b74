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

from shardkit.ordertest.battery import BATTERY, Settings, run, run_prepared
from shardkit.ordertest.keys import OrderKeys, load_npy, prepare
from shardkit.ordertest.report import Report, Result

__all__ = ["run", "run_prepared", "prepare", "load_npy", "Report", "Result", "OrderKeys", "Settings", "BATTERY"]
