"""Help output a person can read: plain metavars, defaults shown, --version, completion."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from shardkit._version import __version__
from shardkit.cli.app import app
from shardkit.cli.main import COMMAND_MODULES, _register_commands

_register_commands()
runner = CliRunner()
COMMANDS = [name.replace("_", "-") for name in COMMAND_MODULES]


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"shardkit {__version__}"


def test_completion_is_offered() -> None:
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.output and "--show-completion" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain(command: str) -> None:
    result = runner.invoke(app, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    text = result.output
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage  # "PATH", not "{path}"
    assert not re.search(r"<(bool|str|int|float|path)>", text), text
    if "[default:" not in text and "Default:" not in text:
        # Every command with options that have defaults shows them (convert's per-kind options say
        # "Default: ..." in their help because the default depends on the kind).
        assert command in {"verify", "info"}, f"{command} --help shows no defaults"


def test_subprocess_smoke(small_dataset: Any) -> None:
    """The one test that runs the CLI as a user does, in its own process (the others run it in-process
    through tests.helpers.run_cli): a command's output, and a bad path's one-line error, exit code 1."""
    path, _ = small_dataset(n=5)
    ok = subprocess.run([sys.executable, "-m", "shardkit", "info", str(path)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "records      5" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "shardkit", "info", str(path / "nope")], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
