"""The shared tier stack: one server, several jobs (separate processes), each with its own exactly
uniform order; one disk pass per epoch whatever the number of jobs; crashes and stale state.

Statistical tests use alpha = 1e-3 and fixed seeds. Checked once against a broken job that emits each
reservoir in stored (ascending key) order instead of its own permutation: the item x position test
fails (p underflows to 0). Timeouts below only guard against hangs; nothing asserts on timing.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError, SamplerError
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES, index_nbytes
from shardkit.readers import Sampler, SharedSampler, TierServer
from shardkit.serve import job_order, wait_for_server
from shardkit.serve.rundir import run_dir_path
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import check_batch, make_dataset, opening_nbytes
from tests.helpers.threads import Jobs, run_jobs

REC = 16
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def name() -> str:
    return f"t{os.getpid()}-{secrets.token_hex(3)}"


def _job(name: str, out: Path, seed: int, epochs: int, batch: int, **extra: object) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.serve.shared_job", name, str(out), "--job-seed", str(seed),
            "--epochs", str(epochs), "--batch", str(batch)]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE)


def _wait(p: subprocess.Popen[bytes], timeout: float = 120.0) -> int:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    if p.returncode not in (0, -signal.SIGKILL):
        print(err.decode(errors="replace"), file=sys.stderr)
    return p.returncode


def _expected_order(server_seed: int, job_seed: int, epoch: int, n: int, k: int) -> np.ndarray:
    return job_order(server_seed, job_seed, epoch, n, k)


def _leftovers(name: str) -> list[str]:
    """What a server named ``name`` left on this machine (its run directory holds everything)."""
    d = run_dir_path(name)
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_two_jobs_uniform_exactly_once_one_disk_pass(tmp_path: Path, name: str) -> None:
    """Two job processes: every record once per epoch, each job's order passes the item x position
    chi-square ((N-1)^2 dof), the orders differ, and the server read the dataset once per epoch."""
    n, epochs, rps = 8, 800, 3
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=rps)
    with TierServer(ds, name=name, ram_size="6records", slots=2, epochs=epochs, wait_for=2, seed=7, gap_bytes=0) as srv:
        assert srv.slot_records == 3
        srv.stats.disk.trace = []
        jobs = [_job(name, tmp_path / f"job{j}.npy", seed=j + 1, epochs=epochs, batch=3) for j in range(2)]
        assert [_wait(p) for p in jobs] == [0, 0]
        assert srv.wait(30)
        trace = srv.stats.disk.trace
    orders = [np.load(tmp_path / f"job{j}.npy") for j in range(2)]
    for j, o in enumerate(orders):
        assert o.shape == (epochs, n)
        assert (np.sort(o, axis=1) == np.arange(n)).all()  # exactly once per epoch
        assert item_position_pvalue(o) > ALPHA
        np.testing.assert_array_equal(np.load(tmp_path / f"job{j}-epochs.npy"), np.arange(epochs))
        for e in (0, 1, epochs - 1):
            np.testing.assert_array_equal(o[e], _expected_order(7, j + 1, e, n, 3))
    same = (orders[0] == orders[1]).all(axis=1)
    # P(two jobs' epoch orders equal | same partition) = 1/(3! 3! 2!) = 1/72: about 11 of 800.
    assert same.sum() < 40
    # Same reservoir sets at the same positions (that is the sharing).
    for a in range(0, n, 3):
        assert (np.sort(orders[0][:, a : a + 3], 1) == np.sort(orders[1][:, a : a + 3], 1)).all()
    # A shard's index is read once, with the end of its records that tail_crc32c checks; it ends the file.
    index = [t for t in trace if t[1] + t[2] == os.path.getsize(t[0]) and (t[2] - 4) % 16 == 0 and t[2] % REC != 0]
    data = [t for t in trace if t not in index]
    isize = index_nbytes(rps)
    assert sum(t[2] for t in data) == epochs * n * REC  # one disk pass per epoch for two jobs
    assert all(t[2] == isize + min(TAIL_SAMPLE_NBYTES, os.path.getsize(t[0]) - isize) for t in index)
    assert len(index) == -(-n // rps)
    assert _leftovers(name) == []


@pytest.mark.parametrize("tiers", ["ram", "ram,ssd"])
@pytest.mark.parametrize("k", [1, 3])
def test_disk_bytes_independent_of_job_count(tmp_path: Path, ssd_dir: Path, name: str, tiers: str, k: int) -> None:
    """k jobs (threads here) cost one disk pass per epoch; with the SSD tier the order is still the
    documented one (blocks of K inside SSD reservoirs)."""
    n, epochs = 29, 3
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=4)
    srv = TierServer(ds, name=name, tiers=tiers, ram_size="8records", ssd_size="16records", ssd_dir=ssd_dir,
                     slots=2, epochs=epochs, wait_for=k, seed=3, gap_bytes=0).start()
    try:
        def run(j: int) -> list[np.ndarray]:
            s = SharedSampler(name, job_seed=10 + j, batch_size=5, epochs=epochs, dataset=ds)
            return [check_batch(b) for b in s]

        results = run_jobs(run, range(k), timeout=60)
        assert srv.wait(30)
    finally:
        srv.close()
    for j in range(k):
        sizes = [b.size for b in results[j]]
        assert sizes == ([5] * 5 + [4]) * epochs  # batches never span epochs
        keys = np.concatenate(results[j]).reshape(epochs, n)
        assert (np.sort(keys, 1) == np.arange(n)).all()
        for e in range(epochs):  # K = 4 divides K1 = 8: the same blocks with or without SSD
            np.testing.assert_array_equal(keys[e], _expected_order(3, 10 + j, e, n, 4))
    assert srv.stats.disk.bytes_read - opening_nbytes(n, 4, REC) == epochs * n * REC  # one pass an epoch
    assert srv.stats.disk.records == epochs * n
    if tiers == "ram,ssd":
        assert srv.ssd_block == 8
        assert srv.stats.ssd_bytes_written == epochs * n * REC
        assert srv.stats.ssd.records == epochs * n
    assert _leftovers(name) == [] and list(ssd_dir.iterdir()) == []


def test_ssd_tier_and_big_ram_through_the_pipeline(tmp_path: Path, ssd_dir: Path, name: str) -> None:
    """A server with the SSD tier and a ring slot larger than an SSD reservoir (K = N > K1) fills its
    ring through the sampler's pipeline: every job's epoch is the documented exact permutation,
    every epoch reads the dataset once and writes it to SSD once, and the pipeline's own per-epoch
    and per-stage counters (which the server's former block loop did not keep) say so."""
    n, epochs, k1 = 29, 3, 8
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=4)
    srv = TierServer(ds, name=name, tiers="ram,ssd", ram_size="64records", ssd_size=f"{2 * k1}records",
                     ssd_dir=ssd_dir, slots=2, epochs=epochs, wait_for=2, seed=5, gap_bytes=0).start()
    try:
        assert (srv.slot_records, srv.ssd_block) == (n, k1)

        def run(j: int) -> list[np.ndarray]:
            return [check_batch(b) for b in SharedSampler(name, job_seed=40 + j, batch_size=5, epochs=epochs, dataset=ds)]

        results = run_jobs(run, range(2), timeout=60)
        assert srv.wait(30)
    finally:
        srv.close()
    for j in range(2):
        keys = np.concatenate(results[j]).reshape(epochs, n)
        for e in range(epochs):
            assert (np.sort(keys[e]) == np.arange(n)).all()
            np.testing.assert_array_equal(keys[e], job_order(5, 40 + j, e, n, n, k1))
    st = srv.stats
    index = opening_nbytes(n, 4, REC)
    assert sorted(st.disk_bytes_by_epoch) == list(range(epochs))
    assert sum(st.disk_bytes_by_epoch.values()) == st.disk.bytes_read == epochs * n * REC + index
    assert all(st.disk_bytes_by_epoch[e] == n * REC for e in range(1, epochs))  # each reservoir read once
    assert st.ssd_bytes_written == st.ssd.bytes_read == epochs * n * REC and st.ssd.records == epochs * n
    assert {"ssd_fill", "ssd"} <= set(st.busy_seconds)
    assert srv.published == epochs * -(-n // k1)
    assert _leftovers(name) == [] and list(ssd_dir.iterdir()) == []


def test_cli_serve_with_the_ssd_tier(tmp_path: Path, ssd_dir: Path, name: str) -> None:
    """``shardkit serve --tiers ram,ssd`` with a big ring: a job gets exact permutations in the
    documented order, and the summary shows each epoch went through the SSD tier once."""
    n, epochs = 20, 2
    ds = make_dataset(tmp_path / "ds", n)
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name, "--tiers",
                          "ram,ssd", "--ram-size", "40records", "--ssd-size", "12records", "--ssd-dir", str(ssd_dir),
                          "--slots", "2", "--epochs", str(epochs), "--seed", "9"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = wait_for_server(name, timeout=60)
        assert set(info.tiers) == {"ram", "ssd"} and info.slot_records == n
        with SharedSampler(name, job_seed=3, batch_size=6, epochs=epochs) as job:
            keys = np.concatenate([check_batch(b) for b in job]).reshape(epochs, n)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert p.returncode == 0, stderr
    for e in range(epochs):
        np.testing.assert_array_equal(keys[e], job_order(9, 3, e, n, n, 6))
    written = epochs * n * REC
    assert f"served {epochs} epochs, {epochs * 4} reservoir blocks" in stdout, stdout
    assert f"SSD tier {written} B written, {written} B read" in stdout, stdout
    assert "Traceback" not in stderr
    assert _leftovers(name) == [] and list(ssd_dir.iterdir()) == []


def test_late_job_starts_at_next_epoch(tmp_path: Path, name: str) -> None:
    # 10 reservoirs of 6 per epoch, a ring of 2: while the first job holds its first batches (and
    # its prefetch of 2), the server cannot have published all of epoch 0, so the late job attaches
    # during epoch 0 and must start with epoch 1.
    n = 60
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="12records", slots=2, epochs=3, seed=1) as srv:
        first = SharedSampler(name, job_seed=1, batch_size=4, epochs=3)
        it = iter(first)
        k0 = [check_batch(next(it))]
        assert first.epoch == 0
        late: list[np.ndarray] = []
        late_sampler = SharedSampler(name, job_seed=2, batch_size=4, epochs=1)
        t = threading.Thread(target=lambda: late.extend(check_batch(b) for b in late_sampler))
        t.start()
        deadline = time.monotonic() + 30
        while srv.jobs < 2 and time.monotonic() < deadline:  # attached while epoch 0 is under way
            time.sleep(0.01)
        k0 += [check_batch(b) for b in it]
        t.join(30)
        assert srv.wait(30)
    assert late_sampler.epoch == 1  # started at the next boundary, ran one whole epoch
    late_keys = np.concatenate(late)
    np.testing.assert_array_equal(np.sort(late_keys), np.arange(n))
    np.testing.assert_array_equal(late_keys, _expected_order(1, 2, 1, n, 6))
    assert srv.published == 3 * 10
    assert np.concatenate(k0).size == 3 * n


def test_sigkilled_job_does_not_stall_the_other(tmp_path: Path, name: str) -> None:
    n, epochs = 30, 4
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="6records", slots=2, epochs=epochs, wait_for=2) as srv:
        victim = _job(name, tmp_path / "victim.npy", seed=1, epochs=epochs, batch=2, kill_after=2)
        survivor = _job(name, tmp_path / "survivor.npy", seed=2, epochs=epochs, batch=2)
        assert _wait(victim) == -signal.SIGKILL
        assert _wait(survivor) == 0
        assert srv.wait(30)
        assert srv.jobs == 0
    keys = np.load(tmp_path / "survivor.npy")
    assert keys.shape == (epochs, n) and (np.sort(keys, 1) == np.arange(n)).all()


def test_silent_job_loses_its_lease(tmp_path: Path, name: str) -> None:
    """A stopped (SIGSTOP) job keeps its socket open; the lease drops it and the other job finishes."""
    n, epochs = 30, 3
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="6records", slots=2, epochs=epochs, wait_for=2, lease_seconds=3.0) as srv:
        hung = _job(name, tmp_path / "hung.npy", seed=1, epochs=epochs, batch=2, stop_after=2)
        survivor = _job(name, tmp_path / "survivor.npy", seed=2, epochs=epochs, batch=2)
        try:
            assert _wait(survivor) == 0
            assert srv.wait(30)
        finally:
            hung.kill()
            hung.communicate(timeout=30)
    keys = np.load(tmp_path / "survivor.npy")
    assert keys.shape == (epochs, n) and (np.sort(keys, 1) == np.arange(n)).all()


def _start_cli_server(ds: Path, name: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name,
                          "--ram-size", "6records"], cwd=ROOT, stderr=subprocess.PIPE)
    wait_for_server(name, timeout=60)
    return p


def test_sigterm_cleans_shared_memory(tmp_path: Path, name: str) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    p = _start_cli_server(ds, name)
    s = SharedSampler(name, job_seed=0, batch_size=4)
    assert len(s) == 3
    assert (run_dir_path(name) / "ring").is_file()  # the shared memory, in the run directory
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    assert _leftovers(name) == []


def test_stale_state_after_sigkill_is_removed(tmp_path: Path, name: str) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    p = _start_cli_server(ds, name)
    p.kill()
    p.communicate(timeout=30)
    old_ring = (run_dir_path(name) / "ring").stat().st_ino
    # the shared memory, socket, token and info survive a SIGKILL
    assert _leftovers(name) == ["info.json", "lock", "ring", "sock", "token"]
    with pytest.raises(SamplerError, match=r"no shardkit server named .*stale files of a dead server"):
        SharedSampler(name, connect_timeout=0)
    with TierServer(ds, name=name, ram_size="6records") as srv:
        assert (run_dir_path(name) / "ring").stat().st_ino != old_ring  # the dead server's ring is gone
        assert srv.info is not None and srv.info.pid == os.getpid()
    assert _leftovers(name) == []


def test_shared_sampler_is_a_sampler_that_cannot_resume(tmp_path: Path, name: str) -> None:
    """SharedSampler implements the whole Sampler protocol the adapters rely on; the resume
    methods exist and refuse clearly (the server owns the epochs)."""
    ds = make_dataset(tmp_path / "ds", 13)
    with TierServer(ds, name=name, ram_size="6records"), SharedSampler(name, batch_size=3, world_size=2, rank=1) as s:
        assert isinstance(s, Sampler)
        assert (s.path, s.num_records, s.batch_size, s.payload_name, s.epoch, len(s)) == (ds.resolve(), 13, 3, "image", None, 2)
        for call in (s.state_dict, lambda: s.load_state_dict({}), lambda: s.set_epoch(3)):
            with pytest.raises(SamplerError, match="epochs are the server's"):
                call()


def test_name_clash_and_wrong_dataset_refused(tmp_path: Path, name: str) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    other = make_dataset(tmp_path / "other", 13)
    with TierServer(ds, name=name, ram_size="6records"):
        with pytest.raises(ConfigError, match=f"named '{name}' is already running .*pid {os.getpid()}"):
            TierServer(other, name=name).start()
        with pytest.raises(SamplerError, match="fingerprints differ"):
            SharedSampler(name, dataset=other)
        SharedSampler(name, dataset=ds)  # the right dataset attaches
    assert _leftovers(name) == []
    with pytest.raises(SamplerError, match="no shardkit server named"):
        SharedSampler(name, connect_timeout=0)
    with pytest.raises(ConfigError):
        TierServer(ds, name="bad/name")


@pytest.mark.parametrize("drop_last", [False, True])
def test_consumers_of_one_job_take_its_global_batches(tmp_path: Path, name: str, drop_last: bool) -> None:
    """W consumers (DataLoader workers / ranks) of one job: their slices of every global batch rebuild
    the job's order, as TieredSampler's ranks do; the group starts together; a duplicate rank is refused."""
    n, b, w, epochs = 37, 4, 3, 2
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="10records", slots=2, epochs=epochs, seed=5, wait_for=w) as srv:
        samplers = [SharedSampler(name, job_seed=21, batch_size=b, epochs=epochs, rank=r, world_size=w,
                                  drop_last=drop_last) for r in range(w)]
        jobs = Jobs(lambda r: [check_batch(x) for x in samplers[r]], range(w))
        jobs.start(0)
        deadline = time.monotonic() + 30
        while srv.jobs < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(SamplerError, match="already has a consumer of rank 0"):
            next(iter(SharedSampler(name, job_seed=21, batch_size=b, rank=0, world_size=w)))
        jobs.start()
        per_rank = jobs.join(timeout=60)
        assert srv.wait(30)
    lens = [len(s) for s in samplers]
    assert lens == ([3, 3, 3] if drop_last else [4, 3, 3])  # 37 = 3 * 12 + 1: only rank 0 gets the tail
    for e in range(epochs):
        order = _expected_order(5, 21, e, n, 5)
        rebuilt = []
        for g in range(max(lens)):
            for r in range(w):
                if g < lens[r]:
                    rebuilt.append(per_rank[r][e * lens[r] + g])
        np.testing.assert_array_equal(np.concatenate(rebuilt), order[: 36 if drop_last else n])


_TF_JOB = """
import sys
import numpy as np
from shardkit.adapters.tf import make_tf_dataset
ds = make_tf_dataset(sys.argv[1], batch_size=5, seed=9, shared=sys.argv[2], prefetch=False)
np.save(sys.argv[3], np.concatenate([b["key"].numpy() for b in ds]))
"""


def test_adapters_attach_with_shared(tmp_path: Path, name: str) -> None:
    """``ShardIterableDataset(..., shared=NAME)`` with two DataLoader workers (one job of two
    consumers) and ``make_tf_dataset(..., shared=NAME)`` (in its own process, as TensorFlow and
    torch are best not mixed in one): each a whole epoch in the job's own order."""
    pytest.importorskip("torch", reason="the 'torch' extra is not installed")
    if importlib.util.find_spec("tensorflow") is None:  # not imported here: the job below runs it
        pytest.skip("the 'tensorflow' extra is not installed")
    from shardkit.adapters.torch import ShardIterableDataset

    n = 26
    ds = make_dataset(tmp_path / "ds", n)
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name,
                          "--ram-size", "8records", "--slots", "2", "--seed", "4"], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_for_server(name, timeout=60)
        tds = ShardIterableDataset(ds, batch_size=3, seed=8, shared=name)
        keys = np.concatenate([b["key"].numpy() for b in tds.loader(num_workers=2)])
        # The group of two workers started the server's first epoch; the loader interleaves their
        # slices of each global batch, which rebuilds the job's order (seed 8) exactly.
        np.testing.assert_array_equal(keys, _expected_order(4, 8, 0, n, 4))
        with pytest.raises(ConfigError, match="only mode='epoch'"):
            ShardIterableDataset(ds, batch_size=3, mode="sequential", shared=name)
        out = tmp_path / "tf.npy"
        tf_job = subprocess.run([sys.executable, "-c", _TF_JOB, str(ds), name, str(out)], cwd=ROOT,
                                capture_output=True, timeout=300)
        assert tf_job.returncode == 0, tf_job.stderr.decode(errors="replace")[-2000:]
        tkeys = np.load(out)
        np.testing.assert_array_equal(np.sort(tkeys), np.arange(n))
        # it attached after the torch job, so it got a later server epoch, in its own order (seed 9)
        assert any(np.array_equal(tkeys, _expected_order(4, 9, e, n, 4)) for e in range(1, 6))
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert _leftovers(name) == []


def _job_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardkit-shared")]


def test_abandoned_iterator_detaches(tmp_path: Path, name: str) -> None:
    """``break`` out of a job's loop: once the iterator is garbage collected the job detaches (it
    does not keep its lease and hold the ring), and its threads are gone."""
    import gc

    n = 40
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="6records", slots=2) as srv:
        def quitter() -> None:
            for _ in SharedSampler(name, job_seed=1, batch_size=2, epochs=None):
                break

        quitter()
        gc.collect()
        deadline = time.monotonic() + 30
        while (srv.jobs or _job_threads()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.jobs == 0
        assert not _job_threads()
        keys = np.concatenate([check_batch(b) for b in SharedSampler(name, job_seed=2, batch_size=7)])
        np.testing.assert_array_equal(np.sort(keys), np.arange(n))


def test_a_job_is_welcomed_before_the_server_sends_it_anything_else(tmp_path: Path, name: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's handshake holds its Welcome until another thread has tried to send the job
    something (a Reservoir of the epoch the job was admitted to, or a Beat), or 2 s have passed: the
    job must still read Welcome first (a job that read a Reservoir first failed with ProtocolError)."""
    from shardkit.serve import server as server_mod
    from shardkit.serve.protocol import Welcome

    other_sent = threading.Event()
    send = server_mod._Job.send

    def ordered_send(self: server_mod._Job, msg: object) -> None:
        if isinstance(msg, Welcome):
            other_sent.wait(2)  # the window: without the fix the job is listed while this waits
        else:
            other_sent.set()
        send(self, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(server_mod._Job, "send", ordered_send)
    ds = make_dataset(tmp_path / "ds", 12)
    with TierServer(ds, name=name, ram_size="6records", slots=2, epochs=1, seed=1, lease_seconds=10.0):
        keys = np.concatenate([check_batch(b) for b in SharedSampler(name, job_seed=1, batch_size=4, epochs=1)])
    assert sorted(keys.tolist()) == list(range(12))
