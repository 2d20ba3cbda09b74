"""``shardkit convert s3://bucket/shards-{000000..000001}.tar`` (issue 35, item 2): WebDataset shards read
from an object store (SeaweedFS) give the records of the same shards converted locally; a shard replaced
during the conversion is refused, a truncated one is an error naming its URL; credentials never shown."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.converters.webdataset import WebDatasetConverter
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset, verify
from shardkit.stores import open_store
from tests.helpers.cli import run_cli
from tests.helpers.seaweed import SECRET_KEY
from tests.helpers.tars import H, W, write_shards

pytest.importorskip("webdataset")
OPTIONS = {"size": f"{H}x{W}", "workers": 1}


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("wds-remote") / "shards"
    return root, write_shards(root)


def _upload(s3: Any, root: Path) -> str:
    """Every ``.tar`` of ``root`` under a fresh prefix; returns the prefix URL."""
    url = s3.url("shards")
    store = open_store(url)
    for p in sorted(root.glob("*.tar")):
        store.put_file(p.name, p)
    return url


def _records(path: Path | str) -> list[dict[str, Any]]:
    with open_dataset(path) as ds:
        return [{k: np.asarray(v) for k, v in ds[i].items()} for i in range(len(ds))]


def test_remote_shards_convert_to_the_records_of_the_local_conversion(s3: Any, local_shards: Any,
                                                                      tmp_path: Path) -> None:
    root, samples = local_shards
    url = _upload(s3, root)
    shardkit.convert(root, tmp_path / "local", **OPTIONS)
    want = _records(tmp_path / "local")
    for i, src in enumerate((f"{url}/shards-{{000000..000001}}.tar", f"{url}/", url)):
        out = tmp_path / f"remote{i}"
        summary = shardkit.convert(src, out, **OPTIONS)
        assert summary.kind == "webdataset" and summary.records == len(samples) and summary.num_skipped == 0
        got = _records(out)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        with open_dataset(out) as ds:
            assert ds.meta.source["path"].startswith(url.rstrip("/"))  # provenance names the URL
            for k, s in enumerate(samples):
                src_k = ds.source(k)
                assert src_k is not None and src_k.name == f"{s['shard']}#{s['__key__']}"
        assert verify(out).ok
    # -j 1: worker processes come from a forkserver that may predate this test's AWS variables
    r = run_cli("convert", f"{url}/shards-{{000000..000001}}.tar", "-o", str(tmp_path / "cli"), "--size", f"{H}x{W}",
                "-q", "-j", "1", env=s3.env())
    assert r.returncode == 0, r.stderr
    assert SECRET_KEY not in r.stdout + r.stderr
    assert len(_records(tmp_path / "cli")) == len(samples)


def test_a_shard_replaced_during_the_conversion_is_refused(s3: Any, local_shards: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = local_shards
    url = _upload(s3, root)
    other = (root / "shards-000000.tar").read_bytes()
    scan = WebDatasetConverter.scan

    def scan_then_replace(self: WebDatasetConverter) -> Any:
        found = scan(self)
        open_store(url).put("shards-000001.tar", other)  # after the listing pinned its ETag, before any decode
        return found

    monkeypatch.setattr(WebDatasetConverter, "scan", scan_then_replace)
    with pytest.raises(ConversionError, match=r"shards-000001\.tar: the shard changed during the conversion"):
        shardkit.convert(f"{url}/", tmp_path / "out", **OPTIONS)


def test_the_etags_are_part_of_the_resume_fingerprint(s3: Any, local_shards: Any) -> None:
    root, _ = local_shards
    url = _upload(s3, root)
    before = WebDatasetConverter(f"{url}/", size=4)
    first = before.inputs_fingerprint(before.scan())
    data = bytearray((root / "shards-000001.tar").read_bytes())
    data[-2000] ^= 0xFF  # a byte of the end-of-archive padding: same members, another ETag
    open_store(url).put("shards-000001.tar", bytes(data))
    after = WebDatasetConverter(f"{url}/", size=4)
    assert before.sources[1].etag != after.sources[1].etag
    again = after.inputs_fingerprint(after.scan())
    assert first.split(":")[:2] == again.split(":")[:2] and first != again  # same samples, other ETag


def test_a_truncated_remote_shard_is_an_error_naming_its_url(s3: Any, local_shards: Any, tmp_path: Path) -> None:
    root, _ = local_shards
    url = _upload(s3, root)
    raw = (root / "shards-000001.tar").read_bytes()
    with tarfile.open(root / "shards-000001.tar") as tf:
        last = tf.getmembers()[-1]
    open_store(url).put("shards-000001.tar", raw[: last.offset_data + last.size // 2])
    with pytest.raises(ConversionError, match=rf"{url}/shards-000001\.tar: truncated"):
        shardkit.convert(f"{url}/shards-{{000000..000001}}.tar", tmp_path / "out", **OPTIONS)
    r = run_cli("convert", f"{url}/", "-o", str(tmp_path / "cli"), "--size", "4", "-j", "1", env=s3.env())
    assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr
    assert f"{url}/shards-000001.tar: truncated" in r.stderr
    assert SECRET_KEY not in r.stdout + r.stderr
    missing = run_cli("convert", f"{url}/shards-{{000000..000002}}.tar", "-o", str(tmp_path / "m"), env=s3.env())
    assert missing.returncode != 0 and "1 of 3 shards do not exist" in missing.stderr
