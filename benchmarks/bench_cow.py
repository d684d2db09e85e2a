"""Copy-on-read gate: what forked workers un-share of the parent's memory, and which objects.

COCO-like records (benchmarks/coco.py) read in ``--workers`` forked workers, measured with
``shmstore.cow.measure`` (pagemap, against a no-op control worker), each variant in a fresh
child process so that the heaps don't mix:

- plain list; plain list after ``gc.freeze()``; ``shmstore.SharedList``; no data at all;
- each read only (refcounts) and read + one full collection (``collect=True``);
- sensitivity: a plain list where the workers read only 1 % of the records.

Checks the targets: the plain list fails the 1 MiB gate with >= 90 % of the un-shared bytes
on the records' types (dict, list, float, int, str); shmstore within 1 MiB of the control;
1 % read is detected; the measurement itself (probe + control) <= 1 s per worker.

    python benchmarks/bench_cow.py                  # 200k records, writes results/cow.md
    python benchmarks/bench_cow.py --records 20000 --no-write
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import time
from typing import Any

import _common as C
import coco

DATA_TYPES = ("dict", "list", "float", "int", "str")


def _read(lst: Any, step: int) -> None:
    for i in range(0, len(lst), step):
        r = lst[i]
        r["file_name"]
        for a in r["annotations"]:
            a["bbox"][0]
            a["area"]
            a["id"]


def _variant(conn: Any, kind: str, n: int, workers: int, collect: bool, step: int) -> None:
    import shmstore
    from shmstore import cow

    records: Any = coco.make_records(n) if kind != "none" else []
    shared = None
    if kind == "shmstore":
        shared = shmstore.SharedList(records)
        records = shared
    gc.collect()
    if kind == "freeze":
        gc.freeze()
    t0 = time.perf_counter()
    report = cow.measure(
        (lambda: _read(records, step)) if kind != "none" else None,
        workers=workers,
        collect=collect,
        max="1 MiB",
        attribute=False,
    )
    seconds = time.perf_counter() - t0
    attr_s = 0.0
    data_share = None
    text = str(report)
    if kind in ("plain", "freeze") and not report.ok:
        t1 = time.perf_counter()
        report = cow.measure(
            lambda: _read(records, step), workers=workers, collect=collect, max="1 MiB"
        )
        attr_s = time.perf_counter() - t1 - seconds
        text = str(report)
        a = report.attribution
        if a is not None and a.page_bytes:
            data_share = sum(r.nbytes for r in a.rows if r.type in DATA_TYPES) / a.page_bytes
    conn.send(
        {
            "worst": max(w.unshared for w in report.workers),
            "control": report.control.unshared,
            "excess": report.excess,
            "ok": report.ok,
            "seconds": seconds,
            "attr_s": attr_s,
            "data_share": data_share,
            "report": text,
        }
    )
    if shared is not None:
        shared.unlink()


def run(kind: str, n: int, workers: int, collect: bool, step: int = 1) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_variant, args=(w, kind, n, workers, collect, step))
    p.start()
    w.close()
    res: dict[str, Any] = r.recv()
    p.join()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    n, nw = args.records, args.workers
    rows, results = [], {}
    for collect in (False, True):
        for kind in ("plain", "freeze", "shmstore", "none"):
            res = run(kind, n, nw, collect)
            results[(kind, collect)] = res
            C.log(f"{kind} collect={collect}: worst {C.mib(res['worst'])} MiB")
            rows.append(
                [
                    kind,
                    "yes" if collect else "no",
                    C.mib(res["worst"]),
                    C.mib(res["control"]),
                    C.mib(res["excess"]),
                    "pass" if res["ok"] else "FAIL",
                    f"{res['seconds'] / (nw + 1):.2f}",
                    "" if res["data_share"] is None else f"{100 * res['data_share']:.1f} %",
                ]
            )
    sens = run("plain", n, nw, False, step=100)
    rows.append(
        [
            "plain, 1 % of records read",
            "no",
            C.mib(sens["worst"]),
            C.mib(sens["control"]),
            C.mib(sens["excess"]),
            "pass" if sens["ok"] else "FAIL",
            f"{sens['seconds'] / (nw + 1):.2f}",
            "",
        ]
    )
    plain, shm = results[("plain", False)], results[("shmstore", False)]
    checks = [
        ("plain list fails the 1 MiB gate", not plain["ok"]),
        (
            ">= 90 % of its un-shared bytes on the records' types",
            (plain["data_share"] or 0) >= 0.9,
        ),
        ("shmstore within 1 MiB of the control", abs(shm["excess"]) <= 1 << 20),
        ("1 % of the records read is detected", not sens["ok"]),
        (
            "measurement <= 1 s per worker (plain, read only)",
            plain["seconds"] / (nw + 1) <= 1.0,
        ),
    ]
    text = "\n\n".join(
        [
            "# Copy-on-read gate (`shmstore.cow`)",
            f"{n:,} COCO-like records, {nw} forked workers + 1 no-op control, each variant "
            "in a fresh process. MiB of the parent's pages a worker made its own "
            "(pagemap). Command: `python benchmarks/bench_cow.py "
            f"--records {n} --workers {nw}`.",
            C.machine_md(),
            C.md_table(
                [
                    "data",
                    "collect",
                    "worst worker MiB",
                    "control MiB",
                    "beyond control MiB",
                    "1 MiB gate",
                    "s per worker",
                    "on records' types",
                ],
                rows,
                left=2,
            ),
            "## Targets\n\n" + "\n".join(f"- {C.verdict(ok)}: {what}" for what, ok in checks),
            f"Attribution (only when the gate fails) took {plain['attr_s']:.1f} s.",
            "## The report of the plain list\n\n```\n" + plain["report"] + "\n```",
        ]
    )
    if args.no_write:
        print(text)
    else:
        C.write_result(C.RESULTS_DIR / "cow.md", text + "\n")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
