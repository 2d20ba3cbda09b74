"""Converter options as data: each kind declares its :class:`Option` schema once.

:class:`~shardkit.converters.base.Converter` parses keyword arguments with it and ``shardkit convert``
builds its flags, help and defaults from it (:mod:`shardkit.cli.convert`). The parsers accept what a
person types (``"16k"``, ``"2.5s"``, via :mod:`shardkit.units`) and name the option as the user wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardkit.declare import Source, choice, count, option_name  # choice, count: re-exported
from shardkit.errors import ConfigError
from shardkit.units import parse_duration, parse_rate

__all__ = [
    "Option",
    "OptionNaming",
    "Parser",
    "parse_options",
    "choice",
    "flag",
    "count",
    "rate",
    "duration",
    "path_text",
    "text",
]

#: How errors name an option: as a Python keyword or as a command-line flag.
OptionNaming = Source
#: ``parser(value, label) -> canonical value``; raises ``ConfigError`` starting with ``label``.
Parser = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Option:
    """One option of a corpus kind: its Python keyword (the flag ``--sample-rate`` derives from it), its
    type (``bool`` makes an on/off flag), its default (``None``: the kind decides, and ``help`` says
    how), one line of help, the parser of a given value (``None`` keeps it) and ``--help``'s metavar."""

    name: str
    type: type
    default: Any
    help: str
    parse: Parser | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        """The command-line flag: ``--sample-rate``."""
        return option_name(self.name, "cli")

    def value(self, given: Any, naming: OptionNaming) -> Any:
        """The canonical value of ``given`` (the default when ``None``)."""
        if given is None:
            return self.default
        return given if self.parse is None else self.parse(given, option_name(self.name, naming))


def parse_options(
    kind: str, schema: Iterable[Option], given: Mapping[str, Any], naming: OptionNaming = "python"
) -> dict[str, Any]:
    """Every option of ``schema`` parsed from ``given`` (``None`` values count as not given); ConfigError
    for an option the kind does not accept (naming the ones it does) or a value its parser refuses."""
    options = {o.name: o for o in schema}
    unknown = sorted(set(given) - set(options))
    if unknown:
        shown, accepted = [option_name(n, naming) for n in unknown], [option_name(n, naming) for n in options]
        raise ConfigError(
            f"kind {kind!r} does not accept option(s) {', '.join(shown)}; "
            f"expected some of: {', '.join(sorted(accepted)) or 'none'}"
        )
    return {name: o.value(given.get(name), naming) for name, o in options.items()}


# ---------------------------------------------------------------------- parsers
def flag(value: Any, label: str) -> bool:
    """``True`` or ``False`` (no truthy strings: ``"no"`` would be true)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{label}: expected True or False, found {value!r}")
    return value


def rate(minimum: int, maximum: int) -> Parser:
    """A rate in hertz in ``[minimum, maximum]`` (``16000``, ``"16k"``, ``"44.1kHz"``)."""

    def parse(value: Any, label: str) -> int:
        hz = parse_rate(value, what=label)
        if not minimum <= hz <= maximum:
            raise ConfigError(f"{label}: expected a rate from {minimum} to {maximum} Hz, found {value!r}")
        return hz

    return parse


def duration(value: Any, label: str) -> float:
    """A positive number of seconds (``1``, ``"2.5s"``, ``"500ms"``)."""
    return parse_duration(value, what=label, allow_zero=False)


def text(value: Any, label: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{label}: expected a non-empty text, found {value!r}")
    return value


def path_text(value: Any, label: str) -> str:
    """A path (``str`` or ``os.PathLike``), kept as text."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return text(value, label)
