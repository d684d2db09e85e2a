"""Threads reading one store: how reads scale with threads in one process.

    python benchmarks/bench_threads.py [--n 50000] [--threads 1 2 4] [--rounds 5] [--out FILE]
    python benchmarks/bench_threads.py --beside-busy [--sizes 1 64 256 1024] [--out FILE]

Each of T threads touches the fields of its own 1/T of the COCO-like records in order (the
touch loop of bench_format: every annotation's bbox[0], category_id and area, and the image's
height), all threads started together behind a barrier; the time is from the barrier to the
last thread's end, median of `--rounds`. The same for a plain list of the same dicts, which
the threads read side by side. On an interpreter with a GIL the threads take turns, so the
time stays that of one thread; on a free-threaded one (3.14t) they run in parallel, up to
the cores. Prints a markdown table and, with `--out`, writes it with the machine's facts.
Changes nothing on the machine.

`--beside-busy`: small objects put, sent and got by one thread while another thread of the
process runs a Python loop (as a progress bar, a prefetching or a logging thread may): each
time a call gives the GIL back, the busy thread may keep it for the interpreter's switch
interval (5 ms). Per call, the median of `--rounds` rounds of `--ops` calls, alone and
beside the busy thread: `put` then `close`, a `Channel`'s put then get, and unpickling a
`Ref` then its get (a fresh handle each time, as a receiving process opens one); and a
16-byte `put` with `arena=False` (a segment of its own) then `close`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import coco
import shmstore
from _common import machine_md, md_table, per_call


def touch(records: Sequence[Any], lo: int, hi: int) -> float:
    total = 0.0
    for i in range(lo, hi):
        r = records[i]
        total += r["height"]
        for a in r["annotations"]:
            total += a["bbox"][0] + a["category_id"] + a["area"]
    return total


def timed(records: Sequence[Any], threads: int) -> float:
    """Seconds for `threads` threads to touch their shares of `records` together."""
    n = len(records)
    bounds = [(n * k // threads, n * (k + 1) // threads) for k in range(threads)]
    barrier = threading.Barrier(threads + 1)
    sums: list[float] = [0.0] * threads

    def work(k: int) -> None:
        barrier.wait()
        sums[k] = touch(records, *bounds[k])

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def beside_busy(sizes_kib: list[int], ops: int, rounds: int) -> str:
    """The `--beside-busy` table (see the module's text)."""
    import pickle

    import numpy as np

    ch = shmstore.Channel(64)
    steps: dict[str, Any] = {}
    refs = []  # the unpickled handles' chunks stay given out while they are measured
    for kib in sizes_kib:
        a = np.full(kib << 10, 7, dtype=np.uint8)
        ref = shmstore.put(a)
        data = pickle.dumps(ref)
        steps[f"put + close, {kib} KiB"] = lambda a=a: shmstore.put(a).close()
        steps[f"Channel put + get, {kib} KiB"] = lambda a=a: (ch.put(a), ch.get())
        steps[f"unpickle a Ref + get, {kib} KiB"] = lambda d=data: pickle.loads(d).get()
        refs.append(ref)
    # A segment of its own: the supervisor's round trip and the file work are done without
    # the GIL, each stretch a chance for the busy thread to keep it (docs/lifecycle.md).
    tiny = np.zeros(2)
    steps["put(16 B, arena=False) + close"] = lambda: shmstore.put(tiny, arena=False).close()
    rows = []
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    for name, step in steps.items():
        step()  # an arena made, a chunk opened: once
        alone = per_call(step, ops, rounds)
        busy = threading.Thread(target=spin)
        busy.start()
        try:
            beside = per_call(step, ops, rounds)
        finally:
            stop.set()
            busy.join()
            stop.clear()
        rows.append(
            [name, f"{alone * 1e6:.1f} µs", f"{beside * 1e6:.1f} µs", f"{beside / alone:.1f}x"]
        )
    for ref in refs:
        ref.close()
    ch.close()
    head = (
        f"One thread's calls alone and beside a thread running a Python loop; per call, "
        f"median of {rounds} rounds of {ops}. CPython {sys.version.split()[0]}, switch "
        f"interval {sys.getswitchinterval() * 1e3:g} ms; {os.cpu_count()} cores; load before "
        f"{os.getloadavg()[0]:.2f}.\n\n"
    )
    return head + md_table(["call", "alone", "beside a busy thread", "ratio"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=50_000, help="records")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--beside-busy", action="store_true", help="small objects beside a busy thread")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256, 1024], help="KiB")
    ap.add_argument("--ops", type=int, default=200, help="calls per round (--beside-busy)")
    args = ap.parse_args()
    if args.beside_busy:
        text = beside_busy(args.sizes, args.ops, args.rounds)
        print(text)
        if args.out:
            args.out.write_text(
                "# Small objects beside a busy thread\n\n" + machine_md() + "\n\n" + text + "\n"
            )
        return

    records = coco.make_records(args.n)
    shared = shmstore.SharedList(records)
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    # Warm both (the store's first pass checks each block: not what this measures).
    touch(records, 0, len(records))
    touch(shared, 0, len(shared))
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for t in args.threads:
            for name, recs in (("plain", records), ("shmstore", shared)):
                times.setdefault((name, t), []).append(timed(recs, t))
    med = {k: statistics.median(v) for k, v in times.items()}
    one = min(args.threads)
    rows = []
    for t in args.threads:
        p, s = med[("plain", t)], med[("shmstore", t)]
        rows.append(
            [
                t,
                f"{p * 1e3:.1f} ms",
                f"{med[('plain', one)] / p:.2f}x",
                f"{s * 1e3:.1f} ms",
                f"{med[('shmstore', one)] / s:.2f}x",
                f"{s / p:.2f}x",
            ]
        )
    head = (
        f"{args.n:,} COCO-like records touched in order by T threads, each its own share; "
        f"median of {args.rounds} rounds. CPython {sys.version.split()[0]}"
        f"{' free-threaded' if free_threaded else ''}, GIL {'on' if gil else 'off'}; "
        f"{os.cpu_count()} cores; load before {os.getloadavg()[0]:.2f}.\n\n"
    )
    table = md_table(
        [
            "threads",
            "plain list",
            f"speed-up over {one}",
            "SharedList",
            f"speed-up over {one}",
            "SharedList / plain",
        ],
        rows,
    )
    print(head + table)
    if args.out:
        args.out.write_text(
            "# Threads reading one store\n\n" + machine_md() + "\n\n" + head + table + "\n"
        )
    shared.close()


if __name__ == "__main__":
    main()
