"""``gc_guard`` / ``GcGuard``: collect cycles after tasks, only when they likely pin memory;
``watch``: log collections that free a lot."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import threading
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Optional, TypeVar, cast, overload

from .._util import format_bytes

__all__ = ["GcEvent", "GcGuard", "GcWatch", "GuardStats", "gc_guard", "watch"]

log = logging.getLogger("shmstore.leaks")
F = TypeVar("F", bound=Callable[..., Any])
#: The default memory ceiling of :class:`GcGuard` (or its ``min_growth``, if larger).
DEFAULT_MAX_GROWTH = 512 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> Optional[int]:
    """Resident set size of this process from /proc/self/statm (a few microseconds), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Optional[Callable[[], _MallInfo2]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return cast(Callable[[], _MallInfo2], fn)


_MALLINFO2 = _load_mallinfo2()


def heap_bytes() -> Optional[int]:
    """Bytes in use in the C heap (glibc's ``mallinfo2``: chunks handed out by malloc, in
    every arena, plus its mmap'd blocks), or None without glibc >= 2.33.

    A collection's freed bytes are the drop of this figure: what the allocator got back
    (numpy buffers, bytes and large objects), whether or not it returns the pages to the
    system, which the RSS drop misses (glibc keeps freed memory for reuse)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd)


@dataclass
class GuardStats:
    """Counters of a :class:`GcGuard`."""

    tasks: int = 0
    collections: int = 0
    skipped_for_budget: int = 0
    #: collections run although the time budget was spent, because RSS grew past max_growth
    over_ceiling: int = 0
    #: Bytes the collections gave back to the C allocator (see :func:`heap_bytes`: numpy
    #: buffers, bytes, large objects; small objects in Python's own pools are not counted),
    #: or, without glibc >= 2.33, the drop of RSS (which misses memory the allocator keeps).
    freed_bytes: int = 0
    collected_objects: int = 0
    gc_seconds: float = 0.0


class GcGuard:
    """Run a cycle collection after a task only when cycle garbage likely pins memory.

    Thread pools (``ThreadPoolExecutor``, joblib's threading backend) never trigger a
    collection for garbage that the gc cannot see grow: a cycle holding a 1 GiB numpy array
    counts as a handful of objects. The signal here is cheap: after each task, the process
    RSS (one read of /proc/self/statm) is compared with what it was after the last
    collection. When it grew by ``min_growth`` or more, a ``gc.collect(generation)`` runs,
    unless the time spent collecting would exceed ``max_gc_fraction`` of the time since the
    guard was made plus ``burst`` seconds (a budget), or another thread is already
    collecting. Each collection is
    logged (logger ``shmstore.leaks``, INFO) with the bytes it gave back.

    ``max_growth`` is a memory ceiling that wins over the time budget: once RSS has grown by
    ``max_growth`` bytes since the last collection, the next task to end collects whatever the
    budget says (default 512 MiB, or ``min_growth`` if larger; None turns the ceiling off,
    leaving only the budget). Cycle
    garbage between two collections therefore stays under about ``max_growth`` plus what the
    tasks running at that moment allocate, however fast the tasks leak. Memory that a
    collection does not give back (live data, not garbage) moves the baseline, so a
    process that really needs more memory is not collected after every task.

    Example::

        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from shmstore.leaks import GcGuard
        >>> guard = GcGuard(min_growth=256 << 20)
        >>> with ThreadPoolExecutor(4) as pool:
        ...     results = list(pool.map(guard.wrap(len), ["a", "bb"]))
        >>> results
        [1, 2]
    """

    def __init__(
        self,
        *,
        min_growth: int = 64 << 20,
        max_growth: Optional[int] = DEFAULT_MAX_GROWTH,
        max_gc_fraction: float = 0.05,
        burst: float = 0.1,
        generation: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_growth < 0:
            raise ValueError(f"min_growth must be >= 0 bytes, not {min_growth}")
        if max_growth == DEFAULT_MAX_GROWTH:
            max_growth = max(max_growth, min_growth)
        if max_growth is not None and max_growth < min_growth:
            raise ValueError(
                f"max_growth ({max_growth} bytes) must be >= min_growth ({min_growth} bytes), "
                "or None for no memory ceiling"
            )
        if not 0 < max_gc_fraction <= 1:
            raise ValueError(f"max_gc_fraction must be in (0, 1], not {max_gc_fraction}")
        if generation not in (0, 1, 2):
            raise ValueError(f"generation must be 0, 1 or 2, not {generation}")
        self.min_growth = min_growth
        self.max_growth = max_growth
        self.max_gc_fraction = max_gc_fraction
        self.burst = burst
        self.generation = generation
        self.stats = GuardStats()
        self._clock = clock
        self._started = clock()
        self._last_cost = 0.0
        self._lock = threading.Lock()  # held while collecting; others skip rather than wait
        self._count_lock = threading.Lock()
        self._baseline = rss_bytes() or 0

    def after_task(self) -> bool:
        """Call when a task ends; returns True if it ran a collection."""
        with self._count_lock:
            self.stats.tasks += 1
        rss = rss_bytes()
        if rss is None or rss - self._baseline < self.min_growth:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another thread is collecting right now: it frees the garbage
        try:
            grown = rss - self._baseline
            elapsed = self._clock() - self._started
            budget = self.max_gc_fraction * elapsed + self.burst
            if self.stats.gc_seconds + self._last_cost > budget:
                if self.max_growth is None or grown < self.max_growth:
                    self.stats.skipped_for_budget += 1
                    return False
                self.stats.over_ceiling += 1  # the memory ceiling wins over the budget
            heap_before = heap_bytes()
            t0 = time.perf_counter()
            found = gc.collect(self.generation)
            cost = time.perf_counter() - t0
            heap_after = heap_bytes()
            after = rss_bytes() or rss
            if heap_before is not None and heap_after is not None:
                freed = max(0, heap_before - heap_after)
            else:
                freed = max(0, rss - after)
            self._baseline = after
            self._last_cost = cost
            self.stats.collections += 1
            self.stats.gc_seconds += cost
            self.stats.collected_objects += found
            self.stats.freed_bytes += freed
            log.info(
                "gc_guard: RSS grew %s since the last collection; gc.collect(%d) found %d "
                "unreachable objects in %.1f ms, freed %s (RSS %s -> %s)",
                format_bytes(grown),
                self.generation,
                found,
                cost * 1000,
                format_bytes(freed),
                format_bytes(rss),
                format_bytes(after),
            )
            return True
        finally:
            self._lock.release()

    def wrap(self, fn: F) -> F:
        """``fn`` followed by :meth:`after_task` (also when it raises)."""

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self.after_task()

        return cast("F", guarded)

    __call__ = wrap

    def __enter__(self) -> GcGuard:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.after_task()


_DEFAULT_GUARD: Optional[GcGuard] = None
_DEFAULT_LOCK = threading.Lock()


def default_guard() -> GcGuard:
    """The process-wide guard :func:`gc_guard` uses when given none."""
    global _DEFAULT_GUARD
    with _DEFAULT_LOCK:
        if _DEFAULT_GUARD is None:
            _DEFAULT_GUARD = GcGuard()
        return _DEFAULT_GUARD


@overload
def gc_guard(fn: F, *, guard: Optional[GcGuard] = None) -> F: ...
@overload
def gc_guard(fn: None = None, *, guard: Optional[GcGuard] = None) -> Callable[[F], F]: ...
def gc_guard(fn: Optional[F] = None, *, guard: Optional[GcGuard] = None) -> F | Callable[[F], F]:
    """Wrap a task with a :class:`GcGuard` (the shared process-wide one by default).

    Example::

        >>> from joblib import Parallel, delayed
        >>> from shmstore.leaks import gc_guard
        >>> def train_one(i):
        ...     return i * i
        >>> Parallel(n_jobs=4, backend="threading")(
        ...     delayed(gc_guard(train_one))(i) for i in range(5))
        [0, 1, 4, 9, 16]
    """
    if fn is None:
        return lambda f: gc_guard(f, guard=guard)
    return (guard or default_guard()).wrap(fn)


@dataclass(frozen=True)
class GcEvent:
    """One collection seen by :func:`watch`."""

    generation: int
    collected: int
    uncollectable: int
    freed_bytes: int
    seconds: float


class GcWatch:
    """A gc callback that logs collections freeing at least ``threshold`` bytes.

    Bytes come from tracemalloc when it is tracing (exact), else from the RSS drop. The
    callback costs two reads of /proc/self/statm per collection. Use :func:`watch`.
    """

    def __init__(
        self,
        threshold: int = 64 << 20,
        *,
        logger: Optional[logging.Logger] = None,
        keep: int = 1000,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 bytes, not {threshold}")
        self.threshold = threshold
        self.logger = logger or log
        #: The last ``keep`` collections that freed at least ``threshold`` bytes.
        self.events: deque[GcEvent] = deque(maxlen=keep)
        self.collections = 0
        self._before: Optional[tuple[int, float]] = None
        self._active = False

    def _measure(self) -> int:
        if tracemalloc.is_tracing():
            return tracemalloc.get_traced_memory()[0]
        return rss_bytes() or 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._before = (self._measure(), time.perf_counter())
            return
        if self._before is None:
            return
        before, t0 = self._before
        self._before = None
        self.collections += 1
        freed = before - self._measure()
        if freed <= 0 or freed < self.threshold:
            return
        event = GcEvent(
            generation=int(info.get("generation", -1)),
            collected=int(info.get("collected", 0)),
            uncollectable=int(info.get("uncollectable", 0)),
            freed_bytes=freed,
            seconds=time.perf_counter() - t0,
        )
        self.events.append(event)
        self.logger.warning(
            "gc generation %d freed %s (%d unreachable objects): reference cycles were "
            "keeping that memory alive; shmstore.leaks.detect() shows which",
            event.generation,
            format_bytes(freed),
            event.collected,
        )

    def start(self) -> GcWatch:
        if not self._active:
            gc.callbacks.append(self._callback)
            self._active = True
        return self

    def stop(self) -> None:
        if self._active:
            gc.callbacks.remove(self._callback)
            self._active = False

    def __enter__(self) -> GcWatch:
        return self.start()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()


def watch(threshold: int = 64 << 20, *, logger: Optional[logging.Logger] = None) -> GcWatch:
    """Start logging collections that free ``threshold`` bytes or more; returns the watcher.

    Example::

        >>> from shmstore import leaks
        >>> with leaks.watch(threshold=1 << 20) as w:
        ...     pass
        >>> list(w.events)
        []
    """
    return GcWatch(threshold, logger=logger).start()
