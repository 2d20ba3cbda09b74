"""Importing an optional dependency (a framework, obstore), or saying which pip extra provides it."""

from __future__ import annotations

import importlib
from types import ModuleType

from shardkit.errors import MissingExtraError

__all__ = ["import_extra", "pip_install"]


def pip_install(extra: str) -> str:
    """The command that installs a shardkit extra: ``pip install "shardkit[EXTRA]"``."""
    return f'pip install "shardkit[{extra}]"'


def import_extra(module: str, extra: str, *, needed_by: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra to install.

    Parameters
    ----------
    module
        Top-level module of the framework (``"torch"``, ``"tensorflow"``).
    extra
        The shardkit extra that installs it (``"torch"``, ``"tensorflow"``).
    needed_by
        The shardkit module that needs it, so the message says why the import happened.

    Notes
    -----
    The frameworks are optional because they are large (hundreds of MB to GB) and slow to import;
    a plain ``ImportError`` from deep inside an adapter would not tell the user that one ``pip``
    command fixes it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{needed_by} needs the optional dependency {module!r}, which could not be imported "
            f"({exc}); install it with: {pip_install(extra)}"
        ) from exc
