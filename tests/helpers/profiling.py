"""Checks of a profile that the local and the object-store profile tests share."""

from __future__ import annotations

import json
from typing import Any

from shardkit.profiling import report_lines, to_json


def check_profile(prof: Any, n: int, epochs: int) -> None:
    assert set(prof.phases) >= {"ingest-cold", "ingest-warm", "both"}
    assert prof.phases["ingest-cold"].records == n
    assert prof.phases["both"].records == n * epochs
    assert len(prof.phases["both"].epoch_seconds) == epochs
    assert prof.rates.storage_bps > 0 and prof.rates.step_s > 0
    assert prof.measured.seconds > 0 and len(prof.measured.epochs) == epochs
    assert any(p.scenario.label.startswith("ram_size") for p in prof.whatifs)
    json.dumps(to_json(prof))  # JSON-able, numpy scalars included
    text = "\n".join(report_lines(prof))
    assert "advice" in text and "stall" in text
