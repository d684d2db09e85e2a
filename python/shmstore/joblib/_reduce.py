"""Sending numpy arrays by name: each array above a threshold is traced to the root buffer
that owns its memory, the root is shared once (a new segment, or the file mapping it already
lives in), and the array travels as ``(segment, byte offset, shape, strides, dtype)``."""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import cloudpickle
import numpy as np

import shmstore
from shmstore import _procmaps
from shmstore._util import format_bytes, parse_size

from ._cache import CACHE, LOADING, open_file, open_segment

__all__ = [
    "DEFAULT_THRESHOLD",
    "Sharer",
    "SharingStats",
    "dumps",
    "file_span",
    "parse_bytes",
    "root_of",
]

log = logging.getLogger("shmstore.joblib")

#: Arrays of at least this many bytes go by name (joblib's own default ``max_nbytes``).
DEFAULT_THRESHOLD = 1 << 20

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_ARRAY_TYPES = (np.ndarray, np.memmap)


def parse_bytes(value: Union[int, str, None]) -> int:
    """``1048576``, ``"1M"``, ``"1 MiB"``, ``"10 MB"`` -> bytes (shmstore's one size grammar,
    :func:`shmstore._util.parse_size`); None means "every array".

    >>> parse_bytes("1M"), parse_bytes(None)
    (1048576, 0)
    """
    return 0 if value is None else parse_size(value, what="threshold")


# ---------------------------------------------------------------------------------------------
# Where an array's memory lives


def root_of(a: np.ndarray) -> np.ndarray:
    """The last ndarray of ``a``'s ``.base`` chain: the array that owns (or wraps) the buffer."""
    r = a
    while isinstance(r.base, np.ndarray):
        r = r.base
    return r


def _data_ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@dataclass(frozen=True)
class FileSpan:
    """A read-only shared file mapping that holds an array's root: path and file offset."""

    path: str
    offset: int  # file offset of the root's first byte


def file_span(root: np.ndarray) -> Optional[FileSpan]:
    """The file behind ``root`` if it lies in one shared file mapping whose file still exists.

    shmstore arrays (``.base`` is ``shmstore.ArrayOwner``), saved archives and ``np.memmap``
    arrays all qualify.
    """
    if root.base is None or root.nbytes == 0:
        return None
    addr = _data_ptr(root)
    entry = _procmaps.entry_at(addr)
    if entry is None or not entry.shared or not entry.path.startswith("/"):
        return None  # private (copy-on-write) or anonymous mapping
    if addr + root.nbytes > entry.end:
        return None  # spans two mappings
    path = _procmaps.live_path(entry.path, entry.ident)
    return None if path is None else FileSpan(path, addr - entry.start + entry.offset)


# ---------------------------------------------------------------------------------------------
# Rebuilding arrays from names (runs in the receiving process, inside pickle.loads)


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
        pending = getattr(LOADING, "pending", None)
        buf = pending.get(path) if pending is not None else None
        if buf is None:
            ref = shmstore.Ref.attach(os.path.basename(path), dir=os.path.dirname(path))
            buf = ref.get()
            if pending is not None:
                pending[path] = buf
                LOADING.refs.append(ref)
            else:
                ref.unlink()
                ref.close()
    else:
        load = (lambda: open_segment(path)) if kind == "segment" else (lambda: open_file(path))
        buf = CACHE.buffer(token, marker, path, load)
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


def dumps(obj: Any, sender: _Sender) -> bytes:
    """``obj`` pickled with cloudpickle, its large arrays sent by name through ``sender``."""
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
        self.threshold = parse_bytes(threshold)
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
            self._marker = shmstore.put(self.token, arena=False)
            self._marker_path = str(self._marker.path)
        return self._marker_path

    def reduce_array(self, a: np.ndarray) -> Optional[tuple[Any, ...]]:
        if a.dtype.hasobject or a.nbytes == 0:
            return None
        root = root_of(a)
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
        span = file_span(root)
        if span is not None:
            self.stats.in_place += 1
            return root, ("file", span.path, self.token, marker), span.offset, None
        contiguous = root.flags.c_contiguous or root.flags.f_contiguous
        data = root if contiguous else np.ascontiguousarray(root)
        ref = shmstore.put(_as_bytes(data), arena=False)
        self._refs.append(ref)
        path = str(ref.path)
        self.stats.segments += 1
        self.stats.copied_bytes += root.nbytes
        self.stats.names.append(ref.name)
        log.debug("shared a %s root buffer as %s", format_bytes(root.nbytes), ref.name)
        return root, ("segment", path, self.token, marker), 0, (None if contiguous else data)

    def dumps(self, obj: Any) -> bytes:
        return dumps(obj, self)

    def close(self) -> None:
        """Unlink every segment of this context (workers drop their mappings at once)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            refs, self._refs = self._refs, []
            marker, self._marker = self._marker, None
            self._roots.clear()
        CACHE.drop_token(self.token)
        for ref in refs:
            ref.unlink()
            ref.close()
        if marker is not None:  # last: its removal tells the workers the context is over
            marker.unlink()
            marker.close()


class ResultSender(_Sender):
    """The worker side: large results go to new segments held until the parent attaches."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self._roots: dict[int, tuple[np.ndarray, _Seg, int]] = {}

    def reduce_array(self, a: np.ndarray) -> Optional[tuple[Any, ...]]:
        if a.dtype.hasobject or a.nbytes == 0:
            return None
        root = root_of(a)
        known = self._roots.get(id(root))
        if known is None:
            if a.nbytes < self.threshold:
                return None
            span = file_span(root)
            if span is not None:  # e.g. a slice of an input array: no copy
                known = (root, ("file", span.path, "", ""), span.offset)
            else:
                if not (root.flags.c_contiguous or root.flags.f_contiguous):
                    return None  # a rare strided root: pickled by value
                ref = shmstore.put(_as_bytes(root), arena=False)
                path = str(ref.path)
                CACHE.hold(path, ref)
                known = (root, ("result", path, "", ""), 0)
            self._roots[id(root)] = known
        _, seg, root_offset = known
        return (_rebuild_array, (seg, *self._view_args(a, root, root_offset)))


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """The buffer of a contiguous (C or Fortran) array as a 1-D uint8 view, in memory order."""
    flat = a.ravel(order="K")  # a view for a contiguous array
    assert flat.base is a or flat is a or np.shares_memory(flat, a)
    return flat.view(np.uint8)
