"""What checking a store costs: open (header + metadata checksum) and full verification
(every block checksum, every record walked as a tree, array data checksums), per GiB, for
record-heavy and array-heavy stores.

Run: .venv/bin/python benchmarks/bench_validation.py  ->  benchmarks/results/validation.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shmstore
from _common import machine_md
from coco import make_records

GIB = 1 << 30


def measure(store, repeats: int) -> dict[str, float]:
    try:
        cls = type(store)
        opens, verifies = [], []
        for _ in range(repeats):
            # A fresh file mapping each time: open() is what every new process pays.
            path = Path("/dev/shm") / f"{store.name}.validation-copy"
            store.save(path)
            try:
                t = time.perf_counter()
                h = cls.open(path)
                opens.append(time.perf_counter() - t)
                t = time.perf_counter()
                h.verify()
                verifies.append(time.perf_counter() - t)
                h.close()
                del h
            finally:
                path.unlink()
        return {
            "nbytes": store.nbytes,
            "open_s": statistics.median(opens),
            "verify_s": statistics.median(verifies),
        }
    finally:
        store.unlink()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--array-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "validation.md"))
    args = ap.parse_args()

    rows = []
    lst = shmstore.SharedList(make_records(args.records))
    rows.append(("SharedList of COCO-like records", args.records, measure(lst, args.repeats)))
    ref = shmstore.put(np.ones(int(args.array_gib * GIB), dtype=np.uint8))
    rows.append(("put(uint8 array)", 1, measure(ref, args.repeats)))

    lines = [
        "# Validation cost",
        "",
        machine_md(),
        "",
        "Median of "
        f"{args.repeats} runs. `open` = what attaching costs (header + metadata checksum);"
        " `verify` = checking every record (block checksums + tree walk) and array data,"
        " which readers"
        " otherwise pay lazily, once per record actually read.",
        "",
        "| store | records | size | open | open per GiB | verify | verify per GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, count, r in rows:
        gib = r["nbytes"] / GIB
        lines.append(
            f"| {label} | {count:,} | {r['nbytes'] / 2**20:,.0f} MiB | {r['open_s'] * 1e3:.1f} ms"
            f" | {r['open_s'] / gib * 1e3:.1f} ms | {r['verify_s'] * 1e3:.0f} ms"
            f" | {r['verify_s'] / gib:.2f} s |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
