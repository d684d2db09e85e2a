"""The backends (loky, multiprocessing, threading), :class:`Parallel` and :func:`sharing`."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import sys
import threading
import time
import warnings
from typing import Any, Iterator, Optional, Union

import joblib
from joblib.parallel import (
    FallbackToBackend,
    LokyBackend,
    MultiprocessingBackend,
    ThreadingBackend,
    register_parallel_backend,
)

from shmstore.leaks import GcGuard, gc_guard

from ._reduce import DEFAULT_THRESHOLD, Sharer, SharingStats
from ._transport import Task

__all__ = [
    "GuardedThreadingBackend",
    "Parallel",
    "ShmLokyBackend",
    "ShmMultiprocessingBackend",
    "WritableMemmapWarning",
    "sharing",
]

log = logging.getLogger("shmstore.joblib")

# ---------------------------------------------------------------------------------------------
# Backends

_ACTIVE: contextvars.ContextVar[Optional[Sharer]] = contextvars.ContextVar(
    "shmstore_joblib_sharer", default=None
)


class WritableMemmapWarning(UserWarning):
    """A call asked joblib for writable memmaps (``mmap_mode="r+"``, ``"w+"`` or ``"c"``):
    shmstore.joblib sends arrays as read-only views of shared memory instead."""


_WRITABLE_MODES = ("r+", "w+", "c")


def _caller_outside_joblib() -> int:
    """The ``stacklevel`` (for a warning issued by our caller) of the first frame outside
    joblib and shmstore.joblib: the user's ``Parallel(...)(...)`` line."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("joblib.", "shmstore.joblib.")
    ):
        frame = frame.f_back
        level += 1
    return level


def _check_mmap_mode(mode: Any) -> None:
    if mode in _WRITABLE_MODES:
        warnings.warn(
            f"mmap_mode={mode!r} has no effect under shmstore.joblib: large arrays reach the "
            "workers as read-only views of one shared copy, so writing to one raises "
            "ValueError. Return the results instead, or run this call with a plain joblib "
            "backend (e.g. backend='loky' outside shmstore.joblib.sharing()).",
            WritableMemmapWarning,
            stacklevel=_caller_outside_joblib(),
        )


class _SharingMixin:
    """Backend mixin: tasks go through :class:`Task`; segments end with the call or context.

    ``honour_prefer``: a call's ``prefer="threads"`` hint gets the (gc-guarded) threading
    backend, as it would outside :func:`sharing` (libraries such as scikit-learn ask for
    threads where their tasks release the GIL and share memory).
    """

    def __init__(
        self,
        *args: Any,
        threshold: Union[int, str, None] = DEFAULT_THRESHOLD,
        sharer: Optional[Sharer] = None,
        guard: Optional[GcGuard] = None,
        honour_prefer: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = threshold
        self._given_sharer = sharer
        self._guard = guard
        self._honour_prefer = honour_prefer
        self._sharer: Optional[Sharer] = None
        self._owns_sharer = False
        self.stats: Optional[SharingStats] = None

    def configure(self, *args: Any, **kwargs: Any) -> int:
        if self._honour_prefer and kwargs.get("prefer") == "threads":
            threads = GuardedThreadingBackend(
                nesting_level=getattr(self, "nesting_level", None), guard=self._guard
            )
            raise FallbackToBackend(threads)
        _check_mmap_mode(kwargs.get("mmap_mode"))
        n = super().configure(*args, **kwargs)  # type: ignore[misc]
        if self._sharer is None or self._sharer.closed:
            sharer = self._given_sharer or _ACTIVE.get()
            self._owns_sharer = sharer is None
            self._sharer = sharer if sharer is not None else Sharer(self._threshold)
            self.stats = self._sharer.stats
        return int(n)

    def submit(self, func: Any, callback: Any = None) -> Any:
        assert self._sharer is not None, "configure() was not called"
        return super().submit(Task(func, self._sharer), callback)  # type: ignore[misc]

    def terminate(self) -> None:
        super().terminate()  # type: ignore[misc]
        if self._owns_sharer and self._sharer is not None:
            self._sharer.close()
            self._sharer = None


class ShmLokyBackend(_SharingMixin, LokyBackend):
    """joblib's loky backend, with arrays and shmstore objects sent by name."""


class ShmMultiprocessingBackend(_SharingMixin, MultiprocessingBackend):
    """joblib's multiprocessing backend, with arrays and shmstore objects sent by name.

    ``context`` (a multiprocessing context) chooses the start method; joblib's default
    otherwise.
    """

    def __init__(self, *args: Any, context: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._context = context

    def configure(self, *args: Any, **kwargs: Any) -> int:
        if self._context is not None:
            kwargs["context"] = self._context  # Parallel passes its default context
        return super().configure(*args, **kwargs)


# Seconds to wait, in all, for a terminated thread pool's threads to end (each has been
# told to; they end as soon as their current task does).
_WORKER_EXIT_WAIT = 30.0


class GuardedThreadingBackend(ThreadingBackend):
    """joblib's threading backend, every task wrapped with :func:`shmstore.leaks.gc_guard`."""

    def __init__(self, *args: Any, guard: Optional[GcGuard] = None, **kwargs: Any) -> None:
        for mine in ("threshold", "sharer", "honour_prefer"):
            kwargs.pop(mine, None)
        super().__init__(*args, **kwargs)
        self.guard = guard

    _aborting = False

    def submit(self, func: Any, callback: Any = None) -> Any:
        return super().submit(gc_guard(func, guard=self.guard), callback)

    def abort_everything(self, ensure_ready: bool = True) -> None:
        self._aborting = True
        try:
            super().abort_everything(ensure_ready)
        finally:
            self._aborting = False

    def terminate(self) -> None:
        # The pool's threads, to wait for below: terminating a thread pool tells them to end
        # but does not wait for them, and a thread that ends leaves garbage behind (its
        # thread-locals' bookkeeping), which would otherwise appear after the collection.
        workers = [
            w
            for w in getattr(self._pool, "_pool", None) or ()
            if isinstance(w, threading.Thread) and w is not threading.current_thread()
        ]
        super().terminate()
        if not self._aborting:  # an aborted call's threads may still run a task: not waited for
            deadline = time.monotonic() + _WORKER_EXIT_WAIT
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
        # gc_guard bounds the garbage *during* the call (it collects when RSS grew, skips when
        # another thread is collecting or its time budget is spent), so the last tasks' cycles
        # may still be there. One full collection when the call ends leaves none behind; it
        # costs what one gc.collect() costs, once per call (joblib's loky backend collects
        # after every task).
        t0 = time.perf_counter()
        found = gc.collect()
        log.debug(
            "end of a threading call: gc.collect() found %d objects in %.1f ms",
            found,
            (time.perf_counter() - t0) * 1000,
        )


_BACKENDS: dict[str, type] = {
    "loky": ShmLokyBackend,
    "multiprocessing": ShmMultiprocessingBackend,
    "threading": GuardedThreadingBackend,
}
for _name, _cls in _BACKENDS.items():
    register_parallel_backend(f"shmstore-{_name}", _cls)


def _enclosing_dask_backend() -> bool:
    """Whether an enclosing ``joblib.parallel_config`` (or ``parallel_backend``) chose joblib's
    Dask backend (``backend="dask"``)."""
    dask = sys.modules.get("joblib._dask")
    if dask is None:
        return False  # joblib imports it when "dask" is first asked for
    active, _ = joblib.parallel.get_active_backend()
    return isinstance(active, dask.DaskDistributedBackend)


def _make_backend(
    backend: Any,
    threshold: Union[int, str, None],
    sharer: Optional[Sharer],
    guard: Optional[GcGuard] = None,
    honour_prefer: bool = True,
) -> Any:
    common = dict(threshold=threshold, sharer=sharer, guard=guard, honour_prefer=honour_prefer)
    if hasattr(backend, "Pool") and hasattr(backend, "Lock"):  # a multiprocessing context
        return ShmMultiprocessingBackend(context=backend, **common)
    name = str(backend or "loky").removeprefix("shmstore-")
    if name == "threading":
        return GuardedThreadingBackend(guard=guard)
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend must be one of {sorted(_BACKENDS)} or a multiprocessing context, "
            f"not {backend!r}"
        ) from None
    return cls(**common)


class Parallel(joblib.Parallel):  # type: ignore[misc]
    """``joblib.Parallel`` with arrays above ``threshold`` bytes sent by name.

    Same arguments as ``joblib.Parallel``, plus ``threshold`` (bytes, or a string like
    ``"1M"``) and ``guard`` (the :class:`~shmstore.leaks.GcGuard` of the threading backend;
    the process-wide one by default). ``backend`` is ``"loky"`` (default),
    ``"multiprocessing"``, ``"threading"`` or a multiprocessing context. The segments end when
    the call ends, or with the enclosing :func:`sharing` context. ``max_nbytes``/``mmap_mode``
    have no effect (nothing is left for joblib's memmapping): arrays arrive read-only, and a
    writable ``mmap_mode`` (``"r+"``, ``"w+"``, ``"c"``) warns (:class:`WritableMemmapWarning`).
    Without ``backend``, ``prefer="threads"`` gets the threading backend, as in joblib, and
    inside ``joblib.parallel_config(backend="dask")`` the call runs on joblib's Dask backend (on
    the cluster, arrays sent the way Dask sends them: see docs/guides/dask.md).
    """

    def __init__(
        self,
        n_jobs: Optional[int] = None,
        backend: Any = None,
        *,
        threshold: Union[int, str, None] = DEFAULT_THRESHOLD,
        guard: Optional[GcGuard] = None,
        **kwargs: Any,
    ) -> None:
        explicit = backend is not None
        if explicit or not _enclosing_dask_backend():
            backend = _make_backend(backend, threshold, None, guard, honour_prefer=not explicit)
        super().__init__(n_jobs=n_jobs, backend=backend, **kwargs)

    @property
    def stats(self) -> Optional[SharingStats]:
        """Counters of the last call (None before the first call, or with threads)."""
        return getattr(self._backend, "stats", None)


@contextlib.contextmanager
def sharing(
    backend: Any = None,
    *,
    threshold: Union[int, str, None] = DEFAULT_THRESHOLD,
    n_jobs: Optional[int] = None,
    guard: Optional[GcGuard] = None,
    **config: Any,
) -> Iterator[SharingStats]:
    """Make every ``joblib.Parallel`` call in the block send arrays by name.

    Within the block, ``joblib.Parallel(...)`` without an explicit ``backend`` uses ours (via
    ``joblib.parallel_config``; ``backend``: ``"loky"``, the default, ``"multiprocessing"``,
    ``"threading"`` or a multiprocessing context); all calls share the same segments, so an
    array passed to several calls is copied once. The segments are unlinked when the block
    ends. Yields the :class:`SharingStats` of the block. ``guard`` is the threading backend's
    :class:`~shmstore.leaks.GcGuard`. Extra keyword arguments go to ``parallel_config``.

    Inside ``joblib.parallel_config(backend="dask")``, a block without ``backend`` keeps
    joblib's Dask backend: the calls run on the cluster, as the enclosing code asked, and
    arrays go the way Dask sends them (this module's segments exist on one machine only; to
    share an array once per machine, ``shmstore.put`` it and pass the ``Ref`` inside
    ``shmstore.dask.share``: docs/guides/dask.md).

    A call that prefers threads (``joblib.Parallel(prefer="threads")``, as scikit-learn does
    where its tasks release the GIL) runs on the gc-guarded threading backend, as it would
    outside the block; ``require="sharedmem"`` gets joblib's threading backend (joblib picks
    it). A call asking for writable memmaps (``mmap_mode="r+"``, ``"w+"`` or ``"c"``) warns
    (:class:`WritableMemmapWarning`): its arrays arrive read-only.
    """
    keep_dask = backend is None and _enclosing_dask_backend()
    sharer = Sharer(threshold)
    token = _ACTIVE.set(sharer)
    try:
        if keep_dask:
            if n_jobs is not None:
                config["n_jobs"] = n_jobs
            scope = joblib.parallel_config(**config)  # the enclosing Dask backend stays
        else:
            scope = joblib.parallel_config(
                backend=_make_backend(backend, threshold, sharer, guard), n_jobs=n_jobs, **config
            )
        with scope:
            yield sharer.stats
    finally:
        _ACTIVE.reset(token)
        sharer.close()
