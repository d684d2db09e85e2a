"""Segments made and let go of in a loop: what a process that puts and closes stores
pays per call, supervisor round trips included.

    python benchmarks/bench_segment_churn.py [--rounds 5] [--ops 100] [--out FILE]

Per call, the median of `--rounds` rounds of `--ops` calls (a quarter as many for the MiB
arrays): `put` of 16 bytes with
`arena=False` (a segment of its own) then `close`; a `SharedList` of 100 small records then
`close`; `put` of a 2 MiB and of an 8 MiB array with `arena=False` then `close`, and the
same by default (a chunk of the process's arena, whose pages the next object writes again:
docs/arena.md, "The threshold"). Each segment's `close` sends the supervisor a `DROP` (from
a background thread) and each new segment a `NEW` (a round trip), so the figures include
how soon the supervisor answers the next request after a `DROP` (docs/lifecycle.md).
Changes nothing on the machine; uses the user's supervisor unless
`SHMSTORE_SUPERVISOR_NAME` names another.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import shmstore
from _common import machine_md, md_table, per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    records = [{"a": i, "b": [1, 2, 3]} for i in range(100)]
    small = np.zeros(2)
    large_ops = max(10, args.ops // 4)
    # name -> (the call, calls per round)
    steps: dict[str, tuple[Callable[[], Any], int]] = {
        "put(16 B, arena=False) + close": (
            lambda: shmstore.put(small, arena=False).close(),
            args.ops,
        ),
        "SharedList(100 records) + close": (
            lambda: shmstore.SharedList(records).close(),
            args.ops,
        ),
    }
    for mib in (2, 8):
        big = np.zeros(mib << 20, dtype=np.uint8)
        steps[f"put({mib} MiB array, arena=False) + close"] = (
            lambda big=big: shmstore.put(big, arena=False).close(),
            large_ops,
        )
        steps[f"put({mib} MiB array) + close (arena)"] = (
            lambda big=big: shmstore.put(big).close(),
            large_ops,
        )
    rows = [
        [name, f"{per_call(step, ops, args.rounds) * 1e6:.0f} µs"]
        for name, (step, ops) in steps.items()
    ]
    head = (
        f"Per call, median of {args.rounds} rounds of {args.ops} (of the MiB arrays a "
        f"quarter as many, at least 10). CPython "
        f"{sys.version.split()[0]}; {os.cpu_count()} cores; load before "
        f"{os.getloadavg()[0]:.2f}.\n\n"
    )
    text = head + md_table(["call", "time"], rows)
    print(text)
    if args.out:
        args.out.write_text(
            "# Segments made and let go of in a loop\n\n" + machine_md() + "\n\n" + text + "\n"
        )


if __name__ == "__main__":
    main()
