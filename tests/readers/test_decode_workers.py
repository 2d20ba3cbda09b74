"""Decoding compressed records on ``decode_workers`` threads: the same batches as decoding in the
reading thread, reads that go on while records decode, and a damaged record that is a named error."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import open_dataset
from shardkit.formats.reader import DECODE_JOB_RECORDS, PayloadArray, _DecodeJobs
from shardkit.readers import TieredSampler
from tests.helpers.datasets import flip_byte, write_dataset

pytest.importorskip("imagecodecs")


def _images(n: int) -> np.ndarray:
    """Smooth, distinct images (gradients with a per-record offset): what JPEG is made for."""
    y, x = np.mgrid[0:24, 0:32]
    base = np.stack([x * 7, y * 9, (x + y) * 4], axis=-1)
    return np.stack([(base + 11 * i) % 256 for i in range(n)]).astype(np.uint8)


@pytest.fixture
def jpeg_dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "ds", _images(40), records_per_shard=7, compression="jpeg")


@pytest.mark.parametrize("tiers", ["ram", "ram,ssd"])
def test_decode_workers_give_the_batches_of_the_reading_thread(jpeg_dataset: Path, tmp_path: Path, tiers: str) -> None:
    with open_dataset(jpeg_dataset) as ds:
        decoded = ds.payload.read(np.arange(40))  # every record, decoded in this thread
    for workers in (0, 2):
        s = TieredSampler(jpeg_dataset, tiers=tiers, batch_size=6, ram_size="10records", ssd_size="20records",
                          ssd_dir=tmp_path, static_cache=0, decode_workers=workers, epochs=2, seed=4)
        seen = []
        for batch in s:
            np.testing.assert_array_equal(batch["image"], decoded[batch["key"]])
            seen.append(batch["key"])
        s.close()
        keys = np.concatenate(seen).reshape(2, 40)
        assert all(sorted(k.tolist()) == list(range(40)) for k in keys)


def test_reads_go_on_while_records_decode(jpeg_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run of a sparse read is read while the decoders are held: reading never waits on decoding."""
    with open_dataset(jpeg_dataset) as ds:
        payload = ds.payload
        payload.use_decoders(2)
        keys = np.arange(0, 40, 3)  # 14 records in 6 shards; runs split at every shard
        runs = len(set((keys // 7).tolist()))
        release, all_read = threading.Event(), threading.Event()
        reads = 0
        add = _DecodeJobs.add  # once per run read (copied, or its pages mapped), from the reading thread
        codec = payload.codec
        assert codec is not None
        decode = codec.decode

        def counting_add(self: _DecodeJobs, *args: Any) -> None:
            nonlocal reads
            add(self, *args)
            reads += 1
            if reads == runs:
                all_read.set()

        def held_decode(data: Any, out: np.ndarray) -> None:
            assert release.wait(30), "the test did not release the decoders"
            decode(data, out)

        monkeypatch.setattr(_DecodeJobs, "add", counting_add)
        monkeypatch.setattr(codec, "decode", held_decode)
        result: list[np.ndarray] = []
        reader = threading.Thread(target=lambda: result.append(payload.read(keys)))
        reader.start()
        try:
            assert all_read.wait(30), f"{reads} of {runs} runs read while the decoders were held"
            assert not result  # nothing returned before its records are decoded
        finally:
            release.set()
            reader.join(30)
        monkeypatch.undo()
        payload.use_decoders(0)
        np.testing.assert_array_equal(result[0], payload.read(keys))


def test_decode_jobs_group_runs_and_shrink_towards_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of one-record runs is decoded in few jobs (not one a run), the jobs never larger than
    DECODE_JOB_RECORDS and shrinking to one record at the end, so the decoders finish together."""
    path = write_dataset(tmp_path / "ds", _images(120), records_per_shard=120, compression="jpeg")
    with open_dataset(path) as ds:
        payload = ds.payload
        payload.use_decoders(2)
        payload.gap_bytes = 0  # every other record: each one a run of its own
        keys = np.arange(0, 120, 2)
        codec = payload.codec
        assert codec is not None
        decode, decode_segments = codec.decode, PayloadArray._decode_segments
        release, all_read = threading.Event(), threading.Event()
        sizes: list[int] = []
        reads = 0
        add = _DecodeJobs.add

        def counting_add(self: _DecodeJobs, *args: Any) -> None:  # args[3]: the records' offsets
            nonlocal reads
            add(self, *args)
            reads += len(args[3])
            if reads == keys.size:
                all_read.set()

        def held_decode(data: Any, out: np.ndarray) -> None:
            assert release.wait(30), "the test did not release the decoders"
            decode(data, out)

        def counted(self: PayloadArray, segments: list[Any], targets: list[np.ndarray]) -> None:
            sizes.append(sum(len(seg[3]) for seg in segments))
            decode_segments(self, segments, targets)

        monkeypatch.setattr(codec, "decode", held_decode)
        monkeypatch.setattr(PayloadArray, "_decode_segments", counted)
        monkeypatch.setattr(_DecodeJobs, "add", counting_add)
        result: list[np.ndarray] = []
        reader = threading.Thread(target=lambda: result.append(payload.read(keys)))
        reader.start()
        try:  # the decoders hold their first jobs: every later run is read while they are busy
            assert all_read.wait(30), f"{reads} of {keys.size} records handed over while the decoders were held"
        finally:
            release.set()
            reader.join(30)
        monkeypatch.undo()
        payload.use_decoders(0)
        np.testing.assert_array_equal(result[0], payload.read(keys))
    assert sum(sizes) == keys.size
    assert len(sizes) <= keys.size // 4, sizes
    assert max(sizes) <= DECODE_JOB_RECORDS and max(sizes) > 1, sizes
    later = sizes[2:]  # the first two went at once, to the idle decoders
    assert later == sorted(later, reverse=True) and later[-1] == 1, sizes


def test_no_decode_threads_without_workers_or_codec(tmp_path: Path) -> None:
    raw = write_dataset(tmp_path / "raw", _images(5))
    for path, workers in ((raw, 4), (write_dataset(tmp_path / "j", _images(5), compression="jpeg"), 0)):
        with open_dataset(path, decode_workers=workers) as ds:
            ds.payload.read(np.arange(5))
            assert ds.payload._decoders is None


def test_a_damaged_record_decoded_by_a_worker_is_a_named_error(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "ds", _images(40), records_per_shard=20, compression="jpeg")
    with open_dataset(path) as ds:
        offset = int(ds.payload.index(1).offsets[3])  # record 23, far from the shard's checked tail
        shard = ds.payload.shard_path(1)
    data = shard.read_bytes()
    sof = data.index(b"\xff\xc0", offset)
    flip_byte(shard, sof + 6, 0x01)  # the frame's height says another image size
    s = TieredSampler(path, batch_size=8, ram_size="16records", static_cache=0, decode_workers=2, seed=1)
    with pytest.raises(errors.CorruptShardError, match=rf"image/c/1/0/0/0: shard 1 \(records 20-39\): record 23 at offset {offset} "):
        for _ in s:
            pass
    s.close()


def test_decode_off_gives_the_stored_streams_and_their_lengths(jpeg_dataset: Path) -> None:
    import imagecodecs

    with open_dataset(jpeg_dataset) as ds:
        decoded = ds.payload.read(np.arange(40))
        sizes = np.concatenate([ds.payload.index(i).nbytes[: info.count] for i, info in enumerate(ds.meta.shards)])
    s = TieredSampler(jpeg_dataset, batch_size=6, ram_size="10records", static_cache=0, decode=False, seed=2)
    assert s.element_spec()["image"] == ((24 * 32 * 3,), np.dtype(np.uint8))
    assert s.element_spec()["image_nbytes"] == ((), np.dtype(np.int64))
    seen = 0
    for batch in s:
        rows, lengths, keys = batch["image"], batch["image_nbytes"], batch["key"]
        assert rows.dtype == np.uint8 and rows.shape == (keys.size, 24 * 32 * 3)
        np.testing.assert_array_equal(lengths, sizes[keys])
        for row, n, k in zip(rows, lengths, keys):
            assert not row[n:].any()  # zeros after the stream
            np.testing.assert_array_equal(imagecodecs.jpeg8_decode(row[:n].tobytes()), decoded[k])
        seen += keys.size
    s.close()
    assert seen == 40


def test_decode_off_refuses_records_stored_larger_than_decoded(tmp_path: Path) -> None:
    # 8x8 noise: a JPEG stream (headers and tables alone are ~600 bytes) is larger than its 192 pixels' bytes.
    noise = np.random.default_rng(0).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    path = write_dataset(tmp_path / "ds", noise, compression="jpeg")
    with pytest.raises(errors.SchemaError, match=r"record \d is stored in \d+ bytes, more than the 192 bytes"):
        TieredSampler(path, batch_size=2, decode=False)


def test_decode_cuda_without_a_device_is_an_explicit_error(jpeg_dataset: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(errors.ConfigError, match="decode='cuda' needs"):
        TieredSampler(jpeg_dataset, batch_size=2, decode="cuda")


def test_order_battery_passes_on_a_jpeg_dataset_through_the_ssd_tier(tmp_path: Path) -> None:
    """The real chain on JPEG records: convert, sample 400 epochs through ram,ssd with decode workers,
    order-test the keys. The order is decided on keys before any payload is read, so the codec cannot
    change it; this checks the jpeg path end to end does not either."""
    from shardkit.cli.main import main
    from shardkit.ordertest import run
    from tests.helpers.datasets import DATASETS

    def cli(*args: str) -> int:
        try:
            main(list(args))
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    ds, keys, labels = tmp_path / "ds", tmp_path / "keys.npy", tmp_path / "labels.npy"
    assert cli("convert", str(DATASETS / "imagefolder"), "-o", str(ds), "--size", "16", "-j", "1", "--compression", "jpeg") == 0
    assert cli("sample", str(ds), "--epochs", "400", "--batch-size", "4", "--seed", "5", "--tiers", "ram,ssd",
               "--ram-size", "6records", "--ssd-size", "12records", "--static-cache", "0", "--decode-workers", "2",
               "--ssd-dir", str(tmp_path), "--order-out", str(keys)) == 0
    with open_dataset(ds) as d:
        assert d.meta.compression == {"name": "jpeg", "quality": 90}
        np.save(labels, np.asarray(d.fields["label"]))
    report = run(keys, labels=labels, batch_size=4)
    assert report.passed and {r.name for r in report.tested} >= {"item_position", "adjacent_pairs", "epoch_independence"}


def test_torch_adapter_delivers_decoded_jpeg_records(jpeg_dataset: Path) -> None:
    pytest.importorskip("torch")
    from shardkit.adapters.torch import ShardIterableDataset

    with open_dataset(jpeg_dataset) as ds:
        decoded = ds.payload.read(np.arange(40))
    seen = 0
    for batch in ShardIterableDataset(jpeg_dataset, batch_size=8, decode_workers=2, seed=3, static_cache=0):
        np.testing.assert_array_equal(batch["image"].numpy(), decoded[batch["key"].numpy()])
        seen += len(batch["key"])
    assert seen == 40


def test_records_read_by_range_decode_on_the_decode_threads(tmp_path: Path, s3: Any) -> None:
    """An object-store dataset read without a local cache: each response's records are decoded by
    the decode threads (the reading thread goes on to the next response), into the same rows."""
    from tests.helpers.datasets import upload

    local = write_dataset(tmp_path / "ds", _images(40), records_per_shard=7, compression="jpeg")
    url = upload(local, s3.url(f"decode-{tmp_path.name}"))
    keys = np.random.default_rng(0).permutation(40)[:25]
    with open_dataset(local) as ds:
        expected = ds.payload.read(keys)
    with open_dataset(url, decode_workers=2) as ds:
        assert ds.cache is None
        codec = ds.payload.codec
        assert codec is not None
        decode, threads = codec.decode, set()

        def named_decode(data: Any, out: np.ndarray) -> None:
            threads.add(threading.current_thread().name)
            decode(data, out)

        codec.decode = named_decode  # type: ignore[method-assign]
        np.testing.assert_array_equal(ds.payload.read(keys), expected)
    assert threads and all(t.startswith("shardkit-decode") for t in threads), threads


def test_rgb_jpeg_batches_start_where_the_colour_conversion_writes_with_ordinary_stores(jpeg_dataset: Path, tmp_path: Path) -> None:
    # libjpeg-turbo writes a row that starts on a 32-byte boundary with non-temporal stores (80-90 µs
    # more per 224x224 record here): batch rows of RGB JPEG records start 16 bytes past a page.
    from shardkit.formats.media_codecs import JPEG_ROW_OFFSET

    def starts(path: Path, **options: Any) -> set[int]:
        s = TieredSampler(path, batch_size=6, static_cache=0, decode_workers=2, seed=1, **options)
        got = set()
        with open_dataset(path) as ds:
            for batch in s:
                got.add(batch["image"].__array_interface__["data"][0] % 4096)
                if options.get("decode", True) is True:
                    np.testing.assert_array_equal(batch["image"], ds.payload.read(batch["key"]))
        s.close()
        return got

    assert JPEG_ROW_OFFSET % 32 and starts(jpeg_dataset) == {JPEG_ROW_OFFSET}
    # The stored bytes (no decoder), gray JPEG (no colour conversion), uncompressed records: page aligned.
    assert starts(jpeg_dataset, decode=False) == {0}
    gray = write_dataset(tmp_path / "gray", _images(12)[..., :1], records_per_shard=7, compression="jpeg")
    plain = write_dataset(tmp_path / "plain", _images(12), records_per_shard=7)
    assert starts(gray) == starts(plain) == {0}


def test_rgb_jpeg_batches_in_shared_memory_start_past_a_page_too(jpeg_dataset: Path) -> None:
    # A DataLoader worker's batch buffers (shared memory, adapters/_handover.py) start where the
    # sampler's own do, so the decoders write their rows with ordinary stores there as well.
    pytest.importorskip("torch")
    from shardkit.adapters._handover import SharedBatchMemory
    from shardkit.formats.media_codecs import JPEG_ROW_OFFSET

    s = TieredSampler(jpeg_dataset, batch_size=6, static_cache=0, decode_workers=2, seed=1)
    s.use_buffer_memory(SharedBatchMemory(extra_hold=2))
    starts = set()
    with open_dataset(jpeg_dataset) as ds:
        for batch in s:
            starts.add(batch["image"].__array_interface__["data"][0] % 4096)
            np.testing.assert_array_equal(batch["image"], ds.payload.read(batch["key"]))
    s.close()
    assert starts == {JPEG_ROW_OFFSET}
