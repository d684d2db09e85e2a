"""The result of a leak analysis: :class:`Cycle` and :class:`LeakReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .._util import format_bytes

__all__ = ["Cycle", "LeakError", "LeakReport", "format_bytes"]


@dataclass(frozen=True)
class Cycle:
    """One group of objects that keep each other alive (a strongly connected component of the
    garbage no other garbage points into), and everything only it keeps alive.

    Example::

        >>> cycle.path                                # doctest: +SKIP
        "QuantileDMatrix.__dict__['_handle_ref'] -> method -> QuantileDMatrix"
    """

    #: ``{"module.Type": count}`` of the objects forming the cycle, most frequent first.
    types: dict[str, int]
    #: A shortest reference path around the cycle, from its most telling member back to it.
    path: str
    #: Bytes freed if this cycle alone were collected: its members, everything reachable only
    #: from it (untracked objects too), and the buffers of numpy arrays (following ``.base``),
    #: bytes, bytearray, memoryview exporters and mmap objects, each buffer counted once.
    retained_bytes: int
    #: Of which buffer bytes (array data, bytes/bytearray payloads, mmap lengths).
    buffer_bytes: int
    #: Number of objects in the cycle itself.
    size: int
    #: Number of objects freed with it (members included).
    retained_objects: int
    #: ``{"module.Type": count}`` of everything retained, members included.
    retained_types: dict[str, int]
    #: ``"file.py:12"`` where the path's first object was allocated (needs tracemalloc).
    allocated_at: Optional[str] = None
    #: ``"current"`` / ``"other"``: which thread allocated it (``detect(threads=...)``).
    thread: Optional[str] = None
    #: The member objects, only with ``detect(keep=True)``; empty otherwise.
    objects: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (without the objects)."""
        return {
            "types": dict(self.types),
            "path": self.path,
            "retained_bytes": self.retained_bytes,
            "buffer_bytes": self.buffer_bytes,
            "size": self.size,
            "retained_objects": self.retained_objects,
            "retained_types": dict(self.retained_types),
            "allocated_at": self.allocated_at,
            "thread": self.thread,
        }

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} x {t}" for t, n in list(self.types.items())[:6])
        lines = [
            f"{format_bytes(self.retained_bytes)} retained by a cycle of {self.size} "
            f"object(s): {kinds}",
            f"    path: {self.path}",
        ]
        extra = {t: n for t, n in self.retained_types.items() if t not in self.types}
        if extra:
            kept = ", ".join(f"{n} x {t}" for t, n in list(extra.items())[:6])
            lines.append(f"    keeps alive: {kept} ({format_bytes(self.buffer_bytes)} of buffers)")
        where = []
        if self.allocated_at:
            where.append(f"allocated at {self.allocated_at}")
        if self.thread:
            where.append(f"thread: {self.thread}")
        if where:
            lines.append("    " + ", ".join(where))
        return "\n".join(lines)


@dataclass
class LeakReport:
    """What :func:`shmstore.leaks.detect` found. Filled when the block exits.

    Example::

        >>> from shmstore import leaks
        >>> with leaks.detect() as report:
        ...     a = []; a.append(a); del a
        >>> len(report.cycles), report.cycles[0].path
        (1, 'list[0] -> list')
    """

    #: Cycles, largest ``retained_bytes`` first.
    cycles: list[Cycle] = field(default_factory=list)
    #: Everything the cyclic garbage keeps alive, each object and buffer counted once (this
    #: includes objects shared by several cycles, which no single cycle claims).
    retained_bytes: int = 0
    #: Tracked objects found unreachable (cycle members and what hangs off them).
    garbage_objects: int = 0
    #: Objects examined (those created in the block, or the whole heap for ``scope="heap"``).
    analysed_objects: int = 0
    #: Seconds the analysis took.
    seconds: float = 0.0
    #: Cycles left out because their members match the allowlist.
    allowed_cycles: int = 0
    #: Cycles left out because another thread allocated them (``threads="current"``).
    other_thread_cycles: int = 0
    #: Why no analysis was done (e.g. a facility missing on this interpreter), else None.
    skipped: Optional[str] = None
    #: True once the block has exited and the analysis ran (or was skipped).
    complete: bool = False
    #: "native" or "python": which implementation did the graph work.
    engine: str = ""

    def release(self) -> None:
        """Drop the objects kept by ``keep=True`` so the collector can free them."""
        self.cycles = [
            Cycle(**{**c.__dict__, "objects": ()}) if c.objects else c for c in self.cycles
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "cycles": [c.to_dict() for c in self.cycles],
            "retained_bytes": self.retained_bytes,
            "garbage_objects": self.garbage_objects,
            "analysed_objects": self.analysed_objects,
            "seconds": self.seconds,
            "allowed_cycles": self.allowed_cycles,
            "other_thread_cycles": self.other_thread_cycles,
            "skipped": self.skipped,
            "engine": self.engine,
        }

    def __str__(self) -> str:
        if not self.complete:
            return "leak report: pending (the block has not exited yet)"
        if self.skipped:
            return f"leak report: skipped: {self.skipped}"
        head = (
            f"{len(self.cycles)} reference cycle(s) retain {format_bytes(self.retained_bytes)} "
            f"({self.garbage_objects} unreachable object(s); analysed {self.analysed_objects} "
            f"object(s) in {self.seconds * 1000:.1f} ms)"
        )
        notes = []
        if self.allowed_cycles:
            notes.append(f"{self.allowed_cycles} allowed by the allowlist")
        if self.other_thread_cycles:
            notes.append(f"{self.other_thread_cycles} from other threads left out")
        if notes:
            head += "; " + ", ".join(notes)
        parts = [head]
        for i, c in enumerate(self.cycles, 1):
            parts.append(f"#{i} {c}")
        return "\n".join(parts)


class LeakError(AssertionError):
    """Raised by ``detect(raise_on_leak=True)`` when cycles were found; ``.report`` has them.

    An ``AssertionError`` so test runners show it as a failed check.
    """

    def __init__(self, report: LeakReport) -> None:
        super().__init__(str(report))
        self.report = report
