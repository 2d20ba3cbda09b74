"""Determinism across worker counts, resume after SIGKILL, refused parameter changes, --overwrite."""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.converters import decoding
from shardkit.converters.base import Decoded, Decoder
from shardkit.converters.decoding import RingSlots, outcomes
from shardkit.converters.pipeline import BackgroundWriter, _Batcher, decode_into
from shardkit.errors import ConversionError
from shardkit.formats import FieldSpec, open_dataset, verify
from tests.helpers.corpora import interrupt_after, make_imagefolder, tone, write_wav

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipe") / "corpus"
    make_imagefolder(root, per_class=12)
    return root


def _payload_files(path: Path) -> dict[str, bytes]:
    with open_dataset(path) as ds:
        return {s.path: (path / s.path).read_bytes() for s in ds.meta.shards}


def assert_same_dataset(a: Path, b: Path) -> None:
    fa, fb = _payload_files(a), _payload_files(b)
    assert list(fa) == list(fb)
    for k in fa:
        assert fa[k] == fb[k], f"shard {k} differs"
    with open_dataset(a) as da, open_dataset(b) as db:
        assert da.meta.shards == db.meta.shards
        assert set(da.fields) == set(db.fields)
        for name in da.fields:
            np.testing.assert_array_equal(da.fields[name], db.fields[name])
        assert [(s.path, s.reason) for s in da.meta.skipped] == [(s.path, s.reason) for s in db.meta.skipped]
        assert da.meta.labels == db.meta.labels and da.meta.transform == db.meta.transform


def test_byte_identical_with_1_and_2_workers(corpus: Path, tmp_path: Path) -> None:
    s1 = shardkit.convert(corpus, tmp_path / "w1", size=24, workers=1, records_per_shard=7)
    s2 = shardkit.convert(corpus, tmp_path / "w2", size=24, workers=2, records_per_shard=7)
    assert s1.records == s2.records == 36 and s1.skipped == s2.skipped
    assert_same_dataset(tmp_path / "w1", tmp_path / "w2")



def test_small_records_travel_in_fewer_larger_tasks(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pool task costs both sides a pickle, a pipe round trip and a future: small records go to the
    workers in tasks of up to 2 MiB of payload, large ones in tasks of chunk_size (the ring holds 3 tasks a
    worker). 45 inputs of 24x24x3 are all tail (:func:`next_task_inputs`): 8 tasks, not 12 of chunk_size 4.
    Same bytes as 1 worker."""
    submitted: list[int] = []

    class Counting(decoding.ProcessPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if fn is decoding._decode_chunk and args[1] is not None:
                submitted.append(len(args[0]))
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(decoding, "ProcessPoolExecutor", Counting)
    shardkit.convert(corpus, tmp_path / "w2", size=24, workers=2, records_per_shard=7)
    assert submitted == [12, 9, 6, 5, 4, 4, 4, 1]  # 45 inputs (9 of them skipped)
    shardkit.convert(corpus, tmp_path / "w1", size=24, workers=1, records_per_shard=7)
    assert_same_dataset(tmp_path / "w1", tmp_path / "w2")
    assert decoding.task_inputs(4, 224 * 224 * 3) == 13
    assert decoding.task_inputs(4, 1024 * 1024 * 3) == 4  # never below the converter's chunk_size
    assert decoding.task_inputs(256, 3072) == 256

def test_the_last_tasks_shrink_so_that_the_workers_finish_together() -> None:
    # Full tasks while the inputs left give each worker two more, then smaller ones down to chunk_size:
    # the end of a conversion waits for the slowest worker, now at most one small task behind.
    def tasks(n: int, task: int, chunk_size: int, workers: int) -> list[int]:
        out: list[int] = []
        while sum(out) < n:
            out.append(decoding.next_task_inputs(n - sum(out), task, chunk_size, workers))
        return out

    got = tasks(800, 13, 1, 2)
    assert sum(got) == 800 and got[:58] == [13] * 58
    assert got[58:] == [12, 9, 7, 5, 4, 3, 2, 1, 1, 1, 1]
    assert tasks(800, 13, 4, 2)[-4:] == [4, 4, 4, 1]  # never below chunk_size but for the last inputs
    assert tasks(10, 32, 4, 1) == [5, 4, 1]
    assert tasks(5, 13, 1, 8) == [1] * 5


KILLER = textwrap.dedent("""
    import os, signal, sys
    import shardkit
    src, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def progress(done, total, records):
        if done >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    shardkit.convert(src, out, size=24, workers=2, shard_bytes=%d, progress=progress)
    print("finished without being killed")
""")


def test_resume_after_sigkill_matches_uninterrupted(corpus: Path, tmp_path: Path) -> None:
    shard_bytes = 5 * (24 * 24 * 3 + 16)  # 5 records per shard
    ref = shardkit.convert(corpus, tmp_path / "ref", size=24, workers=1, shard_bytes=shard_bytes)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILLER % shard_bytes, str(corpus), str(out), "30"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    checkpoints = sorted(out.glob(".shardkit-parts/*/p000000-*.json"))
    assert len(checkpoints) >= 3  # several shards completed (and checkpointed) before the kill
    with pytest.raises(shardkit.errors.IncompleteDatasetError):
        open_dataset(out)
    resumed = shardkit.convert(corpus, out, size=24, workers=2, shard_bytes=shard_bytes)
    assert 0 < resumed.records_this_run < resumed.records == ref.records
    assert_same_dataset(tmp_path / "ref", out)
    assert verify(out).ok
    # The killed run's payload ring (shared memory) was removed by the next conversion.
    from shardkit.converters.decoding import _ring_dir
    from shardkit.processes import pid_alive

    leftovers = [p for p in Path(_ring_dir()).glob("shardkit-convert-*.ring")
                 if not pid_alive(int(p.name.split("-")[2]))]
    assert leftovers == []


def test_resume_inside_an_audio_file_cut_into_windows(tmp_path: Path) -> None:
    root = tmp_path / "a"
    for i in range(4):
        write_wav(root / "w" / f"{i}.wav", tone(200 + 50 * i, 8000, 2.5), 8000)  # 3 windows each
    kw = dict(sample_rate=8000, window=True, records_per_shard=2, workers=1)
    ref = shardkit.convert(root, tmp_path / "ref", **kw)
    assert ref.records == 12

    class Crash(Exception):
        pass

    def crash(done: int, total: int, records: int) -> None:
        if done == 2:  # 6 records produced: shards of 2 end at windows 2 of input 0, 1 of input 1...
            raise Crash

    with pytest.raises(Crash):
        shardkit.convert(root, tmp_path / "out", progress=crash, **kw)
    resumed = shardkit.convert(root, tmp_path / "out", **kw)
    assert resumed.records == 12 and resumed.records_this_run < 12
    assert_same_dataset(tmp_path / "ref", tmp_path / "out")


def test_different_parameters_refused_overwrite_starts_fresh(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.convert(corpus, out, size=16, workers=1)
    again = shardkit.convert(corpus, out, size=16, workers=2)
    assert again.already_complete and again.records == 36
    with pytest.raises(ConversionError, match="different parameters"):
        shardkit.convert(corpus, out, size=20, workers=1)
    fresh = shardkit.convert(corpus, out, size=20, workers=1, overwrite=True)
    assert fresh.records == 36 and not fresh.already_complete
    with open_dataset(out) as ds:
        assert ds.meta.record.shape == (20, 20, 3)


def test_interrupted_run_with_different_parameters_is_refused(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(corpus, tmp_path / "out", size=16, workers=1, records_per_shard=4, progress=interrupt_after(20))
    with pytest.raises(ConversionError, match="different parameters"):
        shardkit.convert(corpus, tmp_path / "out", size=16, workers=1, records_per_shard=4, crop="pad")


def test_changed_corpus_is_not_resumed(tmp_path: Path) -> None:
    root = tmp_path / "c"
    make_imagefolder(root, per_class=4, bad=False, splits=("train",))

    with pytest.raises(KeyboardInterrupt):
        shardkit.convert(root, tmp_path / "out", size=16, workers=1, records_per_shard=3, progress=interrupt_after(8))
    os.remove(root / "train" / "cat" / "cat000.jpg")
    with pytest.raises(ConversionError, match="different parameters"):
        shardkit.convert(root, tmp_path / "out", size=16, workers=1, records_per_shard=3)


class _CountingDecoder(Decoder):
    """Input ``i`` gives one 4x4 record filled with ``i % 251`` (a uint16 one where ``i`` is in ``wide``)."""

    def __init__(self, wide: frozenset[int] = frozenset()) -> None:
        super().__init__("image", FieldSpec((4, 4), "uint8"))
        self.wide = wide

    def decode(self, item: Any, start: int = 0) -> Decoded:
        i = int(item)
        value = np.full((4, 4), i % 251, dtype=np.uint16 if i in self.wide else np.uint8)
        return Decoded([{"image": value, "label": np.int64(i)}])

    def item_path(self, item: Any) -> str:
        return f"input-{item}"


class _KeepingSink:
    """A synchronous RecordSink that keeps a copy of every payload, and the arrays it was handed."""

    records_per_shard = 10_000

    def __init__(self) -> None:
        self.records_written = 0
        self.payloads: list[np.ndarray] = []
        self.handed: list[np.ndarray] = []
        self.labels: list[int] = []

    def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
        self.handed.append(batch["image"])
        self.payloads.append(FieldSpec((4, 4), "uint8").check("image", batch["image"], len(cursors)).copy())
        self.labels += [int(v) for v in batch["label"]]
        self.records_written += len(cursors)

    def skip(self, path: str, reason: str, cursor: int) -> None:
        raise AssertionError(f"unexpected skip of {path}: {reason}")


def _decode_all(decoder: Decoder, n: int, workers: int) -> _KeepingSink:
    sink = _KeepingSink()
    decode_into(decoder, list(range(n)), sink, 0, names=["image", "label"], chunk_size=1, workers=workers,
                strict=False, progress=None, provenance=("test", ()))
    return sink


def _in_ring(a: np.ndarray) -> bool:
    """``a`` is a view of a file mapping (the workers' ring), not memory of this process's own."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def test_payloads_from_workers_are_written_from_the_ring_in_order() -> None:
    # 200 records from 2 workers: every uint8 batch the sink is handed is rows of the workers' ring,
    # not a copy (the copy into a batch buffer was the parent's largest per-record cost).
    sink = _decode_all(_CountingDecoder(wide=frozenset({70, 71})), 200, workers=2)
    got = np.concatenate(sink.payloads)
    np.testing.assert_array_equal(got[:, 0, 0], np.arange(200) % 251)
    assert sink.labels == list(range(200))
    fast = [a for a in sink.handed if a.dtype == np.uint8]
    assert len(fast) >= 3 and all(_in_ring(a) for a in fast)
    # The uint16 records travel stacked, as their own batch, and the sink casts them (same_kind).
    assert any(a.dtype == np.uint16 and not _in_ring(a) for a in sink.handed)


def test_payloads_not_in_the_ring_are_copied_into_reused_batch_buffers() -> None:
    # Payloads of the record's shape that are not ring rows (a long input's further records travel
    # pickled): copied into a buffer that a synchronous sink gives back at once, so every batch is
    # written from the same memory (a fresh stacked array per batch cost page faults on every one).
    sink = _KeepingSink()
    batcher = _Batcher(sink, ["image", "label"], "image", FieldSpec((4, 4), "uint8"))
    for i in range(200):
        batcher.add({"image": np.full((4, 4), i % 251, np.uint8), "label": np.int64(i)}, i + 1)
    batcher.flush()
    np.testing.assert_array_equal(np.concatenate(sink.payloads)[:, 0, 0], np.arange(200) % 251)
    assert len(sink.handed) == 4 and all(np.shares_memory(sink.handed[0], a) for a in sink.handed[1:])


def test_a_held_ring_slot_is_not_refilled_until_given_back() -> None:
    # The consumer holds the first task's slot and reads on through 600 inputs (19 tasks of 32 in 7
    # slots): the workers must not write into the held slot, and it is used again once given back.
    slots = RingSlots(1)
    stream = outcomes(_CountingDecoder(), list(range(600)), (0, 0), 2, 1, slots)
    first = next(stream)
    assert slots.current is not None
    held_slot, rows = slots.current
    give_back = slots.keep()
    views = [first.decoded.records[0]["image"]]
    views += [next(stream).decoded.records[0]["image"] for _ in range(31)]
    for outcome in stream:
        assert slots.current is not None
        if outcome.index < 400:
            assert slots.current[0] != held_slot
        elif outcome.index == 400:  # 12 tasks later: the held rows are as the first task left them
            np.testing.assert_array_equal([int(v[0, 0]) for v in views], range(32))
            np.testing.assert_array_equal(rows[:, 0], range(32))
            give_back()
        elif slots.current[0] == held_slot:
            break
    else:
        raise AssertionError("the slot given back was never used again")
    stream.close()


def test_the_writer_thread_gives_buffers_back_after_a_failure_too() -> None:
    # A batch queued behind a failing write is skipped, and its release still runs: the ring slot or
    # buffer it holds comes back, so the decode loop never waits for a slot that no write will free.
    failing = threading.Event()

    class _FailingSink(_KeepingSink):
        def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
            failing.wait()
            raise OSError("disk full")

    released: list[int] = []
    writer = BackgroundWriter(_FailingSink())
    batch = {"image": np.zeros((1, 4, 4), np.uint8), "label": np.zeros(1, np.int64)}
    writer.write(batch, np.array([1]), release=lambda: released.append(1))
    writer.write(batch, np.array([2]), release=lambda: released.append(2))
    failing.set()
    with pytest.raises(OSError, match="disk full"):
        writer.drain()
    assert released == [1, 2]


def test_the_writer_thread_makes_the_commits_field_codec_ready_before_its_first_write(monkeypatch) -> None:
    # The commit's field codec imports numcodecs on first use: done on the writer thread while records
    # decode, not at the conversion's end.
    from shardkit.converters import pipeline

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(pipeline, "prepare_field_codec",
                        lambda: events.append(("prepare", threading.current_thread().name)))

    class _Sink(_KeepingSink):
        def write(self, batch: dict[str, np.ndarray], cursors: np.ndarray) -> None:
            events.append(("write", threading.current_thread().name))
            super().write(batch, cursors)

    writer = BackgroundWriter(_Sink())
    assert events == []  # no thread before the first operation (workers may still be forked)
    writer.write({"image": np.zeros((1, 4, 4), np.uint8), "label": np.zeros(1, np.int64)}, np.array([1]))
    writer.drain()
    assert events == [("prepare", "shardkit-convert-writer"), ("write", "shardkit-convert-writer")]


def test_batcher_keeps_no_view_of_a_payload_once_added() -> None:
    # A payload from the workers' ring is a view of a slot that a worker refills once the next outcome
    # is asked for: overwriting it after add() (what the worker does) must not change what is written.
    sink = _KeepingSink()
    batcher = _Batcher(sink, ["image", "label"], "image", FieldSpec((4, 4), "uint8"))
    slot = np.zeros((3, 4, 4), np.uint16)
    for i in range(3):
        slot[i] = 10 + i
        view = slot[i] if i == 1 else slot[i].view(np.uint8)[:, ::2]  # record 1: a dtype that is cast
        batcher.add({"image": view, "label": np.int64(i)}, i + 1)
        slot[i] = 99
    batcher.flush()
    np.testing.assert_array_equal(np.concatenate(sink.payloads)[:, 0, 0], [10, 11, 12])


def test_two_workers_hand_over_every_payload_in_order() -> None:
    # Tasks of 32 inputs in 6 ring slots, batches of 64 records: batches span tasks whose slots the
    # workers refill.
    sink = _decode_all(_CountingDecoder(), 600, workers=2)
    got = np.concatenate(sink.payloads)
    np.testing.assert_array_equal(got, np.broadcast_to((np.arange(600) % 251).astype(np.uint8)[:, None, None],
                                                       (600, 4, 4)))
    assert sink.labels == list(range(600))


class _FaultingDecoder(Decoder):
    """Allocates, fills and frees three 1 MiB buffers per input, as an image decode does, and gives the
    page faults that took as the record's label."""

    def __init__(self) -> None:
        super().__init__("image", FieldSpec((4, 4), "uint8"))

    def decode(self, item: Any, start: int = 0) -> Decoded:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = [np.ones(1 << 20, np.uint8) for _ in range(3)]
        del buffers
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return Decoded([{"image": np.zeros((4, 4), np.uint8), "label": np.int64(faults)}])

    def item_path(self, item: Any) -> str:
        return f"input-{item}"


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_decode_workers_reuse_freed_memory_instead_of_faulting_it_in_again() -> None:
    # With glibc's defaults the 3 MiB freed at the top of the heap are trimmed after every input and
    # faulted in again by the next one (about 770 page faults each); a decode worker keeps them.
    sink = _decode_all(_FaultingDecoder(), 40, workers=2)
    later = sorted(sink.labels[8:])
    assert later[len(later) // 2] < 100, later


_EXIT_GATED = False


def _wait_for(path: str) -> None:
    for _ in range(400):  # at most 20 s
        if os.path.exists(path):
            return
        threading.Event().wait(0.05)


class _GatedExitDecoder(_CountingDecoder):
    """A worker that decoded anything waits, as it exits, until the file ``gate`` exists."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def decode(self, item: Any, start: int = 0) -> Decoded:
        global _EXIT_GATED
        if not _EXIT_GATED:
            multiprocessing.util.Finalize(None, _wait_for, args=(self.gate,), exitpriority=100)
            _EXIT_GATED = True
        return super().decode(item, start)


def test_the_stream_ends_without_waiting_for_its_workers_to_exit(tmp_path: Path) -> None:
    # Workers exit while the caller writes its last batch and closes its last shard; the caller joins
    # them after that (join_ended_pools), and the next pool joins any left before it starts.
    gate = tmp_path / "gate"
    try:
        got = [o.index for o in outcomes(_GatedExitDecoder(str(gate)), list(range(40)), (0, 0), 2, 1)]
        assert got == list(range(40))
        assert multiprocessing.active_children(), "the stream waited for its workers to exit"
    finally:
        gate.touch()
        decoding.join_ended_pools()
    assert not multiprocessing.active_children()


def _record_announced(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str]]) -> None:
    """Record, in this process, every file announced with ``POSIX_FADV_WILLNEED`` (by its path)."""
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            events.append(("announce", os.readlink(f"/proc/self/fd/{fd}")))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)


class _FileDecoder(_CountingDecoder):
    """Input ``i`` is file ``i`` of ``files``; decoding it records ``("decode", path)`` in ``events``."""

    def __init__(self, files: list[str], events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.files, self.events = files, events

    def decode(self, item: Any, start: int = 0) -> Decoded:
        self.events.append(("decode", self.files[int(item)]))
        return super().decode(item, start)

    def input_files(self, item: Any) -> tuple[str, ...]:
        return (self.files[int(item)],)


def test_input_files_are_announced_ahead_of_their_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for i in range(100):
        (tmp_path / f"in{i}").write_bytes(b"x" * 100)
        files.append(str(tmp_path / f"in{i}"))
    events: list[tuple[str, str]] = []
    _record_announced(monkeypatch, events)
    decoder = _FileDecoder(files, events)
    # In this process: each file is announced before the decode of the input before it.
    assert [o.index for o in outcomes(decoder, list(range(100)), (0, 0), 1, 1)] == list(range(100))
    where = {e: k for k, e in enumerate(events)}
    assert [p for kind, p in events if kind == "announce"] == files
    assert all(where[("announce", files[i])] < where[("decode", files[i - 1])] for i in range(1, 100))
    # With workers: the parent announces every task's files as it submits the task.
    events.clear()
    assert [o.index for o in outcomes(decoder, list(range(100)), (0, 0), 2, 1)] == list(range(100))
    assert [p for kind, p in events if kind == "announce"] == files


def test_announcing_skips_what_is_not_a_readable_regular_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "fifo")  # opened blocking, it would wait for a writer forever
    (tmp_path / "file").write_bytes(b"x")
    events: list[tuple[str, str]] = []
    _record_announced(monkeypatch, events)
    names = [str(tmp_path / n) for n in ("fifo", "missing", "file")]
    decoding.announce_inputs(_FileDecoder(names, events), range(3))
    assert events == [("announce", names[2])]


def test_announcing_never_opens_a_special_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device or FIFO among the inputs is not even opened (opening a device can act on it)."""
    os.mkfifo(tmp_path / "fifo")
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(decoding.os, "open", spy)
    names = [str(tmp_path / "fifo"), "/dev/null"]
    decoding.announce_inputs(_FileDecoder(names, []), range(2))
    assert opened == []


def test_an_image_folder_conversion_announces_its_images(corpus: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    _record_announced(monkeypatch, events)
    shardkit.convert(corpus, tmp_path / "out", size=16, workers=1)
    images = sorted(str(p) for p in (corpus / "train").rglob("*") if p.is_file())  # the split converted
    assert sorted({p for _, p in events} & set(images)) == images
