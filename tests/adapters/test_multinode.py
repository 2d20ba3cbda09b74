"""Node-aware loading under torchrun: two simulated nodes of two ranks each (gloo, CPU).

Two torchrun agents on this host make two nodes (a file-store rendezvous, so no port is chosen by
the test; each agent picks its own free port for the process group); each node has its own
node-cache directory and RAM budget. What is checked, per the design (DESIGN §10):

* every training step's global batch, as a set, is the epoch order's slice, and every rank gets
  exactly B keys per step;
* the item x position chi-square at the global-batch level passes (alpha = 1e-3): each global batch
  is put in a uniformly random order of its own (a fixed test seed) so a row is a permutation that is
  uniform exactly when the global batches are a uniform permutation's; concatenating the ranks'
  batches in rank order instead fails it, which shows the test has power against a cache-dependent
  split;
* storage reads per epoch, counted by the sampler's instruments, are exactly the misses (keys a rank
  takes that its node does not pin) plus the caches' fill: the node's disk part once per node in the
  first epoch, and each RAM-pinned record once per node, the first time the node takes it (the
  static cache fills as the epochs read); once all have come up, only the misses;
* a resumed run with another world size (one node of two ranks, twice the batch size) continues with
  the same global batches.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _adapter_data import write_keyed

from shardkit.order.locality import node_partition
from shardkit.readers import epoch_permutation
from tests.helpers.order_stats import ALPHA, item_position_pvalue

HERE = Path(__file__).parent
SEED = 11
N = 48
BATCH, RANKS, NODES = 4, 4, 2
GLOBAL = BATCH * RANKS
EPOCHS = 240
RAM_PART, DISK_PART = 5, 13  # records per node, as multinode_script.CACHE says
# One worker under pytest-xdist: the torchrun tests share one pair of runs (the `runs` fixture).
pytestmark = [pytest.mark.xdist_group("adapters-multinode"), pytest.mark.slow]


def _env() -> dict[str, str]:
    path = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _torchrun(args: list[str], launcher: list[str], agents: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(HERE / "multinode_script.py"), *args]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(agents)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("multinode")
    dataset = write_keyed(base / "data", N, records_per_shard=8)
    out = base / "out"
    out.mkdir()
    two_nodes = ["--nnodes", str(NODES), "--nproc-per-node", str(RANKS // NODES), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", str(base / "rendezvous"), "--rdzv-conf", "store_type=file",
                 "--rdzv-id", f"mn-{os.getpid()}", "--max-restarts", "0"]  # fmt: skip
    _torchrun([str(dataset), str(out), str(SEED), "train", str(EPOCHS)], two_nodes, agents=NODES)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    (out / "state.json").write_text(json.dumps(ranks[0]["state"]))
    _torchrun([str(dataset), str(out), str(SEED), "resume", "0"], ["--standalone", "--nproc-per-node", "2"], agents=1)
    resumed = [json.loads((out / f"resumed{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "resumed": resumed, "out": out}


def test_ranks_see_two_nodes_from_torchrun(runs: dict[str, Any]) -> None:
    for r, res in enumerate(runs["ranks"]):
        assert (res["rank"], res["world_size"], res["nodes"], res["node"]) == (r, RANKS, NODES, r // 2)
    assert [(res["world_size"], res["nodes"]) for res in runs["resumed"]] == [(2, 1), (2, 1)]


def test_every_step_is_its_global_batch_and_every_rank_gets_b_keys(runs: dict[str, Any]) -> None:
    ranks = runs["ranks"]
    for epoch in range(EPOCHS):
        pi = epoch_permutation(SEED, epoch, N)
        steps = [res["epochs"][epoch] for res in ranks]
        assert all(len(s) == N // GLOBAL for s in steps)
        for g in range(N // GLOBAL):
            assert all(len(s[g]) == BATCH for s in steps)
            got = np.sort(np.concatenate([s[g] for s in steps]))
            np.testing.assert_array_equal(got, np.sort(pi[g * GLOBAL : (g + 1) * GLOBAL]))


def test_item_position_chi_square_at_the_global_batch_level(runs: dict[str, Any]) -> None:
    ranks = runs["ranks"]
    shuffle = np.random.default_rng(20240601)
    within, by_rank = [], []
    for epoch in range(EPOCHS):
        rows_shuffled, rows_ranked = [], []
        for g in range(N // GLOBAL):
            batch = np.concatenate([res["epochs"][epoch][g] for res in ranks])
            rows_ranked.append(batch)
            rows_shuffled.append(shuffle.permutation(batch))
        within.append(np.concatenate(rows_shuffled))
        by_rank.append(np.concatenate(rows_ranked))
    assert item_position_pvalue(np.array(within)) > ALPHA
    # Power check: inside a global batch, who takes a key depends on which node pins it.
    assert item_position_pvalue(np.array(by_rank)) < ALPHA


def test_storage_reads_are_the_misses_only(runs: dict[str, Any]) -> None:
    """Per rank and epoch, exactly: misses, plus the node's RAM-pinned records the node takes for the
    first time (the static cache fills as the epochs read them, once per node), plus in the first
    epoch the node's disk part (written once per node). After a few epochs every pinned record has
    come up and storage serves the misses only."""
    ranks = runs["ranks"]
    part = node_partition(SEED, N, NODES, RAM_PART + DISK_PART)
    ram_part = [set(part.pinned_keys(node, 0, RAM_PART).tolist()) for node in range(NODES)]
    filled: list[set[int]] = [set() for _ in range(NODES)]
    fills, misses_total = [], []
    for epoch in range(EPOCHS):
        fills.append(0)
        misses_total.append(0)
        node_reads = [0] * NODES
        node_expected = [DISK_PART if epoch == 0 else 0 for _ in range(NODES)]
        for res in ranks:
            node = res["node"]
            keys = np.concatenate(res["epochs"][epoch])
            miss = int(np.count_nonzero(part.holders(keys) != node))
            new = (set(keys.tolist()) & ram_part[node]) - filled[node]
            filled[node] |= new
            fills[-1] += len(new)
            misses_total[-1] += miss
            assert res["hits"][epoch] == keys.size - miss
            node_reads[node] += res["reads"][epoch]
            node_expected[node] += miss + len(new)
            if epoch:
                assert res["reads"][epoch] == miss + len(new), (epoch, res["rank"])
        assert node_reads == node_expected, epoch
    assert filled == ram_part
    assert sum(fills[EPOCHS // 2 :]) == 0  # the second half of the run: storage reads are the misses only
    # 75 % of the dataset is pinned; with the assignment most of it is served locally.
    assert np.mean(misses_total) < 0.4 * N


def test_resume_with_another_world_size_continues_the_same_global_batches(runs: dict[str, Any]) -> None:
    ranks, resumed = runs["ranks"], runs["resumed"]
    assert ranks[0]["state"]["epoch"] == EPOCHS and ranks[0]["state"]["position"] == GLOBAL
    original = [np.sort(np.concatenate([res["last"][g] for res in ranks])) for g in range(1, N // GLOBAL)]
    again = [np.sort(np.concatenate([res["batches"][g] for res in resumed])) for g in range(len(resumed[0]["batches"]))]
    assert len(again) == len(original) == N // GLOBAL - 1
    for a, b in zip(original, again):
        np.testing.assert_array_equal(a, b)
    assert all(len(b) == 2 * BATCH for res in resumed for b in res["batches"])


def test_one_private_node_cache_per_node(runs: dict[str, Any]) -> None:
    out: Path = runs["out"]
    for node in range(NODES):
        users = list((out / f"node{node}").iterdir())
        assert len(users) == 1 and stat.S_IMODE(users[0].stat().st_mode) == 0o700
        entries = [p for p in users[0].iterdir() if p.name.startswith("entry-")]
        assert len(entries) == 1
        for f in entries[0].rglob("*"):
            assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600)


# ---------------------------------------------------------------------------------------------- without torchrun
def test_dataloader_workers_keep_every_training_step(keyed: Path, tmp_path: Path) -> None:
    """Two ranks of two persistent workers on two nodes (explicit): a rank's loader batch s is worker
    s % 2's batch s // 2; each step (batch s of both ranks) keeps the records it has without locality."""
    from _adapter_data import N_KEYED

    from shardkit.adapters.torch import ShardIterableDataset

    def steps(**extra: Any) -> list[list[np.ndarray]]:
        per_rank = []
        for rank in range(2):
            ds = ShardIterableDataset(keyed, batch_size=4, seed=SEED, rank=rank, world_size=2, num_workers=2,
                                      static_cache="20records", ram_size="60records", drop_last=True, **extra)  # fmt: skip
            loader = ds.loader(num_workers=2, persistent_workers=True)
            per_rank.append([[b["key"].numpy() for b in loader] for _ in range(2)])
        return [[np.sort(np.concatenate([per_rank[r][e][s] for r in range(2)])) for s in range(len(per_rank[0][e]))]
                for e in range(2)]  # fmt: skip

    plain = steps()
    local = steps(locality=True, nodes=2, node_cache="10records", node_cache_dir=tmp_path)
    for e in range(2):
        assert len(plain[e]) == len(local[e]) == 2 * (N_KEYED // 16)
        for a, b in zip(plain[e], local[e]):
            np.testing.assert_array_equal(a, b)


def test_nodes_from_the_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.adapters.torch import _nodes
    from shardkit.errors import ConfigError

    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert _nodes(None, 3, 4) == 1
    assert _nodes(2, 3, 4) == 2
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "2")
    assert _nodes(None, 5, 8) == 4
    monkeypatch.setenv("GROUP_RANK", "1")  # rank 5 is not on node 1 with 2 ranks per node
    with pytest.raises(ConfigError, match="pass nodes= explicitly"):
        _nodes(None, 5, 8)
    with pytest.raises(ConfigError, match="nodes: expected a divisor of world_size=8, found 3"):
        _nodes(3, 5, 8)


def _disagreeing_rank(rank: int, init: str, dataset: str, out: str) -> None:
    import torch.distributed as dist

    from shardkit.adapters.torch import ShardIterableDataset
    from shardkit.errors import ConfigError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ShardIterableDataset(dataset, batch_size=4, locality=True, nodes=2, static_cache=f"{5 + rank}records")
        Path(out, f"r{rank}").write_text("accepted")
    except ConfigError as exc:
        Path(out, f"r{rank}").write_text(str(exc))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_locality_options_are_refused(keyed: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_disagreeing_rank, args=(init, str(keyed), str(tmp_path)), nprocs=2, start_method="spawn")
    for r in range(2):
        assert "every rank must be given the same" in (tmp_path / f"r{r}").read_text()
