"""GC tooling benchmarks; writes benchmarks/results/leaks.md.

1. Leak analysis time vs heap size (10k / 100k / 1M tracked objects, 100 garbage cycles each
   pinning a numpy array): shmstore.leaks.detect (native and pure-Python graph engines; block
   scope and whole-heap scope) next to refcycle.garbage() + SCCs and
   objgraph.get_leaking_objects() on the same heap.
2. Per-test overhead of the pytest plugin (--shmstore-leaks) on 400 trivial tests.
3. gc_guard in a ThreadPoolExecutor whose tasks each leave a cycle holding 50 MB: peak RSS
   (VmHWM) and wall time without guard, with guard, and with gc.collect() after every task.

    python benchmarks/bench_leaks.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import RESULTS_DIR, machine_md, md_table, write_result
from shmstore import leaks
from shmstore.leaks import _graph

MiB = 1 << 20


class Node:
    def __init__(self, i: int) -> None:
        self.payload = {"k": i, "v": [i]}


class Circular:
    def __init__(self, data: Any) -> None:
        self.circular = self
        self.data = data


def build_heap(n_objects: int) -> list[Node]:
    """~n_objects tracked objects (a Node, its dict... three per Node on 3.11) kept alive."""
    return [Node(i) for i in range(n_objects // 3)]


def make_garbage(n: int = 100) -> None:
    for _ in range(n):
        Circular(np.zeros(1000))


def _python_engine(on: bool) -> None:
    """Bench-only switch between the graph engines (through leaks' private state)."""
    _graph._native_fn = None
    _graph._native_checked = on  # "already checked, none found" forces the Python engine
    if not on:
        _graph._native()


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_analysis(sizes: list[int]) -> str:
    objgraph = importlib.import_module("objgraph")  # untyped third-party tools
    refcycle = importlib.import_module("refcycle")

    rows = []
    native = _graph.native_available()
    for n in sizes:
        row: list[Any] = [f"{n:,}"]
        engines = [("native", False), ("python", True)] if native else [("python", True)]
        times: dict[str, float] = {}
        for name, py in engines:
            _python_engine(py)
            for _ in range(1 if py else 3):  # best of 3 for the fast engine
                with leaks.detect(collect=False) as report:
                    heap = build_heap(n)
                    make_garbage()
                assert len(report.cycles) == 100, report
                best = times.get(f"block/{name}", float("inf"))
                times[f"block/{name}"] = min(best, report.seconds)
                analysed = report.analysed_objects
                gc.disable()
                make_garbage()
                with leaks.detect(scope="heap", collect=False) as report:
                    pass
                assert len(report.cycles) >= 100, report
                best = times.get(f"heap/{name}", float("inf"))
                times[f"heap/{name}"] = min(best, report.seconds)
                heap_objects = report.analysed_objects
                gc.enable()
                del heap
                gc.collect()
        _python_engine(False)
        heap = build_heap(n)
        gc.collect()
        gc.disable()
        make_garbage()
        t_refcycle = _time(lambda: refcycle.garbage().strongly_connected_components())
        gc.collect()
        make_garbage()
        t_objgraph = _time(objgraph.get_leaking_objects)
        gc.enable()
        gc.collect()
        del heap
        gc.collect()
        row += [f"{analysed:,}", f"{heap_objects:,}"]
        for key in ("block/native", "block/python", "heap/native", "heap/python"):
            row.append(f"{times[key]:.3f}" if key in times else "n/a")
        row += [f"{t_refcycle:.3f}", f"{t_objgraph:.3f}"]
        rows.append(row)
        print("analysis", row, flush=True)
    note = (
        "Native engine: available in this build."
        if native
        else "Native engine: not in this build (`src/py/graph.rs` not registered): n/a."
    )
    return (
        note
        + "\n\n"
        + md_table(
            [
                "heap (target)",
                "objects made in block",
                "objects in heap",
                "detect block, native (s)",
                "detect block, python (s)",
                "detect heap, native (s)",
                "detect heap, python (s)",
                "refcycle.garbage()+SCC (s)",
                "objgraph.get_leaking_objects() (s)",
            ],
            rows,
        )
    )


TRIVIAL = """
import pytest

@pytest.mark.parametrize("i", range({n}))
def test_trivial(i):
    assert [i] * 3 == [i, i, i]
"""


def bench_plugin(n_tests: int, repeats: int) -> str:
    """Sum of the per-test times pytest itself records (setup + call + teardown, from
    --junitxml), so interpreter start-up and collection do not blur the difference."""
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as d:
        Path(d, "test_trivial.py").write_text(TRIVIAL.format(n=n_tests))
        env = {**os.environ, "SHMSTORE_DIR": d}
        xml = str(Path(d, "out.xml"))

        def run(*args: str) -> float:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            subprocess.run(
                [*cmd, f"--junitxml={xml}", *args], cwd=d, env=env, check=True, capture_output=True
            )
            return sum(float(tc.get("time", 0)) for tc in ET.parse(xml).iter("testcase"))

        variants = [
            ("plugin not loaded (-p no:shmstore)", ("-p", "no:shmstore")),
            ("plugin idle (no marker, no option)", ()),
            ("--shmstore-leaks (cycles + segments)", ("--shmstore-leaks",)),
        ]
        best = {label: float("inf") for label, _ in variants}
        for _ in range(repeats):  # interleaved, best of `repeats`
            for label, args in variants:
                best[label] = min(best[label], run(*args))
        rows = []
        base = best[variants[0][0]]
        for label, _ in variants:
            per_test_us = (best[label] - base) / n_tests * 1e6
            rows.append(
                [
                    label,
                    f"{best[label]:.3f}",
                    f"{best[label] / n_tests * 1e6:.0f}",
                    f"{per_test_us:.0f}",
                ]
            )
            print("plugin", rows[-1], flush=True)
    return md_table(
        ["run", f"sum of {n_tests} test times (s)", "per test (µs)", "added per test (µs)"],
        rows,
    )


def guard_child(mode: str, tasks: int, mb: int) -> None:
    """One workload run in a fresh process, so VmHWM is this run's peak."""
    guard = None
    if mode == "guard":
        guard = leaks.GcGuard(min_growth=2 * mb * MiB)
    elif mode == "guard50":
        guard = leaks.GcGuard(min_growth=2 * mb * MiB, max_gc_fraction=0.5)

    def task(i: int) -> int:
        Circular(np.ones(mb * MiB // 8))
        if mode == "collect":
            gc.collect()
        return i

    fn = guard.wrap(task) if guard is not None else task
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(fn, range(tasks))) == list(range(tasks))
    wall = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    out = {"wall": wall, "peak": hwm, "collections": 0, "gc_seconds": 0.0}
    if guard is not None:
        out.update(collections=guard.stats.collections, gc_seconds=guard.stats.gc_seconds)
    print(json.dumps(out))


def bench_guard(tasks: int, mb: int) -> str:
    rows = []
    for mode, label in [
        ("none", "no guard (gc enabled, default thresholds)"),
        ("guard", f"gc_guard (min_growth {2 * mb} MiB, default budget 5% + 0.1 s)"),
        ("guard50", f"gc_guard (min_growth {2 * mb} MiB, budget 50%)"),
        ("collect", "gc.collect() after every task"),
    ]:
        res = subprocess.run(
            [sys.executable, __file__, "--guard-child", mode, str(tasks), str(mb)],
            check=True,
            capture_output=True,
            text=True,
        )
        r = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(
            [
                label,
                f"{r['peak'] / MiB:,.0f}",
                f"{r['wall']:.2f}",
                "every task" if mode == "collect" else str(r["collections"]),
                f"{r['gc_seconds'] * 1000:.0f}" if mode.startswith("guard") else "",
            ]
        )
        print("guard", rows[-1], flush=True)
    return md_table(
        ["variant", "peak RSS (MiB)", "wall (s)", "collections by the guard", "guard gc time (ms)"],
        rows,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--guard-child", nargs=3, metavar=("MODE", "TASKS", "MB"))
    ap.add_argument(
        "--only", choices=("analysis", "plugin", "guard"), help="run one part, print it only"
    )
    args = ap.parse_args()
    if args.guard_child:
        mode, tasks, mb = args.guard_child
        guard_child(mode, int(tasks), int(mb))
        return 0
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    parts = {
        "analysis": lambda: bench_analysis(sizes),
        "plugin": lambda: bench_plugin(100 if args.quick else 400, 1 if args.quick else 5),
        "guard": lambda: bench_guard(8 if args.quick else 40, 50),
    }
    if args.only:
        print(parts[args.only]())
        return 0
    analysis, plugin, guard = (parts[k]() for k in ("analysis", "plugin", "guard"))
    text = f"""# GC tooling benchmarks

{machine_md()}

Produced by `python benchmarks/bench_leaks.py` (`make bench`).

## Leak analysis time vs heap size

The heap: ~N tracked objects kept alive (`Node` instances, their dicts and lists) plus 100
garbage cycles (`Circular`, each pinning a 1000-float numpy array). *detect block* analyses
the objects made inside the `with` block (the heap was built there); *detect heap* analyses
every tracked object (`scope="heap"`, like the other tools); the time includes finding the
cycles, their paths and retained bytes. *native* is the Rust graph engine
(`_native.gc_unreachable`), *python* the pure-Python fallback. refcycle runs
`gc.collect()` with `DEBUG_SAVEALL` (finalizers and weakref callbacks run) and then computes
SCCs; objgraph lists objects nothing refers to. Native times are the best of 3 runs, the
others one run each. Target: 1M objects in <= 1 s. The machine was shared with other
builds and benchmarks while this ran (see the load average above).

{analysis}

## Per-test overhead of the pytest plugin

{plugin}

## gc_guard in a thread pool

{8 if args.quick else 40} tasks on a 2-thread `ThreadPoolExecutor`, each leaving a
`Circular` cycle that pins a 50 MB numpy array. Peak RSS is the process's VmHWM (each variant
runs in a fresh process).

{guard}

Reading it: without a guard nothing collects the cycles (the tasks allocate too few Python
objects to trigger gc) and every 50 MB array stays pinned; the wall time then includes faulting
in ~2 GB of fresh pages. The default budget (5% of elapsed time + 0.1 s) is deliberately
conservative: these tasks last ~15 ms, so it allows only a few collections in the half second
the run takes; with tasks of seconds (the xgboost case) the budget is not what limits it.
`max_gc_fraction=0.5` keeps the peak within a few arrays of the baseline.
"""
    write_result(RESULTS_DIR / "leaks.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
