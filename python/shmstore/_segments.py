"""Where segments live and how to list them (shared by the CLI and the pytest plugin)."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "shmstore-"


def search_dirs() -> list[Path]:
    """The segment directory (``$SHMSTORE_DIR``, else /dev/shm), then the disk fallback
    unless ``SHMSTORE_FALLBACK=0``: the Rust core's rule, asked from it, not restated."""
    from shmstore import _native

    return [Path(d) for d in _native._search_dirs()]


def segment_dir() -> Path:
    """Where new segments go: ``$SHMSTORE_DIR`` if set, else ``/dev/shm``."""
    return search_dirs()[0]


def segment_users(paths: list[Path]) -> dict[Path, list[int]]:
    """For each path, the pids of *other* processes that map it or hold it open (the same
    /proc ground truth, by device and inode, that the supervisor uses)."""
    from shmstore import _native

    return {Path(p): pids for p, pids in _native._segment_users([str(p) for p in paths]).items()}


def segment_paths(directory: Path | None = None) -> list[Path]:
    """This user's shmstore segment files (sealed and being built), sorted by name.

    >>> isinstance(segment_paths(), list)
    True
    """
    dirs = [directory] if directory is not None else search_dirs()
    uid = os.geteuid()
    out = []
    entries = []
    for d in dirs:
        try:
            entries.extend(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
    for e in entries:
        if not e.name.startswith(PREFIX):
            continue
        try:
            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == uid:
                out.append(Path(e.path))
        except FileNotFoundError:
            continue
    return sorted(out)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (it may belong to another user).

    >>> pid_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def human_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
