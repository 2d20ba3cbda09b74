"""Options declared once: each is a dataclass field whose metadata (:class:`Option`) holds the rest of
its declaration; the command-line flags, the adapters' keywords and the documentation are derived
from it. :class:`UserOptions` is what every set of options shares (docs/design.md §7).
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

from shardkit.errors import ConfigError
from shardkit.units import parse_count

__all__ = ["Source", "Parser", "Option", "option", "shared_option", "nested", "option_name", "UserOptions"]

#: Each set's :meth:`UserOptions.flat_options` and :meth:`UserOptions.declared`, derived once per class
#: (its fields never change): every construction names every option it parses, and deriving them
#: anew each time made validating a sampler's options cost more than building the sampler.
_FLAT: dict[type, dict[str, tuple[str, str, Option]]] = {}
_DECLARED: dict[type, dict[str, Option]] = {}

#: Where options came from: decides how errors spell their names.
Source = Literal["python", "cli"]
#: ``parse(value, name) -> normalised value``; raises a ConfigError starting with ``name``.
Parser = Callable[[Any, str], Any]


def option_name(name: str, source: Source = "python") -> str:
    """``ram_size`` as the user wrote it: ``--ram-size`` on the command line, ``ram_size`` in Python."""
    return f"--{name.replace('_', '-')}" if source == "cli" else name


@dataclass(frozen=True)
class Option:
    """How one option is given, kept in its dataclass field's ``metadata`` (see :func:`option`); the
    field holds the option's type and default."""

    #: The concern the option belongs to (``"Tiers"``, ``"Order"``, ...): a section of ``--help``.
    group: str
    #: The option's grammar (:mod:`shardkit.units`) and range (see :data:`Parser`).
    parse: Parser
    #: One paragraph for ``--help`` and the docstrings; ``doc`` adds what only Python readers need.
    help: str
    doc: str = ""
    #: The command-line flag (default ``--name-with-dashes``; ``--name/--no-name`` for a flag);
    #: ``None`` keeps the option off the command line.
    flag: str | None = ""
    #: The type the command line parses the flag as (``str`` hands text to ``parse``).
    cli_type: Any = str
    #: The default as the flag shows and passes it (``512MiB``, ``60s``).
    show: Callable[[Any], Any] | None = None

    def cli_flag(self, name: str) -> str | None:
        """The flag as given on the command line (``None``: not offered there)."""
        if self.flag != "":
            return self.flag
        dashed = name.replace("_", "-")
        return f"--{dashed}/--no-{dashed}" if self.cli_type is bool else f"--{dashed}"

    def cli_default(self, default: Any) -> Any:
        """``default`` as the flag shows and passes it."""
        if self.show is not None:
            return self.show(default)
        return str(default) if self.cli_type is str and default is not None else default


def option(default: Any, group: str, parse: Parser, *, help: str, **more: Any) -> Any:
    """A dataclass field declaring one option: its default here, the rest in an :class:`Option`."""
    return field(default=default, metadata={"option": Option(group, parse, help, **more)})


def shared_option(options: type[UserOptions], name: str, *, default: Any = dataclasses.MISSING, **changes: Any) -> Any:
    """The field of option ``name`` of ``options``, for another set that has the same option
    (its default and :class:`Option` attributes replaced by ``default`` and ``changes``)."""
    f = next(f for f in dataclasses.fields(options) if f.name == name)
    declared = dataclasses.replace(f.metadata["option"], **changes)
    return field(default=f.default if default is dataclasses.MISSING else default, metadata={"option": declared})


def nested(options: type[UserOptions], group: str, *, help: str, **more: Any) -> Any:
    """A field holding a whole set of ``options`` (``store=StoreOptions(retries=3)``); its options
    that have a flag are options of the holding set too, by the flag's name (``remote_concurrency=8``)."""

    def parse(value: Any, what: str) -> Any:
        if not isinstance(value, options):
            raise ConfigError(f"{what}: expected a {options.__name__}, found {type(value).__name__}")
        return value

    declared = Option(group, parse, help, flag=None, show=lambda v: f"{type(v).__name__}()", **more)
    return field(default=options(), metadata={"option": declared, "nested": options})


class _TakesFlatNames(type):
    """Lets a set's constructor, and so :func:`dataclasses.replace`, take the options of the sets it
    holds by their flat names (see :func:`nested`): ``SamplerOptions(remote_concurrency=8)`` sets
    ``store.concurrency``, parsed and named in errors as the user wrote it."""

    def __call__(cls, *args: Any, **values: Any) -> Any:
        options: type[UserOptions] = cls  # type: ignore[assignment]
        flat = options.flat_options()
        source = values.get("source", "python")
        defaults = {f.name: f.default for f in dataclasses.fields(options)}
        for alias in [name for name in values if name in flat]:
            held, key, declared = flat[alias]
            value = declared.parse(values.pop(alias), options.spell(alias, source))
            inner = values.get(held, defaults[held])
            if isinstance(inner, UserOptions):  # else the field's own check names the wrong type
                values[held] = dataclasses.replace(inner, source=source, **{key: value})
        return super().__call__(*args, **values)


@dataclass(frozen=True)
class UserOptions(metaclass=_TakesFlatNames):
    """What every set of options a user gives by name shares: the parsing of every declared option,
    the options of the sets it holds (:func:`nested`), how errors spell names (``source``), the
    refusal of unknown names."""

    #: What one option is called in the error for an unknown name ("sampler option").
    KIND: ClassVar[str] = "option"

    #: ``"python"`` or ``"cli"``: how error messages spell option names (``ram_size`` or ``--ram-size``).
    #: Keyword-only, and not part of equality.
    source: Source = field(default="python", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.source not in ("python", "cli"):
            raise ConfigError(f"source: expected 'python' or 'cli', found {self.source!r}")
        for f in dataclasses.fields(self):
            if "option" in f.metadata:
                object.__setattr__(self, f.name, f.metadata["option"].parse(getattr(self, f.name), self.name(f.name)))

    @classmethod
    def flat_options(cls) -> dict[str, tuple[str, str, Option]]:
        """``{flat name: (field, option, Option)}`` for each option with a flag of each set this one
        holds (:func:`nested`); its flat name is its flag's (``remote_concurrency``)."""
        known = _FLAT.get(cls)
        if known is not None:
            return dict(known)
        flat = {}
        for f in dataclasses.fields(cls):
            held: type[UserOptions] | None = f.metadata.get("nested")
            for key, declared in held.declared().items() if held else ():
                flag = declared.cli_flag(key)
                if flag:
                    flat[flag.split("/")[0].removeprefix("--").replace("-", "_")] = (f.name, key, declared)
        _FLAT[cls] = flat
        return dict(flat)

    @classmethod
    def declared(cls) -> dict[str, Option]:
        """Every option of the set, in declaration order, with its :class:`Option`; a held set's
        options by their flat names follow its field."""
        known = _DECLARED.get(cls)
        if known is not None:
            return dict(known)
        flat = cls.flat_options()
        declared = {}
        for f in dataclasses.fields(cls):
            if "option" in f.metadata:
                declared[f.name] = f.metadata["option"]
            declared.update({name: opt for name, (held, _, opt) in flat.items() if held == f.name})
        _DECLARED[cls] = declared
        return dict(declared)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every declared option's default."""
        own, flat = {f.name: f.default for f in dataclasses.fields(cls)}, cls.flat_options()
        return {k: getattr(own[flat[k][0]], flat[k][1]) if k in flat else own[k] for k in cls.declared()}

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options of the set (every field but ``source``, and the flat names)."""
        return frozenset(cls.declared())

    @classmethod
    def spell(cls, option: str, source: Source) -> str:
        """``option`` as a user of ``source`` writes it: its declared flag on the command line."""
        flag = cls.declared()[option].cli_flag(option) if option in cls.declared() and source == "cli" else None
        return flag.split("/")[0] if flag else option_name(option, source)

    @classmethod
    def parse(cls, *, source: Source = "python", **values: Any) -> Self:
        """Options from user-given values (any accepted spelling); unknown names are a ConfigError."""
        cls.check_names(values, source)
        return cls(source=source, **values)

    @classmethod
    def check_names(cls, values: Mapping[str, Any], source: Source) -> None:
        """Refuse the names in ``values`` that are not options of the set, spelled as the user wrote
        them, with the nearest options' names."""
        known = cls.option_names()
        unknown = sorted(set(values) - known)
        if unknown:
            names = ", ".join(cls.spell(u, source) for u in unknown)
            near = sorted({m for u in unknown for m in difflib.get_close_matches(u, known, n=3)})
            hint = f" (did you mean {', '.join(cls.spell(m, source) for m in near)}?)" if near else ""
            raise ConfigError(f"unknown {cls.KIND} {names}; expected some of {', '.join(sorted(known))}{hint}")

    @classmethod
    def describe(cls, indent: str = "    ") -> str:
        """Every option with its default and help, as a numpydoc section for docstrings."""
        defaults = cls.defaults()
        lines = [f"{cls.__name__} options", "-" * (len(cls.__name__) + 8)]
        for key, declared in cls.declared().items():
            lines.append(f"{key} ({declared.group}; default {declared.cli_default(defaults[key])})")
            lines += textwrap.wrap(f"{declared.help} {declared.doc}".strip(), 96, initial_indent="    ",
                                   subsequent_indent="    ")  # fmt: skip
        return "\n\n" + "\n".join(indent + line for line in lines) + "\n"

    def name(self, option: str) -> str:
        """``option`` as the user wrote it."""
        return self.spell(option, self.source)

    def value(self, option: str) -> Any:
        """The value of ``option``; a held set's option by its flat name (``remote_concurrency``)."""
        flat = self.flat_options().get(option)
        return getattr(getattr(self, flat[0]), flat[1]) if flat else getattr(self, option)


def choice(*allowed: str) -> Parser:
    """One of ``allowed`` (exact text). Here, not with the converters' parsers, so that reading options
    (:mod:`shardkit.readers.options`) do not import the conversion engine."""

    def parse(value: Any, label: str) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise ConfigError(f"{label}: expected one of {', '.join(allowed)}, found {value!r}")
        return value

    return parse


def count(minimum: int = 1, maximum: int | None = None) -> Parser:
    """A whole number in ``[minimum, maximum]`` (``10``, ``"10"``, ``"10k"``)."""

    def parse(value: Any, label: str) -> int:
        n = parse_count(value, what=label, minimum=minimum)
        if maximum is not None and n > maximum:
            raise ConfigError(f"{label}: expected at most {maximum}, found {value!r}")
        return n

    return parse
