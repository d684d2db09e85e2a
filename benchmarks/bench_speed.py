"""Read and build speed: shmstore SharedList vs pickle-per-record (acceptance benchmark).

Single process, the same COCO-like records for both, medians of ``--repeats`` runs (GC off during
each timed call, as timeit does); the approaches alternate within every repeat, so that both see
the same machine state, and every ratio comes from this one run.

- field-touch loop over all records (file_name, height, each annotation's bbox[0] and
  category_id): ``pickle.loads`` of the record's slice then touch, vs ``lst[i]`` (a view) then
  touch. Target: shmstore >= 2x faster. (A plain in-memory list is shown for reference.)
- full materialisation: ``lst[i].to_python()`` vs ``pickle.loads`` per record. Target <= 1.0x.
- build: ``SharedList(records)`` vs ``pickle.dumps`` per record + concatenation into one buffer
  (+ the offsets array). Target <= 1.5x.
- archive size vs pickled size.

    python benchmarks/bench_speed.py [--n 200000] [--repeats 5] [--out benchmarks/results/speed.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import time
from typing import Any, Callable

import _common as C
from coco import make_records

TOUCH_SPEEDUP = 2.0
TO_PYTHON_RATIO = 1.0
BUILD_RATIO = 1.5


def _close(lst: Any) -> None:
    lst.unlink()
    lst.close()


def run(n: int, repeats: int) -> dict[str, Any]:
    shm = C.load_shmstore()
    t0 = time.perf_counter()
    records = make_records(n)
    print(
        f"bench_speed: {n} records generated in {time.perf_counter() - t0:.1f} s", file=sys.stderr
    )

    times: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        dt, result = C.time_call(fn)
        times.setdefault(key, []).append(dt)
        return result

    pb: Any = None
    lst: Any = None
    sums: dict[str, float] = {}
    try:
        for rep in range(repeats):
            # build (keep the last ones for reading)
            pb = None
            pb = timed("build_pickle", lambda: C.PickleBuffer.build(records))
            if shm is not None:
                if lst is not None:
                    _close(lst)
                    lst = None
                lst = timed("build_shmstore", lambda: shm.SharedList(records))
            # field-touch
            sums["plain"] = timed("touch_plain", lambda: C.touch_sequence(records))
            sums["pickle"] = timed("touch_pickle", lambda p=pb: C.touch_pickle(p))
            if lst is not None:
                sums["shmstore"] = timed("touch_shmstore", lambda s=lst: C.touch_sequence(s))
            # full materialisation
            timed("to_python_pickle", lambda p=pb: C.materialize_pickle(p))
            if lst is not None:
                timed("to_python_shmstore", lambda s=lst: C.materialize_shmstore(s))
            print(
                f"  repeat {rep + 1}/{repeats}: "
                + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
                file=sys.stderr,
            )
        res: dict[str, Any] = {
            "n": n,
            "repeats": repeats,
            "annotations": sum(len(r["annotations"]) for r in records),
            "median": {k: C.median(v) for k, v in times.items()},
            "times": times,
            "pickled_bytes": int(pb.buf.nbytes),
            "offsets_bytes": int(pb.offsets.nbytes),
            "checksums": sums,
        }
        if lst is not None:
            res["archive_bytes"] = int(lst.nbytes)
            step = max(1, n // 2000)
            res["sample_equal"] = all(
                lst[i].to_python() == records[i] for i in range(0, n, step)
            ) and (lst[-1].to_python() == records[-1])
    finally:
        if lst is not None:
            _close(lst)
    return res


def _fmt(seconds: float | None, n: int) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:,.0f} ms ({seconds / n * 1e6:.2f} µs/rec)"


def render(res: dict[str, Any]) -> str:
    n, med = res["n"], res["median"]
    have_shm = "archive_bytes" in res
    out = ["# Speed benchmark", "", C.machine_md(), ""]
    out += [
        f"{n:,} COCO-like records ({res['annotations']:,} annotations; benchmarks/coco.py, "
        f"seed 0), one process. Median of {res['repeats']} repeats; approaches alternate "
        "within each repeat; GC off during each timed call.",
        "",
    ]
    best = {k: min(v) for k, v in res["times"].items()}
    # (row name, plain-list key, pickle key, shmstore key, "faster" | "time", target)
    specs = [
        (
            "build: `SharedList(records)` vs `pickle.dumps` per record + concatenation",
            None,
            "build_pickle",
            "build_shmstore",
            "time",
            BUILD_RATIO,
        ),
        (
            "field-touch loop: `lst[i]` view vs `pickle.loads` of the slice",
            "touch_plain",
            "touch_pickle",
            "touch_shmstore",
            "faster",
            TOUCH_SPEEDUP,
        ),
        (
            "full materialisation: `lst[i].to_python()` vs `pickle.loads` per record",
            None,
            "to_python_pickle",
            "to_python_shmstore",
            "time",
            TO_PYTHON_RATIO,
        ),
    ]
    rows = []
    for name, plain, pk, sh, kind, target in specs:
        ratio = ratio_best = ""
        ok = "n/a"
        label = "faster" if kind == "faster" else "the time"
        if have_shm:
            if kind == "faster":  # how many times faster shmstore is
                r, rb = med[pk] / med[sh], best[pk] / best[sh]
                ok = C.verdict(r >= target)
            else:  # shmstore's time as a multiple of pickle's
                r, rb = med[sh] / med[pk], best[sh] / best[pk]
                ok = C.verdict(r <= target)
            ratio, ratio_best = f"{r:.2f}x {label}", f"{rb:.2f}x {label}"
        rows.append(
            [
                name,
                _fmt(med[plain], n) if plain else "",
                _fmt(med[pk], n),
                _fmt(med.get(sh), n),
                ratio or "n/a",
                f"{'>=' if kind == 'faster' else '<='} {target}x {label}",
                ok,
                ratio_best or "n/a",
            ]
        )
    out += [
        C.md_table(
            [
                "measurement (medians)",
                "plain list (reference)",
                "pickle-per-record",
                "shmstore",
                "shmstore vs pickle",
                "target",
                "verdict",
                "same, best runs",
            ],
            rows,
        ),
        "",
        "The verdict uses the medians; the last column compares the fastest runs, which other "
        "load on the machine disturbs less (see the load average above).",
        "",
        "## Sizes",
        "",
    ]
    size_rows = [
        ["pickled records (sum of `pickle.dumps(record, -1)`)", C.mib(res["pickled_bytes"]), ""],
        ["pickle buffer + int64 offsets", C.mib(res["pickled_bytes"] + res["offsets_bytes"]), ""],
    ]
    if have_shm:
        size_rows.append(
            [
                "shmstore archive (`nbytes`)",
                C.mib(res["archive_bytes"]),
                f"{res['archive_bytes'] / res['pickled_bytes']:.2f}x pickled",
            ]
        )
    out += [C.md_table(["", "MiB", "vs pickled"], size_rows), ""]
    if not have_shm:
        out += [f"shmstore not measured: {C.shmstore_error()}", ""]
    else:
        sums = res["checksums"]
        if len(set(sums.values())) != 1:
            out += [f"**WARNING: the touch loops disagree: {sums}**", ""]
        if not res["sample_equal"]:
            out += ["**WARNING: `lst[i].to_python() != records[i]` for some sampled i**", ""]
    out += [
        "All timings (s): "
        + "; ".join(f"{k}: {', '.join(f'{t:.3f}' for t in v)}" for k, v in res["times"].items()),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=200_000, help="records (default 200000)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats, median taken (default 5)")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "speed.md", help="markdown out")
    args = ap.parse_args(argv)
    if C.load_shmstore() is None:
        print(f"WARNING: skipping shmstore: {C.shmstore_error()}", file=sys.stderr)
    text = render(run(args.n, args.repeats))
    print(text)
    C.write_result(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
