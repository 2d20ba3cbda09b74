"""Secrets out of URLs before a URL is shown: the one redaction every message, log line and repr uses.

Shown URLs keep scheme, host, port and path; user information, query values (keys stay, to show a
URL was signed) and the fragment become ``***``. The container of ``abfs[s]://container@account``
stays: it is Azure's address syntax, not a credential.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["HIDDEN", "redact_url", "redact_urls"]

#: What a secret is replaced by.
HIDDEN = "***"

_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_CONTAINER_SCHEMES = ("abfs", "abfss")
_TRAILING = ".,:;)]}"


def _query(query: str) -> str:
    return "&".join(f"{part.split('=', 1)[0]}={HIDDEN}" if "=" in part else part for part in query.split("&"))


def redact_url(url: str) -> str:
    """``url`` with its user information, query values and fragment replaced by ``***`` (a URL that
    does not parse loses everything after its scheme)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme, sep, _ = url.partition("://")
        return f"{scheme}{sep}{HIDDEN}" if sep else HIDDEN
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        keep = parts.scheme.lower() in _CONTAINER_SCHEMES and ":" not in userinfo
        host = f"{userinfo if keep else HIDDEN}@{host}"
    query = _query(parts.query) if parts.query else ""
    return urlunsplit((parts.scheme, host, parts.path, query, HIDDEN if parts.fragment else ""))


def redact_urls(text: str) -> str:
    """``text`` (an error message, a log line, a third-party library's error) with every URL in it
    passed through :func:`redact_url`."""
    def one(match: re.Match[str]) -> str:
        url = match.group(0)
        body = url.rstrip(_TRAILING)  # "see https://h/x." or "(https://h/x):" end the URL before them
        return redact_url(body) + url[len(body):]

    return _URL_IN_TEXT.sub(one, text)
