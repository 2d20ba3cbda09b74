"""Benchmark of ``shardkit profile``: predictions next to measurements in 12 configurations (issues 16, 33).

Run: ``python benchmarks/stall_profile.py [--quick] [--records N] [--step-ms MS] [--rounds R]
[--ssd-dir DIR] [--data DIR]`` (generates ``benchmarks/_data/profile-bench-N``: N records of 224x224x3 uint8).

Profiles the dataset with a sleeping step (an accelerator) and a RAM budget of a tenth of the
dataset (the profiled job: row 1), then checks 11 other configurations a user asks about, each run
for real next to its prediction: no static cache, half the dataset pinned, all of it (a large
budget); each of these four again with the files in the page cache (a fast drive); the SSD tier
(4x the RAM budget) cold and warm; and reads of only the wanted records (``gap_bytes`` 0) cold and
warm. "cold" runs drop the dataset from the page cache first, so their first epoch reads the device.
Every check is predicted from rates measured again just before it (``recalibrate``): on a shared
machine whose load drifts, prediction and measurement then see the same load. Prints a markdown
table of predicted and measured run time, per epoch, with the relative error, and the count within 15%.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from _common import IMAGE_SHAPE, synthetic_dataset

from shardkit.profiling import Scenario, Workload, default_checks, plot, profile, report_lines
from shardkit.profiling.model import with_options
from shardkit.readers import SamplerOptions

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
#: A prediction this close to the measurement counts as a hit.
TOLERANCE = 0.15


def configurations(work: Workload, opts: SamplerOptions) -> list[Scenario]:
    """The 11 checked configurations around the profiled job ``opts`` (the 12th)."""
    base = Scenario("ram 10%", opts)
    ram = opts.ram_size.to_bytes(work.record_nbytes)
    cold = [*default_checks(work, base)]
    cold.append(with_options(base, "ssd tier 4x ram", tiers="ram,ssd", ssd_size=4 * ram))
    cold.append(with_options(base, "gap_bytes 0", gap_bytes=0))
    warm = [replace(s, label=f"{s.label}, warm", cold_start=False) for s in [base, *cold]]
    return [*cold, *warm]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small dataset and one round (smoke run)")
    ap.add_argument("--records", type=int, default=1500)
    ap.add_argument("--step-ms", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ssd-dir", type=Path, default=DATA / "profile-ssd", help="the SSD tier's directory")
    ap.add_argument("--data", type=Path, default=DATA, help="where the dataset is generated")
    ap.add_argument("--plot", type=Path, default=None, help="also write the plot of the last round")
    args = ap.parse_args(argv)
    n, rounds = (400, 1) if args.quick else (args.records, args.rounds)
    path = synthetic_dataset(args.data / f"profile-bench-{n}", n)
    args.ssd_dir.mkdir(parents=True, exist_ok=True)
    record = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
    opts = SamplerOptions.parse(batch_size=args.batch_size, ram_size=n * record // 10, epochs=2, ssd_dir=args.ssd_dir)
    checks = configurations(Workload(n, record, args.batch_size, 2), opts)
    print("| round | configuration | predicted s | measured s | error | epochs pred / meas s |")
    print("|---|---|---|---|---|---|")
    prof = None
    hits = total = 0
    errors: dict[str, list[float]] = {}
    for r in range(rounds):
        prof = profile(path, opts, step_time=args.step_ms / 1e3, check=checks, recalibrate=True)
        rows = [(prof.measured, prof.phases["both"])] + [(c.prediction, c.measured) for c in prof.checks]
        for pred, meas in rows:
            err = (pred.seconds - meas.seconds) / meas.seconds
            hits, total = hits + (abs(err) <= TOLERANCE), total + 1
            errors.setdefault(pred.scenario.label, []).append(err)
            epochs = " ".join(f"{e.seconds:.3f}" for e in pred.epochs) + " / " + " ".join(f"{s:.3f}" for s in meas.epoch_seconds)
            print(f"| {r} | {pred.scenario.label} | {pred.seconds:.3f} | {meas.seconds:.3f} | {err:+.1%} | {epochs} |",
                  flush=True)  # fmt: skip
    print(f"\nwithin {TOLERANCE:.0%}: {hits} of {total} ({rounds} rounds of {total // max(1, rounds)} configurations)")
    medians = {label: float(np.median(errs)) for label, errs in errors.items()}
    print("\n| configuration | median error over rounds | range |\n|---|---|---|")
    for label, errs in errors.items():
        print(f"| {label} | {medians[label]:+.1%} | {min(errs):+.1%} to {max(errs):+.1%} |")
    close = sum(abs(m) <= TOLERANCE for m in medians.values())
    print(f"\nmedian error within {TOLERANCE:.0%}: {close} of {len(medians)} configurations")
    assert prof is not None
    print("\n".join(report_lines(prof)), file=sys.stderr)
    if args.plot is not None:
        plot(prof, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
