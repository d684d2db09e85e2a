"""More attacks by a neighbour (docs/security.md): a planted state directory, a write
descriptor kept across ``chmod g-w``, swapped stores in a group-writable directory, sparse
files, a planted fetch lock, forged pickles, deep nesting in threads with small stacks.
Tests that need a second Unix user run as root (the `other_user` fixture) and skip
otherwise."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import shmstore
from conftest import run_checked

# --- a state directory planted in /tmp ---------------------------------------------------


@pytest.fixture
def sticky_tmp(other_user: tuple[int, int]) -> Iterator[Path]:
    """A world-writable sticky directory, as /tmp is, that the other user can reach."""
    d = Path(tempfile.mkdtemp(prefix="shmstore-sticky-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


CHANNEL_USER = r"""
import logging, sys
import shmstore
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
ch = shmstore.Channel()
ch.put([1, 2, 3])
print("got", ch.get(timeout=30).to_python())
with shmstore.put({"a": 1}) as r:
    print("store", r.get()["a"])
"""


def test_a_state_directory_planted_in_tmp_sends_the_user_to_home(sticky_tmp, tmp_path, other_user):
    """With XDG_RUNTIME_DIR unset, another user who creates ``$TMPDIR/shmstore-<uid>`` first
    used to turn supervision off for good (Channel() raised, gc refused). Now this user's
    supervisor lives under $HOME, and everything (supervisor, Channel, gc) agrees on it."""
    planted = sticky_tmp / f"shmstore-{os.geteuid()}"
    subprocess.run(
        ["mkdir", "-m", "755", str(planted)],
        user=other_user[0],
        group=other_user[1],
        check=True,
    )
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(sticky_tmp), HOME=str(home), SHMSTORE_SUPERVISOR_GRACE="0.2")
    env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-plant-{os.getpid()}"
    proc = run_checked([sys.executable, "-c", CHANNEL_USER], env=env)
    out = proc.stdout + proc.stderr  # said at import, before logging is configured
    assert "got [1, 2, 3]" in out and "store 1" in out, out
    state = home / ".cache" / "shmstore"
    runs = list(state.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("run-"), runs
    assert (runs[0].stat().st_mode & 0o777) == 0o700
    assert str(runs[0]) in out, out  # said where, once
    assert out.count("supervisor keeps its state in") == 1, out
    gc = run_checked([sys.executable, "-m", "shmstore", "gc", "--dry-run"], env=env, check=False)
    assert gc.returncode in (0, 1), gc.stdout + gc.stderr
    assert "refusing" not in gc.stdout + gc.stderr
    # The planter removing its directory later does not split this user's processes.
    subprocess.run(["rmdir", str(planted)], user=other_user[0], group=other_user[1], check=True)
    out = run_checked([sys.executable, "-c", CHANNEL_USER], env=env).stdout
    assert "got [1, 2, 3]" in out, out
    assert not planted.exists()


# --- a write descriptor kept across chmod g-w ---------------------------------------------


def _python_for(user: tuple[int, int]) -> str:
    """A Python interpreter `user` may run (this one may live under root's home)."""
    for cand in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            ok = subprocess.run(
                [cand, "-c", "pass"], user=user[0], group=user[1], capture_output=True
            )
        except OSError:
            continue
        if ok.returncode == 0:
            return cand
    pytest.skip("no Python interpreter the second user may run")


GROUP_WRITER = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)  # while the file was group-writable
print("open", flush=True)
sys.stdin.readline()  # the owner ran chmod g-w and opened the file meanwhile
os.ftruncate(fd, 64)
print("truncated", flush=True)
"""

READ_AFTER = r"""
import sys
import shmstore
from shmstore import _native
r = shmstore.Ref.open(sys.argv[1])
print(_native._store_info(r)["private_copy"], flush=True)
sys.stdin.readline()
print(len(r.get().to_python()), flush=True)
"""


def test_a_write_descriptor_kept_across_chmod_does_not_reach_a_reader(neighbour_dir, other_user):
    """A file saved group-writable is read from a private copy; after `chmod g-w` it used to
    be mapped in place although a group member still had it open for writing (mode bits do
    not revoke descriptors): truncating it killed the owner's reader with SIGBUS."""
    d = neighbour_dir / "team"
    d.mkdir()
    path = d / "data.shmstore"
    with shmstore.put(list(range(5000))) as r:
        r.save(path, mode=0o660)
    os.chown(path, os.geteuid(), other_user[1])
    writer = subprocess.Popen(
        [_python_for(other_user), "-c", GROUP_WRITER, str(path)],
        user=other_user[0],
        group=other_user[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = None
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "open"
        os.chmod(path, 0o640)
        reader = subprocess.Popen(
            [sys.executable, "-c", READ_AFTER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == "True"  # a private copy
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "truncated"
        out, err = reader.communicate("go\n", timeout=60)
        assert reader.returncode == 0, err
        assert out.strip() == "5000"
    finally:
        for p in (writer, reader):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                p.communicate(timeout=60)  # and close its pipes
    # With no writer left, a file of this mode is mapped in place.
    with shmstore.put(list(range(5000))) as r:
        r.save(path, mode=0o640)
    with shmstore.Ref.open(path) as r:
        assert shmstore._native._store_info(r)["private_copy"] is False


# --- sparse files --------------------------------------------------------------------------


def _sparse_copy(src: Path, dst: Path) -> None:
    """`dst`: the bytes of `src`, with every 4 KiB block of zeros left as a hole."""
    data = src.read_bytes()
    with open(dst, "wb") as f:
        for i in range(0, len(data), 4096):
            block = data[i : i + 4096]
            if block.count(0) != len(block):
                f.seek(i)
                f.write(block)
        f.truncate(len(data))


def test_another_users_sparse_file_costs_its_data_not_its_size(neighbour_dir, other_user):
    """The private copy of another user's file keeps its holes: a file of a few KiB of data
    and a large hole used to cost every process that opened it the whole size."""
    dense = neighbour_dir / "dense"
    with shmstore.put(b"\0" * (64 << 20)) as r:
        r.save(dense)
    path = neighbour_dir / "sparse.shmstore"
    _sparse_copy(dense, path)
    dense.unlink()
    os.chown(path, *other_user)
    if path.stat().st_blocks * 512 > 8 << 20:
        pytest.skip(f"the file system of {path} keeps no holes")
    with shmstore.Ref.open(path) as r:
        assert shmstore._native._store_info(r)["private_copy"] is True
        maps = Path("/proc/self/maps").read_text().splitlines()
        copies = [m.split()[0] for m in maps if "shmstore-private-copy" in m]
        assert copies, maps
        allocated = max(os.stat(f"/proc/self/map_files/{c}").st_blocks * 512 for c in copies)
        assert allocated < 8 << 20, allocated
        assert r.get() == b"\0" * (64 << 20)


# --- a planted fetch lock ------------------------------------------------------------------


@pytest.mark.parametrize("plant", ["fifo", "symlink", "file"])
def test_a_fetch_lock_planted_by_another_user_blocks_nothing(sticky_tmp, other_user, plant):
    """The cluster fetch lock used to be ``.shmstore-fetch-<uid>.lock`` in the segment
    directory (/dev/shm, sticky and shared): another user's FIFO, symlink or file there
    refused every fetch of this user for good. It now lives in the private state directory."""
    from shmstore import cluster

    old = sticky_tmp / f".shmstore-fetch-{os.geteuid()}.lock"
    as_them = {"user": other_user[0], "group": other_user[1], "check": True}
    if plant == "fifo":
        subprocess.run(["mkfifo", "-m", "666", str(old)], **as_them)
    elif plant == "symlink":
        subprocess.run(["ln", "-s", "/etc/passwd", str(old)], **as_them)
    else:
        subprocess.run(["touch", str(old)], **as_them)
    os.chown(sticky_tmp, 0, 0)  # a root-owned sticky directory, as /dev/shm
    with cluster._FetchLock(sticky_tmp, timeout=10) as lock:
        assert lock.fd >= 0
    path = shmstore._native._state_dir()
    assert any(p.name.startswith("fetch-") for p in path.iterdir())


# --- deep values in threads with small stacks ----------------------------------------------

# A list nested 99 deep (the builder takes up to 100), its view `v`, and `run(name, f)`,
# which notes in `out` whether `f()` converted ("ok") or raised the RecursionError that
# says what to do ("stack").
DEEP_VALUE = r"""
import threading
import shmstore
x = []
for _ in range(99):
    x = [x]
v = shmstore.put(x).get()
out = {}
def run(name, f):
    try:
        f()
        out[name] = "ok"
    except RecursionError as e:
        out[name] = "stack" if "threading.stack_size" in str(e) else repr(e)
"""

SMALL_STACK = (
    DEEP_VALUE
    + r"""
for kib in (64, 128, 4096):
    threading.stack_size(kib * 1024)
    for name, f in (("to_python", v.to_python), ("eq", lambda: v == x),
                    ("put", lambda: shmstore.put(v).close())):
        t = threading.Thread(target=run, args=(f"{kib}:{name}", f))
        t.start()
        t.join()
print(sorted(out.items()))
"""
)


def test_deep_values_in_a_thread_with_a_small_stack_raise_instead_of_crashing():
    """A list nested 99 deep (which the builder takes) crashed (SIGSEGV) `to_python()` in a
    thread of <= 176 KiB of stack, and `==` and `put(view)` at 128 KiB, where plain Python
    works in 64 KiB. Now RecursionError says what to do; a normal stack converts it."""
    out = run_checked([sys.executable, "-c", SMALL_STACK]).stdout
    got = dict(ast.literal_eval(out))
    for kib in (64, 128):
        for name in ("to_python", "eq", "put"):
            assert got[f"{kib}:{name}"] in ("ok", "stack"), got
    assert got["64:to_python"] == "stack", got
    assert all(got[f"4096:{n}"] == "ok" for n in ("to_python", "eq", "put")), got


MAIN_STACK = (
    DEEP_VALUE
    + r"""
import os
run("to_python", v.to_python)
run("eq", lambda: v == x)
run("put", lambda: shmstore.put(v).close())
# A child forked from a thread with a small stack: its one thread is its main thread now,
# on that thread's stack, not the process's first one.
def fork_from_thread():
    pid = os.fork()
    if pid == 0:
        try:
            v.to_python()
            os._exit(10)
        except RecursionError as e:
            os._exit(11 if "threading.stack_size" in str(e) else 12)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out["forked"] = {10: "ok", 11: "stack"}.get(code, code)
threading.stack_size(64 * 1024)
t = threading.Thread(target=fork_from_thread)
t.start()
t.join()
print(sorted(out.items()))
"""
)


@pytest.mark.parametrize("kib", [128, 8192])
def test_deep_values_in_the_main_thread_with_a_small_stack_limit_raise_instead_of_crashing(kib):
    """The main thread's stack is found from the kernel's account of the process (its size
    limit below the end of the environment) rather than by pthreads, which read all of
    /proc/self/maps for it. Under a 128 KiB stack limit the 99-deep list's conversion raises
    RecursionError saying what to do, as in a thread with a small stack; with 8 MiB it
    converts; a child forked from a thread with a 64 KiB stack still finds that stack."""
    import resource

    def limit_stack() -> None:
        hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
        resource.setrlimit(resource.RLIMIT_STACK, (kib * 1024, hard))

    out = run_checked([sys.executable, "-c", MAIN_STACK], preexec_fn=limit_stack).stdout
    got = dict(ast.literal_eval(out))
    assert got["forked"] == "stack", got
    if kib == 8192:
        assert all(got[n] == "ok" for n in ("to_python", "eq", "put")), got
    else:
        assert got["to_python"] == "stack" and got["eq"] == "stack", got
        assert got["put"] in ("ok", "stack"), got


# --- swapped stores in a group-writable directory -----------------------------------------

ATTACH_TRAIN = r"""
import sys
import shmstore
try:
    print("data", shmstore.SharedList.attach("train", dir=sys.argv[1])[0])
except shmstore.StorePermissionError as e:
    print("refused", str(e))
"""


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_stores_swapped_in_a_shared_directory_are_not_attached(tmp_path, other_user, mode):
    """In a team directory that group members may write (no sticky bit), a member renames
    two of our sealed stores over each other (`mv`: owner and mode go with the file):
    ``attach("train")`` silently returned the other store's data. Attaching from such a
    directory is now refused, naming it and the fix; a sticky one is safe (only a file's
    owner may rename it there) and works."""
    team = tmp_path / "team"
    team.mkdir()
    os.chown(tmp_path, 0, other_user[1])
    os.chmod(tmp_path, 0o755)
    os.chown(team, 0, other_user[1])
    os.chmod(team, mode)
    train = shmstore.SharedList(["train"], name="train", dir=team)
    val = shmstore.SharedList(["val"], name="val", dir=team)
    try:
        swap = "mv shmstore-train x && mv shmstore-val shmstore-train && mv x shmstore-val"
        them = subprocess.run(
            ["sh", "-c", swap],
            cwd=team,
            user=other_user[0],
            group=other_user[1],
            capture_output=True,
            text=True,
        )
        out = run_checked([sys.executable, "-c", ATTACH_TRAIN, str(team)]).stdout
        if mode & 0o1000:
            # Sticky: the rename was refused, and the store is the one named.
            assert them.returncode != 0, them
            assert out.strip() == "data train", out
        else:
            assert them.returncode == 0, them.stderr
            assert out.startswith("refused"), out
            assert str(team) in out and "chmod +t" in out and "not sticky" in out, out
    finally:
        for r in (train, val):
            r.close()
        for p in team.iterdir():
            # The supervisor may be removing them too (closed, no user left).
            p.unlink(missing_ok=True)


def test_a_directory_owned_by_another_user_is_refused_for_attach(neighbour_dir):
    """The owner of a directory may rename anything in it, sticky or not: a store of ours in
    another user's directory cannot be attached by name either."""
    os.chmod(neighbour_dir, 0o1777)
    lst = shmstore.SharedList(["train"], name="train", dir=neighbour_dir)
    try:
        out = run_checked([sys.executable, "-c", ATTACH_TRAIN, str(neighbour_dir)]).stdout
        assert out.startswith("refused") and "is owned by uid" in out, out
    finally:
        lst.unlink()


ATTACH_CHUNK = r"""
import pickle, sys
import shmstore
team, name, channel = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
ref = bytes.fromhex(sys.argv[4])
for what, attach in (
    ("pickle", lambda: pickle.loads(ref).get()),
    ("name", lambda: shmstore.Ref.attach(name, dir=team).get()),
    ("channel", lambda: pickle.loads(channel).get(timeout=60)),
):
    try:
        print(what, "data", attach())
    except shmstore.StorePermissionError as e:
        print(what, "refused", str(e))
"""


@pytest.mark.parametrize("mode", [0o770, 0o1770])
def test_a_chunk_in_a_shared_directory_is_not_attached_by_name(tmp_path, mode):
    """The arena layer too: a chunk attached by its name string (``Ref.attach("<arena>@...")``),
    unpickled, or named by a ``Channel`` cell opens its arena by path, and in a directory others may
    rename files in, two of our arenas swapped there gave the other one's object. Refused
    as for a segment (no second user needed: the directory's mode decides); in a sticky
    directory it works."""
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, mode)
    import pickle

    chunk = shmstore.put(b"x" * 100, dir=team)
    ch = shmstore.Channel(capacity=2, dir=team)
    try:
        ch.put(b"y" * 100)
        assert "@" in chunk.name
        args = [str(team), chunk.name, pickle.dumps(ch).hex(), pickle.dumps(chunk).hex()]
        out = run_checked([sys.executable, "-c", ATTACH_CHUNK, *args]).stdout
        if mode & 0o1000:
            assert "pickle data b'xxx" in out, out
            assert "name data b'xxx" in out and "channel data b'yyy" in out, out
        else:
            lines = out.splitlines()
            assert [line.split()[:2] for line in lines] == [
                ["pickle", "refused"],
                ["name", "refused"],
                ["channel", "refused"],
            ], out
            assert all(str(team) in line and "chmod +t" in line for line in lines), out
    finally:
        chunk.close()
        ch.close()


# --- forged pickle arguments ---------------------------------------------------------------


def test_forged_pickle_arguments_are_corrupt_store_errors():
    """A pickle may come from anyone: the unpickling functions used to raise OverflowError
    (a negative size) or TypeError (a str for an int) from the argument conversion. Every
    forged argument is now CorruptStoreError naming it."""
    import pickle

    from shmstore import _native

    big = shmstore.put(list(range(100)), arena=False)
    view = shmstore.put([[1, 2], [3]], arena=False)
    chunk = shmstore.put(b"x" * 100)
    try:
        _, (cls, path, flag) = big.__reduce__()
        _, (cpath, off, size, gen) = chunk.__reduce__()
        _, vargs = view.get()[0].__reduce__()
        forged = [
            (_native._rebuild_chunk, (cpath, -1, size, gen), "chunk offset"),
            (_native._rebuild_chunk, (cpath, off, -5, gen), "chunk size"),
            (_native._rebuild_chunk, (cpath, off, size, 1 << 64), "chunk generation"),
            (_native._rebuild_chunk, (cpath, "0", size, gen), "chunk offset"),
            (_native._rebuild_chunk, (7, off, size, gen), "path"),
            (_native._rebuild_chunk, (cpath + "\0x", off, size, gen), "path"),
            (_native._rebuild, (cls, path, 3), "kind flag"),
            (_native._rebuild, (None, path, flag), "class name"),
            (_native._rebuild_view, (vargs[0], vargs[1], -1, vargs[3]), "record"),
            (_native._rebuild_view, (*vargs[:3], -(1 << 70)), "position"),
            (_native._rebuild_view, (*vargs[:4], 256), "form"),
            (_native._rebuild_view, (*vargs[:4], 0, -1), "form's argument"),
            (_native._rebuild_view, (*vargs[:4], True), "form"),
        ]
        for fn, args, what in forged:
            with pytest.raises(shmstore.CorruptStoreError, match=what):
                fn(*args)
            # The same through pickle.loads of a forged tuple.
            data = pickle.dumps(_Forged(fn, args))
            with pytest.raises(shmstore.CorruptStoreError, match="forged or corrupt pickle"):
                pickle.loads(data)
        # The genuine arguments still work.
        assert _native._rebuild(cls, path, flag).get()[99] == 99
        assert _native._rebuild_chunk(cpath, off, size, gen).get() == b"x" * 100
        assert _native._rebuild_view(*vargs).to_python() == [1, 2]
    finally:
        for r in (big, view, chunk):
            r.close()


class _Forged:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


RELATIVE = r"""
import logging, os, pickle, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
import shmstore
from shmstore import _native
os.makedirs("rel", exist_ok=True)
os.environ["SHMSTORE_DIR"] = "rel"  # a relative segment directory
chunk = shmstore.put(b"x" * 100)
named = shmstore.put(list(range(5)), name="relative-test", arena=False)
for r in (chunk, named):
    path = r.__reduce__()[1][1 if r is named else 0]
    print("absolute", os.path.isabs(path))
os.chdir("/")  # another working directory: the pickles still name the same files
print("again", pickle.loads(pickle.dumps(chunk)).get(), pickle.loads(pickle.dumps(named)).get()[4])
_, (path, off, size, gen) = chunk.__reduce__()
os.chdir(os.path.dirname(path))
try:
    _native._rebuild_chunk(os.path.basename(path), off, size, gen)
except shmstore.CorruptStoreError as e:
    print("refused", "not absolute" in str(e))
named.unlink()
"""


def test_relative_paths_never_reach_the_supervisor(tmp_path):
    """A relative path in a chunk pickle (or a relative SHMSTORE_DIR) was sent to the
    supervisor, which refuses relative paths, and the process logged a false "runs without
    its supervisor" warning. Segment directories are now made absolute, and a pickle with a
    relative path is refused (CorruptStoreError); nothing is logged."""
    out = run_checked([sys.executable, "-c", RELATIVE], cwd=tmp_path).stdout
    assert out.count("absolute True") == 2, out
    assert "again b'xxxxx" in out and " 4" in out, out
    assert "refused True" in out, out
    assert "WARNING" not in out, out


def test_a_relative_dir_argument_is_made_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dir=`` given relative is made absolute against the current directory, as a
    relative ``SHMSTORE_DIR`` is, wherever a store or an arena chunk is placed or attached:
    it stayed relative, so a pickle named a file relative to whatever directory the
    unpickling process was in, and the supervisor was told a path it refuses."""
    import pickle

    from conftest import segment_dir

    monkeypatch.chdir(segment_dir().parent)
    rel = segment_dir().name
    named = shmstore.put(list(range(5)), name="relative-dir", dir=rel, arena=False)
    try:
        chunk = shmstore.put(b"x" * 100, dir=rel)
        listed = shmstore.SharedList([1, 2, 3], dir=rel)
        again = shmstore.Ref.attach("relative-dir", dir=rel)
        pickles = [pickle.dumps(x) for x in (named, chunk, listed, again)]
        monkeypatch.chdir("/")  # another working directory: the same files
        named2, chunk2, listed2, again2 = (pickle.loads(p) for p in pickles)
        assert named2.get()[4] == 4 and again2.get()[4] == 4
        assert chunk2.get() == b"x" * 100
        assert list(listed2) == [1, 2, 3]
    finally:
        named.unlink()
