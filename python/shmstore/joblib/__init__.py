"""Run ``joblib.Parallel`` with numpy arrays, their slices and shmstore objects sent by name.

joblib's own memmapping keys its temporary files by ``id()`` of each array object it pickles,
so eight slices of one array passed to twenty tasks each become 160 files in /dev/shm
(joblib/joblib#1298). Here the unit of sharing is the *underlying buffer*: every array above
``threshold`` bytes is traced down its ``.base`` chain to the root array that owns the memory,
the root is copied once into one shmstore segment, and every array, slice or view of it
travels as ``(segment, byte offset, shape, strides, dtype)`` and is rebuilt in the worker as a
read-only view of that segment. Arrays that already live in a file mapping (a shmstore store,
a saved archive, an ``np.memmap``) are sent as ``(file, offset, ...)`` without any copy. Large
array *results* come back by name too.

Two ways to use it::

    import joblib
    import numpy as np
    from joblib import delayed
    import shmstore.joblib

    data = np.random.rand(2**24)

    # one call: segments end when the call ends
    par = shmstore.joblib.Parallel(n_jobs=2, backend="loky")
    out = par(delayed(np.sum)(data[i * 2**21:(i + 1) * 2**21]) for i in range(8) for _ in range(20))
    par.stats  # SharingStats of the last call: segments created, bytes copied, arrays by name

    # a context: every Parallel call inside shares the same segments, which end at exit
    with shmstore.joblib.sharing(backend="multiprocessing", n_jobs=2) as stats:
        out = joblib.Parallel()(delayed(np.sum)(data[:1000]) for _ in range(10))
    stats  # SharingStats of the block

Why a backend and not pickler hooks: joblib builds a fresh ``numpy.ndarray`` reducer for every
executor/pool (``joblib._memmapping_reducer.get_memmapping_reducers``), and that reducer wins
over anything registered with ``loky.set_loky_pickler``/``register`` or ``copyreg``. The
documented extension point that sees every task is the backend
(``joblib.register_parallel_backend``): our backends subclass joblib's loky, multiprocessing and
threading backends and change one thing, ``submit()``. Each task batch is pickled by our own
pickler (cloudpickle with a ``reducer_override`` for numpy arrays) into bytes that joblib then
ships unchanged, so joblib's memmapping never sees a large array. Nested arrays (in lists,
dicts, ``self`` of a bound method) are found too, because the pickler sees every object.

Threading backend: no pickling; each task is wrapped with :func:`shmstore.leaks.gc_guard`, so
cycle garbage (xgboost's ``QuantileDMatrix``) is collected when RSS grows.

Lifetimes: the segments a call (or a :func:`sharing` context) created are unlinked when it ends.
Workers keep the segments of a context mapped between tasks (attaching a segment verifies it,
which costs about 0.25 s per GiB), and drop them as soon as the context's marker segment is
unlinked (inotify on the segment directory; no polling). A worker that returns a large array
writes it to a new segment and holds it until the parent has attached it; the parent then
unlinks the name, which tells the worker to let go.

Layout: ``_reduce`` (arrays by name, :class:`Sharer`), ``_transport`` (task batches and
results), ``_cache`` (what a process keeps mapped), ``_watch`` (inotify), ``_backends``
(the backends, :class:`Parallel`, :func:`sharing`); ``shmstore._procmaps`` reads
/proc/self/maps.
"""

from __future__ import annotations

from .. import _versions

# joblib 1.4 ran the calls without ever using these backends: checked, not silently ignored.
_versions.require("joblib", "shmstore.joblib")
_versions.require("cloudpickle", "shmstore.joblib")

from ._backends import (  # noqa: E402
    GuardedThreadingBackend,
    Parallel,
    ShmLokyBackend,
    ShmMultiprocessingBackend,
    WritableMemmapWarning,
    sharing,
)
from ._reduce import DEFAULT_THRESHOLD, Sharer, SharingStats  # noqa: E402

__all__ = [
    "DEFAULT_THRESHOLD",
    "GuardedThreadingBackend",
    "Parallel",
    "Sharer",
    "SharingStats",
    "ShmLokyBackend",
    "ShmMultiprocessingBackend",
    "WritableMemmapWarning",
    "sharing",
]
