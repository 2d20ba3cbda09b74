"""Image and audio codecs per record (jpeg, png, webp, jpegxl, flac): round trips, the zarr documents
zarr-python reads, records a codec cannot store, and damaged streams named by their record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import FieldSpec, open_dataset
from shardkit.formats.codecs import codec_from_zarr, get_codec
from shardkit.formats.spec import index_nbytes
from shardkit.formats.verify import verify
from shardkit.formats.writer import DatasetWriter
from tests.helpers.datasets import write_dataset

pytest.importorskip("imagecodecs")

ROOT = Path(__file__).resolve().parents[2]


def photos(n: int, shape: tuple[int, int, int] = (40, 48, 3)) -> np.ndarray:
    """``n`` photo-like uint8 images: crops of the bundled sample photos (JPEG codecs are made for
    these; noise would compress to nothing and say nothing about quality)."""
    from PIL import Image

    files = sorted((ROOT / "datasets" / "imagefolder").rglob("*.jpg"))
    out = np.empty((n, *shape), np.uint8)
    h, w, c = shape
    for i in range(n):
        with Image.open(files[i % len(files)]) as im:
            im = im.convert("RGB").resize((w * 2, h * 2))
            a = np.asarray(im)[(i % 3) * (h // 3) :][:h, (i % 2) * (w // 2) :][:, :w]
        out[i] = a[..., :c] if c <= 3 else np.concatenate([a, a[..., :1]], axis=-1)
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize("spec,exact,min_psnr", [
    ("jpeg", False, 30.0), ("jpeg:95", False, 33.0), ("png", True, 0.0), ("webp", False, 30.0),
    ("webp:lossless", True, 0.0), ("jpegxl:90", False, 30.0), ("jpegxl:lossless", True, 0.0),
])  # fmt: skip
def test_image_codecs_round_trip_through_the_reader(tmp_path: Path, spec: str, exact: bool, min_psnr: float) -> None:
    recs = photos(23)
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=8, compression=spec)
    keys = np.random.default_rng(0).permutation(23)
    with open_dataset(path) as ds:
        got = ds.payload.read(keys)
        assert ds.meta.compression == get_codec(spec).to_json()  # type: ignore[union-attr]
    if exact:
        np.testing.assert_array_equal(got, recs[keys])
    else:
        assert psnr(got, recs[keys]) >= min_psnr
    # Every record is one stream: stored smaller than decoded for photographs.
    stored = sum(p.stat().st_size for p in (path / "image" / "c").rglob("*") if p.is_file())
    assert stored < recs.nbytes


@pytest.mark.parametrize("shape", [(40, 48, 1), (40, 48, 4)])
def test_gray_and_rgba_images(tmp_path: Path, shape: tuple[int, int, int]) -> None:
    recs = photos(5, shape)
    for spec in ("png", "jpegxl:lossless") if shape[2] == 1 else ("png", "webp:lossless"):
        path = write_dataset(tmp_path / spec.replace(":", "_"), recs, compression=spec)
        with open_dataset(path) as ds:
            np.testing.assert_array_equal(ds.payload.read(np.arange(5)), recs)


@pytest.mark.parametrize("shape", [(4000,), (4000, 2)])
def test_flac_is_lossless_for_int16_audio(tmp_path: Path, shape: tuple[int, ...]) -> None:
    t = np.arange(int(np.prod(shape))).reshape(shape)
    recs = np.stack([(np.sin(t / (5 + i)) * 9000 + i).astype(np.int16) for i in range(9)])
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=4, compression="flac", payload="audio")
    with open_dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read(np.arange(9)[::-1]), recs[::-1])
    stored = sum(p.stat().st_size for p in (path / "audio" / "c").rglob("*") if p.is_file())
    assert stored < recs.nbytes / 2


@pytest.mark.parametrize("spec,shape,dtype", [
    ("jpeg", (16000,), "int16"), ("jpeg", (8, 8, 4), "uint8"), ("jpeg", (8, 8, 3), "uint16"),
    ("webp", (8, 8, 1), "uint8"), ("png", (8, 8), "uint8"), ("flac", (100,), "float32"), ("flac", (8, 8, 3), "uint8"),
])  # fmt: skip
def test_codecs_refuse_records_they_cannot_store(tmp_path: Path, spec: str, shape: tuple[int, ...], dtype: str) -> None:
    found = rf"compression '{spec}' stores .* found records {list(shape)} {dtype}".replace("[", r"\[")
    with pytest.raises(errors.SchemaError, match=found):
        DatasetWriter(tmp_path / "ds", kind="test", payload="image", record=FieldSpec(shape, dtype), compression=spec)
    assert not (tmp_path / "ds" / "zarr.json").exists()


def test_convert_refuses_an_image_codec_for_audio_before_decoding(tmp_path: Path) -> None:
    from shardkit.converters import convert

    with pytest.raises(errors.SchemaError, match="compression 'jpeg' stores uint8 images"):
        convert(ROOT / "datasets" / "speech", tmp_path / "out", "audio", compression="jpeg")
    assert not (tmp_path / "out" / "zarr.json").exists()


@pytest.mark.parametrize("argument,error", [
    ("jpeg:0", "quality must be an integer in \\[1, 100\\]"), ("jpeg:high", "expected jpeg:QUALITY"),
    ("webp:loss", "webp:lossless"), ("png:12", "level must be an integer in \\[0, 9\\]"), ("zstd:x", "zstd:LEVEL"),
])  # fmt: skip
def test_compression_arguments_are_checked(argument: str, error: str) -> None:
    with pytest.raises(errors.ConfigError, match=error):
        get_codec(argument)


def test_compression_arguments_configure_the_codec() -> None:
    assert get_codec("jpeg:75").to_json() == {"name": "jpeg", "quality": 75}  # type: ignore[union-attr]
    assert get_codec("webp:lossless").to_json() == {"name": "webp", "quality": 90, "lossless": True}  # type: ignore[union-attr]
    assert get_codec("zstd:9").to_json()["level"] == 9  # type: ignore[union-attr]


def test_image_codec_documents_replace_the_bytes_codec() -> None:
    jpeg = get_codec("jpeg:80")
    assert jpeg is not None and jpeg.zarr_inner_codecs(1) == [{"name": "numcodecs.imagecodecs_jpeg", "configuration": {"level": 80}}]
    assert codec_from_zarr(jpeg.zarr_inner_codecs(1), where="w").to_json() == jpeg.to_json()  # type: ignore[union-attr]
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    for codecs in ([little, *jpeg.zarr_inner_codecs(1)], [*jpeg.zarr_inner_codecs(1), {"name": "zstd"}]):
        with pytest.raises(errors.NotADatasetError, match="imagecodecs_jpeg"):
            codec_from_zarr(codecs, where="w")


def _entry_points_dir(tmp_path: Path) -> Path:
    """A directory holding a distribution whose only content is the ``zarr.codecs`` entry points that
    pyproject.toml declares: what ``pip install shardkit[codecs]`` gives zarr-python to find."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]["zarr.codecs"]
    dist = tmp_path / "site" / "shardkit_zarr_codecs-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shardkit-zarr-codecs\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[zarr.codecs]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return dist.parent


ZARR_READ = """
import json, sys, warnings
import numpy as np, zarr
warnings.simplefilter("ignore")
group = zarr.open_group(sys.argv[1], mode="r")
arr = group[sys.argv[2]]
print(json.dumps({"shape": list(arr.shape), "all": arr[:].tolist(), "some": arr[[4, 1]].tolist()}))
"""


@pytest.mark.parametrize("spec,payload", [("jpeg:90", "image"), ("png", "image"), ("webp:lossless", "image"),
                                          ("jpegxl:lossless", "image"), ("flac", "audio"), ("opus@16k", "audio"),
                                          ("vorbis@16k", "audio")])
def test_zarr_python_reads_image_and_audio_records_through_the_declared_entry_points(
    tmp_path: Path, spec: str, payload: str
) -> None:
    if payload == "audio":
        recs = np.stack([(np.cos(np.arange(300) / (3 + i)) * 5000).astype(np.int16) for i in range(7)])
    else:
        recs = photos(7, (16, 24, 3))
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=3, compression=spec, payload=payload)
    with open_dataset(path) as ds:
        mine = ds.payload.read(np.arange(7))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_entry_points_dir(tmp_path)), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", ZARR_READ, str(path), payload], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    assert got["shape"] == list(recs.shape)
    np.testing.assert_array_equal(np.array(got["all"], dtype=recs.dtype), mine)  # the same decode as shardkit's
    np.testing.assert_array_equal(np.array(got["some"], dtype=recs.dtype), mine[[4, 1]])
    if spec.endswith("lossless") or spec in ("png", "flac"):
        np.testing.assert_array_equal(mine, recs)


def _shard_file(path: Path, payload: str = "image") -> Path:
    return sorted(p for p in (path / payload / "c").rglob("*") if p.is_file())[0]


def test_a_damaged_jpeg_record_is_a_named_error_with_its_record(tmp_path: Path) -> None:
    recs = photos(6)
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=6, compression="jpeg")
    with open_dataset(path) as ds:
        idx = ds.payload.index(0)
        offset = int(idx.offsets[2])
    shard = _shard_file(path)
    data = bytearray(shard.read_bytes())
    # Record 2's frame header (SOF0: height and width) says another size.
    sof = data.index(b"\xff\xc0", offset)
    data[sof + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    with open_dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read([0, 1]).shape, (2, *recs.shape[1:]))
        with pytest.raises(errors.CorruptShardError, match=rf"record 2 at offset {offset} does not decode"):
            ds.payload.read([5, 2])
    report = verify(path)
    assert not report.ok and any("record 2" in p or "crc32c" in p for p in map(str, report.problems))


def test_full_verify_checks_every_byte_of_jpeg_records(tmp_path: Path) -> None:
    # A flipped bit inside a JPEG's entropy-coded data still decodes (to other pixels): only the
    # records' checksum sees it, and a full verify reads and checks every stored byte.
    recs = photos(6)
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=6, compression="jpeg")
    assert verify(path).ok
    with open_dataset(path) as ds:
        idx = ds.payload.index(0)
        middle = int(idx.offsets[1] + idx.nbytes[1] // 2)
    shard = _shard_file(path)
    data = bytearray(shard.read_bytes())
    data[middle] ^= 0x10
    shard.write_bytes(bytes(data))
    report = verify(path)
    assert not report.ok and any("crc32c" in p for p in map(str, report.problems))


def test_convert_reports_ratio_and_psnr_and_info_shows_both(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    out = tmp_path / "jpeg"
    result = run_cli("convert", str(ROOT / "datasets" / "imagefolder"), "-o", str(out), "--compression", "jpeg:90",
                     "--size", "64x64")
    assert result.returncode == 0, result.stderr
    with open_dataset(out) as ds:
        sample = ds.meta.source["compression_sample"]
        stored = sum(s.nbytes for s in ds.meta.shards)
        decoded = ds.meta.num_records * ds.meta.record.nbytes
    assert sample["records"] == 23 and sample["psnr_db"] >= 30 and sample["min_psnr_db"] <= sample["psnr_db"]
    assert stored * 3 < decoded
    for text in (result.stdout, run_cli("info", str(out)).stdout):
        assert "compression  jpeg (quality=90): " in text and "x (" in text
        assert f"quality      PSNR {sample['psnr_db']} dB on average" in text
    report = json.loads(run_cli("info", str(out), "--json").stdout)["compression_report"]
    assert report == {"codec": {"name": "jpeg", "quality": 90}, "stored_bytes": stored - len(ds.meta.shards) * index_nbytes(
        ds.meta.records_per_shard), "decoded_bytes": decoded, "ratio": report["ratio"], "psnr_db": sample["psnr_db"],
        "min_psnr_db": sample["min_psnr_db"], "snr_db": None, "min_snr_db": None, "sampled_records": 23}
    assert report["ratio"] == round(decoded / report["stored_bytes"], 2) and report["ratio"] > 3


def test_lossless_conversion_records_no_psnr(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    out = tmp_path / "png"
    result = run_cli("convert", str(ROOT / "datasets" / "imagefolder"), "-o", str(out), "--compression", "png",
                     "--size", "32x32")
    assert result.returncode == 0, result.stderr
    with open_dataset(out) as ds:
        assert "compression_sample" not in ds.meta.source
    assert "compression  png (level=6): " in result.stdout and "PSNR" not in result.stdout


def test_compression_auto_picks_lossless_and_shows_every_image_option(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    out = tmp_path / "auto"
    result = run_cli("convert", str(ROOT / "datasets" / "imagefolder"), "-o", str(out), "--compression", "auto",
                     "--size", "32x32")
    assert result.returncode == 0, result.stderr
    for option in ("jpeg:90", "webp:90", "jpegxl:90", "png", "webp:lossless", "jpegxl:lossless", "zstd"):
        assert f"--compression auto: {option} " in result.stderr
    with open_dataset(out) as ds:
        assert ds.meta.compression is not None
        codec = get_codec(ds.meta.compression["name"], **{k: v for k, v in ds.meta.compression.items() if k != "name"})
        assert codec is not None and not codec.is_lossy()


def test_compression_auto_is_flac_for_int16_audio(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    out = tmp_path / "auto"
    result = run_cli("convert", str(ROOT / "datasets" / "speech"), "-o", str(out), "--kind", "audio", "--compression", "auto")
    assert result.returncode == 0, result.stderr
    with open_dataset(out) as ds:
        assert ds.meta.record.dtype == "int16" and ds.meta.compression == {"name": "flac", "level": 5}
    # It says what the lossy audio codecs would give, at the records' rate, and picks neither.
    for option in ("flac", "zstd", "opus", "vorbis"):
        assert f"--compression auto: {option} " in result.stderr
    assert "--compression auto: opus              " in result.stderr and " SNR " in result.stderr
