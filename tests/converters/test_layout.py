"""The one "layout from the first record, then enforced" rule (converters/layout.py) that shardkit.write,
the webdataset, parquet and row-shard importers share: inferred from a first record, a later record
that does not fit is a ``mismatch`` naming the input, under the same rules for every kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters.layout import Mismatch, RecordLayout, fit, spec_of
from shardkit.errors import ConversionError, InputFileError
from shardkit.formats import FieldSpec, open_dataset
from tests.helpers.tars import image, png

wds = pytest.importorskip("webdataset")


def test_infer_then_check_names_the_input_and_what_differs() -> None:
    layout = RecordLayout.infer({"x": np.zeros((2, 3), np.float32), "n": 3, "ok": True}, "first.bin")
    assert dict(layout.specs) == {"x": FieldSpec((2, 3), "float32"), "n": FieldSpec((), "int64"),
                                  "ok": FieldSpec((), "bool")}
    got = layout.check({"x": np.ones((2, 3), np.float16), "n": np.int8(4), "ok": False}, "later.bin")
    assert got["x"].dtype == np.float32 and got["n"].dtype == np.int64  # safe casts only
    cases = [
        ({"x": np.zeros((3, 2), np.float32), "n": 1, "ok": True}, r"'x' has shape \(3, 2\), expected \(2, 3\)"),
        ({"x": np.zeros((2, 3), np.float64), "n": 1, "ok": True}, r"'x' has dtype float64, expected float32"),
        ({"x": np.zeros((2, 3), np.float32), "n": 1.5, "ok": True}, r"'n' is a float, expected int64"),
        ({"x": np.zeros((2, 3), np.float32), "n": 1, "ok": 2}, r"'ok' is a int, expected bool"),
        ({"x": np.zeros((2, 3), np.float32), "n": 1}, r"has no 'ok'"),
        ({"x": np.zeros((2, 3), np.float32), "n": 1, "ok": True, "y": 0}, r"has key\(s\) 'y' the first record had not"),
    ]
    for rec, message in cases:
        with pytest.raises(InputFileError, match=rf"^later\.bin: mismatch: the record.*{message}"):
            layout.check(rec, "later.bin")
    assert RecordLayout(layout.specs, exact=False).check({**cases[-1][0]}, "later.bin").keys() == layout.specs.keys()
    with pytest.raises(ConversionError, match=r"^first\.bin: 's' is a str"):
        RecordLayout.infer({"s": "text"}, "first.bin")
    with pytest.raises(Mismatch, match="does not fit uint8"):
        fit(300, spec_of(np.uint8(1), "u"), "u")


def test_a_webdataset_json_flag_is_not_filled_by_a_number(tmp_path: Path) -> None:
    """The first sample's ``.json`` makes ``flag`` a bool field; a later sample's ``"flag": 7`` does not
    fit it (it used to be stored as True) and is skipped as a mismatch, like every other kind's."""
    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for key, flag in (("s0", True), ("s1", 7), ("s2", False)):
            sink.write({"__key__": key, "png": png(image(1)), "json": {"flag": flag}})
    s = shardkit.convert(root / "a.tar", tmp_path / "out", size=4, workers=1)
    assert s.records == 2 and dict(s.skipped) == {"mismatch": 1}
    (where, reason), = s.skipped_inputs
    assert where.endswith("a.tar#s1") and "mismatch: the sample: 'flag' is a int, expected bool" in reason
    with open_dataset(tmp_path / "out") as ds:
        assert ds.fields["flag"].tolist() == [True, False]
