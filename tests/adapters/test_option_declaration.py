"""Every sampler option is declared once (a field of SamplerOptions, or of StoreOptions for the
object-store settings) and reaches the sampler, and every store option the stores it opens, from
every entry point: Python, the torch adapter, the command line (the TensorFlow adapter's checks run
in tf_script.py, see test_tf.py::test_every_option_reaches_the_sampler and
test_every_store_option_reaches_the_store).

The cases come from OPTION_CASES and STORE_CASES, whose keys must be exactly the declared options:
a new option fails here until it has a case, and then it is checked everywhere without further listing.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from _adapter_data import OPTION_CASES, STORE_CASES

from shardkit.cli.app import app, help_text
from shardkit.cli.main import _register_commands
from shardkit.errors import ConfigError
from shardkit.readers import DEFAULTS, SamplerOptions, TieredSampler
from shardkit.serve.server import ServeOptions
from shardkit.stores import DEFAULT_OPTIONS, LocalStore, StoreOptions
from tests.helpers.cli import run_cli

_register_commands()
DECLARED = list(SamplerOptions.declared())
#: The sampler options with a command-line flag.
FLAGGED = [name for name, declared in SamplerOptions.declared().items() if declared.cli_flag(name)]
STORE_DECLARED = list(StoreOptions.declared())
#: The sampler option that is each store option with a flag, by its flat name (``remote_concurrency``).
FLAT = {key: name for name, (_, key, _) in SamplerOptions.flat_options().items()}


def test_every_declared_option_has_a_case() -> None:
    assert sorted(OPTION_CASES) == sorted(DECLARED)
    for name, case in OPTION_CASES.items():
        assert SamplerOptions(**case).value(name) != DEFAULTS.value(name), name  # type: ignore[arg-type]
    assert sorted(STORE_CASES) == sorted(STORE_DECLARED)
    for key, value in STORE_CASES.items():
        assert getattr(StoreOptions(**{key: value}), key) != getattr(DEFAULT_OPTIONS, key), key  # type: ignore[arg-type]


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
    want = SamplerOptions(**case).value(name)  # type: ignore[arg-type]
    with TieredSampler(keyed, **case):
        pass
    with TieredSampler(keyed, SamplerOptions(**case)):  # type: ignore[arg-type]
        pass
    assert [o.value(name) for o in built] == [want, want]


def _flag_args(case: dict[str, object]) -> list[str]:
    args = []
    for key, value in case.items():
        flag = SamplerOptions.spell(key, "cli")
        if isinstance(value, bool):
            args.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("name", FLAGGED)
def test_option_reaches_the_sampler_from_the_command_line(
    keyed: Path, name: str, built: list[SamplerOptions]
) -> None:
    case = OPTION_CASES[name]
    result = run_cli("sample", str(keyed), *_flag_args(case))
    assert result.returncode == 0, result.stderr
    assert built[-1].value(name) == SamplerOptions(**case).value(name)  # type: ignore[arg-type]


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
        assert got.value(name) == (1 if name in _PLACED_BY_ADAPTER else want.value(name))


# ------------------------------------------------------------------ store options reach the store
@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[StoreOptions]:
    """The options of every store opened while the test runs (the keyed dataset is local)."""
    seen: list[StoreOptions] = []
    init = LocalStore.__init__

    def spy(self: LocalStore, root: str, options: StoreOptions = DEFAULT_OPTIONS) -> None:
        init(self, root, options)
        seen.append(options)

    monkeypatch.setattr(LocalStore, "__init__", spy)
    return seen


def _store_cases(key: str) -> list[dict[str, object]]:
    """Sampler keywords giving store option ``key``: the whole StoreOptions, and its flat name if it has one."""
    value = STORE_CASES[key]
    return [{"store": StoreOptions(**{key: value})}] + ([{FLAT[key]: value}] if key in FLAT else [])  # type: ignore[arg-type]


def _reached(opened: list[StoreOptions], key: str) -> bool:
    want = getattr(StoreOptions(**{key: STORE_CASES[key]}), key)  # type: ignore[arg-type]
    reached = want in [getattr(o, key) for o in opened]
    opened.clear()
    return reached


@pytest.mark.parametrize("key", STORE_DECLARED)
def test_store_option_reaches_the_store_from_python(keyed: Path, key: str, opened: list[StoreOptions]) -> None:
    for case in _store_cases(key):
        with TieredSampler(keyed, **case):
            assert _reached(opened, key), case
        with TieredSampler(keyed, SamplerOptions(**case)):  # type: ignore[arg-type]
            assert _reached(opened, key), case


@pytest.mark.parametrize("key", STORE_DECLARED)
def test_store_option_reaches_the_store_from_the_torch_adapter(
    keyed: Path, key: str, opened: list[StoreOptions]
) -> None:
    from shardkit.adapters.torch import ShardIterableDataset

    for case in _store_cases(key):
        for ds in (ShardIterableDataset(keyed, **case), ShardIterableDataset(keyed, options=SamplerOptions(**case))):  # type: ignore[arg-type]
            opened.clear()
            next(iter(ds), None)
            assert _reached(opened, key), case


@pytest.mark.parametrize("key", list(FLAT))
def test_store_option_reaches_the_store_from_the_command_line(keyed: Path, key: str, opened: list[StoreOptions]) -> None:
    result = run_cli("sample", str(keyed), *_flag_args({FLAT[key]: STORE_CASES[key]}))
    assert result.returncode == 0, result.stderr
    assert _reached(opened, key)


def test_store_options_are_one_value_in_the_sampler_options() -> None:
    """A flat name sets its field of ``store``, on top of a ``store`` given with it; replace keeps the
    rest of ``store``; errors name the option as the user wrote it."""
    name = next(iter(FLAT.values()))
    key = SamplerOptions.flat_options()[name][1]
    o = SamplerOptions(store=StoreOptions(retries=3), **{name: STORE_CASES[key]})  # type: ignore[arg-type]
    assert o.store == StoreOptions(retries=3, **{key: STORE_CASES[key]})  # type: ignore[arg-type]
    assert o.replace(seed=4).store == o.store and o.replace(store=DEFAULT_OPTIONS).store == DEFAULT_OPTIONS
    assert o.replace(**{name: DEFAULT_OPTIONS.value(key)}).store == StoreOptions(retries=3)
    with pytest.raises(ConfigError, match=rf"^{name}: "):
        SamplerOptions.parse(**{name: -1})
    with pytest.raises(ConfigError, match=rf"^{SamplerOptions.spell(name, 'cli')}: "):
        SamplerOptions.parse(source="cli", **{name: -1})
    with pytest.raises(ConfigError, match=r"^store: expected a StoreOptions, found dict"):
        SamplerOptions(store={key: 1})  # type: ignore[arg-type]


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
    """Each command offers every declared option that has a flag, with the declared help (escaped for
    typer's rich markup, which would take ``[0, 2**64)`` or ``[@RATE]`` for a tag)."""
    import typer

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    helps = {p.name: p.help for p in cmd.params}
    for name, declared in options.declared().items():
        if declared.cli_flag(name) is None:
            assert name not in helps
        elif not (command == "profile" and name in ("epochs", "ssd_dir")):  # profile's own meaning
            assert helps[name] == help_text(declared.help), (command, name)
