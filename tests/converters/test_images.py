"""Image decoding: every Pillow mode to correct RGB, EXIF orientation, bad files, the transform."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.converters.images import ImageTransform, open_image, parse_hw, to_rgb
from shardkit.errors import ConfigError, InputFileError
from tests.helpers.corpora import add_bad_images, natural_image, save_jpeg


def _rgb(img: Image.Image) -> np.ndarray:
    out = to_rgb(img)
    assert out.mode == "RGB"
    return np.asarray(out)


def test_every_mode_becomes_correct_rgb() -> None:
    g = np.array([[0, 128, 255]], dtype=np.uint8)
    # 1 and L: grey replicated.
    assert _rgb(Image.fromarray(g > 100).convert("1")).tolist() == [[[0] * 3, [255] * 3, [255] * 3]]
    assert _rgb(Image.fromarray(g, "L")).tolist() == [[[0] * 3, [128] * 3, [255] * 3]]
    # LA / RGBA: composited over white, not dropped (a transparent black pixel is white).
    la = Image.fromarray(np.array([[[0, 255], [128, 0], [0, 128]]], np.uint8), "LA")
    assert np.abs(_rgb(la).astype(int) - [[[0] * 3, [255] * 3, [127] * 3]]).max() <= 1
    rgba = np.array([[[255, 0, 0, 255], [0, 0, 0, 0], [0, 0, 255, 128]]], np.uint8)
    got = _rgb(Image.fromarray(rgba, "RGBA")).astype(int)
    assert np.abs(got - [[[255, 0, 0], [255, 255, 255], [127, 127, 255]]]).max() <= 1
    # P with a transparent palette index.
    p = Image.new("P", (2, 1))
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    p.putdata([0, 1])
    p.info["transparency"] = 0
    assert _rgb(p).tolist() == [[[255, 255, 255], [200, 100, 50]]]
    p.info.pop("transparency")
    assert _rgb(p).tolist() == [[[10, 20, 30], [200, 100, 50]]]
    # CMYK: Pillow's conversion (pure cyan -> (0, 255, 255)).
    cmyk = Image.new("CMYK", (1, 1), (255, 0, 0, 0))
    assert _rgb(cmyk).tolist() == [[[0, 255, 255]]]
    # I;16: scaled by 1/257, not clipped at 255.
    i16 = Image.frombytes("I;16", (3, 1), np.array([0, 32896, 65535], "<u2").tobytes())
    assert _rgb(i16)[0, :, 0].tolist() == [0, 128, 255]
    # I: read as 16-bit data.
    i32 = Image.fromarray(np.array([[0, 32896, 65535]], np.int32), "I")
    assert _rgb(i32)[0, :, 0].tolist() == [0, 128, 255]
    # F: intensities in 0..1.
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32), "F")
    assert _rgb(f)[0, :, 0].tolist() == [0, 128, 255]


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    arr = np.zeros((40, 100, 3), np.uint8)
    arr[:, :10] = 255  # white stripe on the left of the stored pixels
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    img.save(tmp_path / "r.jpg", quality=95, exif=exif)
    up, orientation, stored = open_image(tmp_path / "r.jpg")
    assert orientation == 6 and stored == (100, 40) and up.size == (40, 100)
    a = np.asarray(up.convert("L"))
    assert a[:10].mean() > 200 and a[20:].mean() < 30  # the stripe is now on top


@pytest.mark.parametrize("resize,crop,size,expected", [
    ("shorter", "center", (50, 50), (25, 0)),   # 200x100 -> 100x50, cut 25 left and right
    ("longer", "pad", (50, 50), (0, 0)),        # 200x100 -> 50x25 at top-left
    ("longer", "center", (50, 50), (0, -12)),   # 50x25 centred: 12 rows of padding on top
])
def test_geometry(resize: str, crop: str, size: tuple[int, int], expected: tuple[int, int]) -> None:
    t = ImageTransform(*size, resize=resize, crop=crop)
    geo = t.geometry(200, 100)
    assert (geo.off_x, geo.off_y) == expected
    img = Image.fromarray(natural_image(100, 200, 1))
    out, _ = t.apply(img)
    assert out.shape == (50, 50, 3) and out.dtype == np.uint8
    if crop == "pad":
        assert (out[25:] == 0).all() and out[:25].std() > 5
    if (resize, crop) == ("longer", "center"):
        assert (out[:12] == 0).all() and (out[37:] == 0).all()


def test_transform_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="needs resize 'longer'"):
        ImageTransform(32, 32, resize="shorter", crop="pad")
    with pytest.raises(ConfigError, match="interpolation"):
        ImageTransform(32, 32, interpolation="cubic-ish")
    with pytest.raises(ConfigError, match=r"^size: expected H or HxW"):
        parse_hw("12y4")
    with pytest.raises(ConfigError, match=r"^--size: expected H or HxW"):
        parse_hw("0x4", "--size")
    assert parse_hw("224x320") == (224, 320) and parse_hw(64) == (64, 64) and parse_hw(" 8 x 9 ") == (8, 9)
    assert ImageTransform.from_options({"crop": "pad"}, str).resize == "longer"
    with pytest.raises(ConfigError, match=r"^crop pad keeps every pixel, so it needs resize longer"):
        ImageTransform.from_options({"crop": "pad", "resize": "shorter"}, str)


def test_bad_images_raise_categorised_input_errors(tmp_path: Path) -> None:
    expected = add_bad_images(tmp_path / "bad")
    t = ImageTransform(32, 32)
    for name, category in expected.items():
        if name == "notes.txt":
            continue  # extension check belongs to the folder scan
        with pytest.raises(InputFileError) as info:
            t.load(tmp_path / "bad" / name)
        assert info.value.reason.split(":")[0] == category, (name, info.value.reason)
        assert str(tmp_path / "bad" / name) in str(info.value)


def test_truncated_images_fail_even_if_someone_enabled_load_truncated(tmp_path: Path) -> None:
    from PIL import ImageFile

    add_bad_images(tmp_path)
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        with pytest.raises(InputFileError, match="truncated"):
            ImageTransform(32, 32).load(tmp_path / "truncated.jpg")
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_max_pixels_option_is_the_bomb_limit(tmp_path: Path) -> None:
    save_jpeg(tmp_path / "a.jpg", natural_image(100, 100, 2))
    with pytest.raises(InputFileError, match="too-large"):
        ImageTransform(32, 32, max_pixels=1000).load(tmp_path / "a.jpg")
    loaded = ImageTransform(32, 32, max_pixels=20000).load(tmp_path / "a.jpg")
    assert loaded.array.shape == (32, 32, 3) and loaded.stored_size == (100, 100) and loaded.orientation == 1
    assert Image.MAX_IMAGE_PIXELS != 1000  # the process-wide limit is restored

