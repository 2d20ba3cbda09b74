"""Every CLI default is the library's own: a flag left out means what the Python keyword left out means.

The commands read their defaults from the options objects (``DEFAULTS``, ``SERVE_DEFAULTS``, the
battery's and the selection's); these tests parse what each command would pass when no flag is given
and compare it with the library default, so a default changed in one place and not the other fails.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest
import typer
from typer.core import TyperOption

from shardkit.cli.app import app
from shardkit.cli.main import _register_commands
from shardkit.ordertest.battery import check_fraction
from shardkit.ordertest.settings import DEFAULTS as BATTERY_DEFAULTS
from shardkit.profiling.profiler import PROFILE_EPOCHS
from shardkit.readers import DEFAULTS, SamplerOptions
from shardkit.serve.server import SERVE_DEFAULTS, ServeOptions
from shardkit.units import parse_count
from shardkit.viz import export, show
from shardkit.viz.selection import SELECTION_DEFAULTS

_register_commands()


def _defaults(command: str) -> dict[str, Any]:
    """What ``command`` passes for each option when its flag is not given."""
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.name: p.default for p in cmd.params if isinstance(p, TyperOption) and p.name}


def _sampler_part(values: dict[str, Any], options: type[SamplerOptions] | type[ServeOptions]) -> dict[str, Any]:
    names = options.option_names()
    return {k: v for k, v in values.items() if k in names and v is not None}


def test_sample_defaults_are_the_sampler_options() -> None:
    values = _defaults("sample")
    # sample offers every sampler option that has a flag (its flags are generated from the declaration;
    # ``store``, a whole StoreOptions, is given in Python and its options with a flag by their flat names).
    assert {n for n, d in SamplerOptions.declared().items() if d.cli_flag(n)} <= set(values)
    assert SamplerOptions.option_names() - set(values) == {"store"}
    given = _sampler_part(values, SamplerOptions)
    assert {"batch_size", "ram_size", "ssd_size", "tiers", "seed", "mode", "static_cache", "gap_bytes"} <= set(given)
    assert SamplerOptions.parse(source="cli", **given) == DEFAULTS


def test_profile_defaults_are_the_sampler_options_over_two_epochs() -> None:
    values = _defaults("profile")
    assert values["epochs"] == PROFILE_EPOCHS
    given = _sampler_part(values, SamplerOptions)
    assert SamplerOptions.parse(source="cli", **given) == DEFAULTS.replace(epochs=PROFILE_EPOCHS)


def test_serve_defaults_are_the_server_options() -> None:
    values = _defaults("serve")
    given = _sampler_part(values, ServeOptions)
    assert {"tiers", "ram_size", "ssd_size", "seed", "slots", "wait_for", "lease_seconds", "max_connections"} <= set(given)
    assert ServeOptions.parse(source="cli", **given) == SERVE_DEFAULTS
    assert SERVE_DEFAULTS.ram_size == DEFAULTS.ram_size and SERVE_DEFAULTS.tiers == DEFAULTS.tiers


def test_order_test_defaults_are_the_battery_settings() -> None:
    values = _defaults("order-test")
    assert check_fraction(values["alpha"], "--alpha") == BATTERY_DEFAULTS.alpha
    assert check_fraction(values["effect"], "--effect") == BATTERY_DEFAULTS.effect
    assert parse_count(values["bins"], what="--bins") == BATTERY_DEFAULTS.bins
    assert values["seed"] == BATTERY_DEFAULTS.seed


@pytest.mark.parametrize(("command", "function"), [("show", show), ("export", export)])
def test_selection_defaults_are_the_viz_defaults(command: str, function: Any) -> None:
    values = _defaults(command)
    keywords = inspect.signature(function).parameters
    for name in ("seed", "limit", "keys", "random", "label"):
        assert values[name] == keywords[name].default == getattr(SELECTION_DEFAULTS, name), name


def test_reading_the_defaults_does_not_import_the_battery() -> None:
    """The CLI reads the battery's defaults at start-up; SciPy (about a second) loads only when a test runs."""
    code = ("import sys; from shardkit.cli.main import _register_commands; _register_commands(); "
            "import shardkit.ordertest as o; o.DEFAULTS; "
            "print(sorted(m for m in ('scipy', 'shardkit.ordertest.battery') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
