"""shardkit.privdir: a private directory is 0700 and this user's or refused, never reached through a
symlink, its files private; run directories are locked while alive and swept once their lock is free."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from shardkit.errors import InsecurePathError
from shardkit.privdir import PrivateDir, create_run_dir, exists_at, sweep_stale, unlink_at

PREFIX = "test-run-"


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _foreign(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``path`` another user's: really chowned as root, else this process pretends to be another user."""
    if os.geteuid() == 0:
        os.chown(path, 54321, 54321)
    else:
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: uid)


def _free_run(parent: Path) -> Path:
    """A run directory whose run died: its lock is free (what the kernel does when its holder dies)."""
    run = create_run_dir(parent, PREFIX)
    assert run._alive is not None
    os.close(run._alive)
    run._alive = None
    (run.path / "data").write_bytes(b"reservoir")
    (run.path / "sub").mkdir()
    (run.path / "sub" / "more").write_bytes(b"x")
    run.close()
    return run.path


@pytest.mark.parametrize("umask", [0, 0o277])
def test_created_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """Exactly 0700 / 0600: neither a permissive umask (0) nor one that drops the owner's bits (0277)
    changes the modes."""
    old = os.umask(umask)
    try:
        with PrivateDir.create(tmp_path / "d") as d:
            assert _mode(d.path) == 0o700 and d.path.lstat().st_uid == os.geteuid()
            fd = d.create_file("f")
            os.close(fd)
            d.write_file("g", b"hello")
            assert _mode(d.path / "f") == 0o600 and _mode(d.path / "g") == 0o600
            assert d.read_file("g", 5) == b"hello"
            with pytest.raises(InsecurePathError, match="at most 4 expected"):
                d.read_file("g", 4)
            with d.subdir("s", what="a sub", advice="Remove it") as s:
                assert _mode(s.path) == 0o700
        run = create_run_dir(tmp_path, PREFIX)
        assert _mode(run.path) == 0o700 and _mode(run.path / "lock") == 0o600
        run.close()
    finally:
        os.umask(old)
    with PrivateDir.create(tmp_path / "d") as again:  # an existing private directory is taken as is
        assert sorted(os.listdir(again.fd)) == ["f", "g", "s"]


def test_another_owner_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    _foreign(d, monkeypatch)
    for attempt in (
        lambda: PrivateDir.create(d, what="the test directory", advice="Remove it"),
        lambda: PrivateDir.create(d, tighten=True),
        lambda: PrivateDir.open(d),
    ):
        with pytest.raises(InsecurePathError, match=f"{d}: is owned by uid"):
            attempt()
    monkeypatch.undo()
    assert os.listdir(d) == []


def test_a_wider_mode_is_refused_or_tightened(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(InsecurePathError, match=f"{d}: has mode 0o755; the test directory must be a directory owned "
                                                f"by uid {os.geteuid()} .*Refusing to use it.*Choose another"):  # fmt: skip
        PrivateDir.create(d, what="the test directory", advice="Choose another")
    with pytest.raises(InsecurePathError, match="has mode 0o755"):
        PrivateDir.open(d)
    assert _mode(d) == 0o755  # left as found
    PrivateDir.create(d, tighten=True).close()
    assert _mode(d) == 0o700


def test_symlinks_and_other_files_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    for attempt in (lambda: PrivateDir.create(link, tighten=True), lambda: PrivateDir.open(link)):
        with pytest.raises(InsecurePathError, match=f"{link}: is a symlink"):
            attempt()
    assert os.listdir(target) == []
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    with pytest.raises(InsecurePathError, match=f"{plain}: is not a directory"):
        PrivateDir.create(plain)
    with PrivateDir.create(tmp_path / "d") as d:  # inside: a symlink or a file readable by others is never used
        secret = tmp_path / "secret"
        secret.write_bytes(b"precious")
        (d.path / "token").symlink_to(secret)
        with pytest.raises(InsecurePathError, match="token: is a symlink"):
            d.open_file("token", os.O_RDONLY)
        (d.path / "lock").symlink_to(secret)
        with pytest.raises(InsecurePathError, match="lock: is a symlink"):  # nor is a lock taken behind one
            d.lock()
        (d.path / "open").write_bytes(b"")
        os.chmod(d.path / "open", 0o644)
        with pytest.raises(InsecurePathError, match="expected a private file"):
            d.read_file("open", 10)
    assert secret.read_bytes() == b"precious"


def test_a_run_directory_is_named_once_locked_and_released_on_close(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, PREFIX)
    assert run.path.name.startswith(f"{PREFIX}{os.getpid()}-") and _mode(run.path) == 0o700
    assert os.listdir(tmp_path) == [run.path.name]  # the hidden name it was built under is gone
    assert run.lock_is_held() and run.lock() is None
    run.close()
    with PrivateDir.open(tmp_path / run.path.name) as again:
        assert not again.lock_is_held()
        assert not again.lock_is_held("missing")


def test_a_dead_run_is_swept_a_live_one_is_not(tmp_path: Path) -> None:
    dead = _free_run(tmp_path)
    live = create_run_dir(tmp_path, PREFIX)
    try:
        assert sweep_stale(tmp_path, PREFIX) == [dead]
        assert not dead.exists()
        assert live.path.is_dir() and live.lock_is_held()
        assert sweep_stale(tmp_path, PREFIX) == []
    finally:
        live.close()
    assert sweep_stale(tmp_path, PREFIX) == [live.path]  # once its holder let go


def test_the_sweep_touches_only_private_run_directories_of_this_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Symlinks (and what they point at), directories without a lock, directories of other users
    or with a wider mode, and other names are all left alone."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "lock").write_bytes(b"")
    os.chmod(victim / "lock", 0o600)
    (victim / "keep").write_bytes(b"precious")
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / f"{PREFIX}link").symlink_to(victim, target_is_directory=True)
    (parent / f"{PREFIX}nolock").mkdir(mode=0o700)
    wide = _free_run(parent)
    os.chmod(wide, 0o755)
    other = _free_run(parent)
    (parent / "unrelated").mkdir()
    before = sorted(os.listdir(parent))
    _foreign(other, monkeypatch)
    assert sweep_stale(parent, PREFIX) == []
    assert sorted(os.listdir(parent)) == before
    assert (victim / "keep").read_bytes() == b"precious"
    assert (other / "data").is_file() and (wide / "data").is_file()


def test_mutex_excludes_other_processes_while_held(tmp_path: Path) -> None:
    with PrivateDir.create(tmp_path / "d") as d:
        mutex = d.mutex()
        probe = os.open(d.path / "lock", os.O_RDWR)  # another open file: what another process sees
        try:
            with mutex:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the section ends
        finally:
            os.close(probe)
            mutex.close()


def test_open_or_create_survives_a_file_created_and_deleted_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a lock file that must exist afterwards (the node-shared regions' ``R.lock``) while
    other processes create it and delete it again between our two attempts: it ends up opened,
    never a FileNotFoundError (forced through os.open, no timing)."""
    real_open = os.open
    events: list[str] = []

    def racing_open(name: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if name == "lock" and flags & os.O_EXCL and not events:
            os.close(real_open(name, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=dir_fd))  # another process creates it
            events.append("created")
        elif name == "lock" and not flags & os.O_CREAT and events == ["created"]:
            os.unlink(name, dir_fd=dir_fd)  # ... and its last user deletes it
            events.append("deleted")
        return real_open(name, flags, mode, dir_fd=dir_fd)

    with PrivateDir.create(tmp_path / "d") as d:
        with monkeypatch.context() as m:
            m.setattr(os, "open", racing_open)
            fd = d.lock()
        assert events == ["created", "deleted"] and fd is not None
        os.close(fd)


def test_exists_and_unlink_at_a_directory_descriptor(tmp_path: Path) -> None:
    """Lookups relative to a directory descriptor never follow a symlink; a name already gone is an ordinary outcome."""
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "file").write_bytes(b"x")
    os.symlink(target, tmp_path / "d" / "link")
    os.symlink(tmp_path / "missing", tmp_path / "d" / "dangling")
    fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert exists_at("file", fd) and exists_at("link", fd)
        assert exists_at("dangling", fd)  # the link itself is there, though its target is not
        assert not exists_at("nothing", fd)
        assert unlink_at("link", fd) is True
        assert target.read_bytes() == b"kept"  # the link went, never its target
        assert unlink_at("file", fd) is True
        assert unlink_at("file", fd) is False
        assert sorted(os.listdir(fd)) == ["dangling"]
    finally:
        os.close(fd)
