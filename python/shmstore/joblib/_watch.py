"""An inotify watcher over ctypes: calls back when a watched file is unlinked or renamed."""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from typing import Callable, Optional

__all__ = ["Watcher"]

_IN_MOVED_FROM = 0x40
_IN_DELETE = 0x200
_IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")


class Watcher:
    """Calls ``on_gone(path)`` when a watched file is unlinked or renamed away (inotify);
    ``on_gone("")`` when events were lost (re-check everything)."""

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
