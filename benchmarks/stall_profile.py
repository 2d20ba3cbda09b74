"""Benchmark of ``shardkit profile``: predictions next to measurements (issue 16).

Run: ``python benchmarks/stall_profile.py [--quick] [--records N] [--step-ms MS] [--rounds R]``
(generates ``benchmarks/_data/profile-bench``: N records of 224x224x3 uint8).

Profiles the dataset with a sleeping step (an accelerator) and a RAM budget of a tenth of the
dataset, then runs the default checks (no static cache / half the dataset pinned / all of it), each
cold (the dataset dropped from the page cache first), and prints a markdown table of predicted and
measured run time, steady-state epoch and stall, with the relative error. The machine's disk and
CPU are shared and noisy: run it idle, and compare rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import synthetic_dataset

from shardkit.profiling import plot, profile, report_lines

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "profile-bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small dataset and one round (smoke run)")
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--step-ms", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plot", type=Path, default=None, help="also write the plot of the last round")
    args = ap.parse_args()
    n, rounds = (400, 1) if args.quick else (args.records, args.rounds)
    path = synthetic_dataset(DATA.with_name(f"profile-bench-{n}"), n)
    ram = n * 224 * 224 * 3 // 10
    print("| round | configuration | predicted s | measured s | error | steady pred / meas s | stall pred / meas |")
    print("|---|---|---|---|---|---|---|")
    prof = None
    for r in range(rounds):
        prof = profile(path, step_time=args.step_ms / 1e3, batch_size=args.batch_size, ram_size=ram, check=True)
        both = prof.phases["both"]
        rows = [(prof.measured, both)] + [(c.prediction, c.measured) for c in prof.checks]
        for pred, meas in rows:
            err = (pred.seconds - meas.seconds) / meas.seconds
            print(f"| {r} | {pred.scenario.label} | {pred.seconds:.3f} | {meas.seconds:.3f} | {err:+.1%} | "
                  f"{pred.steady.seconds:.3f} / {meas.epoch_seconds[-1]:.3f} | "
                  f"{pred.stall_fraction:.1%} / {meas.stall_fraction:.1%} |")  # fmt: skip
    assert prof is not None
    print("\n".join(report_lines(prof)), file=sys.stderr)
    if args.plot is not None:
        plot(prof, args.plot)


if __name__ == "__main__":
    main()
