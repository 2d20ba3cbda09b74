"""Where a dataset lives: a local path or a URL, opened as a :class:`~shardkit.stores.base.Store`.

Credentials come from each cloud's standard environment, never from a URL, and are never shown
(docs/design.md §9, §13).
"""

from __future__ import annotations

import configparser
import os
import re
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from shardkit.errors import ConfigError
from shardkit.processes import renew_locks_after_fork
from shardkit.redact import redact_url
from shardkit.stores.base import DEFAULT_OPTIONS, Store, StoreOptions, check_key
from shardkit.stores.local import LocalStore
from shardkit.stores.objectstore import ObjectStore, import_obstore

__all__ = ["Location", "open_store", "is_url", "as_location", "location_string", "s3_settings", "SCHEMES"]

#: Anything that names a dataset: a local path, a URL, or an opened store.
Location = str | os.PathLike[str] | Store

#: URL schemes understood, besides ``file``.
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_S3_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
)

_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_stores_lock")


def is_url(location: object) -> bool:
    """True for ``scheme://...`` strings (``file://`` included)."""
    return isinstance(location, str) and bool(_URL.match(location))


def location_string(location: Location) -> str:
    """The location as the user would write it (a path or a URL), for messages: secrets redacted."""
    if isinstance(location, Store):
        return location.url
    return redact_url(str(location)) if is_url(location) else os.fspath(location)


def as_location(location: Location, *, resolve: bool = False) -> Path | str:
    """A local ``Path`` (resolved with ``resolve``) or an object-store URL string: what samplers keep and pickle."""
    if isinstance(location, Store):
        return location.local_path() if location.is_local else location.location
    if is_url(location):
        url = str(location)
        parts = urlsplit(url)
        if parts.scheme.lower() != "file":
            return url
        location = unquote(parts.path)
    path = Path(location)
    return path.resolve() if resolve else path


def open_store(location: Location, options: StoreOptions | None = None) -> Store:
    """The store for ``location``; a Store passes through unchanged.

    Accepted locations:

    ==========================================  ====================================================
    ``/data/ds``, ``ds``, ``file:///data/ds``    a local directory (:class:`LocalStore`)
    ``s3://bucket/prefix``                       S3 or any S3-compatible store (SeaweedFS, MinIO, R2, ...)
    ``gs://bucket/prefix``                       Google Cloud Storage
    ``az://container/prefix``                    Azure Blob Storage (also ``azure://``, ``abfs[s]://...``)
    ``http://host/path``, ``https://...``         any HTTP server with range requests, read-only
    ==========================================  ====================================================

    Credentials and endpoints come from each cloud's standard environment, read by obstore (the
    docs/object-storage.md lists the variables), plus the AWS profile files (:func:`s3_settings`);
    HTTP(S) is anonymous.

    A URL with credentials (``s3://KEY:SECRET@bucket``) is refused without repeating them; shown URLs
    are redacted (:mod:`shardkit.redact`). One store is kept per location, options and environment in
    each process, so every reader of a dataset shares one connection pool.

    Raises
    ------
    ConfigError
        An unknown URL scheme, a URL without a bucket/container, or credentials in a bucket URL.
    MissingExtraError
        An object-store URL without the ``remote`` extra (obstore) installed.
    """
    if isinstance(location, Store):
        return location
    opts = options or DEFAULT_OPTIONS
    url = as_location(location)
    if isinstance(url, Path):  # a local path or file:// URL
        return LocalStore(url, opts)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{redact_url(url)}: unknown URL scheme {scheme!r}; expected a local path or one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    env_key = tuple(os.environ.get(k) for k in _S3_ENV) if scheme in ("s3", "s3a") else ()
    key = (os.getpid(), url.rstrip("/"), opts, env_key)
    with _stores_lock:
        if key not in _stores:
            _stores[key] = _open_object_store(url, scheme, parts.netloc, parts.path, opts)
        return _stores[key]


def _client_options(opts: StoreOptions, allow_http: bool) -> dict[str, Any]:
    return {
        "allow_http": allow_http,
        "timeout": timedelta(seconds=opts.timeout),
        "connect_timeout": timedelta(seconds=opts.connect_timeout),
    }


#: obstore's own retries are off: shardkit retries (see shardkit.stores.retry).
_NO_RETRY: dict[str, Any] = {"max_retries": 0}


def _open_object_store(url: str, scheme: str, netloc: str, path: str, opts: StoreOptions) -> ObjectStore:
    import_obstore()  # MissingExtraError with the install hint when obstore is absent
    from obstore import store as obstores

    if scheme in ("http", "https"):
        inner = obstores.HTTPStore.from_url(url, client_options=_client_options(opts, scheme == "http"),
                                            retry_config=_NO_RETRY)
        return ObjectStore(url, inner, opts, read_only=True)
    shown = redact_url(url)
    if not netloc:
        raise ConfigError(f"{shown}: expected {scheme}://BUCKET/PREFIX, found no bucket or container name")
    userinfo = netloc.rpartition("@")[0] if "@" in netloc else None
    if userinfo is not None and (scheme not in ("abfs", "abfss") or ":" in userinfo):
        raise ConfigError(
            f"{shown}: credentials in the URL are not accepted (and were not used); give the bare "
            f"{scheme}://BUCKET/PREFIX and the credentials through the environment (see docs/object-storage.md)"
        )
    prefix = unquote(path).strip("/")
    if prefix:
        check_key(prefix, what="prefix", where=shown)

    common: dict[str, Any] = dict(prefix=prefix or None, client_options=_client_options(opts, False),
                                  retry_config=_NO_RETRY)
    if scheme in ("s3", "s3a"):
        settings = s3_settings(os.environ)
        common["client_options"] = _client_options(opts, settings.get("endpoint", "").startswith("http://"))
        inner = obstores.S3Store(netloc, config=settings, **common)
    elif scheme in ("gs", "gcs"):
        inner = obstores.GCSStore(netloc, **common)
    elif scheme in ("az", "azure"):
        inner = obstores.AzureStore(netloc, **common)
    else:  # abfs[s]://container@account.dfs.core.windows.net/prefix
        inner = obstores.AzureStore.from_url(f"{scheme}://{netloc}", **common)
    return ObjectStore(f"{scheme}://{netloc}/{prefix}".rstrip("/"), inner, opts)


def s3_settings(env: Any) -> dict[str, str]:
    """obstore S3 configuration from the AWS environment variables and profile files.

    ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``; else ``us-east-1``), ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` (an ``http://`` endpoint allows plain HTTP for that store only); keys are
    obstore's own ``AWS_*`` reading, or, when ``AWS_ACCESS_KEY_ID`` is not set, the profile
    ``AWS_PROFILE`` of ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
    ``AWS_CONFIG_FILE``).
    """
    settings: dict[str, str] = {}
    profile = _aws_profile(env) if not env.get("AWS_ACCESS_KEY_ID") else {}
    for ours, theirs in (("access_key_id", "aws_access_key_id"), ("secret_access_key", "aws_secret_access_key"),
                         ("session_token", "aws_session_token")):
        if profile.get(theirs):
            settings[ours] = profile[theirs]
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        settings["endpoint"] = endpoint
    settings["region"] = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region") or "us-east-1"
    return settings


def _aws_profile(env: Any) -> dict[str, str]:
    """The ``AWS_PROFILE`` section of the shared credentials and config files (missing files: empty)."""
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME") or Path.home())
    creds_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    config_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")
    out: dict[str, str] = {}
    for file, section in ((config_file, name if name == "default" else f"profile {name}"), (creds_file, name)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(file, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: cannot read the AWS profile {name!r} ({exc})") from None
        if parser.has_section(section):
            out.update({k.lower(): v.strip() for k, v in parser.items(section)})
    if env.get("AWS_PROFILE") and not out:
        raise ConfigError(f"AWS_PROFILE={name!r}: no such profile in {creds_file} or {config_file}")
    return out
