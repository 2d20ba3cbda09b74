"""Credentials in URLs never reach a message, a log line, a repr or the CLI's output.

The HTTP tests point at a port nothing listens on (connection refused: transient, retried, then
the final error), so no server is needed and no byte leaves the machine.
"""

from __future__ import annotations

import logging
import pickle
import socket

import pytest

from shardkit.cli.app import RedactingFilter
from shardkit.errors import ConfigError, StoreError
from shardkit.redact import redact_url, redact_urls
from shardkit.stores import StoreOptions, location_string, open_store
from tests.helpers.cli import run_cli

SECRETS = ("password", "s3cr3t", "SIGNATURE", "CREDENTIAL", "TOKEN", "SECRET")


def _closed_port() -> int:
    """A local port with no listener (bound, then released: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_clean(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in {text!r}"


@pytest.mark.parametrize(("url", "shown"), [
    ("https://user:password@host/ds", "https://***@host/ds"),
    ("https://s3cr3t@host:8443/ds", "https://***@host:8443/ds"),
    ("https://b.s3.amazonaws.com/ds?X-Amz-Algorithm=AWS4&X-Amz-Credential=CREDENTIAL&X-Amz-Signature=SIGNATURE"
     "&X-Amz-Security-Token=TOKEN", "https://b.s3.amazonaws.com/ds?X-Amz-Algorithm=***&X-Amz-Credential=***"
     "&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("https://acct.blob.core.windows.net/c/ds?sv=2022&se=2030&sig=SIGNATURE#TOKEN",
     "https://acct.blob.core.windows.net/c/ds?sv=***&se=***&sig=***#***"),
    ("s3://KEY:SECRET@bucket/ds", "s3://***@bucket/ds"),
    ("abfss://container@acct.dfs.core.windows.net/ds", "abfss://container@acct.dfs.core.windows.net/ds"),
    ("abfss://container:SECRET@acct.dfs.core.windows.net/ds", "abfss://***@acct.dfs.core.windows.net/ds"),
    ("s3://bucket/plain/prefix", "s3://bucket/plain/prefix"),
    ("https://[::1:s3cr3t@host/ds", "https://***"),  # does not parse: nothing after the scheme is kept
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_urls(f"cannot open {url}: refused") == f"cannot open {shown}: refused"


@pytest.mark.parametrize("url", ["s3://KEY:SECRET@bucket/ds", "s3a://KEY:SECRET@bucket/ds", "gs://KEY:SECRET@bucket/ds",
                                 "az://SECRET@container/ds", "abfss://c:SECRET@acct.dfs.core.windows.net/ds"])
def test_credentials_in_a_bucket_url_are_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError, match=r"credentials in the URL are not accepted") as info:
        open_store(url)
    assert "KEY" not in str(info.value)
    _assert_clean(str(info.value))


def test_http_errors_repr_and_pickling(caplog: pytest.LogCaptureFixture) -> None:
    url = (f"http://user:password@127.0.0.1:{_closed_port()}/ds?X-Amz-Credential=CREDENTIAL"
           "&X-Amz-Signature=SIGNATURE")
    store = open_store(url, StoreOptions(retries=2, retry_seconds=60, backoff_initial=0.01, backoff_max=0.02))
    _assert_clean(repr(store))
    _assert_clean(store.describe("zarr.json"))
    assert location_string(url) == store.url and location_string(store) == store.url
    with caplog.at_level(logging.INFO, logger="shardkit"), pytest.raises(StoreError) as info:
        store.head("zarr.json")
    message = str(info.value)
    _assert_clean(message)  # ours and obstore's own text, which repeats the URL
    # the key goes before the query, where the request puts it too
    assert message.startswith(f"http://***@127.0.0.1:{url.split(':')[3].split('/')[0]}/ds/zarr.json?X-Amz-Credential=***")
    assert "failed after 3 attempts in" in message and "2 retries" not in message
    assert [r for r in caplog.records if "transient failure" in r.getMessage()]
    for record in caplog.records:
        _assert_clean(record.getMessage())
    again = pickle.loads(pickle.dumps(store))  # a worker reopens the real location
    assert again.location == url and again.url == store.url


def test_retry_message_states_what_happened() -> None:
    """The time budget ends the retries long before 30 of them: the message counts the attempts made."""
    store = open_store(f"http://127.0.0.1:{_closed_port()}/ds",
                       StoreOptions(retries=30, retry_seconds=0.05, backoff_initial=0.01, backoff_max=0.02))
    with pytest.raises(StoreError) as info:
        store.get("x")
    attempts = store.counters.requests  # type: ignore[attr-defined]
    assert attempts < 31
    assert f"failed after {attempts} attempt" in str(info.value) and "30 retries" not in str(info.value)


def test_cli_output_and_log_lines_are_redacted() -> None:
    r = run_cli("info", "s3://KEY:SECRET@bucket/ds")
    assert r.returncode == 1 and "s3://***@bucket/ds" in r.stderr and "Traceback" not in r.stderr
    assert "KEY" not in r.stderr
    _assert_clean(r.stderr + r.stdout)
    r = run_cli("info", "ftp://user:password@host/ds?token=TOKEN")
    assert r.returncode == 1 and "ftp://***@host/ds?token=***" in r.stderr
    _assert_clean(r.stderr + r.stdout)
    record = logging.LogRecord("obstore", logging.WARNING, __file__, 1, "GET %s failed", ("https://u:s3cr3t@h/x",), None)
    assert RedactingFilter().filter(record) and record.getMessage() == "GET https://***@h/x failed"
