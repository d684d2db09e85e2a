"""`make bench`: run every benchmarks/bench_*.py, each in its own process with its default
arguments (results go to benchmarks/results/). Exits non-zero if any of them failed.

    python benchmarks/run_all.py [--list] [-k NAME]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def discover() -> list[Path]:
    return sorted(BENCH_DIR.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("-k", default="", help="only the bench_<name>.py whose <name> contains this")
    args = ap.parse_args(argv)

    benches = [p for p in discover() if args.k in p.stem.removeprefix("bench_")]
    if args.list:
        print("\n".join(p.name for p in benches))
        return 0
    if not benches:
        print("no benchmarks found", file=sys.stderr)
        return 1
    summary = []
    for path in benches:
        print(f"=== {path.name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(path)], cwd=BENCH_DIR.parent)
        summary.append((path.name, rc, time.perf_counter() - t0))
    print("=== summary")
    for name, rc, dt in summary:
        print(f"  {name:<30} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {dt:7.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
