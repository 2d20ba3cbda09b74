"""The pure helpers of ``benchmarks/remote.py`` and ``benchmarks/_remote_peers.py``: the request counter
of the proxy (and the proxy itself against a tiny HTTP server), the epoch check, the tables."""

from __future__ import annotations

import http.server
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.helpers.benchmarks import load_benchmark

STREAM = (
    b"GET /bucket/a HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n\r\n"
    b"PUT /bucket/b HTTP/1.1\r\nContent-Length: 24\r\n\r\nGET /not-a-request HTTP/"
    b"POST /bucket/c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nGET /\r\n3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
    b"HEAD /bucket/d HTTP/1.1\r\n\r\n"
)


@pytest.fixture
def remote(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("remote", monkeypatch)


@pytest.mark.parametrize("step", [1, 2, 5, 13, len(STREAM)])
def test_request_counter_counts_requests_not_body_bytes(remote: ModuleType, step: int) -> None:
    """Bodies (by length and chunked) that look like requests are skipped, however the stream is cut."""
    c = remote.RequestCounter()
    for i in range(0, len(STREAM), step):
        c.feed(STREAM[i : i + step])
    assert dict(c.by_method) == {"GET": 1, "PUT": 1, "POST": 1, "HEAD": 1}
    assert c.requests == 4 and not c.lost


def test_request_counter_gives_up_on_garbage_without_buffering_it(remote: ModuleType) -> None:
    c = remote.RequestCounter()
    c.feed(b"x" * (remote.RequestCounter.MAX_HEAD + 10))
    assert c.lost and c.requests == 0
    c.feed(b"GET / HTTP/1.1\r\n\r\n")  # once lost, nothing more is counted (or kept)
    assert c.requests == 0 and len(c._buf) <= remote.RequestCounter.MAX_HEAD + 10
    bad = remote.RequestCounter()
    bad.feed(b"PUT / HTTP/1.1\r\nContent-Length: lots\r\n\r\n")
    assert bad.lost and bad.requests == 1


@pytest.fixture
def http_server() -> Iterator[int]:
    body = bytes(range(256)) * 400

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_proxy_counts_requests_and_bytes_from_the_server(remote: ModuleType, http_server: int) -> None:
    proxy = remote.DelayProxy(http_server, 0.0)
    try:
        before = proxy.counters()
        for _ in range(3):
            with urllib.request.urlopen(f"{proxy.endpoint}/obj", timeout=30) as r:
                assert len(r.read()) == 102400
        d = remote.counter_delta(before, proxy.counters())
    finally:
        proxy.close()
    assert d["requests"] == 3 and d["requests_GET"] == 3
    assert 3 * 102400 <= d["bytes"] < 3 * 102400 + 3 * 1024  # the bodies and their response heads


def test_link_cap_never_runs_ahead_of_its_rate(remote: ModuleType) -> None:
    """Connections sharing a cap: no piece leaves before the bytes ahead of it could cross the link at
    its rate (a load can only make pieces later), and every connection gets its pieces through."""
    rate, piece = 20e6, 64 << 10
    cap = remote.LinkCap(rate)
    sent: list[tuple[str, float]] = []

    async def connection(name: str) -> None:
        for _ in range(4):
            await cap.take(piece)
            sent.append((name, remote.time.monotonic()))

    async def run() -> float:
        t0 = remote.time.monotonic()
        await remote.asyncio.gather(*(connection(n) for n in "abc"))
        return t0

    t0 = remote.asyncio.run(run())
    assert sorted(name for name, _ in sent) == sorted("abc" * 4)
    for i, (_, at) in enumerate(sent):
        assert at - t0 >= i * piece / rate - 1e-3
    assert cap.free_at - t0 >= 12 * piece / rate - 1e-3


def test_proxy_caps_the_bytes_it_answers_only_when_asked(remote: ModuleType, http_server: int) -> None:
    """Through a proxy capped at 10 MB/s, parallel GETs of 4 MB take at least what the cap allows
    (less one piece), and the proxy's timeline holds every byte it counted; without ``mbps`` the
    proxy has no cap."""
    mbps, gets = 10.0, 40
    proxy = remote.DelayProxy(http_server, 0.0, mbps)
    try:
        before, t0 = proxy.counters(), remote.time.monotonic()

        def get(_: int) -> int:
            with urllib.request.urlopen(f"{proxy.endpoint}/obj", timeout=30) as r:
                return len(r.read())

        with remote.ThreadPoolExecutor(8) as ex:
            total = sum(ex.map(get, range(gets)))
        t1 = remote.time.monotonic()
        d = remote.counter_delta(before, proxy.counters())
        bins = proxy.timeline(t0, t1)
    finally:
        proxy.close()
    assert total == gets * 102400 and d["requests"] == gets
    assert t1 - t0 >= (d["bytes"] - remote.LinkCap.PIECE) / (mbps * 1e6)
    assert sum(bins) == d["bytes"]
    profile = remote.link_profile(bins, t0, t1, mbps)
    assert 0 < profile["link_use"] <= 1.0 + remote.LinkCap.PIECE / d["bytes"]
    plain = remote.DelayProxy(http_server, 0.0)
    try:
        assert plain.mbps is None and plain.proc.args[-1] == "0"
    finally:
        plain.close()


def test_link_profile_splits_the_idle_link_time(remote: ModuleType) -> None:
    """Idle link time before the link got busy, between, and after it was last busy; whole bins."""
    mbps, full = 100.0, 10_000_000  # a full 0.1 s bin at 100 MB/s
    bins = [0, 0, full, full // 4, full, 0]
    started = 1000 * remote.Timeline.BIN
    p = remote.link_profile(bins, started, started + 6 * remote.Timeline.BIN - 1e-9, mbps)
    assert p["link_MB"] == [0.0, 0.0, 10.0, 2.5, 10.0, 0.0]
    assert abs(p["idle_start_s"] - 0.2) < 1e-6 and abs(p["idle_mid_s"] - 0.075) < 1e-6
    assert abs(p["idle_end_s"] - 0.1) < 1e-6 and abs(p["link_use"] - 22.5 / 60) < 1e-6
    assert "link_use" not in remote.link_profile(bins, started, started + 0.6, None)


def test_in_flight_bins_follow_the_prefetchers_changes(remote: ModuleType) -> None:
    """Parts in flight at the end of each 0.1 s bin, on the proxy's bins (the prefetcher's times are
    seconds since its start)."""
    from types import SimpleNamespace

    t0 = 500 * remote.Timeline.BIN
    changes = [(0.01, 0, 1), (0.05, 0, 2), (0.15, 1, 2), (0.35, 0, 0)]
    pf = SimpleNamespace(_t0=t0, stats=SimpleNamespace(in_flight=changes))
    assert remote._in_flight_bins(pf, t0 + 0.001, t0 + 0.45) == [(0, 2), (1, 2), (1, 2), (0, 0), (0, 0)]


def _records(keys: list[int]) -> np.ndarray:
    recs = np.zeros((len(keys), 16, 1024), dtype=np.uint8)
    recs[:, 5, 7] = np.arange(len(keys)) % 251
    for i, k in enumerate(keys):
        recs[i].reshape(-1)[:8] = np.array([k], dtype=np.int64).view(np.uint8)
        recs[i].reshape(-1)[8192] = k % 256  # a byte the 1-in-4096 sample sees
    return recs


def test_epoch_check_equal_records_in_another_order(monkeypatch: pytest.MonkeyPatch) -> None:
    peers = load_benchmark("_remote_peers", monkeypatch)
    keys = list(range(10))
    a, b = peers.EpochCheck(10), peers.EpochCheck(10)
    a.add(keys[:4], _records(keys[:4]))
    a.add(keys[4:], _records(keys[4:]))
    shuffled = [3, 1, 9, 0, 2, 8, 7, 4, 6, 5]
    recs = _records(keys)[shuffled]
    b.add(shuffled, recs)
    sa, sb = a.summary(), b.summary()
    assert sa["complete"] and sb["complete"] and sa["records"] == 10
    assert sa["unordered"] == sb["unordered"] and sa["ordered"] != sb["ordered"]
    # A record whose sampled bytes differ changes the digest; a duplicate or a wrong key is not complete.
    c = peers.EpochCheck(10)
    bad = _records(keys)
    bad[2].reshape(-1)[8192] ^= 1
    c.add(keys, bad)
    assert c.summary()["unordered"] != sa["unordered"]
    d = peers.EpochCheck(10)
    d.add([0, 0, 1], _records([0, 0, 1]))
    assert not d.complete
    e = peers.EpochCheck(3)
    e.add([0, 1, 2], _records([0, 1, 5]))  # the key a record carries in its bytes is not the key given
    assert e.mismatched == 1 and not e.complete


def _run(system: str, lat: float, rnd: int, mbs: float, raw: float, epoch: int = 1, **kw: object) -> dict[str, object]:
    return {"system": system, "latency_ms": lat, "round": rnd, "epoch": epoch, "MB/s": mbs, "ratio": mbs / raw, **kw}


def test_tables_give_medians_spread_and_errors(remote: ModuleType) -> None:
    runs = []
    for rnd, raw in enumerate([100.0, 200.0, 150.0], 1):
        runs.append(_run("raw", 50, rnd, raw, raw, fetched_MB=100.0, requests=4))
        runs.append(_run("cache", 50, rnd, raw / 2, raw, first_batch_s=0.5 * rnd, fetched_MB=100.0, requests=5,
                         same_as_local="order", cpu_s_per_GB=2.0, server_cpu_s_per_GB=3.0, link_use=0.6 + 0.1 * rnd,
                         idle_start_s=0.1, idle_mid_s=0.2, idle_end_s=0.3))
        runs.append(_run("cache", 50, rnd, raw, raw, epoch=2, fetched_MB=0.0, requests=0,
                         same_as_local="records" if rnd == 2 else "order"))
        runs.append({"system": "litdata", "latency_ms": 50, "round": rnd, "epoch": 1, "error": "no venv"})
    rows = remote.summarize(runs)
    cold = next(r for r in rows if r["system"] == "cache" and r["epoch"] == 1)
    warm = next(r for r in rows if r["system"] == "cache" and r["epoch"] == 2)
    assert cold["rounds"] == 3 and cold["same_as_local"] == "order" and warm["same_as_local"] == "records"
    detail = remote.markdown_table(rows, 100.0)
    assert ("| 50 ms | shardkit, cache_dir | 1 (cold) | 75 (50-100) | 0.50 (0.50-0.50) | 1.00 | 100 (1.00x) | 5 | order "
            "| 2.00; 3.00 | 0.80 (0.70-0.90) (0.1/0.2/0.3) |") in detail
    assert "| 50 ms | shardkit, cache_dir | 2 (warm) |" in detail
    assert "| 50 ms | LitData | 1 (cold) | error: no venv |" in detail
    summary = remote.summary_table(rows)
    assert summary.splitlines()[0] == "| added latency | raw GET MB/s | LitData | shardkit, cache_dir |"
    assert summary.splitlines()[2] == "| 50 ms | 150 (100-200) | error | 0.50 (0.50-0.50) |"


def test_same_as_local(remote: ModuleType) -> None:
    local = [{"ordered": "o1", "unordered": "u"}, {"ordered": "o2", "unordered": "u"}]
    assert remote.same_as_local({"epoch": 2, "complete": True, "ordered": "o2", "unordered": "u"}, local) == "order"
    assert remote.same_as_local({"epoch": 1, "complete": True, "ordered": "x", "unordered": "u"}, local) == "records"
    assert remote.same_as_local({"epoch": 1, "complete": True, "ordered": "x", "unordered": "v"}, local) == "NO"
    assert remote.same_as_local({"epoch": 1, "complete": False, "ordered": "o1", "unordered": "u"}, local) == "NO"


def test_bench_requirements_are_the_bench_extra(remote: ModuleType) -> None:
    reqs = remote.bench_requirements(Path(remote.ROOT) / "pyproject.toml")
    names = {r.split("=")[0].split(">")[0].split("<")[0] for r in reqs}
    assert {"mosaicml-streaming", "litdata", "boto3", "torch"} <= names
    assert not any(r.startswith("shardkit") for r in reqs)  # the peers' venv does not hold shardkit


def test_raw_ranged_fetches_each_record_once_by_range(remote: ModuleType, s3: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw ranged baseline asks for every record once, one ranged GET each (no whole object,
    nothing twice), and gets exactly the records' bytes."""
    from tests.helpers.datasets import upload
    from tests.helpers.faultproxy import FaultProxy

    url = upload(remote.make_dataset(tmp_path / "ds", 6, 4), s3.url("rawranged"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        m = remote.raw_ranged(url, ["image/c/0/0/0/0", "image/c/1/0/0/0"], None, [4, 2], 128 << 10, concurrency=3)
    finally:
        proxy.close()
    rec = int(np.prod(remote.RECORD_SHAPE))
    assert m["ranges"] == 6 and m["payload_MB"] * 1e6 == 6 * rec
    assert len(proxy.gets) == 6 and all(ranged for _, ranged in proxy.gets)
    assert sorted(path.split("/image/c/")[1].split("/")[0] for path, _ in proxy.gets) == ["0"] * 4 + ["1"] * 2


def test_download_summary_gives_the_tail_parts_and_fetch_cpu_per_gb(remote: ModuleType) -> None:
    """From a pass's prefetcher: the tail after its last part, the parts by kind, and its fetch
    threads' CPU per GB downloaded (0 when it downloaded nothing), the bytes delivered from the parts,
    the background width last chosen and the parts' mean wait for their first byte."""
    from shardkit.stores.prefetch import PrefetchStats

    class Pf:
        _t0 = 100.0
        stats = PrefetchStats(parts_demanded=3, parts_background=5, bytes=2 * 10**9, cpu_s=3.0,
                              delivered_bytes=5 * 10**8, in_flight=[(0.5, 1, 0), (4.0, 0, 0)], width=19,
                              first_byte_s=0.4)

    m = remote._download_summary(Pf(), 110.0)
    assert m["tail_s"] == 6.0 and m["download_s"] == 4.0 and m["delivered_MB"] == 500.0
    assert (m["parts_demanded"], m["parts_background"], m["fetch_cpu_s_per_GB"]) == (3, 5, 1.5)
    assert m["width"] == 19 and m["first_byte_s"] == pytest.approx(0.05)
    Pf.stats = PrefetchStats(in_flight=[(0.1, 1, 0)])
    assert remote._download_summary(Pf(), 110.0)["fetch_cpu_s_per_GB"] == 0.0


def test_process_cpu_counts_a_process_cpu_and_reads_nothing_for_a_missing_one(remote: ModuleType) -> None:
    """The server's and the proxy's CPU per GB come from ``/proc/<pid>/stat`` (all threads)."""
    import os
    import time

    before = remote.process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert remote.process_cpu_s(os.getpid()) >= before + 0.1
    assert remote.process_cpu_s(2**22 + 7) == 0.0  # above pid_max's default: no such process


_BURN = ("import time, sys\nt = time.process_time()\nwhile time.process_time() - t < {cpu}: pass\n"
         "sys.stdout.write('done\\n'); sys.stdout.flush()\nsys.stdin.read()\n")


def _burner(cpu: float) -> Any:
    """A child that spends ``cpu`` CPU seconds of its own, says so, then waits for its stdin to close."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _BURN.format(cpu=cpu)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def test_tree_cpu_counts_the_processes_started_after_it_live_and_reaped(remote: ModuleType) -> None:
    """The loader rows' CPU: workers alive across epochs are read from /proc, exited ones from the
    reaped children's usage; a process running before (the server, the proxy) is left out."""
    before = _burner(0.6)  # already running when the counter is made: never counted
    tree = remote.TreeCPU()
    assert before.stdout is not None and before.stdout.readline() == "done\n"
    child = _burner(0.3)
    assert child.stdout is not None and child.stdout.readline() == "done\n"
    live = tree.split()[1]
    assert 0.3 <= live < 0.6
    child.communicate("")  # exits and is reaped: counted from RUSAGE_CHILDREN from now on
    reaped = tree.split()[1]
    before.communicate("")
    assert 0.3 <= reaped < 0.6
