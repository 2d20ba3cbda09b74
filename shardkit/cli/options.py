"""Command-line flags derived from an options set's declaration (``shardkit sample``, ``profile``,
``serve``; docs/design.md §7): a flag, its default and its help cannot drift from the library."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, get_type_hints

import typer

from shardkit.cli.app import help_text
from shardkit.declare import UserOptions

__all__ = ["option_parameters", "options_command"]


def option_parameters(
    options: type[UserOptions], only: Collection[str] | None = None, changes: Mapping[str, Mapping[str, Any]] | None = None
) -> list[inspect.Parameter]:
    """One keyword parameter (a typer option) per declared option of ``options`` that has a flag
    (those in ``only`` if given); ``changes[name]`` replaces a ``default`` or attributes of its Option."""
    defaults = options.defaults()
    params = []
    for name, declared in options.declared().items():
        if only is not None and name not in only:
            continue
        change = dict((changes or {}).get(name, {}))
        default = change.pop("default", defaults[name])
        declared = dataclasses.replace(declared, **change)
        flag = declared.cli_flag(name)
        if flag is None:
            continue
        info = typer.Option(declared.cli_default(default), flag, help=help_text(declared.help) if declared.help else None,
                            rich_help_panel=declared.group)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                        annotation=declared.cli_type))  # fmt: skip
    return params


def options_command(
    options: type[UserOptions], *, only: Collection[str] | None = None,
    changes: Mapping[str, Mapping[str, Any]] | None = None,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command ``fn(..., options)``: its parameters but ``options``, then a flag per option
    of ``options`` (see :func:`option_parameters`); it is called with the options parsed from them
    (spelled as flags in errors). Decorate before registering with ``app.command()``."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        hints = get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(fn).parameters.values() if p.name != "options"]  # fmt: skip
        declared = option_parameters(options, only, changes)
        names = [p.name for p in declared]

        def command(**values: Any) -> None:
            given = {name: values.pop(name) for name in names}
            fn(**values, options=options.parse(source="cli", **given))

        params = own + declared
        command.__name__, command.__doc__, command.__module__ = fn.__name__, fn.__doc__, fn.__module__
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap
