"""The sampler's one options object: defaults, parsing through shardkit.units, errors named as the user
wrote them (Python or CLI), and the budget checks that need the record size."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError
from shardkit.readers import DEFAULTS, SamplerOptions, TieredSampler
from shardkit.units import Capacity
from tests.helpers.sampler_data import collect, make_dataset
from tests.readers.test_cli_sample import _run as _cli

REC = 16  # bytes per record of the test datasets (4 x 4 x 1 uint8)


def test_defaults_live_in_the_options() -> None:
    o = SamplerOptions()
    assert o == DEFAULTS
    assert (o.batch_size, o.ram_size, o.ssd_size, o.tiers, o.mode, o.seed) == (
        256, Capacity(nbytes=512 << 20), Capacity(nbytes=4 << 30), ("ram",), "epoch", 0
    )
    assert (o.epochs, o.drop_last, o.limit, o.gap_bytes, o.static_cache) == (1, False, None, 64 << 10, "auto")
    assert (o.permutation, o.node_sharing) == ("auto", True)
    assert (o.rank, o.world_size, o.start_epoch, o.ssd_dir) == (0, 1, 0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch_size = 3  # type: ignore[misc]


def test_values_are_parsed_and_normalised() -> None:
    o = SamplerOptions.parse(tiers="SSD, ram", ram_size="1.5KiB", ssd_size="10records", gap_bytes="1KiB",
                             static_cache="off", seed=np.uint64(2**64 - 1), batch_size=np.int32(7), ssd_dir="/tmp")
    assert o.tiers == ("ssd", "ram")
    assert o.ram_size == Capacity(nbytes=1536) and o.ssd_size == Capacity(records=10)
    assert o.gap_bytes == 1024 and o.static_cache == Capacity(nbytes=0)
    assert o.seed == 2**64 - 1 and type(o.seed) is int and o.batch_size == 7 and type(o.batch_size) is int
    assert o.ssd_dir == Path("/tmp")
    assert o.replace(batch_size=9).batch_size == 9 and o.replace(batch_size=9).tiers == ("ssd", "ram")
    assert pickle.loads(pickle.dumps(o)) == o


@pytest.mark.parametrize(
    "option,value",
    [("ram_size", "lots"), ("ssd_size", 0), ("batch_size", 0), ("batch_size", 2.5), ("batch_size", True),
     ("epochs", -1), ("seed", -3), ("seed", 2**64), ("mode", "random"), ("tiers", "ram,gpu"), ("limit", -1),
     ("gap_bytes", -1), ("static_cache", "many"), ("start_epoch", -2), ("world_size", 0), ("drop_last", "yes"),
     ("permutation", "shuffled"), ("node_sharing", "yes")],
)
def test_errors_name_the_option_as_written(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{option}: "):
        SamplerOptions.parse(**{option: value})
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^{flag}: "):
        SamplerOptions.parse(source="cli", **{option: value})


def test_rank_checked_against_world_size_and_unknown_names_refused() -> None:
    with pytest.raises(ConfigError, match=r"^rank: expected 0 <= rank < world_size=2, found 2"):
        SamplerOptions(rank=2, world_size=2)
    with pytest.raises(ConfigError, match=r"^--rank: expected 0 <= --rank < --world-size=2"):
        SamplerOptions.parse(source="cli", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="unknown sampler option ram_sise"):
        SamplerOptions.parse(ram_sise="1GiB")
    with pytest.raises(ConfigError, match="unknown sampler option"):
        SamplerOptions().replace(bach_size=3)
    with pytest.raises(ConfigError, match=r"^batch_size: "):
        SamplerOptions().replace(batch_size=0)  # replace validates again


def test_both_option_sets_share_source_naming_and_the_unknown_name_check() -> None:
    from shardkit.serve.server import ServeOptions

    for cls in (SamplerOptions, ServeOptions):
        with pytest.raises(ConfigError, match=r"^source: expected 'python' or 'cli', found 'shell'"):
            cls(source="shell")  # type: ignore[arg-type]
        assert cls(source="cli") == cls()  # where the options came from is not part of the value
        assert "source" not in cls.option_names() and "seed" in cls.option_names()
    with pytest.raises(ConfigError, match=r"^unknown sampler option --ram; expected some of .*ram_size"):
        SamplerOptions.parse(source="cli", ram="1GiB")
    with pytest.raises(ConfigError, match=r"^unknown server option ram; expected some of .*lease_seconds"):
        ServeOptions.parse(ram="1GiB")
    assert ServeOptions(source="cli").name("lease_seconds") == "--lease"
    assert SamplerOptions(source="cli").name("ram_size") == "--ram-size"


def test_keyword_arguments_and_options_build_the_same_sampler(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 23)
    kw = dict(tiers="ram", ram_size="6records", batch_size=4, epochs=2, seed=3, rank=1, world_size=2)
    by_kwargs = TieredSampler(ds, **kw)  # type: ignore[arg-type]
    by_options = TieredSampler(ds, SamplerOptions.parse(**kw))
    assert by_kwargs.options == by_options.options
    assert [b.tolist() for b in collect(by_kwargs)] == [b.tolist() for b in collect(by_options)]
    over = TieredSampler(ds, SamplerOptions.parse(**kw), seed=4)  # keyword arguments override options
    assert over.seed == 4 and over.batch_size == 4
    restored = pickle.loads(pickle.dumps(by_kwargs))  # DataLoader workers started with spawn
    assert restored.options == by_kwargs.options and restored.state_dict() == by_kwargs.state_dict()
    with pytest.raises(ConfigError, match="unknown sampler option"):
        TieredSampler(ds, batchsize=3)
    with pytest.raises(ConfigError, match="options: expected a SamplerOptions"):
        TieredSampler(ds, {"batch_size": 3})  # type: ignore[arg-type]


# ------------------------------------------------------------------ budgets that need the record size
@pytest.mark.parametrize(
    "kw,option",
    [
        ({"ram_size": REC + 1}, "ram_size"),
        ({"ram_size": "1records"}, "ram_size"),
        ({"tiers": "ram,ssd", "ram_size": "4records", "ssd_size": "1records"}, "ssd_size"),
        ({"tiers": "ram,ssd", "ram_size": "8records", "ssd_size": "6records"}, "ssd_size"),
        ({"static_cache": REC - 1}, "static_cache"),
    ],
)
def test_budget_errors_say_the_record_size(tmp_path: Path, ssd_dir: Path, kw: dict, option: str) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    with pytest.raises(ConfigError, match=rf"^{option}: .*16 bytes") as info:
        TieredSampler(ds, ssd_dir=ssd_dir, **kw)
    assert "record" in str(info.value)


def test_static_cache_is_part_of_the_ram_budget(tmp_path: Path) -> None:
    """An explicit cache comes out of ram_size and must leave two records for blocks; "auto" takes
    what the blocks do not need; 0 turns it off."""
    ds = make_dataset(tmp_path / "ds", 50)
    with pytest.raises(ConfigError, match=r"^static_cache: .*leaves ram_size .*fewer than two records") as info:
        TieredSampler(ds, ram_size="10records", static_cache="9records")
    assert "16 bytes" in str(info.value)
    assert TieredSampler(ds, ram_size="10records", static_cache="8records").static_cache == 8
    assert TieredSampler(ds, ram_size="10records", static_cache=0).static_cache == 0
    assert TieredSampler(ds, ram_size="10records", static_cache="50records").memory_plan.full_cache
    assert TieredSampler(ds, ram_size="50records").memory_plan.full_cache  # auto: the budget covers it
    assert SamplerOptions(static_cache="AUTO").static_cache == "auto"


def test_smallest_budgets_work(tmp_path: Path, ssd_dir: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    s = TieredSampler(ds, tiers="ram,ssd", ram_size="2records", ssd_size="2records", ssd_dir=ssd_dir, batch_size=3)
    assert (s.ram_block, s.ssd_block) == (1, 1)
    assert sorted(np.concatenate(collect(s)).tolist()) == list(range(10))


def test_cli_budget_error_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    assert _cli(["sample", str(ds), "--tiers", "ram,ssd", "--ram-size", "8records", "--ssd-size", "4records"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ssd-size: ") and "--ram-size" in err[0] and "16 bytes" in err[0]
    assert _cli(["sample", str(ds), "--seed", str(2**64)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --seed: expected an integer in [0, 2**64)")


def test_cli_summary_explains_reads_beyond_delivered_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = make_dataset(tmp_path / "ds", 40, records_per_shard=10)
    assert _cli(["sample", str(ds), "--ram-size", "8records", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "delivered    640 B of payload" in out
    assert "index" in out and "gaps of up to 64.0 KiB" in out  # tiny records: whole shards are read
    assert _cli(["sample", str(ds), "--ram-size", "8records", "--batch-size", "4", "--gap-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "index" in out  # only the shard indexes remain beyond the records' bytes


def test_a_consumers_first_block_asks_at_its_worker_index() -> None:
    """The dataset a consumer reads gets its worker index in its rank as the first block's ask
    priority: the main process takes the workers' first batches in that order (docs/design.md §9)."""
    placed = {"world_size": 6, "workers_per_rank": 3}
    assert [SamplerOptions(rank=r, **placed).dataset_options()["ask_priority"] for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert SamplerOptions().dataset_options()["ask_priority"] == 0
    # ... and the rank's workers as the processes that fill the cache together (each its share).
    assert SamplerOptions(rank=4, **placed).dataset_options()["fillers"] == 3
    assert SamplerOptions().dataset_options()["fillers"] == 1


def test_options_are_derived_once_per_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A set's declared options and flat names are derived once per class, not at every
    construction (each sampler build validates its options twice), and callers get their own copy."""
    from shardkit.declare import Option

    base = SamplerOptions(ram_size="1MiB")
    base.replace(rank=1, world_size=2)  # derived by now
    calls = []
    real = Option.cli_flag
    monkeypatch.setattr(Option, "cli_flag", lambda self, name: calls.append(name) or real(self, name))
    assert base.replace(rank=1, world_size=2, remote_concurrency=8).store.concurrency == 8
    assert calls == []
    SamplerOptions.declared().clear()
    assert "ram_size" in SamplerOptions.declared()
