"""`make demo`: bench_memory.py at a demo size (about 3 minutes on 2 cores).

50,000 COCO-like records, 4 workers that each read every record once, under fork, spawn and
forkserver: a plain Python list, the usual pickle-per-record numpy buffer, and a shmstore
SharedList. Prints the markdown table (no results file). See bench_memory.py for the method.
Each start method takes about a third of the time: ``--methods fork`` for a one-minute run.

    python benchmarks/demo.py [--n 50000] [--workers 4] [--methods fork,spawn,forkserver]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import time

import _common as C
import bench_memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=50_000, help="records (default 50000)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument(
        "--methods", default="fork,spawn,forkserver", help="comma-separated start methods"
    )
    args = ap.parse_args(argv)

    approaches = list(C.APPROACHES)
    if C.load_shmstore() is None:
        print(f"WARNING: shmstore is not importable, not shown: {C.shmstore_error()}")
        approaches.remove("shmstore")
    t0 = time.perf_counter()
    print(f"shmstore demo: {args.n:,} records, {args.workers} workers ...", file=sys.stderr)
    methods = [m for m in args.methods.split(",") if m]
    results = bench_memory.run_matrix(args.n, args.workers, methods, approaches)
    title = f"shmstore demo: memory of {args.workers} workers that each read every record"
    print(bench_memory.render(results, title=title, compact=True))
    print(f"Run time: {time.perf_counter() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
