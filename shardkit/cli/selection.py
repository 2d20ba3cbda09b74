"""The options that choose records, declared once for ``shardkit show`` and ``shardkit export``."""

from __future__ import annotations

from typing import Any

from shardkit.cli.options import flag_info
from shardkit.viz.selection import MAX_RECORDS, SELECTION_DEFAULTS

__all__ = ["selection_option", "keys_option"]

#: Each option's default, flag, metavar and help.
_SELECTION: dict[str, tuple[Any, str, str | None, str]] = {
    "keys": (None, "--keys", "KEYS", f"Records by key: 3,10-12,40 (at most {MAX_RECORDS})."),
    "random": (None, "--random", "N", "Pick N records uniformly at random, without replacement (seeded by --seed)."),
    "seed": (SELECTION_DEFAULTS.seed, "--seed", None, "Seed of --random, an integer in [0, 2**64)."),
    "label": (None, "--label", "NAME", "Only records of this class (by name), the first ones unless --random."),
    "limit": (SELECTION_DEFAULTS.limit, "--limit", "N", "Records when neither --keys nor --random is given."),
}


def selection_option(name: str) -> Any:
    """The typer option ``name`` (``keys``, ``random``, ``seed``, ``label`` or ``limit``) for a
    command's signature; a new one each call, as typer expects one per parameter."""
    default, flag, metavar, help = _SELECTION[name]
    return flag_info(default, flag, metavar=metavar, help=help)


def keys_option(text: str | None) -> list[int] | None:
    """``--keys`` parsed (``None`` when not given)."""
    from shardkit.viz import parse_keys

    return None if text is None else parse_keys(text, what="--keys")
