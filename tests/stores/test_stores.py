"""The Store interface, the same tests for a local directory and for a real S3-compatible server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from shardkit.errors import (
    ConfigError,
    MissingExtraError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StorePermissionError,
    UnsafePathError,
)
from shardkit.stores import ByteRange, LocalStore, Store, StoreOptions, as_location, check_key, open_store
from shardkit.stores.url import s3_settings


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "root")
    s3 = request.getfixturevalue("s3")
    return open_store(s3.url("store"))


def test_put_get_head_list_delete(store: Store, tmp_path: Path) -> None:
    meta = store.put("a/b.bin", b"hello world")
    assert meta.size == 11
    assert store.get("a/b.bin") == b"hello world"
    assert store.head("a/b.bin").size == 11
    assert bytes(store.get_range("a/b.bin", 6, 11)) == b"world"
    assert [bytes(x) for x in store.get_ranges("a/b.bin", [0, 6], [5, 11])] == [b"hello", b"world"]
    store.put("a/c.bin", b"x")
    store.put("ab/d.bin", b"y")
    assert sorted(m.key for m in store.list("a")) == ["a/b.bin", "a/c.bin"]  # whole segments only
    assert sorted(m.key for m in store.list()) == ["a/b.bin", "a/c.bin", "ab/d.bin"]
    store.copy("a/b.bin", "z/copy.bin")
    store.rename("a/c.bin", "z/moved.bin")
    assert store.get("z/copy.bin") == b"hello world" and store.get("z/moved.bin") == b"x"
    assert not store.exists("a/c.bin")
    store.delete("z/copy.bin")
    store.delete("z/copy.bin")  # deleting what is gone is fine
    assert not store.exists("z/copy.bin")
    with pytest.raises(ObjectNotFoundError) as err:
        store.get("nope.bin")
    assert isinstance(err.value, FileNotFoundError) and "nope.bin" in str(err.value)


def test_a_key_below_a_file_is_not_found_by_any_local_read(tmp_path: Path) -> None:
    """``a/b.bin/x`` where ``a/b.bin`` is a file: every read says "no such file" (ObjectNotFoundError),
    the ranged read too, never a bare NotADirectoryError."""
    store = LocalStore(tmp_path / "root")
    store.put("a/b.bin", b"hello")
    for read in (lambda: store.get("a/b.bin/x"), lambda: store.head("a/b.bin/x"),
                 lambda: store.get_range("a/b.bin/x", 0, 1)):
        with pytest.raises(ObjectNotFoundError, match=r"a/b\.bin/x: no such file"):
            read()


def test_get_refuses_large_objects_before_reading(store: Store) -> None:
    store.put("big", b"0" * 1000)
    with pytest.raises(ObjectTooLargeError, match="1000 bytes, more than the 999"):
        store.get("big", max_nbytes=999)
    assert len(store.get("big", max_nbytes=1000)) == 1000


def test_fetch_many_ranges_exact_lengths(store: Store) -> None:
    data = os.urandom(300_000)
    store.put("obj", data)
    ranges = [ByteRange("obj", a, a + 1000 + a % 7) for a in range(0, 290_000, 9_973)]
    got = {f.index: bytes(f.data) for f in store.fetch(ranges)}
    assert sorted(got) == list(range(len(ranges)))
    for i, r in enumerate(ranges):
        assert got[i] == data[r.start : r.end]
    # A range past the end of the object is never passed on short.
    with pytest.raises(Exception) as err:
        list(store.fetch([ByteRange("obj", 299_000, 301_000)]))
    assert "obj" in str(err.value)


def test_put_file_and_metadata(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(50_000))
    store.put_file("f/src.bin", src, metadata={"shardkit-crc32c": "42"})
    assert store.get("f/src.bin") == src.read_bytes()
    meta = store.head("f/src.bin")
    assert meta.size == 50_000
    if not store.is_local:
        assert meta.metadata["shardkit-crc32c"] == "42" and meta.etag


def test_multipart_upload(s3: Any, tmp_path: Path) -> None:
    """A file above the threshold goes up in parts (S3's ETag says how many) and reads back whole."""
    store = open_store(s3.url("mp"), StoreOptions(part_bytes=5 << 20, multipart_threshold=6 << 20))
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 << 20))
    store.put_file("big.bin", src)
    meta = store.head("big.bin")
    assert meta.size == 12 << 20
    assert meta.etag is not None and meta.etag.strip('"').endswith("-3")
    assert store.get("big.bin") == src.read_bytes()


def test_pinned_etag_refuses_a_changed_object(s3: Any) -> None:
    store = open_store(s3.url("etag"))
    store.put("o", b"version one")
    etag = store.head("o").etag
    assert bytes(store.get_range("o", 0, 7, etag=etag)) == b"version"
    store.put("o", b"version two")
    with pytest.raises(ObjectChangedError, match="changed"):
        store.get_range("o", 0, 7, etag=etag)


@pytest.mark.parametrize("key", ["../x", "a/../b", "/abs", "a//b", "a/./b", "a\\b", "nul\x00", "", "."])
def test_keys_stay_inside(store: Store, key: str) -> None:
    with pytest.raises(UnsafePathError):
        store.get(key)
    with pytest.raises(UnsafePathError):
        check_key(key)


def test_local_symlink_out_of_root_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"s")
    (root / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafePathError, match="outside"):
        LocalStore(root).get("link")


def test_http_store_is_read_only(s3: Any) -> None:
    """An http(s):// URL reads anonymously (the test server allows anonymous reads) and refuses writes."""
    url = s3.url("http")
    open_store(url).put("doc.txt", b"public bytes")
    http = open_store(f"{s3.endpoint}/{url[len('s3://'):]}")
    assert not http.is_local and http.read_only
    assert http.get("doc.txt") == b"public bytes"
    assert bytes(http.get_range("doc.txt", 7, 12)) == b"bytes"
    with pytest.raises(StorePermissionError, match="read-only"):
        http.put("doc.txt", b"x")


def test_wrong_credentials_name_the_object(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    store = open_store(s3.url("denied"))
    with pytest.raises(StorePermissionError, match=r"denied/x.*access denied"):
        store.get("x")


def test_locations() -> None:
    assert as_location("s3://b/p") == "s3://b/p"
    assert as_location("file:///tmp/x") == Path("/tmp/x")
    assert as_location(Path("rel")) == Path("rel")
    assert isinstance(open_store("file:///tmp/x"), LocalStore)
    with pytest.raises(ConfigError, match="unknown URL scheme 'ftp'"):
        open_store("ftp://host/x")
    with pytest.raises(ConfigError, match="no bucket"):
        open_store("s3:///prefix")


def test_missing_extra_names_remote(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "obstore", None)  # what an environment without obstore looks like
    with pytest.raises(MissingExtraError, match=r"shardkit\[remote\]"):
        open_store("s3://bucket/never-opened-before")


def test_s3_settings_from_environment_and_profile(tmp_path: Path) -> None:
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-3", "AWS_ACCESS_KEY_ID": "k"}
    assert s3_settings(env) == {"endpoint": "http://127.0.0.1:9", "region": "eu-west-3"}
    env = {"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://b", "AWS_ACCESS_KEY_ID": "k"}
    assert s3_settings(env)["endpoint"] == "http://b"  # the service-specific variable wins
    assert s3_settings({"AWS_ACCESS_KEY_ID": "k", "HOME": str(tmp_path)})["region"] == "us-east-1"
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = D\n[work]\naws_access_key_id = W\naws_secret_access_key = S\n")
    config = tmp_path / "config"
    config.write_text("[profile work]\nregion = ap-south-1\nendpoint_url = https://s3.example.test\n")
    env = {"AWS_PROFILE": "work", "AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(config)}
    assert s3_settings(env) == {
        "access_key_id": "W", "secret_access_key": "S", "endpoint": "https://s3.example.test", "region": "ap-south-1",
    }
    with pytest.raises(ConfigError, match="AWS_PROFILE='missing'"):
        s3_settings({**env, "AWS_PROFILE": "missing"})


def test_store_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="concurrency"):
        StoreOptions(concurrency=0)
    with pytest.raises(ConfigError, match="part_bytes"):
        StoreOptions(part_bytes=1 << 20)
    # Declared options: parsed with shardkit.units, errors named as the user wrote them.
    assert StoreOptions(timeout="5s", part_bytes="8MiB", retries="3") == StoreOptions(timeout=5.0, part_bytes=8 << 20,
                                                                                   retries=3)
    with pytest.raises(ConfigError, match=r"^--remote-timeout: expected a positive duration"):
        StoreOptions.parse(source="cli", timeout=0)
    with pytest.raises(ConfigError, match=r"^unknown store option concurency; .*\(did you mean concurrency\?\)"):
        StoreOptions.parse(concurency=3)
