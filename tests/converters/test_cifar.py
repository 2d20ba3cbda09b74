"""CIFAR-10/100 batches through the restricted unpickler; malicious pickles are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.converters import cifar
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


class _Call:
    """Pickles as ``func(*args)`` (then ``__setstate__(state)`` if a state is given): any call a
    hostile batch could spell with the globals the restricted unpickler resolves."""

    def __init__(self, func: Any, *args: Any, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


_reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]


def test_claimed_shape_without_bytes_is_refused_before_allocating(tmp_path: Path) -> None:
    """A ~200-byte batch claiming 200,000 rows: no array of uninitialised memory, a named error."""
    path = tmp_path / "data_batch_1"
    write_pickle(path, {b"data": _Call(_reconstruct, np.ndarray, (200_000, 3072), b"B"),
                        b"labels": _Call(_reconstruct, np.ndarray, (200_000,), b"<i8")})
    assert path.stat().st_size < 400
    with pytest.raises(ConversionError, match=r"data_batch_1: .*array without its data"):
        safe_load(path)


@pytest.mark.parametrize("protocol", [2, 5])
def test_hostile_batch_stops_the_conversion_naming_the_file(tmp_path: Path, protocol: int) -> None:
    """End to end: the array state claims 2,000 rows and holds 3 bytes; nothing is written."""
    make_cifar10(tmp_path / "c10")
    bad = tmp_path / "c10" / "cifar-10-batches-py" / "data_batch_2"
    state = (1, (2000, 3072), np.dtype("u1"), False, b"abc")
    write_pickle(bad, {b"data": _Call(_reconstruct, np.ndarray, (2000, 3072), b"B", state=state),
                       b"labels": _Call(np.ndarray, (2000,), "<i8")}, protocol=protocol)
    with pytest.raises(ConversionError, match=r"data_batch_2: refused to unpickle: an array claims shape "
                                              r"\[2000, 3072\] of uint8 \(6144000 bytes\) but holds 3 bytes"):
        shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "zarr.json").exists()


@pytest.mark.parametrize(("obj", "message"), [
    (_Call(np.ndarray, (200_000, 3072), "B"), r"numpy\.ndarray\(\.\.\.\) is not allowed"),
    (_Call(bytes, 10**8), r"bytes\(\) of int is not allowed"),
    (_Call(bytearray, 10**8), r"bytearray\(\) of int is not allowed"),
    (_Call(np._core.numeric._frombuffer, b"abc", np.dtype("u1"), (10**6, 3072), "C"),  # type: ignore[attr-defined]
     r"claims shape \[1000000, 3072\] of uint8 \(3072000000 bytes\) but holds 3 bytes"),
    (_Call(np._core.multiarray.scalar, np.dtype("V100000000"), b"x"),  # type: ignore[attr-defined]
     r"claims shape \[\] of \|V100000000 \(100000000 bytes\) but holds 1 bytes"),
    (_Call(_reconstruct, np.ndarray, (0,), b"B", state=(1, (3,), np.dtype("V0"), False, b"")),
     r"claims 3 items of the zero-size dtype"),
    (_Call(_reconstruct, np.ndarray, (0,), b"B", state=(1, (1,) * 40, np.dtype("u1"), False, b"x")),
     r"expected a tuple of at most 32 sizes"),
    (_Call(_reconstruct, np.ndarray, (0,), b"B", state=(1, (-1, 3), np.dtype("u1"), False, b"x")),
     r"expected non-negative integer sizes"),
    (_Call(_reconstruct, dict, (0,), b"B"), r"_reconstruct of type is not allowed"),
])
def test_allocations_the_file_does_not_pay_for_are_refused(tmp_path: Path, obj: Any, message: str) -> None:
    path = tmp_path / "batch"
    write_pickle(path, {b"data": obj}, protocol=4)
    with pytest.raises(ConversionError, match=rf"batch: refused to unpickle: .*{message}"):
        safe_load(path)


@pytest.mark.timeout(120)
def test_shared_lists_are_visited_once(tmp_path: Path) -> None:
    """A list referenced twice per level, 40 levels deep, is a few hundred bytes of pickle; checking it
    visits each list once instead of 2**40 times."""
    nested: list[Any] = [np.zeros(2, dtype=np.uint8)]
    for _ in range(40):
        nested = [nested, nested]
    write_pickle(tmp_path / "p", {"data": nested}, protocol=4)
    got = safe_load(tmp_path / "p")["data"]
    for _ in range(40):
        assert got[0] is got[1]
        got = got[0]
    np.testing.assert_array_equal(got[0], [0, 0])


def test_arrays_keep_order_and_byte_order(tmp_path: Path) -> None:
    obj = {"f": np.asfortranarray(np.arange(12, dtype=">i4").reshape(3, 4)), "z": np.zeros((0, 3072), np.uint8),
           "s": np.float32(2.5), "t": (np.arange(3, dtype=np.int16),), "e": b"", "ba": bytearray(b"xy")}
    for protocol in (2, 4, 5):
        write_pickle(tmp_path / "p", obj, protocol=protocol)
        got = safe_load(tmp_path / "p")
        assert got["f"].flags.f_contiguous and got["f"].dtype == np.dtype(">i4") and got["f"].flags.writeable
        np.testing.assert_array_equal(got["f"], obj["f"])
        assert got["z"].shape == (0, 3072) and got["s"] == np.float32(2.5) and isinstance(got["s"], np.float32)
        np.testing.assert_array_equal(got["t"][0], obj["t"][0])
        assert got["e"] == b"" and got["ba"] == bytearray(b"xy")


@pytest.mark.timeout(120)
def test_special_and_oversized_files_are_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "data_batch_1"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(ConversionError, match=r"data_batch_1: expected a regular file .* found a special file"):
        safe_load(fifo)
    write_pickle(tmp_path / "big", {b"data": b"x" * 100})
    monkeypatch.setattr(cifar, "_MAX_BATCH_BYTES", 64)
    with pytest.raises(ConversionError, match=r"big: \d+ bytes; a CIFAR batch has at most 64"):
        safe_load(tmp_path / "big")
