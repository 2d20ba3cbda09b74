"""``shardkit order-test`` from the command line: output, exit codes (0 pass, 1 fail, 2 bad input)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.cli.main import COMMAND_MODULES, main
from shardkit.ordertest import BATTERY, alternatives


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["order-test", *args])
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out, err


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    paths = {
        "uniform": tmp_path / "uniform.npy", "buffer": tmp_path / "buffer.npy", "labels": tmp_path / "labels.npy",
        "float": tmp_path / "float.npy", "tiny": tmp_path / "tiny.npy",
    }
    np.save(paths["uniform"], np.array([rng.permutation(100) for _ in range(200)]))
    np.save(paths["buffer"], np.array([alternatives.buffer_shuffle(rng, 100, 10) for _ in range(50)]))
    np.save(paths["labels"], np.arange(100) // 10)
    np.save(paths["float"], np.zeros((4, 4)))
    np.save(paths["tiny"], np.array([[1, 0]]))
    return paths


def test_registered() -> None:
    assert "order_test" in COMMAND_MODULES
    res = subprocess.run([sys.executable, "-m", "shardkit", "--help"], capture_output=True, text=True, timeout=120)
    assert "order-test" in res.stdout


def test_pass_prints_one_line_per_test(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, _ = cli(capsys, str(files["uniform"]), "--labels", str(files["labels"]), "--batch-size", "16")
    lines = out.splitlines()
    assert code == 0, out
    assert lines[0].startswith(f"{files['uniform']}: 200 epoch(s) x 100 keys, N = 100")
    for test in BATTERY:
        assert sum(line.startswith(test.name + " ") for line in lines) == 1, test.name
    item = next(line for line in lines if line.startswith("item_position"))
    assert "PASS" in item and "chi2(225)" in item and " p " in item and "needs >= " in item and "has 200" in item
    pairs = next(line for line in lines if line.startswith("adjacent_pairs"))
    assert "weighted chi2(1)" in pairs
    labels = next(line for line in lines if line.startswith("labels_per_batch"))
    assert "t(499), simulated null: 500 draws" in labels and "PASS" in labels
    assert lines[-1].startswith("PASS")


def test_fail_exit_code_and_json(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, _ = cli(capsys, str(files["buffer"]), "--alpha", "1e-4")
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: item_position")
    code, out, _ = cli(capsys, str(files["buffer"]), "--json", "--seed", "7", "--bins", "8", "--effect", "0.2")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False and data["seed"] == 7 and data["alpha"] == 1e-3
    item = next(t for t in data["tests"] if t["name"] == "item_position")
    assert item["verdict"] == "fail" and item["dof"] == 49 and item["pvalue"] < 1e-100
    assert "buffer shuffle of 20 records" in item["alternative"]


@pytest.mark.parametrize("args,message", [
    (["{float}"], "{float}: expected integers, found dtype float64"),
    (["{missing}"], "{missing}: no such file"),
    (["{uniform}", "--labels", "{labels}"], "--labels needs --batch-size"),
    (["{uniform}", "--labels", "{float}", "--batch-size", "8"], "{float}: expected integer, boolean or string labels"),
    (["{uniform}", "--alpha", "abc"], "--alpha: expected a number between 0 and 1"),
    (["{uniform}", "--batch-size", "0", "--labels", "{labels}"], "--batch-size: expected a whole number >= 1"),
    (["{uniform}", "--records", "50"], "{uniform}: key 99 is outside 0..49"),
    (["{uniform}", "--storage-order", "{labels}"], "{labels}: not a permutation"),
    (["{uniform}", "--seed", "-3"], "--seed: expected an integer"),
    (["{uniform}", "--plot", "{tmp}/x.jpg"], "plot: expected a file name ending in .png"),
    (["{tiny}"], "{tiny}: no test applies to 1 epoch(s) of 2 keys"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path,
                                      args: list[str], message: str) -> None:
    names = {k: str(v) for k, v in files.items()} | {"missing": str(tmp_path / "missing.npy"), "tmp": str(tmp_path)}
    code, out, err = cli(capsys, *(a.format(**names) for a in args))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message.format(**names) in err


def test_real_console_script_bad_input(files: dict[str, Path]) -> None:
    res = subprocess.run([sys.executable, "-m", "shardkit", "order-test", str(files["float"])],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"error: {files['float']}: expected integers, found dtype float64"


def test_plot_is_written(capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path) -> None:
    out_png = tmp_path / "plots" / "buffer.png"
    code, _, err = cli(capsys, str(files["buffer"]), "--plot", str(out_png))
    assert code == 1 and f"wrote {out_png}" in err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(capsys: pytest.CaptureFixture[str], files: dict[str, Path],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = cli(capsys, str(files["uniform"]), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and out == "" and not (tmp_path / "x.png").exists()
    assert "shardkit order-test --plot needs the optional dependency 'matplotlib'" in err
    assert 'pip install "shardkit[viz]"' in err
