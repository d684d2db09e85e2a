"""The same COCO-like records under rkyv (archive formats 1-3) and under format 4.

Sizes only, no timings: they are the same on every machine and every run, whatever the load.
The records (coco.py, seed 0) are made once here and written as JSON lines (exact for them:
ints, floats with repr round trip, strs, lists, dicts); the Rust side
(benchmarks/rkyv_compare, rkyv 0.8.18 with the features formats 1-3 used) encodes each with
the value model of formats 1-3 and prints its sizes; this side builds a ``SharedList`` (format
4) and pickles each record (protocol 5) for the reference. docs/architecture.md ("Why our own
archive format, not rkyv") quotes the result.

Run: ``make bench-rkyv``, or (it builds the Rust side with cargo first)

    .venv/bin/python benchmarks/bench_rkyv.py [--n 200000] [--out benchmarks/results/rkyv.md]
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common as C
import coco
import shmstore

RUST_DIR = C.BENCH_DIR / "rkyv_compare"
TARGET_DIR = C.BENCH_DIR.parent / "target" / "rkyv_compare"
BINARY = TARGET_DIR / "release" / "rkyv_compare"


def build_rust_side() -> None:
    """``cargo build --release`` of benchmarks/rkyv_compare (a no-op when up to date)."""
    cmd = ["cargo", "build", "--release", "-q", "--locked"]
    cmd += ["--manifest-path", str(RUST_DIR / "Cargo.toml"), "--target-dir", str(TARGET_DIR)]
    C.log("rkyv: " + " ".join(cmd))
    subprocess.run(cmd, check=True, timeout=1800)


def rkyv_sizes(records: list[Any]) -> dict[str, int]:
    """What the Rust side prints for ``records`` (written to it as JSON lines)."""
    with tempfile.TemporaryFile("w+b") as f:
        for r in records:
            line = json.dumps(r, separators=(",", ":"), allow_nan=False)
            f.write(line.encode() + b"\n")
        f.seek(0)
        out = subprocess.run([str(BINARY)], stdin=f, capture_output=True, check=True, timeout=600)
    sizes: dict[str, int] = json.loads(out.stdout)
    if sizes["records"] != len(records):
        sys.exit(f"the Rust side read {sizes['records']} records, not {len(records)}")
    return sizes


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=C.BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000, help="COCO-like records (default 200000)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = ap.parse_args()

    build_rust_side()
    records = coco.make_records(args.n)
    # JSON must give the Rust side exactly these records.
    for i in range(0, len(records), max(1, len(records) // 100)):
        if json.loads(json.dumps(records[i])) != records[i]:
            sys.exit(f"record {i} does not survive a JSON round trip")
    n = len(records)
    n_ann = sum(len(r["annotations"]) for r in records)
    rk = rkyv_sizes(records)
    pickled = sum(len(pickle.dumps(r, protocol=5)) for r in records)
    lst = shmstore.SharedList(records)
    try:
        f4 = lst.nbytes
    finally:
        lst.unlink()
        lst.close()
    rkyv_total = rk["rkyv_record_bytes"] + rk["key_table_bytes"]

    def row(what: str, nbytes: int) -> str:
        return f"| {what} | {nbytes:,} | {nbytes / n:,.0f} | {nbytes / pickled:.2f}x |"

    lines = [
        f"{n:,} COCO-like records ({n_ann:,} annotations; benchmarks/coco.py, seed 0). "
        "Sizes, not timings: the same on every run.",
        "",
        "| encoding | bytes | per record | vs pickle |",
        "|---|---:|---:|---:|",
        row("pickle, one `pickle.dumps(record, 5)` per record (the reference)", pickled),
        row(
            "rkyv 0.8 `Value` (formats 1-3): the records' rkyv bytes + the key table, "
            "no header, offsets or checksums",
            rkyv_total,
        ),
        row("format 4: `SharedList(records).nbytes` (the whole archive)", f4),
        row("JSON lines (compact), for scale", rk["json_bytes"] + n),
        "",
        f"An archived rkyv `Value` is {rk['archived_value_size']} bytes "
        "(a tag and 8 bytes) for every int, float, bool and None.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        header = (
            "# Record sizes: rkyv (formats 1-3) vs format 4\n\n"
            "`make bench-rkyv` (benchmarks/bench_rkyv.py with benchmarks/rkyv_compare), "
            f"shmstore {shmstore.__version__} at commit {_commit()}, archive format 4.\n\n"
        )
        args.out.write_text(header + text + "\n")


if __name__ == "__main__":
    main()
