"""Reading and validating what a loader emitted (``shardkit.ordertest.keys``): hostile files are refused
by name before anything is allocated or unpickled, and each kind of row is recognised."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError, InputFileError
from shardkit.ordertest import load_npy, prepare


def save(path: Path, arr: np.ndarray) -> Path:
    np.save(path, arr)
    return path


def test_permutation_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    keys = np.array([rng.permutation(7) for _ in range(3)], dtype=np.int32)
    d = prepare(save(tmp_path / "k.npy", keys))
    assert d.kind == "permutation" and d.n == 7 and (d.epochs, d.length) == (3, 7)
    assert d.storage.dtype == np.int64 and d.source.endswith("k.npy") and d.notes == ()
    np.testing.assert_array_equal(d.storage, keys)
    fortran = prepare(save(tmp_path / "f.npy", np.asfortranarray(keys)))  # column-major files read right
    np.testing.assert_array_equal(fortran.storage, keys)


def test_distinct_and_repeated_rows() -> None:
    d = prepare(np.array([[3, 1, 4], [0, 9, 2]]))
    assert d.kind == "distinct" and d.n == 10 and any("largest key" in n for n in d.notes)
    d = prepare(np.array([[3, 1, 4], [0, 9, 2]]), records=12)
    assert d.n == 12 and d.notes == ()
    assert prepare(np.array([[1, 1, 0]])).kind == "repeats"


def test_storage_order_and_labels_are_applied_by_key() -> None:
    keys = np.array([[2, 0, 1]])
    storage_of_key = np.array([1, 2, 0])  # key 0 is stored at position 1, ...
    labels = np.array(["cat", "dog", "emu"])  # by key
    d = prepare(keys, storage_order=storage_of_key, labels=labels)
    np.testing.assert_array_equal(d.storage, [[0, 1, 2]])
    assert d.labels is not None
    # labels indexed by storage position: position 0 holds key 2 (emu = code 2), position 1 key 0 (cat)
    np.testing.assert_array_equal(d.labels, [2, 0, 1])


def test_padding_of_rows_cut_short(tmp_path: Path) -> None:
    keys = np.array([[2, 0, 1, 3], [1, 3, -1, -1]])
    d = prepare(keys)
    assert d.epochs == 1 and d.kind == "permutation" and "dropped 1 row" in d.notes[0]
    d = prepare(np.array([[2, 0, -1, -1], [1, 3, 0, -1]]), records=4)
    assert d.length == 2 and d.kind == "distinct" and "first 2 keys" in d.notes[0]
    with pytest.raises(InputFileError, match="-1 inside a row"):
        prepare(save(tmp_path / "p.npy", np.array([[2, -1, 1, 0]])))
    with pytest.raises(InputFileError, match="negative key -5"):
        prepare(np.array([[2, -5, 1, 0]]))


@pytest.mark.parametrize("arr,match", [
    (np.zeros((3, 4)), "expected integers, found dtype float64"),
    (np.arange(5), "2-D array"),
    (np.zeros((2, 2, 2), dtype=np.int64), "2-D array"),
    (np.zeros((0, 4), dtype=np.int64), "at least one epoch"),
    (np.zeros((3, 1), dtype=np.int64), "at least one epoch of at least 2 keys"),
    (np.array([[1, 2**64 - 1]], dtype=np.uint64), "does not fit in int64"),
])
def test_bad_key_files_are_named(tmp_path: Path, arr: np.ndarray, match: str) -> None:
    path = save(tmp_path / "bad.npy", arr)
    with pytest.raises(InputFileError, match=match) as info:
        prepare(path)
    assert str(path) in str(info.value)


def test_keys_outside_the_stated_dataset(tmp_path: Path) -> None:
    path = save(tmp_path / "k.npy", np.array([[0, 5, 2]]))
    with pytest.raises(InputFileError, match=r"key 5 is outside 0..3 \(the records give 4"):
        prepare(path, records=4)
    with pytest.raises(ConfigError, match="disagrees: records 6, labels 5"):
        prepare(path, records=6, labels=np.zeros(5, dtype=np.int64))


def test_bad_storage_order_and_labels(tmp_path: Path) -> None:
    keys = np.array([[0, 1, 2]])
    with pytest.raises(InputFileError, match="not a permutation"):
        prepare(keys, storage_order=save(tmp_path / "m.npy", np.array([0, 0, 1])))
    with pytest.raises(InputFileError, match=r"m2.npy: expected a key -> storage position map: a 1-D array"):
        prepare(keys, records=3, storage_order=save(tmp_path / "m2.npy", np.array([[0, 1, 2]])))
    with pytest.raises(InputFileError, match=r"l.npy: expected labels: a 1-D array with one entry per key"):
        prepare(keys, records=3, labels=save(tmp_path / "l.npy", np.zeros((3, 2), dtype=np.int64)))
    with pytest.raises(ConfigError, match="disagrees: records 3, labels 4"):
        prepare(keys, records=3, labels=np.zeros(4, dtype=np.int64))
    with pytest.raises(InputFileError, match=r"l2\.npy: expected integer, boolean or string labels, found dtype float64"):
        prepare(keys, labels=save(tmp_path / "l2.npy", np.zeros(3)))


class _Boom:
    """Unpickling this writes a marker file: proof of code execution if it ever happens."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.marker), "executed"))  # type: ignore[return-value]


def test_pickled_arrays_are_refused_without_executing_them(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "evil.npy"
    np.save(path, np.array([_Boom(str(marker))], dtype=object), allow_pickle=True)
    assert pickle.dumps(_Boom(str(marker)))  # the payload is real
    with pytest.raises(InputFileError, match=r"evil\.npy: holds Python objects"):
        prepare(path)
    with pytest.raises(InputFileError, match="holds Python objects"):
        load_npy(path, kinds="biuUS")
    assert not marker.exists()


def test_sizes_are_checked_before_allocating(tmp_path: Path) -> None:
    """A header promising 2**40 keys in a tiny file is refused from the header alone."""
    path = tmp_path / "huge.npy"
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<i8", "fortran_order": False,
                                                   "shape": (1 << 20, 1 << 20)})
        fh.write(b"\0" * 32)
    with pytest.raises(InputFileError, match="more than this tool reads"):
        prepare(path)
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<i8", "fortran_order": False, "shape": (4, 1000)})
        fh.write(b"\0" * 64)
    with pytest.raises(InputFileError, match="truncated"):
        prepare(path)


def test_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="no such file"):
        prepare(tmp_path / "missing.npy")
    with pytest.raises(InputFileError, match="not a regular file"):
        prepare(tmp_path)
    (tmp_path / "text.npy").write_text("hello")
    with pytest.raises(InputFileError, match=r"text\.npy: not a \.npy file"):
        prepare(tmp_path / "text.npy")


def test_arrays_from_python_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="keys: expected an array of integers"):
        prepare(np.array([[0.5, 1.0]]))
    with pytest.raises(ConfigError, match="storage_order: expected an array of integers"):
        prepare(np.array([[0, 1]]), storage_order=np.array(["a", "b"]))
