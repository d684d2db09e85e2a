"""``detect()``: run a block with automatic gc paused, then report the cycles it left behind."""

from __future__ import annotations

import functools
import gc
import operator
import sys
import threading
import time
import tracemalloc
import warnings
from itertools import compress
from types import TracebackType
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, TypeVar, cast

from ._analyse import AllowSpec, build_cycles
from ._graph import find_unreachable, native_available
from ._report import LeakError, LeakReport

__all__ = ["detect"]

F = TypeVar("F", bound=Callable[..., Any])


class _GcPause:
    """Automatic gc off while any detect() block runs, restored when the last one ends.

    Counted so that nested blocks and blocks in several threads restore the state that held
    before the first of them, not each other's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def alone(self) -> bool:
        """Whether exactly one block runs (the caller's, in any thread)."""
        return self.running() == 1

    def running(self) -> int:
        """How many blocks run, in all threads."""
        with self._lock:
            return self._depth

    def leave(self) -> tuple[bool, bool]:
        """Returns (this was the outermost block, gc was enabled before it)."""
        with self._lock:
            self._depth -= 1
            last = self._depth == 0
            if last and self._was_enabled:
                gc.enable()
            return last, self._was_enabled


_PAUSE = _GcPause()


class _Entry:
    """The young generation at block entry, to tell the objects created in the block.

    With automatic gc off nothing leaves the young generation, and CPython appends newly
    tracked objects at its end (3.9-3.14, incremental gc included). So at exit the young list
    is: the entry objects still alive, in their entry order, then the new ones. Comparing ids
    alone is not enough: an entry object freed in the block leaves its address to a new
    object (pymalloc reuses it at once). The walk below stops at the first object that is not
    the next surviving entry object (same id and type, in order).

    The free-threaded build has no generation list (get_objects(0) returns every object in
    memory order), and its allocator hands a freed object's address to the next object of
    its size at once, so (id, type) pairs would take a new list for the freed one before it.
    There the block's entry freezes every tracked object (`gc.freeze()`: a bit in each
    object, which `gc.get_objects()` leaves out) and its exit unfreezes them, so the objects
    seen at exit are exactly those tracked since entry. That needs the freeze to be ours
    alone: when the program has frozen objects itself (`gc.get_freeze_count()`), or another
    block runs (in any thread), the (id, type) pairs are compared instead, and a new object
    at a freed entry object's address, of its type, is missed.
    """

    __slots__ = ("frozen", "ordered", "pos")

    def __init__(self, scope: str) -> None:
        self.ordered = not _free_threaded()
        self.frozen = False
        if scope == "block" and not self.ordered and _PAUSE.alone() and not gc.get_freeze_count():
            gc.freeze()
            self.frozen = True
            self.pos: dict[int, tuple[int, int]] = {}
            return
        objs = gc.get_objects(0) if scope == "block" else []
        self.pos = {id(o): (i, id(type(o))) for i, o in enumerate(objs)}

    def release(self) -> None:
        """Unfreeze what the entry froze (once)."""
        if self.frozen:
            self.frozen = False
            gc.unfreeze()

    def new_objects(self, objs: list[Any]) -> list[Any]:
        pos = self.pos
        if not pos:
            return objs
        if self.ordered:
            nxt = 0
            boundary = len(objs)
            for k, o in enumerate(objs):
                entry = pos.get(id(o))
                if entry is None or entry[0] < nxt or entry[1] != id(type(o)):
                    boundary = k
                    break
                nxt = entry[0] + 1
            return objs[boundary:]
        return [o for o in objs if pos.get(id(o), (0, 0))[1] != id(type(o))]


def _stack_depth() -> int:
    depth = 0
    f: Optional[Any] = sys._getframe()
    while f is not None:
        depth += 1
        f = f.f_back
    return depth


def _free_threaded() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return check is not None and not check()


def _other_threads() -> bool:
    """Whether another thread may run Python code now: one `threading` knows of, or one it
    does not (``_thread.start_new_thread``, a C thread calling into Python) that is running
    Python code at this moment."""
    return threading.active_count() > 1 or len(sys._current_frames()) > 1


def _freethreaded_unsafe() -> Optional[str]:
    check = getattr(sys, "_is_gil_enabled", None)
    if check is None or check():
        return None
    if sys.version_info < (3, 14) and _other_threads():
        return (
            "free-threaded CPython < 3.14 traverses objects without stopping other threads; "
            "analysis skipped while other threads run"
        )
    return None


_TRACE_LOCK = threading.Lock()
_ours = False  # tracemalloc runs because a block started it


def _toggle_unsafe() -> bool:
    """Whether starting or stopping tracemalloc now could crash the interpreter.

    On a free-threaded interpreter (3.14t checked) ``tracemalloc.start()`` and ``stop()``
    swap the allocator hooks while other threads allocate through them: a thread can call
    a new hook with the old context, or look up a trace table being cleared, and the process
    dies (a pure-CPython loop toggling it beside two threads making lists crashed 2 runs in
    8). With the GIL the swap happens while no other thread runs Python.
    """
    return _free_threaded() and _other_threads()


def _start_tracing(nframe: int) -> Optional[str]:
    """Start tracemalloc for a block; the reason it stays off, else None."""
    global _ours
    with _TRACE_LOCK:
        if tracemalloc.is_tracing():
            return None
        if _toggle_unsafe():
            return (
                "tracemalloc cannot be started while other threads run on a free-threaded "
                "interpreter (it crashes there); start it before the threads do: "
                "tracemalloc.start(128), or PYTHONTRACEMALLOC=128 in the environment"
            )
        tracemalloc.start(nframe)
        _ours = True
        return None


def _stop_tracing(mine: int = 1) -> None:
    """At a block's exit (``mine``: 1, the block still counted as running) or a session's
    end (0): stop the tracemalloc a block or the pytest plugin started, once no other block
    needs it and stopping is safe; else it stays on until a later exit finds both."""
    global _ours
    with _TRACE_LOCK:
        if _ours and _PAUSE.running() <= mine and not _toggle_unsafe():
            _ours = False
            tracemalloc.stop()


class _ThreadTagger:
    """Tells whether an object was allocated by the thread that entered the block.

    tracemalloc keeps, per allocation, the stack that made it. An allocation made by the
    entering thread inside the block starts with that thread's stack as it was at entry (the
    frames below the block keep their line numbers while it runs); another thread's stack
    starts elsewhere. Two threads running the very same call chain cannot be told apart;
    a truncated stack gives "unknown" (None).
    """

    def __init__(self, depth: int) -> None:
        frame = sys._getframe(depth)
        outer: list[tuple[str, int]] = []
        f = frame.f_back
        while f is not None:
            outer.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        outer.reverse()
        self.outer = outer
        self.block_file = frame.f_code.co_filename

    def __call__(self, objs: Iterable[Any]) -> tuple[Optional[str], Optional[str]]:
        """(allocation site, thread) of the first object tracemalloc has a traceback for.

        Not every object has one: those taken from a free list (lists, tuples, frames) and,
        on 3.11, objects with an inline ``__dict__`` are not seen by tracemalloc.
        """
        for obj in objs:
            tb = tracemalloc.get_object_traceback(obj)
            if tb is not None:
                return self._classify(tb)
        return None, None

    def _classify(self, tb: tracemalloc.Traceback) -> tuple[Optional[str], Optional[str]]:
        newest = tb[-1]
        where = f"{newest.filename}:{newest.lineno}"
        total = getattr(tb, "total_nframe", None)
        if total is not None and total > len(tb):  # truncated: the outer frames are gone
            return where, None
        n = len(self.outer)
        if len(tb) <= n:
            return where, "other"
        for i, (fname, line) in enumerate(self.outer):
            if tb[i].filename != fname or tb[i].lineno != line:
                return where, "other"
        return where, "current" if tb[n].filename == self.block_file else "other"


class detect:  # lower case: used like a function, `with detect() as report`
    """Report the reference cycles a block of code leaves behind, and what they keep alive.

    Automatic gc is paused while the block runs and restored afterwards. At exit the objects
    created in the block that only reference cycles keep alive are found *without collecting
    them*: no ``__del__`` or weakref callback runs because of the analysis, nothing is
    resurrected, ``gc.garbage`` and the gc flags are left as they were. Then the garbage is
    freed the normal way, by one young-generation collection (finalizers run there, as in any
    collection), unless ``keep=True`` or gc was disabled before the block.

    Args:
        keep: keep the cycles' objects in ``Cycle.objects`` for inspection (and do not
            collect); call ``report.release()`` when done.
        collect: free the garbage found by a ``gc.collect(0)`` after the analysis.
        scope: ``"block"`` (objects created in the block) or ``"heap"`` (every object the
            gc tracks, i.e. also garbage made before the block).
        allow: types, or ``"module"`` / ``"module.QualName"`` strings, whose cycles are
            expected (caches): counted in ``report.allowed_cycles``, not reported.
        threads: ``"all"`` reports garbage from every thread; ``"current"`` leaves out
            cycles another thread allocated (uses tracemalloc; see ``trace``).
        trace: frames tracemalloc keeps per allocation, to report ``allocated_at`` and the
            thread; ``None`` means 128 with ``threads="current"``, else off (0); raised to
            the current stack depth + 64 so that whole stacks are kept. Ignored when
            tracemalloc is already tracing (then attribution may say None: unknown). On a
            free-threaded interpreter tracemalloc is not started while other threads run
            (it can crash there): a ``RuntimeWarning`` and ``report.unattributed`` say so,
            and every cycle is kept; start tracemalloc before the threads do.
        min_bytes: cycles retaining fewer bytes are not reported.
        raise_on_leak: raise :class:`LeakError` at exit when cycles were found (not when the
            block itself raised).

    Example::

        >>> import numpy as np
        >>> from shmstore import leaks
        >>> class Circular:
        ...     def __init__(self, data):
        ...         self.circular = self
        ...         self.data = data
        >>> with leaks.detect() as report:
        ...     c = Circular(np.zeros(1_000_000))
        ...     del c
        >>> report.cycles[0].path, report.retained_bytes > 8_000_000
        ("Circular.__dict__['circular'] -> Circular", True)

    As a decorator, each call is checked and the last report is ``fn.leak_report``::

        @leaks.detect(raise_on_leak=True)
        def task(): ...
    """

    def __init__(
        self,
        *,
        keep: bool = False,
        collect: bool = True,
        scope: Literal["block", "heap"] = "block",
        allow: Sequence[AllowSpec] = (),
        threads: Literal["all", "current"] = "all",
        trace: Optional[int] = None,
        min_bytes: int = 0,
        raise_on_leak: bool = False,
    ) -> None:
        if scope not in ("block", "heap"):
            raise ValueError(f"scope must be 'block' or 'heap', not {scope!r}")
        if threads not in ("all", "current"):
            raise ValueError(f"threads must be 'all' or 'current', not {threads!r}")
        if trace is not None and trace < 0:
            raise ValueError(f"trace must be a number of frames >= 0, not {trace!r}")
        self.keep = keep
        self.collect = collect
        self.scope = scope
        self.allow = tuple(allow)
        self.threads = threads
        self.trace = (128 if threads == "current" else 0) if trace is None else trace
        self.min_bytes = min_bytes
        self.raise_on_leak = raise_on_leak
        self.report = LeakReport()
        self._local = threading.local()

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> LeakReport:
        return self._enter(depth=2)

    def _enter(self, depth: int) -> LeakReport:
        report = LeakReport()
        if self.trace and not tracemalloc.is_tracing():
            # Thread attribution needs whole stacks: at least this deep, plus the block's own.
            why = _start_tracing(min(65535, max(self.trace, _stack_depth() + 64)))
            if why is not None:
                report.unattributed = why
                warnings.warn(f"leaks.detect(): {why}", RuntimeWarning, stacklevel=depth + 1)
        tagger = _ThreadTagger(depth + 1) if tracemalloc.is_tracing() else None
        _PAUSE.enter()
        state = (report, tagger, None)
        self._stack().append(state)
        # Last: everything made so far (this detector's own state included) counts as old.
        entry = _Entry(self.scope)
        self._stack()[-1] = (report, tagger, entry)
        self.report = report
        return report

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return cast("list[Any]", stack)

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        report, tagger, entry = self._stack().pop()
        found = False
        try:
            exclude = {id(report), id(entry), id(entry.pos)}
            found = self._analyse(report, entry, tagger, exclude)
        finally:
            entry.release()
            entry = None
            _stop_tracing()
            outermost, was_enabled = _PAUSE.leave()
            report.complete = True
        if found and self.collect and not self.keep and outermost and was_enabled:
            gc.collect(0)
        if self.raise_on_leak and exc_type is None and report.cycles:
            raise LeakError(report)

    # -- decorator ---------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            report = self._enter(depth=2)
            wrapper.leak_report = report  # type: ignore[attr-defined]
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                self.__exit__(type(e), e, e.__traceback__)
                raise
            self.__exit__(None, None, None)
            return result

        wrapper.leak_report = LeakReport()  # type: ignore[attr-defined]
        return cast("F", wrapper)

    # -- the analysis ------------------------------------------------------------------------
    def _analyse(
        self,
        report: LeakReport,
        entry: _Entry,
        tagger: Optional[_ThreadTagger],
        exclude: set[int],
    ) -> bool:
        reason = _freethreaded_unsafe()
        if reason is not None:
            report.skipped = reason
            return False
        t0 = time.perf_counter()
        garbage, analysed = _collect_garbage(self.scope, entry, exclude)
        report.analysed_objects = analysed
        report.engine = "native" if native_available() else "python"
        found = bool(garbage)
        if garbage:
            cycles, total, allowed, other, held = build_cycles(
                garbage,
                allow=self.allow,
                keep=self.keep,
                thread_of=tagger,
                only_current_thread=self.threads == "current",
            )
            report.cycles = [c for c in cycles if c.retained_bytes >= self.min_bytes]
            report.retained_bytes = total
            report.garbage_objects = held
            report.allowed_cycles = allowed
            report.other_thread_cycles = other
        report.seconds = time.perf_counter() - t0
        return found


def _collect_garbage(scope: str, entry: _Entry, exclude: set[int]) -> tuple[list[Any], int]:
    """Tracked objects created since ``entry`` (or all) that nothing outside cycles holds."""
    objs = gc.get_objects(0) if scope == "block" else gc.get_objects()
    new = entry.new_objects(objs)
    del objs
    cand = list(compress(new, map(operator.not_, map(exclude.__contains__, map(id, new)))))
    del new
    n = len(cand)
    idx = find_unreachable(cand)
    if not native_available() and _other_threads():
        idx = _confirmed(cand, idx)
    garbage = [cand[i] for i in idx]
    del cand
    return garbage, n


def _confirmed(cand: list[Any], idx: list[int]) -> list[int]:
    """With other threads and the Python analysis, the garbage of a first analysis (`idx`)
    that a second one agrees on.

    The analysis reads every candidate's refcount, its edges, then the refcounts again: one
    snapshot only while no other thread changes them. The native analysis is one call that
    holds the GIL throughout; the Python one is three, and another thread may run between
    them (with a GIL at a switch, on a free-threaded interpreter all along), so an object it
    is using (a list it is filling) can change count between the reads and look unreachable.
    Garbage cannot change: nothing can reach it. So an object is kept only if a second
    analysis also finds it unreachable and its refcount, read after each, did not move: an
    object another thread is using at that moment is left out (a leak missed this time, not
    a live object reported)."""
    first = {i: sys.getrefcount(cand[i]) for i in idx}
    again = find_unreachable(cand)
    return [i for i in again if i in first and sys.getrefcount(cand[i]) == first[i]]
