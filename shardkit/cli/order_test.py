"""``shardkit order-test``: run the uniformity battery on the keys any loader emitted. Exit codes:
0 every applicable test passes, 1 some test rejects a uniform order, 2 bad input or nothing testable."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from shardkit.cli.app import app, echo_err, echo_out, help_text
from shardkit.errors import ConfigError, InputFileError, ShardkitError
from shardkit.ordertest.settings import DEFAULTS

if TYPE_CHECKING:
    from shardkit.ordertest.mixture import MixtureReport

EXIT_BAD_INPUT = 2


@app.command("order-test")
def order_test(
    keys: Path = typer.Argument(
        ..., help=help_text("KEYS.npy: int [epochs, N], the keys a loader emitted, one row per epoch "
                            "(e.g. from `shardkit sample --order-out`); or a mixture's int [epochs, L, 2] (dataset "
                            "index, key).")),
    alpha: str = typer.Option(f"{DEFAULTS.alpha:g}", "--alpha", help="Significance level of every verdict."),
    labels: Path = typer.Option(None, "--labels", help="LABELS.npy: one label per key, for distinct labels per batch."),
    batch_size: str = typer.Option(None, "--batch-size", help="The loader's batch size (with --labels)."),
    storage_order: Path = typer.Option(
        None, "--storage-order", help="MAP.npy: storage position of each key (default: the key is the position)."),
    records: str = typer.Option(None, "--records", help="Records in the dataset, if the rows do not show it."),
    bins: str = typer.Option(str(DEFAULTS.bins), "--bins", help="At most this many item / position bins."),
    effect: str = typer.Option(
        f"{DEFAULTS.effect:g}", "--effect", help="Power is stated against buffer / block shuffles of this fraction of N."),
    seed: int = typer.Option(DEFAULTS.seed, "--seed", help="Seed of the simulated null and the power simulations."),
    sizes: str | None = typer.Option(
        None, "--sizes", help="A mixture's dataset sizes, comma-separated (default: the largest key + 1 of each)."),
    weights: str | None = typer.Option(
        None, "--weights", help="A mixture's weights, comma-separated: the counts test then checks their rounding."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    plot: Path = typer.Option(
        None, "--plot", help="FILE.png: item x position heat map and adjacent-pair deviations (needs the viz extra)."),
) -> None:
    """Test whether an order is a uniform shuffle: one line per test with its statistic, null, p-value,
    verdict and the epochs it needs for 80% power."""
    from shardkit.order.seeds import check_seed
    from shardkit.ordertest import run
    from shardkit.ordertest.battery import check_fraction
    from shardkit.ordertest.plot import plot_report, require_matplotlib
    from shardkit.units import parse_count

    try:
        if _is_mixture(keys):
            mixed = _mixture(keys, sizes, weights, alpha, bins, seed, labels, plot, records)
            echo_out(mixed.to_json() if as_json else mixed.format())
            raise typer.Exit(mixed.exit_code)
        if sizes is not None or weights is not None:
            raise ConfigError("--sizes and --weights describe a mixture: KEYS must then be [epochs, L, 2]")
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
    echo_out(report.to_json() if as_json else report.format())
    if plot is not None and not as_json:
        echo_err(f"wrote {plot}")
    raise typer.Exit(report.exit_code)


def _is_mixture(keys: Path) -> bool:
    from shardkit.ordertest.keys import npy_shape

    return len(npy_shape(keys)) == 3


def _mixture(keys: Path, sizes: str | None, weights: str | None, alpha: str, bins: str, seed: int,
             labels: Path | None, plot: Path | None, records: str | None) -> MixtureReport:
    """``order-test`` on a mixture's ``[epochs, L, 2]`` order (see :mod:`shardkit.ordertest.mixture`)."""
    from shardkit.order.mixture import parse_weights
    from shardkit.order.seeds import check_seed
    from shardkit.ordertest.battery import check_fraction
    from shardkit.ordertest.mixture import run_mixture
    from shardkit.units import parse_count

    for option, value in (("--labels", labels), ("--plot", plot), ("--records", records)):
        if value is not None:
            raise ConfigError(f"{option}: not available for a mixture's [epochs, L, 2] order (use --sizes for its datasets)")
    size_list = None
    if sizes is not None:
        size_list = [parse_count(s.strip(), what="--sizes", minimum=1) for s in sizes.split(",")]
    weight_list = None if weights is None else list(parse_weights(weights.split(","), what="--weights"))
    return run_mixture(keys, sizes=size_list, weights=weight_list, alpha=check_fraction(alpha, "--alpha"),
                       bins=parse_count(bins, what="--bins", minimum=2), seed=check_seed(seed, what="--seed"))
