"""Which of a forked child's pages are still shared with its parent, and which it un-shared.

Used by :mod:`shmstore.cow`. Two ways, the first where the kernel offers it:

- ``pagemap``: ``/proc/self/pagemap`` has one 64-bit entry per virtual page. Bit 63 says the
  page is present, bit 61 that it is a file page or shared anonymous memory, bit 56 that
  exactly one process maps it ("exclusively mapped", Linux >= 4.2). These flags are readable
  by the process itself without privileges; only the physical frame numbers (bits 0-54) are
  hidden from unprivileged readers, and they are not needed. Right after ``fork()`` every
  present private anonymous page of the parent is mapped by both processes (not exclusive);
  a page the child writes to (a reference count, a GC header, a free slot malloc reuses) is
  copied and becomes exclusive. So: un-shared = present, anonymous and not exclusive when
  the probe starts, exclusive when it ends. Pages the child allocates anew were never shared
  and are not counted. Exact to the page, and which pages is known (for attribution).
- ``smaps``: where pagemap can't be read, the growth of ``Private_Dirty`` over the private
  writable mappings that existed at the start, from ``/proc/self/smaps``. It also counts new
  memory the child touches inside those mappings, and can't say which pages.

Only private writable mappings are read (``rw-p``: the heap, anonymous mmaps such as
pymalloc's arenas, the data sections of libraries): nothing else can be un-shared by
writing. Mappings with no anonymous pages at the start are skipped, so a large untouched
reservation costs nothing.
"""

from __future__ import annotations

import os
from array import array
from typing import Optional

from . import _procmaps

__all__ = ["PAGE_SIZE", "Probe"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_SHIFT = PAGE_SIZE.bit_length() - 1
_PRESENT = 1 << 63
_FILE_OR_SHARED = 1 << 61
_EXCLUSIVE = 1 << 56
_CHUNK = 1 << 17  # pagemap entries read at once (1 MiB of entries, 512 MiB of address space)


def _private_writable() -> list[tuple[int, int, int]]:
    """``(start, end, Private_Dirty bytes)`` of this process's private writable mappings
    that hold anonymous pages, from ``/proc/self/smaps``."""
    out: list[tuple[int, int, int]] = []
    cur: Optional[_procmaps.MapEntry] = None
    anon = dirty = 0

    def flush() -> None:
        if cur is not None and anon and cur.perms.startswith("rw") and cur.perms[3] == "p":
            out.append((cur.start, cur.end, dirty))

    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                anon = int(line.split()[1])
            elif line.startswith("Private_Dirty:"):
                dirty = int(line.split()[1]) * 1024
            elif not line[:1].isupper():
                e = _procmaps.parse_header(line)
                if e is not None:
                    flush()
                    cur, anon, dirty = e, 0, 0
    flush()
    return out


def _entries(fd: int, start: int, end: int) -> array[int]:
    """The pagemap entries of ``[start, end)`` (zero entries for holes)."""
    first, last = start >> _SHIFT, end >> _SHIFT
    out = array("Q")
    for lo in range(first, last, _CHUNK):
        n = min(_CHUNK, last - lo)
        data = os.pread(fd, n * 8, lo * 8)
        if len(data) != n * 8:
            raise OSError(f"short read of /proc/self/pagemap at page {lo:#x}")
        out.frombytes(data)
    return out


class Probe:
    """Started in a freshly forked child; ``finish()`` says what the child un-shared since.

    The child must not have written much before ``start()``: pages it wrote already are
    exclusive at the start and not counted (the no-op control worker pays the same).
    """

    def __init__(self) -> None:
        self.method = "pagemap"
        self._maps = _private_writable()
        self._shared: list[tuple[int, list[int]]] = []  # (first page, offsets of shared pages)
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:
            self.method = "smaps"
            return
        try:
            want, mask = _PRESENT, _PRESENT | _FILE_OR_SHARED | _EXCLUSIVE
            for start, end, _ in self._maps:
                ent = _entries(fd, start, end)
                self._shared.append(
                    (start >> _SHIFT, [i for i, x in enumerate(ent) if x & mask == want])
                )
        except OSError:
            self.method, self._shared = "smaps", []
        finally:
            os.close(fd)

    def finish(self) -> tuple[int, Optional[array[int]]]:
        """``(bytes un-shared, page numbers un-shared or None)``; the page numbers are
        ``address >> log2(PAGE_SIZE)``, known with the pagemap method only."""
        if self.method == "smaps":
            before = {start: dirty for start, _, dirty in self._maps}
            grown = 0
            for start, _, dirty in _private_writable():
                if start in before:
                    grown += max(0, dirty - before[start])
            return grown, None
        pages = array("Q")
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            for (start, end, _), (first, shared) in zip(self._maps, self._shared):
                if not shared:
                    continue
                ent = _entries(fd, start, end)
                both = _PRESENT | _EXCLUSIVE
                pages.extend(first + i for i in shared if ent[i] & both == both)
        finally:
            os.close(fd)
        return len(pages) * PAGE_SIZE, pages
