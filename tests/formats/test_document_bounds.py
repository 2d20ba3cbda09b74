"""Reading a metadata document is bounded in memory whatever the document holds (issue 31, item 3).

A 105 MB ``zarr.json`` used to peak at 2.7 GB in ``shardkit info`` before anything rejected it. Now
its size and its number of JSON values are bounded before it is parsed, and the worst document
within both bounds stays under the stated peak. Each case runs ``shardkit info`` in a child of a
small wrapper process, whose ``RUSAGE_CHILDREN`` then holds that child's peak RSS alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.errors import ConversionError, NotADatasetError
from shardkit.formats.metadata import (
    DOCUMENT_PEAK_NBYTES,
    MAX_DOCUMENT_NBYTES,
    MAX_DOCUMENT_VALUES,
    encode_json,
    parse_json,
)

_WRAPPER = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run([sys.executable, '-m', 'shardkit', 'info', sys.argv[1]], capture_output=True, text=True)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
    "print(r.returncode)\n"
    "print(r.stderr)\n"
)


def _info_peak(dataset: Path) -> tuple[int, int, str]:
    """``(peak RSS in bytes, exit code, stderr)`` of ``shardkit info dataset`` in a child process."""
    out = subprocess.run([sys.executable, "-c", _WRAPPER, str(dataset)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    peak, code, err = out.split("\n", 2)
    return int(peak), int(code), err


def _nested_lists(values: int, depth: int = 500) -> bytes:
    """``[[[...]]],`` repeated: one list object per counted value, the costliest value to parse."""
    unit = b"[" * depth + b"]" * depth + b","
    return unit * (values // (depth + 1))


def test_a_large_hostile_document_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """The issue's case: a 105 MB document of nested lists, refused by its size."""
    (tmp_path / "zarr.json").write_bytes(b'{"a": [' + _nested_lists(105_000_000 // 1001 * 501, depth=250) + b"[]]}")
    assert (tmp_path / "zarr.json").stat().st_size > 100_000_000
    peak, code, err = _info_peak(tmp_path)
    assert code == 1 and "more than the" in err and "Traceback" not in err
    assert peak < 300 << 20


def test_a_document_of_too_many_values_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    doc = b'{"a": [' + _nested_lists(MAX_DOCUMENT_VALUES + 10_000, depth=2) + b"[]]}"
    assert len(doc) < MAX_DOCUMENT_NBYTES
    (tmp_path / "zarr.json").write_bytes(doc)
    peak, code, err = _info_peak(tmp_path)
    assert code == 1 and "values" in err and "Traceback" not in err
    assert peak < 300 << 20


def test_the_worst_document_within_the_bounds_stays_under_the_stated_peak(tmp_path: Path) -> None:
    """Every value a list, and the rest one long string with a 4-byte character (text at 4 bytes a
    character, twice: the decoded document and the parsed string)."""
    body = _nested_lists(MAX_DOCUMENT_VALUES - 16)
    pad = MAX_DOCUMENT_NBYTES - len(body) - 64
    doc = b'{"a": "\xf0\x9f\x98\x80' + b"x" * pad + b'", "b": [' + body + b"[]]}"
    assert MAX_DOCUMENT_NBYTES - 64 < len(doc) <= MAX_DOCUMENT_NBYTES
    (tmp_path / "zarr.json").write_bytes(doc)
    peak, code, err = _info_peak(tmp_path)
    assert code == 1 and "expected a zarr v3 group" in err  # parsed whole, then refused for what it is
    assert peak < DOCUMENT_PEAK_NBYTES


def test_parse_json_names_the_bound_and_the_file() -> None:
    with pytest.raises(NotADatasetError, match=r"^doc\.json: JSON document of more than \d+ values"):
        parse_json(b"[" + b"0," * MAX_DOCUMENT_VALUES + b"0]", "doc.json")
    with pytest.raises(NotADatasetError, match=r"^doc\.json: .*digits"):
        parse_json(b'{"a": ' + b"9" * 5000 + b"}", "doc.json")


def test_a_writer_refuses_a_document_no_reader_would_open() -> None:
    with pytest.raises(ConversionError, match="split the dataset"):
        encode_json({"shards": [{"a": 1}] * (MAX_DOCUMENT_VALUES // 2)})
    assert json.loads(encode_json({"shards": [{"a": 1}] * 1000}))["shards"][0] == {"a": 1}
