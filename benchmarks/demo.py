"""`make demo`: bench_memory.py at a demo size (`--full`: the larger run).

COCO-like records, 4 workers that each read every record once: a plain Python list, the usual
pickle-per-record numpy buffer, and a shmstore SharedList. By default 20,000 records under fork
and spawn (forkserver shares like spawn); ``--full`` runs 50,000 records under fork, spawn and
forkserver. Prints the markdown table (no results file). See bench_memory.py for the method,
and benchmarks/results/memory.md for the measured full-size run.

    python benchmarks/demo.py [--full] [--n N] [--workers 4] [--methods fork,spawn,forkserver]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import time

import _common as C
import bench_memory

QUICK = {"n": 20_000, "methods": "fork,spawn"}
FULL = {"n": 50_000, "methods": "fork,spawn,forkserver"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument(
        "--full", action="store_true", help="50,000 records, fork, spawn and forkserver"
    )
    ap.add_argument("--n", type=int, default=None, help="records (default 20000; --full: 50000)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated start methods (default fork,spawn; --full: all three)",
    )
    args = ap.parse_args(argv)
    size = FULL if args.full else QUICK
    n = size["n"] if args.n is None else args.n
    methods = [m for m in (args.methods or size["methods"]).split(",") if m]

    approaches = list(C.APPROACHES)
    if C.load_shmstore() is None:
        print(f"WARNING: shmstore is not importable, not shown: {C.shmstore_error()}")
        approaches.remove("shmstore")
    t0 = time.perf_counter()
    print(
        f"shmstore demo: {n:,} records, {args.workers} workers, {', '.join(methods)}"
        + ("" if args.full else " (the quick run; --full for 50,000 records and forkserver)")
        + " ...",
        file=sys.stderr,
    )
    results = bench_memory.run_matrix(n, args.workers, methods, approaches)
    title = f"shmstore demo: memory of {args.workers} workers that each read every record"
    print(bench_memory.render(results, title=title, compact=True))
    print(f"Run time: {time.perf_counter() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
