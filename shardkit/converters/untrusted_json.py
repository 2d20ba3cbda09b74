"""Parsing JSON written by someone else (annotation files) without letting its nesting crash us.

``json.loads`` recurses per nesting level, so a value nested ten thousand levels deep cannot be parsed
(and would endanger every recursive walk of the result). :func:`loads` parses normally and only when
that fails replaces every value nested deeper than :data:`MAX_DEPTH` by :data:`TOO_DEEP` and parses
again, so the entries holding one can be skipped with a reason (:func:`holds_too_deep`).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_DEPTH", "TOO_DEEP", "loads", "holds_too_deep"]

#: Values nested deeper than this are replaced when the file cannot be parsed as it is.
MAX_DEPTH = 32
#: What replaces a value nested deeper than :data:`MAX_DEPTH`.
TOO_DEEP = "\x00shardkit: value nested too deeply"
# A JSON string (escapes included) or a bracket; everything else is irrelevant to the depth.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def loads(raw: bytes) -> tuple[Any, bool]:
    """Parse ``raw``; returns ``(document, truncated)`` where ``truncated`` says :data:`TOO_DEEP`
    replaced something. JSONDecodeError when it is not JSON, RecursionError when brackets never close."""
    try:
        return json.loads(raw), False
    except RecursionError:
        pass
    return json.loads(_cut_deep(raw)), True


def _cut_deep(raw: bytes) -> bytes:
    """``raw`` with every value opened at depth ``MAX_DEPTH + 1`` replaced by :data:`TOO_DEEP`."""
    marker = json.dumps(TOO_DEEP).encode()
    out: list[bytes] = []
    depth = 0
    pos = 0
    cut_from: int | None = None
    for m in _TOKENS.finditer(raw):
        token = m.group()
        if token[:1] == b'"':
            continue
        if token in (b"[", b"{"):
            depth += 1
            if depth == MAX_DEPTH + 1:
                cut_from = m.start()
        else:
            if depth == MAX_DEPTH + 1 and cut_from is not None:
                out += [raw[pos:cut_from], marker]
                pos, cut_from = m.end(), None
            depth -= 1
    out.append(raw[pos:])
    return b"".join(out)


def holds_too_deep(value: Any) -> bool:
    """Whether ``value`` (from :func:`loads`) holds a :data:`TOO_DEEP` replacement anywhere.

    Iterative, so it is safe whatever the depth.
    """
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if v == TOO_DEEP:
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False
