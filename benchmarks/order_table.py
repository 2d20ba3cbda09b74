"""Run ``shardkit order-test`` over the orders ``benchmarks/compare.py`` recorded and print a Markdown table.

``compare.py`` saves each loader's emitted keys of its repeated-epoch order runs as
``benchmarks/_data/orders/<loader>.npy`` (``[epochs, N]`` int64; N = 200 records in 10 classes stored
by class, like ImageFolder), with ``labels.npy`` and ``meta.json`` (batch size, loader names)::

    python benchmarks/compare.py                       # or --small for a quick run (orders-small/)
    python benchmarks/order_table.py                   # the table, one row per loader
    python benchmarks/order_table.py --plot wds benchmarks/order_test_wds.png

Each cell is the test's p-value (bold when it rejects a uniform order at alpha); the last column
lists the tests that reject. Only numpy, scipy and shardkit are needed (matplotlib for ``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from shardkit.ordertest import Report, run
from shardkit.ordertest.plot import plot_report
from shardkit.ordertest.report import format_p

HERE = Path(__file__).resolve().parent
COLUMNS = ("item_position", "adjacent_pairs", "joint_positions", "storage_spearman", "labels_per_batch",
           "epoch_independence")


def reports(orders: Path, alpha: float, seed: int) -> dict[str, tuple[str, Report]]:
    """``{loader: (its name, the battery's report)}`` for every ``<loader>.npy`` listed in meta.json."""
    meta = json.loads((orders / "meta.json").read_text())
    labels = np.load(orders / "labels.npy", allow_pickle=False)
    out = {}
    for key, name in meta["loaders"].items():
        path = orders / f"{key}.npy"
        if path.exists():
            out[key] = (name, run(path, labels=labels, batch_size=int(meta["batch"]), alpha=alpha, seed=seed))
    return out


def markdown(found: dict[str, tuple[str, Report]], alpha: float) -> str:
    """One row per loader: p-value of each test (bold = rejects), and the verdict."""
    head = ["loader", "epochs x N", *COLUMNS, f"uniform at alpha = {alpha:g}"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(COLUMNS) + "---|"]
    for name, rep in found.values():
        cells = []
        for col in COLUMNS:
            r = rep.result(col)
            if r.verdict == "n/a":
                cells.append("n/a")
            else:
                p = format_p(r.pvalue)
                cells.append(f"**{p}**" if r.verdict == "fail" else p)
        verdict = "yes" if rep.passed else "**no** (" + ", ".join(r.name for r in rep.failed) + ")"
        lines.append(f"| {name} | {rep.epochs} x {rep.records} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("orders", nargs="?", type=Path, default=HERE / "_data" / "orders",
                    help="directory compare.py wrote the orders to (default benchmarks/_data/orders)")
    ap.add_argument("--alpha", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", nargs=2, action="append", default=[], metavar=("LOADER", "FILE"),
                    help="also write the heat maps of LOADER (e.g. wds) to FILE.png; repeatable")
    args = ap.parse_args(argv)
    if not (args.orders / "meta.json").exists():
        print(f"error: {args.orders}: no meta.json; run benchmarks/compare.py first", file=sys.stderr)
        return 2
    found = reports(args.orders, args.alpha, args.seed)
    print(markdown(found, args.alpha))
    for key, file in args.plot:
        if key not in found:
            print(f"error: no recorded order for loader {key!r} (have: {', '.join(found)})", file=sys.stderr)
            return 2
        plot_report(found[key][1], file, needed_by="benchmarks/order_table.py --plot")
        print(f"wrote {file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
