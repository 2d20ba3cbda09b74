#!/usr/bin/env python3
"""Rebuild shardkit's bundled sample corpora from extracted Debian packages.

This script documents, and can reproduce, where every file under
``datasets/`` came from.  It is *not* run by CI: the corpora are committed.

It builds three small corpora of real (not synthetic) data:

``coco/``
    ~20 photographs in the official COCO "instances" layout
    (``annotations/instances_val.json`` + ``val/*.jpg``).  The boxes,
    polygons and the crowd RLE mask were placed **by hand** for testing
    (see :data:`COCO_IMAGES`); they are not from the COCO dataset.  The
    category ids/names/supercategories are the real COCO (things, 1-90) and
    COCO-Stuff (stuff, 92-182) ones, hence non-contiguous.
``imagefolder/``
    ImageNet-style ``{train,val}/<class>/<file>`` folders (see
    :data:`FOLDER_IMAGES`), including a PNG, an RGBA PNG, a natively
    grayscale JPEG and a JPEG whose pixels are stored rotated with an EXIF
    Orientation tag.
``speech/``
    Speech-Commands-style ``<word>/<speaker>_nohash_<n>.wav`` recordings
    of single English words (8 kHz, 16-bit, mono, as in the source) plus
    ``validation_list.txt`` and ``testing_list.txt``; one file is converted
    to FLAC (see :data:`SPEECH_FILES`).

Sources (Debian 12 "bookworm" packages)::

    mate-backgrounds              1.26.0-1
    plasma-workspace-wallpapers   4:5.27.5-2
    lomiri-wallpapers-16.04       20.04.0-2
    lomiri-wallpapers-20.04       20.04.0-2
    asterisk-core-sounds-en-wav   1.6.1-1

Usage::

    apt-get update
    cd "$(mktemp -d)"
    for p in mate-backgrounds plasma-workspace-wallpapers \\
             lomiri-wallpapers-16.04 lomiri-wallpapers-20.04 \\
             asterisk-core-sounds-en-wav; do
        apt-get download "$p" && mkdir -p "x/$p" && dpkg -x "$p"_*.deb "x/$p"
    done
    python /path/to/shardkit/datasets/make_samples.py x/*   # writes next to itself

Each positional argument is the root of one extracted package (the
directory holding ``usr/``); the package name is read from its
``usr/share/doc/<name>/`` directory.  Requires Pillow, numpy and soundfile.
Output is deterministic for a given Pillow/libjpeg/libsndfile version.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image, ImageDraw

LOG = logging.getLogger("make_samples")
Image.MAX_IMAGE_PIXELS = None  # some sources are 6028x3391

JPEG_QUALITY = 85

# ---------------------------------------------------------------------------
# Provenance of every source file.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One original file inside an extracted Debian package."""

    package: str
    path: str  # relative to the extracted package root
    copyright: str  # "Copyright:" line(s) of the package's debian/copyright
    licence: str  # "License:" short name of the package's debian/copyright
    year: int  # year of the copyright line (COCO date_captured if no EXIF date)


_MATE = "usr/share/backgrounds/mate/nature/"
_L16 = "usr/share/backgrounds/"
_PLASMA = "usr/share/wallpapers/{}/contents/images/2560x1600.jpg"
# plasma-workspace-wallpapers' debian/copyright has a single stanza
# ("Files: *  Copyright: 2014 KDE Visual Design Group  License: GPL-2+"); each
# wallpaper's upstream metadata.json names the photographer and "LGPLv3".
_PLASMA_LIC = "GPL-2+ (debian/copyright); LGPLv3 (upstream metadata.json)"


def _plasma(name: str, author: str) -> Source:
    return Source(
        "plasma-workspace-wallpapers",
        _PLASMA.format(name),
        f"2014 KDE Visual Design Group http://vdesign.kde.org/ "
        f"(photograph by {author}, per metadata.json)",
        _PLASMA_LIC,
        2014,
    )


SOURCES: dict[str, Source] = {
    # mate-backgrounds 1.26.0-1, usr/share/backgrounds/mate/nature/
    "aqua": Source("mate-backgrounds", _MATE + "Aqua.jpg",
                   "2008, Charles Barbin <barbinch@free.fr>", "GPL-2+", 2008),
    "blinds": Source("mate-backgrounds", _MATE + "Blinds.jpg",
                     "2008, Lennart Poettering <mztabzr@0pointer.de>; "
                     "2008, Andrea Cimitan", "GPL-2+", 2008),
    "dune": Source("mate-backgrounds", _MATE + "Dune.jpg",
                   "2007, Marco Cogoni <cogoni@gmail.com>; "
                   "2008, Hylke Bons <hylkebons@gmail.com>", "GPL-2+", 2007),
    "freshflower": Source("mate-backgrounds", _MATE + "FreshFlower.jpg",
                          "2005, Jens Ansorg <jens@ansorg-web.de>", "GPL-2+", 2005),
    "garden": Source("mate-backgrounds", _MATE + "Garden.jpg",
                     "2008, Charles Barbin <barbinch@free.fr>", "GPL-2+", 2008),
    "greenmeadow": Source("mate-backgrounds", _MATE + "GreenMeadow.jpg",
                          "2005, Timothy Schellhase; 2008, Lapo Calamandrei",
                          "GPL-2+", 2005),
    "ladybird": Source("mate-backgrounds", _MATE + "LadyBird.jpg",
                       "2008, Charles Barbin <barbinch@free.fr>", "GPL-2+", 2008),
    "raindrops": Source("mate-backgrounds", _MATE + "RainDrops.jpg",
                        '2008, "blackcombwhistler07" '
                        "<blackcombwhistler07@googlemail.com>", "GPL-2+", 2008),
    "storm": Source("mate-backgrounds", _MATE + "Storm.jpg",
                    "2008, Sergey Nazarov <phearnot@renee.ru>", "GPL-2+", 2008),
    "twowings": Source("mate-backgrounds", _MATE + "TwoWings.jpg",
                       "2008, Charles Barbin <barbinch@free.fr>; "
                       "2008, Hylke Bons <hylkebons@gmail.com>", "GPL-2+", 2008),
    "wood": Source("mate-backgrounds", _MATE + "Wood.jpg",
                   "2008, Jean-François Fortin Tam <nekohayo@gmail.com>",
                   "GPL-2+", 2008),
    "yellowflower": Source("mate-backgrounds", _MATE + "YellowFlower.jpg",
                           "2008, Charles Barbin <barbinch@free.fr>", "GPL-2+", 2008),
    # lomiri-wallpapers-16.04 20.04.0-2, usr/share/backgrounds/
    "aitzgorri": Source("lomiri-wallpapers-16.04",
                        _L16 + "aitzgorri_by_Aitzol_Berasategi.jpg",
                        "Aitzol Berasategi, 2018", "CC-BY-4.0", 2018),
    "bridge": Source("lomiri-wallpapers-16.04",
                     _L16 + "Bridge_by_Sander_Klootwijk.jpg",
                     "2018. Sander Klootwijk", "CC-BY-SA-4.0", 2018),
    "dragonfly": Source("lomiri-wallpapers-16.04", _L16 + "Dragonfly_by_Bolly.jpg",
                        '"Bolly", 2018', "CC-BY-SA-4.0", 2018),
    "free": Source("lomiri-wallpapers-16.04", _L16 + "free_by_Peter_Nerlich.jpg",
                   "Peter Nerlich, 2018", "CC-BY-SA-4.0", 2018),
    "friends": Source("lomiri-wallpapers-16.04",
                      _L16 + "friends_by_Aitzol_Berasategi.jpg",
                      "Aitzol Berasategi, 2018", "CC-BY-4.0", 2018),
    "greentock": Source("lomiri-wallpapers-16.04",
                        _L16 + "greentock_by_Peter_Nerlich.jpg",
                        "Peter Nerlich, 2018", "CC-BY-SA-4.0", 2018),
    "life": Source("lomiri-wallpapers-16.04", _L16 + "life_by_Aitzol_Berasategi.jpg",
                   "Aitzol Berasategi, 2018", "CC-BY-4.0", 2018),
    "picosdeeuropa": Source("lomiri-wallpapers-16.04",
                            _L16 + "picosdeeuropa_by_Aitzol_Berasategi.jpg",
                            "Aitzol Berasategi, 2018", "CC-BY-4.0", 2018),
    "fig": Source("lomiri-wallpapers-16.04", _L16 + "Picture_0B_by_freespace.jpg",
                  'Trevor "Freespace", 2018', "CC-BY-4.0", 2018),
    "brushes": Source("lomiri-wallpapers-16.04", _L16 + "Picture_1A_by_freespace.jpg",
                      'Trevor "Freespace", 2018', "CC-BY-4.0", 2018),
    "seeding": Source("lomiri-wallpapers-16.04",
                      _L16 + "seeding_by_Clements_Engelhardt.jpg",
                      "Clemens Engelhardt, 2018", "CC0-1.0", 2018),
    "sunset": Source("lomiri-wallpapers-16.04",
                     _L16 + "sunset_by_Aitzol_Berasategi.jpg",
                     "Aitzol Berasategi, 2018", "CC-BY-4.0", 2018),
    "wine": Source("lomiri-wallpapers-16.04", _L16 + "Wine_by_Jakkub_Mede.jpg",
                   "Jakub Mede, 2018", "CC-BY-4.0", 2018),
    # lomiri-wallpapers-20.04 20.04.0-2, usr/share/backgrounds/
    "kleiber": Source("lomiri-wallpapers-20.04", _L16 + "Kleiber_by_Lukas_Baubkus.jpg",
                      "2021, Lukas Baubkus", "CC-BY-SA-3.0", 2021),
    # plasma-workspace-wallpapers 4:5.27.5-2, usr/share/wallpapers/<Name>/
    "coldripple": _plasma("ColdRipple", "Risto Saukonpää <paristo@gmail.com>"),
    "colorfulcups": _plasma("ColorfulCups", "Dmitri Popov <dmpop@linux.com>"),
    "eveningglow": _plasma("EveningGlow", "Ian Hex"),
    "fallenleaf": _plasma("FallenLeaf", "Martin Klapetek <mklapetek@kde.org>"),
    "grey": _plasma("Grey", "Sigi Sagi <sigi-sagi@gmx.de>"),
    "kite": _plasma("Kite", "Risto Saukonpää <paristo@gmail.com>"),
    "onestandsout": _plasma("OneStandsOut", "Risto Saukonpää <paristo@gmail.com>"),
    "path": _plasma("Path", "Risto Saukonpää <paristo@gmail.com>"),
    "summer1am": _plasma("summer_1am", "Risto Saukonpää <paristo@gmail.com>"),
}

# COCO "licenses" entries; keyed by the Source.licence string.
LICENCES: dict[str, tuple[int, str, str]] = {
    "GPL-2+": (1, "GNU General Public License v2 or later (GPL-2+)",
               "https://www.gnu.org/licenses/old-licenses/gpl-2.0.html"),
    "CC-BY-4.0": (2, "Attribution 4.0 International (CC-BY-4.0)",
                  "https://creativecommons.org/licenses/by/4.0/"),
    "CC-BY-SA-4.0": (3, "Attribution-ShareAlike 4.0 International (CC-BY-SA-4.0)",
                     "https://creativecommons.org/licenses/by-sa/4.0/"),
    "CC-BY-SA-3.0": (4, "Attribution-ShareAlike 3.0 Unported (CC-BY-SA-3.0)",
                     "https://creativecommons.org/licenses/by-sa/3.0/"),
    "CC0-1.0": (5, "CC0 1.0 Universal Public Domain Dedication (CC0-1.0)",
                "https://creativecommons.org/publicdomain/zero/1.0/"),
    _PLASMA_LIC: (6, "LGPLv3 per upstream metadata.json; GPL-2+ per debian/copyright",
                  "https://www.gnu.org/licenses/lgpl-3.0.html"),
}

# ---------------------------------------------------------------------------
# Image preparation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Crop:
    """Where to cut the output's aspect ratio out of the source.

    The largest window with the output's aspect ratio that fits the source is
    shrunk by ``zoom`` (1.0 = largest window), centred on the source-fraction
    point ``focus`` and clamped to the image.
    """

    focus: tuple[float, float] = (0.5, 0.5)
    zoom: float = 1.0


def crop_resize(im: Image.Image, size: tuple[int, int], crop: Crop,
                mode: str = "RGB") -> Image.Image:
    """Cut a window of ``size``'s aspect ratio from ``im``, resize it to ``size``.

    The result is converted to ``mode``.
    """
    sw, sh = im.size
    tw, th = size
    aspect = tw / th
    if sw / sh > aspect:
        ch = sh / crop.zoom
        cw = ch * aspect
    else:
        cw = sw / crop.zoom
        ch = cw / aspect
    cx, cy = crop.focus[0] * sw, crop.focus[1] * sh
    left = min(max(cx - cw / 2, 0.0), sw - cw)
    top = min(max(cy - ch / 2, 0.0), sh - ch)
    box = (left, top, left + cw, top + ch)
    # draft() lets libjpeg decode big sources at a reduced scale first.
    im.draft(mode, (int(sw * tw / cw), int(sh * th / ch)))
    im = im.convert(mode)
    fx, fy = im.size[0] / sw, im.size[1] / sh
    box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
    return im.resize(size, Image.Resampling.LANCZOS, box=box)


def load_source(roots: dict[str, Path], key: str) -> Image.Image:
    """Open the source image ``key`` from its extracted package."""
    src = SOURCES[key]
    path = roots[src.package] / src.path
    im = Image.open(path)
    LOG.debug("loaded %s (%s, %dx%d)", path, im.mode, *im.size)
    return im


def date_captured(im: Image.Image, src: Source) -> str:
    """COCO ``date_captured``: EXIF DateTimeOriginal, else Jan 1 of the copyright year."""
    raw = im.getexif().get_ifd(0x8769).get(0x9003)  # Exif IFD -> DateTimeOriginal
    if isinstance(raw, str) and len(raw) >= 19:
        return raw[:10].replace(":", "-") + raw[10:19]
    return f"{src.year}-01-01 00:00:00"


def save_jpeg(im: Image.Image, path: Path, exif: Image.Exif | None = None) -> None:
    """Save a baseline JPEG without any metadata except ``exif``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    exif_bytes = exif.tobytes() if exif is not None else b""
    im.save(path, "JPEG", quality=JPEG_QUALITY, optimize=True, exif=exif_bytes)


# ---------------------------------------------------------------------------
# COCO corpus
# ---------------------------------------------------------------------------

# (id, name, supercategory): COCO 2017 things and COCO-Stuff 2017 stuff ids.
CATEGORIES: list[tuple[int, str, str]] = [
    (9, "boat", "vehicle"),
    (16, "bird", "animal"),
    (18, "dog", "animal"),
    (38, "kite", "sports"),
    (44, "bottle", "kitchen"),
    (46, "wine glass", "kitchen"),
    (47, "cup", "kitchen"),
    (51, "bowl", "kitchen"),
    (67, "dining table", "furniture"),
    (85, "clock", "indoor"),
    (95, "bridge", "building"),
    (106, "clouds", "sky"),
    (119, "flower", "plant"),
    (122, "fruit", "food-stuff"),
    (124, "grass", "plant"),
    (135, "mountain", "solid"),
    (142, "plant-other", "plant"),
    (148, "river", "water"),
    (149, "road", "ground"),
    (150, "rock", "solid"),
    (154, "sand", "ground"),
    (155, "sea", "water"),
    (157, "sky-other", "sky"),
    (169, "tree", "plant"),
]
CAT_ID = {name: cid for cid, name, _ in CATEGORIES}

Point = tuple[float, float]


@dataclass(frozen=True)
class Ann:
    """A hand-placed annotation in output-image pixels.

    Give either ``box`` (x, y, w, h; the segmentation is then the box
    outline) or ``poly`` (a hand-traced outline; bbox and area follow from
    it).  ``crowd=True`` turns ``poly`` into an uncompressed RLE mask with
    ``iscrowd=1``.
    """

    cat: str
    box: tuple[float, float, float, float] | None = None
    poly: tuple[Point, ...] | None = None
    crowd: bool = False


@dataclass(frozen=True)
class CocoImage:
    """One image of the COCO corpus."""

    image_id: int
    source: str
    size: tuple[int, int]
    crop: Crop = Crop()
    anns: tuple[Ann, ...] = ()


def B(cat: str, x: float, y: float, w: float, h: float) -> Ann:
    """Shorthand for a box annotation."""
    return Ann(cat, box=(x, y, w, h))


def P(cat: str, *xy: float, crowd: bool = False) -> Ann:
    """Shorthand for a polygon annotation given as flat x1, y1, x2, y2, ..."""
    pts = tuple((xy[i], xy[i + 1]) for i in range(0, len(xy), 2))
    return Ann(cat, poly=pts, crowd=crowd)


# Boxes/polygons were placed by looking at each *output* image (after crop and
# resize) on a pixel grid.  They are plausible, not pixel-exact.
COCO_IMAGES: list[CocoImage] = [
    CocoImage(1, "eveningglow", (640, 427), anns=(  # rowing boats on a lake shore
        B("boat", 0, 222, 86, 68),
        B("boat", 0, 217, 182, 183),
        B("boat", 192, 210, 78, 117),
        P("boat", 275, 205, 420, 200, 560, 196, 640, 190, 640, 275, 560, 282,
          490, 290, 392, 300, 275, 300, crowd=True),  # the row of boats behind
    )),
    CocoImage(2, "kite", (500, 375), anns=(
        B("kite", 336, 113, 41, 40),
        B("clouds", 0, 20, 38, 215),
        B("clouds", 405, 0, 95, 95),
    )),
    CocoImage(3, "friends", (375, 500), Crop((0.5, 0.4)), anns=(  # two spaniels
        B("dog", 112, 128, 84, 100),
        B("dog", 172, 250, 79, 122),
    )),
    CocoImage(4, "kleiber", (500, 375), Crop((0.42, 0.52), 1.4), anns=(  # nuthatch
        P("bird", 238, 97, 255, 130, 270, 175, 290, 205, 320, 220, 338, 237,
          361, 250, 330, 252, 300, 258, 260, 255, 245, 240, 236, 200, 232, 150,
          236, 110),
        P("tree", 0, 0, 225, 0, 222, 60, 230, 120, 240, 200, 250, 260, 262, 320,
          272, 375, 0, 375),
    )),
    CocoImage(5, "fig", (640, 427), anns=(  # half a fig in a red bowl
        P("bowl", 143, 210, 200, 130, 300, 70, 450, 55, 560, 80, 620, 150,
          633, 250, 610, 330, 550, 390, 450, 422, 330, 400, 230, 330, 160, 260),
        P("fruit", 265, 200, 300, 195, 320, 165, 360, 152, 410, 160, 443, 190,
          447, 240, 430, 280, 395, 310, 350, 320, 320, 300, 305, 250, 300, 215,
          268, 212),
    )),
    CocoImage(6, "greentock", (500, 375), anns=(  # close-up of a wall clock
        P("clock", 10, 40, 30, 0, 500, 0, 500, 375, 225, 375, 150, 320, 80, 240,
          30, 160, 12, 100),
    )),
    CocoImage(7, "colorfulcups", (640, 427), anns=(  # plastic cups from above
        B("cup", 153, 163, 163, 112),
        B("cup", 253, 243, 185, 152),
        B("cup", 297, 88, 141, 88),
        P("cup", 405, 0, 640, 0, 640, 427, 555, 427, 545, 340, 500, 270, 440, 200,
          440, 90, crowd=True),  # the pink/red cups on the right
    )),
    CocoImage(8, "wine", (375, 500), Crop((0.5, 0.42)), anns=(
        B("bottle", 173, 66, 26, 121),
        B("wine glass", 140, 110, 30, 82),
        B("dining table", 105, 160, 248, 168),
    )),
    CocoImage(9, "picosdeeuropa", (500, 375), anns=(
        P("mountain", 0, 70, 20, 72, 50, 100, 75, 125, 120, 130, 150, 160,
          185, 165, 215, 145, 225, 90, 260, 78, 300, 82, 330, 92, 360, 95,
          400, 85, 440, 80, 470, 60, 500, 50, 500, 250, 440, 250, 330, 225,
          230, 205, 200, 195, 160, 180, 100, 170, 50, 165, 0, 160),
        B("clouds", 25, 25, 210, 140),
        P("grass", 0, 165, 100, 175, 200, 200, 300, 225, 420, 248, 500, 255,
          500, 375, 0, 375),
    )),
    CocoImage(10, "aitzgorri", (640, 427), anns=(
        P("mountain", 30, 100, 70, 88, 110, 72, 150, 68, 200, 65, 260, 62,
          300, 55, 345, 50, 400, 65, 450, 60, 500, 62, 540, 70, 565, 85,
          600, 95, 625, 100, 625, 190, 560, 220, 470, 230, 400, 230, 330, 180,
          250, 160, 150, 130, 60, 110),
        B("tree", 450, 170, 52, 128),
        P("grass", 0, 255, 150, 262, 300, 280, 420, 290, 520, 300, 640, 325,
          640, 427, 0, 427),
    )),
    CocoImage(11, "sunset", (640, 427), anns=(
        B("sky-other", 0, 0, 640, 185),
        P("mountain", 0, 215, 100, 205, 200, 195, 300, 195, 380, 195, 450, 190,
          520, 190, 560, 182, 600, 180, 640, 178, 640, 245, 500, 250, 400, 240,
          300, 235, 200, 240, 100, 250, 0, 250),
        P("grass", 0, 280, 150, 270, 300, 260, 420, 245, 550, 240, 640, 250,
          640, 427, 0, 427),
    )),
    CocoImage(12, "life", (427, 640), anns=(  # a stream between rocks
        P("river", 150, 300, 235, 290, 300, 280, 330, 300, 330, 340, 250, 360,
          230, 420, 225, 470, 215, 500, 260, 540, 330, 560, 300, 590, 380, 600,
          400, 640, 0, 640, 0, 600, 30, 560, 60, 480, 110, 450, 140, 420,
          165, 380, 200, 330),
        B("rock", 225, 300, 202, 330),
        B("rock", 10, 385, 140, 85),
        B("tree", 0, 0, 427, 190),
    )),
    CocoImage(13, "path", (375, 500), anns=(  # spruce forest
        B("tree", 118, 0, 35, 345),
        B("tree", 172, 0, 27, 300),
        B("tree", 240, 0, 22, 270),
        B("plant-other", 0, 225, 375, 275),
    )),
    CocoImage(14, "dune", (500, 375), anns=(  # dune grass, sea behind
        B("sky-other", 0, 0, 500, 112),
        B("sea", 0, 112, 500, 58),
        P("grass", 0, 160, 100, 175, 200, 185, 300, 170, 400, 160, 500, 165,
          500, 375, 0, 375),
    )),
    CocoImage(15, "storm", (640, 427), anns=(  # storm clouds over a road
        B("clouds", 0, 0, 640, 262),
        B("road", 0, 290, 640, 137),
    )),
    CocoImage(16, "yellowflower", (500, 375), anns=(
        P("flower", 70, 200, 140, 130, 135, 100, 180, 30, 270, 20, 330, 0,
          500, 0, 500, 375, 75, 375, 100, 300, 72, 230),
    )),
    CocoImage(17, "ladybird", (500, 375), anns=(  # forget-me-nots (ladybird: no category)
        B("flower", 0, 55, 55, 95),
        B("flower", 300, 222, 82, 75),
        B("flower", 325, 288, 100, 80),
    )),
    CocoImage(18, "bridge", (500, 375), anns=(  # looking up through bridge struts
        B("sky-other", 0, 0, 500, 300),
        B("sand", 0, 322, 500, 53),
        P("bridge", 72, 375, 330, 235, 500, 148, 500, 162, 340, 245, 100, 375),
    )),
    CocoImage(19, "wood", (500, 375)),  # deliberately unannotated (plank texture)
    CocoImage(20, "seeding", (427, 640), Crop((0.3, 0.5)), anns=(  # dandelion clocks
        P("flower", 25, 230, 40, 150, 80, 100, 150, 55, 230, 45, 300, 55,
          350, 90, 380, 150, 390, 240, 370, 300, 330, 340, 250, 355, 170, 340,
          100, 310, 40, 280),
        B("flower", 170, 358, 115, 95),
    )),
]


def polygon_area(pts: Sequence[Point]) -> float:
    """Shoelace area of a simple polygon."""
    s = 0.0
    for (x1, y1), (x2, y2) in zip(pts, list(pts[1:]) + [pts[0]], strict=True):
        s += x1 * y2 - x2 * y1
    return abs(s) / 2.0


def rasterize(pts: Sequence[Point], size: tuple[int, int]) -> np.ndarray:
    """Binary mask (h, w) of a polygon."""
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).polygon([(float(x), float(y)) for x, y in pts], fill=1)
    return np.asarray(mask, dtype=np.uint8)


def rle_encode(mask: np.ndarray) -> dict[str, list[int]]:
    """Uncompressed COCO RLE: column-major run lengths, starting with zeros."""
    flat = mask.flatten(order="F")
    counts: list[int] = []
    current, run = 0, 0
    for v in flat:
        if v != current:
            counts.append(run)
            current, run = v, 0
        run += 1
    counts.append(run)
    h, w = mask.shape
    return {"counts": counts, "size": [h, w]}


def coco_annotation(ann: Ann, ann_id: int, image_id: int,
                    size: tuple[int, int]) -> dict[str, object]:
    """Build one COCO annotation dict in output pixels."""
    w, h = size
    if ann.crowd:
        assert ann.poly is not None, "crowd annotations need a polygon"
        mask = rasterize(ann.poly, size)
        ys, xs = np.nonzero(mask)
        x0, y0 = int(xs.min()), int(ys.min())
        bbox: list[float] = [x0, y0, int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1]
        seg: object = rle_encode(mask)
        area = float(mask.sum())
    elif ann.poly is not None:
        xs_, ys_ = [p[0] for p in ann.poly], [p[1] for p in ann.poly]
        bbox = [min(xs_), min(ys_), max(xs_) - min(xs_), max(ys_) - min(ys_)]
        seg = [[round(float(c), 1) for p in ann.poly for c in p]]
        area = polygon_area(ann.poly)
    else:
        assert ann.box is not None
        x, y, bw, bh = ann.box
        bbox = [x, y, bw, bh]
        seg = [[float(c) for c in (x, y, x + bw, y, x + bw, y + bh, x, y + bh)]]
        area = bw * bh
    bx, by, bw_, bh_ = bbox
    if bx < 0 or by < 0 or bx + bw_ > w or by + bh_ > h or bw_ <= 0 or bh_ <= 0:
        raise ValueError(f"image {image_id}: box {bbox} outside {w}x{h}")
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": CAT_ID[ann.cat],
        "segmentation": seg,
        "area": round(float(area), 2),
        "bbox": [round(float(v), 2) for v in bbox],
        "iscrowd": int(ann.crowd),
    }


def build_coco(roots: dict[str, Path], out: Path) -> None:
    """Write coco/val/*.jpg and coco/annotations/instances_val.json."""
    images: list[dict[str, object]] = []
    annotations: list[dict[str, object]] = []
    used_licences: dict[int, tuple[int, str, str]] = {}
    ann_id = 1
    for spec in COCO_IMAGES:
        src = SOURCES[spec.source]
        original = load_source(roots, spec.source)
        captured = date_captured(original, src)
        im = crop_resize(original, spec.size, spec.crop)
        name = f"{spec.image_id:012d}.jpg"
        save_jpeg(im, out / "coco" / "val" / name)
        lic = LICENCES[src.licence]
        used_licences[lic[0]] = lic
        images.append({
            "license": lic[0],
            "file_name": name,
            "coco_url": "",
            "height": spec.size[1],
            "width": spec.size[0],
            "date_captured": captured,
            "flickr_url": "",
            "id": spec.image_id,
        })
        for ann in spec.anns:
            annotations.append(coco_annotation(ann, ann_id, spec.image_id, spec.size))
            ann_id += 1
        LOG.info("coco %s <- %s:%s (%d anns)", name, src.package, src.path,
                 len(spec.anns))
    doc = {
        "info": {
            "description": "shardkit COCO-format sample: real photographs from "
                           "Debian wallpaper packages, hand-placed annotations "
                           "(not from the COCO dataset)",
            "url": "",
            "version": "1.0",
            "year": 2026,
            "contributor": "shardkit developers",
            "date_created": "2026/11/22",
        },
        "licenses": [{"url": u, "id": i, "name": n}
                     for i, n, u in sorted(used_licences.values())],
        "images": images,
        "annotations": annotations,
        "categories": [{"supercategory": s, "id": i, "name": n}
                       for i, n, s in CATEGORIES],
    }
    path = out / "coco" / "annotations" / "instances_val.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False) + "\n", encoding="utf-8")
    LOG.info("wrote %s: %d images, %d annotations", path, len(images), len(annotations))


# ---------------------------------------------------------------------------
# ImageFolder corpus
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FolderImage:
    """One image of the ImageFolder corpus.

    ``kind`` is ``"jpeg"`` (RGB JPEG), ``"gray"`` (the source is already a
    grayscale JPEG and is kept single-channel), ``"png"`` (RGB PNG),
    ``"rgba"`` (PNG with an opaque alpha channel) or ``"exif"`` (JPEG whose
    pixels are stored rotated 90 degrees counter-clockwise with EXIF
    Orientation=6, so only an EXIF-aware reader shows it upright).
    """

    split: str
    label: str
    source: str
    size: tuple[int, int]
    crop: Crop = Crop()
    kind: str = "jpeg"

    @property
    def file_name(self) -> str:
        ext = ".png" if self.kind in ("png", "rgba") else ".jpg"
        return self.source + ext


FOLDER_IMAGES: list[FolderImage] = [
    # landscape: 8 train, 3 val
    FolderImage("train", "landscape", "dune", (400, 250)),
    FolderImage("train", "landscape", "storm", (400, 267)),
    FolderImage("train", "landscape", "aitzgorri", (400, 267)),
    FolderImage("train", "landscape", "picosdeeuropa", (400, 300)),
    FolderImage("train", "landscape", "sunset", (400, 267)),
    FolderImage("train", "landscape", "life", (300, 400)),
    FolderImage("train", "landscape", "eveningglow", (400, 250)),
    FolderImage("train", "landscape", "path", (400, 250)),
    FolderImage("val", "landscape", "summer1am", (400, 250)),
    FolderImage("val", "landscape", "bridge", (400, 225)),
    FolderImage("val", "landscape", "coldripple", (400, 250)),
    # plant: 9 train, 3 val
    FolderImage("train", "plant", "blinds", (400, 250)),
    FolderImage("train", "plant", "greenmeadow", (320, 256), kind="png"),
    FolderImage("train", "plant", "raindrops", (400, 250)),
    FolderImage("train", "plant", "onestandsout", (400, 250)),
    FolderImage("train", "plant", "dragonfly", (400, 300)),
    FolderImage("train", "plant", "fallenleaf", (400, 250)),
    FolderImage("train", "plant", "freshflower", (400, 300)),
    FolderImage("train", "plant", "garden", (400, 250)),
    FolderImage("train", "plant", "yellowflower", (400, 250)),
    FolderImage("val", "plant", "ladybird", (400, 250)),
    FolderImage("val", "plant", "twowings", (400, 250)),
    FolderImage("val", "plant", "seeding", (400, 225)),
    # object: 6 train, 3 val
    FolderImage("train", "object", "fig", (400, 270)),
    FolderImage("train", "object", "brushes", (400, 315)),
    FolderImage("train", "object", "wine", (300, 450), kind="exif"),
    FolderImage("train", "object", "greentock", (400, 300)),
    FolderImage("train", "object", "grey", (400, 250), kind="gray"),
    FolderImage("train", "object", "wood", (400, 300)),
    FolderImage("val", "object", "free", (400, 300)),
    FolderImage("val", "object", "colorfulcups", (320, 200), kind="rgba"),
    FolderImage("val", "object", "aqua", (400, 250)),
]


def exif_rotated(im: Image.Image) -> tuple[Image.Image, Image.Exif]:
    """Return pixels rotated 90 degrees CCW plus EXIF Orientation=6.

    Orientation 6 means "rotate 90 degrees clockwise to display", so
    ``ImageOps.exif_transpose`` of the result gives back ``im``.
    """
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    return im.transpose(Image.Transpose.ROTATE_90), exif


def build_imagefolder(roots: dict[str, Path], out: Path) -> None:
    """Write imagefolder/{train,val}/<class>/<file>."""
    for spec in FOLDER_IMAGES:
        im = load_source(roots, spec.source)
        if spec.kind == "gray" and im.mode != "L":
            raise ValueError(f"{spec.source} is {im.mode}, expected a grayscale source")
        im = crop_resize(im, spec.size, spec.crop, "L" if spec.kind == "gray" else "RGB")
        path = out / "imagefolder" / spec.split / spec.label / spec.file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        if spec.kind == "png":
            im.save(path, "PNG", optimize=True)
        elif spec.kind == "rgba":
            im.convert("RGBA").save(path, "PNG", optimize=True)
        elif spec.kind == "exif":
            rotated, exif = exif_rotated(im)
            save_jpeg(rotated, path, exif)
        else:
            save_jpeg(im, path)
        LOG.info("imagefolder %s <- %s (%s)", path.relative_to(out),
                 SOURCES[spec.source].path, spec.kind)


# ---------------------------------------------------------------------------
# Speech corpus
# ---------------------------------------------------------------------------

ASTERISK_DIR = "usr/share/asterisk/sounds/en_US_f_Allison/"
SPEAKER = "allison"


@dataclass(frozen=True)
class SpeechFile:
    """One single-word recording: ``<word>/allison_nohash_<n>.<ext>``."""

    word: str
    n: int
    source: str  # prompt name relative to ASTERISK_DIR, without .wav
    split: str = "train"  # train | validation | testing
    flac: bool = False

    @property
    def rel_path(self) -> str:
        return f"{self.word}/{SPEAKER}_nohash_{self.n}.{'flac' if self.flac else 'wav'}"


# Every source prompt's transcript (core-sounds-en.txt in the
# asterisk-core-sounds-en package) is exactly the class word.  Different
# prompts of one word are distinct takes (checked by cross-correlation);
# "seconds"/"queue-seconds" were the same take and are not used.
SPEECH_FILES: list[SpeechFile] = [
    SpeechFile("zero", 0, "digits/0"),
    SpeechFile("one", 0, "digits/1"),
    SpeechFile("two", 0, "digits/2"),
    SpeechFile("three", 0, "digits/3"),
    SpeechFile("four", 0, "digits/4"),
    SpeechFile("five", 0, "digits/5"),
    SpeechFile("six", 0, "digits/6"),
    SpeechFile("seven", 0, "digits/7"),
    SpeechFile("eight", 0, "digits/8"),
    SpeechFile("nine", 0, "digits/9"),
    SpeechFile("first", 0, "digits/h-1"),
    SpeechFile("first", 1, "vm-first", "validation"),
    SpeechFile("second", 0, "digits/h-2"),
    SpeechFile("second", 1, "second", "testing"),
    SpeechFile("minutes", 0, "minutes"),
    SpeechFile("minutes", 1, "queue-minutes", "validation"),
    SpeechFile("minutes", 2, "vm-minutes", "testing"),
    SpeechFile("star", 0, "digits/star"),
    SpeechFile("star", 1, "letters/ascii42", flac=True),
    SpeechFile("november", 0, "digits/mon-10"),
    SpeechFile("november", 1, "phonetic/n_p", "testing"),
    SpeechFile("goodbye", 0, "goodbye"),
    SpeechFile("goodbye", 1, "vm-goodbye", "validation"),
    SpeechFile("extension", 0, "extension"),
    SpeechFile("extension", 1, "vm-extension", "testing"),
]


def build_speech(roots: dict[str, Path], out: Path) -> None:
    """Write speech/<word>/*.wav|flac and the validation/testing lists."""
    root = roots["asterisk-core-sounds-en-wav"] / ASTERISK_DIR
    lists: dict[str, list[str]] = {"validation": [], "testing": []}
    for spec in SPEECH_FILES:
        src = root / f"{spec.source}.wav"
        dst = out / "speech" / spec.rel_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if spec.flac:
            data, rate = soundfile.read(src, dtype="int16")
            soundfile.write(dst, data, rate, format="FLAC", subtype="PCM_16")
        else:
            shutil.copyfile(src, dst)  # unchanged: 8 kHz, 16-bit PCM, mono
        if spec.split in lists:
            lists[spec.split].append(spec.rel_path)
        LOG.info("speech %s <- %s", spec.rel_path, src.name)
    for split, files in lists.items():
        (out / "speech" / f"{split}_list.txt").write_text(
            "".join(f + "\n" for f in sorted(files)), encoding="utf-8")


# ---------------------------------------------------------------------------


def find_roots(dirs: Iterable[Path]) -> dict[str, Path]:
    """Map package name -> extracted root, read from usr/share/doc/<name>/."""
    roots: dict[str, Path] = {}
    for d in dirs:
        docs = sorted(p.name for p in (d / "usr/share/doc").iterdir() if p.is_dir())
        if not docs:
            raise SystemExit(f"{d}: no usr/share/doc/<package>/ inside")
        for name in docs:
            roots[name] = d
    return roots


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", type=Path,
                        help="roots of extracted Debian packages (dpkg -x PKG.deb DIR)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="output directory (default: this script's directory)")
    parser.add_argument("--only", choices=("coco", "imagefolder", "speech"),
                        action="append", help="build only these corpora")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(message)s")
    roots = find_roots(args.packages)
    LOG.info("packages: %s", ", ".join(sorted(roots)))
    todo = args.only or ["coco", "imagefolder", "speech"]
    for corpus, fn in (("coco", build_coco), ("imagefolder", build_imagefolder),
                       ("speech", build_speech)):
        if corpus in todo:
            target = args.out / corpus
            if target.exists():
                shutil.rmtree(target)
            fn(roots, args.out)


if __name__ == "__main__":
    main()
