"""Which object-store failures are worth retrying, and how long to wait between tries (docs/design.md §9)."""

from __future__ import annotations

import random
import re

from shardkit.stores.base import StoreOptions

__all__ = ["ShortResponse", "is_transient", "backoff_seconds", "first_line"]

_STATUS = re.compile(r"status code:? (\d{3})")
_TRANSIENT_WORDS = (
    "timed out",
    "timeout",
    "connection",
    "connect error",
    "error sending request",
    "error decoding response body",
    "incomplete",
    "reset",
    "broken pipe",
    "closed",
    "eof",
    "unexpected end",
    "body",
)
_PERMANENT_TYPES = (
    "PermissionDeniedError",
    "UnauthenticatedError",
    "PreconditionError",
    "NotSupportedError",
    "InvalidPathError",
    "AlreadyExistsError",
    "UnknownConfigurationKeyError",
    "NotModifiedError",
)


class ShortResponse(Exception):
    """A response whose body is not the length asked for (retried; never passed on as data)."""


def first_line(exc: BaseException) -> str:
    """The first line of an error message (obstore appends a long debug dump)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """True for failures that another try may cure (the lists: docs/design.md §9, *Retries*)."""
    if isinstance(exc, ShortResponse | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    name = type(exc).__name__
    if name in _PERMANENT_TYPES:
        return False
    text = str(exc)
    match = _STATUS.search(text)
    if match is not None:
        status = int(match.group(1))
        return status >= 500 or status in (408, 429)
    if name in ("GenericError", "JoinError", "BaseError"):
        low = text.lower()
        return any(word in low for word in _TRANSIENT_WORDS)
    return False


def backoff_seconds(attempt: int, options: StoreOptions, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): full jitter, capped."""
    cap = min(options.backoff_max, options.backoff_initial * (2.0 ** min(attempt, 30)))
    return (rng or random).uniform(0.0, cap)
