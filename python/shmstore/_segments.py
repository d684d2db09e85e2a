"""Where segments live and which exist: thin calls into the Rust core, which alone knows the
naming rule, the directories and how to list them (shared by the CLI, the pytest plugin and
``shmstore.memory``)."""

from __future__ import annotations

import os
from pathlib import Path

from shmstore import _native

__all__ = [
    "PREFIX",
    "arena_creator",
    "channel_creator",
    "remove",
    "search_dirs",
    "segment_dir",
    "segment_name",
    "segment_paths",
    "segment_users",
]


#: Every segment name starts with this (the core's rule).
PREFIX: str = _native._SEGMENT_PREFIX


def search_dirs() -> list[Path]:
    """The segment directory (``$SHMSTORE_DIR``, else /dev/shm), then the disk fallback
    unless ``SHMSTORE_FALLBACK=0``."""
    return [Path(d) for d in _native._search_dirs()]


def segment_dir() -> Path:
    """Where new segments go: ``$SHMSTORE_DIR`` if set, else ``/dev/shm``."""
    return search_dirs()[0]


def segment_name(name: str) -> str:
    """The full segment name ``name`` stands for (``"coco"`` -> ``"shmstore-coco"``);
    :class:`shmstore.InvalidInputError` for a name shmstore would never create.

    >>> segment_name("coco")
    'shmstore-coco'
    """
    return _native._segment_name(name)


def segment_paths(directory: Path | None = None) -> list[Path]:
    """This user's shmstore segment files (sealed and being built), sorted by path.

    >>> isinstance(segment_paths(), list)
    True
    """
    return [Path(p) for p in _native._segment_paths(directory)]


def segment_users(paths: list[Path]) -> dict[Path, list[int]]:
    """For each path, the pids of *other* processes that map it or hold it open (the same
    /proc ground truth, by device and inode, that the supervisor uses)."""
    return {Path(p): pids for p, pids in _native._segment_users([str(p) for p in paths]).items()}


def remove(name: str) -> Path | None:
    """Unlink segment ``name`` (checked like :func:`segment_name`); its path, or None if
    this user has no such segment. Processes that map it keep reading it."""
    removed = _native._remove_segment(name)
    return None if removed is None else Path(removed)


def arena_creator(path: Path) -> int | None:
    """The creator's pid if ``path`` is an arena segment (docs/arena.md), else None (also
    for a symlink, a FIFO or a file that cannot be read)."""
    return _creator_if(path, _native._ARENA_MAGIC)


def channel_creator(path: Path) -> int | None:
    """The creator's pid if ``path`` is a channel (docs/channel.md), else None."""
    return _creator_if(path, _native._CHANNEL_MAGIC)


def _creator_if(path: Path, magic: bytes) -> int | None:
    """The creator's pid (a little-endian u32 at ``_native._CREATOR_PID_AT``) of ``path`` if
    its header starts with ``magic`` (both from the Rust side, which writes them)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = os.pread(fd, 32, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    at = _native._CREATOR_PID_AT
    if len(head) < at + 4 or head[: len(magic)] != magic:
        return None
    return int.from_bytes(head[at : at + 4], "little")
