"""Every record traced to its source, and what conversion changed, for every kind (issue 14, items 3 and 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import shardkit
from shardkit.converters.images import ImageTransform
from shardkit.converters.provenance import change_lines
from shardkit.formats import open_dataset
from tests.helpers.corpora import (
    coco_doc,
    make_cifar10,
    make_imagefolder,
    natural_image,
    save_jpeg,
    tone,
    write_json,
    write_wav,
)

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_every_imagefolder_record_is_traced_to_the_file_it_was_decoded_from(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    bad = make_imagefolder(root, per_class=3)  # bad files interleaved: input numbers skip over them
    s = shardkit.convert(root, tmp_path / "out", size=20, workers=2, decode="exact")
    assert s.num_skipped == len(bad)
    t = ImageTransform(20, 20)
    with open_dataset(tmp_path / "out") as ds:
        assert "provenance" not in ds.fields  # training batches do not carry it
        names = ds.meta.labels["label"]
        for k in range(len(ds)):
            src = ds.source(k)
            assert src is not None and Path(src.path) == root / src.name
            assert src.name.startswith("train/") and src.values["part"] == 0
            # The record is exactly what its source file decodes to, under the label of its folder.
            np.testing.assert_array_equal(ds[k]["image"], t.load(Path(src.path)).array)
            assert names[int(ds[k]["label"])] == src.name.split("/")[1]
            with Image.open(src.path) as im:
                assert (src.values["width"], src.values["height"]) == im.size
        inputs = [ds.source(k).input for k in range(len(ds))]
        assert inputs == sorted(inputs) and len(set(inputs)) == len(ds)
        assert ds.provenance is not None and ds.provenance.count == len(ds) + len(bad)


def test_coco_records_name_their_file_and_image_id(tmp_path: Path) -> None:
    root = tmp_path / "coco"
    for i, (h, w) in enumerate([(60, 80), (90, 40), (64, 64)]):
        save_jpeg(root / "val" / f"{i:03d}.jpg", natural_image(h, w, i))
    images = [{"id": 10 + i, "file_name": f"{i:03d}.jpg", "width": w, "height": h}
              for i, (h, w) in enumerate([(60, 80), (90, 40), (64, 64)])]
    images.append({"id": 99, "file_name": "missing.jpg", "width": 5, "height": 5})
    anns = [{"id": 1, "image_id": 10, "category_id": 1, "bbox": [30, 20, 5, 5]},
            {"id": 2, "image_id": 12, "category_id": 1, "bbox": [0, 0, 64, 64]},
            {"id": 3, "image_id": 12, "category_id": 1, "bbox": [10, 10, 4, 4]}]
    write_json(root / "annotations" / "instances_val.json", coco_doc(images, anns, [{"id": 1, "name": "thing"}]))
    shardkit.convert(root, tmp_path / "out", size=32, workers=1, max_boxes=1)
    with open_dataset(tmp_path / "out") as ds:
        got = [(ds.source(k).name, int(ds[k]["image_id"]), ds.source(k).values["boxes"]) for k in range(len(ds))]
        changes = ds.provenance.changes
    assert got == [("val/000.jpg", 10, 1), ("val/001.jpg", 11, 0), ("val/002.jpg", 12, 2)]
    assert changes["capped"] == {"count": 1, "max_boxes": 2.0}  # image 12: 2 boxes visible, 1 kept


def test_cifar_records_name_their_batch_file_and_row(tmp_path: Path) -> None:
    truth = make_cifar10(tmp_path / "c10", per_batch=4)
    shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)
    with open_dataset(tmp_path / "out") as ds:
        for k in (0, 5, 13, 19):
            src = ds.source(k)
            assert src.name == f"cifar-10-batches-py/data_batch_{k // 4 + 1}#{k % 4}"
            np.testing.assert_array_equal(ds[k]["image"], truth["data"][k].reshape(3, 32, 32).transpose(1, 2, 0))


def test_audio_windows_trim_pad_and_resampling_are_counted_exactly(tmp_path: Path) -> None:
    root = tmp_path / "speech"
    write_wav(root / "yes" / "a.wav", tone(440, 8000, 1.5), 8000)      # 1.5 s: trimmed 0.5 s
    write_wav(root / "yes" / "b.wav", tone(440, 16000, 0.25), 16000)   # 0.25 s: padded 0.75 s
    write_wav(root / "no" / "c.wav", np.stack([tone(300, 44100, 1.0)] * 2, axis=1), 44100)  # stereo, exact length
    shardkit.convert(root, tmp_path / "trim", kind="audio", sample_rate="16k", duration=1, workers=1)
    with open_dataset(tmp_path / "trim") as ds:
        c = ds.provenance.changes
        sources = [ds.source(k) for k in range(len(ds))]
    assert [s.name for s in sources] == ["no/c.wav", "yes/a.wav", "yes/b.wav"]
    assert sources[0].values | {} == {"input": 0, "part": 0, "rate": 44100, "channels": 2, "frames": 44100}
    assert c["trimmed"] == {"count": 1, "max_seconds": 0.5}
    assert c["padded"] == {"count": 1, "max_seconds": 0.75}
    assert c["resampled"] == {"count": 2, "from_hz": {"8000": 1, "44100": 1}}
    assert c["channels"] == {"count": 1, "from": {"2": 1}}
    assert change_lines(c) == [  # what convert and info print
        "1 trimmed (at most 0.500 s cut)",
        "1 zero-padded (at most 0.750 s added)",
        "2 resampled (from 8000 Hz: 1, 44100 Hz: 1)",
        "1 with their channels mixed or duplicated (from 2 channels: 1)",
    ]
    # Windows: a.wav gives windows 0 and 1 (the second padded by 0.5 s), nothing is trimmed.
    shardkit.convert(root, tmp_path / "win", kind="audio", sample_rate=16000, duration=1, window=True, workers=1)
    with open_dataset(tmp_path / "win") as ds:
        parts = [(ds.source(k).name, ds.source(k).values["part"]) for k in range(len(ds))]
        c = ds.provenance.changes
    assert parts == [("no/c.wav", 0), ("yes/a.wav", 0), ("yes/a.wav", 1), ("yes/b.wav", 0)]
    assert c["trimmed"]["count"] == 0 and c["padded"] == {"count": 2, "max_seconds": 0.75}


def test_convert_and_info_print_what_changed(tmp_path: Path) -> None:
    root = tmp_path / "speech"
    write_wav(root / "yes" / "a.wav", tone(440, 8000, 1.5), 8000)
    write_wav(root / "no" / "b.wav", tone(440, 16000, 0.25), 16000)
    out = tmp_path / "out"
    r = _cli("convert", str(root), "-o", str(out), "--kind", "audio", "--sample-rate", "16k", "-q")
    assert r.returncode == 0, r.stderr
    expected = ["changed      1 trimmed (at most 0.500 s cut)", "changed      1 zero-padded (at most 0.750 s added)",
                "changed      1 resampled (from 8000 Hz: 1)"]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("changed")] == expected
    info = _cli("info", str(out)).stdout.splitlines()
    assert [ln for ln in info if ln.startswith("changed")] == expected


def test_image_changes_upscale_crop_and_transparency(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    save_jpeg(root / "a" / "tiny.jpg", natural_image(10, 12, 0))        # 10 -> 32: upscaled 3.2x
    save_jpeg(root / "a" / "wide.jpg", natural_image(20, 100, 1))       # 20x100 -> 32x160: keeps 20%
    save_jpeg(root / "a" / "plain.jpg", natural_image(40, 48, 2))       # neither
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[..., 3] = 128
    Image.fromarray(rgba, "RGBA").save(root / "a" / "alpha.png")
    s = shardkit.convert(root, tmp_path / "out", size=32, workers=1)
    assert s.changes["upscaled"] == {"count": 1, "max_factor": 3.2}  # tiny only: wide is enlarged 1.6x
    assert s.changes["cropped"] == {"count": 1, "min_kept": 0.2}
    assert s.changes["composited"] == {"count": 1}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.info()["changes"] == dict(s.changes)


def test_info_record_prints_source_and_steps_and_json_lists_skip_reasons(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    bad = make_imagefolder(root, per_class=2)
    out = tmp_path / "out"
    assert _cli("convert", str(root), "-o", str(out), "--size", "16", "-q").returncode == 0
    r = _cli("info", str(out), "--record", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    src = open_dataset(out).source(1)
    assert lines[0] == "record       1 of 6"
    assert lines[1] == f"source       {root / src.name}"
    assert any(ln.startswith("conversion   downscaled x") for ln in lines)
    assert any(ln.startswith("label        ") and "(cat)" in ln for ln in lines)
    data = json.loads(_cli("info", str(out), "--json").stdout)
    assert data["skipped"] == len(bad)
    reasons = {Path(s["path"]).name: s["reason"].split(":")[0] for s in data["skipped_inputs"]}
    assert reasons == bad
    assert data["provenance"]["columns"][:2] == ["input", "part"]
    text = [ln for ln in _cli("info", str(out)).stdout.splitlines() if ln.startswith("provenance")]
    assert text == [f"provenance   {', '.join(data['provenance']['columns'])} of each record's source "
                    f"({data['provenance']['inputs']} inputs): shardkit info {out} --record K"]
    r = _cli("info", str(out), "--record", "6")
    assert r.returncode == 1 and r.stderr.startswith("error: --record: expected a record key from 0 to 5")


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_lists_annotation_level_skips(tmp_path: Path, verbose: bool) -> None:
    root = tmp_path / "coco"
    save_jpeg(root / "val" / "a.jpg", natural_image(40, 40, 0))
    anns = [{"id": 7, "image_id": 555, "category_id": 1, "bbox": [0, 0, 4, 4]}]  # an orphan annotation
    write_json(root / "annotations" / "instances_val.json",
               coco_doc([{"id": 1, "file_name": "a.jpg"}], anns, [{"id": 1, "name": "x"}]))
    args = ["convert", str(root), "-o", str(tmp_path / "out"), "--size", "16", "-q"] + (["-v"] if verbose else [])
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    orphan = [ln for ln in r.stderr.splitlines() if "annotations[0] id=7" in ln and "unknown-image" in ln]
    assert len(orphan) == (1 if verbose else 0)
    assert "1 inputs skipped (unknown-image: 1)" in r.stderr
    assert ("--verbose lists them" in r.stderr) != verbose
