"""Memory of 4 DataLoader-like workers that each read every record once (acceptance benchmark).

For every start method (fork, spawn, forkserver) and every way of holding the records
(plain list, pickle-per-record numpy buffer, shmstore SharedList, plus "none": the interpreter
baseline), one fresh process (the "main") builds the data and starts the workers. The list and
the buffer are Process arguments, as a DataLoader's dataset: inherited under fork, pickled to each
worker under spawn/forkserver. The SharedList is always handed over pickled (its name, < 256
bytes), so every worker attaches by name, under fork too ("shmstore-inherit", not run by
default, passes it as a Process argument instead). Then it measures from /proc/PID/smaps_rollup:

1. "idle": every worker has received the data and waits, nothing read yet;
2. "after reading": every worker has read every record once (file_name, height, and each
   annotation's bbox[0] and category_id) and waits.

Workers wait in ``Connection.recv()``; there is no sleep anywhere. Total PSS = main + workers
(the forkserver and resource-tracker processes are reported apart). USS growth of a worker =
its USS after reading - its own USS when idle.

Targets (shmstore, every start method):
  total PSS after reading <= 1.1 x (archive size + total PSS of the "none" run);
  every worker's USS growth from reading <= 2% of the archive size.

    python benchmarks/bench_memory.py [--n 200000] [--workers 4] [--methods fork,spawn,forkserver]
        [--approaches plain,pickle,shmstore] [--out benchmarks/results/memory.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import json
import os
import subprocess
import time
from typing import Any

import _common as C
from coco import iter_records, make_records

METHODS = ("fork", "spawn", "forkserver")
PSS_FACTOR = 1.1
USS_FRACTION = 0.02
RESULT_TAG = "BENCH_MEMORY_RESULT "


# ----------------------------------------------------------------------------------------------
# One configuration, in a fresh process (so that no other approach's garbage is in "main").


def _measure(pool: C.WorkerPool) -> dict[str, Any]:
    def one(pid: int) -> dict[str, int]:
        r = C.smaps_rollup(pid)
        return {"pss": r["Pss"], "uss": r["uss"], "rss": r["Rss"], "shm": r.get("Pss_Shmem", 0)}

    me = os.getpid()
    helpers = [p for p in C.descendants(me) if p not in pool.pids]
    out: dict[str, Any] = {
        "main": one(me),
        "workers": [one(p) for p in pool.pids],
        "helpers": [],
    }
    for pid in helpers:
        try:
            out["helpers"].append(one(pid))
        except OSError:  # a helper that just exited
            pass
    out["total_pss"] = out["main"]["pss"] + sum(w["pss"] for w in out["workers"])
    out["total_shm"] = out["main"]["shm"] + sum(w["shm"] for w in out["workers"])
    return out


def run_one(method: str, approach: str, n: int, workers: int, seed: int = 0) -> dict[str, Any]:
    """Build the data as ``approach``, start ``workers`` workers with ``method``, measure."""
    res: dict[str, Any] = {"method": method, "approach": approach, "n": n, "workers": workers}
    # Every main, "none" included, runs the generator once first, so that they all have the same
    # code and caches loaded and the data is the only difference.
    make_records(100, seed + 1)
    t0 = time.perf_counter()
    handle: Any = None
    if approach == "none":
        data: Any = None
    elif approach == "plain":
        data = make_records(n, seed)
    elif approach == "pickle":
        data = C.PickleBuffer.build(iter_records(n, seed))
        res["pickled_bytes"] = int(data.buf.nbytes)
        res["offsets_bytes"] = int(data.offsets.nbytes)
    elif approach in ("shmstore", "shmstore-inherit"):
        shm = C.load_shmstore()
        if shm is None:
            raise RuntimeError(f"shmstore is not importable: {C.shmstore_error()}")
        data = handle = shm.SharedList(iter_records(n, seed))
        res["archive_bytes"] = int(data.nbytes)
    else:
        raise ValueError(f"unknown approach {approach!r}")
    res["build_s"] = time.perf_counter() - t0
    try:
        res["payload_bytes"] = C.payload_size(data) if data is not None else 0
        if approach == "shmstore":
            data = C.Pickled(data)  # every worker attaches by name, under fork too
        C.settle()  # drop generation garbage: main should hold the data and nothing else
        with C.WorkerPool(method, workers, C.read_task, data) as pool:
            res["idle"] = _measure(pool)
            t1 = time.perf_counter()
            res["checksums"] = pool.broadcast(("touch", approach))
            res["read_s"] = time.perf_counter() - t1
            res["read"] = _measure(pool)
            if handle is not None:
                # Resident pages of the segment, mapped or not (PSS only sees mapped pages).
                res["shm_resident_bytes"] = os.stat(handle.path).st_blocks * 512
    finally:
        if handle is not None:
            handle.unlink()
            handle.close()
    res["wall_s"] = time.perf_counter() - t0
    return res


def run_config(method: str, approach: str, n: int, workers: int) -> dict[str, Any]:
    """``run_one`` in a fresh interpreter; returns its result."""
    cfg = json.dumps({"method": method, "approach": approach, "n": n, "workers": workers})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--run-one", cfg],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(
        f"{method}/{approach} failed (exit status {proc.returncode}); stdout:\n{proc.stdout}"
    )


def run_matrix(
    n: int, workers: int, methods: list[str], approaches: list[str]
) -> list[dict[str, Any]]:
    results = []
    for method in methods:
        for approach in ["none", *approaches]:
            print(f"  {method:<10} {approach:<8} ...", end="", flush=True, file=sys.stderr)
            r = run_config(method, approach, n, workers)
            print(
                f" total PSS {C.mib(r['idle']['total_pss'])} -> {C.mib(r['read']['total_pss'])}"
                f" MiB ({r['wall_s']:.1f} s)",
                file=sys.stderr,
            )
            results.append(r)
    return results


# ----------------------------------------------------------------------------------------------
# Report


def _worker_growth(r: dict[str, Any]) -> list[int]:
    return [a["uss"] - b["uss"] for a, b in zip(r["read"]["workers"], r["idle"]["workers"])]


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def render(
    results: list[dict[str, Any]], title: str = "Memory benchmark", compact: bool = False
) -> str:
    """The markdown report; ``compact`` keeps the main columns only (for a terminal)."""
    by = {(r["method"], r["approach"]): r for r in results}
    first = results[0]
    n, workers = first["n"], first["workers"]
    methods = list(dict.fromkeys(r["method"] for r in results))
    pick = next((r for r in results if r["approach"] == "pickle"), None)
    shm = next((r for r in results if r["approach"] == "shmstore"), None)

    out = [f"# {title}", "", C.machine_md(), ""]
    out += [
        f"{n:,} COCO-like records (benchmarks/coco.py, seed 0), {workers} workers per run, each "
        "reading every record once (file_name, height, every annotation's bbox[0] and "
        "category_id). Every row is a fresh main process; memory from /proc/PID/smaps_rollup "
        "while all workers wait in `recv()`. Total PSS = main + workers; USS growth = a worker's "
        "USS after reading - its USS before reading (same process). MiB = 2^20 bytes.",
        "",
        "## Sizes",
        "",
    ]
    size_rows = []
    if pick:
        size_rows.append(["pickled records (numpy uint8 buffer)", C.mib(pick["pickled_bytes"]), ""])
        size_rows.append(["offsets (int64)", C.mib(pick["offsets_bytes"]), ""])
    if shm:
        vs = f"{shm['archive_bytes'] / pick['pickled_bytes']:.2f}x" if pick else ""
        size_rows.append(["shmstore archive (`nbytes`)", C.mib(shm["archive_bytes"]), vs])
        if "shm_resident_bytes" in shm:
            size_rows.append(
                [
                    f"shmstore segment resident in /dev/shm ({shm['method']}, after reading)",
                    C.mib(shm["shm_resident_bytes"]),
                    "",
                ]
            )
    if size_rows:
        out += [C.md_table(["", "MiB", "vs pickled"], size_rows), ""]
    payload_rows = []
    for a in ("plain", "pickle", "shmstore"):
        r = next((x for x in results if x["approach"] == a), None)
        if r:
            payload_rows.append([C.APPROACH_TITLES[a], f"{r['payload_bytes']:,}"])
    if payload_rows:
        out += [
            "What each worker receives under spawn/forkserver (pickle of the data, bytes):",
            "",
            C.md_table(["approach", "bytes"], payload_rows),
            "",
        ]

    out += ["## Memory", ""]
    headers = [
        "start method",
        "approach",
        "total PSS idle",
        "total PSS after reading",
        "main PSS",
        "worker PSS (mean)",
        "worker USS idle (mean)",
        "worker USS after reading (mean)",
        "worker USS growth (max)",
        "shmem PSS (total)",
        "helper procs PSS (not in total)",
    ]
    keep = [0, 1, 2, 3, 7, 8] if compact else list(range(len(headers)))
    rows = []
    for method in methods:
        for approach in C.APPROACH_TITLES:
            r = by.get((method, approach))
            if r is None:
                continue
            row = [
                method,
                C.APPROACH_TITLES[approach],
                C.mib(r["idle"]["total_pss"]),
                C.mib(r["read"]["total_pss"]),
                C.mib(r["read"]["main"]["pss"]),
                C.mib(_mean([w["pss"] for w in r["read"]["workers"]])),
                C.mib(_mean([w["uss"] for w in r["idle"]["workers"]])),
                C.mib(_mean([w["uss"] for w in r["read"]["workers"]])),
                C.mib(max(_worker_growth(r))),
                C.mib(r["read"]["total_shm"]),
                C.mib(sum(h["pss"] for h in r["read"]["helpers"])),
            ]
            rows.append([row[i] for i in keep])
    out += ["All figures in MiB.", "", C.md_table([headers[i] for i in keep], rows, left=2), ""]
    if not compact:
        out += [
            "shmem PSS: the part of total PSS in shared memory (/dev/shm) mappings. Helper procs: "
            "the forkserver and multiprocessing's resource tracker.",
            "",
        ]

    out += ["## Targets (shmstore)", ""]
    if shm is None:
        out += [f"shmstore not measured: {C.shmstore_error() or 'not requested'}", ""]
    else:
        vrows = []
        for method in methods:
            r, base = by.get((method, "shmstore")), by.get((method, "none"))
            if r is None or base is None:
                continue
            archive = r["archive_bytes"]
            bound = archive + base["read"]["total_pss"]
            total = r["read"]["total_pss"]
            growth = max(_worker_growth(r))
            vrows.append(
                [
                    method,
                    C.mib(total),
                    f"{C.mib(archive)} + {C.mib(base['read']['total_pss'])}",
                    f"{total / bound:.3f}",
                    C.verdict(total <= PSS_FACTOR * bound),
                    C.mib(growth),
                    C.mib(USS_FRACTION * archive),
                    f"{100 * growth / archive:.2f}%",
                    C.verdict(growth <= USS_FRACTION * archive),
                ]
            )
        out += [
            C.md_table(
                [
                    "start method",
                    "total PSS (MiB)",
                    "archive + baseline (MiB)",
                    f"ratio (<= {PSS_FACTOR})",
                    "PSS",
                    "max worker USS growth (MiB)",
                    f"{USS_FRACTION:.0%} of archive (MiB)",
                    "growth / archive",
                    "USS",
                ],
                vrows,
            ),
            "",
            'Baseline: total PSS (main + workers) of the "no data" run of the same start method: '
            "the same interpreters, modules and workers, holding nothing. It moves by a few MiB "
            "between runs: file-backed pages (libpython, numpy, the extension) are shared with "
            "every process mapping them, unrelated ones included, so other activity on the "
            "machine changes their PSS share.",
            "",
        ]

    # Every worker of every approach must have read the same records.
    sums = {
        (r["method"], r["approach"]): set(r["checksums"])
        for r in results
        if r["approach"] != "none"
    }
    distinct = set().union(*sums.values()) if sums else set()
    if len(distinct) > 1:
        out += [f"**WARNING: workers read different data: {sums}**", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=200_000, help="records (default 200000)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated start methods")
    ap.add_argument(
        "--approaches",
        default=None,
        help="comma-separated: plain,pickle,shmstore (default), and shmstore-inherit",
    )
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "memory.md", help="markdown out")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.run_one:
        cfg = json.loads(args.run_one)
        print(RESULT_TAG + json.dumps(run_one(**cfg)), flush=True)
        return 0

    methods = [m for m in args.methods.split(",") if m]
    if args.approaches is None:
        approaches = list(C.APPROACHES)
        if C.load_shmstore() is None:
            print(f"WARNING: skipping shmstore: {C.shmstore_error()}", file=sys.stderr)
            approaches.remove("shmstore")
    else:
        approaches = [a for a in args.approaches.split(",") if a and a != "none"]
    unknown = set(methods) - set(METHODS) | set(approaches) - set(C.APPROACH_TITLES)
    if unknown:
        ap.error(f"unknown method/approach: {sorted(unknown)}")

    t0 = time.perf_counter()
    print(f"bench_memory: n={args.n} workers={args.workers}", file=sys.stderr)
    results = run_matrix(args.n, args.workers, methods, approaches)
    text = render(results) + f"\nRun time: {time.perf_counter() - t0:.0f} s.\n"
    print(text)
    C.write_result(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
