"""``shardkit.convert`` from a script as users write it: no ``__main__`` guard, a progress bar when a
person watches, a summary of skipped inputs in the log."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

import shardkit
from tests.helpers.corpora import make_imagefolder

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _run(script: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guard") / "corpus"
    make_imagefolder(root, per_class=4, bad=False)
    return root


def test_readme_example_without_guard_runs_with_worker_processes(corpus: Path, tmp_path: Path) -> None:
    # The README's example, saved as a script as it is written: convert at the top level, then read.
    script = _script(tmp_path, "example.py", f"""
        import logging
        import shardkit
        from shardkit.readers import TieredSampler

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        shardkit.convert({str(corpus)!r}, "out/a", size=24, workers=2)
        with TieredSampler("out/a", tiers="ram", ram_size="1MiB", batch_size=4, epochs=1, seed=0) as s:
            n = sum(len(b["key"]) for b in s)
        print("read", n)
    """)
    r = _run(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read 12" in r.stdout
    assert "forking the 2 decode workers" in r.stderr  # workers ran, without re-running the script
    assert "Traceback" not in r.stderr
    one = shardkit.convert(corpus, tmp_path / "one", size=24, workers=1)
    assert one.records == 12
    assert _files(tmp_path / "out" / "a") == _files(tmp_path / "one")  # byte-identical to one process


def test_the_readme_python_example_runs_as_a_script(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    tour = text[text.index("## 30-second tour") :]
    code = tour[tour.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert "shardkit.convert(" in code and "__main__" not in code  # as documented: no guard
    (tmp_path / "datasets").symlink_to(REPO / "datasets")
    script = _script(tmp_path, "readme.py", code + "print('images', images.shape)\n")
    r = _run(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "images (" in r.stdout and (tmp_path / "sheet.png").is_file()
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr


def test_guarded_script_keeps_forkserver_workers(corpus: Path, tmp_path: Path) -> None:
    # A thread of the program's own runs, so the workers are not forked (fork_is_safe) but started by
    # the fork server, which re-imports the script as __mp_main__.
    script = _script(tmp_path, "guarded.py", f"""
        import logging
        import threading
        import shardkit

        def main():
            threading.Thread(target=threading.Event().wait, daemon=True).start()
            logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
            s = shardkit.convert({str(corpus)!r}, "out/g", size=24, workers=2)
            print("records", s.records)

        if __name__ == "__main__":
            main()
    """)
    r = _run(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "records 12" in r.stdout and "forking" not in r.stderr


@pytest.mark.parametrize("body,expected", [
    ("print(call_is_guarded())", "False"),
    ("if __name__ == '__main__':\n    print(call_is_guarded())", "True"),
    ("if '__main__' == __name__:\n    print(call_is_guarded())", "True"),
    ("def f():\n    print(call_is_guarded())\nif __name__ == '__main__':\n    f()", "True"),
    ("def f():\n    print(call_is_guarded())\nf()", "False"),
    ("if __name__ != '__main__':\n    pass\nelse:\n    print(call_is_guarded())", "False"),
    ("if __name__ == '__main__':\n    pass\nelse:\n    pass\nprint(call_is_guarded())", "False"),
])
def test_guard_is_read_from_the_script(tmp_path: Path, body: str, expected: str) -> None:
    script = _script(tmp_path, "s.py", "from shardkit.converters.main_guard import call_is_guarded\n" + body + "\n")
    r = _run(script, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


def test_without_fork_the_script_decodes_in_process_and_says_how_to_get_workers(corpus: Path, tmp_path: Path) -> None:
    script = _script(tmp_path, "nofork.py", f"""
        import multiprocessing
        import shardkit

        multiprocessing.get_all_start_methods = lambda: ["spawn", "forkserver"]   # as on a system without fork
        s = shardkit.convert({str(corpus)!r}, "out/n", size=24, workers=2)
        print("records", s.records)
    """)
    r = _run(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "records 12" in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "decoding in this process instead of 2 workers" in ln]
    assert len(lines) == 1 and 'if __name__ == "__main__":' in lines[0]


def test_a_worker_re_running_the_script_never_touches_the_output(corpus: Path, tmp_path: Path) -> None:
    # What a forkserver / spawn worker does while it starts: run the script as __mp_main__.
    target = _script(tmp_path, "unguarded.py", f"""
        import shardkit
        shardkit.convert({str(corpus)!r}, "out/w", size=24, workers=1)
    """)
    script = _script(tmp_path, "runner.py", f"""
        import runpy
        from shardkit.errors import ConversionError
        try:
            runpy.run_path({str(target)!r}, run_name="__mp_main__")
        except ConversionError as exc:
            print("refused:", exc)
    """)
    r = _run(script)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "worker process" in r.stdout and "__name__" in r.stdout
    assert not (tmp_path / "out").exists()


def _stderr_through_a_terminal(script: Path) -> str:
    """Run ``script`` with its standard error on a pseudo-terminal, as when a person runs it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen([sys.executable, str(script)], cwd=script.parent, stdout=subprocess.DEVNULL,
                            stderr=slave, env=_env())
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_python_api_draws_a_progress_bar_only_when_someone_watches(corpus: Path, tmp_path: Path) -> None:
    script = _script(tmp_path, "bar.py", f"""
        import sys
        import shardkit
        if __name__ == "__main__":
            shardkit.convert({str(corpus)!r}, "out/b", size=24, workers=1, overwrite=True)
            print("tqdm imported:", "tqdm" in sys.modules)
    """)
    watched = _stderr_through_a_terminal(script)
    assert "convert imagefolder" in watched and "12/12" in watched
    piped = _run(script)
    assert piped.returncode == 0 and "convert imagefolder" not in piped.stderr
    # Nobody watches: tqdm (~0.1 s of CPU to import, paid before the commit) is not even imported.
    assert "tqdm imported: False" in piped.stdout


def test_python_api_logs_a_summary_of_skipped_inputs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "corpus"
    expected = make_imagefolder(root, per_class=2)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        s = shardkit.convert(root, tmp_path / "out", size=16, workers=1)
    assert s.num_skipped == len(expected)
    lines = [r.getMessage() for r in caplog.records if "inputs skipped" in r.getMessage()]
    assert len(lines) == 1
    assert f"{len(expected)} inputs skipped" in lines[0] and "corrupt: 1" in lines[0]
    assert "logging at level INFO lists them" in lines[0]


def test_fork_server_imports_the_decoder_once_and_keeps_the_programs_own_preload(tmp_path: Path) -> None:
    # A fresh interpreter (its fork server not started yet): the program asked for `csv`; a conversion
    # with 2 workers adds shardkit's decoding modules, keeps `csv`, and its workers find them imported.
    # The program runs a thread of its own, so the workers are not forked (fork_is_safe).
    src = tmp_path / "corpus"
    make_imagefolder(src, per_class=2, splits=("train",))
    script = tmp_path / "preload.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, sys
        from multiprocessing import forkserver
        import shardkit
        from concurrent.futures import ProcessPoolExecutor

        def loaded(_):
            return sorted(m for m in ("csv", "shardkit.converters.decoding") if m in sys.modules)

        if __name__ == "__main__":
            import threading
            threading.Thread(target=threading.Event().wait, daemon=True).start()
            mp.set_forkserver_preload(["csv"])
            shardkit.convert({str(src)!r}, {str(tmp_path / "out")!r}, size=8, workers=2, progress=False)
            print(forkserver._forkserver._preload_modules)
            with ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
                print(pool.submit(loaded, 0).result())
    """))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    preload, in_worker = res.stdout.strip().splitlines()[-2:]
    assert preload.startswith("['csv', ") and "'shardkit.converters.decoding'" in preload and "'shardkit.converters.imagefolder'" in preload
    assert in_worker == "['csv', 'shardkit.converters.decoding']"


_PARENT_PID_SCRIPT = """
    import os, sys, threading
    import numpy as np
    import shardkit

    def parent(i):
        return {{"x": np.full(64, i, np.uint8), "ppid": os.getppid()}}

    if __name__ == "__main__":
        if sys.argv[1] == "thread":
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        s = shardkit.write(parent, range(24), sys.argv[2], workers=2, progress=False)
        ppids = set(shardkit.open_dataset(sys.argv[2]).field("ppid").tolist())
        print("me", os.getpid(), "workers' parents", sorted(ppids))
"""


@pytest.mark.parametrize("threads", ["none", "thread"])
def test_workers_are_forked_from_a_guarded_script_with_no_other_thread(tmp_path: Path, threads: str) -> None:
    # Forked workers start with the caller's imports and decoder (no fork server, no interpreter start-up):
    # their parent is the calling process. Another thread in the caller (it might hold a lock the child
    # would inherit) keeps the fork server; both give the same bytes.
    script = _script(tmp_path, "ppid.py", _PARENT_PID_SCRIPT.format())
    out = tmp_path / f"out-{threads}"
    r = subprocess.run([sys.executable, str(script), threads, str(out)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    me, parents = int(words[1]), r.stdout.split("workers' parents")[1].strip()
    if threads == "none":
        assert parents == f"[{me}]"
    else:
        assert str(me) not in parents and parents.startswith("[")


def test_fork_is_not_safe_with_another_thread_or_a_thread_pool_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from shardkit.converters import main_guard
    from shardkit.processes import FORK_UNSAFE_MODULES

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    for name in FORK_UNSAFE_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main_guard.fork_is_safe() == sys.platform.startswith("linux")
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert not main_guard.fork_is_safe()
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", sys)
    assert not main_guard.fork_is_safe()


def test_a_forked_worker_does_not_hold_the_output_lock(tmp_path: Path) -> None:
    # Workers are forked from a process holding the output's flock: each closes its copy at once, so one
    # outliving a killed owner cannot make the re-run find the output "in use".
    from shardkit.converters.partrun import _OutputLock
    from shardkit.stores import open_store

    (tmp_path / "out").mkdir()
    lock = _OutputLock(open_store(tmp_path / "out"))
    lock.acquire()
    try:
        assert lock.fd is not None
        pid = os.fork()
        if pid == 0:  # the child: only look at the descriptor, then leave without any clean-up
            try:
                os.fstat(lock.fd)
            except OSError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # closed in the child
        os.fstat(lock.fd)  # and still open (and locked) here
    finally:
        lock.release()


def test_workers_of_a_later_conversion_see_the_environment_as_it_is_then(tmp_path: Path) -> None:
    """A program with a thread of its own gets workers from a fork server, which keeps the
    environment it started with: a variable the program sets after its first conversion (credentials,
    an endpoint) must still reach the workers of the next one."""
    script = _script(tmp_path, "late_env.py", """
        import os
        import threading
        import numpy as np
        import shardkit
        from shardkit.formats import open_dataset

        def make(i):
            return {"image": np.full((4, 4, 3), int(i), np.uint8), "seen": int(os.environ.get("SHARDKIT_TEST_LATE", "0"))}

        def main():
            threading.Thread(target=threading.Event().wait, daemon=True).start()
            shardkit.write(make, list(range(6)), "out/first", workers=2, progress=False)
            os.environ["SHARDKIT_TEST_LATE"] = "7"
            shardkit.write(make, list(range(6)), "out/second", workers=2, progress=False)
            with open_dataset("out/second") as ds:
                print("seen", sorted(set(np.asarray(ds.fields["seen"]).tolist())))

        if __name__ == "__main__":
            main()
    """)
    r = _run(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "seen [7]" in r.stdout, r.stdout + r.stderr[-2000:]
