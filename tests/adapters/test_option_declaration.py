"""Every sampler option is declared once (a field of SamplerOptions) and reaches the sampler from
every entry point: Python, the torch adapter, the command line (the TensorFlow adapter's check runs in
tf_script.py, see test_tf.py::test_every_option_reaches_the_sampler).

The cases come from OPTION_CASES, whose keys must be exactly the declared options: a new option
fails here until it has a case, and then it is checked everywhere without further listing.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from _adapter_data import OPTION_CASES

from shardkit.cli.app import app
from shardkit.cli.main import _register_commands
from shardkit.errors import ConfigError
from shardkit.readers import DEFAULTS, SamplerOptions, TieredSampler
from shardkit.readers.shared.server import ServeOptions
from tests.helpers.cli import run_cli

_register_commands()
DECLARED = list(SamplerOptions.declared())


def test_every_declared_option_has_a_case() -> None:
    assert sorted(OPTION_CASES) == sorted(DECLARED)
    for name, case in OPTION_CASES.items():
        assert getattr(SamplerOptions(**case), name) != getattr(DEFAULTS, name), name  # type: ignore[arg-type]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[SamplerOptions]:
    """The options of every TieredSampler built while the test runs (what the pipeline runs with)."""
    seen: list[SamplerOptions] = []
    init = TieredSampler.__init__

    def spy(self: TieredSampler, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        seen.append(self.options)

    monkeypatch.setattr(TieredSampler, "__init__", spy)
    return seen


@pytest.mark.parametrize("name", DECLARED)
def test_option_reaches_the_sampler_from_python(keyed: Path, name: str, built: list[SamplerOptions]) -> None:
    case = OPTION_CASES[name]
    want = getattr(SamplerOptions(**case), name)  # type: ignore[arg-type]
    with TieredSampler(keyed, **case):
        pass
    with TieredSampler(keyed, SamplerOptions(**case)):  # type: ignore[arg-type]
        pass
    assert [getattr(o, name) for o in built] == [want, want]


def _flag_args(case: dict[str, object]) -> list[str]:
    args = []
    for key, value in case.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("name", DECLARED)
def test_option_reaches_the_sampler_from_the_command_line(
    keyed: Path, name: str, built: list[SamplerOptions]
) -> None:
    case = OPTION_CASES[name]
    result = run_cli("sample", str(keyed), *_flag_args(case))
    assert result.returncode == 0, result.stderr
    assert getattr(built[-1], name) == getattr(SamplerOptions(**case), name)  # type: ignore[arg-type]


#: Options the adapters place themselves (torch: the DataLoader's workers; tf.distribute: pipelines).
_PLACED_BY_ADAPTER = {"workers_per_rank"}


@pytest.mark.parametrize("name", DECLARED)
def test_option_reaches_the_sampler_from_the_torch_adapter(
    keyed: Path, name: str, built: list[SamplerOptions]
) -> None:
    from shardkit.adapters.torch import ShardIterableDataset

    case = OPTION_CASES[name]
    want = SamplerOptions(**case)  # type: ignore[arg-type]
    for ds in (ShardIterableDataset(keyed, **case), ShardIterableDataset(keyed, options=want)):
        next(iter(ds), None)  # the pass's own sampler is the last one built
        got = built[-1]
        assert getattr(got, name) == (1 if name in _PLACED_BY_ADAPTER else getattr(want, name))


def test_adapters_take_options_and_overrides_not_keyword_lists() -> None:
    """The adapters name no sampler option in their signature: they take ``options`` and ``**overrides``
    (rank, world_size and nodes stay explicit: the adapters find them where they run when not given)."""
    from shardkit.adapters.torch import ShardIterableDataset

    params = inspect.signature(ShardIterableDataset.__init__).parameters
    assert params["options"].default is None and params["overrides"].kind is inspect.Parameter.VAR_KEYWORD
    assert set(params) & set(DECLARED) == {"rank", "world_size", "nodes"}
    assert all(name in (ShardIterableDataset.__doc__ or "") for name in DECLARED)


def test_unknown_override_names_the_nearest_options(keyed: Path) -> None:
    from shardkit.adapters.torch import ShardIterableDataset

    with pytest.raises(ConfigError, match=r"unknown sampler option ram_sise; .*\(did you mean ram_size\?\)"):
        ShardIterableDataset(keyed, ram_sise="1GiB")
    with pytest.raises(ConfigError, match="options: expected a SamplerOptions"):
        ShardIterableDataset(keyed, options={"ram_size": "1GiB"})  # type: ignore[arg-type]


@pytest.mark.parametrize(("command", "options"), [("sample", SamplerOptions), ("profile", SamplerOptions),
                                                  ("serve", ServeOptions)])
def test_command_flags_are_generated_from_the_declaration(command: str, options: type) -> None:
    """Each command offers every declared option that has a flag, with the declared help."""
    import typer

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    helps = {p.name: p.help for p in cmd.params}
    for name, declared in options.declared().items():
        if declared.cli_flag(name) is None:
            assert name not in helps
        elif not (command == "profile" and name in ("epochs", "ssd_dir")):  # profile's own meaning
            assert helps[name] == declared.help, (command, name)
