"""What a process keeps mapped between tasks, emptied when a context's marker (or a result
segment) is unlinked; and the result segments of the payload being unpickled."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np

import shmstore

from ._watch import Watcher

__all__ = ["CACHE", "LOADING", "Cache", "open_file", "open_segment"]


class Cache:
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
        self.watcher = Watcher(self._gone)

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


CACHE = Cache()
os.register_at_fork(after_in_child=CACHE.reset_after_fork)

#: Per thread, while a result payload is unpickled: ``pending`` (path -> buffer) and ``refs``
#: (the result segments to unlink once the whole payload is loaded).
LOADING = threading.local()


def open_segment(path: str) -> np.ndarray:
    """A uint8 array over the whole segment at ``path`` (keeps the mapping alive)."""
    ref = shmstore.Ref.attach(os.path.basename(path), dir=os.path.dirname(path))
    try:
        return ref.get()  # type: ignore[no-any-return]
    finally:
        ref.close()


def open_file(path: str) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")
