"""CIFAR-10/100 batches through the restricted unpickler; malicious pickles are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters.cifar import safe_load
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset
from tests.helpers.corpora import _Evil, make_cifar10, make_cifar100, write_pickle


def test_cifar10_native_size(tmp_path: Path) -> None:
    ref = make_cifar10(tmp_path / "c10")
    s = shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)
    assert s.kind == "cifar10" and s.records == 30
    with open_dataset(tmp_path / "out") as ds:
        img = ds.read(np.arange(30))["image"]
        assert img.shape == (30, 32, 32, 3)
        np.testing.assert_array_equal(img, ref["data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(ds.fields["label"], ref["labels"])
        assert ds.label_names == [f"class{k}" for k in range(10)]
    t = shardkit.convert(tmp_path / "c10", tmp_path / "test", split="test", size=16, workers=1)
    assert t.records == 6
    with open_dataset(tmp_path / "test") as ds:
        assert ds.meta.record.shape == (16, 16, 3)


def test_cifar100_fine_and_coarse(tmp_path: Path) -> None:
    ref = make_cifar100(tmp_path / "c100")
    s = shardkit.convert(tmp_path / "c100" / "cifar-100-python", tmp_path / "out", workers=2)
    assert s.kind == "cifar100" and s.records == 8
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.fields["label"], ref["train"]["fine"])
        np.testing.assert_array_equal(ds.fields["coarse_label"], ref["train"]["coarse"])
        assert ds.meta.labels["coarse_label"][:2] == ["coarse0", "coarse1"]


@pytest.mark.parametrize("protocol", [2, 4])
def test_code_executing_pickle_is_refused(tmp_path: Path, protocol: int) -> None:
    marker = Path("/tmp/shardkit-pwned")
    marker.unlink(missing_ok=True)
    make_cifar10(tmp_path / "c10")
    bad = tmp_path / "c10" / "cifar-10-batches-py" / "data_batch_3"
    write_pickle(bad, {b"data": _Evil(), b"labels": []}, protocol=protocol)
    with pytest.raises(ConversionError, match=r"data_batch_3: refused to unpickle: global (posix|os)\.system"):
        shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)
    assert not marker.exists()


def test_object_arrays_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    write_pickle(path, {"data": np.array([1, "x"], dtype=object)})
    with pytest.raises(ConversionError, match="obj"):
        safe_load(path)


def test_plain_data_roundtrips(tmp_path: Path) -> None:
    obj = {"a": [1, 2.5, (3, b"x")], "b": np.arange(6, dtype=np.uint8).reshape(2, 3), "c": {1, 2}}
    for protocol in (2, 4, 5):
        write_pickle(tmp_path / "p", obj, protocol=protocol)
        got = safe_load(tmp_path / "p")
        assert got["a"] == obj["a"] and got["c"] == obj["c"]
        np.testing.assert_array_equal(got["b"], obj["b"])
