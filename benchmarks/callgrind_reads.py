"""Instructions per read, machine-independent: run under callgrind twice with different loop
counts and divide the difference (interpreter start, imports and the store's build cancel).

    python benchmarks/callgrind_reads.py [--n-small 20000 --n-large 120000] [--what lst_i view ...]

Prints, for each read, instructions per call (`lst[k]`, `ann["bbox"]` (a view), `ann["iscrowd"]`
(a scalar), `rec["height"]` (a record's field), `list_field`: `rec["annotations"]` (a view of a
list of dicts), `lst.get_many(64)` per record, `next_view`: one
step of `for a in rec["annotations"]` (a dict view made by the iterator), `elem`: `bbox[0]` (a
float read from a list view)), and the empty loop for reference (subtract it). Needs valgrind.
Used to compare interpreters and builds (benchmarks/results/matrix.md and the files it names).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

BODY = r"""
import sys
sys.path.insert(0, {bench!r})
import shmstore, coco
n = {n}
what = {what!r}
lst = shmstore.SharedList(coco.make_records(200))
k = 7
ann = lst[k]["annotations"][0]
rec = lst[k]
idx = list(range(64))
import gc
gc.collect()
gc.disable()  # a collection in one of the two runs and not the other would not cancel out
if what == "empty":
    for _ in range(n):
        pass
elif what == "lst_i":
    for _ in range(n):
        lst[k]
elif what == "view":
    for _ in range(n):
        ann["bbox"]
elif what == "scalar":
    for _ in range(n):
        ann["iscrowd"]
elif what == "field":
    for _ in range(n):
        rec["height"]
elif what == "list_field":
    for _ in range(n):
        rec["annotations"]
elif what == "get_many":
    for _ in range(n // 64):
        lst.get_many(idx)
elif what == "next_view":
    anns = rec["annotations"]
    for _ in range(n // len(anns)):
        for a in anns:
            pass
elif what == "elem":
    bbox = ann["bbox"]
    for _ in range(n):
        bbox[0]
"""


def instructions(python: str, what: str, n: int) -> int:
    bench = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "s.py")
        with open(script, "w") as f:
            f.write(BODY.format(bench=bench, n=n, what=what))
        out = os.path.join(d, "cg.out")
        # A fixed hash seed: the loop's global names are looked up in dicts whose probe
        # sequences otherwise change from run to run (tens of instructions per call); one
        # BLAS thread: idle BLAS threads spin, and valgrind runs them in turn with the loop;
        # no supervisor: whether the build finds one running or starts one differs between
        # the two runs and would not cancel out.
        env = dict(
            os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", SHMSTORE_SUPERVISOR="0"
        )
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, script],
            check=True,
            capture_output=True,
            env=env,
        )
        with open(out) as f:
            for line in f:
                m = re.match(r"(?:summary|totals):\s+(\d+)", line)
                if m:
                    return int(m.group(1))
    raise RuntimeError("no totals in callgrind output")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--n-small", type=int, default=20_000)
    ap.add_argument("--n-large", type=int, default=120_000)
    ap.add_argument(
        "--what",
        nargs="*",
        default=[
            "empty",
            "lst_i",
            "view",
            "scalar",
            "field",
            "list_field",
            "get_many",
            "next_view",
            "elem",
        ],
    )
    a = ap.parse_args()
    print(f"# {a.python}")
    for what in a.what:
        lo = instructions(a.python, what, a.n_small)
        hi = instructions(a.python, what, a.n_large)
        print(f"{what:10s} {(hi - lo) / (a.n_large - a.n_small):8.1f} instructions per call")


if __name__ == "__main__":
    main()
