"""Small helpers every part of shmstore shares: one size grammar, one byte formatter, one
answer to "is this process alive?", one map from a store's kind to its handle class.

Sizes (:func:`parse_size`) — one grammar everywhere a size is accepted (the pytest plugin's
``memory=``, ``shmstore.joblib``'s ``threshold``):

- an ``int`` is a number of bytes;
- a string is a number (``"10"``, ``"1.5"``) and an optional unit, case-insensitive:
  ``B``; decimal (SI) ``kB``, ``MB``, ``GB``, ``TB`` = 10**3, 10**6, 10**9, 10**12;
  binary (IEC) ``KiB``, ``MiB``, ``GiB``, ``TiB`` = 2**10, 2**20, 2**30, 2**40; and a bare
  ``k``, ``M``, ``G``, ``T`` (joblib's ``max_nbytes="1M"`` style) = the binary ones.

So ``"10 MB"`` is 10,000,000 bytes and ``"10 MiB"`` and ``"10M"`` are 10,485,760.
"""

from __future__ import annotations

import os
import re

from shmstore._native import Ref, SharedDict, SharedList, StoreHandle

__all__ = ["HANDLE_CLASSES", "format_bytes", "parse_size", "pid_alive"]

#: The handle class of each store kind (``StoreHandle.kind``), for the code that rebuilds a
#: handle from a kind it received (cluster, torch, dask).
#:
#: >>> HANDLE_CLASSES["dict"].__name__
#: 'SharedDict'
HANDLE_CLASSES: dict[str, type[StoreHandle]] = {
    "list": SharedList,
    "dict": SharedDict,
    "object": Ref,
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(value: float | str, *, what: str = "size") -> int:
    """Bytes from an int or a string like ``"10 MB"`` (grammar: the module docstring).

    >>> parse_size(1024), parse_size("10 MB"), parse_size("10 MiB"), parse_size("1.5k")
    (1024, 10000000, 10485760, 1536)
    >>> parse_size("ten")
    Traceback (most recent call last):
    ...
    ValueError: cannot read 'ten' as a size: use bytes (an int) or e.g. '10 MB', '1.5 GiB', '1M'
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{what} must be a number of bytes (an int) or a string like '10 MB', "
            f"not {type(value).__name__}"
        )
    if isinstance(value, (int, float)):
        if not value >= 0:
            raise ValueError(f"{what} must be >= 0 bytes, not {value}")
        return int(value)
    m = _SIZE.fullmatch(value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a {what}: use bytes (an int) or e.g. '10 MB', "
            f"'1.5 GiB', '1M'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """A byte count for people, in binary units.

    >>> format_bytes(512), format_bytes(1536), format_bytes(3 << 30)
    ('512 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running: it exists (whoever owns it) and is not a zombie.

    A zombie has exited and only waits for its parent to collect its status: it maps no
    memory and holds no files, so for shmstore it is dead.

    >>> pid_alive(os.getpid())
    True
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc (or it just exited): kill() said it exists
    # The state follows the command name, which is in parentheses and may contain any byte.
    fields = stat.rsplit(b")", 1)[-1].split()
    return not fields or fields[0] not in (b"Z", b"X")
