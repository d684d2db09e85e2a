"""Where segments live and how to list them (shared by the CLI and the pytest plugin)."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "shmstore-"


def segment_dir() -> Path:
    """``$SHMSTORE_DIR`` if set, else ``/dev/shm`` (the same rule as the Rust core)."""
    return Path(os.environ.get("SHMSTORE_DIR") or "/dev/shm")


def fallback_dir() -> Path | None:
    """Where stores go when the segment directory is too small (the Rust core's rule)."""
    if os.environ.get("SHMSTORE_FALLBACK") in ("0", "off"):
        return None
    return Path(os.environ.get("SHMSTORE_FALLBACK_DIR") or f"/var/tmp/shmstore-{os.geteuid()}")


def search_dirs() -> list[Path]:
    """The segment directory, then the fallback directory."""
    dirs = [segment_dir()]
    fb = fallback_dir()
    if fb is not None:
        dirs.append(fb)
    return dirs


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
