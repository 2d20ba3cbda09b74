"""``shardkit order-test``: run the uniformity battery on the keys any loader emitted.

Exit codes: 0 every applicable test passes, 1 some test rejects a uniform order, 2 bad input (a
one-line error naming the file or option) or nothing that can be tested.
"""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app, echo_err
from shardkit.errors import ConfigError, InputFileError, ShardkitError

EXIT_BAD_INPUT = 2


@app.command("order-test")
def order_test(
    keys: Path = typer.Argument(
        ..., help="KEYS.npy: int [epochs, N], the keys a loader emitted, one row per epoch "
                  "(e.g. from `shardkit sample --order-out`)."),
    alpha: str = typer.Option("1e-3", "--alpha", help="Significance level of every verdict."),
    labels: Path = typer.Option(None, "--labels", help="LABELS.npy: one label per key, for distinct labels per batch."),
    batch_size: str = typer.Option(None, "--batch-size", help="The loader's batch size (with --labels)."),
    storage_order: Path = typer.Option(
        None, "--storage-order", help="MAP.npy: storage position of each key (default: the key is the position)."),
    records: str = typer.Option(None, "--records", help="Records in the dataset, if the rows do not show it."),
    bins: str = typer.Option("16", "--bins", help="At most this many item / position bins."),
    effect: str = typer.Option(
        "0.1", "--effect", help="Power is stated against buffer / block shuffles of this fraction of N."),
    seed: int = typer.Option(0, "--seed", help="Seed of the simulated null and the power simulations."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    plot: Path = typer.Option(
        None, "--plot", help="FILE.png: item x position heat map and adjacent-pair deviations (needs the viz extra)."),
) -> None:
    """Test whether an order is a uniform shuffle: one line per test with its statistic, null, p-value,
    verdict and the epochs it needs for 80% power."""
    from shardkit.ordertest import run
    from shardkit.ordertest.battery import check_fraction
    from shardkit.ordertest.plot import plot_report, require_matplotlib
    from shardkit.readers.seeds import check_seed
    from shardkit.units import parse_count

    try:
        if labels is not None and batch_size is None:
            raise ConfigError("--labels needs --batch-size (the loader's batch size)")
        if plot is not None:
            require_matplotlib("shardkit order-test --plot")
        report = run(
            keys, labels=labels, storage_order=storage_order,
            batch_size=None if batch_size is None else parse_count(batch_size, what="--batch-size", minimum=1),
            records=None if records is None else parse_count(records, what="--records", minimum=2),
            alpha=check_fraction(alpha, "--alpha"), effect=check_fraction(effect, "--effect"),
            bins=parse_count(bins, what="--bins", minimum=2), seed=check_seed(seed, what="--seed"))
        if not report.tested:
            reasons = "; ".join(f"{r.name}: {r.detail}" for r in report.results if r.detail)
            raise InputFileError(str(keys), f"no test applies to {report.epochs} epoch(s) of {report.length} keys "
                                            f"({reasons})")
        if plot is not None:
            plot_report(report, plot, needed_by="shardkit order-test --plot")
    except (ShardkitError, OSError) as exc:
        echo_err(f"error: {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    typer.echo(report.to_json() if as_json else report.format())
    if plot is not None and not as_json:
        echo_err(f"wrote {plot}")
    raise typer.Exit(report.exit_code)
