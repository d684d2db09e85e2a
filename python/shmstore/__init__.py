"""shmstore: share one copy of a large read-only dataset between many processes.

Records are written once into a named shared-memory segment; every process maps the
same pages read-only and reads through lazy views, so reading never copies the data
into the reader (no copy-on-read), under fork, spawn and forkserver alike.

>>> import shmstore
>>> lst = shmstore.SharedList([{"file_name": "a.jpg", "bbox": [1.0, 2.0, 3.0, 4.0]}])
>>> lst[0]["bbox"][2]
3.0
>>> lst.unlink()
"""

from __future__ import annotations

import atexit
import collections.abc as _abc
import importlib as _importlib
from typing import TYPE_CHECKING, Any

from shmstore import _native
from shmstore._native import (
    Channel,
    CorruptStoreError,
    DictView,
    InvalidInputError,
    ListView,
    OutOfSharedMemoryError,
    Ref,
    SharedDict,
    SharedList,
    ShmStoreError,
    StoreClosedError,
    StoreExistsError,
    StoreHandle,
    StoreIOError,
    StoreNotFoundError,
    StorePermissionError,
    UnsupportedTypeError,
    __version__,
    put,
)

# Views and stores are registered (not subclassed) so they stay plain native objects:
# isinstance(view, collections.abc.Mapping) holds, and they remain untracked by the GC.
_abc.Sequence.register(ListView)
_abc.Mapping.register(DictView)
_abc.Sequence.register(SharedList)
_abc.Mapping.register(SharedDict)

# The functions pickles of handles, views and channels name, exported here under the
# package's own name: unpickling (and the pickler's check) then imports one top-level module
# instead of a package and its submodule. Pickles naming shmstore._native.<name> still load.
_rebuild = _native._rebuild
_rebuild_chunk = _native._rebuild_chunk
_rebuild_view = _native._rebuild_view
_rebuild_channel = _native._rebuild_channel
for _f in (_rebuild, _rebuild_chunk, _rebuild_view, _rebuild_channel):
    _f.__module__ = __name__
del _f

# Names this process created and still owns are removed when the interpreter exits.
atexit.register(_native._cleanup_at_exit)

# The tools beside the store (`cow`, `leaks`, `memory`) are imported on first use: they need
# much of the standard library (multiprocessing, subprocess, tempfile, pathlib, tracemalloc,
# csv), ~75 ms of a fresh process's start, which a DataLoader's spawned worker that only
# reads a store would pay for nothing. `shmstore.cow`, `from shmstore import cow` and
# `import shmstore.cow` all work as before.
_LAZY = ("cow", "leaks", "memory")

if TYPE_CHECKING:
    from shmstore import cow, leaks, memory


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Channel",
    "CorruptStoreError",
    "DictView",
    "InvalidInputError",
    "ListView",
    "OutOfSharedMemoryError",
    "Ref",
    "SharedDict",
    "SharedList",
    "ShmStoreError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreHandle",
    "StoreIOError",
    "StoreNotFoundError",
    "StorePermissionError",
    "UnsupportedTypeError",
    "__version__",
    "cow",
    "leaks",
    "memory",
    "put",
]
