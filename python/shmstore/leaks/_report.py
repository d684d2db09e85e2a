"""The result of a leak analysis: :class:`Cycle` and :class:`LeakReport`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .._util import format_bytes

__all__ = ["Cycle", "CycleGroup", "LeakError", "LeakReport", "format_bytes"]

#: How many groups of cycles ``str(report)`` shows; ``report.format(top=..., verbose=True)``
#: shows more, and ``--shmstore-leaks-verbose`` every cycle in a pytest failure.
DEFAULT_TOP = 10


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


def _shape_of(c: Cycle) -> tuple[Any, ...]:
    """What cycles of the same shape share: their member types and their reference path with
    list/tuple indices left out (attribute names stay: they are the shape)."""
    path = re.sub(r"\[-?\d+\]", "[i]", c.path)
    return (tuple(sorted(c.types.items())), path, tuple(sorted(c.retained_types)))


@dataclass(frozen=True)
class CycleGroup:
    """Cycles of one shape (same member types, same reference path up to list/tuple
    indices, same kinds of retained objects): how many, what they retain in all, and one of
    them as the example.

    Example::

        >>> from shmstore import leaks
        >>> with leaks.detect() as report:
        ...     for _ in range(3):
        ...         a = []; a.append(a)
        ...     del a
        >>> (g,) = report.groups()
        >>> g.count, g.example.path
        (3, 'list[0] -> list')
    """

    #: The first cycle of the group (the one retaining most).
    example: Cycle
    #: Number of cycles of this shape.
    count: int
    #: Sum of their ``retained_bytes``.
    retained_bytes: int
    #: Sum of their ``retained_objects``.
    retained_objects: int

    def __str__(self) -> str:
        if self.count == 1:
            return str(self.example)
        head, _, rest = str(self.example).partition("\n")
        return (
            f"{self.count} cycles of this shape retain {format_bytes(self.retained_bytes)} "
            f"in all ({self.retained_objects} object(s)); the largest: {head}\n{rest}"
        )


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
    #: Why the cycles carry no allocation site or thread (so ``threads="current"`` could not
    #: leave out other threads' cycles), else None.
    unattributed: Optional[str] = None
    #: True once the block has exited and the analysis ran (or was skipped).
    complete: bool = False
    #: "native" or "python": which implementation did the graph work.
    engine: str = ""

    def release(self) -> None:
        """Drop the objects kept by ``keep=True`` so the collector can free them."""
        self.cycles = [
            Cycle(**{**c.__dict__, "objects": ()}) if c.objects else c for c in self.cycles
        ]

    def groups(self) -> list[CycleGroup]:
        """The cycles grouped by shape, most ``retained_bytes`` first (then most cycles)."""
        by: dict[tuple[Any, ...], list[Cycle]] = {}
        for c in self.cycles:
            by.setdefault(_shape_of(c), []).append(c)
        groups = [
            CycleGroup(
                example=max(cs, key=lambda c: c.retained_bytes),
                count=len(cs),
                retained_bytes=sum(c.retained_bytes for c in cs),
                retained_objects=sum(c.retained_objects for c in cs),
            )
            for cs in by.values()
        ]
        groups.sort(key=lambda g: (-g.retained_bytes, -g.count))
        return groups

    def format(self, top: Optional[int] = DEFAULT_TOP, verbose: bool = False) -> str:
        """The report as text: a summary line, then the ``top`` groups of cycles of the same
        shape (all with ``top=None``), each with its count, total bytes and one example path;
        ``verbose`` lists every cycle instead, one by one (``str(report)`` is
        ``format()``)."""
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
        if self.unattributed:
            parts.append(f"(not attributed to threads: {self.unattributed})")
        if verbose:
            for i, c in enumerate(self.cycles, 1):
                parts.append(f"#{i} {c}")
            return "\n".join(parts)
        groups = self.groups()
        if len(groups) < len(self.cycles):
            parts[0] += f"; {len(groups)} shape(s)"
        shown = groups if top is None else groups[: max(0, top)]
        for i, g in enumerate(shown, 1):
            parts.append(f"#{i} {g}")
        if len(shown) < len(groups):
            rest = groups[len(shown) :]
            parts.append(
                f"... and {len(rest)} more shape(s): {sum(g.count for g in rest)} cycle(s), "
                f"{format_bytes(sum(g.retained_bytes for g in rest))} (all of them: "
                "report.format(top=None), every cycle: report.format(verbose=True), in "
                "pytest: --shmstore-leaks-verbose)"
            )
        return "\n".join(parts)

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
            "unattributed": self.unattributed,
            "engine": self.engine,
        }

    def __str__(self) -> str:
        return self.format()


class LeakError(AssertionError):
    """Raised by ``detect(raise_on_leak=True)`` when cycles were found; ``.report`` has them.

    An ``AssertionError`` so test runners show it as a failed check.
    """

    def __init__(self, report: LeakReport, verbose: bool = False) -> None:
        super().__init__(report.format(verbose=verbose))
        self.report = report
