"""``benchmarks/stall_profile.py``: the 12 configurations it checks and its table, on a tiny dataset."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from shardkit.profiling import Workload
from shardkit.readers import SamplerOptions
from tests.helpers.benchmarks import load_benchmark


@pytest.fixture
def stall_profile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("stall_profile", monkeypatch)


def test_configurations_cold_and_warm(stall_profile: ModuleType, tmp_path: Path) -> None:
    rec = 224 * 224 * 3
    opts = SamplerOptions.parse(batch_size=8, ram_size=100 * rec // 10, epochs=2, ssd_dir=tmp_path)
    checks = stall_profile.configurations(Workload(100, rec, 8, 2), opts)
    assert len(checks) == 11 and len({c.label for c in checks}) == 11  # the profiled job is the 12th
    assert sum(c.cold_start for c in checks) == 5  # its own cold run is the profile's "both"
    assert any("ssd" in c.options.tiers for c in checks) and any(c.options.gap_bytes == 0 for c in checks)
    assert {"static_cache 0", "all cached", "all cached, warm"} <= {c.label for c in checks}


def test_table_of_twelve_rows(stall_profile: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stall_profile.main(["--records", "24", "--rounds", "1", "--batch-size", "4", "--data", str(tmp_path / "data"),
                               "--ssd-dir", str(tmp_path / "ssd")]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| 0 |")]
    assert len(rows) == 12 and rows[0].startswith("| 0 | measured |")
    assert any(line.startswith("within 15%: ") and line.endswith("(1 rounds of 12 configurations)") for line in out)
    assert any(line.startswith("median error within 15%: ") and line.endswith(" of 12 configurations") for line in out)
