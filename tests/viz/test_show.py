"""``show`` / ``export``: boxes drawn where they are, records chosen as asked (uniformly, when random),
audio plotted and written back exactly, file names and permissions safe (issue 14, item 2)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image
from scipy import stats

import shardkit
from shardkit.errors import ConfigError, MissingExtraError
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.order.seeds import Domain, rng
from shardkit.viz import Selection, select_keys
from shardkit.viz.sheet import BOX_COLORS
from tests.helpers.corpora import coco_doc, tone, write_json, write_wav
from tests.helpers.order_stats import ALPHA

REPO = Path(__file__).resolve().parents[2]
GREY = 128


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A COCO dataset of plain grey 64 x 64 pictures with known boxes (no resize: size 64)."""
    root = tmp_path_factory.mktemp("show") / "coco"
    (root / "val").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (64, 64), (GREY, GREY, GREY)).save(root / "val" / f"{i}.png")
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64} for i in range(3)]
    anns = [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [10, 12, 30, 20]},   # x 10..40, y 12..32
            {"id": 2, "image_id": 2, "category_id": 3, "bbox": [0.5, 40.25, 20, 10]},
            {"id": 3, "image_id": 2, "category_id": 7, "bbox": [30, 5, 25, 50]}]
    cats = [{"id": 3, "name": "cat"}, {"id": 7, "name": "zebra"}]
    write_json(root / "annotations" / "instances_val.json", coco_doc(images, anns, cats))
    out = root.parent / "ds"
    shardkit.convert(root, out, size=64, workers=1)
    return out


def _tile(result: shardkit.viz.ShowResult, key: int) -> np.ndarray:
    sheet = np.asarray(Image.open(result.path).convert("RGB"))
    tile = next(t for t in result.layout.tiles if t.key == key)
    assert tile.zoom == 2  # 64-pixel frames are shown at 2x: 128 screen pixels
    return sheet[tile.y : tile.y + 64 * tile.zoom, tile.x : tile.x + 64 * tile.zoom]


def _check_box(tile: np.ndarray, box: list[float], cls: int, z: int) -> None:
    """The outline covers the frame pixels the box touches (first floor(x0), last ceil(x1) - 1), 2 screen
    pixels wide, in the class's colour; the pixels right outside and inside it are the picture's."""
    color = np.array(BOX_COLORS[cls])
    c0, r0 = int(np.floor(box[0])), int(np.floor(box[1]))
    c1, r1 = int(np.ceil(box[2])) - 1, int(np.ceil(box[3])) - 1
    x0, y0, x1, y1 = c0 * z, r0 * z, (c1 + 1) * z - 1, (r1 + 1) * z - 1
    for edge in (tile[y0 : y1 + 1, x0], tile[y0 : y1 + 1, x0 + 1], tile[y0 : y1 + 1, x1], tile[y0 : y1 + 1, x1 - 1],
                 tile[y0, x0 : x1 + 1], tile[y0 + 1, x0 : x1 + 1], tile[y1, x0 : x1 + 1], tile[y1 - 1, x0 : x1 + 1]):
        assert (edge == color).all()
    below_name = slice(y0 + 15, y1 - 1)  # the class name sits on a patch at the top-left, inside the box
    assert (tile[below_name, x0 + 2] == GREY).all() and (tile[below_name, x1 - 2] == GREY).all()
    assert (tile[y1 - 2, x0 + 2 : x1 - 1] == GREY).all()
    if x0 > 0:
        assert (tile[y0 : y1 + 1, x0 - 1] == GREY).all()
    if x1 + 1 < tile.shape[1]:
        assert (tile[y0 : y1 + 1, x1 + 1] == GREY).all()
    if y0 > 0:
        assert (tile[y0 - 1, x0 : x1 + 1] == GREY).all()
    if y1 + 1 < tile.shape[0]:
        assert (tile[y1 + 1, x0 : x1 + 1] == GREY).all()
    patch = tile[y0 + 2 : y0 + 14, x0 + 2 : x0 + 20]
    assert (patch.max(axis=2) < 80).any() and (patch == color).all(axis=2).any()  # dark name on its colour


def test_boxes_are_drawn_exactly_where_they_are(coco: Path, tmp_path: Path) -> None:
    result = shardkit.show(coco, tmp_path / "sheet.png", keys=[0, 1, 2])
    assert result.keys == (0, 1, 2) and result.path.is_file()
    # Contiguous classes: cat (id 3) = 0, zebra (id 7) = 1. No resize at size 64, so the boxes are the
    # annotations' own [x, y, x + w, y + h].
    _check_box(_tile(result, 0), [10, 12, 40, 32], 1, 2)
    tile = _tile(result, 1)
    _check_box(tile, [0.5, 40.25, 20.5, 50.25], 0, 2)  # fractional edges: pixels 0..20 x 40..50
    _check_box(tile, [30, 5, 55, 55], 1, 2)
    others = np.ones(tile.shape[:2], bool)
    others[40 * 2 : 51 * 2, 0 : 21 * 2] = False
    others[5 * 2 : 55 * 2, 30 * 2 : 55 * 2] = False
    assert (tile[others] == GREY).all()  # nothing drawn anywhere else
    assert (_tile(result, 2) == GREY).all()  # no boxes: the plain picture


def test_random_picks_are_uniform_and_seeded_in_their_own_domain(tmp_path: Path) -> None:
    n, k = 10, 3
    with DatasetWriter(tmp_path / "ds", kind="t", payload="image", record=FieldSpec((2, 2, 3), "uint8"),
                       fields={"label": FieldSpec((), "int64")}, labels={"label": ["a", "b"]}) as w:
        w.write({"image": np.zeros((n, 2, 2, 3), np.uint8), "label": np.arange(n) % 2})
    with open_dataset(tmp_path / "ds") as ds:
        default = select_keys(ds, Selection(random=k))  # the default seed, 0
        assert default.tolist() == sorted(rng(Domain.RECORD_SAMPLE, 0).choice(n, size=k, replace=False).tolist())
        trials = 3000
        counts = np.zeros(n)
        for seed in range(trials):
            counts[select_keys(ds, Selection(random=k, seed=seed))] += 1
        # Inclusion of each record: k/n per draw; chi-square over the n counts (alpha = 1e-3).
        assert stats.chisquare(counts, np.full(n, trials * k / n)).pvalue > ALPHA
        only_b = select_keys(ds, Selection(label="b", random=2, seed=5))
        assert len(only_b) == 2 and all(ds.fields["label"][only_b] == 1)
        assert select_keys(ds, Selection(label="a", limit=3)).tolist() == [0, 2, 4]
        with pytest.raises(ConfigError, match="random: expected 1 to 256"):
            select_keys(ds, Selection(random=0))
        with pytest.raises(ConfigError, match="seed: expected an integer"):
            select_keys(ds, Selection(random=2, seed=-1))


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("speech") / "corpus"
    write_wav(root / "yes" / "a.wav", tone(440, 16000, 0.5), 16000)
    write_wav(root / "no" / "b.wav", tone(880, 8000, 1.2), 8000)
    out = root.parent / "ds"
    shardkit.convert(root, out, kind="audio", sample_rate="16k", duration="1s", workers=1)
    return out


def test_audio_plots_and_wav_files_play_back_the_records(speech: Path, tmp_path: Path) -> None:
    result = shardkit.show(speech, tmp_path / "plot.png", keys=[0, 1], wav_dir=tmp_path / "wav")
    img = np.asarray(Image.open(result.path).convert("RGB"))
    assert img.shape[0] > 300 and img.shape[1] > 600 and len(np.unique(img.reshape(-1, 3), axis=0)) > 50
    with open_dataset(speech) as ds:
        for k, path in enumerate(result.wavs):
            data, rate = sf.read(path, dtype="int16")
            assert rate == 16000 and path.name == f"{k:06d}-{ds.meta.labels['label'][int(ds[k]['label'])]}.wav"
            np.testing.assert_array_equal(data, ds[k]["audio"])


def test_missing_matplotlib_names_the_extra(speech: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r'pip install "shardkit\[viz\]"'):
        shardkit.show(speech, tmp_path / "plot.png")
    shardkit.show(REPO / "tests" / "formats" / "golden" / "v1.1-zstd", tmp_path / "sheet.png")  # images need none


def test_export_writes_the_stored_records_with_safe_names_and_the_datasets_permissions(tmp_path: Path) -> None:
    rec = np.random.default_rng(0).integers(0, 256, (3, 5, 4, 3), dtype=np.uint8)
    with DatasetWriter(tmp_path / "ds", kind="t", payload="image", record=FieldSpec((5, 4, 3), "uint8"),
                       fields={"label": FieldSpec((), "int64")},
                       labels={"label": ["../../escape", "a/b", ""]}) as w:
        w.write({"image": rec, "label": np.array([0, 1, 2])})
    for f in (tmp_path / "ds" / "image").rglob("*"):
        if f.is_file() and f.name != "zarr.json":
            os.chmod(f, 0o600)
    paths = shardkit.export(tmp_path / "ds", tmp_path / "x", keys=[2, 0, 1])
    assert [p.name for p in paths] == ["000002-label.png", "000000-escape.png", "000001-a_b.png"]
    assert all(p.parent == tmp_path / "x" for p in paths) and not (tmp_path / "escape.png").exists()
    for p, k in zip(paths, [2, 0, 1]):
        np.testing.assert_array_equal(np.asarray(Image.open(p)), rec[k])
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0  # no more readable than the dataset


def test_cli_show_and_export(coco: Path, tmp_path: Path) -> None:
    r = _cli("show", str(coco), "-o", str(tmp_path / "s.png"), "--random", "2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 's.png'} (2 records: ")
    r = _cli("export", str(coco), "--keys", "0-1", "-o", str(tmp_path / "e"))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "e").iterdir()) == ["000000-zebra.png",
                                                                                       "000001-zebra.png"]
    for args, needle in ((["show", str(coco), "--keys", "0,x"], "--keys: expected keys such as"),
                         (["show", str(coco), "--keys", "7"], "--keys: record 7 is outside"),
                         (["show", str(coco), "--label", "dog"], "--label: no class 'dog'"),
                         (["show", str(coco), "--random", "0"], "--random: expected 1 to 256"),
                         (["show", str(coco), "--wav", str(tmp_path / "w")], "--wav:")):
        r = _cli(*args)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
