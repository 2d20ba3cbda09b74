"""``shardkit write module:function --inputs FILE|GLOB -o OUT``: :func:`shardkit.write` from the command line.

The options shared with ``convert`` (workers, scheduler, append, parts, sizes, ...) are derived from
their one declaration, :class:`~shardkit.converters.runoptions.ConversionOptions`
(:func:`shardkit.cli.convert.conversion_parameters`), so both commands spell and document them
alike; the progress bar and the summary are ``convert``'s too.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Any

import typer

from shardkit.cli.app import app, help_text, setup_logging
from shardkit.cli.convert import _common_parameters, conversion_options, print_summary
from shardkit.converters.progress import progress_bar
from shardkit.errors import ConfigError

__all__ = ["write"]

#: ``convert`` parameters that ``write`` does not take (it has a function and inputs instead of a corpus).
_NOT_HERE = ("src", "kind")
#: ``convert`` options whose help names its corpus, said for ``write``.
_HELP = {
    "append": ("Add the records after those of the dataset at the output, as its next version (same payload key, "
               "shapes, dtypes and fields); readers that opened it keep their version."),
    "scheduler": ("Run in parts on this Dask cluster (tcp://host:8786; default: $DASK_SCHEDULER_ADDRESS if set; "
                  "'local' for this machine). Workers must import MODULE and see the output at the same path."),
    "part_size": ("Write in parts of N inputs (default with --scheduler or --append: about 64 parts). Without "
                  "--scheduler the parts run on --workers local processes, each writing its own shards."),
}


def _parameters() -> list[inspect.Parameter]:
    def p(name: str, annotation: Any, info: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)

    own = [
        p("fn", str, typer.Argument(..., metavar="MODULE:FUNCTION", show_default=False, help=(
            "The function that makes the records of one input (a dict of arrays and numbers, or a generator of "
            "them), imported from the current directory or the Python path."))),
        p("inputs", str, typer.Option(..., "--inputs", "-i", metavar="FILE|GLOB", help=help_text(
            "The inputs: a file with one input per line, or a glob pattern (quoted, e.g. 'scans/**/*.nii'; "
            "matches sorted). fn gets each as a str.")))
        ,
        p("record", str | None, typer.Option(None, "--record", metavar="KEY", show_default=False, help=(
            "The payload key of fn's records (default: the array with the most bytes in the first record)."))),
        p("fields", str | None, typer.Option(None, "--fields", metavar="KEY,KEY", show_default=False, help=(
            "The small per-record fields to keep, comma-separated (default: every other key; a record with "
            "other keys is then a mismatch). Shapes and dtypes come from the first record."))),
    ]
    shared = []
    for q in _common_parameters():
        if q.name in _NOT_HERE:
            continue
        if q.name in _HELP:  # convert's words name SRC: the same option, told for write
            info = copy.copy(q.default)
            info.help = _HELP[q.name]
            q = q.replace(default=info)
        shared.append(q)
    return own + shared


def write(*, fn: str, inputs: str, record: str | None, fields: str | None, output: str, quiet: bool, verbose: bool,
          **given: Any) -> None:
    """Write a dataset from a Python function over a list of inputs; resumable, deterministic whatever --workers."""
    from shardkit.converters.write import cli_path, function_name, inputs_from, resolve_function
    from shardkit.converters.write import write as run_write

    setup_logging(verbose)
    cli_path()
    function = resolve_function(fn, what="MODULE:FUNCTION")
    items = inputs_from(inputs)
    keys = None
    if fields is not None:
        keys = [k.strip() for k in fields.split(",") if k.strip()]
        if not keys:
            raise ConfigError(f"--fields {fields!r}: expected keys separated by commas")
    run = conversion_options(given, "writing")
    t0 = time.perf_counter()
    with progress_bar("input", f"write {function_name(function)}", disable=quiet) as progress:
        summary = run_write(function, items, output, record=record, fields=keys, naming="cli",
                            **{**run.run_keywords(), "progress": progress})
    print_summary(summary, append=run.append, started=t0, compression=run.compression)


write.__signature__ = inspect.Signature(_parameters(), return_annotation=None)  # type: ignore[attr-defined]
app.command("write")(write)
