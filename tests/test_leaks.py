"""shmstore.leaks: real cycles, found without collecting them, with paths and retained bytes."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import mmap
import os
import random
import sys
import threading
import tracemalloc
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest
from conftest import run_checked
from shmstore import leaks
from shmstore.leaks import _detect, _graph
from shmstore.leaks._guard import rss_bytes

np = pytest.importorskip("numpy")

MiB = 1 << 20


@pytest.fixture
def no_auto_gc() -> Any:
    """Automatic gc off around a test that checks what did *not* happen after a block."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()
    gc.collect()


class Circular:
    """The classic leak: an object that references itself and pins its data."""

    def __init__(self, data: Any) -> None:
        self.circular = self
        self.data = data


class QuantileDMatrix:
    """xgboost 2.x's cycle: a bound method of the object stored on the object."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self._handle_ref = self.reset

    def reset(self) -> None:
        pass


# -- well-known cycles ---------------------------------------------------------------------


def test_circular_pinning_a_numpy_array_reports_path_and_bytes() -> None:
    with leaks.detect() as report:
        Circular(np.ones(1 * MiB // 8))
    assert report.complete and report.skipped is None
    assert len(report.cycles) == 1
    cycle = report.cycles[0]
    assert cycle.path == "Circular.__dict__['circular'] -> Circular"
    assert cycle.types == {f"{__name__}.Circular": 1}
    assert cycle.buffer_bytes == 1 * MiB
    assert cycle.retained_bytes >= 1 * MiB
    assert cycle.retained_types["numpy.ndarray"] == 1
    assert report.retained_bytes >= cycle.retained_bytes


def test_quantiledmatrix_method_cycle_path_is_named() -> None:
    with leaks.detect() as report:
        QuantileDMatrix(np.zeros(10))
    assert [c.path for c in report.cycles] == [
        "QuantileDMatrix.__dict__['_handle_ref'] -> method -> QuantileDMatrix"
    ]


def _make_closure_cycle() -> None:
    def inner() -> Any:
        return inner  # inner's closure cell points at inner itself

    assert inner() is inner


def test_closure_cycle() -> None:
    with leaks.detect() as report:
        _make_closure_cycle()
    (cycle,) = report.cycles
    assert cycle.path == (
        "function _make_closure_cycle.<locals>.inner.__closure__[0] "
        "-> function _make_closure_cycle.<locals>.inner"
    )
    assert set(cycle.types) == {"function", "cell", "tuple"}


def _generator() -> Any:
    me = yield
    yield me


def test_generator_frame_cycle() -> None:
    with leaks.detect() as report:
        g = _generator()
        next(g)
        g.send(g)  # the suspended frame's local `me` is the generator itself
        del g
    (cycle,) = report.cycles
    assert cycle.path == "generator _generator.gi_frame.f_locals['me'] -> generator _generator"


def _raise_and_keep() -> None:
    try:
        raise ValueError("boom")
    except ValueError as e:
        err = e  # exception -> traceback -> this frame -> err: the classic cycle
        assert err is not None


def test_exception_traceback_cycle() -> None:
    with leaks.detect() as report:
        _raise_and_keep()
    (cycle,) = report.cycles
    assert cycle.path == (
        "ValueError.__traceback__ -> traceback.tb_frame -> frame _raise_and_keep"
        ".f_locals['err'] -> ValueError"
    )


class WithDel:
    deleted: list[str] = []  # noqa: RUF012 - test-only record

    def __init__(self) -> None:
        self.me = self
        self.payload = bytearray(2 * MiB)

    def __del__(self) -> None:
        WithDel.deleted.append("del")
        self.__dict__.pop("payload", None)


@pytest.mark.usefixtures("no_auto_gc")
def test_del_does_not_run_during_analysis_and_runs_once_after() -> None:
    WithDel.deleted.clear()
    with leaks.detect(collect=False) as report:
        WithDel()
    assert WithDel.deleted == []  # the analysis ran no finalizer
    (cycle,) = report.cycles
    assert cycle.path == "WithDel.__dict__['me'] -> WithDel"
    assert cycle.buffer_bytes >= 2 * MiB  # seen before __del__ dropped the payload
    gc.collect()
    assert WithDel.deleted == ["del"]


def test_default_frees_the_garbage_after_the_report() -> None:
    WithDel.deleted.clear()
    was = gc.isenabled()
    gc.enable()
    try:
        with leaks.detect() as report:
            WithDel()
        assert WithDel.deleted == ["del"]  # freed normally, after the analysis
        assert report.cycles[0].buffer_bytes >= 2 * MiB
    finally:
        if not was:
            gc.disable()


class Target:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.usefixtures("no_auto_gc")
def test_weakref_callback_does_not_fire_and_nothing_is_resurrected() -> None:
    fired: list[int] = []
    with leaks.detect(collect=False) as report:
        t = Target()
        ref = weakref.ref(t, lambda _: fired.append(1))
        del t
    assert fired == []
    assert ref() is not None  # still there: not collected, not resurrected into anything
    assert len(report.cycles) == 1
    gc.collect()
    assert fired == [1] and ref() is None


@pytest.mark.usefixtures("no_auto_gc")
def test_keep_holds_the_objects_until_release() -> None:
    fired: list[int] = []
    with leaks.detect(keep=True) as report:
        t = Target()
        ref = weakref.ref(t, lambda _: fired.append(1))
        del t
    (cycle,) = report.cycles
    assert cycle.objects and cycle.objects[0] is ref()
    del cycle
    gc.collect()
    assert fired == [] and ref() is not None
    report.release()
    assert report.cycles[0].objects == ()
    gc.collect()
    assert fired == [1]


# -- the program is not changed --------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_in_block_and_state_restored(enabled: bool) -> None:
    was = gc.isenabled()
    flags = gc.get_debug()
    thresholds = gc.get_threshold()
    garbage_before = list(gc.garbage)
    (gc.enable if enabled else gc.disable)()
    try:
        with leaks.detect():
            assert not gc.isenabled()
            Circular(None)
        assert gc.isenabled() is enabled
        assert gc.get_debug() == flags
        assert gc.get_threshold() == thresholds
        assert gc.garbage == garbage_before
    finally:
        (gc.enable if was else gc.disable)()
        gc.collect()


def test_live_objects_are_not_reported() -> None:
    with leaks.detect() as report:
        alive = Circular(np.zeros(3))  # a cycle, but still referenced by a local
        chain = [[{"k": [1, 2]}] for _ in range(100)]
    assert report.cycles == []
    assert report.analysed_objects >= 300
    assert alive.circular is alive and len(chain) == 100


def test_garbage_referencing_live_objects_does_not_claim_them() -> None:
    shared = np.ones(MiB // 8)
    with leaks.detect() as report:
        Circular(shared)  # the cycle points at an array someone else also holds
        Circular(shared[10:])  # a view: its base is alive elsewhere
    assert len(report.cycles) == 2
    assert all(c.buffer_bytes == 0 for c in report.cycles)
    assert report.retained_bytes < 100_000


def test_buffers_counted_once_through_views_and_bases() -> None:
    with leaks.detect() as report:
        base = np.ones(MiB // 8)
        holder = Circular([base[1:], base[::2], base.reshape(2, -1)])
        del base, holder
    (cycle,) = report.cycles
    assert cycle.buffer_bytes == MiB  # three views, one buffer
    assert cycle.retained_types["numpy.ndarray"] == 4


def test_bytes_bytearray_memoryview_mmap_are_counted() -> None:
    with leaks.detect() as report:
        blob = b"x" * MiB
        m = mmap.mmap(-1, 2 * MiB)
        Circular([blob, bytearray(MiB), memoryview(bytearray(MiB)), m])
        del blob, m
    (cycle,) = report.cycles
    assert cycle.buffer_bytes >= 5 * MiB
    assert {"bytes", "bytearray", "memoryview", "mmap.mmap"} <= set(cycle.retained_types)


def test_cycles_sorted_by_retained_bytes_and_str_and_json() -> None:
    with leaks.detect() as report:
        Circular(np.zeros(1000))
        Circular(np.zeros(100_000))
        Circular(np.zeros(10))
    sizes = [c.retained_bytes for c in report.cycles]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 3
    text = str(report)
    assert "3 reference cycle(s)" in text and "Circular.__dict__['circular']" in text
    # one shape: grouped, with the largest as the example
    assert "#1 3 cycles of this shape" in text
    assert f"the largest: {leaks._report.format_bytes(sizes[0])} retained" in text
    verbose = report.format(verbose=True)
    assert f"#1 {leaks._report.format_bytes(sizes[0])} retained" in verbose
    assert "#3 " in verbose
    data = json.loads(json.dumps(report.to_dict()))
    assert data["cycles"][0]["buffer_bytes"] == 800_000


class Node:
    def __init__(self) -> None:
        self.other = Pair(self)


class Pair:
    def __init__(self, node: Node) -> None:
        self.node = node


def test_identical_cycles_are_grouped_by_shape_with_counts_and_bytes() -> None:
    with leaks.detect() as report:
        for _ in range(5000):
            a: list[Any] = []
            a.append(a)
        for _ in range(3):
            Circular(np.zeros(100_000))  # 2.4 MB in all: more than the 5000 lists
        Node()
        del a
    assert len(report.cycles) == 5004
    groups = report.groups()
    assert [g.count for g in groups] == [3, 5000, 1]  # most bytes first
    assert sum(g.retained_bytes for g in groups) == sum(c.retained_bytes for c in report.cycles)
    assert groups[1].example.path == "list[0] -> list"
    text = str(report)
    assert len(text.splitlines()) <= 15, text
    assert "5000 cycles of this shape" in text and "3 shape(s)" in text
    assert len(report.format(verbose=True).splitlines()) > 5004
    top1 = report.format(top=1)
    assert "... and 2 more shape(s): 5001 cycle(s)" in top1
    assert "--shmstore-leaks-verbose" in top1


def test_allowlist_by_type_and_by_module() -> None:
    with leaks.detect(allow=[Circular]) as by_type:
        Circular(None)
        QuantileDMatrix(None)
    assert by_type.allowed_cycles == 1 and len(by_type.cycles) == 1
    with leaks.detect(allow=[__name__]) as by_module:
        Circular(None)
        QuantileDMatrix(None)
    assert by_module.allowed_cycles == 2 and by_module.cycles == []


def test_min_bytes() -> None:
    with leaks.detect(min_bytes=MiB) as report:
        Circular(np.zeros(10))
        Circular(np.zeros(MiB))
    assert len(report.cycles) == 1 and report.cycles[0].buffer_bytes == 8 * MiB


def test_nested_blocks() -> None:
    with leaks.detect() as outer:
        Circular(None)
        with leaks.detect() as inner:
            QuantileDMatrix(None)
        assert not gc.isenabled()
    assert [c.size for c in inner.cycles] == [2]
    assert len(outer.cycles) == 2  # the inner block did not free what the outer must see


def test_scope_heap_finds_garbage_made_before_the_block() -> None:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        Circular(np.zeros(7))
        with leaks.detect(scope="heap") as report:
            pass
        assert any(c.buffer_bytes == 56 for c in report.cycles)
    finally:
        if was:
            gc.enable()
        gc.collect()


def test_decorator_and_raise_on_leak() -> None:
    @leaks.detect()
    def clean() -> int:
        return 1

    @leaks.detect(raise_on_leak=True)
    def leaky() -> None:
        Circular(np.zeros(5))

    assert clean() == 1 and clean.leak_report.cycles == []  # type: ignore[attr-defined]
    with pytest.raises(leaks.LeakError) as info:
        leaky()
    assert "Circular.__dict__['circular'] -> Circular" in str(info.value)
    assert info.value.report.cycles[0].buffer_bytes == 40


def test_decorated_function_raising_keeps_its_exception() -> None:
    @leaks.detect(raise_on_leak=True)
    def fails() -> None:
        Circular(None)
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        fails()
    assert len(fails.leak_report.cycles) == 1  # type: ignore[attr-defined]


def test_exception_in_block_propagates_and_report_is_filled() -> None:
    with pytest.raises(KeyError):
        with leaks.detect(raise_on_leak=True) as report:
            Circular(None)
            raise KeyError("x")
    assert report.complete and len(report.cycles) == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="scope"):
        leaks.detect(scope="everything")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads"):
        leaks.detect(threads="mine")  # type: ignore[arg-type]


# -- threads --------------------------------------------------------------------------------


@contextlib.contextmanager
def _traced_before_threads() -> Iterator[None]:
    """What docs/free-threading.md tells users of ``threads="current"`` on a free-threaded
    interpreter: tracemalloc started before the threads are, stopped after they end."""
    start = _detect._free_threaded() and not tracemalloc.is_tracing()
    if start:
        tracemalloc.start(128)
    try:
        yield
    finally:
        if start:
            tracemalloc.stop()


def _cycle_in_thread(go: threading.Event, done: threading.Event) -> None:
    assert go.wait(300)
    Circular(np.zeros(1000))
    done.set()


@pytest.mark.parametrize("threads", ["all", "current"])
def test_other_threads_garbage_attributed_or_excluded(threads: str) -> None:
    go, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=_cycle_in_thread, args=(go, done))
    with _traced_before_threads():
        worker.start()
        try:
            with leaks.detect(threads=threads, trace=128) as report:  # type: ignore[arg-type]
                go.set()
                assert done.wait(300)
                QuantileDMatrix(None)
        finally:
            worker.join(300)
    mine = [c for c in report.cycles if "QuantileDMatrix" in c.path]
    assert len(mine) == 1 and mine[0].thread == "current"
    assert mine[0].allocated_at is not None and __file__ in mine[0].allocated_at
    theirs = [c for c in report.cycles if "Circular" in c.path]
    if threads == "all":
        assert len(theirs) == 1 and theirs[0].thread == "other"
        assert report.other_thread_cycles == 0
    else:
        assert theirs == [] and report.other_thread_cycles == 1


@pytest.mark.skipif(
    sys.version_info >= (3, 14),
    reason="CPython 3.14+: the analysis runs beside other threads there (checked by the next test)",
)
def test_freethreaded_without_stop_the_world_skips_with_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, args=(30,))
    worker.start()
    try:
        with leaks.detect() as report:
            Circular(None)
    finally:
        stop.set()
        worker.join(300)
    assert report.skipped is not None and "free-threaded" in report.skipped
    assert report.cycles == [] and "skipped" in str(report)
    gc.collect()


def test_cycles_are_found_while_other_threads_make_and_free_objects() -> None:
    """Other threads allocating and freeing the whole time (on a free-threaded interpreter
    in parallel with the analysis, changing refcounts under it): the block's own cycles are
    each found, none of the other threads' objects is reported (alive, or let go while the
    analysis held them), nothing is skipped."""
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            junk = [[i] for i in range(200)]
            del junk

    workers = [threading.Thread(target=churn) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        # threads="all": the other threads' objects must stay out for what they are (alive,
        # or freed by refcounting), not by attribution.
        with leaks.detect() as report:
            for _ in range(200):
                a: list[Any] = []
                a.append(a)
            Node()
            del a
    finally:
        stop.set()
        for w in workers:
            w.join(300)
    assert report.skipped is None
    # (the Node-Pair cycle's path may start at either of the two)
    assert Counter(tuple(sorted(c.types)) for c in report.cycles) == {
        ("list",): 200,
        ("test_leaks.Node", "test_leaks.Pair"): 1,
    }
    assert {c.path for c in report.cycles if "list" in c.types} == {"list[0] -> list"}
    gc.collect()


def test_tracemalloc_is_neither_started_nor_stopped_where_that_is_unsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where toggling tracemalloc could crash the interpreter (a free-threaded one with
    other threads running), a block does not start it: it warns, says so in the report and
    keeps every cycle; a block that started it and cannot stop it leaves it on, and a later
    block's exit stops it once that is safe."""
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is already tracing (PYTHONTRACEMALLOC?): nothing to start")
    unsafe = [True]
    monkeypatch.setattr(_detect, "_toggle_unsafe", lambda: unsafe[0])
    try:
        with pytest.warns(RuntimeWarning, match=r"start it before the threads do"):
            with leaks.detect(threads="current") as report:
                assert not tracemalloc.is_tracing()
                Node()
        assert report.unattributed is not None and "PYTHONTRACEMALLOC=128" in report.unattributed
        assert [(c.thread, c.allocated_at) for c in report.cycles] == [(None, None)]
        assert "not attributed to threads" in str(report)
        assert report.to_dict()["unattributed"] == report.unattributed

        unsafe[0] = False
        with leaks.detect(threads="current") as report:
            assert tracemalloc.is_tracing()
            QuantileDMatrix(None)
            unsafe[0] = True  # e.g. a thread started in the block, still running at exit
        assert tracemalloc.is_tracing()  # left on
        assert report.unattributed is None and [c.thread for c in report.cycles] == ["current"]
        with leaks.detect():  # its exit is not safe either
            pass
        assert tracemalloc.is_tracing()
        unsafe[0] = False
        with leaks.detect():
            pass
        assert not tracemalloc.is_tracing()  # stopped by the first exit where it is safe
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        monkeypatch.setattr(_detect, "_ours", False)
    gc.collect()


THREAD_FROM_THREAD_MODULE = """
import _thread, threading
from shmstore.leaks import _detect
assert not _detect._other_threads(), threading.enumerate()
started, release = _thread.allocate_lock(), _thread.allocate_lock()
started.acquire()
release.acquire()

def run():
    started.release()
    release.acquire()

_thread.start_new_thread(run, ())
assert started.acquire(timeout=300)
try:
    assert threading.active_count() == 1 and _detect._other_threads()
finally:
    release.release()
print("ok")
"""


def test_threads_the_threading_module_does_not_know_count_as_other_threads() -> None:
    """What decides the Python engine's second analysis and whether tracemalloc may be
    toggled sees a thread started with ``_thread`` too (as a C thread calling Python). In a
    process of its own: earlier tests may have left threads in this one."""
    proc = run_checked([sys.executable, "-c", THREAD_FROM_THREAD_MODULE])
    assert proc.stdout.strip() == "ok"


def test_objects_another_thread_lets_go_during_the_analysis_are_not_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The analysis holds every new object from its snapshot on. An object whose last owner
    (another thread) drops it after the snapshot is then held by the analysis alone and is
    unreachable, but no cycle holds it: refcounting frees it. Such objects, and what only
    they hold, are neither reported nor counted; a cycle they held is reported."""
    holder: list[Any] = []  # made before the block: the other thread's object
    real = _graph.find_unreachable

    def drop_then_analyse(cand: list[Any], **kw: Any) -> list[int]:
        holder.clear()  # "another thread": after the snapshot, before the refcounts
        return real(cand, **kw)

    monkeypatch.setattr(_detect, "find_unreachable", drop_then_analyse)
    with leaks.detect() as report:
        holder.extend([i] for i in range(50))  # lists of its own
        holder.append({"big": bytearray(1 << 20)})
        cyc: list[Any] = []
        cyc.append(cyc)
        holder.append([cyc])  # a cycle only a let-go object holds
        del cyc
        for _ in range(3):
            a: list[Any] = []
            a.append(a)
        del a
    assert Counter(tuple(sorted(c.types)) for c in report.cycles) == {("list",): 4}
    assert {c.path for c in report.cycles} == {"list[0] -> list"}
    assert report.retained_bytes < 1 << 20  # the let-go bytearray is not counted
    assert report.garbage_objects == 4  # the cycles' lists only
    gc.collect()


# -- the graph core: Python and native agree -------------------------------------------------


def _random_heap(seed: int, n: int) -> tuple[list[Any], list[Any]]:
    rnd = random.Random(seed)
    nodes: list[list[Any]] = [[] for _ in range(n)]
    for node in nodes:
        for _ in range(rnd.randrange(3)):
            node.append(nodes[rnd.randrange(n)])
    roots = [nodes[i] for i in rnd.sample(range(n), n // 10)]
    return nodes, roots


@pytest.mark.parametrize("seed", range(5))
def test_find_unreachable_matches_reachability(seed: int) -> None:
    gc.disable()
    try:
        nodes, roots = _random_heap(seed, 400)
        expected_alive = set()
        stack = list(roots)
        while stack:
            v = stack.pop()
            if id(v) not in expected_alive:
                expected_alive.add(id(v))
                stack.extend(v)
        ids = [id(x) for x in nodes]
        got = {ids[i] for i in _graph.find_unreachable(nodes, use_native=False)}
        assert got == set(ids) - expected_alive
        if _graph.native_available():
            native = {ids[i] for i in _graph.find_unreachable(nodes, use_native=True)}
            assert native == got
    finally:
        del nodes, roots
        gc.enable()
        gc.collect()


def test_strongly_connected_components() -> None:
    comp, n = _graph.strongly_connected([[1], [2], [0, 3], [], [4]])
    assert n == 3
    assert comp[0] == comp[1] == comp[2] != comp[3] != comp[4]


# -- gc_guard and watch ------------------------------------------------------------------------


_LEAKED: weakref.WeakSet[Circular] = weakref.WeakSet()  # the cycles of _leaky_task not freed yet


def _leaky_task(i: int) -> int:
    # 40 MiB: above glibc's largest mmap threshold (32 MiB), so the block is always its own
    # mapping, counted in the RSS while it lives and given back to the OS when freed.
    _LEAKED.add(Circular(np.ones(40 * MiB // 8)))
    return i


@pytest.mark.skipif(rss_bytes() is None, reason="needs /proc/self/statm")
def test_gc_guard_frees_cycles_a_thread_pool_never_collects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thread pool's tasks each leave a 40 MiB cycle; with the automatic gc off (a pool
    whose tasks allocate too few objects to trigger it) nothing frees them. Under the guard
    every task's RSS growth (40 MiB >= min_growth) triggers a collection right after it.

    One worker thread, so which collection frees which cycle does not depend on how the
    threads interleave; the time budget is made unlimited (``burst``) because the budget is
    a separate rule, tested with a fake clock below."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        with ThreadPoolExecutor(1) as pool:
            assert list(pool.map(_leaky_task, range(4))) == [0, 1, 2, 3]
        assert len(_LEAKED) == 4  # without the guard: every cycle (and its 40 MiB) is kept
        gc.collect()
        assert len(_LEAKED) == 0
        guard = leaks.GcGuard(min_growth=16 * MiB, max_gc_fraction=1.0, burst=float("inf"))
        with caplog.at_level(logging.INFO, logger="shmstore.leaks"), ThreadPoolExecutor(1) as pool:
            results = list(pool.map(leaks.gc_guard(_leaky_task, guard=guard), range(8)))
            left = len(_LEAKED)
    finally:
        if was:
            gc.enable()
        gc.collect()
    assert results == list(range(8))
    assert left == 0  # every cycle was collected after its task
    assert guard.stats.tasks == 8 and guard.stats.collections == 8
    assert guard.stats.skipped_for_budget == 0
    assert guard.stats.collected_objects >= 8
    assert guard.stats.freed_bytes >= 8 * 32 * MiB  # the arrays went back to the OS
    freed = [r.getMessage() for r in caplog.records if "gc_guard" in r.getMessage()]
    assert len(freed) == 8 and all("freed" in m for m in freed)


def test_gc_guard_freed_bytes_counts_what_was_freed_not_the_rss_drop() -> None:
    """Cycles holding 625 KiB arrays: glibc keeps freed blocks of that size for reuse, so RSS
    hardly drops, but the collection did free them, and freed_bytes says so."""
    if leaks._guard.heap_bytes() is None:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        guard = leaks.GcGuard(min_growth=0, max_gc_fraction=1.0, burst=float("inf"))
        for _ in range(3):
            for _ in range(16):
                Circular(np.ones(625 * 1024 // 8))  # 625 KiB each, 10 MB per round
            assert guard.after_task()
    finally:
        if was:
            gc.enable()
    assert guard.stats.collections == 3
    assert guard.stats.freed_bytes >= 3 * 16 * 625 * 1024 * 0.9, guard.stats


def test_gc_guard_respects_its_time_budget() -> None:
    now = [100.0]
    guard = leaks.GcGuard(min_growth=0, max_gc_fraction=0.01, burst=0, clock=lambda: now[0])
    assert guard.after_task() is True  # nothing spent yet
    assert guard.after_task() is False  # no time has passed: the budget forbids another
    assert guard.stats.skipped_for_budget == 1
    now[0] += 1e6
    assert guard.after_task() is True
    with pytest.raises(ValueError, match="max_gc_fraction"):
        leaks.GcGuard(max_gc_fraction=0)


def _private_rss() -> int:
    """This process's resident memory that is not shared (statm: resident - shared): what the
    leaked arrays occupy, unmoved by mappings of files and segments (stores of earlier tests
    whose last reference goes meanwhile) that the total RSS also counts."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def _peak_growth(task: Any, n: int) -> int:
    """Run ``task`` ``n`` times in this thread; the largest growth of the private RSS seen
    after a task."""
    base = _private_rss()
    peak = base
    for i in range(n):
        task(i)
        peak = max(peak, _private_rss())
    return peak - base


@pytest.mark.skipif(rss_bytes() is None, reason="needs /proc/self/statm")
def test_gc_guard_memory_ceiling_wins_over_the_time_budget() -> None:
    """Tasks that leak 40 MiB each through cycles, with a time budget that is spent after the
    first collection (the guard's clock never advances): the budget alone lets the garbage
    pile up; ``max_growth`` keeps it under the ceiling plus one task's allocation."""
    frozen = 0.0
    gc.collect()
    was = gc.isenabled()
    gc.disable()  # the guard is the only collector, as in a pool of threads
    try:
        budget_only = leaks.GcGuard(
            min_growth=40 * MiB, max_growth=None, burst=0, clock=lambda: frozen
        )
        grown_budget_only = _peak_growth(budget_only.wrap(_leaky_task), 10)
        gc.collect()
        ceiling = leaks.GcGuard(
            min_growth=40 * MiB, max_growth=100 * MiB, burst=0, clock=lambda: frozen
        )
        grown_with_ceiling = _peak_growth(ceiling.wrap(_leaky_task), 10)
    finally:
        if was:
            gc.enable()
        gc.collect()
    assert budget_only.stats.collections == 1 and budget_only.stats.over_ceiling == 0
    assert grown_budget_only >= 300 * MiB  # everything after the first collection stays
    assert ceiling.stats.over_ceiling >= 2
    assert grown_with_ceiling < 100 * MiB + 2 * 40 * MiB, grown_with_ceiling
    with pytest.raises(ValueError, match="max_growth"):
        leaks.GcGuard(min_growth=2 * MiB, max_growth=MiB)


def test_gc_guard_as_decorator_and_context_manager() -> None:
    guard = leaks.GcGuard(min_growth=1 << 40)

    @leaks.gc_guard(guard=guard)
    def task(x: int) -> int:
        return x * 2

    assert task(4) == 8
    with guard:
        pass
    assert guard.stats.tasks == 2 and guard.stats.collections == 0


@pytest.mark.skipif(rss_bytes() is None, reason="needs /proc/self/statm")
def test_watch_logs_collections_that_free_a_lot(caplog: pytest.LogCaptureFixture) -> None:
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="shmstore.leaks"):
        with leaks.watch(threshold=16 * MiB) as w:
            Circular(np.ones(48 * MiB // 8))
            gc.collect()
            gc.collect(0)  # frees nothing big: not logged
    assert w.collections >= 2
    assert len(w.events) == 1 and w.events[0].freed_bytes >= 16 * MiB
    assert w.events[0].collected >= 1
    assert gc.callbacks.count(w._callback) == 0  # removed on exit
    assert any("freed" in r.getMessage() for r in caplog.records)
