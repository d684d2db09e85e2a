"""One copy per machine past one machine: store handles that fetch themselves.

A handle pickles by name, which means nothing on another machine. :func:`share` wraps a store
in a :class:`NodeRef`: its name, kind, size, content digest (xxh3-128 of the sealed archive)
and *sources* for its bytes, in order: a saved archive on a shared file system
(:class:`FileSource`), the engine (e.g. ``shmstore.dask``'s chunks held by Dask workers), or
any object with a ``chunks()`` method. Unpickling a NodeRef *is* resolving it, and gives back
the store handle itself (a ``SharedList``, ``SharedDict`` or ``Ref``), so code that receives
it needs no change:

- on the machine that made the store: attach to it by path;
- elsewhere, if this machine's segment directory already holds a segment of that name with
  the same header (kind, size, checksum): attach to it;
- else take this machine's fetch lock (``flock`` on ``fetch-<dev>-<inode>.lock`` in this
  user's state directory, one per segment directory, where no other user can plant anything;
  the kernel releases it if its holder dies), look again (another process
  may have fetched it meanwhile), fetch the bytes once into a private ``.part`` file, verify
  the length and the digest, seal and publish the copy under the store's name (``link``,
  never over an existing name), release the lock. The other processes of the machine wait
  for the lock (``SHMSTORE_FETCH_TIMEOUT`` seconds at most, default 600, then
  ``TimeoutError`` naming the lock) and attach.

A fetched copy is registered with this machine's supervisor before its first byte exists,
exactly like a store built here: it is removed once no process of the machine uses it, after
any kind of death, and never while one does. It is sealed mode 0500 instead of 0400 (the
owner-execute bit marks "fetched"; :func:`info` and ``shmstore inspect`` show it).

Every process keeps the handles it resolved (so a worker running task after task does not let
the copy go between tasks and fetch it again); :func:`release` drops them.

Machine identity (:func:`node_id`): processes that see the same segment directory are one
machine: boot id + device and inode of the directory, or ``$SHMSTORE_NODE_ID`` when set.

A saved archive on a shared file system can also be *mapped* in place
(``FileSource(path, mode="map")``): the page cache then holds one copy per machine, with no
fetch. The default is ``"copy"`` (into the segment directory), because a copy in tmpfs stays
resident (page-cache pages of an NFS/Lustre file can be evicted and re-read over the network
in the middle of an epoch), cannot change under the readers if someone rewrites the shared
file, and is counted and cleaned up by the supervisor like any segment.

>>> import shmstore, shmstore.cluster as sc, pickle
>>> lst = shmstore.SharedList([{"a": 1}, {"a": 2}])
>>> ref = sc.share(lst)
>>> pickle.loads(pickle.dumps(ref))[1]["a"]   # unpickling resolves: here, an attach
2
>>> _ = sc.release(); lst.unlink()
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, Union, runtime_checkable

import shmstore
from shmstore import _native
from shmstore._util import HANDLE_CLASSES

__all__ = [
    "FileSource",
    "NodeRef",
    "Source",
    "info",
    "node_id",
    "release",
    "resolve",
    "share",
    "stats",
]

log = logging.getLogger("shmstore.cluster")

#: Bytes read from a source at a time.
CHUNK = 16 << 20


@runtime_checkable
class Source(Protocol):
    """Where a machine can get the archive's bytes: anything picklable with ``chunks()``."""

    def chunks(self) -> Iterable[bytes]:
        """The archive's bytes, in order, in pieces."""


@dataclass(frozen=True)
class FileSource:
    """A saved archive (``store.save(path)``) on a file system every machine mounts.

    ``mode="copy"`` (default): copied into this machine's segment directory once.
    ``mode="map"``: mapped in place (one copy per machine in the page cache; no fetch).
    """

    path: str
    mode: str = "copy"

    def __post_init__(self) -> None:
        if self.mode not in ("copy", "map"):
            raise ValueError(f"FileSource mode must be 'copy' or 'map', not {self.mode!r}")

    def chunks(self) -> Iterator[bytes]:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise shmstore.InvalidInputError(f"{self.path}: not a regular file")
            for _ in range(1 << 40):
                b = f.read(CHUNK)
                if not b:
                    return
                yield b


def node_id() -> str:
    """This machine's identity: ``$SHMSTORE_NODE_ID``, else boot id + device:inode of the
    segment directory (processes that see the same segment directory share segments).

    >>> node_id() == node_id()
    True
    """
    env = os.environ.get("SHMSTORE_NODE_ID")
    if env:
        return env
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    d = _segment_dir()
    try:
        st = os.stat(d)
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        where = str(d)
    return f"{boot}/{where}"


def _segment_dir() -> Path:
    return Path(_native._search_dirs()[0])


@dataclass(frozen=True)
class NodeRef:
    """A store that resolves itself on any machine (see the module docs).

    Pickling a NodeRef and unpickling it gives the store handle, resolved on the machine
    that unpickles it; :meth:`resolve` does the same without pickling.
    """

    name: str
    kind: str
    nbytes: int
    checksum: str
    digest: str
    sources: tuple[Any, ...] = ()
    origin_node: str = ""
    origin_path: str = ""

    def resolve(self, *, timeout: Optional[float] = None) -> Any:
        """The store on this machine: attached, or fetched once per machine."""
        return resolve(self, timeout=timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self._state(),))

    def _state(self) -> tuple[Any, ...]:
        return (
            self.name,
            self.kind,
            self.nbytes,
            self.checksum,
            self.digest,
            self.sources,
            self.origin_node,
            self.origin_path,
        )

    @classmethod
    def _from_state(cls, state: tuple[Any, ...]) -> NodeRef:
        return cls(*state)


def _unpickle(state: tuple[Any, ...]) -> Any:
    if _in_dask_scheduler():
        return _Unresolved(state)
    ref = NodeRef._from_state(state)
    if _on_event_loop():
        # A Dask worker unpickles a task's arguments on its event loop: a fetch there would
        # block the loop that serves the chunks (its own included) and run a client on it.
        return resolve(ref, fetch=False)
    return resolve(ref)


class _Unresolved:
    """A NodeRef unpickled by a process that only passes it on (a Dask scheduler, which
    unpickles every task to schedule it, and pickles it again for the worker): it must not
    fetch or pin a copy on the scheduler's machine, and it pickles as the NodeRef again.
    ``resolve(handle)`` opens the store here all the same, when that is what is wanted (a
    script that hosts a ``LocalCluster`` and unpickles a handle itself)."""

    __slots__ = ("state",)

    def __init__(self, state: tuple[Any, ...]) -> None:
        self.state = state

    @property
    def ref(self) -> NodeRef:
        return NodeRef._from_state(self.state)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self.state,))

    def __repr__(self) -> str:
        return (
            f"<unresolved shmstore NodeRef {self.state[0]!r}: unpickled in a Dask scheduler's "
            "process, not opened here; shmstore.cluster.resolve(it) opens it>"
        )


_GONE = {"stopping", "stopped", "closing", "closing_gracefully", "closed", "failed"}


def _live(module: str, cls: str) -> bool:
    """A running instance of Dask's ``module.cls`` exists in this process (closed ones may
    linger in the class's weak set until collected)."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    try:
        instances = list(getattr(mod, cls)._instances)
    except (AttributeError, TypeError):
        return False
    return any(getattr(getattr(i, "status", None), "name", "") not in _GONE for i in instances)


def _on_event_loop() -> bool:
    """True on the running event loop of a process that hosts a Dask worker or Nanny (not,
    e.g., in a notebook, whose cells also run on an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return _live("distributed.worker", "Worker") or _live("distributed.nanny", "Nanny")


def _in_dask_scheduler() -> bool:
    """True in a process that runs a Dask scheduler and no Dask worker (in a process with
    both, e.g. ``LocalCluster(processes=False)``, everything is on one machine: resolving is
    an attach)."""
    return _live("distributed.scheduler", "Scheduler") and not _live("distributed.worker", "Worker")


def _is_arena_chunk(handle: Any) -> bool:
    """Whether ``handle`` is a chunk of an arena (a small ``put``; named ``<arena>@...``)."""
    return isinstance(handle, shmstore.Ref) and "@" in handle.name


def _shareable(handle: Any) -> Any:
    """``handle`` itself, or for a chunk of this process's arena (a small ``put``) a segment
    of its own holding the same value: other machines cannot name a chunk. The value is small
    (an arena takes arrays up to 8 MiB, other objects up to 1 MiB), so the copy is cheap
    next to sending it to another machine."""
    if _is_arena_chunk(handle):
        return shmstore.put(handle.get(), arena=False)
    return handle


def share(
    handle: Any,
    *,
    sources: Iterable[Any] = (),
    path: Union[str, os.PathLike[str], None] = None,
    mode: str = "copy",
) -> NodeRef:
    """A :class:`NodeRef` for ``handle`` (a SharedList, SharedDict or Ref).

    A ``Ref`` to a chunk of this process's arena (a small ``put``) is first copied into a
    segment of its own, since no other machine can name a chunk; that segment is what is
    shared.

    ``path``: also save the archive there (a shared file system) and use it as the first
    source, with ``mode`` "copy" or "map" (see :class:`FileSource`); an existing file there
    that is this very archive is reused. ``sources``: more sources, tried in order.
    """
    if not isinstance(handle, shmstore.StoreHandle):
        raise TypeError(f"share() takes a SharedList, SharedDict or Ref, not {type(handle)!r}")
    handle = _shareable(handle)
    ident = _native._cluster_identity(handle, True)
    srcs: list[Any] = []
    if path is not None:
        p = os.path.abspath(os.fspath(path))
        if not _same_archive_file(p, ident):
            handle.save(p)
        srcs.append(FileSource(p, mode))
    for s in sources:
        if not isinstance(s, Source):
            raise TypeError(f"a source needs a chunks() method; got {type(s)!r}")
        srcs.append(s)
    name = str(ident["name"])
    if name == str(ident["path"]):  # opened from a saved file: copies get a segment name
        name = f"shmstore-{ident['digest']}"
    ref = NodeRef(
        name=name,
        kind=str(ident["kind"]),
        nbytes=int(ident["nbytes"]),
        checksum=str(ident["checksum"]),
        digest=str(ident["digest"]),
        sources=tuple(srcs),
        origin_node=node_id(),
        origin_path=str(ident["path"]),
    )
    with _lock:
        _held.setdefault(ref.digest, handle)
    return ref


def _same_archive_file(path: str, ident: dict[str, Any]) -> bool:
    if not os.path.exists(path):
        return False
    try:
        h = HANDLE_CLASSES[str(ident["kind"])].open(path)
    except shmstore.ShmStoreError:
        return False
    mine = _native._cluster_identity(h, False)
    same = mine["checksum"] == ident["checksum"] and mine["nbytes"] == ident["nbytes"]
    h.close()
    return bool(same)


# ---------------------------------------------------------------------------------------------
# Resolving

_lock = threading.Lock()
_held: dict[str, Any] = {}
_counts = {"fetched": 0, "attached": 0, "mapped": 0, "origin": 0}


def stats() -> dict[str, int]:
    """How this process resolved NodeRefs: ``fetched`` (it made this machine's copy),
    ``attached`` (a copy was there), ``mapped`` (a shared file, in place), ``origin``
    (the machine that built it), ``held`` (handles kept now).

    >>> sorted(stats())
    ['attached', 'fetched', 'held', 'mapped', 'origin']
    """
    with _lock:
        out = dict(_counts)
        out["held"] = len(_held)
    return out


def release(ref: Union[NodeRef, str, None] = None) -> int:
    """Drop the handles this process keeps for ``ref`` (a NodeRef or digest), or all of them.
    The machine's copy goes once no process there uses it. Returns how many were dropped."""
    with _lock:
        if ref is None:
            n = len(_held)
            _held.clear()
            return n
        digest = ref.digest if isinstance(ref, NodeRef) else ref
        return 1 if _held.pop(digest, None) is not None else 0


def _timeout(given: Optional[float]) -> float:
    if given is not None:
        return given
    try:
        return float(os.environ.get("SHMSTORE_FETCH_TIMEOUT", "600"))
    except ValueError:
        return 600.0


def _matches(handle: Any, ref: NodeRef) -> bool:
    ident = _native._cluster_identity(handle, False)
    return bool(
        ident["checksum"] == ref.checksum
        and ident["nbytes"] == ref.nbytes
        and ident["kind"] == ref.kind
    )


def _attach_local(ref: NodeRef, d: Path) -> Any:
    """The copy in ``d`` if there is one (None if not); a different store under that name is
    an error, never used."""
    try:
        h = HANDLE_CLASSES[ref.kind].attach(ref.name, dir=d)
    except shmstore.StoreNotFoundError:
        return None
    if not _matches(h, ref):
        h.close()
        raise shmstore.StoreExistsError(
            f"{d / ref.name} is another store than the one shared under that name "
            f"(digest {ref.digest}); remove it (`shmstore rm {ref.name}`) or share under "
            "another name"
        )
    return h


def resolve(ref: Any, *, timeout: Optional[float] = None, fetch: bool = True) -> Any:
    """The store ``ref`` (a NodeRef) names, on this machine (see the module docs).
    ``fetch=False``: only attach (StoreNotFoundError if this machine has no copy yet). A
    handle unpickled in a Dask scheduler's process, which stays unopened there, is opened."""
    if isinstance(ref, _Unresolved):
        ref = ref.ref
    if not isinstance(ref, NodeRef):
        raise TypeError(f"resolve() takes a NodeRef, not {type(ref).__name__}")
    if ref.kind not in HANDLE_CLASSES:
        raise shmstore.InvalidInputError(f"unknown store kind {ref.kind!r}")
    with _lock:
        h = _held.get(ref.digest)
    if h is not None and not h.closed:
        return h
    how, h = _resolve(ref, _timeout(timeout), fetch)
    with _lock:
        _counts[how] += 1
        _held[ref.digest] = h
    log.debug("%s %s (%s)", how, ref.name, ref.digest)
    return h


_split_warned: set[tuple[str, str]] = set()


def _warn_if_split_host(ref: NodeRef, here: str) -> None:
    """Log once per process (and pair of directories) when this process runs on the host that
    shared ``ref`` (same boot id) but sees another segment directory: each directory then
    gets a copy of its own, and the host holds the store twice. Intended between containers
    with their own /dev/shm; otherwise a ``SHMSTORE_DIR`` that differs between processes."""
    if os.environ.get("SHMSTORE_NODE_ID") or "/" not in ref.origin_node or "/" not in here:
        return
    boot, _, origin_dir = ref.origin_node.partition("/")
    my_boot, _, my_dir = here.partition("/")
    if boot != my_boot or boot == "?" or origin_dir == my_dir:
        return
    with _lock:
        if (origin_dir, my_dir) in _split_warned:
            return
        _split_warned.add((origin_dir, my_dir))
    log.warning(
        "store %r was shared by a process of this same host (boot id %s) that uses another "
        "segment directory (device:inode %s; here %s, %s): each directory gets its own "
        "copy. Give every process of the host the same SHMSTORE_DIR (or set "
        "SHMSTORE_NODE_ID where this is meant, e.g. containers with a /dev/shm each)",
        ref.name,
        boot,
        origin_dir,
        _segment_dir(),
        my_dir,
    )


def _resolve(ref: NodeRef, timeout: float, fetch: bool = True) -> tuple[str, Any]:
    here = node_id()
    _warn_if_split_host(ref, here)
    if ref.origin_path and ref.origin_node == here:
        flag = "s" if os.path.basename(ref.origin_path) == ref.name else ""  # segment or file
        try:
            h = _native._rebuild(HANDLE_CLASSES[ref.kind].__name__, ref.origin_path, flag)
            if _matches(h, ref):
                return "origin", h
            h.close()
        except shmstore.StoreNotFoundError:
            pass
    for s in ref.sources:
        if isinstance(s, FileSource) and s.mode == "map":
            h = HANDLE_CLASSES[ref.kind].open(s.path)
            if not _matches(h, ref):
                h.close()
                raise shmstore.CorruptStoreError(
                    f"{s.path} holds another archive than store {ref.name!r} "
                    f"(digest {ref.digest}); it was rewritten after share()"
                )
            return "mapped", h
    d = _segment_dir()
    h = _attach_local(ref, d)
    if h is not None:
        return "attached", h
    if not fetch:
        raise shmstore.StoreNotFoundError(
            f"store {ref.name!r} is not on this machine ({node_id()}) yet, and it cannot be "
            "fetched here: this is an event loop's thread (a Dask worker unpickling a task). "
            "Share it with shmstore.dask.share(..., pre_attach=True) (the default: each "
            "worker fetches it when it starts), or pass the NodeRef's state and resolve it "
            "inside the task"
        )
    with _FetchLock(d, timeout):
        h = _attach_local(ref, d)
        if h is not None:
            return "attached", h
        return "fetched", _fetch(ref, d)


def _fetch(ref: NodeRef, d: Path) -> Any:
    if not ref.sources:
        raise shmstore.StoreNotFoundError(
            f"store {ref.name!r} is not on this machine ({node_id()}) and its NodeRef has no "
            "source to fetch it from: share it with path=<shared file> or a source"
        )
    errors = []
    for s in ref.sources:
        try:
            return _native._import_archive(
                HANDLE_CLASSES[ref.kind].__name__, ref.name, d, ref.nbytes, ref.digest, s.chunks()
            )
        except (OSError, shmstore.ShmStoreError, ValueError) as e:
            if isinstance(e, shmstore.OutOfSharedMemoryError):
                raise
            errors.append(f"{s!r}: {e}")
            log.warning("fetching %s from %r failed: %s", ref.name, s, e)
    raise shmstore.StoreNotFoundError(
        f"could not fetch store {ref.name!r} from any source: " + "; ".join(errors)
    )


class _FetchLock:
    """This machine's fetch lock for segment directory ``d``: ``flock`` on
    ``fetch-<dev>-<inode>.lock`` in this user's state directory (the supervisor's: 0700 and
    verified, so no other user can plant a FIFO, a symlink or a locked file there, as they
    could at the lock's old place in /dev/shm). The segment directory must be this user's and
    not writable by others, or a sticky shared directory such as /dev/shm."""

    def __init__(self, d: Path, timeout: float) -> None:
        self.dir = d
        self.timeout = timeout
        self.fd = -1

    def __enter__(self) -> _FetchLock:
        uid = os.geteuid()
        try:
            st = os.stat(self.dir)
        except OSError as e:
            raise shmstore.StoreIOError(f"segment directory {self.dir}: {e}") from e
        own = st.st_uid == uid and not st.st_mode & 0o022
        shared_sticky = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
        if not stat.S_ISDIR(st.st_mode) or not (own or shared_sticky):
            raise shmstore.StorePermissionError(
                f"segment directory {self.dir} is neither this user's (and closed to others) "
                "nor a sticky shared directory like /dev/shm: refusing to fetch into it"
            )
        path = _native._state_dir() / f"fetch-{st.st_dev}-{st.st_ino}.lock"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise shmstore.StorePermissionError(f"fetch lock {path}: {e}") from e
        lst = os.fstat(fd)
        if not stat.S_ISREG(lst.st_mode) or lst.st_uid != uid or lst.st_mode & 0o077:
            os.close(fd)
            raise shmstore.StorePermissionError(
                f"fetch lock {path} is not this user's private regular file: remove it"
            )
        deadline = time.monotonic() + self.timeout
        wait = 0.001
        for _ in range(10_000_000):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(
                    f"another process of this machine held the fetch lock {path} for more "
                    f"than {self.timeout:g} s (SHMSTORE_FETCH_TIMEOUT); is a fetch stuck?"
                )
            time.sleep(wait)
            wait = min(wait * 2, 0.1)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        # Unlocked before the close: closing alone would leave the lock held by any process
        # another thread forked meanwhile (a flock belongs to the open file, which the
        # child's copy of the descriptor keeps), and this machine's next fetch would wait
        # for that child to exit.
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1


def info(handle: Any) -> dict[str, Any]:
    """Name, kind, size, content digest and whether this machine's copy was fetched.

    >>> lst = shmstore.SharedList([1])
    >>> info(lst)["fetched"], len(info(lst)["digest"])
    (False, 32)
    >>> lst.unlink()
    """
    if isinstance(handle, _Unresolved):
        raise TypeError(
            f"{handle.state[0]!r} was unpickled in a process that runs a Dask scheduler (and "
            "no worker), where shmstore leaves handles unopened, as the scheduler only passes "
            "tasks on; call info() in a worker or a client, or open it here first: "
            "info(shmstore.cluster.resolve(handle))"
        )
    return dict(_native._cluster_identity(handle, True))
