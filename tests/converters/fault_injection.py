"""Kill a conversion after each file-system step in turn, re-run it, and compare with an uninterrupted one.

Run as ``python -m tests.converters.fault_injection SPEC_JSON`` (``tests/converters/test_staging.py``
does). A fresh, single-threaded process is the fork server: it imports shardkit once and forks one
child per run, so a hundred runs cost a hundred forks, not a hundred interpreter starts, and the
forks never copy pytest's threads. The modules the first (uninterrupted) run imported lazily are then
imported by the fork server too, so later children do not each import them again (about half a
second per child); a second uninterrupted run checks that this left the step count unchanged (every
step is still hooked: shardkit calls ``os.*`` and ``open`` through their modules at call time).

A *step* is one call that changes something inside the output directory: ``mkdir``, ``rmdir``,
``unlink``, ``rename``/``replace``, ``open`` for writing (``os.open`` and ``open``), ``write``,
``fsync`` and ``ftruncate``. The hooked child counts the steps it performs and sends itself SIGKILL
right after step ``k``: no timing is involved, so every instant between two steps is reached. An
``fsync`` inside the output directory is counted (and killed after) like any step but not passed to
the disk: it guards against a power cut, and a SIGKILL leaves the page cache, so what a re-run finds is
the same, without the tens of milliseconds each one costs on a loaded disk.

SPEC_JSON: ``{"src": ..., "out": ..., "kwargs": {...}, "double": [j, ...], "every": n, "executor": e,
"base": dir, "sample": m, "seed": s}`` (a list ``src`` runs ``shardkit.write(kwargs["fn"], src, out)``).
For every ``k`` (every ``n``-th with ``every``), the child is killed at step ``k``, then the same
conversion runs again (and, for each ``j`` of ``double``, that re-run is itself killed at its step
``j`` first). ``executor`` runs the conversion in parts: ``"inline"`` (parts converted in the
killed process itself) or ``"threads:N"``; ``base`` is a dataset copied to ``out`` before every run
(the conversion appends to it); ``check`` runs ``verify`` and looks for an unfinished append
(:func:`shardkit.formats.versions.unfinished`, what ``info`` shows) right after each kill, before the
re-run; ``commit_only`` kills only at the steps of the commit (and its cleanup); ``sample`` kills at only
``m`` of the steps, drawn at random with seed ``s``.
Prints one JSON object: the uninterrupted run's step count and
digest, and per ``k`` the digest after the re-run(s), how many parts were finished when the kill
came (their manifests), whether the commit had already published the root document, and how many
parts the final run converted.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import shardkit

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def install_hooks(out: Path, kill_at: int | None, count_file: Path | None) -> None:
    """Count file-system steps inside ``out``; SIGKILL this process right after step ``kill_at``."""
    root = os.path.realpath(out)
    state = {"n": 0}

    def inside(path: Any, dir_fd: int | None = None) -> bool:
        if isinstance(path, int):
            text = _fd_path(path)
        else:
            text = os.fsdecode(path)
            if dir_fd is not None and not os.path.isabs(text):
                text = os.path.join(_fd_path(dir_fd), text)
            text = os.path.realpath(text)
        return text == root or text.startswith(root + os.sep)

    def step() -> None:
        state["n"] += 1
        if count_file is not None:
            count_file.write_text(str(state["n"]))
        if kill_at is not None and state["n"] >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def path_call(real: Any) -> Any:
        def wrapped(path: Any, *args: Any, **kwargs: Any) -> Any:
            hit = inside(path, kwargs.get("dir_fd") or kwargs.get("src_dir_fd"))
            result = real(path, *args, **kwargs)
            if hit:
                step()
            return result
        return wrapped

    def fd_call(real: Any) -> Any:
        def wrapped(fd: int, *args: Any, **kwargs: Any) -> Any:
            hit = inside(fd)
            result = real(fd, *args, **kwargs)
            if hit:
                step()
            return result
        return wrapped

    real_os_open = os.open

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & _WRITE_FLAGS and inside(path, kwargs.get("dir_fd")):
            step()
        return fd

    real_open = builtins.open

    def py_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int) and any(c in mode for c in "wax+") and inside(file):
            step()
        return fh

    for name in ("mkdir", "rmdir", "unlink", "remove", "rename", "replace"):
        setattr(os, name, path_call(getattr(os, name)))
    for name in ("write", "ftruncate"):
        setattr(os, name, fd_call(getattr(os, name)))
    real_fsync = os.fsync

    def fsync(fd: Any) -> None:
        if not inside(fd if isinstance(fd, int) else fd.fileno()):
            real_fsync(fd)
            return
        os.fstat(fd if isinstance(fd, int) else fd.fileno())  # a bad descriptor still fails as fsync's would
        step()

    os.fsync = fsync
    os.open = os_open
    builtins.open = py_open
    io.open = py_open


def inject(spec: dict[str, Any], timeout: float = 3000) -> dict[str, Any]:
    """Run this module on ``spec`` in a fresh interpreter (see the module docstring) and return its report."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.converters.fault_injection", json.dumps(spec)],
                          cwd=repo, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def digest(out: Path) -> dict[str, str]:
    """Every entry under ``out``: relative path -> sha256 of a file's bytes, or ``"dir"``."""
    result: dict[str, str] = {}
    if not out.exists():
        return result
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        result[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return result


def _executor(name: str | None) -> Any:
    if name is None:
        return None
    if name == "inline":
        from shardkit.converters.executors import InlineExecutor

        return InlineExecutor()
    kind, _, n = name.partition(":")
    if kind == "threads":
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(int(n))
    raise ValueError(f"unknown executor {name!r}")


#: Parts converted by the last run that finished ("ok"), read by :func:`main`.
_LAST: dict[str, int] = {}
#: Modules the last run that finished imported (that its parent, the fork server, had not), read by :func:`_warm`.
_IMPORTED: list[str] = []


def _warm(names: list[str]) -> None:
    """Import ``names`` here, in the fork server, so that its children find them imported.

    Importing must not start a thread: a fork copies only the forking thread, and a lock another
    thread held would stay locked in every child.
    """
    import importlib
    import threading

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # a name an extension module registered for itself (e.g. Cython's runtime)
            continue
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        raise RuntimeError(f"importing {names} started threads {alive} in the fork server")


def run(src: str, out: Path, kwargs: dict[str, Any], kill_at: int | None = None,
        count_file: Path | None = None, executor: str | None = None) -> str:
    """Convert in a forked child; ``"killed"``, ``"ok"`` or ``"error: ..."``."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(rd)
        code, message = 0, b""
        try:
            before = set(sys.modules)
            install_hooks(out, kill_at, count_file)
            if count_file is not None:
                _note_commit_start(count_file)
            how = {**kwargs, **({"executor": _executor(executor)} if executor else {})}
            if isinstance(src, list):  # shardkit.write: src is the inputs, kwargs["fn"] the function
                summary = shardkit.write(how.pop("fn"), src, out, **how)
            else:
                summary = shardkit.convert(src, out, **how)
            message = json.dumps({"parts_converted": summary.parts_converted,
                                  "imported": sorted(set(sys.modules) - before)}).encode()
        except BaseException as exc:
            code, message = 3, f"{type(exc).__name__}: {exc}".encode()
        os.write(wr, message)
        os._exit(code)
    os.close(wr)
    with os.fdopen(rd, "rb") as fh:
        message = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.waitstatus_to_exitcode(status) == 0:
        report = json.loads(message)
        _IMPORTED[:] = report.pop("imported")
        _LAST.clear()
        _LAST.update(report)
        return "ok"
    return f"error: {message}"


def finished_parts(out: Path) -> int:
    """Parts of an unfinished conversion in parts whose manifest is written."""
    return len(list(out.glob(".shardkit-parts/*/p[0-9][0-9][0-9][0-9][0-9][0-9].json")))


def _note_commit_start(count_file: Path) -> None:
    """Record (in ``<count_file>.commit``) how many steps were done when the commit of a conversion in parts began."""
    from shardkit.converters import partrun

    real = partrun.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        count_file.with_name(count_file.name + ".commit").write_text(count_file.read_text())
        return real(*args, **kwargs)

    partrun.commit = commit  # type: ignore[assignment]


def _fresh(out: Path, base: str | None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    if base is not None:
        shutil.copytree(base, out, symlinks=True)


def _check(out: Path) -> dict[str, Any]:
    """``verify`` of the dataset a kill left (in this process: no hooks here), and what ``info`` would call unfinished."""
    from shardkit.errors import ShardkitError
    from shardkit.formats import verify
    from shardkit.formats.versions import unfinished

    try:
        report = verify(out)
    except ShardkitError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ok": report.ok, "unfinished": report.unfinished, "info": unfinished(out),
            "problems": [str(p) for p in report.problems[:3]]}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    src, out, kwargs = spec["src"], Path(spec["out"]), spec["kwargs"]
    executor, base = spec.get("executor"), spec.get("base")
    counter = out.with_name(out.name + ".steps")
    ref = out.with_name(out.name + ".ref")
    _fresh(ref, base)
    status = run(src, ref, kwargs, None, counter, executor)
    total = int(counter.read_text())
    reference = digest(ref)
    parts = _LAST.get("parts_converted", 0)
    shutil.rmtree(ref)
    if status == "ok":
        _warm(_IMPORTED)
        _fresh(ref, base)
        warm = run(src, ref, kwargs, None, counter, executor)
        # Parts on a Dask cluster finish in an order nobody controls, and whether a part is counted first
        # or written in place depends on it: the client's step count may differ by a few, its result not.
        scheduled = kwargs.get("scheduler") is not None
        if warm != "ok" or (not scheduled and int(counter.read_text()) != total) or digest(ref) != reference:
            raise RuntimeError(f"after importing {_IMPORTED} in the fork server, the uninterrupted run gave "
                               f"{warm} in {counter.read_text()} steps; expected ok in {total} with the same files")
        shutil.rmtree(ref)
    commit_file = counter.with_name(counter.name + ".commit")
    first_step = int(commit_file.read_text()) + 1 if spec.get("commit_only") and commit_file.exists() else 1
    runs = []
    steps = range(first_step, total + 1, int(spec.get("every", 1)))
    if spec.get("sample"):  # that many steps drawn at random (seeded: a failure names its seed)
        import random

        steps = sorted(random.Random(spec.get("seed", 0)).sample(steps, min(len(steps), int(spec["sample"]))))
    for k in steps:
        _fresh(out, base)
        first = run(src, out, kwargs, kill_at=k, executor=executor)
        done_before = finished_parts(out)
        checked = _check(out) if spec.get("check") else None
        committed = digest(out).get("zarr.json") == reference.get("zarr.json")
        second = [run(src, out, kwargs, kill_at=j, executor=executor) for j in spec.get("double", [])]
        final = run(src, out, kwargs, executor=executor)
        got = digest(out)
        runs.append({
            "k": k, "first": first, "double": second, "final": final,
            "same": got == reference, "parts_done_before": done_before, "committed_before": committed,
            "parts_converted": _LAST.get("parts_converted", 0) if final == "ok" else None,
            "differs": sorted(p for p in set(got) | set(reference) if got.get(p) != reference.get(p))[:10],
            "check": checked,
        })
    shutil.rmtree(out, ignore_errors=True)
    return {"reference": status, "steps": total, "files": len(reference), "parts": parts, "runs": runs}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
