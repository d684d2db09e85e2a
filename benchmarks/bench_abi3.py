"""Does the abi3 (stable ABI) build slow the hot paths? Two builds of shmstore, side by side.

Runs ``bench_speed.run`` (build, field-touch loop, ``to_python``; see bench_speed.py) in fresh
processes, alternating between two installed copies of the package (``--a`` and ``--b``: a
directory holding ``shmstore/``, e.g. an unpacked wheel), ``--rounds`` times. Each process also
times the pickle baseline, so every shmstore time is taken both raw and as a ratio to pickle in
the same process (which cancels most of the machine's load drift). Medians over the rounds.

    python benchmarks/bench_abi3.py --a DIR_VERSION_SPECIFIC --b DIR_ABI3 \\
        [--n 100000] [--rounds 5] [--out benchmarks/results/abi3.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import json
import os
import subprocess
from typing import Any

import _common as C

BENCH_DIR = Path(__file__).resolve().parent
METRICS = [
    ("build", "build_shmstore", "build_pickle"),
    ("field-touch loop", "touch_shmstore", "touch_pickle"),
    ("to_python", "to_python_shmstore", "to_python_pickle"),
]
CHILD = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import shmstore, bench_speed
res = bench_speed.run(int(sys.argv[3]), 1)
print(json.dumps({"native": shmstore._native.__file__, "median": res["median"]}))
"""


def one(pkg_dir: Path, n: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(pkg_dir), str(BENCH_DIR), str(n)],
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--a", type=Path, required=True, help="the version-specific build")
    ap.add_argument("--b", type=Path, required=True, help="the abi3 build")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "abi3.md")
    args = ap.parse_args(argv)
    dirs = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    natives: dict[str, str] = {}
    for r in range(args.rounds):
        for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
            out = one(dirs[key], args.n)
            natives[key] = Path(out["native"]).name
            runs[key].append(out["median"])
            print(f"round {r + 1}/{args.rounds} {key}: {out['median']}", file=sys.stderr)
    rows = []
    for label, shm, base in METRICS:
        raw = {k: C.median([m[shm] for m in runs[k]]) for k in runs}
        rel = {k: C.median([m[shm] / m[base] for m in runs[k]]) for k in runs}
        best = {k: min(m[shm] for m in runs[k]) for k in runs}
        rows.append(
            [
                label,
                f"{raw['a'] * 1e3:,.0f} ms",
                f"{raw['b'] * 1e3:,.0f} ms",
                f"{raw['b'] / raw['a']:.3f}",
                f"{rel['b'] / rel['a']:.3f}",
                f"{best['a'] * 1e3:,.0f} / {best['b'] * 1e3:,.0f} ms",
                f"{best['b'] / best['a']:.3f}",
            ]
        )
    text = "\n".join(
        [
            "# abi3 vs version-specific build: hot-path speed",
            "",
            C.machine_md(),
            "",
            f"`bench_speed.run({args.n}, repeats=1)` in a fresh process per run, alternating "
            f"between the two builds, {args.rounds} rounds; medians over the rounds.",
            f"A = `{natives['a']}` from `{args.a}`; B = `{natives['b']}` from `{args.b}`.",
            "The pickle-normalised ratio divides each shmstore time by the pickle baseline timed "
            "in the same process first; the fastest runs are the ones other load on the machine "
            "disturbed least.",
            "",
            C.md_table(
                [
                    "shmstore operation",
                    "A (version-specific)",
                    "B (abi3)",
                    "B / A",
                    "B / A (pickle-normalised)",
                    "fastest run A / B",
                    "B / A (fastest runs)",
                ],
                rows,
            ),
            "",
            "All runs (s), in order: "
            + "; ".join(
                f"{k.upper()} {shm}: " + ", ".join(f"{m[shm]:.3f}" for m in runs[k])
                for _, shm, _ in METRICS
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
