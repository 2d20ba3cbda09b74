"""The one grammar of sizes, counts, durations and rates (shardkit.units): durations and rates."""

from __future__ import annotations

import pytest

from shardkit.errors import ConfigError
from shardkit.units import parse_duration, parse_rate


@pytest.mark.parametrize(("text", "seconds"), [("1.5s", 1.5), ("20ms", 0.02), ("2min", 120.0), ("1h", 3600.0), (3, 3.0),
                                               ("0", 0.0)])  # fmt: skip
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text, what="--timeout") == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "hz"), [("16k", 16000), ("44.1kHz", 44100), (16000, 16000), ("16000", 16000)])
def test_rates(text: str | int, hz: int) -> None:
    assert parse_rate(text, what="--rate") == hz


@pytest.mark.parametrize("bad", [True, "abc", None, -1, "5 parsecs", float("nan")])
def test_bad_durations_name_the_option(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^--timeout: expected a"):
        parse_duration(bad, what="--timeout")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="positive"):
        parse_duration(0, what="timeout", allow_zero=False)


@pytest.mark.parametrize("bad", [True, "1.5", "5q", 0, -16000, None])
def test_bad_rates_name_the_option(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^rate: expected a"):
        parse_rate(bad, what="rate")  # type: ignore[arg-type]
