"""Run ``joblib.Parallel`` with numpy arrays, their slices and shmstore objects sent by name.

joblib's own memmapping keys its temporary files by ``id()`` of each array object it pickles,
so eight slices of one array passed to twenty tasks each become 160 files in /dev/shm
(joblib/joblib#1298 and the "joblib memory errors" seed). Here the unit of sharing is the
*underlying buffer*: every array above ``threshold`` bytes is traced down its ``.base`` chain to
the root array that owns the memory, the root is copied once into one shmstore segment, and
every array, slice or view of it travels as ``(segment, byte offset, shape, strides, dtype)``
and is rebuilt in the worker as a read-only view of that segment. Arrays that already live in a
file mapping (a shmstore store, a saved archive, an ``np.memmap``) are sent as
``(file, offset, ...)`` without any copy. Large array *results* come back by name too.

Two ways to use it::

    import numpy as np
    from joblib import delayed
    import shmstore.joblib

    data = np.random.rand(2**24)

    # one call: segments end when the call ends
    out = shmstore.joblib.Parallel(n_jobs=2, backend="loky")(
        delayed(np.sum)(data[i * 2**21:(i + 1) * 2**21]) for i in range(8) for _ in range(20))

    # a context: every Parallel call inside shares the same segments, which end at exit
    with shmstore.joblib.sharing(backend="multiprocessing", n_jobs=2) as share:
        out = joblib.Parallel()(delayed(np.sum)(data[:1000]) for _ in range(10))
    share.stats  # segments created, bytes copied, arrays sent by name

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
cycle garbage (xgboost's ``QuantileDMatrix``) is collected when RSS grows, within a time budget.

Lifetimes: the segments a call (or a :func:`sharing` context) created are unlinked when it ends.
Workers keep the segments of a context mapped between tasks (attaching a segment verifies it,
which costs about 0.25 s per GiB), and drop them as soon as the context's marker segment is
unlinked (inotify on the segment directory; no polling). A worker that returns a large array
writes it to a new segment and holds it until the parent has attached it; the parent then
unlinks the name, which tells the worker to let go.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import gc
import io
import logging
import os
import pickle
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import cloudpickle
import joblib
import numpy as np
from joblib.parallel import (
    LokyBackend,
    MultiprocessingBackend,
    ThreadingBackend,
    register_parallel_backend,
)

import shmstore
from shmstore.leaks import GcGuard, gc_guard

__all__ = [
    "DEFAULT_THRESHOLD",
    "GuardedThreadingBackend",
    "Parallel",
    "Sharer",
    "SharingStats",
    "ShmLokyBackend",
    "ShmMultiprocessingBackend",
    "sharing",
]

log = logging.getLogger("shmstore.joblib")

#: Arrays of at least this many bytes go by name (joblib's own default ``max_nbytes``).
DEFAULT_THRESHOLD = 1 << 20

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_ARRAY_TYPES = (np.ndarray, np.memmap)


def _parse_bytes(value: Union[int, str, None]) -> int:
    """``1048576``, ``"1M"``, ``"512k"``, ``"2G"`` -> bytes; None means "every array"."""
    if value is None:
        return 0
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"threshold must be >= 0 bytes, not {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)i?[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"threshold must be a number of bytes or like '1M', not {value!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


# ---------------------------------------------------------------------------------------------
# Where an array's memory lives


def _root_of(a: np.ndarray) -> np.ndarray:
    """The last ndarray of ``a``'s ``.base`` chain: the array that owns (or wraps) the buffer."""
    r = a
    while isinstance(r.base, np.ndarray):
        r = r.base
    return r


def _data_ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@dataclass(frozen=True)
class _FileSpan:
    """A read-only shared file mapping that holds an array's root: path and file offset."""

    path: str
    offset: int  # file offset of the root's first byte


def _maps_entry(addr: int) -> Optional[tuple[int, int, str, int, tuple[int, int], str]]:
    """(start, end, perms, file offset, (device, inode), path) of this process's mapping at
    ``addr``, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                start_s, _, end_s = parts[0].partition("-")
                start, end = int(start_s, 16), int(end_s, 16)
                if start <= addr < end:
                    path = parts[5].rstrip("\n") if len(parts) > 5 else ""
                    major, _, minor = parts[3].partition(":")
                    dev = os.makedev(int(major, 16), int(minor, 16))
                    return start, end, parts[1], int(parts[2], 16), (dev, int(parts[4])), path
    except OSError:
        return None
    return None


def _file_span(root: np.ndarray) -> Optional[_FileSpan]:
    """The file behind ``root`` if it lies in one shared file mapping whose file still exists.

    shmstore arrays (``.base`` is ``shmstore.ArrayOwner``), saved archives and ``np.memmap``
    arrays all qualify. A store mapped by the process that built it shows its build name
    (``shmstore-X.part-Y (deleted)``); its sealed name is ``shmstore-X``, checked by
    device and inode.
    """
    if root.base is None or root.nbytes == 0:
        return None
    addr = _data_ptr(root)
    entry = _maps_entry(addr)
    if entry is None:
        return None
    start, end, perms, pgoff, ident, path = entry
    if "s" not in perms or not path.startswith("/") or addr + root.nbytes > end:
        return None  # private (copy-on-write) or anonymous mapping, or spans two mappings
    candidates = [path]
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
        candidates = [re.sub(r"\.part-[^/]*$", "", path)] if ".part-" in path else []
    for cand in candidates:
        try:
            st = os.stat(cand)
            if (st.st_dev, st.st_ino) == ident:
                return _FileSpan(cand, addr - start + pgoff)
        except OSError:
            continue
    return None


# ---------------------------------------------------------------------------------------------
# Per-process cache of mapped segments, emptied when a context's marker (or a segment) goes


_IN_MOVED_FROM = 0x40
_IN_DELETE = 0x200
_IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")


class _Watcher:
    """Calls ``on_gone(path)`` when a watched file is unlinked or renamed away (inotify)."""

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._on_gone = on_gone
        self._fd = -1
        self._wds: dict[int, str] = {}
        self._dirs: dict[str, int] = {}
        self._lock = threading.Lock()
        self.available = True
        self._thread: Optional[threading.Thread] = None

    def watch(self, path: str) -> bool:
        """Start watching ``path``'s directory; False if inotify is unavailable."""
        d = os.path.dirname(path)
        with self._lock:
            if not self.available:
                return False
            if self._fd < 0:
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    self._add = libc.inotify_add_watch
                    self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
                    fd = libc.inotify_init1(os.O_CLOEXEC)
                except (OSError, AttributeError):
                    fd = -1
                if fd < 0:
                    self.available = False
                    return False
                self._fd = fd
                self._thread = threading.Thread(
                    target=self._run, name="shmstore-joblib-watcher", daemon=True
                )
                self._thread.start()
            if d not in self._dirs:
                wd = self._add(self._fd, os.fsencode(d), _IN_DELETE | _IN_MOVED_FROM)
                if wd < 0:
                    return False
                self._dirs[d] = wd
                self._wds[wd] = d
        return True

    def _run(self) -> None:
        fd = self._fd
        while True:
            try:
                buf = os.read(fd, 64 * 1024)
            except OSError:
                return
            pos = 0
            while pos + _EVENT.size <= len(buf):
                wd, mask, _cookie, n = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size : pos + _EVENT.size + n].rstrip(b"\0")
                pos += _EVENT.size + n
                if mask & _IN_Q_OVERFLOW:
                    self._on_gone("")  # events were lost: re-check everything
                elif wd in self._wds:
                    self._on_gone(os.path.join(self._wds[wd], os.fsdecode(name)))

    def reset_after_fork(self) -> None:
        # The thread did not survive the fork; the fd is shared with the parent: let it be.
        self._fd = -1
        self._wds.clear()
        self._dirs.clear()
        self._thread = None
        self._lock = threading.Lock()


class _Cache:
    """What this process keeps mapped between tasks.

    - ``buffers``: context token -> {segment path: uint8 array over the whole segment}
    - ``markers``: marker path -> context token (when the marker goes, the context's buffers go)
    - ``held``: path -> Ref of a result segment this worker made, until the parent unlinked it
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.buffers: dict[str, dict[str, np.ndarray]] = {}
        self.markers: dict[str, str] = {}
        self.held: dict[str, Any] = {}
        self.watcher = _Watcher(self._gone)

    def _gone(self, path: str) -> None:
        with self.lock:
            if not path:  # overflow: check every path we know
                for p in list(self.markers) + list(self.held):
                    if not os.path.exists(p):
                        self._gone(p)
                return
            token = self.markers.pop(path, None)
            if token is not None:
                self.buffers.pop(token, None)
            held = self.held.pop(path, None)
        if held is not None:
            held.close()

    def buffer(self, token: str, marker: str, path: str, load: Callable[[], np.ndarray]) -> Any:
        """The cached buffer of ``path`` for context ``token``, loading it on first use."""
        with self.lock:
            got = self.buffers.get(token, {}).get(path)
        if got is not None:
            return got
        buf = load()
        if not marker or not self.watcher.watch(marker):
            return buf  # no way to learn when the context ends: do not keep it
        with self.lock:
            self.markers[marker] = token
            self.buffers.setdefault(token, {})[path] = buf
        if not os.path.exists(marker):  # the context ended before the watch was set
            self._gone(marker)
        return buf

    def hold(self, path: str, ref: Any) -> None:
        with self.lock:
            self.held[path] = ref
        # Without inotify, sweep() at the start of this worker's next task lets it go.
        self.watcher.watch(path)

    def sweep(self) -> None:
        """Drop held results and contexts whose name is gone (backs up the watcher)."""
        with self.lock:
            gone = [p for p in list(self.held) + list(self.markers) if not os.path.exists(p)]
        for p in gone:
            self._gone(p)

    def drop_token(self, token: str) -> None:
        with self.lock:
            self.buffers.pop(token, None)
            for m in [m for m, t in self.markers.items() if t == token]:
                del self.markers[m]

    def reset_after_fork(self) -> None:
        self.lock = threading.RLock()
        self.buffers = {}
        self.markers = {}
        self.held = {}
        self.watcher.reset_after_fork()


_CACHE = _Cache()
os.register_at_fork(after_in_child=_CACHE.reset_after_fork)


# ---------------------------------------------------------------------------------------------
# Rebuilding arrays from names (runs in the receiving process, inside pickle.loads)

_LOADING = threading.local()  # result segments to unlink once the whole payload is loaded


def _open_segment(path: str) -> np.ndarray:
    name = os.path.basename(path)
    ref = shmstore.Ref.attach(name, dir=os.path.dirname(path))
    try:
        return ref.get()  # uint8 over the whole root buffer; keeps the mapping alive
    finally:
        ref.close()


def _open_file(path: str) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _rebuild_array(
    seg: tuple[str, str, str, str],
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
) -> np.ndarray:
    """A read-only view at ``offset`` of the segment or file ``seg``."""
    kind, path, token, marker = seg
    if kind == "result":
        pending = getattr(_LOADING, "pending", None)
        buf = pending.get(path) if pending is not None else None
        if buf is None:
            ref = shmstore.Ref.attach(os.path.basename(path), dir=os.path.dirname(path))
            buf = ref.get()
            if pending is not None:
                pending[path] = buf
                _LOADING.refs.append(ref)
            else:
                ref.unlink()
                ref.close()
    else:
        load = (lambda: _open_segment(path)) if kind == "segment" else (lambda: _open_file(path))
        buf = _CACHE.buffer(token, marker, path, load)
    out = np.ndarray(shape, dtype, buffer=buf, offset=offset, strides=strides)
    out.flags.writeable = False
    return out


# ---------------------------------------------------------------------------------------------
# Sending arrays by name


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with numpy arrays reduced by ``sender.reduce_array``."""

    def __init__(self, file: io.BytesIO, sender: _Sender) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self._sender = sender

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _ARRAY_TYPES:
            rv = self._sender.reduce_array(obj)
            if rv is not None:
                return rv
        return super().reducer_override(obj)


def _dumps(obj: Any, sender: _Sender) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, sender).dump(obj)
    return buf.getvalue()


@dataclass
class SharingStats:
    """What a :func:`sharing` context (or one call) did."""

    #: segments created for root buffers (one per buffer, whatever the number of slices/tasks)
    segments: int = 0
    #: bytes copied into those segments
    copied_bytes: int = 0
    #: arrays sent by name referring to a file mapping they already lived in (no copy)
    in_place: int = 0
    #: arrays (whole, slices or views) sent by name
    sent_by_name: int = 0
    names: list[str] = field(default_factory=list)


_Seg = tuple[str, str, str, str]  # (kind, path, context token, marker path)
_Known = tuple[np.ndarray, _Seg, int, Optional[np.ndarray]]


class _Sender:
    threshold: int

    def reduce_array(self, a: np.ndarray) -> Optional[tuple[Any, ...]]:
        raise NotImplementedError

    @staticmethod
    def _view_args(
        a: np.ndarray, root: np.ndarray, root_offset: int
    ) -> tuple[int, tuple[int, ...], tuple[int, ...], np.dtype]:
        return (root_offset + _data_ptr(a) - _data_ptr(root), a.shape, a.strides, a.dtype)


class Sharer(_Sender):
    """The parent side of a context: one segment per root buffer, unlinked by :meth:`close`."""

    def __init__(self, threshold: Union[int, str, None] = DEFAULT_THRESHOLD) -> None:
        self.threshold = _parse_bytes(threshold)
        self.token = uuid.uuid4().hex
        self.stats = SharingStats()
        self._lock = threading.RLock()
        # id(root) -> (root, seg, root offset, contiguous copy or None); the root is kept so
        # that its id is not reused while the context lives
        self._roots: dict[int, _Known] = {}
        self._refs: list[Any] = []
        self._marker: Optional[Any] = None
        self._marker_path = ""
        self.closed = False

    def _marker_path_locked(self) -> str:
        if self._marker is None:
            self._marker = shmstore.put(self.token)
            self._marker_path = shmstore._native._store_info(self._marker)["path"]
        return self._marker_path

    def reduce_array(self, a: np.ndarray) -> Optional[tuple[Any, ...]]:
        if a.dtype.hasobject or a.nbytes == 0:
            return None
        root = _root_of(a)
        if not (root.flags.c_contiguous or root.flags.f_contiguous):
            root = a  # e.g. as_strided over a foreign buffer: share this array on its own
        with self._lock:
            if self.closed:
                raise RuntimeError("this shmstore.joblib sharing context has ended")
            known = self._roots.get(id(root))
            if known is None:
                if a.nbytes < self.threshold:
                    return None
                known = self._share_root(root)
                self._roots[id(root)] = known
            _, seg, root_offset, kept = known
            self.stats.sent_by_name += 1
        if kept is not None:  # a non-contiguous array shared as its contiguous copy
            return (_rebuild_array, (seg, 0, kept.shape, kept.strides, kept.dtype))
        return (_rebuild_array, (seg, *self._view_args(a, root, root_offset)))

    def _share_root(self, root: np.ndarray) -> _Known:
        marker = self._marker_path_locked()
        span = _file_span(root)
        if span is not None:
            self.stats.in_place += 1
            return root, ("file", span.path, self.token, marker), span.offset, None
        contiguous = root.flags.c_contiguous or root.flags.f_contiguous
        data = root if contiguous else np.ascontiguousarray(root)
        ref = shmstore.put(_as_bytes(data))
        self._refs.append(ref)
        path = shmstore._native._store_info(ref)["path"]
        self.stats.segments += 1
        self.stats.copied_bytes += root.nbytes
        self.stats.names.append(ref.name)
        log.debug("shared a %s root buffer as %s", _fmt(root.nbytes), ref.name)
        return root, ("segment", path, self.token, marker), 0, (None if contiguous else data)

    def dumps(self, obj: Any) -> bytes:
        return _dumps(obj, self)

    def close(self) -> None:
        """Unlink every segment of this context (workers drop their mappings at once)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            refs, self._refs = self._refs, []
            marker, self._marker = self._marker, None
            self._roots.clear()
        _CACHE.drop_token(self.token)
        for ref in refs:
            ref.unlink()
            ref.close()
        if marker is not None:  # last: its removal tells the workers the context is over
            marker.unlink()
            marker.close()


class _ResultSender(_Sender):
    """The worker side: large results go to new segments held until the parent attaches."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self._roots: dict[int, tuple[np.ndarray, tuple[str, str, str, str], int]] = {}

    def reduce_array(self, a: np.ndarray) -> Optional[tuple[Any, ...]]:
        if a.dtype.hasobject or a.nbytes == 0:
            return None
        root = _root_of(a)
        known = self._roots.get(id(root))
        if known is None:
            if a.nbytes < self.threshold:
                return None
            span = _file_span(root)
            if span is not None:  # e.g. a slice of an input array: no copy
                known = (root, ("file", span.path, "", ""), span.offset)
            else:
                if not (root.flags.c_contiguous or root.flags.f_contiguous):
                    return None  # a rare strided root: pickled by value
                ref = shmstore.put(_as_bytes(root))
                path = shmstore._native._store_info(ref)["path"]
                _CACHE.hold(path, ref)
                known = (root, ("result", path, "", ""), 0)
            self._roots[id(root)] = known
        _, seg, root_offset = known
        return (_rebuild_array, (seg, *self._view_args(a, root, root_offset)))


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """The buffer of a contiguous (C or Fortran) array as a 1-D uint8 view, in memory order."""
    flat = a.ravel(order="K")  # a view for a contiguous array
    assert flat.base is a or flat is a or np.shares_memory(flat, a)
    return flat.view(np.uint8)


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Tasks


def _load_task(payload: bytes, threshold: int) -> _LoadedTask:
    return _LoadedTask(pickle.loads(payload), threshold)


class _LoadedTask:
    """A task batch in the worker; its result goes back through :class:`_Outbox`."""

    def __init__(self, batch: Callable[[], Any], threshold: int) -> None:
        self.batch = batch
        self.threshold = threshold

    def __call__(self) -> _Outbox:
        _CACHE.sweep()  # backs up the watcher: what ended is dropped before the next task
        return _Outbox(self.batch(), self.threshold)


def _load_results(payload: bytes) -> Any:
    """Unpickle a result payload; result segments are unlinked once all of it is loaded."""
    _LOADING.pending = {}
    _LOADING.refs = []
    try:
        return pickle.loads(payload)
    finally:
        refs = _LOADING.refs
        del _LOADING.pending, _LOADING.refs
        for ref in refs:
            ref.unlink()  # we have it mapped: this tells the worker to let go
            ref.close()


class _Outbox:
    """A batch's results, pickled with large arrays by name."""

    def __init__(self, results: Any, threshold: int) -> None:
        self.results = results
        self.threshold = threshold

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_results, (_dumps(self.results, _ResultSender(self.threshold)),))


class _Task:
    """What our backends submit instead of joblib's batch: pickled by our pickler."""

    def __init__(self, batch: Any, sharer: Sharer) -> None:
        self.batch = batch
        self.sharer = sharer

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_task, (self.sharer.dumps(self.batch), self.sharer.threshold))

    def __call__(self) -> Any:  # only if a backend runs it without pickling
        return self.batch()

    def __len__(self) -> int:
        return len(self.batch)


# ---------------------------------------------------------------------------------------------
# Backends

_ACTIVE: contextvars.ContextVar[Optional[Sharer]] = contextvars.ContextVar(
    "shmstore_joblib_sharer", default=None
)


class _SharingMixin:
    """Backend mixin: tasks go through :class:`_Task`; segments end with the call or context."""

    def __init__(
        self,
        *args: Any,
        threshold: Union[int, str, None] = DEFAULT_THRESHOLD,
        sharer: Optional[Sharer] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = threshold
        self._given_sharer = sharer
        self._sharer: Optional[Sharer] = None
        self._owns_sharer = False
        self.stats: Optional[SharingStats] = None

    def configure(self, *args: Any, **kwargs: Any) -> int:
        n = super().configure(*args, **kwargs)  # type: ignore[misc]
        if self._sharer is None or self._sharer.closed:
            sharer = self._given_sharer or _ACTIVE.get()
            self._owns_sharer = sharer is None
            self._sharer = sharer if sharer is not None else Sharer(self._threshold)
            self.stats = self._sharer.stats
        return int(n)

    def submit(self, func: Any, callback: Any = None) -> Any:
        assert self._sharer is not None, "configure() was not called"
        return super().submit(_Task(func, self._sharer), callback)  # type: ignore[misc]

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


class GuardedThreadingBackend(ThreadingBackend):
    """joblib's threading backend, every task wrapped with :func:`shmstore.leaks.gc_guard`."""

    def __init__(self, *args: Any, guard: Optional[GcGuard] = None, **kwargs: Any) -> None:
        kwargs.pop("threshold", None)
        kwargs.pop("sharer", None)
        super().__init__(*args, **kwargs)
        self.guard = guard

    def submit(self, func: Any, callback: Any = None) -> Any:
        return super().submit(gc_guard(func, guard=self.guard), callback)

    def terminate(self) -> None:
        super().terminate()
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


def _make_backend(
    backend: Any,
    threshold: Union[int, str, None],
    sharer: Optional[Sharer],
    guard: Optional[GcGuard] = None,
) -> Any:
    if hasattr(backend, "Pool") and hasattr(backend, "Lock"):  # a multiprocessing context
        return ShmMultiprocessingBackend(threshold=threshold, sharer=sharer, context=backend)
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
    return cls(threshold=threshold, sharer=sharer)


class Parallel(joblib.Parallel):  # type: ignore[misc]
    """``joblib.Parallel`` with arrays above ``threshold`` bytes sent by name.

    Same arguments as ``joblib.Parallel``, plus ``threshold`` (bytes, or a string like
    ``"1M"``) and ``guard`` (the :class:`~shmstore.leaks.GcGuard` of the threading backend;
    the process-wide one by default). ``backend`` is ``"loky"`` (default),
    ``"multiprocessing"``, ``"threading"`` or a multiprocessing context. The segments end when
    the call ends, or with the enclosing :func:`sharing` context. ``max_nbytes``/``mmap_mode``
    have no effect (nothing is left for joblib's memmapping).
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
        backend = _make_backend(backend, threshold, None, guard)
        super().__init__(n_jobs=n_jobs, backend=backend, **kwargs)

    @property
    def stats(self) -> Optional[SharingStats]:
        """Counters of the last call (None before the first call, or with threads)."""
        return getattr(self._backend, "stats", None)


@contextlib.contextmanager
def sharing(
    backend: Any = "loky",
    *,
    threshold: Union[int, str, None] = DEFAULT_THRESHOLD,
    n_jobs: Optional[int] = None,
    guard: Optional[GcGuard] = None,
    **config: Any,
) -> Iterator[SharingStats]:
    """Make every ``joblib.Parallel`` call in the block send arrays by name.

    Within the block, ``joblib.Parallel(...)`` without an explicit ``backend`` uses ours (via
    ``joblib.parallel_config``); all calls share the same segments, so an array passed to
    several calls is copied once. The segments are unlinked when the block ends. Yields the
    :class:`SharingStats` of the block. ``guard`` is the threading backend's
    :class:`~shmstore.leaks.GcGuard`. Extra keyword arguments go to ``parallel_config``.
    """
    sharer = Sharer(threshold)
    token = _ACTIVE.set(sharer)
    try:
        with joblib.parallel_config(
            backend=_make_backend(backend, threshold, sharer, guard), n_jobs=n_jobs, **config
        ):
            yield sharer.stats
    finally:
        _ACTIVE.reset(token)
        sharer.close()
