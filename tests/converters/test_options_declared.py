"""The options every conversion takes are declared once (ConversionOptions) and reach the engine from
every entry point: ``shardkit.convert``, ``shardkit.write``, ``shardkit convert`` and ``shardkit write``.

CASES must name exactly the declared options: a new option fails here until it has a case, and is then
checked in all four places; a keyword or flag that one entry point has and the declaration has not
fails too.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.cli.app import app
from shardkit.cli.main import _register_commands
from shardkit.converters import partrun
from shardkit.converters import write as write_module
from shardkit.converters.runoptions import ConversionOptions
from shardkit.errors import ConfigError
from tests.helpers.cli import run_cli
from tests.helpers.corpora import make_imagefolder

_register_commands()
DECLARED = list(ConversionOptions.declared())
FLAGGED = [name for name, o in ConversionOptions.declared().items() if o.cli_flag(name)]
_EXECUTOR = object()
#: A value of each option other than its default, as Python takes it, and what the engine gets.
CASES: dict[str, tuple[Any, Any]] = {
    "workers": (3, 3),
    "strict": (True, True),
    "overwrite": (True, True),
    "compression": ("zstd", "zstd"),
    "shard_bytes": ("1MiB", 1 << 20),
    "records_per_shard": (7, 7),
    "progress": (False, False),
    "executor": (_EXECUTOR, _EXECUTOR),
    "scheduler": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:1"),
    "append": (True, True),
    "part_size": ("5", 5),
    "keep_versions": (4, 4),
    "staging_dir": ("/tmp/staging-here", Path("/tmp/staging-here")),
}
#: Each entry point's own parameters: what it converts, not how.
OWN = {
    "convert": {"src", "out", "kind", "naming", "options"},
    "write": {"fn", "inputs", "out", "record", "fields", "naming"},
    "cli convert": {"src", "output", "kind", "quiet", "verbose"},
    "cli write": {"fn", "inputs", "record", "fields", "output", "quiet", "verbose"},
}


class _Stop(ConfigError):
    pass


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keywords run_conversion gets (for convert and write), the run stopped there."""
    seen: list[dict[str, Any]] = []

    def spy(conv: Any, out: Any, title: str, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise _Stop("stopped by the test")

    monkeypatch.setattr(partrun, "run_conversion", spy)
    monkeypatch.setattr(write_module, "run_conversion", spy)
    return seen


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("opts") / "corpus"
    make_imagefolder(root, per_class=1, bad=False, splits=("train",))
    return root


def _parameters(command: str) -> set[str]:
    info = next(c for c in app.registered_commands if c.name == command)
    assert info.callback is not None
    return set(inspect.signature(info.callback).parameters)


def test_every_option_has_a_case_and_every_entry_point_has_every_option() -> None:
    assert sorted(CASES) == sorted(DECLARED)
    for name, (given, _) in CASES.items():
        assert ConversionOptions(**{name: given}).value(name) != ConversionOptions().value(name), name
    assert set(inspect.signature(shardkit.convert).parameters) - OWN["convert"] == set(DECLARED)
    assert set(inspect.signature(shardkit.write).parameters) - OWN["write"] == set(DECLARED)
    from shardkit.cli.convert import kind_option_parameters

    kind_flags = {p.name for p in kind_option_parameters()}
    assert _parameters("convert") - OWN["cli convert"] - kind_flags == set(FLAGGED)
    assert _parameters("write") - OWN["cli write"] == set(FLAGGED)


@pytest.mark.parametrize("name", DECLARED)
def test_option_reaches_the_engine_from_python(name: str, corpus: Path, tmp_path: Path,
                                              reached: list[dict[str, Any]]) -> None:
    given, want = CASES[name]
    with pytest.raises(_Stop):
        shardkit.convert(corpus, tmp_path / "a", size=4, **{name: given})
    with pytest.raises(_Stop):
        shardkit.write("tests.converters.write_fns:tile", range(3), tmp_path / "b", **{name: given})
    assert [r[name] for r in reached] == [want, want]


def _flag_args(name: str, value: Any) -> list[str]:
    flag = ConversionOptions.spell(name, "cli")
    return [flag] if value is True else [flag, str(value)]


@pytest.mark.parametrize("name", FLAGGED)
def test_option_reaches_the_engine_from_the_command_line(name: str, corpus: Path, tmp_path: Path,
                                                         reached: list[dict[str, Any]]) -> None:
    given, want = CASES[name]
    r = run_cli("convert", str(corpus), "-o", str(tmp_path / "a"), "--size", "4", "-q", *_flag_args(name, given))
    assert "stopped by the test" in r.stderr, r.stderr
    r = run_cli("write", "tests.converters.write_fns:from_path", "--inputs", str(corpus / "train" / "*" / "*"), "-o",
                str(tmp_path / "b"), "-q", *_flag_args(name, given))
    assert "stopped by the test" in r.stderr, r.stderr
    assert [r[name] for r in reached] == [want, want]


def test_cli_errors_name_the_flags() -> None:
    r = run_cli("write", "tests.converters.write_fns:tile", "--inputs", __file__, "-o", "y", "--shard-size", "lots")
    assert r.returncode != 0 and "--shard-size" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ConfigError, match=r"^keep_versions"):
        ConversionOptions.parse(keep_versions=-1)
    with pytest.raises(ConfigError, match=r"^--part-size"):
        ConversionOptions.parse(source="cli", part_size="0")
