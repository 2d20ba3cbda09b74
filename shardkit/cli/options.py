"""Command-line flags derived from declared options (``shardkit sample``, ``profile``, ``serve``,
``convert``, ``write``; docs/design.md §7): a flag, its default and its help cannot drift from the
library. :func:`flag_info` is the one place a declared flag is made (and its help escaped)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, get_type_hints

import typer

from shardkit.cli.app import help_text
from shardkit.declare import UserOptions

__all__ = ["flag_info", "flag_parameter", "option_parameters", "options_command"]


def flag_info(default: Any, *flags: str, help: str | None, **look: Any) -> Any:
    """The typer option offered as ``flags``: ``help`` is plain text (escaped here for typer's rich
    markup, where ``[@RATE]`` would vanish), ``look`` more typer.Option keywords (``metavar``,
    ``show_default``, ``rich_help_panel``). A new one each call, as typer expects one per parameter."""
    return typer.Option(default, *flags, help=help_text(help) if help else None, **look)


def flag_parameter(name: str, annotation: Any, default: Any, *flags: str, help: str | None, **look: Any) -> inspect.Parameter:
    """A keyword parameter ``name`` whose default is :func:`flag_info` (for a generated signature)."""
    info = flag_info(default, *flags, help=help, **look)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def option_parameters(
    options: type[UserOptions], only: Collection[str] | None = None, changes: Mapping[str, Mapping[str, Any]] | None = None,
    *, look: Mapping[str, Mapping[str, Any]] | None = None, panels: bool = True, unset_is_none: bool = False,
) -> list[inspect.Parameter]:
    """One keyword parameter (a typer option) per declared option of ``options`` that has a flag
    (those in ``only`` if given); ``changes[name]`` replaces a ``default`` or attributes of its Option.

    ``look[name]`` says how a flag looks beyond its declaration: ``short`` (another name such as
    ``-j``), ``metavar``, ``show_default``. ``panels``: a help section per declared group.
    ``unset_is_none``: a flag not given passes ``None`` and shows no default, so the declared default
    applies when the options are parsed (but a bool flag, or one whose look shows its default,
    passes its default)."""
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
        extra = dict((look or {}).get(name, {}))
        names = [flag, *([extra.pop("short")] if "short" in extra else [])]
        value = declared.cli_default(default)
        if unset_is_none:
            extra["show_default"] = shown = extra.get("show_default", False)
            if not (shown or declared.cli_type is bool):
                value = None
        if panels:
            extra["rich_help_panel"] = declared.group
        params.append(flag_parameter(name, declared.cli_type, value, *names, help=declared.help, **extra))
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
