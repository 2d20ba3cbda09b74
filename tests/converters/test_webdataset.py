"""WebDataset tar shards as a corpus kind (issue 35, item 2): real shards written by webdataset's own
TarWriter converted record by record, and hostile tars (truncated, lying sizes, links, unsafe names)
refused with errors naming the shard, nothing already written lost."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import shardkit
from shardkit.converters.webdataset import expand_braces, sample_key
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import open_dataset, verify
from tests.helpers.cli import run_cli
from tests.helpers.importers import tree_digest as _digest
from tests.helpers.tars import H, W
from tests.helpers.tars import image as _image
from tests.helpers.tars import member as _member
from tests.helpers.tars import png as _png
from tests.helpers.tars import write_shards as _write_shards
from tests.helpers.tars import write_tar as _tar

wds = pytest.importorskip("webdataset")

@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("wds") / "corpus"
    return root, _write_shards(root)


def test_brace_pattern_shards_convert_record_by_record(shards, tmp_path: Path) -> None:
    root, samples = shards
    summary = shardkit.convert(root / "shards-{000000..000001}.tar", tmp_path / "out", size=f"{H}x{W}", workers=1)
    assert summary.kind == "webdataset" and summary.records == len(samples) and summary.num_skipped == 0
    assert summary.notes == {"dropped .txt": len(samples)}  # captions have no fixed shape
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "image" and ds.meta.record.shape == (H, W, 3)
        assert ds.label_names == ["0", "1", "2"]
        assert sorted(ds.fields) == ["emb", "label", "score", "width"]
        for k, want in enumerate(samples):
            rec = ds[k]
            np.testing.assert_array_equal(rec["image"], want["image"])  # same size: the pixels themselves
            assert int(rec["label"]) == want["cls"]
            np.testing.assert_array_equal(rec["emb"], want["emb.npy"])
            assert float(rec["score"]) == want["json"]["score"] and int(rec["width"]) == W
            src = ds.source(k)
            assert src is not None and src.name == f"{want['shard']}#{want['__key__']}"
            assert (src.values["width"], src.values["height"]) == (W, H)
    assert verify(tmp_path / "out").ok
    r = run_cli("convert", str(root / "shards-{000000..000001}.tar"), "-o", str(tmp_path / "cli"), "--size", "4", "-q")
    assert r.returncode == 0 and f"note         dropped .txt: {len(samples)}" in r.stdout
    assert r.stderr.count("dropped .txt") == 1  # the first one is shown, the others only with -v


def test_a_directory_of_shards_is_detected_and_resized_by_the_image_options(shards, tmp_path: Path) -> None:
    root, samples = shards
    summary = shardkit.convert(root, tmp_path / "out", size=6, crop="center", workers=2)
    assert summary.kind == "webdataset" and summary.records == len(samples)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (6, 6, 3) and ds.meta.transform["size"] == [6, 6]
        assert ds.fields["label"].tolist() == [s["cls"] for s in samples]


def test_audio_members_and_text_labels(tmp_path: Path) -> None:
    root = tmp_path / "speech"
    root.mkdir()
    rate, clips = 8000, []
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i, word in enumerate(["yes", "no", "yes"]):
            x = (np.sin(np.arange(rate // 2) * (i + 1) / 10) * 0.5).astype(np.float32)
            buf = io.BytesIO()
            sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
            sink.write({"__key__": f"utt{i}", "wav": buf.getvalue(), "txt": word})
            clips.append(x)
    summary = shardkit.convert(root / "a.tar", tmp_path / "out", label="txt", sample_rate=rate, duration=0.5,
                               workers=1)
    assert summary.records == 3 and not summary.notes
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "audio" and ds.meta.record.shape == (rate // 2,)
        assert ds.label_names == ["no", "yes"] and ds.fields["label"].tolist() == [1, 0, 1]
        for k, x in enumerate(clips):
            want = np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int16)
            assert np.abs(ds[k]["audio"].astype(int) - want).max() <= 1  # PCM_16 round trip
            assert ds.source(k).name == f"a.tar#utt{k}"


def test_links_devices_and_unsafe_names_are_refused_with_their_sample(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    good = _png(_image(1))
    _tar(root / "x.tar", [
        _member("ok1.png", good), _member("ok1.cls", b"1"),
        _member("sym.png", None, tarfile.SYMTYPE, "/etc/passwd"), _member("sym.cls", b"0"),
        _member("hard.png", None, tarfile.LNKTYPE, "ok1.png"),
        _member("dev.png", None, tarfile.CHRTYPE),
        _member("../up.png", good), _member("/abs.png", good),
        _member("big.png", good + b"\0" * 4096), _member("big.cls", b"0"),
        _member("ok2.png", good), _member("ok2.cls", b"2"),
    ])
    summary = shardkit.convert(root / "x.tar", tmp_path / "out", size=f"{H}x{W}", max_member_bytes=4096, workers=1)
    assert summary.records == 2
    assert dict(summary.skipped) == {"unsafe": 5, "too-large": 1}
    reasons = dict(summary.skipped_inputs)
    assert "symbolic link" in reasons[f"{root / 'x.tar'}#sym"] and "hard link" in reasons[f"{root / 'x.tar'}#hard"]
    assert "'..'" in reasons[f"{root / 'x.tar'}#../up"] and "absolute" in reasons[f"{root / 'x.tar'}#/abs"]
    with open_dataset(tmp_path / "out") as ds:
        assert [ds.source(k).name for k in range(2)] == ["x.tar#ok1", "x.tar#ok2"]
        assert ds.fields["label"].tolist() == [1, 2]


def test_truncated_shard_is_a_clear_error_and_a_failed_append_changes_nothing(shards, tmp_path: Path) -> None:
    root, samples = shards
    out = tmp_path / "out"
    shardkit.convert(root, out, size=8, workers=1)
    before = _digest(out)
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = (root / "shards-000001.tar").read_bytes()
    with tarfile.open(root / "shards-000001.tar") as tf:
        last = tf.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    for cut in (last.offset_data + last.size // 2, end):  # inside a member; before the end-of-archive block
        (bad / "shards-000001.tar").write_bytes(raw[:cut])
        with pytest.raises(ConversionError, match=r"shards-000001\.tar: truncated"):
            shardkit.convert(bad, tmp_path / "other", kind="webdataset", size=8, workers=1)
        r = run_cli("convert", str(bad), "-o", str(out), "--append", "--size", "8", "--kind", "webdataset")
        assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
        assert "shards-000001.tar: truncated" in r.stderr
        assert _digest(out) == before
    with open_dataset(out) as ds:
        assert len(ds) == len(samples)


def test_a_member_claiming_100_gb_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.tar"
    _tar(path, [_member("a.png", b""), _member("a.cls", b"1")])
    raw = bytearray(path.read_bytes())
    raw[124:136] = bytes([0x80]) + (100 * 10**9).to_bytes(11, "big")  # base-256 size, as GNU tar writes it
    raw[148:156] = b"%06o\0 " % (sum(raw[:148]) + 8 * 32 + sum(raw[156:512]))
    path.write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match=r"huge\.tar: truncated: member 'a\.png' claims 100000000000 bytes"):
        shardkit.convert(path, tmp_path / "out", workers=1)


def test_corrupt_header_and_mismatched_fields(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "junk.tar").write_bytes(b"not a tar" * 200)
    with pytest.raises(ConversionError, match=r"junk\.tar: corrupt: bad tar header checksum"):
        shardkit.convert(root / "junk.tar", tmp_path / "out", workers=1)
    good = _png(_image(2))
    with wds.TarWriter(str(root / "m.tar")) as sink:
        sink.write({"__key__": "a", "png": good, "vec.npy": np.zeros(3, np.float32)})
        sink.write({"__key__": "b", "png": good, "vec.npy": np.zeros(4, np.float32)})  # another shape
        sink.write({"__key__": "c", "png": good})  # no .npy
        sink.write({"__key__": "d", "jpg": good})  # no png payload
    s = shardkit.convert(root / "m.tar", tmp_path / "out", size=4, workers=1)
    assert s.records == 1 and dict(s.skipped) == {"mismatch": 2, "missing": 1}
    with pytest.raises(ConversionError, match=r"m\.tar#a\.png.*|mismatch"):
        shardkit.convert(root / "m.tar", tmp_path / "strict", size=4, workers=1, strict=True)


def test_grouping_and_brace_rules() -> None:
    # WebDataset's rule: the key runs to the first dot of the last path component.
    assert sample_key("dir/a.b/img001.seg.png") == ("dir/a.b/img001", "seg.png")
    assert sample_key("x.JPG") == ("x", "jpg")
    assert sample_key("README") is None and sample_key("dir/.hidden") is None
    assert expand_braces("s-{08..10}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar"]
    assert expand_braces("{a,b}-{0..1}.tar") == ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]
    with pytest.raises(ConfigError, match="more than"):
        expand_braces("{0..999999999}.tar")
    with pytest.raises(ConfigError, match="counts down"):
        expand_braces("{9..1}.tar")


def test_an_npy_header_is_checked_against_its_bytes_before_anything_is_allocated(tmp_path: Path) -> None:
    good = _png(_image(3))
    vec = io.BytesIO()
    np.save(vec, np.arange(4, dtype=np.int64))
    raw = vec.getvalue()
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (10**13,)})
    lying = buf.getvalue() + raw[-32:]  # a header claiming 80 TB, followed by 32 bytes
    with wds.TarWriter(str(tmp_path / "v.tar")) as sink:
        sink.write({"__key__": "a", "png": good, "vec.npy": raw})
        sink.write({"__key__": "b", "png": good, "vec.npy": lying})
        sink.write({"__key__": "c", "png": good, "vec.npy": np.lib.format.magic(1, 0) + b"garbage"})
    s = shardkit.convert(tmp_path / "v.tar", tmp_path / "out", size=4, workers=1)
    assert s.records == 1 and dict(s.skipped) == {"corrupt": 2}
    reasons = dict(s.skipped_inputs)
    assert "claims [10000000000000] int64 (80000000000000 bytes), the member holds 32 bytes" in reasons[f"{tmp_path / 'v.tar'}#b"]
    with open_dataset(tmp_path / "out") as ds:
        assert ds.fields["vec"].tolist() == [[0, 1, 2, 3]]


def test_a_json_member_is_parsed_only_below_its_bound(tmp_path: Path) -> None:
    good = _png(_image(4))
    with wds.TarWriter(str(tmp_path / "j.tar")) as sink:
        sink.write({"__key__": "a", "png": good, "json": b'{"n": 1}'})
        sink.write({"__key__": "b", "png": good, "json": b" " * (1 << 20) + b'{"n": 2}'})
        sink.write({"__key__": "c", "png": good, "json": b'{"n": 3}'})
    s = shardkit.convert(tmp_path / "j.tar", tmp_path / "out", size=4, workers=1)
    assert s.records == 2 and dict(s.skipped) == {"too-large": 1}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.fields["n"].tolist() == [1, 3]
