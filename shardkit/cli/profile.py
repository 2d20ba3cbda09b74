"""``shardkit profile``: measure data stalls differentially and predict other configurations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from shardkit._extras import pip_install
from shardkit.cli.app import app, echo_err, echo_out, help_text
from shardkit.cli.options import options_command
from shardkit.errors import ConfigError
from shardkit.profiling.profiler import PROFILE_EPOCHS
from shardkit.readers import SamplerOptions
from shardkit.units import parse_duration


@app.command()
@options_command(SamplerOptions, changes={
    "ssd_dir": {"help": "SSD directory; given without --tiers ram,ssd it is only probed for its rates."},
    "epochs": {"default": PROFILE_EPOCHS, "help": "Epochs per phase (the first fills the static cache)."},
})
def profile(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    step_ms: str = typer.Option(
        None,
        "--step-ms",
        help="The training step takes this long (milliseconds, or a duration such as 20ms) without using the "
        "CPU, like an accelerator. Give this or --step.",
    ),
    step: str = typer.Option(None, "--step", help="Your training step as module:function (called with every batch, a dict of arrays)."),
    warm: bool = typer.Option(
        False, "--warm", help="Start the measured runs with the page cache as it is instead of dropping the dataset from it."
    ),
    check: bool = typer.Option(
        False, "--check", help="Also run three other configurations and show their predictions next to what they measure."
    ),
    recalibrate: bool = typer.Option(
        False, "--recalibrate", help="With --check: measure the rates again just before each check and predict it from them "
        "(on a busy machine, prediction and measurement then see the same load).",
    ),
    plot_out: Path = typer.Option(
        None, "--plot", help=help_text(f"Write a PNG of predicted epoch time against the static cache size (needs {pip_install('viz')}).")
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the whole profile as JSON instead of the report."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A progress bar per phase (on stderr)."),
    *,
    options: SamplerOptions,
) -> None:
    """Measure data stalls (pipeline alone, step alone, both) and predict what more RAM, SSD, cache,
    workers or bandwidth would buy."""
    from shardkit.profiling import load_step, plot, profile, report_lines, to_json

    if (step_ms is None) == (step is None):
        raise ConfigError("give exactly one of --step-ms (a duration) and --step (module:function)")
    if plot_out is not None and plot_out.suffix.lower() != ".png":
        raise ConfigError(f"--plot: expected a file name ending in .png, found {str(plot_out)!r}")
    step_time = None
    if step_ms is not None:
        text = step_ms.strip()
        step_time = parse_duration(f"{text}ms" if text.replace(".", "", 1).isdigit() else text, what="--step-ms")
    if step is not None and "" not in sys.path:
        sys.path.insert(0, "")  # --step train:step finds train.py in the working directory, as python -m would
    fn = load_step(step) if step is not None else None
    prof = profile(path, options, step=fn, step_time=step_time, cold=not warm, check=check,
                   recalibrate=recalibrate, progress_bars=progress and not as_json)  # fmt: skip
    if as_json:
        echo_out(json.dumps(to_json(prof), indent=1))
    else:
        echo_out("\n".join(report_lines(prof)))
    if plot_out is not None:
        echo_err(f"wrote {plot(prof, plot_out)}")
