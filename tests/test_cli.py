"""The ``shmstore`` command: every verb's output, its ``--json`` form and its error paths
(one line on stderr, no traceback, the documented exit code).

Each test runs the command as a subprocess in a private segment directory, without a
supervisor and without the disk fallback, so nothing outside that directory is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import shmstore
from shmstore import cli

TIMEOUT_S = 120


class Env:
    def __init__(self, segdir: Path) -> None:
        self.dir = segdir
        self.vars = {
            **os.environ,
            "SHMSTORE_DIR": str(segdir),
            "SHMSTORE_SUPERVISOR": "0",
            "SHMSTORE_FALLBACK": "0",
        }

    def run(self, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [sys.executable, "-m", "shmstore", *args],
            env=self.vars,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            **kw,  # type: ignore[arg-type]
        )
        assert "Traceback" not in r.stderr, r.stderr
        return r

    def one_error_line(self, r: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
        assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shmstore"), r.stderr
        for w in words:
            assert w in lines[0], (w, lines[0])
        return lines[0]


@pytest.fixture
def env(_private_segment_dir: Path) -> Iterator[Env]:
    # This test's private segment directory (tests/conftest.py), emptied afterwards.
    segdir = _private_segment_dir
    try:
        yield Env(segdir)
    finally:
        for p in segdir.iterdir():
            # A segment or arena whose last user exited may be removed by its owner's exit
            # path between the listing and this unlink.
            p.unlink(missing_ok=True)


CREATOR = """
import sys, shmstore
lst = shmstore.SharedList(range(7), name="cli-live")
print(lst.name, flush=True)
sys.stdin.readline()
"""


def test_ls_shows_a_live_store_under_its_public_name_with_its_state(env: Env) -> None:
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR],
        env=env.vars,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None and creator.stdin is not None
        name = creator.stdout.readline().strip()
        assert name == "shmstore-cli-live"
        r = env.run("ls", "--json")
        assert r.returncode == 0, r
        (row,) = json.loads(r.stdout)
        assert row["name"] == name and ".part-" not in row["path"]
        assert row["state"] == "in use" and row["users"] == [creator.pid]
        assert row["kind"] == "list" and row["records"] == 7
        assert row["creator_pid"] == creator.pid and row["creator_alive"] is True
        r = env.run("ls")
        assert r.returncode == 0 and name in r.stdout and "in use" in r.stdout, r
        assert "(deleted)" not in r.stdout and ".part-" not in r.stdout
    finally:
        creator.communicate("\n", timeout=TIMEOUT_S)
    assert creator.returncode == 0


ARENA_CREATOR = """
import sys, shmstore
refs = [shmstore.put({"i": i}, arena=True) for i in range(3)]
print(refs[0].name.split("@")[0], flush=True)
sys.stdin.readline()
"""


def _arena_creator(env: Env, tmp_path: Path, script: str) -> subprocess.Popen[str]:
    """A process running ``script`` with this test's own supervisor (arenas need one), its
    stdin and stdout piped."""
    supervised = {
        **env.vars,
        "SHMSTORE_SUPERVISOR": "1",
        "SHMSTORE_SUPERVISOR_NAME": f"shmstore-test-cli-{os.getpid()}-{tmp_path.name}"[:80],
        "SHMSTORE_SUPERVISOR_GRACE": "0.3",
        "XDG_RUNTIME_DIR": str(tmp_path),
    }
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env=supervised,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_ls_shows_an_arena_as_an_arena(env: Env, tmp_path: Path) -> None:
    """An arena (docs/arena.md) is listed with its kind and creator, not as unreadable."""
    creator = _arena_creator(env, tmp_path, ARENA_CREATOR)
    try:
        assert creator.stdout is not None
        name = creator.stdout.readline().strip()
        assert name.startswith("shmstore-"), name
        r = env.run("ls", "--json")
        assert r.returncode == 0, r
        (row,) = json.loads(r.stdout)
        assert row["name"] == name
        assert row["kind"] == "arena" and row["state"] == "in use"
        assert row["creator_pid"] == creator.pid and row["creator_alive"] is True
    finally:
        creator.communicate("\n", timeout=TIMEOUT_S)
    assert creator.returncode == 0


ARENA_CHUNKS = """
import sys, shmstore
refs = [shmstore.put(bytes(100 * (i + 1)), arena=True) for i in range(3)]
print(" ".join(r.name for r in refs), flush=True)
sys.stdin.readline()
"""


def test_inspect_shows_an_arena_s_chunks(env: Env, tmp_path: Path) -> None:
    """``shmstore inspect`` of an arena lists its chunks with their state (a lease held by
    another process shows as leased); of a chunk's name, the object and its chunk; bad
    chunk names are one-line errors."""
    creator = _arena_creator(env, tmp_path, ARENA_CHUNKS)
    try:
        assert creator.stdout is not None
        names = creator.stdout.readline().split()
        assert len(names) == 3 and all("@" in n for n in names), names
        arena = names[0].split("@")[0]
        # This process holds a lease on the second chunk.
        _, rest = names[1].split("@")
        reader = shmstore.Ref.attach(f"{arena}@{rest}", dir=env.dir)
        assert bytes(reader.get()) == bytes(200)
        r = env.run("inspect", "--json", arena)
        assert r.returncode == 0, r
        info = json.loads(r.stdout)
        assert info["kind"] == "arena" and info["creator_pid"] == creator.pid
        chunks = [c for c in info["chunks"] if c["generation"] is not None]
        assert [c["generation"] for c in chunks] == [1, 2, 3]
        assert [c["state"] for c in chunks] == ["unleased", "leased", "unleased"]
        offsets = [int(n.split("@")[1].split(":")[0]) for n in names]
        assert [c["offset"] for c in chunks] == offsets
        rest_of_arena = info["chunks"][-1]
        assert rest_of_arena["generation"] is None and rest_of_arena["state"] == "free"
        assert sum(c["size"] for c in info["chunks"]) == info["capacity"]
        r = env.run("inspect", arena)
        assert r.returncode == 0 and "leased" in r.stdout and "generation" in r.stdout, r
        r = env.run("inspect", "--json", names[2])
        assert r.returncode == 0, r
        obj = json.loads(r.stdout)
        assert obj["kind"] == "object" and obj["chunk"]["generation"] == 3
        env.one_error_line(env.run("inspect", f"{arena}@xx"), cli.EXIT_USAGE, "chunk name")
        env.one_error_line(env.run("inspect", f"{arena}@4096:1:1"), cli.EXIT_UNREADABLE, arena)
        env.one_error_line(env.run("inspect", f"{arena}@64:64:1"), cli.EXIT_UNREADABLE, arena)
        reader.close()
    finally:
        creator.communicate("\n", timeout=TIMEOUT_S)
    assert creator.returncode == 0


def test_ls_into_a_closed_pipe_stops_quietly(env: Env) -> None:
    """``shmstore ls --json | head``: a reader that goes away is not an error to report."""
    for args in (("ls", "--json"), ("ls",)):
        r_fd, w_fd = os.pipe()
        os.close(r_fd)  # the reader is gone before the first write
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "shmstore", *args],
                env=env.vars,
                stdout=w_fd,
                stderr=subprocess.PIPE,
                text=True,
                timeout=TIMEOUT_S,
            )
        finally:
            os.close(w_fd)
        assert proc.returncode == cli.EXIT_BROKEN_PIPE, proc
        assert proc.stderr == "", proc.stderr


def test_inspect_errors(env: Env, tmp_path: Path) -> None:
    bad = tmp_path / "bad.shm"
    bad.write_bytes(b"not a store" * 100)
    env.one_error_line(env.run("inspect", str(bad)), cli.EXIT_UNREADABLE, str(bad))
    env.one_error_line(env.run("inspect", str(tmp_path)), cli.EXIT_UNREADABLE, "directory")
    (env.dir / "shmstore-garbage").write_bytes(b"\0" * 4096)
    env.one_error_line(env.run("inspect", "garbage"), cli.EXIT_UNREADABLE, "garbage")
    env.one_error_line(env.run("inspect", "absent"), cli.EXIT_NOT_FOUND, "absent")
    env.one_error_line(env.run("inspect", str(tmp_path / "nofile")), cli.EXIT_NOT_FOUND)
    env.one_error_line(env.run("inspect", "bad name!"), cli.EXIT_USAGE, "bad name!")
    # a corrupt segment is still listed, as unreadable
    r = env.run("ls", "--json")
    assert r.returncode == 0, r
    (row,) = json.loads(r.stdout)
    assert row["name"] == "shmstore-garbage" and row["state"] == "unreadable"


def test_inspect_json_and_text(env: Env, tmp_path: Path) -> None:
    path = tmp_path / "five.shm"
    with shmstore.SharedList(range(5)) as lst:
        lst.save(path)
    r = env.run("inspect", str(path), "--json")
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["count"] == 5
    r = env.run("inspect", str(path))
    assert r.returncode == 0 and "count" in r.stdout, r


def test_inspect_verify_finds_modified_array_data(env: Env, tmp_path: Path) -> None:
    """Array data is not hashed when read (docs/format.md, "Checking"): a modified array
    still reads, and ``inspect --verify`` is what finds it."""
    np = pytest.importorskip("numpy")
    path = tmp_path / "arr.shm"
    data = np.arange(4096, dtype=np.float64)
    with shmstore.put(data) as ref:
        ref.save(path)
    r = env.run("inspect", str(path), "--verify", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["verified"] is True, r
    raw = bytearray(path.read_bytes())
    at = raw.index(data[1000:1001].tobytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    got = shmstore.Ref.open(path).get()
    assert got[1000] != 1000.0  # read, unchecked
    env.one_error_line(env.run("inspect", str(path), "--verify"), cli.EXIT_UNREADABLE, "modified")


def test_rm_errors_and_json(env: Env) -> None:
    (env.dir / "shmstore-doomed").write_bytes(b"x")
    r = env.run("rm", "doomed", "missing", "--json")
    env.one_error_line(r, cli.EXIT_NOT_FOUND, "shmstore-missing")
    rows = json.loads(r.stdout)
    assert [(x["name"], x["removed"]) for x in rows] == [("doomed", True), ("missing", False)]
    assert not (env.dir / "shmstore-doomed").exists()
    env.one_error_line(env.run("rm", "../etc"), cli.EXIT_USAGE, "not a store name")
    env.one_error_line(env.run("rm", ".hidden"), cli.EXIT_USAGE, "not a store name")


def _sealed_orphan(env: Env) -> Path:
    orphan = env.dir / "shmstore-orphan"
    orphan.write_bytes(b"\0" * 4096)
    # Sealed as shmstore's writer seals a segment (read-only, its mark in the mtime's
    # nanoseconds, src/segment/mod.rs): gc removes nothing else.
    now = time.time_ns()
    os.utime(orphan, ns=(now, now // 10**9 * 10**9 + 314_159_265))
    orphan.chmod(0o400)
    return orphan


def test_gc_json(env: Env) -> None:
    _sealed_orphan(env)
    r = env.run("gc", "--dry-run", "--json")
    assert r.returncode == cli.EXIT_NOT_FOUND, r
    report = json.loads(r.stdout)
    assert report["dry_run"] is True and report["removed"] == 1
    assert (env.dir / "shmstore-orphan").exists()
    r = env.run("gc", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["removed"] == 1, r
    assert not (env.dir / "shmstore-orphan").exists()


def test_gc_and_ls_when_the_supervisor_cannot_be_asked(env: Env, tmp_path: Path) -> None:
    """The supervisor's directory is not safe to use (a file stands where it should be), so
    no supervisor can say which segments are in use: ``gc`` removes nothing and says why in
    one line (exit 4, without blaming a supervisor that never answered); ``ls`` says so in
    one line and still lists the files."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    (runtime / "shmstore").write_text("")
    env.vars["XDG_RUNTIME_DIR"] = str(runtime)
    orphan = _sealed_orphan(env)
    for args in (("gc",), ("gc", "--json"), ("gc", "--dry-run")):
        line = env.one_error_line(
            env.run(*args), cli.EXIT_OS_ERROR, "not sweeping", "not a directory"
        )
        assert "answer" not in line, line
    assert orphan.exists()
    r = env.run("ls", "--json")
    env.one_error_line(r, cli.EXIT_OK, "no information from the supervisor", "not a directory")
    assert [row["name"] for row in json.loads(r.stdout)] == ["shmstore-orphan"]


def test_usage_errors(env: Env) -> None:
    r = env.run()
    assert r.returncode == cli.EXIT_USAGE and "usage:" in r.stderr, r
    r = env.run("frobnicate")
    assert r.returncode == cli.EXIT_USAGE and "invalid choice" in r.stderr, r
    r = env.run("ls", "--bogus")
    assert r.returncode == cli.EXIT_USAGE and "--bogus" in r.stderr, r


def test_every_verb_takes_json(env: Env) -> None:
    for args in (("ls",), ("gc", "--dry-run"), ("inspect", "x"), ("rm", "x")):
        r = env.run(*args, "--json")
        assert r.returncode in (0, cli.EXIT_NOT_FOUND), r
        assert "unrecognized arguments" not in r.stderr


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "saved.shm"
    with shmstore.SharedList([1, 2, 3]) as lst:
        lst.save(str(path))
    return path


def test_output_that_cannot_be_written_is_one_line_and_exit_4(env: Env, tmp_path: Path) -> None:
    (env.dir / "shmstore-copied").write_bytes(_saved(tmp_path).read_bytes())
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "shmstore", "ls"],
            env=env.vars,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT_S,
        )
    assert r.returncode == cli.EXIT_OS_ERROR, r.stderr
    assert r.stderr.strip().splitlines() == [
        "shmstore ls: cannot write the output: No space left on device"
    ]
    closed = subprocess.run(
        [sys.executable, "-m", "shmstore", "ls"],
        env=env.vars,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=TIMEOUT_S,
        preexec_fn=lambda: os.close(1),  # the shell's `>&-`
    )
    assert closed.returncode == cli.EXIT_OS_ERROR, closed.stderr
    assert closed.stderr.strip() == "shmstore ls: cannot write the output: stdout is closed"


def test_rm_of_a_directory_named_like_a_segment_says_what_it_is(env: Env) -> None:
    d = env.dir / "shmstore-adir"
    d.mkdir()
    try:
        r = env.run("rm", "adir")
        env.one_error_line(r, cli.EXIT_UNREADABLE, "is a directory, not a segment")
        assert d.is_dir()
    finally:
        d.rmdir()
    r = env.run("rm", "nothing-here")
    env.one_error_line(r, cli.EXIT_NOT_FOUND, "no segment named 'shmstore-nothing-here'")


def test_a_hand_copied_archive_is_unsealed_in_ls_and_gc_agrees(env: Env, tmp_path: Path) -> None:
    saved = _saved(tmp_path)
    (env.dir / "shmstore-copied").write_bytes(saved.read_bytes())
    r = env.run("ls", "--json")
    (row,) = json.loads(r.stdout)
    assert row["state"] == "unsealed" and row["sealed"] is False and row["kind"] == "list"
    text = env.run("ls").stdout
    assert "unsealed" in text and "gc leaves them" in text
    assert "would remove 0" in env.run("gc", "--dry-run").stdout
    env.run("gc")
    assert (env.dir / "shmstore-copied").exists()  # gc left it, as ls said
    assert env.run("rm", "copied").returncode == 0  # rm removes it, as ls said
    assert not (env.dir / "shmstore-copied").exists()


def test_inspect_of_a_segment_by_path_is_a_segment_not_a_saved_file(
    env: Env, tmp_path: Path
) -> None:
    saved = _saved(tmp_path)
    info = json.loads(env.run("inspect", "--json", str(saved)).stdout)
    assert info["copy"] == "saved file"
    code = (
        "import shmstore, sys\n"
        "lst = shmstore.SharedList([1, 2], name='bypath')\n"
        "print(lst.path, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    creator = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env.vars,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None and creator.stdin is not None
        path = creator.stdout.readline().strip()
        info = json.loads(env.run("inspect", "--json", path).stdout)
        assert info["copy"] == "built here", info
        assert info["name"] == "shmstore-bypath"
    finally:
        assert creator.stdin is not None and creator.stdout is not None
        creator.stdin.close()
        creator.wait(timeout=TIMEOUT_S)
        creator.stdout.close()


def test_an_unreadable_entry_keeps_the_columns(env: Env, tmp_path: Path) -> None:
    (env.dir / "shmstore-junk").write_bytes(b"not an archive at all, not even close")
    (env.dir / "shmstore-copied").write_bytes(_saved(tmp_path).read_bytes())
    lines = env.run("ls").stdout.splitlines()
    header, rows = lines[0], [ln for ln in lines[1:] if ln.startswith("shmstore-")]
    assert len(rows) == 2
    at = header.index("STATE")
    for row in rows:
        assert row[at : at + 10].strip() in ("unreadable", "unsealed"), (header, row)
    data = json.loads(env.run("ls", "--json").stdout)
    junk = next(r for r in data if r["name"] == "shmstore-junk")
    assert junk["kind"].startswith("unreadable (")  # the reason, in --json
