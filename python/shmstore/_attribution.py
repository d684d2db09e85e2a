"""Which Python objects live on a set of pages: the attribution half of :mod:`shmstore.cow`.

Runs in the process whose address space the pages belong to (the parent, for fork: the
children's pages are the parent's pages at the same addresses). An object is placed on the
page of its address ``id(o)``, where its reference count and (for GC-tracked objects, just
before it) its GC header live: the words a read or a collection writes. A page's bytes are
shared among the types on it by their allocated sizes (``sys.getsizeof`` rounded up to the
allocator's 16 bytes; lists, dicts and sets without their out-of-line storage, which a read
does not write).

GC-tracked objects come from ``gc.get_objects()`` (beyond 400k of them, a regular 1-in-k
sample, and the counts and bytes are estimates the report marks as such); untracked ones
(str, int, float, and tuples or dicts holding only those) from the containers that hold them
(``gc.get_referents``), one level below untracked tuples and dicts as well. Objects only C
code holds are not found: their pages are counted as "no Python object found".

An example access path per type comes from a breadth-first walk down from the named roots
(the measured callable's arguments, closure variables and globals) that looks at a few items
of each container, bounded in objects and time; list indices print as i, j, k.
"""

from __future__ import annotations

import gc
import operator
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import repeat
from types import FrameType, ModuleType
from typing import Any, Iterable, Optional

__all__ = ["Attribution", "TypeRow", "attribute"]

_GC_HEAD = sys.getsizeof([]) - [].__sizeof__()
_OUT_OF_LINE = (list, dict, set, frozenset, bytearray)
_INDEX_NAMES = "ijklmnpqrs"
_PATH_SECONDS = 2.0
_PATH_DEPTH = 12
_PATH_TYPES = 12  # example paths for this many types at most
_PATH_NODES = 20_000
_SAMPLE = 400_000  # GC-tracked objects looked at, at most
_DICT_KEYS = 64


@dataclass(frozen=True)
class TypeRow:
    """Objects of one type found on the un-shared pages."""

    type: str  #: ``module.QualName`` (builtins without module)
    count: int
    nbytes: int  #: their share of the un-shared pages' bytes
    example: str  #: an access path to one of them ("" when none was found in time)


@dataclass(frozen=True)
class Attribution:
    """The objects on a set of pages, grouped by type, largest first."""

    page_bytes: int  #: bytes of the pages attributed
    rows: tuple[TypeRow, ...]
    #: 1, or k when 1 in k containers were looked at (counts and bytes are then estimates)
    sample: int = 1

    @property
    def attributed(self) -> int:
        """Bytes of Python objects found on the pages (at most ``page_bytes``)."""
        return min(self.page_bytes, sum(r.nbytes for r in self.rows))


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def attribute(
    pages: Iterable[int],
    page_size: int,
    named: Optional[dict[str, Any]] = None,
    exclude: Iterable[object] = (),
) -> Attribution:
    """The Python objects of this process that live on ``pages`` (numbers ``addr // page_size``).

    Each page's bytes are shared among the types of the objects on it, in proportion to
    their allocated sizes, so free slots and out-of-line storage on a page count for the
    objects that caused the copy; a page with no object found is "no Python object".
    ``named``: objects example paths may start at (``{"records": records}``); ``exclude``:
    objects of the caller to leave out (its own lists of pages and such).
    """
    on = set(pages)
    shift = page_size.bit_length() - 1
    if gc.get_freeze_count():
        # gc.get_objects() leaves out frozen objects: thaw them to list them, freeze again
        # (objects made since the last gc.freeze() end up frozen as well)
        gc.unfreeze()
        everything = gc.get_objects()
        gc.freeze()
    else:
        everything = gc.get_objects()
    # Beyond _SAMPLE containers, a random sample of _SAMPLE of them (and the untracked
    # objects they hold): the cost stays bounded, and the types' counts and shares of the
    # pages are estimated from the sample. Random, not every k-th: the collector's list
    # interleaves the objects of each record (dict, list, dict, list, ...), and a stride
    # would see some types and miss others.
    total = len(everything)
    step = -(-total // _SAMPLE)
    if step > 1:
        tracked = random.Random(total).sample(everything, _SAMPLE)
        per_object = total / _SAMPLE
    else:
        tracked, per_object = everything, 1.0
    own = {id(tracked), id(everything), id(on), *map(id, exclude)}
    hits: dict[int, Any] = {
        a: o for o, a in zip(tracked, map(id, tracked)) if (a >> shift) in on and a not in own
    }
    is_tracked = gc.is_tracked
    # Modules are left out of the walk: what they hold is their __dict__, itself in the
    # collector's list, and the traverse of some extension modules does not end (CPython
    # 3.12.1's _asyncio: gc.get_referents of it grew until memory ran out).
    level = [o for o in tracked if type(o) is not ModuleType]
    # Each untracked container once: one held by a million others (a shared constant tuple)
    # would otherwise be listed a million times, and its items a million times over.
    seen: set[int] = set()
    for _ in range(2):  # the tracked containers' children, then those of untracked ones
        below: list[Any] = []
        for lo in range(0, len(level), 1 << 16):
            refs = gc.get_referents(*level[lo : lo + (1 << 16)])
            hits.update((id(r), r) for r in refs if (id(r) >> shift) in on and not is_tracked(r))
            for r in refs:
                if type(r) in (tuple, dict) and id(r) not in seen and not is_tracked(r):
                    seen.add(id(r))
                    below.append(r)
            del refs
        level = below
    del seen
    del level, below, tracked, everything
    objs = list(hits.values())
    del hits
    # (type, page) -> allocated bytes of the objects of that type on that page
    weight: dict[tuple[type, int], int] = {}
    per_type = Counter(map(type, objs))
    fixed = {t: _block(t.__basicsize__ + _GC_HEAD) for t in per_type if _fixed_size(t)}
    pairs = Counter(zip(map(type, objs), map(operator.rshift, map(id, objs), repeat(shift))))
    for (t, p), n in pairs.items():
        if t in fixed:
            weight[(t, p)] = n * fixed[t]
    for o in objs:
        t = type(o)
        if t not in fixed:
            key = (t, id(o) >> shift)
            weight[key] = weight.get(key, 0) + _block(_size(o))
    del objs, pairs
    page_total: dict[int, int] = {}
    for (_, p), w in weight.items():
        page_total[p] = page_total.get(p, 0) + w
    share: dict[type, float] = dict.fromkeys(per_type, 0.0)
    # a sample misses some pages: the pages it found stand for all the pages
    scale = len(on) / max(1, len(page_total)) if step > 1 else 1.0
    for (t, p), w in weight.items():
        share[t] += page_size * w / page_total[p] * scale
    order = sorted(per_type, key=lambda t: -share[t])
    examples = _examples(named or {}, set(order[:_PATH_TYPES]), on, shift)
    rows = tuple(
        TypeRow(
            _type_name(t), round(per_type[t] * per_object), round(share[t]), examples.get(t, "")
        )
        for t in order
    )
    return Attribution(page_bytes=len(on) * page_size, rows=rows, sample=step)


def _fixed_size(t: type) -> bool:
    """Whether every object of ``t`` has the same inline size (lists, dicts and sets keep
    their items out of line)."""
    return issubclass(t, _OUT_OF_LINE) or (
        t.__itemsize__ == 0 and not issubclass(t, (str, bytes, int))
    )


def _size(o: Any) -> int:
    try:
        return sys.getsizeof(o)
    except Exception:  # a broken __sizeof__ of some extension type
        return type(o).__basicsize__


def _block(n: int) -> int:
    """Bytes the allocator gives for ``n``: pymalloc rounds small requests up to 16."""
    return (n + 15) & ~15 if n <= 512 else n


def _children(o: Any) -> list[tuple[tuple[str, Any], Any]]:
    """A few children of a container, with the step that reaches each."""
    t = type(o)
    if t is list or t is tuple:
        n = len(o)
        idx = sorted({0, n // 3, (2 * n) // 3, n - 1}) if n else []
        return [(("index", None), o[i]) for i in idx]
    if t is dict:
        return [(("key", k), v) for k, v in list(o.items())[:_DICT_KEYS]]
    if isinstance(o, (type, ModuleType, FrameType)) or callable(o):
        return []
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        return [(("attr", k), v) for k, v in list(d.items())[:_DICT_KEYS]]
    return []


def _examples(named: dict[str, Any], want: set[type], on: set[int], shift: int) -> dict[type, str]:
    """An access path for each type in ``want``: a breadth-first walk from the named roots
    that looks at a few items of each container (first, middle, last), bounded in objects
    visited and time. Of the paths that reach objects of a type on un-shared pages, the
    most frequent pattern wins (else the most frequent of any)."""
    found: dict[type, Counter[tuple[bool, str]]] = {}
    frontier = [([("root", name)], obj) for name, obj in named.items()]
    seen: set[int] = set()
    deadline = time.monotonic() + _PATH_SECONDS
    for _ in range(_PATH_DEPTH):
        nxt: list[tuple[list[tuple[str, Any]], Any]] = []
        for steps, o in frontier:
            t = type(o)
            if t in want:
                found.setdefault(t, Counter())[((id(o) >> shift) in on, _render(steps))] += 1
            if id(o) in seen:
                continue
            seen.add(id(o))
            nxt.extend(([*steps, step], c) for step, c in _children(o))
        frontier = nxt
        if not frontier or len(seen) > _PATH_NODES or time.monotonic() > deadline:
            break
    return {t: max(c.items(), key=lambda kv: (kv[0][0], kv[1]))[0][1] for t, c in found.items()}


def _render(steps: list[tuple[str, Any]]) -> str:
    out, n = [], 0
    for kind, v in steps:
        if kind == "root":
            out.append(v)
        elif kind == "index":
            out.append(f"[{_INDEX_NAMES[min(n, len(_INDEX_NAMES) - 1)]}]")
            n += 1
        elif kind == "key":
            out.append(f"[{v!r}]")
        else:
            out.append(f".{v}")
    return "".join(out)
