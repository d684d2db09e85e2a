"""From unreachable objects to a report: cycles, what each retains, paths, attribution."""

from __future__ import annotations

import gc
import sys
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ._graph import shortest_cycle, strongly_connected
from ._paths import _type_lookup, cycle_path, type_name
from ._report import Cycle

__all__ = ["AllowSpec", "build_cycles", "matches_allow"]

AllowSpec = Union[type, str]
_PROBE_KEY = -1
_SHARED = -2
# Builtin plumbing: a path starts at the first member that is not one of these.
_PLUMBING = frozenset(
    {
        dict,
        list,
        tuple,
        set,
        frozenset,
        types.FunctionType,
        types.MethodType,
        types.CellType,
        types.FrameType,
        types.TracebackType,
        types.CodeType,
        types.ModuleType,
    }
)


def _start_rank(tp: type) -> int:
    """Where a cycle's path starts: user types, then code-ish objects, then containers."""
    if tp not in _PLUMBING:
        return 0
    if tp in (types.FunctionType, types.MethodType, types.FrameType):
        return 1
    return 2


def matches_allow(tp: type, allow: Sequence[AllowSpec]) -> bool:
    """True if ``tp`` is (a subclass of) an allowed type, or its module/name matches a string.

    A string matches ``module.QualName`` exactly, or a module and its submodules (``"pkg"``
    matches ``pkg.mod.Type``).
    """
    name = type_name(tp)
    mod = type.__dict__["__module__"].__get__(tp)
    for spec in allow:
        if type(spec) is str:
            if name == spec or (
                isinstance(mod, str) and (mod == spec or mod.startswith(spec + "."))
            ):
                return True
        elif spec in type.__dict__["__mro__"].__get__(tp):
            return True
    return False


def _referents(obj: Any, ndarray: Optional[type]) -> list[Any]:
    refs = gc.get_referents(obj)
    # numpy arrays have no tp_traverse: follow .base by hand (numpy/numpy#6581)
    if ndarray is not None and issubclass(type(obj), ndarray):
        base = ndarray.base.__get__(obj)  # type: ignore[attr-defined]
        if base is not None:
            refs.append(base)
    return refs


def _sizes(obj: Any, ndarray: Optional[type], mmap_type: Optional[type]) -> tuple[int, int]:
    """(total bytes, buffer bytes) of one object, without running user-defined __sizeof__."""
    tp = type(obj)
    if type(_type_lookup(tp, "__sizeof__")) is types.FunctionType:
        size = object.__sizeof__(obj) + (16 if gc.is_tracked(obj) else 0)
    else:
        try:
            size = sys.getsizeof(obj)
        except Exception:
            size = object.__sizeof__(obj)
    buf = 0
    if ndarray is not None and issubclass(tp, ndarray):
        if ndarray.flags.__get__(obj).owndata:  # type: ignore[attr-defined]
            buf = int(ndarray.nbytes.__get__(obj))  # type: ignore[attr-defined]
    elif issubclass(tp, bytes):
        buf = bytes.__len__(obj)
    elif issubclass(tp, bytearray):
        buf = bytearray.__alloc__(obj)
    elif mmap_type is not None and issubclass(tp, mmap_type):
        try:
            buf = mmap_type.__len__(obj)  # type: ignore[attr-defined]
        except ValueError:  # closed
            buf = 0
        size += buf  # mmap's __sizeof__ does not count the mapping
    return size, buf


@dataclass
class _Dead:
    """The garbage graph: tracked unreachable objects first, then what dies with them."""

    objects: list[Any]
    adj: list[list[int]]


def _grow_dead(garbage: list[Any], ndarray: Optional[type]) -> _Dead:
    """Add to the garbage every object whose references all come from dead objects."""
    dead_index: dict[int, int] = {id(o): i for i, o in enumerate(garbage)}
    objects = list(garbage)
    adj: list[list[int]] = [[] for _ in objects]
    pending: dict[int, Any] = {}
    inref: Counter[int] = Counter()
    parents: dict[int, list[int]] = {}
    true_refs: dict[int, int] = {}

    def scan(first: int) -> set[int]:
        touched: set[int] = set()
        for i in range(first, len(objects)):
            for r in _referents(objects[i], ndarray):
                rid = id(r)
                j = dead_index.get(rid)
                if j is not None:
                    adj[i].append(j)
                    continue
                if rid not in pending:
                    pending[rid] = r
                inref[rid] += 1
                parents.setdefault(rid, []).append(i)
                touched.add(rid)
        return touched

    start = 0
    while True:
        touched = scan(start)
        # Calibrated refcounts of the objects met for the first time: `pending` is our only
        # reference to them now (scan's locals are gone); the probe shows what reading adds.
        new_ids = [rid for rid in touched if rid not in true_refs]
        pending[_PROBE_KEY] = []
        counts = [sys.getrefcount(pending[k]) for k in [*new_ids, _PROBE_KEY]]
        del pending[_PROBE_KEY]
        base = counts.pop()
        for rid, c in zip(new_ids, counts):
            true_refs[rid] = c - base
        newly = [rid for rid in touched if inref[rid] >= true_refs[rid]]
        if not newly:
            break
        start = len(objects)
        for rid in newly:
            obj = pending.pop(rid)
            dead_index[rid] = len(objects)
            objects.append(obj)
            adj.append([])
            for p in parents.pop(rid):
                adj[p].append(dead_index[rid])
            del obj
    return _Dead(objects, adj)


def build_cycles(
    garbage: list[Any],
    *,
    allow: Sequence[AllowSpec] = (),
    keep: bool = False,
    thread_of: Optional[Callable[[Iterable[Any]], tuple[Optional[str], Optional[str]]]] = None,
    only_current_thread: bool = False,
) -> tuple[list[Cycle], int, int, int, int]:
    """Group ``garbage`` into cycles. Returns (cycles, total retained bytes, allowed, other,
    the garbage objects that cycles hold: the rest, let go by another thread during the
    analysis, refcounting frees).

    ``garbage`` (tracked unreachable objects, in allocation order) is consumed.
    """
    np = sys.modules.get("numpy")
    ndarray = getattr(np, "ndarray", None) if np is not None else None
    mmap_mod = sys.modules.get("mmap")
    mmap_type = getattr(mmap_mod, "mmap", None) if mmap_mod is not None else None

    dead = _grow_dead(garbage, ndarray)
    g = len(garbage)
    del garbage[:]
    objects, adj = dead.objects, dead.adj
    gadj = [[w for w in adj[v] if w < g] for v in range(g)]
    comp, ncomp = strongly_connected(gadj)
    members: list[list[int]] = [[] for _ in range(ncomp)]
    for v in range(g):
        members[comp[v]].append(v)

    # Only what a cycle holds is garbage the collector must free. An unreachable object that
    # no cycle reaches was let go by another thread while the analysis held it (between the
    # snapshot and the refcounts): refcounting frees it once the analysis drops it.
    held = [False] * g
    stack = [v for v in range(g) if len(members[comp[v]]) > 1 or v in gadj[v]]
    for v in stack:
        held[v] = True
    while stack:
        for w in gadj[stack.pop()]:
            if not held[w]:
                held[w] = True
                stack.append(w)

    # Root components: no other held component points into them.
    has_parent = [False] * ncomp
    for v in range(g):
        if not held[v]:
            has_parent[comp[v]] = True  # not a root: not reported
            continue
        for w in gadj[v]:
            if comp[w] != comp[v]:
                has_parent[comp[w]] = True

    # Owner of each dead object: the only root component reaching it, or _SHARED; -1 for
    # what only an object refcounting frees reaches (not counted).
    owner = [-1] * len(objects)
    queue: list[int] = []
    for c in range(ncomp):
        if not has_parent[c]:
            for v in members[c]:
                owner[v] = c
                queue.append(v)
    for v in queue:
        ov = owner[v]
        for w in adj[v]:
            ow = owner[w]
            if ow == -1 or (ow != ov and ow != _SHARED):
                owner[w] = ov if ow == -1 else _SHARED
                queue.append(w)

    total = 0
    per_owner_bytes = [0] * ncomp
    per_owner_buf = [0] * ncomp
    per_owner_count = [0] * ncomp
    per_owner_types: list[Counter[str]] = [Counter() for _ in range(ncomp)]
    owned: list[list[int]] = [[] for _ in range(ncomp)]
    for v, obj in enumerate(objects):
        o = owner[v]
        if o == -1:
            continue
        size, buf = _sizes(obj, ndarray, mmap_type)
        total += size
        if o >= 0:
            per_owner_bytes[o] += size
            per_owner_buf[o] += buf
            per_owner_count[o] += 1
            per_owner_types[o][type_name(type(obj))] += 1
            owned[o].append(v)

    cycles: list[Cycle] = []
    allowed = other = 0
    for c in range(ncomp):
        if has_parent[c]:
            continue
        mem = members[c]
        if any(matches_allow(type(objects[v]), allow) for v in mem):
            allowed += 1
            continue
        start = min(mem, key=lambda v: (_start_rank(type(objects[v])), v))
        walk = shortest_cycle(gadj, comp, start)
        where, thread = (None, None)
        if thread_of is not None:
            order = [start, *(v for v in mem if v != start), *(v for v in owned[c] if v >= g)]
            where, thread = thread_of(objects[v] for v in order[:64])
        if only_current_thread and thread == "other":
            other += 1
            continue
        kinds = Counter(type_name(type(objects[v])) for v in mem)
        cycles.append(
            Cycle(
                types=dict(kinds.most_common()),
                path=cycle_path([objects[v] for v in walk]),
                retained_bytes=per_owner_bytes[c],
                buffer_bytes=per_owner_buf[c],
                size=len(mem),
                retained_objects=per_owner_count[c],
                retained_types=dict(per_owner_types[c].most_common()),
                allocated_at=where,
                thread=thread,
                objects=tuple(objects[v] for v in mem) if keep else (),
            )
        )
    cycles.sort(key=lambda cy: cy.retained_bytes, reverse=True)
    return cycles, total, allowed, other, sum(held)
