"""Find the cyclic garbage among a list of candidate objects, without collecting it.

Method (the same bookkeeping as CPython's own collector, done from the outside):

1. ``external(o) = refcount(o) - references to o from other candidates``. The refcount is read
   with ``sys.getrefcount``; the references from candidates are counted without hashing
   anything, by reading the refcounts a second time while a list returned by
   ``gc.get_referents(*candidates)`` holds one extra reference per internal edge.
   A probe object appended to the list calibrates what our own list and the call add.
2. Every candidate with ``external > 0`` is referenced from outside (a frame, an older object, a
   C global, an untracked container): it and everything it reaches among the candidates is alive.
3. The candidates left are unreachable: cyclic garbage and what hangs off it.

Nothing is collected, no finalizer or weakref callback runs, ``gc.garbage`` is untouched: the
objects are only read. When the native module ``shmstore._native`` provides
``gc_unreachable`` (the same algorithm over ``tp_traverse`` in Rust) it is used on builds with a
GIL; this pure-Python version is the fallback and the reference.
"""

from __future__ import annotations

import gc
import operator
import sys
from itertools import compress, repeat
from typing import Any, Callable, Optional

__all__ = ["find_unreachable", "native_available", "strongly_connected"]

_NativeFn = Callable[[list[Any]], list[int]]
_native_fn: Optional[_NativeFn] = None
_native_checked = False


def _gil_enabled() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def _native() -> Optional[_NativeFn]:
    global _native_fn, _native_checked
    if not _native_checked:
        _native_checked = True
        try:
            import importlib

            mod = importlib.import_module("shmstore._native")
            _native_fn = getattr(mod, "gc_unreachable", None)
        except ImportError:
            _native_fn = None
    return _native_fn


def native_available() -> bool:
    """True when the Rust implementation will be used for the graph work."""
    return _native() is not None and _gil_enabled()


def find_unreachable(candidates: list[Any], *, use_native: Optional[bool] = None) -> list[int]:
    """Indices of the candidates that no reference from outside the list keeps alive.

    ``candidates`` must hold each object once and be the caller's only reference to objects
    it created for the analysis. It is left unchanged.
    """
    fn = _native() if use_native is not False else None
    if fn is not None and _gil_enabled():
        candidates.append([])  # calibration probe: referenced by the list only
        try:
            return fn(candidates)
        finally:
            candidates.pop()
    if use_native:
        raise RuntimeError("the native gc_unreachable is not available in this build")
    return _unreachable_py(candidates)


def _unreachable_py(cand: list[Any]) -> list[int]:
    cand.append([])  # calibration probe: referenced by `cand` only
    try:
        before = list(map(sys.getrefcount, cand))
        flat = gc.get_referents(*cand)
        after = list(map(sys.getrefcount, cand))
        del flat
    finally:
        cand.pop()
    base = before.pop()
    after.pop()
    # external = before - base - (after - before) > 0   <=>   2*before - after > base
    ext = list(
        map(operator.gt, map(operator.sub, map(operator.add, before, before), after), repeat(base))
    )
    del before, after
    ids = list(map(id, cand))
    by_id = dict(zip(ids, range(len(cand))))
    unvisited = set(ids)
    frontier = list(compress(cand, ext))
    unvisited.difference_update(map(id, frontier))
    while frontier and unvisited:
        reached = set(map(id, gc.get_referents(*frontier)))
        reached.intersection_update(unvisited)
        unvisited.difference_update(reached)
        frontier = [cand[i] for i in map(by_id.__getitem__, reached)]
    return sorted(map(by_id.__getitem__, unvisited))


def strongly_connected(adj: list[list[int]]) -> tuple[list[int], int]:
    """Tarjan's SCC, iterative. Returns (component of each node, number of components).

    Components are numbered in reverse topological order (a component only points to
    components with smaller numbers).
    """
    n = len(adj)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    ncomp = 0
    for start in range(n):
        if index[start] != -1:
            continue
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        work = [(start, 0)]
        while work:
            v, pos = work[-1]
            edges = adj[v]
            if pos < len(edges):
                work[-1] = (v, pos + 1)
                w = edges[pos]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w] and index[w] < low[v]:
                    low[v] = index[w]
                continue
            work.pop()
            if work:
                u = work[-1][0]
                if low[v] < low[u]:
                    low[u] = low[v]
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp, ncomp


def shortest_cycle(adj: list[list[int]], comp: list[int], start: int) -> list[int]:
    """Nodes of a shortest closed walk from ``start`` back to it inside its component."""
    c = comp[start]
    parent = {start: -1}
    queue = [start]
    for v in queue:
        for w in adj[v]:
            if w == start:
                path = [v]
                while parent[path[-1]] != -1:
                    path.append(parent[path[-1]])
                path.reverse()
                return [*path, start]
            if comp[w] == c and w not in parent:
                parent[w] = v
                queue.append(w)
    return [start]
