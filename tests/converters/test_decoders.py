"""Workers get small picklable decoders, outcomes and notes are named types, class-folder kinds share a
real base class."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters import Converter, Decoded, Note, get_converter
from shardkit.converters.classfolders import ClassFolderConverter, ClassFolderDecoder
from shardkit.converters.decoding import Failed, Produced, Skipped, decode_one
from shardkit.formats import FieldSpec, open_dataset
from tests.helpers.corpora import make_cifar10

DATASETS = Path(__file__).resolve().parents[2] / "datasets"


def test_decoders_stay_small_whatever_the_corpus(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "small", per_batch=2)
    make_cifar10(tmp_path / "large", per_batch=400)
    sizes = []
    for name in ("small", "large"):
        conv = get_converter("cifar10")(tmp_path / name)
        conv.scan()
        sizes.append(len(pickle.dumps(conv.decoder)))
    assert sizes[0] == sizes[1] < 2000  # the rows (2000 images) are not in it
    coco = get_converter("coco")(DATASETS / "coco")
    assert len(pickle.dumps(coco.decoder)) < 2000 < len(pickle.dumps(coco.scan().items))
    for kind in ("audio", "cifar10", "cifar100", "coco", "imagefolder"):
        assert "__getstate__" not in vars(get_converter(kind)), kind  # nothing to trim any more
    assert not hasattr(Converter, "kind")


def test_decode_outcomes_are_named_types(tmp_path: Path) -> None:
    conv = get_converter("imagefolder")(DATASETS / "imagefolder", size=8)
    items = conv.scan().items
    match decode_one(conv.decoder, 0, items[0]):
        case Produced(index=0, decoded=Decoded(records=[record], start=0, more=False, notes=())):
            assert record["image"].shape == (8, 8, 3)
        case other:
            pytest.fail(f"unexpected {other}")
    match decode_one(conv.decoder, 5, ("cat/missing.jpg", 0)):
        case Skipped(index=5, path=path, reason=reason):
            assert path.endswith("cat/missing.jpg") and reason.startswith("missing: ")
        case other:
            pytest.fail(f"unexpected {other}")
    # A skip after some records of the input are written cannot be a skip any more.
    match decode_one(conv.decoder, 5, ("cat/missing.jpg", 0), start=3):
        case Failed(index=5, message=message):
            assert "after 3 of its records were written" in message
        case other:
            pytest.fail(f"unexpected {other}")
    assert str(Note("capped", "120 visible boxes, kept the first 100")) == "capped: 120 visible boxes, kept the first 100"


class _TextDecoder(ClassFolderDecoder):
    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        text = self.checked_path(item[0]).read_bytes()[:4].ljust(4, b" ")
        return Decoded([{"text": np.frombuffer(text, np.uint8).copy(), "label": np.int64(item[1])}])


class _TextFolders(ClassFolderConverter):
    """A class-folder kind written against the base class alone (no mixin order to get right)."""

    name = "textfolders"
    payload = "text"
    media_extensions = frozenset({".txt"})
    media_name = "text"

    def media_transform(self) -> object:
        class Nothing:
            def to_json(self) -> dict[str, str]:
                return {"bytes": "first 4"}

        return Nothing()

    def scan(self) -> shardkit.converters.ScanResult:
        return shardkit.converters.ScanResult(self.scan_files())

    def record_spec(self) -> FieldSpec:
        return FieldSpec((4,), "uint8")

    def make_decoder(self) -> _TextDecoder:
        return _TextDecoder("text", self.record_spec(), self.base, self.media_extensions, self.media_name)


def test_class_folder_kinds_derive_from_one_base_class(tmp_path: Path) -> None:
    for c, words in {"a": ["ant", "ape"], "b": ["bee"]}.items():
        (tmp_path / "src" / "train" / c).mkdir(parents=True)
        for w in words:
            (tmp_path / "src" / "train" / c / f"{w}.txt").write_text(w)
    (tmp_path / "src" / "train" / "b" / "x.bin").write_bytes(b"?")
    conv = _TextFolders(tmp_path / "src")
    assert _TextFolders.detect(tmp_path / "src")
    s = shardkit.converters.run_converter(conv, tmp_path / "out", workers=1)
    assert s.records == 3 and dict(s.skipped) == {"unsupported": 1}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.label_names == ["a", "b"] and ds.fields["label"].tolist() == [0, 0, 1]
        assert bytes(ds.read([2])["text"][0]) == b"bee " and ds.meta.transform == {"bytes": "first 4"}
    for kind in ("imagefolder", "audio"):
        assert issubclass(get_converter(kind), ClassFolderConverter)
