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


def _rendered(args: list[str]) -> str:
    """The help as a person reads it, panel borders and line wrapping taken out."""
    result = runner.invoke(app, args, terminal_width=300)
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def test_help_names_the_viz_extra_literally() -> None:
    """Typer renders help as rich markup, where ``[viz]`` is a style tag: it used to vanish and leave
    ``pip install "shardkit"``."""
    for args in (["--help"], ["show", "--help"]):
        assert 'pip install "shardkit[viz]"' in _rendered(args), args
    assert 'pip install "shardkit[viz]"' in _rendered(["profile", "--help"])


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_bracket_in_help_text_is_shown(command: str) -> None:
    """Whatever help text holds in brackets (an extra, a shape ``[epochs, N]``) reaches the screen as
    written, and no escaping backslash does."""
    import typer

    group = typer.main.get_command(app)
    cmd = group.commands[command] if command else group  # type: ignore[attr-defined]
    texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
    if not command:
        texts += [c.help or "" for c in group.commands.values()]  # type: ignore[attr-defined]
    shown = _rendered([command, "--help"] if command else ["--help"])
    assert "\\[" not in shown
    for text in texts:
        for token in re.findall(r"\[[^\[\]]*\]", text.replace("\\[", "[")):
            assert " ".join(token.split()) in shown, (token, text)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_bracket_in_flag_help_is_escaped_where_the_flag_is_made(command: str) -> None:
    """Rich would take ``[viz]`` or ``[@RATE]`` for a style tag: every flag's help reaches typer with
    each ``[`` escaped (declared flags by cli/options.flag_info, the selection flags of show and
    export included), whether or not the text inside happens to look like a tag."""
    import typer

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    for p in cmd.params:
        text = getattr(p, "help", None) or ""
        assert not re.search(r"(?<!\\)\[", text), (command, p.name, text)
