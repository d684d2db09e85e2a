"""Type stubs for the Rust extension `shmstore._native` (kept by hand; checked by stubtest)."""

from __future__ import annotations

import os
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence, ValuesView
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, SupportsIndex, TypeVar, final, overload

from typing_extensions import Buffer, disjoint_base

__all__ = [
    "_ARENA_MAGIC",
    "_ARENA_RECLAIM_BATCH",
    "_CHANNEL_MAGIC",
    "_CREATOR_PID_AT",
    "_SEGMENT_PREFIX",
    "ArrayOwner",
    "Channel",
    "CorruptStoreError",
    "DictView",
    "DictViewIterator",
    "InvalidInputError",
    "ListView",
    "ListViewIterator",
    "OutOfSharedMemoryError",
    "Ref",
    "SharedDict",
    "SharedDictIterator",
    "SharedList",
    "SharedListIterator",
    "ShmStoreError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreHandle",
    "StoreIOError",
    "StoreNotFoundError",
    "StorePermissionError",
    "UnsupportedTypeError",
    "__version__",
    "_arena_gil_handbacks",
    "_arena_info",
    "_arena_release",
    "_arena_simulate",
    "_arena_usage",
    "_cleanup_at_exit",
    "_cluster_identity",
    "_crafted_archive",
    "_crafted_names",
    "_fast_paths",
    "_flush_drops",
    "_fuzz_case",
    "_import_archive",
    "_rebuild",
    "_rebuild_channel",
    "_rebuild_chunk",
    "_rebuild_view",
    "_remove_segment",
    "_search_dirs",
    "_segment_name",
    "_segment_paths",
    "_segment_users",
    "_state_dir",
    "_store_info",
    "_supervisor_main",
    "gc_unreachable",
    "put",
    "supervisor_info",
    "sweep",
]

__version__: str
_SEGMENT_PREFIX: str
_ARENA_MAGIC: bytes
_CHANNEL_MAGIC: bytes
_CREATOR_PID_AT: int
_ARENA_RECLAIM_BATCH: int

_S = TypeVar("_S", bound="StoreHandle")
_T_co = TypeVar("_T_co", covariant=True)
_K = TypeVar("_K")
# Records that read back as the same type (a stored str is a str again, ...). Containers read
# back as views (a dict as a DictView, a list or tuple as a ListView), other values as Any.
_Scalar = TypeVar("_Scalar", bool, int, float, complex, str, bytes)

_Path = str | os.PathLike[str]

_Key = Any  # a dict key: str, int, float, bool, None, bytes, or a tuple of these

class ShmStoreError(Exception):
    """Base class of every error shmstore raises."""

class StoreNotFoundError(ShmStoreError, FileNotFoundError):
    """No store has that name (unlinked, never created, or its creator is gone)."""

class StoreExistsError(ShmStoreError, FileExistsError):
    """A store with that name already exists."""

class StorePermissionError(ShmStoreError, PermissionError):
    """The store belongs to another user."""

class CorruptStoreError(ShmStoreError, ValueError):
    """The bytes of a store are not a valid, complete archive."""

class UnsupportedTypeError(ShmStoreError, TypeError):
    """A value of a type shmstore cannot store; the message gives its path."""

class InvalidInputError(ShmStoreError, ValueError):
    """Input that cannot be stored as given (duplicate key, bad name, too large a record)."""

class StoreClosedError(ShmStoreError, ValueError):
    """The handle was closed; attach again to keep reading."""

class OutOfSharedMemoryError(ShmStoreError, MemoryError):
    """Not enough room in /dev/shm (or SHMSTORE_DIR) for the store."""

class StoreIOError(ShmStoreError, OSError):
    """An operating-system error while creating, mapping or removing a store."""

@disjoint_base
class StoreHandle:
    """What every store handle has: name, path, kind, size, close/unlink, save, pickling by
    name."""

    @classmethod
    def attach(cls, name: str, *, dir: _Path | None = None) -> StoreHandle:
        """Attach to an existing store by name; on ``StoreHandle`` itself, the class fits
        the store's kind."""
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> StoreHandle:
        """Map a store saved with ``save(path)``."""
    @classmethod
    def from_buffer(cls, buffer: Buffer, *, copy: bool | None = None) -> StoreHandle:
        """Read the archive in ``buffer`` (``bytes``, ``memoryview``, ``PickleBuffer``, a
        numpy uint8 array) with a segment's checks; the store holds the buffer while any
        handle, view or array of it lives. ``copy``: None in place when read-only and
        aligned (an unaligned one is copied), True always a private copy, False never."""
    def archive(self) -> memoryview:
        """The whole archive as a read-only memoryview of the store's pages (no copy)."""
    @property
    def name(self) -> str:
        """The store's name (``shmstore-...``), or the path of a store opened from a file."""
    @property
    def path(self) -> Path:
        """The file behind the store: its segment, or the saved archive file (none for a
        store read from a buffer: InvalidInputError)."""
    @property
    def kind(self) -> Literal["list", "dict", "object"]:
        """What the store holds: ``"list"``, ``"dict"`` or ``"object"``."""
    @property
    def nbytes(self) -> int:
        """Size of the archive in bytes."""
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called on this handle."""
    def close(self) -> None:
        """Drop this handle's reference; views and arrays handed out keep working."""
    def unlink(self) -> None:
        """Remove the name now; existing mappings (here and elsewhere) keep working."""
    def save(self, path: str | os.PathLike[str], *, mode: int = 0o600) -> None:
        """Write the archive to a regular file (atomically), with permission bits ``mode``."""
    def verify(self) -> None:
        """Check every record now (checksums and structure)."""
    def __enter__(self: _S) -> _S: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        """Close; a handle that created the store also unlinks it. Never swallows the
        exception."""
    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]: ...
    def _mapping_extent(self) -> tuple[int, int, ArrayOwner]: ...

@final
class SharedList(StoreHandle, Sequence[_T_co], Generic[_T_co]):
    """A list of records in shared memory (a read-only ``Sequence``).

    Typed by what its records read back as: ``SharedList[int]`` from ints (likewise bool,
    float, complex, str, bytes), ``SharedList[DictView]`` from dicts, ``SharedList[ListView]``
    from lists or tuples, ``SharedList[Any]`` otherwise.

    >>> with SharedList([{"a": 1}, {"a": 2}]) as lst:
    ...     lst[1]["a"]
    2
    """

    @overload
    def __new__(
        cls, iterable: Iterable[_Scalar], *, name: str | None = None, dir: _Path | None = None
    ) -> SharedList[_Scalar]: ...
    @overload
    def __new__(
        cls,
        iterable: Iterable[Mapping[Any, Any]],
        *,
        name: str | None = None,
        dir: _Path | None = None,
    ) -> SharedList[DictView]: ...
    @overload
    def __new__(
        cls,
        iterable: Iterable[list[Any] | tuple[Any, ...]],
        *,
        name: str | None = None,
        dir: _Path | None = None,
    ) -> SharedList[ListView]: ...
    @overload
    def __new__(
        cls, iterable: Iterable[Any], *, name: str | None = None, dir: _Path | None = None
    ) -> SharedList[Any]: ...
    @classmethod
    def attach(cls, name: str, *, dir: _Path | None = None) -> SharedList[Any]:
        """Attach to an existing SharedList by name."""
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SharedList[Any]:
        """Map a SharedList saved with ``save(path)``."""
    @classmethod
    def from_buffer(cls, buffer: Buffer, *, copy: bool | None = None) -> SharedList[Any]:
        """Read a SharedList's archive in ``buffer`` (see ``StoreHandle.from_buffer``)."""
    def __class_getitem__(cls, item: Any) -> Any: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: SupportsIndex, /) -> _T_co: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[_T_co]: ...
    def __iter__(self) -> Iterator[_T_co]: ...
    def __reversed__(self) -> Iterator[_T_co]: ...
    def __contains__(self, value: object, /) -> bool: ...
    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int: ...
    def count(self, value: Any) -> int: ...
    def get_many(self, indices: Iterable[SupportsIndex]) -> list[_T_co]:
        """The records at ``indices``, in order (the batch's memory reads overlap)."""
    def to_python(self) -> list[Any]:
        """All records as plain Python objects."""

@final
class SharedDict(StoreHandle, Mapping[_K, Any], Generic[_K]):
    """A dict of records in shared memory (a read-only ``Mapping``), O(1) lookups.

    Typed by its key type (keys read back as the same plain objects); values are views or
    scalars (``Any``).

    >>> with SharedDict({"doc-1": "text"}) as d:
    ...     d["doc-1"]
    'text'
    """

    def __new__(
        cls,
        mapping_or_pairs: Mapping[_K, Any] | Iterable[tuple[_K, Any]],
        *,
        name: str | None = None,
        dir: _Path | None = None,
    ) -> SharedDict[_K]: ...
    @classmethod
    def attach(cls, name: str, *, dir: _Path | None = None) -> SharedDict[Any]:
        """Attach to an existing SharedDict by name."""
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SharedDict[Any]:
        """Map a SharedDict saved with ``save(path)``."""
    @classmethod
    def from_buffer(cls, buffer: Buffer, *, copy: bool | None = None) -> SharedDict[Any]:
        """Read a SharedDict's archive in ``buffer`` (see ``StoreHandle.from_buffer``)."""
    def __class_getitem__(cls, item: Any) -> Any: ...
    def __len__(self) -> int: ...
    def __getitem__(self, key: _Key, /) -> Any: ...
    def get(self, key: _Key, default: Any = None) -> Any: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __iter__(self) -> Iterator[_K]: ...
    def keys(self) -> KeysView[_K]: ...
    def values(self) -> ValuesView[Any]: ...
    def items(self) -> ItemsView[_K, Any]: ...
    def to_python(self) -> dict[Any, Any]:
        """All entries as a plain dict."""
    def __eq__(self, other: object, /) -> bool: ...

@final
class Ref(StoreHandle):
    """One object shared by name; made by :func:`put`.

    >>> with put([1, 2, 3]) as ref:
    ...     ref.get()[2]
    3
    """

    @classmethod
    def attach(cls, name: str, *, dir: _Path | None = None) -> Ref:
        """Attach to an object shared with ``put(obj, name=...)``."""
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Ref:
        """Map an object saved with ``save(path)``."""
    @classmethod
    def from_buffer(cls, buffer: Buffer, *, copy: bool | None = None) -> Ref:
        """Read a Ref's archive in ``buffer`` (see ``StoreHandle.from_buffer``)."""
    def get(self) -> Any:
        """The shared object: a read-only view, a read-only numpy array, or a scalar."""

@final
class Channel:
    """A bounded queue of objects between processes, like ``multiprocessing.Queue``, whose
    objects are written once into shared memory instead of pickled through a pipe
    (docs/channel.md).

    ``put`` writes an object into a chunk of this process's arena (a segment of its own when
    larger: an array over 8 MiB, another object over 1 MiB) and its handle into a ring that
    every process using the channel maps; ``get`` maps the object where it is and returns
    what ``Ref.get()`` would: a read-only numpy array, a read-only view of a list or dict,
    or a scalar. Any number of processes may put and get. A channel pickles by name: pass it
    to a ``multiprocessing.Process``, a pool's initializer or a DataLoader worker. An object
    stays readable until a get takes it, even after the process that put it exits.

    >>> import numpy as np
    >>> ch = Channel(capacity=8)
    >>> ch.put(np.arange(4))
    >>> ch.put({"id": 1, "tags": ["a", "b"]})
    >>> ch.qsize()
    2
    >>> ch.get().tolist()
    [0, 1, 2, 3]
    >>> rec = ch.get()
    >>> rec["id"], list(rec["tags"])
    (1, ['a', 'b'])
    >>> ch.get(timeout=0.01)
    Traceback (most recent call last):
    ...
    _queue.Empty
    """

    def __new__(cls, capacity: int = 1024, *, dir: _Path | None = None) -> Channel:
        """A new channel with room for ``capacity`` waiting objects (a power of two, 2 to
        2**20: ``ValueError`` otherwise), in ``dir`` (default: ``$SHMSTORE_DIR`` or
        /dev/shm)."""
    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj``; while the channel is full, wait up to ``timeout`` seconds (``None``:
        as long as it takes), then raise ``queue.Full`` (at once when ``block`` is false)."""
    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Take the oldest object; while the channel is empty, wait up to ``timeout``
        seconds (``None``: as long as it takes), then raise ``queue.Empty`` (at once when
        ``block`` is false)."""
    def put_nowait(self, obj: Any) -> None:
        """``put(obj, block=False)``."""
    def get_nowait(self) -> Any:
        """``get(block=False)``."""
    def qsize(self) -> int:
        """How many objects wait (approximate while other processes put and get)."""
    def empty(self) -> bool:
        """Whether no object waits (approximate while other processes put and get)."""
    def full(self) -> bool:
        """Whether ``capacity`` objects wait (approximate while other processes put and
        get)."""
    def close(self) -> None:
        """This process puts and gets no more through this object: later ``put``/``get``
        raise ``ValueError``, as on a closed ``multiprocessing.Queue``. Objects already put
        stay readable for other processes until taken. Calling it again does nothing.

        >>> ch = Channel(capacity=2)
        >>> ch.close()
        >>> ch.put(1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Channel "..." is closed
        >>> ch.join_thread()  # returns at once: a put is complete when it returns
        """
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called on this object."""
    def join_thread(self) -> None:
        """After ``close()``: returns at once (no feeder thread to wait for); ``ValueError``
        before ``close()``."""
    def cancel_join_thread(self) -> None:
        """Does nothing (no feeder thread holds the process's exit); for
        ``multiprocessing.Queue`` compatibility."""
    @property
    def capacity(self) -> int:
        """How many objects may wait at once."""
    @property
    def name(self) -> str:
        """The channel's file name."""
    @property
    def path(self) -> Path:
        """The channel's file."""
    def _in_flight(self) -> int: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

def put(obj: Any, *, name: str | None = None, dir: _Path | None = None, arena: bool = True) -> Ref:
    """Share one object (e.g. a numpy array) by name.

    A small object (an array or bytes of at most 8 MiB, another object whose archive is at
    most 1 MiB; docs/arena.md) without ``name`` goes into a chunk of this process's
    arena segment (docs/arena.md); its name is ``<arena>@<offset>:<size>:<generation>``.
    A larger one, a named one, or any with ``arena=False`` gets a segment of its own.

    >>> import numpy as np
    >>> with put(np.arange(3)) as small:
    ...     small.get().tolist(), "@" in small.name
    ([0, 1, 2], True)
    >>> with put(np.zeros(2 << 20)) as large:   # 16 MiB: a segment of its own
    ...     "@" in large.name
    False
    >>> with put({"a": 1}, arena=False) as own:
    ...     own.get()["a"], "@" in own.name
    (1, False)
    """

@final
class ListView(Sequence[Any]):
    """A stored list or tuple: a lazy, read-only ``Sequence``."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: SupportsIndex, /) -> Any: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[Any] | tuple[Any, ...]: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __reversed__(self) -> Iterator[Any]: ...
    def __contains__(self, value: object, /) -> bool: ...
    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int: ...
    def count(self, value: Any) -> int: ...
    def to_python(self) -> list[Any] | tuple[Any, ...]:
        """Plain objects equal to the stored value (tuples stay tuples)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[str, str, int, int]]: ...

@final
class DictView(Mapping[Any, Any]):
    """A stored dict: a lazy, read-only ``Mapping`` (keys as stored: usually ``str``)."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: _Key, /) -> Any: ...
    def get(self, key: _Key, default: Any = None) -> Any: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __iter__(self) -> Iterator[Any]: ...
    def keys(self) -> KeysView[Any]: ...
    def values(self) -> ValuesView[Any]: ...
    def items(self) -> ItemsView[Any, Any]: ...
    def to_python(self) -> dict[Any, Any]:
        """A plain dict equal to the stored one."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __reduce__(self) -> tuple[Any, tuple[str, str, int, int]]: ...

@final
class ArrayOwner:
    """Keeps the mapping behind a numpy array alive (the array's ``.base``)."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def _mapping_extent(self) -> tuple[int, int]: ...

@final
class ListViewIterator(Iterator[Any]):
    def __next__(self) -> Any: ...

@final
class DictViewIterator(Iterator[Any]):
    def __next__(self) -> Any: ...

@final
class SharedListIterator(Iterator[Any]):
    def __next__(self) -> Any: ...

@final
class SharedDictIterator(Iterator[Any]):
    def __next__(self) -> Any: ...

def _rebuild(cls: str, path: str, kind_flag: str) -> StoreHandle: ...
def _rebuild_channel(path: _Path) -> Channel: ...
def _rebuild_chunk(path: str, offset: int, size: int, generation: int) -> Ref: ...
def _rebuild_view(
    path: str, kind_flag: str, rec: int, pos: int, form: int | None = None, aux: int | None = None
) -> ListView | DictView: ...
def _cleanup_at_exit() -> int: ...
def _fuzz_case(seed: int) -> tuple[str, bytes]: ...
def _crafted_archive(name: str) -> bytes: ...
def _crafted_names() -> list[str]: ...
def _cluster_identity(handle: StoreHandle, with_digest: bool) -> dict[str, Any]: ...
def _import_archive(
    cls: str, name: str, dir: _Path, nbytes: int, digest: str, chunks: Iterable[bytes]
) -> StoreHandle: ...
def _store_info(target: StoreHandle | str | os.PathLike[str]) -> dict[str, Any]: ...
def _supervisor_main() -> None: ...
def _state_dir() -> Path: ...
def sweep(dry_run: bool = False, dirs: list[_Path] | None = None) -> list[dict[str, Any]]:
    """Remove this user's shmstore files that no live process maps or holds open.

    Raises StoreIOError (removing nothing) when a supervisor is running but its list of
    tracked segments is missing or incomplete, or when the supervisor's directory is not safe
    to use (so no supervisor could be asked)."""

def supervisor_info() -> dict[str, Any] | None:
    """The running supervisor: pid, log path, segments and the pids using them (or None).

    Raises StoreIOError when one is running but does not answer in time."""

def _flush_drops() -> None: ...
def _arena_info(path: _Path) -> dict[str, Any]: ...
def _arena_release() -> int: ...
def _fast_paths() -> dict[str, bool | str]: ...
def _arena_usage() -> list[tuple[str, int, int]]: ...
def _arena_gil_handbacks() -> dict[str, int]: ...
def _arena_simulate(
    policy: str,
    ops: int,
    lo: int = 64,
    hi: int = 1048576,
    live_target: int = 1000,
    seed: int = 1,
) -> dict[str, Any]: ...
def gc_unreachable(objects: list[object]) -> list[int]:
    """Indices of objects[:-1] nothing outside the list keeps alive; objects[-1] is a fresh
    calibration probe referenced only by the list. Needs the GIL."""

def _search_dirs() -> list[Path]: ...
def _segment_paths(dir: _Path | None = None) -> list[Path]: ...
def _segment_name(name: str) -> str: ...
def _remove_segment(name: str) -> Path | None: ...
def _segment_users(paths: list[_Path]) -> dict[Path, list[int]]: ...
