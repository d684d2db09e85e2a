"""Copy-on-read: how much of the parent's memory forked workers un-share, and which objects.

A forked worker shares its parent's pages until it writes to one; then the kernel copies the
page. Reading a Python object writes its reference count (and a garbage collection writes
every tracked object's GC header), so workers that only *read* a large list of dicts copy it
page by page: each one ends up with its own copy. :func:`measure` runs a callable in forked
workers, and reports per worker the bytes of pages that were shared with the parent when the
worker started and became its own, beyond what a no-op control worker started the same way
un-shares (the interpreter's own churn). When that is over a limit it says which Python
objects lived on the copied pages, by type, with an example access path::

    >>> from shmstore import cow
    >>> records = [{"bbox": [1.0, 2.0, 3.0, 4.0], "id": i} for i in range(20_000)]
    >>> def read_all():
    ...     for r in records:
    ...         r["bbox"]
    >>> report = cow.measure(read_all, workers=2, max="1 MiB")
    >>> report.ok
    False
    >>> print(report)  # doctest: +SKIP
    copy-on-read: 2 fork workers un-shared up to 2.3 MiB of the parent's memory ...
      dict      20.0k    1.2 MiB  records[i]
      list      20.0k    1.1 MiB  records[i]['bbox']
    >>> import shmstore
    >>> shared = shmstore.SharedList(records)
    >>> def read_shared():
    ...     for r in shared:
    ...         r["bbox"]
    >>> cow.measure(read_shared, workers=2, max="1 MiB").ok
    True
    >>> shared.unlink()

How: ``/proc/self/pagemap`` in each worker, unprivileged (bit 56, "exclusively mapped"; see
``shmstore._pages``), else the growth of ``Private_Dirty`` in ``/proc/self/smaps`` (no page
list, so no attribution). Workers are :mod:`multiprocessing` processes of the given start
method, the way ``multiprocessing.Pool`` and torch's ``DataLoader`` start theirs; they all
wait for one signal, so the parent's own work starting them is not counted. Keep the parent
idle while they run: a page the parent writes meanwhile becomes the workers' own as well.

Under ``forkserver`` the workers are forked from the fork server, not from the caller: what
they can un-share is the server's memory (its preloaded modules), while the callable and its
arguments are pickled and arrive private. ``spawn`` shares nothing, so there is nothing to
measure: :func:`measure` refuses it (``ValueError``) instead of passing.
"""

from __future__ import annotations

import builtins
import gc
import multiprocessing
import multiprocessing.connection
import os
import sysconfig
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from . import _attribution, _pages
from ._attribution import Attribution, TypeRow
from ._util import format_bytes, parse_size

__all__ = [
    "DEFAULT_LIMIT",
    "Attribution",
    "CopyOnReadError",
    "CowReport",
    "TypeRow",
    "WorkerError",
    "WorkerResult",
    "measure",
]

#: The limit when none is given: 1 MiB beyond the no-op control, per worker.
DEFAULT_LIMIT = 1 << 20
_MAX_TYPE_ROWS = 12
#: Whether this interpreter is a free-threaded build (its allocator is mimalloc, whose delayed
#: purge the report explains when most of the copied pages held no object).
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
_MAX_WORKER_ROWS = 8


class CopyOnReadError(AssertionError):
    """A worker un-shared more of its parent's memory than allowed; ``report`` says what."""

    def __init__(self, report: CowReport) -> None:
        super().__init__(str(report))
        self.report = report


class WorkerError(RuntimeError):
    """The measured callable raised in a worker (the worker's traceback is the message)."""


@dataclass(frozen=True)
class WorkerResult:
    """One worker: bytes it un-shared (pages shared with the parent at its start, its own
    at the end)."""

    pid: int
    unshared: int


@dataclass(frozen=True)
class CowReport:
    """What :func:`measure` found. ``str(report)`` is the grouped report (at most 50 lines)."""

    start_method: str
    method: str  #: "pagemap" (exact, pages known) or "smaps" (Private_Dirty growth)
    collect: bool
    workers: tuple[WorkerResult, ...]
    control: WorkerResult  #: the no-op worker, started and measured the same way
    limit: Optional[int]  #: bytes beyond the control allowed per worker (None: no gate)
    attribution: Optional[Attribution]
    frozen: int  #: objects the parent had frozen with ``gc.freeze()`` when it forked

    @property
    def excess(self) -> int:
        """The most any worker un-shared beyond the control, in bytes (may be < 0)."""
        return max(w.unshared for w in self.workers) - self.control.unshared

    @property
    def ok(self) -> bool:
        """Whether every worker stayed within ``limit`` (True when there is no limit)."""
        return self.limit is None or self.excess <= self.limit

    def check(self) -> CowReport:
        """Raise :class:`CopyOnReadError` unless :attr:`ok`; returns the report."""
        if not self.ok:
            raise CopyOnReadError(self)
        return self

    def __str__(self) -> str:
        fb = format_bytes
        n = len(self.workers)
        worst = max(w.unshared for w in self.workers)
        where = "the fork server's" if self.start_method == "forkserver" else "the parent's"
        lim = "" if self.limit is None else f"; limit {fb(self.limit)} beyond the control"
        verdict = "" if self.limit is None else (" — OK" if self.ok else " — TOO MUCH")
        lines = [
            f"copy-on-read: {n} {self.start_method} worker(s) un-shared up to {fb(worst)} of "
            f"{where} memory each, {fb(self.excess)} beyond a no-op worker{lim}{verdict}",
            f"  {'worker':<8}{'pid':>9}{'un-shared':>12}{'beyond control':>16}",
        ]
        for i, w in enumerate(self.workers[:_MAX_WORKER_ROWS]):
            beyond = fb(w.unshared - self.control.unshared)
            lines.append(f"  {i:<8}{w.pid:>9}{fb(w.unshared):>12}{beyond:>16}")
        if n > _MAX_WORKER_ROWS:
            lines.append(f"  ... {n - _MAX_WORKER_ROWS} more worker(s)")
        lines.append(f"  {'control':<8}{self.control.pid:>9}{fb(self.control.unshared):>12}")
        lines.extend(self._attribution_lines())
        extra = "after its callable and one full collection" if self.collect else ""
        lines.append(
            f"measured with /proc/self/{self.method}"
            + (" (pages exclusively mapped at the end)" if self.method == "pagemap" else "")
            + (f", each worker {extra}" if extra else "")
            + (f"; gc.freeze() held {self.frozen} objects" if self.frozen else "")
        )
        return "\n".join(lines)

    def _attribution_lines(self) -> list[str]:
        a = self.attribution
        if a is None:
            if self.method == "smaps" and not self.ok:
                return ["  (no page list without /proc/self/pagemap: objects not attributed)"]
            return []
        if not a.page_bytes:
            return []
        share = 100.0 * a.attributed / a.page_bytes
        lines = [
            f"Python objects on the {format_bytes(a.page_bytes)} of pages the workers "
            f"un-shared and the control did not (each page's bytes shared among the types on "
            f"it; {share:.0f} % on pages with objects found"
            + (f"; estimated from 1 in {a.sample} objects" if a.sample > 1 else "")
            + "):",
            f"  {'type':<24}{'count':>9}{'bytes':>12}  example",
        ]
        for r in a.rows[:_MAX_TYPE_ROWS]:
            lines.append(
                f"  {r.type[:24]:<24}{_count(r.count):>9}{format_bytes(r.nbytes):>12}  {r.example}"
            )
        rest = a.rows[_MAX_TYPE_ROWS:]
        if rest:
            lines.append(
                f"  {len(rest)} more type(s): {_count(sum(r.count for r in rest))} objects, "
                f"{format_bytes(sum(r.nbytes for r in rest))}"
            )
        lines.append(
            f"  {'(no Python object)':<33}{format_bytes(a.page_bytes - a.attributed):>12}"
            "  pages holding no object found (interpreter and C data)"
        )
        if _FREE_THREADED and 2 * a.attributed < a.page_bytes:
            lines.append(
                "  free-threaded interpreter: memory the parent freed shortly before the fork "
                "is still mapped in the workers (its allocator, mimalloc, gives it back after "
                "10 ms), and a worker that allocates reuses it, un-sharing pages that held no "
                "object; start the parent with MIMALLOC_PURGE_DELAY=0 in its environment to "
                "have it given back at once"
            )
        top = {r.type for r in a.rows[:3]}
        if top & {"dict", "list", "tuple", "float", "int", "str"}:
            lines.append(
                "  fix: keep the data in shmstore (shmstore.SharedList / SharedDict): "
                "readers get views of pages no one writes; gc.freeze() before forking only "
                "spares the collector's writes, not reference counts"
            )
        return lines


def _count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.1f}k"
    return str(n)


def _child(
    conn: multiprocessing.connection.Connection,
    go: Any,
    fn: Optional[Callable[..., Any]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    collect: bool,
    attribute_over: Optional[int],
    timeout: float,
) -> None:
    """A worker: wait for the start signal, probe, run ``fn``, probe again, send the result."""
    try:
        if not go.wait(timeout):
            raise TimeoutError("the parent never sent the start signal")
        probe = _pages.Probe()
        if fn is not None:
            fn(*args, **kwargs)
        if collect:
            gc.collect()
        unshared, pages = probe.finish()
        attribution = None
        if pages is not None and attribute_over is not None and unshared > attribute_over:
            attribution = _attribution.attribute(pages, _pages.PAGE_SIZE, exclude=(pages, probe))
        conn.send(("ok", os.getpid(), probe.method, unshared, pages, attribution))
    except BaseException:
        conn.send(("error", os.getpid(), traceback.format_exc()))
    finally:
        conn.close()


def _roots(
    fn: Optional[Callable[..., Any]], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Names for the objects a callable reaches first: arguments, closure variables,
    the instance of a bound method, the globals its code names."""
    roots: dict[str, Any] = {}
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is not None:
        glob = getattr(func, "__globals__", {})
        for name in code.co_names:
            if name in glob:
                roots[name] = glob[name]
        for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                roots[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
    self = getattr(fn, "__self__", None)
    if self is not None:
        roots["self"] = self
    for i, a in enumerate(args):
        roots[f"args[{i}]"] = a
    roots.update(kwargs)
    return roots


def measure(
    fn: Optional[Callable[..., Any]],
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    workers: int = 4,
    start_method: str = "fork",
    collect: bool = False,
    max: Optional[int | float | str] = None,
    attribute: Optional[bool] = None,
    roots: Optional[Mapping[str, Any]] = None,
    timeout: float = 600.0,
) -> CowReport:
    """Run ``fn(*args, **kwargs)`` in ``workers`` worker processes started with
    ``start_method`` (plus one no-op control worker) and measure what each un-shared.

    - ``collect``: each worker (and the control) also runs one full ``gc.collect()`` after
      ``fn``, as a long-lived worker eventually does; the control then un-shares every page
      of GC-tracked objects too, so the excess shows what ``fn`` adds to a collection;
    - ``max``: bytes (or ``"4 MiB"``) a worker may un-share beyond the control; the report's
      :attr:`~CowReport.ok` and :meth:`~CowReport.check` use it;
    - ``attribute``: say which objects lived on the un-shared pages; by default when a worker
      is over ``max`` (or over 1 MiB beyond the control when there is no ``max``). Takes
      time in proportion to the number of objects the parent holds;
    - ``roots``: names for objects the example paths may start at (``{"records": records}``);
      ``fn``'s arguments, closure variables and globals are named already.

    Raises ``ValueError`` for ``spawn`` (it shares no memory, so nothing could be
    un-shared), :class:`WorkerError` if ``fn`` raised in a worker, ``TimeoutError`` if the
    workers did not finish within ``timeout`` seconds (they are terminated).
    """
    kwargs = dict(kwargs or {})
    if start_method == "spawn":
        raise ValueError(
            "start method 'spawn' starts a fresh interpreter that shares no memory with its "
            "parent, so there is nothing to un-share: copy-on-read can only happen under "
            "'fork' (workers share the parent's pages) or 'forkserver' (the server's pages); "
            "measure under one of those"
        )
    if start_method not in ("fork", "forkserver"):
        raise ValueError(f"start_method must be 'fork' or 'forkserver', not {start_method!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, not {workers!r}")
    limit = None if max is None else parse_size(max, what="max")
    over = DEFAULT_LIMIT if limit is None else limit
    ctx = multiprocessing.get_context(start_method)
    go = ctx.Event()
    in_child = start_method == "forkserver" and attribute is not False
    readers, procs = [], []
    try:
        for i in range(workers + 1):
            r, w = ctx.Pipe(duplex=False)
            target = fn if i < workers else None
            p = ctx.Process(  # type: ignore[attr-defined]
                target=_child,
                args=(
                    w,
                    go,
                    target,
                    args if target else (),
                    kwargs if target else {},
                    collect,
                    over if in_child and i == 0 else None,
                    timeout,
                ),
                name=f"shmstore-cow-{'control' if target is None else i}",
                daemon=True,
            )
            p.start()
            w.close()
            readers.append(r)
            procs.append(p)
        go.set()
        results = _collect(readers, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        for r in readers:
            r.close()
    errors = [res for res in results if res[0] == "error"]
    if errors:
        raise WorkerError(
            f"the measured callable raised in worker pid {errors[0][1]}:\n{errors[0][2]}"
        )
    method = results[0][2]
    control = WorkerResult(results[-1][1], results[-1][3])
    done = tuple(WorkerResult(res[1], res[3]) for res in results[:-1])
    worst = builtins.max(w.unshared for w in done) - control.unshared
    attribution: Optional[Attribution] = None
    if in_child:
        attribution = results[0][5]
    elif method == "pagemap" and (attribute or (attribute is None and worst > over)):
        control_pages = set(results[-1][4])
        pages = {p for res in results[:-1] for p in res[4] if p not in control_pages}
        named = {**_roots(fn, args, kwargs), **(roots or {})}
        attribution = _attribution.attribute(
            pages, _pages.PAGE_SIZE, named, exclude=(results, control_pages, named)
        )
    return CowReport(
        start_method=start_method,
        method=method,
        collect=collect,
        workers=done,
        control=control,
        limit=limit,
        attribution=attribution,
        frozen=gc.get_freeze_count(),
    )


def _collect(readers: list[Any], timeout: float) -> list[Any]:
    """One message from each reader, in order, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    got: dict[int, Any] = {}
    pending = {id(r): (i, r) for i, r in enumerate(readers)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{len(pending)} of {len(readers)} copy-on-read worker(s) did not finish "
                f"within {timeout:g} s"
            )
        for ready in multiprocessing.connection.wait([r for _, r in pending.values()], left):
            i, r = pending.pop(id(ready))
            try:
                got[i] = r.recv()
            except EOFError:
                got[i] = ("error", -1, "the worker exited without a result (killed?)")
    return [got[i] for i in range(len(readers))]
