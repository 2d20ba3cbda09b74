"""The registry of kinds: lazy loading, entry points from an installed package, the CLI generated from option
schemas, units in options (``--sample-rate 16k``, ``shard_bytes="1MiB"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters import registry
from shardkit.converters.base import Converter
from shardkit.converters.imagefolder import ImageFolderConverter
from shardkit.errors import ConfigError
from shardkit.formats import open_dataset
from tests.helpers.corpora import make_imagefolder, tone, write_wav

REPO = Path(__file__).resolve().parents[2]

PLUGIN = textwrap.dedent('''
    """A corpus kind from another package: folders of .npy arrays (one 4x4 uint8 record each)."""
    from pathlib import Path

    import numpy as np

    from shardkit.converters import Converter, Decoded, Decoder, Option, ScanResult
    from shardkit.converters.options import count
    from shardkit.errors import InputFileError
    from shardkit.formats import FieldSpec


    class NpyDecoder(Decoder):
        def __init__(self, root, scale):
            super().__init__("image", FieldSpec((4, 4), "uint8"))
            self.root, self.scale = root, scale

        def item_path(self, item):
            return str(self.root / item)

        def decode(self, item, start=0):
            arr = np.load(self.root / item)
            if arr.shape != (4, 4):
                raise InputFileError(self.item_path(item), f"shape: expected 4x4, found {arr.shape}")
            return Decoded([{"image": (arr * self.scale).astype(np.uint8), "label": np.int64(0)}])


    class NpyConverter(Converter):
        name = "npy"
        payload = "image"
        options = (Option("scale", int, 1, "Multiply every value.", parse=count(1), metavar="K"),)

        @classmethod
        def detect(cls, src):
            return src.is_dir() and any(src.glob("*.npy"))

        def scan(self):
            return ScanResult(sorted(p.name for p in self.src.glob("*.npy")))

        def record_spec(self):
            return FieldSpec((4, 4), "uint8")

        def fields(self):
            return {"label": FieldSpec((), "int64")}

        def labels(self):
            return {"label": ["all"]}

        def make_decoder(self):
            return NpyDecoder(self.src, self.values["scale"])
''')


def _install(site: Path, entry_points: str, module: str = PLUGIN) -> None:
    """A tiny installed distribution: its module and a dist-info with entry points."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "demo_npy_kind.py").write_text(module)
    info = site / "demo_npy_kind-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-npy-kind\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch):
    site = tmp_path / "site"
    _install(site, "[shardkit.converters]\nnpy = demo_npy_kind:NpyConverter\n")
    monkeypatch.syspath_prepend(str(site))
    registry._plugins.cache_clear()
    monkeypatch.setattr(registry, "_LOADED", {})
    yield site
    registry._plugins.cache_clear()
    sys.modules.pop("demo_npy_kind", None)


@pytest.fixture
def npy_corpus(tmp_path: Path) -> Path:
    root = tmp_path / "arrays"
    root.mkdir()
    for k in range(5):
        np.save(root / f"{k}.npy", np.full((4, 4), k, np.uint8))
    np.save(root / "odd.npy", np.zeros((2, 2), np.uint8))
    return root


def test_an_installed_package_adds_a_kind_through_its_entry_point(plugin_site: Path, npy_corpus: Path,
                                                                  tmp_path: Path) -> None:
    assert "npy" in registry.available_kinds()
    assert "demo_npy_kind" not in sys.modules  # listed, not imported
    assert registry.detect_kind(npy_corpus) == "npy"
    s = shardkit.convert(npy_corpus, tmp_path / "out", scale=3, workers=2)
    assert s.kind == "npy" and s.records == 5 and dict(s.skipped) == {"shape": 1}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.read([4])["image"][0].tolist() == [[12] * 4] * 4
    with pytest.raises(ConfigError, match=r"^scale: expected a whole number >= 1"):
        shardkit.convert(npy_corpus, tmp_path / "bad", kind="npy", scale=0)
    # The command line learns the kind and its option from the entry point alone.
    env = {**os.environ, "PYTHONPATH": f"{plugin_site}{os.pathsep}{REPO}"}
    help_text = subprocess.run([sys.executable, "-m", "shardkit", "convert", "--help"], env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=120).stdout
    assert "--scale" in help_text and "npy: Multiply every value." in " ".join(help_text.split())
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(npy_corpus), "-o", str(tmp_path / "cli"),
                        "--scale", "2", "-q"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with open_dataset(tmp_path / "cli") as ds:
        assert ds.meta.kind == "npy" and ds.read([1])["image"][0, 0, 0] == 2


def test_entry_points_that_clash_or_break_are_reported(tmp_path: Path, monkeypatch, caplog) -> None:
    site = tmp_path / "site"
    _install(site, "[shardkit.converters]\nnpy = demo_npy_kind:NpyConverter\nnpy2 = demo_npy_kind:Missing\n"
                   "coco = demo_npy_kind:NpyConverter\nbroken = no_such_module_xyz:Kind\n")
    other = tmp_path / "other"
    _install(other, "[shardkit.converters]\nnpy = elsewhere:NpyConverter\n")
    (other / "demo_npy_kind-0.1.dist-info").rename(other / "other_kind-0.1.dist-info")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(other))
    registry._plugins.cache_clear()
    monkeypatch.setattr(registry, "_LOADED", {})
    try:
        assert registry.get_converter("coco").__module__ == "shardkit.converters.coco"  # built-ins win
        assert "is a built-in corpus kind" in caplog.text
        with pytest.raises(ConfigError, match="'npy' is declared by several entry points"):
            registry.get_converter("npy")
        with pytest.raises(ConfigError, match=r"corpus kind 'broken': cannot load no_such_module_xyz:Kind \(ModuleNotFoundError"):
            registry.get_converter("broken")
        with pytest.raises(ConfigError, match=r"corpus kind 'npy2': cannot load demo_npy_kind:Missing \(AttributeError"):
            registry.get_converter("npy2")
        make_imagefolder(tmp_path / "if", per_class=1, bad=False, splits=("train",))
        assert registry.detect_kind(tmp_path / "if") == "imagefolder"  # a broken plugin does not break detection
    finally:
        registry._plugins.cache_clear()


def test_register_refuses_a_taken_name_and_bad_kinds(monkeypatch, tmp_path: Path, caplog) -> None:
    monkeypatch.setattr(registry, "_ADDED", {})
    monkeypatch.setattr(registry, "_LOADED", {})

    class Other(ImageFolderConverter):
        name = "imagefolder"

    with pytest.raises(ConfigError, match=r"'imagefolder' is already registered as shardkit\.converters\.imagefolder"):
        registry.register(Other)
    registry.register(Other, replace=True)
    assert registry.get_converter("imagefolder") is Other

    class Clash(ImageFolderConverter):
        name = "clash"
        options = (*ImageFolderConverter.options, ImageFolderConverter.options[0].__class__("workers", int, 1, "x"))

    registry.register(Clash)
    with pytest.raises(ConfigError, match="option\\(s\\) workers clash with convert's own options"):
        registry.get_converter("clash")
    registry.register("misnamed", ImageFolderConverter)
    with pytest.raises(ConfigError, match="is named 'imagefolder'"):
        registry.get_converter("misnamed")
    with pytest.raises(ConfigError, match="unknown corpus kind 'tfrecord'; expected one of audio, cifar10"):
        registry.get_converter("tfrecord")

    class Exploding(ImageFolderConverter):
        name = "exploding"

        @classmethod
        def detect(cls, src: Path) -> bool:
            raise PermissionError("detection of another package failed")

    registry.register(Exploding)
    make_imagefolder(tmp_path / "if", per_class=1, bad=False, splits=("train",))
    assert registry.detect_kind(tmp_path / "if") == "imagefolder"  # the clash and the explosion are logged
    assert "detection of another package failed" in caplog.text


def test_kinds_load_on_demand_and_the_base_knows_no_kind() -> None:
    code = textwrap.dedent("""
        import json, sys
        import shardkit
        from shardkit.converters import available_kinds, get_converter
        kinds = ("audio", "cifar", "coco", "imagefolder", "classfolders")
        loaded = lambda: sorted(k for k in kinds if f"shardkit.converters.{k}" in sys.modules)
        steps = {"import": loaded()}
        available_kinds()
        steps["listed"] = loaded()
        get_converter("coco")
        steps["coco"] = loaded()
        print(json.dumps(steps))
    """)
    steps = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
    # coco needs the image options, which live in images.py, not in the imagefolder kind.
    assert steps == {"import": [], "listed": [], "coco": ["coco"]}


def test_cli_options_are_generated_from_every_kinds_schema() -> None:
    from shardkit.cli.convert import kind_option_parameters

    params = {p.name: p for p in kind_option_parameters()}
    for name in registry.available_kinds():
        for opt in registry.get_converter(name).options:
            assert opt.name in params, (name, opt.name)
            assert opt.flag in params[opt.name].default.param_decls[0]
    assert "--window/--no-window" in params["window"].default.param_decls


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from shardkit.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_sample_rate_takes_units_on_the_cli_and_in_python(tmp_path: Path, capsys) -> None:
    root = tmp_path / "speech"
    write_wav(root / "yes" / "a.wav", tone(440, 44100, 0.5), 44100)
    code, _, err = _cli(capsys, "convert", str(root), "-o", str(tmp_path / "cli"), "--sample-rate", "16k",
                          "--duration", "250ms", "-q")
    assert code == 0, err
    with open_dataset(tmp_path / "cli") as ds:
        assert ds.meta.transform["sample_rate"] == 16000 and ds.meta.record.shape == (4000,)
    code, _, err = _cli(capsys, "convert", str(root), "-o", str(tmp_path / "bad"), "--sample-rate", "fast", "-q")
    assert code == 1 and err.startswith("error: --sample-rate: expected a rate such as 16000")
    code, _, err = _cli(capsys, "convert", str(root), "-o", str(tmp_path / "bad"), "--sample-rate", "2M", "-q")
    assert code == 1 and "error: --sample-rate: expected a rate from 1000 to 768000 Hz, found '2M'" in err
    s = shardkit.convert(root, tmp_path / "py", sample_rate="8kHz", duration="0.5s", workers=1)
    assert s.records == 1
    with pytest.raises(ConfigError, match=r"^sample_rate: expected a rate"):
        shardkit.convert(root, tmp_path / "bad", sample_rate="fast")


def test_shard_sizes_go_through_the_units_grammar(tmp_path: Path, capsys) -> None:
    src = tmp_path / "c"
    make_imagefolder(src, per_class=4, bad=False, splits=("train",))
    s = shardkit.convert(src, tmp_path / "a", size=32, shard_bytes="10KiB", workers=1)
    with open_dataset(tmp_path / "a") as ds:
        # 10 KiB shards: 3 records of 3 KiB would fit, the index cap (one slot per 4 KiB) allows 2
        assert ds.meta.records_per_shard == min(10240 // (32 * 32 * 3 + 16), 10240 // 4096) == 2 and s.records == 12
    with pytest.raises(ConfigError, match=r"^shard_bytes: expected a size such as 512MiB"):
        shardkit.convert(src, tmp_path / "b", shard_bytes="lots")
    with pytest.raises(ConfigError, match=r"^records_per_shard: expected a whole number >= 1"):
        shardkit.convert(src, tmp_path / "b", records_per_shard=0)
    with pytest.raises(ConfigError, match=r"^workers: expected a whole number >= 1"):
        shardkit.convert(src, tmp_path / "b", workers=0)
    code, _, err = _cli(capsys, "convert", str(src), "-o", str(tmp_path / "c2"), "--size", "32", "--shard-size",
                          "10KiB", "-q")
    assert code == 0, err
    with open_dataset(tmp_path / "c2") as ds:
        assert ds.meta.records_per_shard == 2
    code, _, err = _cli(capsys, "convert", str(src), "-o", str(tmp_path / "c3"), "--size", "0x4", "-q")
    assert code == 1 and err.startswith("error: --size: expected H or HxW")
    code, _, err = _cli(capsys, "convert", str(src), "-o", str(tmp_path / "c3"), "--sample-rate", "8000", "-q")
    assert code == 1 and "kind 'imagefolder' does not accept option(s) --sample-rate" in err


def test_a_converter_without_its_abstract_half_cannot_be_built() -> None:
    class Incomplete(Converter):
        name = "incomplete"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(REPO)  # type: ignore[abstract]
