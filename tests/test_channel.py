"""`shmstore.Channel`: a queue of objects between processes whose objects travel as handles
through a ring in shared memory (docs/channel.md). The ring's own invariants (order, many
putters and getters, hostile positions) are Rust tests (src/channel/tests.rs)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shmstore
from conftest import run_checked, segment_dir
from shmstore import _native


@pytest.fixture(autouse=True)
def _release_arenas(no_leftover_segments: None) -> Iterator[None]:
    """This process's arenas are let go after each test, so that the leftover check sees
    them (and the test's channels) removed."""
    yield
    gc.collect()
    _native._arena_release()


LARGE = b"L" * (3 << 20)  # larger than an arena object: a segment of its own


def values(i: int) -> list[Any]:
    return [
        np.full(1024, i % 251, dtype=np.uint8),
        {"id": i, "tags": ["a", "b"], "box": (1.5, -0.0)},
        f"text {i}",
        i,
    ]


def same(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return bool(np.array_equal(got, want)) and got.dtype == want.dtype
    if isinstance(want, dict):
        return set(got.keys()) == set(want) and all(same(got[k], v) for k, v in want.items())
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return bool(got == want) and type(got) is type(want)


def test_objects_come_out_in_order_as_put() -> None:
    ch = shmstore.Channel(capacity=16)
    want = [v for i in range(3) for v in values(i)] + [LARGE]
    for v in want:
        ch.put(v)
    assert ch.qsize() == len(want)
    got = [ch.get() for _ in want]
    assert all(same(g, w) for g, w in zip(got, want))
    assert isinstance(got[0], np.ndarray) and not got[0].flags.writeable
    assert ch.empty() and ch._in_flight() == 0


def test_full_and_empty_say_so_like_a_queue() -> None:
    ch = shmstore.Channel(capacity=2)
    assert ch.capacity == 2 and ch.empty() and not ch.full()
    ch.put(1)
    ch.put_nowait(2)
    assert ch.full()
    with pytest.raises(queue.Full):
        ch.put_nowait(3)
    with pytest.raises(queue.Full):
        ch.put(3, timeout=0.01)
    assert [ch.get(), ch.get_nowait()] == [1, 2]
    with pytest.raises(queue.Empty):
        ch.get_nowait()
    with pytest.raises(queue.Empty):
        ch.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        ch.get(block=False)


@pytest.mark.parametrize("capacity", [0, 1, 3, 1000, 1 << 30, -4, 1 << 70])
def test_a_capacity_that_is_not_a_power_of_two_in_range_is_refused(capacity: int) -> None:
    with pytest.raises(ValueError, match="power of two") as info:
        shmstore.Channel(capacity=capacity)
    assert isinstance(info.value, shmstore.InvalidInputError)  # a ValueError, not an I/O error


@pytest.mark.parametrize("capacity", [4.0, "4", None])
def test_a_capacity_that_is_not_an_int_is_a_type_error(capacity: Any) -> None:
    with pytest.raises(TypeError, match="capacity"):
        shmstore.Channel(capacity=capacity)


def test_close_is_like_a_multiprocessing_queues() -> None:
    """After close(), put and get raise ValueError as a closed mp.Queue's do; close() again
    and join_thread() return; qsize/empty/full keep working; other objects of the same
    channel (an unpickled copy) are not closed."""
    ch = shmstore.Channel(capacity=4)
    other = pickle.loads(pickle.dumps(ch))
    ch.put("kept")
    with pytest.raises(ValueError, match="not closed"):
        ch.join_thread()
    assert not ch.closed
    ch.close()
    ch.close()
    assert ch.closed
    for call in (lambda: ch.put(1), lambda: ch.get(), ch.get_nowait, lambda: ch.put_nowait(1)):
        with pytest.raises(ValueError, match="is closed"):
            call()
    ch.join_thread()
    ch.cancel_join_thread()
    assert ch.qsize() == 1 and not ch.empty() and not ch.full()
    assert other.get(timeout=10) == "kept"  # what was put before close() is still there
    q: Any = mp.get_context("spawn").Queue()
    q.close()
    with pytest.raises(ValueError, match="is closed"):  # the behaviour matched
        q.put(1)
    q.join_thread()


# A program written against multiprocessing.Queue, unchanged: producers put, a consumer gets
# until it has seen every producer's sentinel, each side closes and joins as the docs advise.
def _qprog_producer(q: Any, start: int, n: int) -> None:
    for i in range(start, start + n):
        q.put({"i": i, "sq": i * i})
    q.put(None)
    q.close()
    q.join_thread()


def _qprog_consumer(q: Any, out: Any, producers: int) -> None:
    seen, done = [], 0
    while done < producers:
        item = q.get(timeout=60)
        if item is None:
            done += 1
            continue
        assert item["sq"] == item["i"] ** 2
        seen.append(item["i"])
    q.close()
    q.join_thread()
    out.put(sorted(seen))


def _queue_program(make_queue: Any, ctx: Any) -> list[int]:
    q = make_queue(8)
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_qprog_producer, args=(q, k * 100, 50)) for k in range(2)]
    cons = ctx.Process(target=_qprog_consumer, args=(q, out, 2))
    for p in [*procs, cons]:
        p.start()
    result: list[int] = out.get()
    for p in [*procs, cons]:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert q.empty() and q.qsize() == 0
    q.close()
    q.join_thread()
    return result


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_program_written_for_multiprocessing_queue_runs_unchanged(method: str) -> None:
    ctx = mp.get_context(method)
    want = sorted([*range(0, 50), *range(100, 150)])
    assert _queue_program(lambda n: ctx.Queue(n), ctx) == want
    assert _queue_program(lambda n: shmstore.Channel(n), ctx) == want


def test_a_negative_timeout_is_refused() -> None:
    ch = shmstore.Channel(capacity=2)
    with pytest.raises(shmstore.InvalidInputError, match="timeout"):
        ch.get(timeout=-1)


def test_an_object_that_cannot_be_stored_raises_and_puts_nothing() -> None:
    ch = shmstore.Channel(capacity=2)
    with pytest.raises(shmstore.UnsupportedTypeError):
        ch.put({"f": object()})
    assert ch.empty()


def test_a_getter_waits_without_the_gil() -> None:
    """A get blocked on an empty channel lets other threads run: the put below happens
    while it waits (with the GIL held, the put could only run after the get timed out,
    and the get would raise queue.Empty)."""
    ch = shmstore.Channel(capacity=2)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(ch.get(timeout=600)))
    t.start()
    ch.put("hello")
    t.join()
    assert got == ["hello"]


def _produce(ch: shmstore.Channel, start: int, n: int, large: bool) -> None:
    for i in range(start, start + n):
        for v in values(i):
            ch.put(v)
    if large:
        ch.put(LARGE)


def _consume(ch: shmstore.Channel, n: int, out: Any) -> None:
    got = [ch.get(timeout=600) for _ in range(n)]
    out.put([(int(a[-1]), r["id"]) for a, r in zip(got[0::4], got[1::4])])


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_channel_passed_to_another_process_delivers_everything(method: str) -> None:
    ctx = mp.get_context(method)
    ch = shmstore.Channel(capacity=8)  # smaller than what goes through: the putter waits
    p = ctx.Process(target=_produce, args=(ch, 0, 50, True))
    p.start()
    got = [ch.get(timeout=600) for _ in range(50 * 4 + 1)]
    p.join(600)
    assert p.exitcode == 0
    want = [v for i in range(50) for v in values(i)] + [LARGE]
    assert all(same(g, w) for g, w in zip(got, want))


def test_many_putters_and_getters_in_processes_lose_and_repeat_nothing() -> None:
    ctx = mp.get_context("forkserver")
    ch = shmstore.Channel(capacity=16)
    out = ctx.Queue()
    per, putters, getters = 60, 3, 2
    ps = [ctx.Process(target=_produce, args=(ch, k * per, per, False)) for k in range(putters)]
    # Each getter takes whole records of four values only if puts do not interleave, so
    # the getters here take single values and the check is on the multiset of arrays.
    gs = [
        ctx.Process(target=_take_all, args=(ch, putters * per * 4 // getters, out))
        for _ in range(getters)
    ]
    for p in ps + gs:
        p.start()
    got: list[Any] = []
    for _ in gs:
        got += out.get(timeout=600)
    for p in ps + gs:
        p.join(600)
        assert p.exitcode == 0
    ints = sorted(v for kind, v in got if kind == "int")
    arrays = sorted(v for kind, v in got if kind == "array")
    assert ints == list(range(putters * per))
    assert arrays == sorted(i % 251 for i in range(putters * per))


def _take_all(ch: shmstore.Channel, n: int, out: Any) -> None:
    got = []
    for _ in range(n):
        v = ch.get(timeout=600)
        if isinstance(v, np.ndarray):
            got.append(("array", int(v[-1])))
        elif isinstance(v, int):
            got.append(("int", v))
    out.put(got)


def _put_then_exit(ch: shmstore.Channel, how: str) -> None:
    _produce(ch, 0, 3, True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_objects_outlive_the_process_that_put_them(how: str) -> None:
    """The putter is gone (its arena no longer mapped by any process) before anything is
    taken: the supervisor keeps its arena and segment while the channel is in use."""
    ctx = mp.get_context("forkserver")
    ch = shmstore.Channel(capacity=16)
    p = ctx.Process(target=_put_then_exit, args=(ch, how))
    p.start()
    p.join(600)
    assert p.exitcode == (-signal.SIGKILL if how == "sigkill" else 0)
    _native._flush_drops()
    got = [ch.get(timeout=600) for _ in range(3 * 4 + 1)]
    want = [v for i in range(3) for v in values(i)] + [LARGE]
    assert all(same(g, w) for g, w in zip(got, want))


BOTH_KILLED = r"""
import multiprocessing as mp, os, signal, sys, time
from pathlib import Path
import numpy as np
import shmstore
from shmstore import _native

def put_then_die(ch):
    ch.put(np.full(1024, 7, dtype=np.uint8))
    ch.put({"id": 1})
    ch.put(b"L" * (3 << 20))  # a segment of its own
    os.kill(os.getpid(), signal.SIGKILL)

ch = shmstore.Channel(capacity=16)
p = mp.get_context("fork").Process(target=put_then_die, args=(ch,))
p.start()
p.join(600)
assert p.exitcode == -signal.SIGKILL, p.exitcode
_native._flush_drops()
pid = int(_native.supervisor_info()["pid"])
os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 60
while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
    time.sleep(0.01)  # bounded: until the kernel has reaped it
files = [f for f in Path(os.environ["SHMSTORE_DIR"]).iterdir() if f != ch.path]
# The next conversation starts a new supervisor, whose start-up sweep settles each file
# left: removed, or tracked (kept).
shmstore.put({"start": "a supervisor"}, arena=False).close()
while time.monotonic() < deadline:
    now = _native.supervisor_info()
    tracked = set(now["segments"]) if now else set()
    if all(not f.exists() or str(f) in tracked for f in files):
        break
    time.sleep(0.05)  # bounded: polling the supervisor's state
got = [ch.get(timeout=60) for _ in range(3)]
print(int(got[0][-1]), got[1]["id"], len(got[2]))
"""


TWO_SUPERVISORS_GETTER = r"""
import os, pickle, sys, time
from pathlib import Path
import shmstore
from shmstore import _native

ch = pickle.loads(bytes.fromhex(sys.argv[2]))
if sys.argv[1] == "first":
    shmstore.put({"start": "a supervisor"}, arena=False).close()
    print("ready", flush=True)
else:
    # Until this process's supervisor has settled the arena that the first getter, now
    # gone, used: removed it, or keeps it for the channel (tracked, no process using it).
    arenas = [f for f in Path(os.environ["SHMSTORE_DIR"]).iterdir() if f != ch.path]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        segs = (_native.supervisor_info() or {}).get("segments", {})
        if all(not f.exists() or segs.get(str(f)) == [] for f in arenas):
            break
        time.sleep(0.05)  # bounded: polling the supervisor's state
print(int(ch.get(timeout=60)[-1]))
"""

TWO_SUPERVISORS = r"""
import multiprocessing as mp, os, pickle, signal, subprocess, sys
import numpy as np
import shmstore
from shmstore import _native

def put_then_die(ch):
    ch.put(np.full(1024, 7, dtype=np.uint8))  # two objects of one arena
    ch.put(np.full(1024, 8, dtype=np.uint8))
    os.kill(os.getpid(), signal.SIGKILL)

ch = shmstore.Channel(capacity=16)
env = {**os.environ, "SHMSTORE_SUPERVISOR_NAME": os.environ["SHMSTORE_SUPERVISOR_NAME"] + "-b"}
getter = [sys.executable, "-c", sys.argv[1]]
# The first getter starts its supervisor before anything is put, then waits in get().
first = subprocess.Popen([*getter, "first", pickle.dumps(ch).hex()], env=env,
                         stdout=subprocess.PIPE, text=True)
assert first.stdout.readline().strip() == "ready"
p = mp.get_context("fork").Process(target=put_then_die, args=(ch,))
p.start()
p.join(600)
assert p.exitcode == -signal.SIGKILL, p.exitcode
print(first.stdout.read().strip())
assert first.wait(300) == 0, first.returncode
second = subprocess.run([*getter, "second", pickle.dumps(ch).hex()], env=env,
                        capture_output=True, text=True, timeout=300)
sys.stderr.write(second.stderr)
assert second.returncode == 0, second.returncode
print(second.stdout.strip())
"""


def test_a_channels_objects_survive_getters_of_another_supervisor() -> None:
    """Processes of one user that find different state directories (a cron job beside a
    login session) talk to two supervisors that sweep one segment directory. A getter whose
    supervisor is not the putter's took the first of two objects of one arena (the putter
    had died) and exited: its supervisor saw the arena's last user go and removed it,
    though the channel still held the second object (whose pin only the putter's
    supervisor knew), and the next getter's get raised StoreNotFoundError. A supervisor
    now pins what a channel it tracks holds before removing anything."""
    env = {**os.environ, "SHMSTORE_SUPERVISOR_NAME": f"shmstore-two-{os.getpid()}"}
    out = run_checked([sys.executable, "-c", TWO_SUPERVISORS, TWO_SUPERVISORS_GETTER], env=env)
    assert out.stdout.split() == ["7", "8"], (out.stdout, out.stderr[-3000:])


def test_objects_outlive_their_putter_and_the_supervisor_both_killed() -> None:
    """The putter and then the supervisor are SIGKILLed before anything is taken: the pin
    on the putter's arena lived in those two processes only, and the next supervisor's
    orphan sweep removed the arena (no live process maps it), so get() raised
    StoreNotFoundError. The sweep now reads what the channel's cells still hold and keeps
    it while the channel is in use. (In a child process with a supervisor of its own: the
    test kills it.)"""
    env = {**os.environ, "SHMSTORE_SUPERVISOR_NAME": f"shmstore-both-{os.getpid()}"}
    out = run_checked([sys.executable, "-c", BOTH_KILLED], env=env).stdout
    assert out.split() == ["7", "1", str(3 << 20)], out


def _hold_then_die(ch: shmstore.Channel, ready: Any) -> None:
    held = [ch.get(timeout=600) for _ in range(4)]
    ready.put(sum(int(a[-1]) for a in held))
    signal.pause()


def test_objects_taken_by_a_killed_getter_are_let_go_of() -> None:
    """A getter holding objects is SIGKILLed: the putter's hold ended when they were
    taken, the getter's with its death, so their chunks are free again: held by nobody,
    and reused by the putter (which reclaims released chunks in batches)."""
    ctx = mp.get_context("forkserver")
    ch = shmstore.Channel(capacity=8)
    for i in range(4):
        ch.put(np.full(4096, i, dtype=np.uint8))
    ready = ctx.Queue()
    p = ctx.Process(target=_hold_then_die, args=(ch, ready))
    p.start()
    assert ready.get(timeout=600) == 0 + 1 + 2 + 3
    assert ch._in_flight() == 0  # taken: the putter holds none of them any more
    ((arena, _, _),) = _native._arena_usage()

    def held() -> dict[tuple[int, int], str]:
        """(offset, generation) -> state of every chunk not free."""
        chunks = _native._arena_info(arena)["chunks"]
        return {(c["offset"], c["generation"]): c["state"] for c in chunks if c["state"] != "free"}

    taken = held()
    assert list(taken.values()) == ["leased"] * 4  # the getter's leases
    p.kill()
    p.join(600)
    assert list(held().values()) == ["unleased"] * 4  # its leases died with it
    # Reused: a stream of objects put and taken through the channel goes into the chunks
    # let go of, the four among them (rewritten: a new generation at their offsets),
    # instead of growing the arena.
    used_before = _native._arena_usage()[0][1]
    for i in range(64):
        ch.put(np.full(4096, i, dtype=np.uint8))
        assert int(ch.get()[-1]) == i
    assert _native._arena_usage()[0][1] <= used_before + 16 * 8192
    assert not set(taken) & set(held()), "a chunk of the killed getter was never reused"


def test_a_channel_pickles_by_name() -> None:
    ch = shmstore.Channel(capacity=4)
    data = pickle.dumps(ch)
    assert len(data) < 200
    again = pickle.loads(data)
    assert again.name == ch.name and again.path == ch.path
    ch.put("x")
    assert again.get() == "x"


def test_only_a_channel_file_of_ours_is_opened(tmp_path: Path) -> None:
    ch = shmstore.Channel(capacity=4)
    path = Path(ch.path)
    rebuild = _native._rebuild_channel
    with pytest.raises(shmstore.ShmStoreError):
        rebuild(Path("relative-name"))
    with pytest.raises(shmstore.ShmStoreError):
        rebuild(path.parent / "../etc")
    # A symlink named like a channel: not followed.
    link = segment_dir() / "shmstore-link"
    link.symlink_to(path)
    try:
        with pytest.raises(shmstore.ShmStoreError):
            rebuild(link)
    finally:
        link.unlink()
    # A file of the right name that is not a channel: refused as corrupt.
    other = segment_dir() / "shmstore-notachannel"
    other.write_bytes(b"\0" * 4096)
    other.chmod(0o600)
    try:
        with pytest.raises(shmstore.CorruptStoreError):
            rebuild(other)
    finally:
        other.unlink()


def test_a_crafted_cell_gives_corrupt_store_error_and_the_channel_goes_on() -> None:
    ch = shmstore.Channel(capacity=4)
    ch.put(np.arange(3))
    # Cell 0's path (bytes 512 + 72 on) pointed elsewhere by a neighbour writing the file.
    with open(ch.path, "r+b") as f:
        f.seek(512 + 72)
        f.write(b"/etc/passwd\0")
        f.seek(512 + 8 + 1)
        f.write(bytes([11, 0]))
    with pytest.raises(shmstore.ShmStoreError):
        ch.get(timeout=600)
    ch.put("next")
    assert ch.get(timeout=600) == "next"


def _dead_claim() -> int:
    """What a cell's claim word says of a process that has exited (and was reaped)."""
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    ns = os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    return p.pid | ns << 32


def _poke(path: str, at: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(value.to_bytes(8, "little"))


CELLS, CELL, HEAD, TAIL = 512, 256, 128, 64
PUTTER, GETTER, PUTTER_START = 5 * 8, 6 * 8, 7 * 8


def _start_word(pid: int, shift: int) -> int:
    """What a claim's start word says of process `pid` (docs/channel.md, "Layout"), its
    start time (``/proc/<pid>/stat`` field 22) moved by `shift` ticks."""
    with open(f"/proc/{pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[22 - 3]) + shift
    try:
        time_ns = os.stat("/proc/self/ns/time").st_ino & 0xFFFFFF
    except OSError:
        time_ns = 0
    return (start & ((1 << 40) - 1)) | time_ns << 40


def test_a_cell_held_by_a_dead_getter_is_handed_back_to_a_waiting_putter() -> None:
    """A getter SIGKILLed between claiming a cell and handing it back (written here as it
    would have left the file): the next put waits, finds the claimer dead and goes on."""
    ch = shmstore.Channel(capacity=2)
    ch.put("one")
    ch.put("two")
    _poke(str(ch.path), HEAD, 1)
    _poke(str(ch.path), CELLS + GETTER, _dead_claim())
    ch.put("three", timeout=600)  # queue.Full without the recovery
    assert [ch.get(timeout=600), ch.get(timeout=600)] == ["two", "three"]
    assert ch._in_flight() == 0


def test_a_cell_claimed_by_a_dead_putter_is_skipped_by_a_waiting_getter() -> None:
    ch = shmstore.Channel(capacity=2)
    _poke(str(ch.path), TAIL, 1)
    _poke(str(ch.path), CELLS + PUTTER, _dead_claim())
    ch.put("after")
    assert ch.get(timeout=600) == "after"  # queue.Empty without the recovery


def test_a_cell_claimed_by_a_killed_putter_whose_pid_names_another_process_is_skipped() -> None:
    """A putter SIGKILLed between its claim and its publish, whose pid the system has since
    given to another process (written here as the file would be: the claim names a live
    process, which started after the claimer did): a waiting get sees that and goes on."""
    import subprocess

    ch = shmstore.Channel(capacity=2)
    with subprocess.Popen(["sleep", "600"]) as other:
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
            _poke(str(ch.path), TAIL, 1)
            _poke(str(ch.path), CELLS + PUTTER_START, _start_word(other.pid, -1))
            _poke(str(ch.path), CELLS + PUTTER, other.pid | ns << 32)
            ch.put("after")
            assert ch.get(timeout=60) == "after"  # queue.Empty while `other` lives, before
        finally:
            other.kill()


def test_a_relative_dir_is_made_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(segment_dir().parent)
    ch = shmstore.Channel(capacity=2, dir=segment_dir().name)
    assert Path(ch.path).is_absolute() and Path(ch.path).parent == segment_dir()
    again = pickle.loads(pickle.dumps(ch))
    ch.put(5)
    assert again.get() == 5


def test_without_a_supervisor_a_channel_says_what_it_needs(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import shmstore\n"
        "try:\n"
        "    shmstore.Channel()\n"
        "except shmstore.ShmStoreError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, SHMSTORE_SUPERVISOR="0", SHMSTORE_DIR=str(segment_dir()))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert "needs the supervisor" in out.stdout, out
    assert not [p for p in segment_dir().iterdir() if p.name.startswith("shmstore-")]


def _busy(stop: Any) -> None:
    """A busy loop until `stop` is set (at most 120 s)."""
    import time

    end = time.monotonic() + 120
    x = 0
    while not stop.is_set() and time.monotonic() < end:
        x = (x * 31 + 1) & 0xFFFF


def _echo(inbox: shmstore.Channel, outbox: shmstore.Channel, n: int) -> None:
    for _ in range(n):
        outbox.put(inbox.get(timeout=600), timeout=600)


def test_a_ping_pong_between_processes_under_busy_loops_delivers_every_round() -> None:
    """With more busy processes than cores, two processes answer each other object by
    object: every wait ends by its spin or a wake-up (none is lost: a lost one would hang
    until the 600 s timeout), and a timed-out get on the empty channel still raises
    `queue.Empty`. The busy loops are stopped whatever happens."""
    ctx = mp.get_context("forkserver")
    stop = ctx.Event()
    busy = [ctx.Process(target=_busy, args=(stop,)) for _ in range((os.cpu_count() or 2) + 2)]
    for p in busy:
        p.start()
    try:
        ab, ba = shmstore.Channel(capacity=2), shmstore.Channel(capacity=2)
        rounds = 100
        echo = ctx.Process(target=_echo, args=(ab, ba, rounds))
        echo.start()
        for i in range(rounds):
            ab.put(np.full(1024, i % 251, dtype=np.uint8), timeout=600)
            got = ba.get(timeout=600)
            assert int(got[0]) == i % 251 and got.shape == (1024,)
        echo.join(600)
        assert echo.exitcode == 0
        with pytest.raises(queue.Empty):
            ba.get(timeout=0.01)
    finally:
        stop.set()
        for p in busy:
            p.join(130)
            if p.exitcode is None:
                p.kill()
                p.join()
