"""The first pass over records of other shapes than COCO's: what the check on first access
costs a fresh process that reads every record once, against its second pass.

    python benchmarks/first_pass_shapes.py [--n 100000] [--rounds 5] [--out FILE.md]

Two kinds of records: `benchmarks/irregular.py`'s (61 key sets, mixed value types, an
optional list of tags, a `geo` dict) and *nested*: `{"id", "name", "tags": [str, ...],
"meta": {"w", "h", "src"}, "score"}`, a dict and a list of strs inside each record. Per
round a fresh store is saved to a file and a fresh process opens it and iterates every
record's keys twice (first pass: pages mapped and blocks checked on first access; warm:
neither); its CPU time per pass. The ratio first / warm is per round, the median over the
rounds. Changes nothing on the machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import irregular
import shmstore
from _common import machine_md, md_table

CHILD = r"""
import sys, time, shmstore
lst = shmstore.SharedList.open(sys.argv[1])
def touch(lst):
    t = 0
    for i in range(len(lst)):
        for k in lst[i]:
            t += 1
    return t
t0 = time.process_time(); touch(lst); t1 = time.process_time(); touch(lst)
t2 = time.process_time()
print(t1 - t0, t2 - t1)
"""


def nested(n: int) -> list[dict[str, Any]]:
    rnd = random.Random(0)
    return [
        {
            "id": i,
            "name": f"item-{i}",
            "tags": [rnd.choice("abcdef") * 3 for _ in range(rnd.randrange(1, 5))],
            "meta": {"w": 640, "h": 480, "src": f"cam{i % 7}"},
            "score": rnd.random(),
        }
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, recs in (("irregular", irregular.make_records(a.n)), ("nested", nested(a.n))):
            ratios, firsts, warms = [], [], []
            for r in range(a.rounds):
                path = os.path.join(d, f"{name}-{r}.shm")
                shmstore.SharedList(recs).save(path)
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True
                ).stdout.split()
                first, warm = float(out[0]), float(out[1])
                firsts.append(first)
                warms.append(warm)
                ratios.append(first / warm)
                os.unlink(path)
            rows.append(
                (
                    name,
                    f"{statistics.median(firsts) * 1e3:.1f}",
                    f"{statistics.median(warms) * 1e3:.1f}",
                    f"{statistics.median(ratios):.2f}x",
                    ", ".join(f"{x:.2f}" for x in ratios),
                )
            )
    headers = ("records", "first pass (ms)", "warm pass (ms)", "first / warm", "each round")
    report = (
        f"# First pass, records with inner dicts and lists\n\n{machine_md()}\n\n"
        f"{a.n:,} records per store, {a.rounds} rounds, medians (CPU time of the reading "
        f"process).\n\n{md_table(headers, rows)}\n"
    )
    print(report)
    if a.out is not None:
        a.out.write_text(report)


if __name__ == "__main__":
    main()
