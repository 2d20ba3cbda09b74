"""shardkit.mix and the disk tier of a mixture (shardkit.readers.sources): schema checks from metadata
alone, reads by global key, gathered fields."""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConfigError, DatasetNotFoundError, SchemaError
from shardkit.formats import DatasetWriter, FieldSpec, ReadStats
from shardkit.readers.sources import DATASET_FIELD, MixedDataset, Mixture, mix
from tests.helpers.sampler_data import encode, make_dataset


def _write(path: Path, n: int, *, shape: tuple[int, ...] = (4, 4, 1), dtype: str = "uint8",
           fields: dict[str, FieldSpec] | None = None, payload: str = "image") -> Path:
    fields = {"label": FieldSpec((), "int64")} if fields is None else fields
    with DatasetWriter(path, kind="test", payload=payload, record=FieldSpec(shape, dtype), fields=fields,
                       records_per_shard=4) as w:
        w.write({payload: np.zeros((n, *shape), dtype=dtype),
                 **{k: np.zeros((n, *s.shape), dtype=s.dtype) for k, s in fields.items()}})
    return path


def test_mix_describes_the_mixture(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 10)
    b = make_dataset(tmp_path / "b", 4, first=10)
    m = shardkit.mix([(a, 3), (b, 1)])
    assert isinstance(m, Mixture)
    assert m.paths == (a, b) and m.sizes == (10, 4) and m.weights == (Fraction(3), Fraction(1))
    assert m.epoch_size == 14 and m.counts == (11, 3)  # 10.5 / 3.5: the tie goes to dataset 0
    assert m.seed is None and m.plan(5).seed == 5
    m2 = mix([(a, "0.5"), (b, 0.5)], epoch_size="1k", seed=9)
    assert m2.epoch_size == 1000 and m2.counts == (500, 500) and m2.plan(5).seed == 9
    assert "weight 3 (11 of 10 records per epoch)" in m.describe()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(shape=(4, 4, 3)), "image record shape differs .* expected \\(4, 4, 1\\), found \\(4, 4, 3\\)"),
        (dict(dtype="int16"), "image record dtype differs .* expected 'uint8', found 'int16'"),
        (dict(payload="audio", shape=(16,)), "payload name differs .* expected 'image', found 'audio'"),
        (dict(fields={}), "fields differs .* expected \\['label'\\], found \\[\\]"),
        (dict(fields={"label": FieldSpec((2,), "int64")}), "field 'label' shape differs .* expected \\(\\), found \\(2,\\)"),
        (dict(fields={"label": FieldSpec((), "int32")}), "field 'label' dtype differs .* expected 'int64', found 'int32'"),
    ],
)
def test_a_schema_mismatch_is_refused_before_anything_is_read(tmp_path: Path, kwargs: dict, message: str) -> None:
    """The error names the dataset and the first difference; payload shards and field chunks of both
    datasets are deleted first, so reading any of them would raise something else."""
    a = _write(tmp_path / "a", 6)
    b = _write(tmp_path / "b", 6, **kwargs)
    for ds in (a, b):
        for sub in ds.iterdir():
            if sub.is_dir():
                for f in sub.rglob("*"):
                    if f.is_file() and f.name != "zarr.json":
                        f.unlink()
    with pytest.raises(SchemaError, match=f"{b}: {message}"):
        mix([(a, 1), (b, 1)])


def test_dataset_field_name_is_reserved(tmp_path: Path) -> None:
    fields = {DATASET_FIELD: FieldSpec((), "int64")}
    a = _write(tmp_path / "a", 3, fields=fields)
    b = _write(tmp_path / "b", 3, fields=fields)
    with pytest.raises(SchemaError, match="has a field named 'dataset'"):
        mix([(a, 1), (b, 1)])


def test_mix_input_errors(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 5)
    with pytest.raises(ConfigError, match="list of \\(dataset, weight\\) pairs"):
        mix(str(a))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="list of \\(dataset, weight\\) pairs"):
        mix([])
    with pytest.raises(ConfigError, match="entry 1 must be a \\(dataset, weight\\) pair"):
        mix([(a, 1), a])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="weight 1 must be a finite number > 0"):
        mix([(a, 1), (a, 0)])
    with pytest.raises(ConfigError, match="epoch_size"):
        mix([(a, 1)], epoch_size=0)
    with pytest.raises(ConfigError, match="seed"):
        mix([(a, 1)], seed=-3)
    with pytest.raises(DatasetNotFoundError):
        mix([(a, 1), (tmp_path / "missing", 1)])


def test_mixed_dataset_reads_by_global_key(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 10)
    b = make_dataset(tmp_path / "b", 7, first=10)
    stats = ReadStats()
    with MixedDataset(mix([(a, 1), (b, 1)]), stats=stats) as md:
        assert md.num_records == 17 and md.payload.num_records == 17
        keys = np.array([16, 3, 10, 3, 0, 12, 9], dtype=np.int64)
        np.testing.assert_array_equal(md.payload.read(keys), encode(keys))
        sorted_keys = np.array([1, 2, 11, 15])
        np.testing.assert_array_equal(md.payload.read(sorted_keys), encode(sorted_keys))
        np.testing.assert_array_equal(md.fields["label"][keys], keys * 3)
        np.testing.assert_array_equal(md.fields["pair"][keys][:, 0], keys.astype(np.float32))
        np.testing.assert_array_equal(md.fields[DATASET_FIELD][keys], [1, 0, 1, 0, 0, 1, 0])
        np.testing.assert_array_equal(md.local_keys(keys), [6, 3, 0, 3, 0, 2, 9])
        assert stats.records == 11  # one set of counters for all datasets
        with pytest.raises(IndexError, match="global key 17 outside"):
            md.payload.read(np.array([17]))


def test_mixture_of_a_dataset_with_itself(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 5)
    with MixedDataset(mix([(a, 1), (a, 2)])) as md:
        np.testing.assert_array_equal(md.payload.read(np.array([7, 2])), encode(np.array([2, 2])))
    shutil.rmtree(a)
