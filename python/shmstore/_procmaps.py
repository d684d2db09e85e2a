"""Reading ``/proc/PID/maps`` and ``/proc/PID/smaps`` mapping headers (shared by
:mod:`shmstore.memory` and :mod:`shmstore.joblib`).

A header line is ``start-end perms offset major:minor inode   path``; the kernel appends
`` (deleted)`` to the path of a file whose name was removed while it stays mapped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["MapEntry", "entry_at", "live_path", "parse_header"]

_DELETED = " (deleted)"
_PART = re.compile(r"\.part-[^/]*$")


@dataclass(frozen=True)
class MapEntry:
    """One mapping of a process."""

    start: int
    end: int
    perms: str
    offset: int  #: file offset of ``start``
    ident: tuple[int, int]  #: (device, inode) of the mapped file; (0, 0) when anonymous
    path: str  #: as the kernel shows it, `` (deleted)`` included

    @property
    def shared(self) -> bool:
        return "s" in self.perms


def parse_header(line: str) -> Optional[MapEntry]:
    """The mapping of a maps/smaps header line, or None for any other line.

    >>> e = parse_header("7f00-7f10 r--s 00000000 00:1a 42   /dev/shm/shmstore-x (deleted)")
    >>> e.start, e.end, e.shared, e.ident[1], e.path
    (32512, 32528, True, 42, '/dev/shm/shmstore-x (deleted)')
    >>> parse_header("Pss:                 12 kB") is None
    True
    """
    parts = line.rstrip("\n").split(None, 5)
    if len(parts) < 5 or parts[0].endswith(":"):
        return None
    start_s, dash, end_s = parts[0].partition("-")
    major, colon, minor = parts[3].partition(":")
    if not (dash and colon):
        return None
    try:
        return MapEntry(
            start=int(start_s, 16),
            end=int(end_s, 16),
            perms=parts[1],
            offset=int(parts[2], 16),
            ident=(os.makedev(int(major, 16), int(minor, 16)), int(parts[4])),
            path=parts[5] if len(parts) > 5 else "",
        )
    except ValueError:
        return None


def entry_at(addr: int, pid: str = "self") -> Optional[MapEntry]:
    """The mapping of process ``pid`` that contains address ``addr``, if any."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                e = parse_header(line)
                if e is not None and e.start <= addr < e.end:
                    return e
    except OSError:
        return None
    return None


def live_path(path: str, ident: tuple[int, int]) -> Optional[str]:
    """The existing name of the mapped file ``ident`` shown as ``path``, or None if it has none.

    A store mapped by the process that built it may show its build name,
    ``shmstore-X.part-Y (deleted)``: its public name is ``shmstore-X``, accepted only if it
    is the same file (device and inode).
    """
    candidates = [path]
    if path.endswith(_DELETED):
        path = path[: -len(_DELETED)]
        candidates = [_PART.sub("", path)] if _PART.search(path) else []
    for cand in candidates:
        try:
            st = os.stat(cand)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == ident:
            return cand
    return None
