"""Where the field-touch loop's time goes: the loop of `bench_format.py` built up one step
at a time, over plain objects and over a `SharedList`, each step timed alone.

    python benchmarks/touch_steps.py [--n 50000] [--repeat 7]

Prints the machine (CPU, load), then per step the median time of the loop up to that step
for both, timed in alternation (`_common.paired_samples`), and their paired ratio: the step
whose time grows most between two rows is where the two differ (one process, the machine as
it is).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C
import coco
import shmstore
from _common import touch_sequence

# Each step is the loop up to that point written out in full (no branch inside a timed loop),
# so the functions repeat one another's lines on purpose; the last step is the loop of
# bench_format.py itself.


def records_only(lst: Any) -> None:
    for i in range(len(lst)):
        lst[i]


def record_fields(lst: Any) -> float:
    acc = 0.0
    for i in range(len(lst)):
        rec = lst[i]
        acc += len(rec["file_name"]) + rec["height"]
    return acc


def annotations_iterated(lst: Any) -> float:
    acc = 0.0
    for i in range(len(lst)):
        rec = lst[i]
        acc += len(rec["file_name"]) + rec["height"]
        for _ in rec["annotations"]:
            pass
    return acc


def annotation_scalar(lst: Any) -> float:
    acc = 0.0
    for i in range(len(lst)):
        rec = lst[i]
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["category_id"]
    return acc


STEPS: list[tuple[str, Callable[[Any], Any]]] = [
    ("lst[i]", records_only),
    ('+ len(rec["file_name"]) + rec["height"]', record_fields),
    ('+ for a in rec["annotations"]: pass', annotations_iterated),
    ('+ a["category_id"]', annotation_scalar),
    ('+ a["bbox"][0] (the whole touch loop)', touch_sequence),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    plain = coco.make_records(a.n)
    shared = shmstore.SharedList(plain)
    print(C.machine_md())
    print(
        f"\n{a.n} records; per step, medians of {a.repeat} rounds, plain and shmstore alternating"
    )
    print("\n| loop body, per record | plain | shmstore | ratio |\n|---|---:|---:|---:|")
    for name, f in STEPS:
        fns = {"plain": partial(f, plain), "shmstore": partial(f, shared)}
        times, _ = C.paired_samples(fns, a.repeat, gc_collect=False)
        p, s = (C.median(times[k]) * 1e3 for k in fns)
        ratio = C.paired_ratio(times, "shmstore", "plain")
        print(f"| `{name}` | {p:.1f} ms | {s:.1f} ms | {ratio:.2f}x |")
    shared.close()


if __name__ == "__main__":
    main()
