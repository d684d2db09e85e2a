"""Small objects in arenas: `put(obj, arena=True)` (docs/arena.md). The kill matrix of arenas
is in test_lifecycle.py; the allocator's invariants are Rust tests (src/arena/alloc.rs)."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import shmstore
from conftest import gather_a_reclaim, mounted_tmpfs, segment_dir
from shmstore import _native


@pytest.fixture(autouse=True)
def _release_arenas(no_leftover_segments: None) -> Iterator[None]:
    """This process's arenas are let go after each test, so that the leftover check sees
    them removed (it runs after this fixture's teardown)."""
    yield
    gc.collect()
    _native._arena_release()


def chunk_of(ref: shmstore.Ref) -> tuple[str, int, int, int]:
    arena, rest = ref.name.split("@")
    offset, size, generation = (int(x) for x in rest.split(":"))
    return arena, offset, size, generation


def test_round_trip_of_small_objects() -> None:
    values = [
        {"a": [1, 2, 3], "s": "text", "f": 1.5, "none": None},
        [1, (2, 3), {"k": b"bytes"}],
        np.arange(12, dtype=np.float32).reshape(3, 4),
        "just a string",
        2**100,
    ]
    refs = [shmstore.put(v, arena=True) for v in values]
    arenas = {chunk_of(r)[0] for r in refs}
    assert len(arenas) == 1, "all in one arena"
    for v, r in zip(values, refs, strict=True):
        got = r.get()
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype and np.array_equal(got, v)
            assert not got.flags.writeable
            assert got.ctypes.data % 64 == 0
        elif hasattr(got, "to_python"):
            assert got.to_python() == v
        else:
            assert got == v


def test_attach_by_name_and_pickle_in_another_process() -> None:
    ref = shmstore.put({"x": list(range(100))}, arena=True)
    again = shmstore.Ref.attach(ref.name)
    assert again.get()["x"][99] == 99
    data = pickle.dumps(ref)
    assert len(data) < 256
    code = "import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); print(sum(r.get()['x']))"
    out = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=300
    )
    assert out.stdout.strip() == b"4950"
    # A view of a chunk pickles too.
    view = pickle.loads(pickle.dumps(ref.get()["x"]))
    assert list(view)[:3] == [0, 1, 2]


def test_a_stale_handle_raises_store_closed_error() -> None:
    ref = shmstore.put(b"a" * 1000, arena=True)
    name = ref.name
    arena, offset, _, generation = chunk_of(ref)
    ref.close()
    del ref
    gc.collect()
    # The chunk is free: once reclaimed, the next object of that size takes it, with a new
    # generation.
    gather_a_reclaim(1)
    new = shmstore.put(b"b" * 1000, arena=True)
    assert chunk_of(new)[:2] == (arena, offset)
    assert chunk_of(new)[3] != generation
    with pytest.raises(shmstore.StoreClosedError, match="was freed"):
        shmstore.Ref.attach(name)
    assert new.get() == b"b" * 1000


def test_views_keep_their_chunk() -> None:
    ref = shmstore.put({"xs": [1, 2, 3]}, arena=True)
    view = ref.get()["xs"]
    offset = chunk_of(ref)[1]
    ref.close()
    del ref
    gc.collect()
    # The view still holds the chunk: a new object goes elsewhere.
    other = shmstore.put({"xs": [4, 5, 6]}, arena=True)
    assert chunk_of(other)[1] != offset
    assert list(view) == [1, 2, 3]


def test_large_objects_get_a_segment_of_their_own() -> None:
    ref = shmstore.put(np.zeros((8 << 20) + 1, dtype=np.uint8), arena=True)
    assert "@" not in ref.name
    ref.close()
    named = shmstore.put(1, arena=True, name="shmstore-arena-test-named")
    assert named.name == "shmstore-arena-test-named"
    named.close()
    # No size known in advance: found out while encoding (at most 1 MiB buffered).
    big = {"rows": [str(i) * 40 for i in range(40_000)]}
    ref = shmstore.put(big, arena=True)
    assert "@" not in ref.name and ref.get()["rows"][39_999] == "39999" * 40
    ref.close()
    many = list(range(100_000))  # more items than an arena is tried for
    ref = shmstore.put(many, arena=True)
    assert "@" not in ref.name and ref.get()[99_999] == 99_999
    ref.close()
    small = shmstore.put({"rows": [str(i) for i in range(100)]}, arena=True)
    assert "@" in small.name


def test_by_default_small_objects_go_to_the_arena_and_large_ones_to_a_segment() -> None:
    small = [shmstore.put(b"x" * 1000), shmstore.put(np.arange(10)), shmstore.put({"a": 1})]
    assert all("@" in r.name for r in small)
    assert len({chunk_of(r)[0] for r in small}) == 1, "one arena for all of them"
    # docs/arena.md: payloads of a known size (arrays, bytes) of at most an eighth of the
    # largest arena (8 MiB by default), that size included; other objects up to 1 MiB.
    limit = 8 << 20
    at_limit = [shmstore.put(np.zeros(limit, dtype=np.uint8)), shmstore.put(b"z" * limit)]
    assert all("@" in r.name for r in at_limit), "8 MiB exactly is an arena object"
    assert at_limit[1].get() == b"z" * limit
    assert at_limit[0].get().nbytes == limit
    for r in at_limit:
        r.close()
    large = shmstore.put(np.zeros(limit + 1, dtype=np.uint8))
    unknown_size = shmstore.put({"rows": ["y" * 100] * 20_000})  # > 1 MiB, found encoding
    forced = shmstore.put(b"x" * 1000, arena=False)
    named = shmstore.put(b"x" * 1000, name="shmstore-default-named")
    for r in (large, unknown_size, forced, named):
        assert "@" not in r.name
        assert (segment_dir() / r.name).is_file()
    assert named.name == "shmstore-default-named"
    for r in (*small, large, unknown_size, forced, named):
        r.close()


ARENA_LIMITS = """
import sys, numpy as np, shmstore
from shmstore import _native

limit = int(sys.argv[1])
at = [shmstore.put(np.ones(limit, dtype=np.uint8)), shmstore.put(b"y" * limit)]
over = [shmstore.put(np.ones(limit + 1, dtype=np.uint8)), shmstore.put(b"y" * (limit + 1))]
assert all("@" in r.name for r in at), [r.name for r in at]
assert all("@" not in r.name for r in over), [r.name for r in over]
assert int(at[0].get().sum()) == limit and at[1].get() == b"y" * limit
# The arena made for the first of them holds three like it (whole MiB; docs/arena.md).
caps = [cap for _, _, cap in _native._arena_usage()]
print(caps[0])
"""


@pytest.mark.parametrize(
    ("arena_size", "limit", "first_arena"),
    [
        (str(64 << 20), 8 << 20, 25 << 20),  # the default: an eighth
        (str(32 << 20), 4 << 20, 13 << 20),
        (str(4 << 20), 1 << 20, 4 << 20),  # never less than 1 MiB
    ],
)
def test_the_largest_arena_sets_the_limit_of_known_size_objects(
    arena_size: str, limit: int, first_arena: int
) -> None:
    """An array or bytes object goes into an arena up to an eighth of the largest arena
    (`SHMSTORE_ARENA_SIZE`, read once per process), 1 MiB at least; the arena made for it
    has room for three like it."""
    import os

    env = {**os.environ, "SHMSTORE_ARENA_SIZE": arena_size}
    out = subprocess.run(
        [sys.executable, "-c", ARENA_LIMITS, str(limit)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == first_arena


def test_a_stream_of_large_arrays_with_a_few_in_flight_stays_in_one_arena() -> None:
    """6 MiB arrays put one after another, each closed once two newer ones exist: the arena
    made for the first has room for three (docs/arena.md, "The threshold"), and the chunks
    let go of are reused, so forty of them need no second arena and values never mix."""
    mib = 1 << 20
    live: list[shmstore.Ref] = []
    for i in range(40):
        live.append(shmstore.put(np.full(6 * mib, i % 251, dtype=np.uint8)))
        assert "@" in live[-1].name
        if len(live) > 2:
            live.pop(0).close()
        assert [int(r.get()[-1]) for r in live] == [(i - k) % 251 for k in range(len(live))][::-1]
    usage = _native._arena_usage()
    assert len(usage) == 1, usage
    assert usage[0][2] == 19 * mib  # three 6 MiB chunks with their headers, whole MiB
    for r in live:
        r.close()


def test_an_arena_for_large_arrays_leaves_most_of_a_small_dev_shm_to_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a 64 MiB tmpfs (a container's default /dev/shm) an 8 MiB array gets a segment of
    its own: the arena made for it (25 MiB) would take more than a quarter of the room, and
    stay reserved while the process lives. A 2 MiB array's (7 MiB) and a small object's
    (4 MiB) arenas fit that rule and are made (docs/arena.md, "The threshold")."""
    mib = 1 << 20
    with mounted_tmpfs(tmp_path, "64m") as mnt:
        monkeypatch.setenv("SHMSTORE_DIR", str(mnt))
        big = shmstore.put(np.ones(8 * mib, dtype=np.uint8))
        assert "@" not in big.name and (mnt / big.name).is_file()
        assert _native._arena_usage() == []
        medium = shmstore.put(np.ones(2 * mib, dtype=np.uint8))
        assert "@" in medium.name
        assert [cap for _, _, cap in _native._arena_usage()] == [7 * mib]
        assert int(big.get().sum()) == 8 * mib and int(medium.get().sum()) == 2 * mib
        for r in (big, medium):
            r.close()
        _native._arena_release()
        small = shmstore.put(np.ones(1000, dtype=np.uint8))
        assert "@" in small.name
        assert [cap for _, _, cap in _native._arena_usage()] == [4 * mib]
        small.close()
        _native._arena_release()


@pytest.mark.parametrize(
    "name",
    [
        "shmstore-0@4096:64",
        "shmstore-0@x:64:1",
        "shmstore-0@4096:64:1:9",
    ],
)
def test_malformed_chunk_names_are_refused(name: str) -> None:
    with pytest.raises(shmstore.InvalidInputError, match="<arena>@<offset>:<size>:<generation>"):
        shmstore.Ref.attach(name)


def test_hostile_chunk_coordinates_are_errors() -> None:
    ref = shmstore.put([1, 2, 3], arena=True)
    arena, offset, size, generation = chunk_of(ref)
    for off, sz in [(0, size), (offset + 8, size), (offset, 1 << 62), (offset, 8)]:
        with pytest.raises(shmstore.CorruptStoreError):
            shmstore.Ref.attach(f"{arena}@{off}:{sz}:{generation}")


def test_unlink_of_a_chunk_keeps_the_arena() -> None:
    ref = shmstore.put([1], arena=True)
    other = shmstore.put([2], arena=True)
    ref.unlink()
    assert ref.path.exists()
    assert other.get()[0] == 2


def test_simulation_compares_best_fit_with_first_fit() -> None:
    best = _native._arena_simulate("best-fit", 20_000, live_target=200, seed=3)
    first = _native._arena_simulate("first-fit", 20_000, live_target=200, seed=3)
    assert best["peak_live"] == first["peak_live"]
    assert best["peak_end"] < first["peak_end"]
    with pytest.raises(ValueError):
        _native._arena_simulate("worst-fit", 10)


def test_threads_putting_and_reading_at_once() -> None:
    """Many threads share the process's arenas: every object reads back as put."""
    import threading

    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            refs = []
            for i in range(300):
                refs.append(shmstore.put({"t": t, "i": i, "b": bytes([i % 256]) * i}, arena=True))
                if i % 3 == 0:
                    refs.pop(0).close()  # freed chunks are reused while others put
            for r in refs:
                v = r.get()
                assert v["b"] == bytes([v["i"] % 256]) * v["i"] and v["t"] == t
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors


def test_small_objects_keep_the_gil() -> None:
    """A small object's arena work is done with the GIL when no other thread holds the
    arenas' lock: giving it back would let a thread running Python keep it for up to the
    switch interval (5 ms) per step. Counted per process (`_arena_gil_handbacks`): none for
    puts kept and let go of (reclaims and sweeps for idle arenas among them), a channel's
    puts and gets, or unpickled handles of arrays of any size (their metadata is small);
    only the first put, which makes the arena, and opening a chunk whose archive has large
    metadata (a dict of 8,000 keys) give it back."""
    a = np.arange(256, dtype=np.uint32)
    big = np.zeros(300_000, dtype=np.uint8)
    shmstore.put(a).close()  # the arena is made (without the GIL)
    before = _native._arena_gil_handbacks()
    assert set(before) == {"place", "commit", "settle", "open"}
    kept = [shmstore.put(a) for _ in range(100)]
    for i in range(300):  # over 64 puts: a sweep; over 16 released: a reclaim
        shmstore.put(a).close()
        if i % 3 == 0 and kept:
            kept.pop().close()
    ch = shmstore.Channel(8)
    for x in [a] * 100 + [big] * 5:
        ch.put(x)
        assert ch.get()[-1] == x[-1]
    for x in (a, big):
        with shmstore.put(x) as ref:
            assert pickle.loads(pickle.dumps(ref)).get()[-1] == x[-1]
    assert _native._arena_gil_handbacks() == before
    with shmstore.put({f"k{i}": i for i in range(8000)}) as ref:
        assert pickle.loads(pickle.dumps(ref)).get()["k7"] == 7
    assert _native._arena_gil_handbacks() == dict(before, open=before["open"] + 1)
    ch.close()


def test_without_a_supervisor_objects_get_segments_of_their_own() -> None:
    """No supervisor: nothing would remove an arena after a crash, so none is made."""
    import os

    code = (
        "import shmstore; r = shmstore.put([1, 2], arena=True); "
        "print('@' in r.name, r.get()[1]); r.close()"
    )
    env = {**os.environ, "SHMSTORE_SUPERVISOR": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "2"]


def _arena_mappings(arena: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/" + arena))


def test_one_mapping_per_arena_per_process() -> None:
    """Every chunk read in a process is a window of the arena's one mapping there: not a
    mapping per object, in the creator or in a reader."""
    refs = [shmstore.put(np.full(3000, i, dtype=np.uint8), arena=True) for i in range(50)]
    arena = chunk_of(refs[0])[0]
    assert {chunk_of(r)[0] for r in refs} == {arena}
    arrays = [r.get() for r in refs]
    again = [pickle.loads(pickle.dumps(r)).get() for r in refs]
    assert _arena_mappings(arena) == 1
    assert [int(a[0]) for a in again] == list(range(50))
    code = (
        "import pickle, sys\n"
        "refs = pickle.loads(sys.stdin.buffer.read())\n"
        "arrays = [r.get() for r in refs]\n"
        "assert [int(a[-1]) for a in arrays] == list(range(50))\n"
        "arena = refs[0].name.split('@')[0]\n"
        "print(sum(l.rstrip().endswith('/' + arena) for l in open('/proc/self/maps')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(refs),
        capture_output=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.strip() == b"1"
    # The mapping outlives the handles while views of it exist.
    for r in refs:
        r.close()
    del refs, again
    gc.collect()
    assert [int(a[1]) for a in arrays] == list(range(50))


def _arena_rss(arena: str) -> int:
    """KiB of this process's mapping of `arena` (by its name) that are mapped in."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = line.rstrip().endswith("/" + arena)
            elif inside and line.startswith("Rss:"):
                rss += int(head[1])
    return rss


def test_the_creator_reads_its_chunks_through_the_mapping_it_wrote_them_with() -> None:
    """The creator's own handles read the pages its writer mapped in already: its mapping
    of the arena by name takes no page (no page faults, nothing to take down later) until
    it attaches a chunk by name like any other process."""
    refs = [shmstore.put(np.full(20_000, i, dtype=np.uint8), arena=True) for i in range(20)]
    arena = chunk_of(refs[0])[0]
    assert _arena_mappings(arena) == 1
    arrays = [r.get() for r in refs]
    assert [int(a[0]) + int(a[-1]) for a in arrays] == [2 * i for i in range(20)]
    refs[3].verify()
    assert _arena_rss(arena) == 0
    # Attached by name (as another process would): read through the arena's mapping.
    again = pickle.loads(pickle.dumps(refs[5]))
    assert int(again.get()[-1]) == 5
    assert _arena_rss(arena) > 0
    # The chunk of a dropped handle is reused; the new object reads its own bytes.
    del arrays, again
    gc.collect()
    stale = refs.pop(0)
    stale_name = stale.name
    stale.close()
    gc.collect()
    gather_a_reclaim(1)
    new = shmstore.put(np.full(20_000, 99, dtype=np.uint8), arena=True)
    assert int(new.get()[-1]) == 99
    assert new.name.split(":")[0] == stale_name.split(":")[0]  # same arena, same offset
    with pytest.raises(shmstore.StoreClosedError):
        shmstore.Ref.attach(stale_name)


CREATOR = r"""
import sys, shmstore
held = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "put":
        held.append(shmstore.put(b"c" * int(cmd[1])))
        print(held[-1].name, flush=True)
    elif cmd[0] == "close":
        for h in held:
            h.close()
        held.clear()
        print("closed", flush=True)
"""


def test_a_forked_child_dropping_an_inherited_handle_keeps_the_parent_s_lease() -> None:
    """A reader's lease is a lock of its open file description, which a forked child shares:
    the child letting go of its copy of the handle must not release the parent's lease
    (before: it did, and the creator reused the chunk under the parent's view)."""
    import os

    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert creator.stdin is not None and creator.stdout is not None

    def ask(cmd: str) -> str:
        creator.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        creator.stdin.flush()  # type: ignore[union-attr]
        return creator.stdout.readline().strip()  # type: ignore[union-attr]

    try:
        name = ask("put 1000")
        ref = shmstore.Ref.attach(name)  # this process's lease
        view = ref.get()
        assert ask("close") == "closed"  # only the lease here keeps the chunk now
        pid = os.fork()
        if pid == 0:
            del view, ref
            gc.collect()
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        again = ask("put 1000")  # the creator reclaims what nobody leases
        assert chunk_of(shmstore.Ref.attach(again))[1] != chunk_of(ref)[1]
        assert bytes(view) == b"c" * 1000
        ref.close()
    finally:
        creator.stdin.close()
        creator.wait(300)
        creator.stdout.close()


def test_a_process_s_arenas_start_small_and_grow() -> None:
    """The first arena reserves 4 MiB of shared memory, not 64: a process putting a few small
    objects holds little; each next arena is twice the last (docs/arena.md, "Layout")."""
    mib = 1 << 20
    first = shmstore.put(b"x" * 100)
    assert [cap for _, _, cap in _native._arena_usage()] == [4 * mib]
    held = [shmstore.put(np.zeros(mib - 4096, dtype=np.uint8)) for _ in range(6)]
    assert all("@" in r.name for r in held)
    assert [cap for _, _, cap in _native._arena_usage()] == [4 * mib, 8 * mib]
    for r in (first, *held):
        r.close()


IDLE_ARENAS = """
import os, sys, time
import numpy as np, shmstore
from shmstore import _native

mib = 1 << 20
def arenas():
    return [os.path.basename(p) for p, _, _ in _native._arena_usage()]
def sweep():  # every 64th small put looks at the older arenas (docs/arena.md, "Layout")
    for _ in range(64):
        shmstore.put(b"x").close()

held = [shmstore.put(np.zeros(mib - 4096, dtype=np.uint8)) for _ in range(14)]
usage = _native._arena_usage()
assert [c for _, _, c in usage] == [4 * mib, 8 * mib, 16 * mib], usage
first, second, newest = arenas()
keep = next(r for r in held if r.name.split("@")[0] == second)
for r in held:
    if r is not keep:
        r.close()
sweep()
if sys.argv[1] == "kept":  # idle, but not for SHMSTORE_ARENA_IDLE seconds yet
    assert arenas() == [first, second, newest], arenas()
    print("ok")
    sys.exit()
# The first is handed back; the second holds an object; the newest takes the next ones.
assert arenas() == [second, newest], arenas()
assert keep.get()[0] == 0
keep.close()
sweep()
assert arenas() == [newest], arenas()
path = os.path.join(os.path.dirname(_native._arena_usage()[0][0]), first)
deadline = time.monotonic() + 60
while os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.02)  # the supervisor's unlink: no event to wait on
assert not os.path.exists(path), "an arena handed back was not removed"
print("ok")
"""


@pytest.mark.parametrize(("idle", "expect"), [("0", "released"), ("3600", "kept")])
def test_older_arenas_no_object_uses_are_handed_back(idle: str, expect: str) -> None:
    """A burst of small objects grows a process's arenas (4, 8, 16 MiB); an older arena that
    no object has used for `SHMSTORE_ARENA_IDLE` seconds is handed back at a later put and
    removed once no process maps it, while one that still holds an object, and the newest,
    stay (docs/arena.md, "Layout"). Before, a process kept every arena it ever made."""
    import os

    env = {**os.environ, "SHMSTORE_ARENA_IDLE": idle}
    out = subprocess.run(
        [sys.executable, "-c", IDLE_ARENAS, expect],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_an_arena_whose_creator_died_mid_write_is_still_removed() -> None:
    """An arena's modification time can move after its creator set the seal mark (a page of
    its writable mapping faulted in again for a write; formerly every chunk written
    moved it): a creator SIGKILLed before putting the mark back leaves an arena without
    it, which the supervisor must still recognise (by its header) and remove (before: kept
    forever)."""
    import time
    from pathlib import Path

    code = (
        "import os, shmstore\n"
        "r = shmstore.put(b'x' * 100)\n"
        "st = os.stat(r.path)\n"
        "mtime = st.st_mtime_ns - st.st_mtime_ns % 10**9 + 1  # what a write leaves\n"
        "os.utime(r.path, ns=(st.st_atime_ns, mtime))\n"
        "print(r.path, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stderr
    arena = Path(out.stdout.strip())
    assert arena.name.startswith("shmstore-")
    deadline = time.monotonic() + 60
    while arena.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the supervisor's unlink: no event to wait on
    assert not arena.exists(), "an arena without the seal mark was left behind"


def test_writing_chunks_leaves_the_seal_mark() -> None:
    """The creator copies chunks into a mapping whose pages were all faulted in writable at
    creation: tmpfs moves the modification time only on a write fault, so after thousands of
    chunks over hundreds of pages the arena still carries the writer's seal mark (its mtime's
    nanoseconds, docs/invariants.md), with no system call per chunk to put it back."""
    import os

    refs = [shmstore.put(np.full(1000 + i % 64, i % 251, dtype=np.uint8)) for i in range(2000)]
    arenas = {r.path for r in refs}
    assert all("@" in r.name for r in refs)
    for arena in arenas:
        assert os.stat(arena).st_mtime_ns % 10**9 == 314_159_265, arena
    assert [int(r.get()[-1]) for r in refs] == [i % 251 for i in range(2000)]


def test_a_pickled_chunk_handle_is_short_and_checked() -> None:
    """A chunk's Ref pickles as `_rebuild_chunk(path, offset, size, generation)`; unpickled
    after its chunk was freed and reused it raises StoreClosedError, and hostile
    coordinates in a pickle are CorruptStoreError, as through `Ref.attach`."""
    ref = shmstore.put(b"a" * 1000)
    data = pickle.dumps(ref)
    assert len(data) < 256
    again = pickle.loads(data)
    assert again.get() == b"a" * 1000 and again.name == ref.name
    arena, offset, size, generation = chunk_of(ref)
    for off, sz in [(0, size), (offset + 8, size), (offset, 1 << 62), (offset, 8)]:
        with pytest.raises(shmstore.CorruptStoreError):
            _native._rebuild_chunk(str(ref.path), off, sz, generation)
    ref.close()
    again.close()
    del ref, again
    gc.collect()
    gather_a_reclaim(1)
    new = shmstore.put(b"b" * 1000)
    assert chunk_of(new)[:2] == (arena, offset)
    with pytest.raises(shmstore.StoreClosedError, match="was freed"):
        pickle.loads(data)
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=300)
    assert out.returncode == 1 and b"StoreClosedError" in out.stderr, out.stderr
    # The path must be an arena shmstore made: any other file is refused, not mapped.
    with pytest.raises((shmstore.CorruptStoreError, shmstore.StoreNotFoundError)):
        _native._rebuild_chunk(str(segment_dir() / "shmstore-no-such-arena"), 4096, 128, 1)


def test_known_size_objects_are_built_in_their_chunk() -> None:
    """An array or bytes object (its size known before encoding) is encoded straight into a
    chunk reserved for it, which then shrinks to the archive: chunks are as tight as those of
    objects encoded in memory first, objects of one shape reuse each other's chunks, and
    an object whose archive needs more room than reserved (another shape) still goes to
    the arena, whole."""
    values: list[object] = [
        np.arange(256, dtype=np.float32),
        np.full(64 << 10, 7, dtype=np.uint8),
        np.arange(300_000, dtype=np.uint8).reshape(100, 3000),
        b"z" * 100_000,  # out of line
        b"y" * 1000,  # inline
        np.zeros((1,) * 20, dtype=np.int16),  # more metadata than any before it
        np.arange(6, dtype=np.int64)[::2],  # not contiguous: copied first
        # Large payloads are copied past the cache (non-temporal stores): a source that is
        # not 16-byte aligned, lengths that are not a multiple of 64.
        np.frombuffer(bytes(range(256)) * 400, dtype=np.uint8, offset=3, count=100_003),
        np.arange(20_001, dtype=np.uint8),
    ]
    refs = [shmstore.put(v) for v in values]
    for v, r in zip(values, refs, strict=True):
        assert "@" in r.name
        size = chunk_of(r)[2]
        nbytes = v.nbytes if isinstance(v, np.ndarray) else len(v)  # type: ignore[arg-type]
        assert size < nbytes + 1024, (size, nbytes)  # shrunk: no room left reserved
        got = r.get()
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)
            assert got.ctypes.data % 64 == 0
        else:
            assert got == v
        r.verify()
    # Same-shaped arrays: a freed chunk is reused by the next one (once reclaimed).
    same = [shmstore.put(np.full(64 << 10, i, dtype=np.uint8)) for i in range(6)]
    freed = {chunk_of(same[i])[1] for i in (1, 4)}
    for i in (1, 4):
        same[i].close()
    del same[4], same[1]
    gc.collect()
    gather_a_reclaim(2)
    again = [shmstore.put(np.full(64 << 10, 9, dtype=np.uint8)) for _ in range(2)]
    assert {chunk_of(r)[1] for r in again} == freed
    assert all(int(r.get()[-1]) == 9 for r in again)


def test_a_modified_payload_of_a_chunk_is_found_by_verify() -> None:
    """The payload checksum of an array built in its chunk is right (verify() passes), and
    a byte of the payload changed afterwards in the arena file is found by verify() as
    CorruptStoreError (reads of the array do not hash it: docs/format.md, "Integrity")."""
    import os

    ref = shmstore.put(np.arange(20_000, dtype=np.uint8))
    ref.verify()
    _, offset, size, _ = chunk_of(ref)
    path = ref.path
    # The payload sits in the chunk's second half; flip one of its bytes through the file.
    at = offset + size // 2
    os.chmod(path, 0o600)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            (old,) = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old ^ 0xFF]), at)
        finally:
            os.close(fd)
    finally:
        os.chmod(path, 0o400)
    with pytest.raises(shmstore.CorruptStoreError, match=r"modified|checksum"):
        ref.verify()


def test_arrays_keep_dtype_and_shape_whatever_came_before() -> None:
    """The writer remembers the dtypes it met (typestr by dtype object) and takes the shape
    from the array's buffer export: arrays of a dtype, its byte-swapped twin and others in
    turn, 0-d, non-contiguous and subclassed arrays all come back exactly."""

    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    base = np.arange(24, dtype="<i4").reshape(2, 3, 4)
    values = (
        [
            base,
            base.astype(">i4"),
            base[:, ::2, 1:],  # not contiguous: copied to C order
            base.astype(">i4").T,
            np.array(7, dtype="<i4"),  # 0-d
            np.array(7.5, dtype=">f8"),
            np.zeros((0, 5), dtype="<f2"),
            np.eye(3, dtype="<f4")[:2].view(Sub),  # a subclass
            base,
        ]
        * 2
    )
    for v in values:
        with shmstore.put(v) as ref:
            got = ref.get()
            assert got.dtype.str == v.dtype.str and got.shape == v.shape, (v.dtype, v.shape)
            assert np.array_equal(got, v)


def test_arenas_let_go_of_while_an_object_is_encoded_into_one() -> None:
    """An array is encoded straight into a chunk reserved for it; if the process lets go of
    its arenas meanwhile (here: code the encoding runs, an ndarray subclass's `dtype`), the
    chunk is never given out and the object goes to a new arena, whole."""
    released = []

    class Releasing(np.ndarray):  # type: ignore[type-arg]
        @property
        def dtype(self) -> np.dtype:  # type: ignore[override,type-arg]
            if not released:
                released.append(_native._arena_release())
            return super().dtype

    first = shmstore.put(b"x" * 100)  # this process's first arena
    a = np.arange(1000, dtype=np.int32).view(Releasing)
    ref = shmstore.put(a)
    assert released and "@" in ref.name
    assert chunk_of(ref)[0] != chunk_of(first)[0], "a new arena"
    got = ref.get()
    assert got.dtype == np.int32 and np.array_equal(got, np.arange(1000, dtype=np.int32))
    assert first.get() == b"x" * 100


HOLDER = r"""
import sys, shmstore
names = sys.stdin.readline().split()
held = [shmstore.Ref.attach(n) for n in names]
arrays = [h.get() for h in held]
print("held", sum(int(a[0]) for a in arrays), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_chunks_another_process_held_are_reused_after_it_exits_without_a_new_arena() -> None:
    """Chunks the creator let go of while another process held them are tried again a few
    per `put` at each reclaim (and all of them before another arena is made): once the
    holder is gone, the creator's next objects go into those chunks, in the same arena."""
    size = 32 * 1024
    refs = [shmstore.put(np.full(size, i % 200, dtype=np.uint8), arena=True) for i in range(100)]
    arena = chunk_of(refs[0])[0]
    assert {chunk_of(r)[0] for r in refs} == {arena}
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            holder.stdin.write(" ".join(r.name for r in refs) + "\n")
            holder.stdin.flush()
            total = str(sum(i % 200 for i in range(100)))
            assert holder.stdout.readline().split() == ["held", total]
            offsets = {chunk_of(r)[1] for r in refs}
            for r in refs:
                r.close()
            del refs
            gc.collect()
            # Let go of by the creator, leased by the holder: not reused.
            probe = shmstore.put(np.zeros(size, dtype=np.uint8), arena=True)
            assert chunk_of(probe)[1] not in offsets
        finally:
            holder.stdin.close()
            assert holder.wait(timeout=300) == 0
    # The holder's leases died with it: its chunks come back. The first arena (4 MiB) cannot
    # hold 201 such chunks at once, so a second hundred in it means the first were reused.
    again = [shmstore.put(np.full(size, 7, dtype=np.uint8), arena=True) for _ in range(100)]
    assert {chunk_of(r)[0] for r in again} == {arena}
    assert len({chunk_of(r)[1] for r in again} & offsets) > 50
    assert all(int(r.get()[-1]) == 7 for r in again)
