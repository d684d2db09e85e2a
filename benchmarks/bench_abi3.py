"""Does the abi3 (stable ABI) build slow the hot paths? Two builds of shmstore, side by side.

Two installed copies of the package (``--a`` and ``--b``: a directory holding ``shmstore/``,
e.g. an unpacked wheel) run the same work in fresh processes, alternating, ``--rounds`` times:
build ``SharedList(records)``, the field-touch loop over every record (bench_speed.py's), and
``to_python()`` of every record, on benchmarks/coco.py records. Each operation is timed in
**CPU time of the thread** (``time.thread_time``), best of ``--repeats`` in a process, so that
time spent waiting for a CPU on a busy machine does not count; the table gives the medians over
the rounds of those per-process bests, and the fastest of all.

    python benchmarks/bench_abi3.py [--a DIR_VERSION_SPECIFIC --b DIR_ABI3] \\
        [--n 50000] [--rounds 7] [--repeats 3] [--out benchmarks/results/abi3.md]

Without ``--a``/``--b`` it unpacks this interpreter's version-specific wheel and the abi3
wheel from ``dist/`` (``make wheels``), and says so and stops if they are not there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import json
import os
import subprocess
import tempfile
import zipfile
from typing import Any

import _common as C

BENCH_DIR = Path(__file__).resolve().parent
METRICS = [
    ("build: `SharedList(records)`", "build_shmstore"),
    ("field-touch loop: `lst[i]` views", "touch_shmstore"),
    ("`lst[i].to_python()` of every record", "to_python_shmstore"),
]
CHILD = """
import gc, json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import shmstore, _common as C
from coco import make_records

n, repeats = int(sys.argv[3]), int(sys.argv[4])
records = make_records(n)
best = {}

def timed(key, fn):
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        out = fn()
        dt = time.thread_time() - t0
    finally:
        gc.enable()
    best[key] = min(best.get(key, dt), dt)
    return out

for _ in range(repeats):
    lst = timed("build_shmstore", lambda: shmstore.SharedList(records))
    timed("touch_shmstore", lambda: C.touch_sequence(lst))
    timed("to_python_shmstore", lambda: C.materialize_shmstore(lst))
    lst.unlink()
    lst.close()
print(json.dumps({"native": shmstore._native.__file__, "best": best}))
"""


def one(pkg_dir: Path, n: int, repeats: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(pkg_dir), str(BENCH_DIR), str(n), str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark process failed:\n{proc.stdout}\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["native"].startswith(str(pkg_dir)):
        raise SystemExit(f"{pkg_dir}: imported {out['native']} instead")
    return out


def _unpacked_wheels(dist: Path, into: Path) -> dict[str, Path] | None:
    """This interpreter's version-specific wheel and the abi3 wheel from ``dist``, unpacked."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    found = {
        "a": sorted(dist.glob(f"shmstore-*-{tag}-{tag}-*.whl")),
        "b": sorted(dist.glob("shmstore-*-abi3-*.whl")),
    }
    if not all(found.values()):
        return None
    out = {}
    for key, wheels in found.items():
        out[key] = into / key
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(out[key])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--a", type=Path, help="the version-specific build (default: from dist/)")
    ap.add_argument("--b", type=Path, help="the abi3 build (default: from dist/)")
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "abi3.md")
    args = ap.parse_args(argv)
    if args.a is None or args.b is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-abi3-"))
        unpacked = _unpacked_wheels(BENCH_DIR.parent / "dist", tmp)
        if unpacked is None:
            print("bench_abi3: skipped: no version-specific + abi3 wheels in dist/ (make wheels)")
            return 0
        args.a, args.b = unpacked["a"], unpacked["b"]
    dirs = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    natives: dict[str, str] = {}
    for r in range(args.rounds):
        for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
            out = one(dirs[key], args.n, args.repeats)
            natives[key] = Path(out["native"]).name
            runs[key].append(out["best"])
            print(f"round {r + 1}/{args.rounds} {key}: {out['best']}", file=sys.stderr)
    rows = []
    for label, key in METRICS:
        med = {k: C.median([m[key] for m in runs[k]]) for k in runs}
        best = {k: min(m[key] for m in runs[k]) for k in runs}
        rows.append(
            [
                label,
                f"{med['a'] * 1e3:,.1f} ms",
                f"{med['b'] * 1e3:,.1f} ms",
                f"{med['b'] / med['a']:.3f}",
                f"{best['a'] * 1e3:,.1f} / {best['b'] * 1e3:,.1f} ms",
                f"{best['b'] / best['a']:.3f}",
            ]
        )
    text = "\n".join(
        [
            "# abi3 vs version-specific build: hot-path speed",
            "",
            C.machine_md(),
            "",
            f"{args.n:,} COCO-like records; each operation timed in CPU time of the thread, best "
            f"of {args.repeats} in a fresh process; {args.rounds} rounds alternating between the "
            "builds; medians over the rounds of those bests.",
            f"A = `{natives['a']}` from `{args.a}`; B = `{natives['b']}` from `{args.b}`.",
            "",
            C.md_table(
                [
                    "operation",
                    "A (version-specific), median",
                    "B (abi3), median",
                    "B / A",
                    "fastest A / B",
                    "B / A (fastest)",
                ],
                rows,
            ),
            "",
            "All per-process bests (ms), in order: "
            + "; ".join(
                f"{k.upper()} {key}: " + ", ".join(f"{m[key] * 1e3:.1f}" for m in runs[k])
                for _, key in METRICS
                for k in runs
            ),
            "",
        ]
    )
    print(text)
    C.write_result(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
