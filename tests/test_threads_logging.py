"""Concurrent readers in one process, and Rust log records reaching Python logging."""

import gc
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import shmstore
from conftest import mappings_of, run_checked


def run_in_threads(n: int, body: Callable[[int], None]) -> None:
    """`body(k)` in threads k = 0..n-1, released together by a barrier; the first exception
    any of them raised is raised here once all have finished."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            start.wait()
            body(k)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_read_one_store_concurrently():
    records = [
        {"id": i, "tags": [f"t{i % 7}", i * 0.5], "nested": {"k": (i, str(i))}} for i in range(3000)
    ]
    with shmstore.SharedList(records) as lst:

        def reader(offset: int) -> None:
            it = iter(lst)  # one shared iterator across threads is also allowed
            for k in range(len(lst)):
                i = (k * 7 + offset) % len(lst)
                r = lst[i]
                assert r["id"] == i
                assert r["tags"][1] == i * 0.5
                assert r["nested"]["k"] == (i, str(i))
                next(it, None)

        run_in_threads(8, reader)


def test_threads_share_views_and_one_iterator():
    """The read slots (`view[k]`, `len`, `iter`, `next`) on objects several threads use at
    once: views made by one thread, read by all, and one iterator that all of them advance.
    A shared iterator may yield an item twice (its position is not locked), never skips one
    and never yields anything that is not there: every thread's items are the list's, and
    together they are all of it."""
    n = 2000
    records = [{"id": i, "vals": [i, -i, str(i)], "sub": {"x": i * 2}} for i in range(n)]
    with shmstore.SharedList(records) as lst:
        views = [lst[i] for i in range(0, n, 10)]
        shared = iter(lst)
        seen: list[list[int]] = [[] for _ in range(6)]

        def reader(t: int) -> None:
            for _ in range(3):
                for v in views:
                    i = v["id"]
                    assert len(v) == 3 and len(v["vals"]) == 3
                    assert list(v["vals"]) == [i, -i, str(i)]
                    assert v["sub"]["x"] == i * 2 and list(v["sub"]) == ["x"]
            for rec in shared:
                assert rec["vals"][2] == str(rec["id"])
                seen[t].append(rec["id"])

        run_in_threads(6, reader)
        assert sorted(set().union(*map(set, seen))) == list(range(n))
        assert next(shared, None) is None


def test_views_dropped_by_other_threads_and_by_threads_that_end_are_made_afresh():
    """Views are recycled (on a free-threaded interpreter, by each thread in lists of its
    own, which outlive the thread for threads that start later). Views made in one thread
    and dropped in another, by threads that then end, in rounds of new threads: every view
    read afterwards is a fresh object (its own values, one reference, no weak reference of
    a former life)."""
    n = 300
    records = [{"id": i, "vals": [i, str(i)], "sub": {"x": i}} for i in range(n)]
    with shmstore.SharedList(records) as lst:

        def one_round(round_: int) -> None:
            handed: list[list[object]] = [[] for _ in range(4)]
            made = threading.Barrier(4)

            def body(t: int) -> None:
                # Made here, dropped by the next thread (after the barrier).
                handed[(t + 1) % 4].extend(lst[i]["vals"] for i in range(t, n, 4))
                made.wait()
                handed[t].clear()
                for i in range((t + round_) % 7, n, 7):
                    rec = lst[i]
                    vals, sub = rec["vals"], rec["sub"]
                    assert (rec["id"], list(vals), sub["x"]) == (i, [i, str(i)], i)
                    fresh: list[int] = []  # a new object, held as `vals` is
                    assert sys.getrefcount(vals) == sys.getrefcount(fresh)
                    if i % 3 == 0:
                        ref = weakref.ref(sub)
                        del sub
                        assert ref() is None

            run_in_threads(4, body)

        for round_ in range(6):  # new threads each round
            one_round(round_)
        assert [lst[i]["vals"][1] for i in range(n)] == [str(i) for i in range(n)]


def test_close_while_other_threads_hold_views():
    lst = shmstore.SharedList([{"x": list(range(50))}] * 200)
    views = [lst[i] for i in range(200)]
    done = threading.Event()

    def reader() -> None:
        for v in views:
            assert v["x"][49] == 49
        done.set()

    t = threading.Thread(target=reader)
    lst.close()  # drops only the handle's reference: the views keep the mapping alive
    t.start()
    t.join()
    assert done.is_set()


def test_threads_reading_through_a_handle_that_another_thread_closes():
    """Readers in several threads go through one handle (on a free-threaded interpreter each
    gets a store reference of its own, kept by the handle) while the main thread closes it:
    every read before the close is right, every one after it raises StoreClosedError, the
    views each thread kept still read after the close, and once they are gone the store is
    unmapped (the handle let go of every thread's reference)."""
    n = 2000
    records = [{"id": i, "xs": [i, i + 1]} for i in range(n)]
    lst = shmstore.SharedList(records)
    st = os.stat(os.path.join(os.environ["SHMSTORE_DIR"], lst.name))
    start = threading.Barrier(5)
    first_round = [threading.Event() for _ in range(4)]
    errors: list[BaseException] = []
    kept: list[list[object]] = [[] for _ in range(4)]
    closed_seen = [False] * 4

    def reader(k: int) -> None:
        try:
            start.wait()
            for rnd in range(10_000):  # bounded: the close ends it far sooner
                for i in range(k, n, 4):
                    try:
                        v = lst[i]
                    except shmstore.StoreClosedError:
                        closed_seen[k] = True
                        return
                    assert v["id"] == i and v["xs"][1] == i + 1
                    if rnd == 0 and i % 101 == k:
                        kept[k].append(v)
                first_round[k].set()
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            first_round[k].set()

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    start.wait()
    for e in first_round:
        assert e.wait(300)
    lst.close()
    for t in threads:
        t.join(300)
    assert errors == []
    assert all(closed_seen)
    for k, views in enumerate(kept):
        assert views, k
        for v in views:
            assert v["xs"][1] == v["id"] + 1
    assert mappings_of(st)  # the kept views hold the mapping
    del views, v
    kept.clear()
    gc.collect()
    assert not mappings_of(st)


def test_rounds_of_new_threads_through_one_handle_then_many_through_handles_that_close():
    """On a free-threaded interpreter a handle keeps each reading thread's store reference
    in a table by seat, read without a lock; it grows as threads with higher seats come,
    a thread that starts later takes an ended one's seat, and a close gives every
    reference back once no reader is in the middle of taking one. Rounds of new threads
    read through one handle (seats reused, the table grown while others read); then
    rounds of a dozen threads read through a fresh handle that the main thread closes
    while they read. Every read is right, every read after a close raises, and each
    store is unmapped once its views are gone: no reference was kept or given back
    twice."""
    n = 600
    records = [{"id": i, "xs": [i, -i]} for i in range(n)]
    lst = shmstore.SharedList(records)
    st = os.stat(os.path.join(os.environ["SHMSTORE_DIR"], lst.name))
    for round_ in range(5):  # new threads each round, as many as the round's number + 3

        def body(k: int) -> None:
            for i in range(k, n, 3):
                v = lst[i]
                assert v["id"] == i and v["xs"][1] == -i

        run_in_threads(round_ + 3, body)
    lst.close()
    gc.collect()
    assert not mappings_of(st)

    for _ in range(4):
        close_while_reading(records, threads=12)


def close_while_reading(records: list[dict[str, object]], threads: int) -> None:
    """`threads` threads read through a fresh handle until the main thread, once each has
    read once, closes it: see the test above."""
    n = len(records)
    lst = shmstore.SharedList(records)
    st = os.stat(os.path.join(os.environ["SHMSTORE_DIR"], lst.name))
    read_once = threading.Barrier(threads + 1)
    closed_seen = [False] * threads
    kept: list[object] = []
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            kept.append(lst[k])
            read_once.wait()
            deadline = time.monotonic() + 300  # the close ends it far sooner
            for rnd in itertools.count():
                if rnd % 1000 == 0 and time.monotonic() > deadline:
                    return
                i = (k + rnd * 7) % n
                try:
                    v = lst[i]
                except shmstore.StoreClosedError:
                    closed_seen[k] = True
                    return
                assert v["id"] == i and v["xs"][0] == i
        except BaseException as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    read_once.wait(300)
    lst.close()
    for t in ts:
        t.join(300)
    assert errors == []
    assert all(closed_seen)
    assert sorted(v["id"] for v in kept) == list(range(threads))  # type: ignore[index]
    assert mappings_of(st)  # the kept views hold the mapping
    kept.clear()
    gc.collect()
    assert not mappings_of(st)


def test_more_threads_at_once_than_seats_all_read_right(caplog):
    """More threads with views alive at once than there are seats (256): on a free-threaded
    interpreter the threads beyond them read through the handle's own reference (slower,
    never wrong), which is logged once; with the GIL no thread needs a seat."""
    threads = 300
    records = [{"id": i, "xs": [i, str(i)]} for i in range(threads)]
    with caplog.at_level(logging.WARNING, logger="shmstore"):
        with shmstore.SharedList(records) as lst:
            all_alive = threading.Barrier(threads)

            def body(k: int) -> None:
                v = lst[k]  # every thread has made a view (and holds its lists) ...
                all_alive.wait()  # ... before any reads on
                assert v["id"] == k and v["xs"][1] == str(k)
                for i in range(k, k + 50):
                    assert lst[i % threads]["xs"][0] == i % threads

            run_in_threads(threads, body)
    said = [
        r.getMessage() for r in caplog.records if "threads made views at once" in r.getMessage()
    ]
    free_threaded = not getattr(sys, "_is_gil_enabled", lambda: True)()
    if free_threaded:
        # Said once per process: at most once here (no other test has this many threads
        # at once, but a repeated run in one process finds it said already).
        assert len(said) <= 1, said
    else:
        assert said == []


def test_rust_logs_reach_python_logging(caplog):
    with caplog.at_level(logging.DEBUG, logger="shmstore"):
        with shmstore.SharedList([1, 2, 3]) as lst:
            name = lst.name
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("shmstore")]
    assert any(name in m and "created" in m for m in messages), messages


def test_rust_logs_use_public_logger_names_one_line_per_event(caplog):
    """Records from the Rust core go to loggers named by what they are about
    (``shmstore.store``), not by Rust module paths (``shmstore.py.store``); an unlink logs
    once even when ``with`` unlinks again after an explicit ``unlink()``."""
    with caplog.at_level(logging.DEBUG, logger="shmstore"):
        with shmstore.SharedList([1, 2, 3]) as lst:
            name = lst.name
            lst.unlink()
    mine = [r for r in caplog.records if name in r.getMessage()]
    assert {r.name for r in mine} == {"shmstore.store"}, [(r.name, r.getMessage()) for r in mine]
    unlinked = [r for r in mine if r.getMessage().startswith("unlinked")]
    assert len(unlinked) == 1, [r.getMessage() for r in mine]


LATE_LOGGING = r"""
import sys
before = "logging" in sys.modules  # a site hook may have imported it
import shmstore
lst = shmstore.SharedList([1, 2])
lst.unlink()
print("logging imported by shmstore:", "logging" in sys.modules and not before)
import logging
logging.basicConfig(
    level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s"
)
lst = shmstore.SharedList([1, 2])
print("made", lst.name)
lst.unlink()
"""


def test_logging_is_imported_by_the_first_record_that_needs_it():
    """``import shmstore`` and DEBUG records leave ``logging`` unimported (no level or
    handler can be set without it, so they would be dropped anyway); a program that sets
    logging up later gets the records from then on; a WARNING is shown unconfigured, as
    Python's logging shows one (the supervisor unavailable: its state directory cannot be
    made)."""
    out = run_checked([sys.executable, "-c", LATE_LOGGING]).stdout.splitlines()
    assert out[0] == "logging imported by shmstore: False", out
    name = next(line.split()[1] for line in out if line.startswith("made "))
    assert f"shmstore.store DEBUG created {name}" in [" ".join(x.split()[:4]) for x in out], out

    env = {**os.environ, "XDG_RUNTIME_DIR": "/proc/self/no-such-directory"}
    warned = run_checked(
        [sys.executable, "-c", "import shmstore; shmstore.SharedList([1]).unlink()"], env=env
    ).stderr
    assert "shmstore runs without its supervisor" in warned, warned
