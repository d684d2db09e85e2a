"""Attacks through the file system by a neighbour (docs/security.md): saved files that
change under a reader, symlinks at save paths, leftovers of killed saves, names taken by
another user or by a FIFO. Tests that need a second Unix user run as root (they create
`shmstore-test`) and skip otherwise."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import shmstore
from shmstore import _native

# --- save() ------------------------------------------------------------------------------


def test_save_replaces_a_symlink_at_the_path_and_never_writes_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "out.shmstore"
    target.symlink_to(victim)
    with shmstore.put([1, 2, 3]) as r:
        r.save(target)
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(target.lstat().st_mode)
    with shmstore.Ref.open(target) as r:
        assert r.get() == [1, 2, 3]


def test_save_ignores_a_symlink_planted_at_the_old_temporary_name(tmp_path):
    """Older versions wrote `.<file>.tmp-<pid>` without O_EXCL|O_NOFOLLOW: a symlink planted
    there made save() overwrite the link's target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".out.shmstore.tmp-{os.getpid()}").symlink_to(victim)
    with shmstore.put(b"x" * 1000) as r:
        r.save(tmp_path / "out.shmstore")
    assert victim.read_text() == "precious"
    with shmstore.Ref.open(tmp_path / "out.shmstore") as r:
        assert r.get() == b"x" * 1000


@pytest.mark.parametrize(("mode", "expected"), [(None, 0o600), (0o644, 0o644), (0o400, 0o400)])
def test_saved_files_are_private_unless_asked(tmp_path, mode, expected):
    old = os.umask(0o077)  # the mode is applied exactly, not masked
    try:
        with shmstore.put([1]) as r:
            if mode is None:
                r.save(tmp_path / "f")
            else:
                r.save(tmp_path / "f", mode=mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_save_refuses_a_mode_beyond_permission_bits(tmp_path):
    with shmstore.put([1]) as r, pytest.raises(shmstore.InvalidInputError, match="permission"):
        r.save(tmp_path / "f", mode=0o4755)


def test_save_errors_keep_the_os_reason(tmp_path):
    with shmstore.put([1]) as r:
        with pytest.raises(FileNotFoundError) as e:
            r.save(tmp_path / "missing-dir" / "f")
        assert e.value.errno == errno.ENOENT
        assert e.value.filename == str(tmp_path / "missing-dir")
        assert "No such file or directory" in str(e.value)
        assert isinstance(e.value, shmstore.ShmStoreError)
        (tmp_path / "file").write_text("")
        with pytest.raises(shmstore.StoreIOError) as e2:
            r.save(tmp_path / "file" / "f")  # a file where a directory should be
        assert e2.value.errno == errno.ENOTDIR
        assert "Not a directory" in str(e2.value)


def test_save_permission_error_reads_differently(tmp_path, other_user):
    """EACCES (acting as another user, in a directory it cannot write) is a PermissionError
    that says so, distinct from ENOENT."""
    out = tmp_path / "ro"
    out.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    with shmstore.put([1]) as r:
        os.setegid(other_user[1])
        os.seteuid(other_user[0])  # root can switch back; only file access checks change
        try:
            with pytest.raises(PermissionError) as e:
                r.save(out / "f")
        finally:
            os.seteuid(0)
            os.setegid(0)
    assert e.value.errno == errno.EACCES
    assert "Permission denied" in str(e.value)
    # The step that failed is named (here the directory: pytest's tmp root is 0700).
    assert f"saving to {out / 'f'}: cannot" in str(e.value)
    assert e.value.filename == str(out)
    assert isinstance(e.value, shmstore.StorePermissionError)
    assert list(out.iterdir()) == []


def _leftover(d: Path, age_s: float) -> Path:
    p = d / ".out.shmstore.shmstore-save-0123456789abcdef"
    p.write_bytes(b"partial")
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_leftovers_of_a_killed_save_are_removed_by_the_next_save(tmp_path):
    stale = _leftover(tmp_path, 3600)
    unrelated = tmp_path / ".notes.tmp-123"
    unrelated.write_text("not ours")
    with shmstore.put([1]) as r:
        r.save(tmp_path / "other.shmstore")
    assert not stale.exists()
    assert unrelated.exists()


def test_a_save_in_progress_is_never_removed(tmp_path):
    """A live writer holds an flock on its temporary file: even an old one stays."""
    busy = _leftover(tmp_path, 3600)
    fd = os.open(busy, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with shmstore.put([1]) as r:
            r.save(tmp_path / "other.shmstore")
        assert busy.exists()
    finally:
        os.close(fd)
    young = _leftover(tmp_path, 0)  # as a writer between its open and its flock
    with shmstore.put([1]) as r:
        r.save(tmp_path / "other.shmstore")
    assert young.exists()


def test_leftovers_of_other_users_are_left_alone(tmp_path, other_user):
    theirs = _leftover(tmp_path, 3600)
    os.chown(theirs, *other_user)
    with shmstore.put([1]) as r:
        r.save(tmp_path / "other.shmstore")
    assert theirs.exists()


# --- files that change under a reader ----------------------------------------------------

READER = r"""
import sys
import shmstore
from shmstore import _native
path = sys.argv[1]
lst = shmstore.SharedList.open(path)
before = lst.to_python()
print(_native._store_info(lst)["private_copy"], flush=True)
sys.stdin.readline()  # the owner rewrites and truncates the file now
lst.verify()
print(lst.to_python() == before, [lst[i]["name"] for i in (0, len(lst) - 1)], flush=True)
"""


def _read_while_changed(path: Path, change) -> tuple[str, str, int]:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    first = proc.stdout.readline().strip()
    change()
    out, err = proc.communicate("go\n", timeout=60)
    return first, out.strip() + err[-1500:], proc.returncode


OWNER_ATTACK = r"""
import os, sys
path = sys.argv[1]
with open(path, "r+b") as f:
    data = bytearray(f.read())
    for i in range(128, len(data) // 2):  # every record byte, validated or not
        data[i] ^= 0xFF
    f.seek(0)
    f.write(data)
    f.flush()
    os.truncate(path, 64)
print("changed")
"""


def test_another_users_file_rewritten_and_truncated_under_a_reader(neighbour_dir, other_user):
    """The owner of a saved file rewrites every record byte and truncates the file while
    another user reads it: the reader read a private sealed copy and sees no change (before:
    SIGSEGV on the rewritten records, SIGBUS after truncation)."""
    path = neighbour_dir / "theirs.shmstore"
    with shmstore.SharedList([{"name": f"r{i}", "v": list(range(i))} for i in range(300)]) as s:
        s.save(path, mode=0o644)
    os.chown(path, *other_user)
    uid, gid = other_user

    def attack() -> None:
        done = subprocess.run(  # system Python: the other user cannot reach our venv
            ["/usr/bin/python3", "-c", OWNER_ATTACK, str(path)],
            capture_output=True,
            text=True,
            user=uid,
            group=gid,
            timeout=60,
        )
        assert done.stdout.strip() == "changed", done.stderr[-2000:]

    first, rest, rc = _read_while_changed(path, attack)
    assert first == "True"
    assert rc == 0, rest
    assert rest.startswith("True ['r0', 'r299']"), rest
    assert path.stat().st_size == 64


def test_own_file_writable_by_others_is_read_from_a_private_copy(tmp_path):
    path = tmp_path / "shared.shmstore"
    with shmstore.SharedList([{"name": f"r{i}"} for i in range(10)]) as s:
        s.save(path, mode=0o664)

    def attack() -> None:  # as a member of the group could
        with open(path, "r+b") as f:
            f.seek(200)
            f.write(b"\xff" * 64)
        os.truncate(path, 0)

    first, rest, rc = _read_while_changed(path, attack)
    assert first == "True"
    assert rc == 0 and rest.startswith("True ['r0', 'r9']"), rest


def test_own_private_file_is_mapped_in_place(tmp_path):
    path = tmp_path / "mine.shmstore"
    with shmstore.put([1]) as r:
        r.save(path)
    with shmstore.Ref.open(path) as r:
        assert _native._store_info(r)["private_copy"] is False


# --- names taken by someone else ---------------------------------------------------------


@pytest.fixture
def segdir(tmp_path, monkeypatch):
    d = tmp_path / "seg"
    d.mkdir(mode=0o1777)
    os.chmod(d, 0o1777)  # a shared segment directory, like /dev/shm
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("SHMSTORE_DIR", str(d))
    monkeypatch.setenv("SHMSTORE_FALLBACK", "0")
    # No supervisor: these tests are about what the client opens and says. (A supervisor
    # asked to clean up a failed build must not touch a planted file either: its tests.)
    monkeypatch.setenv("SHMSTORE_SUPERVISOR", "0")
    return d


def test_a_fifo_under_a_store_name_is_refused_without_hanging(segdir):
    name = f"shmstore-fifo-{os.getpid()}"
    os.mkfifo(segdir / name)
    script = (
        "import shmstore, sys\n"
        "try:\n"
        "    shmstore.SharedList.attach(sys.argv[1])\n"
        "except shmstore.StoreIOError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, name],
        capture_output=True,
        text=True,
        timeout=60,  # before: attach blocked in open() forever
        env={**os.environ, "SHMSTORE_SUPERVISOR": "0"},
    )
    assert "FIFO" in proc.stdout and "not a store file" in proc.stdout, proc
    with pytest.raises(shmstore.StoreExistsError, match="FIFO") as e:
        shmstore.SharedList([1], name=name)
    assert "remove it" in str(e.value)


def test_a_name_taken_by_another_user_says_so(segdir, other_user):
    name = f"shmstore-taken-{os.getpid()}"
    planted = segdir / name
    planted.write_bytes(b"not a store")
    os.chown(planted, *other_user)
    with pytest.raises(shmstore.StoreExistsError) as e:
        shmstore.SharedList([1], name=name)
    msg = str(e.value)
    assert f"owned by uid {other_user[0]}" in msg and "attaching will not work" in msg, msg
    with pytest.raises(shmstore.StorePermissionError) as e2:
        shmstore.SharedList.attach(name)
    assert f"belongs to uid {other_user[0]}" in str(e2.value)
    assert "another user created a file under this store's name" in str(e2.value)
    assert planted.read_bytes() == b"not a store"


def test_a_name_taken_and_locked_by_another_user_says_so(segdir, other_user):
    """An attach locks a segment before mapping it (docs/lifecycle.md): a file of another
    user under the name is refused for what it is, not waited on and failed for the lock
    that user holds on it."""
    name = f"shmstore-taken-locked-{os.getpid()}"
    planted = segdir / name
    planted.write_bytes(b"not a store")
    os.chown(planted, *other_user)
    fd = os.open(planted, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the lock the supervisor takes to remove a file
        with pytest.raises(shmstore.StorePermissionError) as e:
            shmstore.SharedList.attach(name)
        assert f"belongs to uid {other_user[0]}" in str(e.value)
    finally:
        os.close(fd)


def test_a_symlink_under_a_store_name_is_not_followed(segdir, tmp_path):
    name = f"shmstore-link-{os.getpid()}"
    with shmstore.put([1]) as r:
        r.save(tmp_path / "real.shmstore")
    (segdir / name).symlink_to(tmp_path / "real.shmstore")
    with pytest.raises(shmstore.StoreIOError, match="symbolic link"):
        shmstore.Ref.attach(name)


def test_open_follows_a_symlink_the_caller_gave_and_checks_its_target(tmp_path):
    with shmstore.put([1]) as r:
        r.save(tmp_path / "real.shmstore")
    (tmp_path / "link.shmstore").symlink_to(tmp_path / "real.shmstore")
    with shmstore.Ref.open(tmp_path / "link.shmstore") as r:
        assert r.get() == [1]
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    with pytest.raises(shmstore.StoreIOError, match="FIFO"):
        shmstore.Ref.open(tmp_path / "to-fifo")


@pytest.mark.skipif(
    not hasattr(_native, "_crafted_archive"),
    reason="the fuzzer's testing hooks are not in this build of shmstore._native "
    "(cargo feature 'fuzzing': `make build` has it, wheels do not)",
)
def test_crafted_hooks_exist():
    assert isinstance(_native._crafted_archive("list-key"), bytes)
