"""Ray: one copy of a store per node, in Ray's own object store, read in place.

A handle pickles by name, which means nothing on another node. Ray's object store already
keeps one copy of an object per node in shared memory, moves it between nodes, counts its
references and spills it; but it reads lists and dicts back by unpickling them in every
worker (a copy per worker). :func:`share` puts a store's *archive* there instead, as one
buffer, and gives back a :class:`RayShared`: a small object (a few hundred bytes) that
pickles as its ``ObjectRef``. Unpickled in a Ray worker (a task's argument, an actor's
state), it *is* the store's handle, a ``SharedList``, ``SharedDict`` or ``Ref`` reading in
place from Ray's shared memory on that node::

    import ray, shmstore, shmstore.ray

    ray.init()
    with shmstore.SharedList(records) as lst:
        shared = shmstore.ray.share(lst)      # one copy into Ray's object store

    @ray.remote
    def score(lst, i):                        # lst: a SharedList, lazily read in place
        return lst[i]["area"]

    ray.get([score.remote(shared, i) for i in range(1000)])

What happens:

- ``share`` copies the archive's bytes from the store's pages into Ray's object store once
  (``ray.put`` of a pickle-protocol-5 out-of-band buffer: no copy in between);
- a worker unpickling the ``RayShared`` does ``ray.get`` of it: Ray brings the object to the
  node once (one transfer per node, however many workers ask), and hands out its buffer in
  the node's shared memory, which :meth:`StoreHandle.from_buffer` reads in place with the
  usual checks (header and metadata at open, each block of records on first access);
- each process opens it once per ``ObjectRef`` and keeps the handle while it is in use, and
  :data:`KEEP` seconds after its last use (``SHMSTORE_RAY_KEEP``, default 30): a worker
  running task after task opens it once.

Why Ray's copy and not a copy of our own: Ray already keeps exactly one copy per node in
shared memory, with transfer, reference counting and spilling; a second copy in a shmstore
segment would double the memory of every node for nothing. The cost is that the store's
size counts in Ray's object store memory (``object_store_memory``, by default 30% of RAM):
size it for the store, or Ray spills other objects (or refuses the put).

Lifetime: the object lives while any ``ObjectRef`` to it does: the ``RayShared`` in the
process that shared it, its copies in pending tasks' arguments, in actors that keep it.
A node's copy is kept while a worker there holds the handle (Ray never evicts or spills an
object a process is reading); after that, until Ray frees the object (every reference
gone) or needs the memory. A worker holds the handle while the task or actor holding it,
any view or array read from it, or the :data:`KEEP` delay after its last unpickling does;
:func:`release` lets go of the held handles now. The segment ``share`` read from is not
needed once it returns: close (or unlink) it, as the ``with`` block above does, so that
the node that shared it does not hold the store twice.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from typing import Any, Optional

from shmstore import _versions
from shmstore._native import StoreHandle
from shmstore._util import HANDLE_CLASSES

__all__ = ["KEEP", "RayShared", "release", "share", "stats"]

log = logging.getLogger("shmstore.ray")


def _keep_from_env() -> float:
    raw = os.environ.get("SHMSTORE_RAY_KEEP", "30")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"SHMSTORE_RAY_KEEP={raw!r} is not a number of seconds (e.g. 30, or 0 to keep a "
            "store only while something uses it)"
        ) from None
    if value < 0:
        raise ValueError(f"SHMSTORE_RAY_KEEP={raw!r} must be >= 0 seconds")
    return value


#: Seconds a process keeps a store it opened after its last unpickling there
#: (``SHMSTORE_RAY_KEEP``, default 30; 0: only while something uses it).
KEEP = _keep_from_env()


def _ray() -> Any:
    """The ``ray`` module, checked to be installed in a version this module can serve."""
    _versions.require("ray", "shmstore.ray")
    import ray

    return ray


class _Archive:
    """What goes into Ray's object store: the archive's bytes as one out-of-band buffer
    (pickle protocol 5, which Ray's serializer uses), read back as the store's handle."""

    __slots__ = ("buffer", "kind")

    def __init__(self, kind: str, buffer: memoryview) -> None:
        self.kind = kind
        self.buffer = buffer

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if not isinstance(protocol, int) or protocol < 5:
            raise TypeError(
                "a shared archive is pickled with protocol 5 (out-of-band buffers), as "
                "Ray's serializer does; share it with shmstore.ray.share"
            )
        return _open_archive, (self.kind, pickle.PickleBuffer(self.buffer))


def _open_archive(kind: str, buffer: Any) -> StoreHandle:
    """The handle over the buffer Ray hands out (its shared memory on this node)."""
    cls = HANDLE_CLASSES.get(kind)
    if cls is None:
        raise TypeError(f"unknown store kind {kind!r} in a shared archive")
    return cls.from_buffer(buffer)


class RayShared:
    """A store in Ray's object store (made by :func:`share`). Pickles as its ``ObjectRef``;
    unpickling it in a Ray process gives the store's handle there (:meth:`get`).

    ``ref`` is the ``ObjectRef``; ``kind``, ``name`` and ``nbytes`` describe the store that
    was shared (``name``: the segment it came from, for messages)."""

    __slots__ = ("__weakref__", "kind", "name", "nbytes", "ref")

    def __init__(self, ref: Any, kind: str, name: str, nbytes: int) -> None:
        self.ref = ref
        self.kind = kind
        self.name = name
        self.nbytes = nbytes

    def get(self) -> StoreHandle:
        """The store's handle in this process (opened once per process, see :data:`KEEP`)."""
        return _resolve(self.ref, self.kind)

    def __reduce__(self) -> tuple[Any, ...]:
        return _resolve, (self.ref, self.kind)

    def __repr__(self) -> str:
        return f"RayShared({self.kind}, name={self.name!r}, nbytes={self.nbytes})"


def share(handle: StoreHandle) -> RayShared:
    """Put ``handle``'s store into Ray's object store once and return a :class:`RayShared`
    to pass to tasks and actors (see the module docs). Needs a connected Ray
    (``ray.init()``). The handle stays usable; close it when this process no longer reads
    it, so that this node does not hold the store twice."""
    ray = _ray()
    if not isinstance(handle, StoreHandle):
        raise TypeError(
            f"shmstore.ray.share takes a store handle (SharedList, SharedDict, Ref), not "
            f"{type(handle).__name__}: build one first (e.g. shmstore.SharedList(records))"
        )
    if not ray.is_initialized():
        raise RuntimeError("shmstore.ray.share needs a connected Ray: call ray.init() first")
    kind = handle.kind
    archive = handle.archive()
    try:
        ref = ray.put(_Archive(kind, archive))
    finally:
        archive.release()
    log.debug("shared %s (%d bytes) as %s", handle.name, handle.nbytes, ref.hex())
    return RayShared(ref, kind, handle.name, handle.nbytes)


class _Held:
    """An open store of this process: the handle (weakly once :data:`KEEP` is over) and
    when it was last handed out."""

    __slots__ = ("handle", "last", "weak")

    def __init__(self, handle: StoreHandle) -> None:
        self.handle: Optional[StoreHandle] = handle if KEEP > 0 else None
        self.weak = weakref.ref(handle)
        self.last = time.monotonic()

    def live(self) -> Optional[StoreHandle]:
        h = self.weak()
        return None if h is None or h.closed else h


_lock = threading.Lock()
#: ObjectRef id -> the store opened from it in this process.
_open: dict[bytes, _Held] = {}
#: One lock per ObjectRef being opened: concurrent unpicklings in one process (threads of
#: an actor) open it once.
_opening: dict[bytes, threading.Lock] = {}
_counts = {"opened": 0, "reused": 0}
_sweeper: Optional[threading.Thread] = None


def _resolve(ref: Any, kind: str) -> StoreHandle:
    """Unpickling a :class:`RayShared`: this process's handle of the store ``ref`` holds."""
    key = ref.binary()
    with _lock:
        h = _hit(key)
        if h is not None:
            return h
        gate = _opening.setdefault(key, threading.Lock())
    with gate:
        with _lock:
            h = _hit(key)
            if h is not None:
                return h
        try:
            h = _ray().get(ref)
        except Exception as e:
            if _ray().is_initialized():
                raise
            raise RuntimeError(
                "a shmstore.ray.RayShared can only be opened in a process connected to the "
                "Ray cluster that holds it (a task, an actor, or a driver after ray.init)"
            ) from e
        if not isinstance(h, StoreHandle) or h.kind != kind:
            raise TypeError(
                f"ObjectRef {ref.hex()} does not hold a shared {kind} store "
                f"(it holds {type(h).__name__}): was it made by shmstore.ray.share?"
            )
        with _lock:
            _open[key] = _Held(h)
            _opening.pop(key, None)
            _counts["opened"] += 1
            _start_sweeper()
    log.debug("opened %s (%d bytes) from Ray's object store", ref.hex(), h.nbytes)
    return h


def _hit(key: bytes) -> Optional[StoreHandle]:
    """The open handle for ``key`` (held again for :data:`KEEP`), or None. Under ``_lock``."""
    held = _open.get(key)
    if held is None:
        return None
    h = held.live()
    if h is None:
        del _open[key]
        return None
    if KEEP > 0:
        held.handle = h
    held.last = time.monotonic()
    _counts["reused"] += 1
    return h


def _start_sweeper() -> None:
    """Start the thread that lets go of handles :data:`KEEP` seconds after their last use
    (under ``_lock``; one thread, which ends when nothing is held)."""
    global _sweeper
    if KEEP <= 0 or _sweeper is not None:
        return
    _sweeper = threading.Thread(target=_sweep, name="shmstore-ray-keep", daemon=True)
    _sweeper.start()


def _sweep() -> None:
    while True:
        time.sleep(max(min(KEEP / 2, 5.0), 0.05))
        dropped = []
        with _lock:
            now = time.monotonic()
            for held in _open.values():
                if held.handle is not None and now - held.last >= KEEP:
                    dropped.append(held.handle)
                    held.handle = None
            for key in [k for k, v in _open.items() if v.handle is None and v.live() is None]:
                del _open[key]
            done = not any(v.handle is not None for v in _open.values())
            if done:
                global _sweeper
                _sweeper = None  # a store opened from now on starts a new thread
        del dropped  # the last references go here, outside the lock
        if done:
            return


def release() -> int:
    """Let go of the stores this process keeps (:data:`KEEP`) now; those still in use (a
    task's argument, an actor's, a view) stay open until that use ends. Returns how many
    were let go of.

    >>> release()
    0
    """
    with _lock:
        dropped = [v.handle for v in _open.values() if v.handle is not None]
        for v in _open.values():
            v.handle = None
    return len(dropped)


def stats() -> dict[str, int]:
    """How this process opened shared stores: ``opened`` (a ``ray.get`` and an open),
    ``reused`` (an unpickling that found the store open), ``held`` (kept now, for
    :data:`KEEP`), ``open`` (open now, held or in use).

    >>> sorted(stats())
    ['held', 'open', 'opened', 'reused']
    """
    with _lock:
        out = dict(_counts)
        out["held"] = sum(v.handle is not None for v in _open.values())
        out["open"] = sum(v.live() is not None for v in _open.values())
    return out
