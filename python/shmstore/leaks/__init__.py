"""Find the reference cycles that keep memory alive, and free them in time.

- :func:`detect` — run a block with automatic gc paused and report the cycles it left behind:
  member types, a reference path around each cycle, and the bytes each one retains (numpy
  buffers included), without running any finalizer.
- :func:`gc_guard` / :class:`GcGuard` — after each task of a thread pool, collect cycles only
  when they likely pin memory, within a time budget.
- :func:`watch` — log collections that free a lot of memory.

Example::

    >>> from shmstore import leaks
    >>> with leaks.detect() as report:
    ...     a = []; a.append(a); del a
    >>> print(report.cycles[0].path)
    list[0] -> list

This module does not need the native extension (``shmstore._native``); it uses it, when
present, to speed up the graph analysis.
"""

from __future__ import annotations

from ._detect import detect
from ._graph import native_available
from ._guard import GcEvent, GcGuard, GcWatch, GuardStats, gc_guard, watch
from ._report import Cycle, CycleGroup, LeakError, LeakReport

__all__ = [
    "Cycle",
    "CycleGroup",
    "GcEvent",
    "GcGuard",
    "GcWatch",
    "GuardStats",
    "LeakError",
    "LeakReport",
    "detect",
    "gc_guard",
    "native_available",
    "watch",
]
