"""Every target of the compact archive format, side by side in one run -> results/format.md.

One command, public API only (``SharedList``, ``SharedDict``, views, ``to_python()``, and
``lst.get_many(indices)`` where the installed shmstore has it). Every comparison is made of
alternating paired samples taken in this run (the order of the approaches is reversed every other
round, so that a change of the machine's load hits all alike); the verdict uses the median of the
per-round ratios. GC off during each timed call, as timeit does.

Sections (``--sections``, all by default):

- ``coco``: 200k COCO-like records (coco.py). Sizes (archive vs pickle-per-record + offsets,
  msgpack-per-record + offsets, Arrow IPC uncompressed), build, field-touch loop in order (warm)
  and in random order, ``to_python()`` vs ``pickle.loads``, the cost of one view and of
  ``lst[i]`` in nanoseconds.
- ``first``: first pass vs warm pass, each in a fresh (spawned) process attached to a fresh store.
- ``irregular``: 200k irregular records (irregular.py): size, field access, ``to_python()``,
  build, vs pickle.
- ``docstore``: SharedDict document store vs py-lmdb at 1, 2, 4, 8 processes
  (bench_docstore.py's corpus, workers and measurement).

The memory targets are bench_memory.py's (results/memory.md), run separately.

    python benchmarks/bench_format.py                 # defaults: the targets' settings (~10 min)
    python benchmarks/bench_format.py --quick         # small sizes, ~1 min, a smoke test
    python benchmarks/bench_format.py --sections coco,irregular --n 100000
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import os

# Before numpy is imported (here and in spawned workers): idle OpenBLAS threads spin on a core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import gc
import random
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import _common as C
import coco
import irregular

SECTIONS = ("coco", "first", "irregular", "docstore")
MICRO_KEY = 7  # the record whose view / lst[i] costs are timed (any record; always the same)
BATCH = 64  # get_many batch size (a DataLoader batch)
# In-process timings count this process's CPU time (user + system, all threads): on a shared
# machine other processes take turns on the cores, which wall time would count.
CLOCK = time.process_time


@dataclass
class Target:
    section: str
    what: str
    measured: str  # the figure, e.g. "0.55x" or "12 ns"
    goal: str  # e.g. "<= 0.6x"
    ok: bool | None  # None: not measured
    detail: str = ""  # e.g. the medians behind it


def _ratio_target(
    section: str, what: str, value: float | None, op: str, bound: float, unit: str = "x"
) -> Target:
    if value is None:
        return Target(section, what, "not measured", f"{op} {bound:g}{unit}", None)
    ok = value <= bound if op == "<=" else value >= bound
    return Target(section, what, f"{value:.2f}{unit}", f"{op} {bound:g}{unit}", ok)


def _rate(per_second: float) -> str:
    return "-" if per_second != per_second else f"{per_second:,.0f}"  # NaN: nothing measured


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def _us_per(seconds: float, n: int) -> str:
    return f"{seconds / n * 1e6:.2f} µs"


def format_version(handle: Any) -> str:
    """The archive format version from the store's header (bytes 8-9 after the 8-byte magic)."""
    try:
        with open(handle.path, "rb") as f:
            head = f.read(10)
        if head[:7] == b"SHMSTOR":
            return str(struct.unpack_from("<H", head, 8)[0])
    except OSError:
        pass
    return "unknown"


def source_commit() -> str:
    """The commit of the checkout this runs from (the extension is assumed built from it)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(C.BENCH_DIR), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        dirty = subprocess.run(
            ["git", "-C", str(C.BENCH_DIR), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if out.returncode != 0:
        return "unknown (not a git checkout)"
    line = out.stdout.strip()[:100]
    return f"commit {line}" + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _free(handle: Any) -> None:
    if handle is not None and not handle.closed:
        handle.unlink()
        handle.close()


def _free_built(_key: str, result: Any) -> None:
    """``paired_samples``' after-hook of the build rounds: free every archive but the last."""
    if hasattr(result, "unlink"):
        _BUILT.append(result)
        while len(_BUILT) > 1:
            _free(_BUILT.pop(0))


_BUILT: list[Any] = []


def _summary_times(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: C.median(v) for k, v in times.items()}


# ----------------------------------------------------------------------------------------------
# COCO-like records


def arrow_ipc_size(records: list[Any]) -> int | None:
    try:
        import pyarrow as pa
    except ImportError:
        return None
    table = pa.Table.from_pylist(records)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:  # uncompressed (the default)
        writer.write_table(table)
    return int(sink.getvalue().size)


def msgpack_size(records: list[Any]) -> int | None:
    try:
        import msgpack
    except ImportError:
        return None
    return C.per_record_buffer_size(records, msgpack.packb)


def touch_batched(lst: Any, indices: list[int]) -> float:
    """The field-touch loop over ``lst.get_many`` batches of ``BATCH`` indices."""
    acc = 0.0
    get_many = lst.get_many
    for s in range(0, len(indices), BATCH):
        for rec in get_many(indices[s : s + BATCH]):
            acc += len(rec["file_name"]) + rec["height"]
            for a in rec["annotations"]:
                acc += a["bbox"][0] + a["category_id"]
    return acc


def micro_fns(lst: Any, n_iter: int, n: int) -> dict[str, Callable[[], Any]]:
    """The loops behind the ns figures (see ``HOW``)."""
    rng = range(n_iter)
    seq = range(n)
    key = MICRO_KEY % n
    ann = lst[key]["annotations"][0]

    def empty() -> None:
        for _ in rng:
            pass

    def getitem() -> None:
        for _ in rng:
            lst[key]

    def view() -> None:
        for _ in rng:
            ann["bbox"]

    def scalar() -> None:
        for _ in rng:
            ann["iscrowd"]

    def empty_seq() -> None:
        for _ in seq:
            pass

    def getitem_seq() -> None:
        for i in seq:
            lst[i]

    return {
        "empty": empty,
        "lst[k]": getitem,
        'ann["bbox"]': view,
        'ann["iscrowd"]': scalar,
        "empty over n": empty_seq,
        "lst[i] over n": getitem_seq,
    }


def run_coco(shm: Any, n: int, repeats: int, micro_iter: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    records = coco.make_records(n)
    C.log(f"coco: {n} records in {time.perf_counter() - t0:.1f} s")
    res: dict[str, Any] = {"n": n, "annotations": sum(len(r["annotations"]) for r in records)}
    sizes: dict[str, int | None] = {}
    sizes["msgpack"] = msgpack_size(records)
    sizes["arrow"] = arrow_ipc_size(records)
    C.log(f"coco: sizes {sizes}")

    # build (keep the last of each)
    builders: dict[str, Callable[[], Any]] = {"pickle": lambda: C.PickleBuffer.build(records)}
    if shm is not None:
        builders["shmstore"] = lambda: shm.SharedList(records)
    times, built = C.paired_samples(builders, repeats, after=_free_built, clock=CLOCK)
    res["build"] = times
    pb = built["pickle"]
    lst = built.get("shmstore")
    sizes["pickle"] = pb.nbytes
    sizes["pickled records"] = int(pb.buf.nbytes)
    res["sizes"] = sizes
    C.log("coco: build " + str(_summary_times(times)))
    try:
        if lst is not None:
            sizes["shmstore"] = int(lst.nbytes)
            res["format_version"] = format_version(lst)
            C.touch_sequence(lst)  # warm: every record validated once, pages mapped
        # field-touch loop, in order
        fns: dict[str, Callable[[], Any]] = {
            "plain": lambda: C.touch_sequence(records),
            "pickle": lambda: C.touch_pickle(pb),
        }
        if lst is not None:
            fns["shmstore"] = lambda: C.touch_sequence(lst)
        res["touch"], sums = C.paired_samples(fns, repeats, clock=CLOCK)
        res["touch_sums"] = sums
        C.log("coco: touch " + str(_summary_times(res["touch"])))
        # random order: one permutation for all
        perm = random.Random(1).sample(range(n), n)
        fns = {
            "plain": lambda: C.touch_indices(records, perm),
            "pickle": lambda: C.touch_pickle_indices(pb, perm),
        }
        if lst is not None:
            fns["shmstore"] = lambda: C.touch_indices(lst, perm)
            if hasattr(lst, "get_many"):
                fns["shmstore get_many"] = lambda: touch_batched(lst, perm)
        res["random"], sums = C.paired_samples(fns, repeats, clock=CLOCK)
        res["random_sums"] = sums
        C.log("coco: random " + str(_summary_times(res["random"])))
        # to_python vs pickle.loads
        fns = {"pickle": lambda: C.materialize_pickle(pb)}
        if lst is not None:
            fns["shmstore"] = lambda: C.materialize_shmstore(lst)
        res["to_python"], _ = C.paired_samples(fns, repeats, clock=CLOCK)
        C.log("coco: to_python " + str(_summary_times(res["to_python"])))
        if lst is not None:
            # ns figures: many short rounds (each ~0.1 s), no gc.collect() between them
            res["micro_iter"] = micro_iter
            res["micro"], _ = C.paired_samples(
                micro_fns(lst, micro_iter, n), max(9, 2 * repeats), gc_collect=False, clock=CLOCK
            )
            step = max(1, n // 2000)
            res["sample_equal"] = all(
                lst[i].to_python() == records[i] for i in range(0, n, step)
            ) and (lst[-1].to_python() == records[-1])
    finally:
        while _BUILT:
            _free(_BUILT.pop())
        _free(lst)
    return res


def coco_targets(res: dict[str, Any]) -> list[Target]:
    sec = "COCO 200k" if res["n"] == 200_000 else f"COCO {res['n'] // 1000}k"
    sizes = res["sizes"]
    arc = sizes.get("shmstore")
    have = arc is not None
    out = [
        _ratio_target(
            sec,
            "archive bytes / pickle-per-record buffer + offsets",
            arc / sizes["pickle"] if have else None,
            "<=",
            0.6,
        ),
        _ratio_target(
            sec,
            "archive bytes / Arrow IPC uncompressed",
            arc / sizes["arrow"] if have and sizes["arrow"] else None,
            "<=",
            1.0,
        ),
    ]
    t = res["touch"]
    out.append(
        _ratio_target(
            sec,
            "field-touch loop in order (warm): times faster than pickle-per-record",
            C.paired_ratio(t, "pickle", "shmstore") if have else None,
            ">=",
            4.0,
        )
    )
    out.append(
        _ratio_target(
            sec,
            "field-touch loop in order (warm): time / plain Python objects",
            C.paired_ratio(t, "shmstore", "plain") if have else None,
            "<=",
            1.1,
        )
    )
    r = res["random"]
    out.append(
        _ratio_target(
            sec,
            "field-touch loop in random order, `lst[i]`: times faster than plain objects",
            C.paired_ratio(r, "plain", "shmstore") if have else None,
            ">=",
            2.5,
        )
    )
    if "shmstore get_many" in r:
        out.append(
            _ratio_target(
                sec,
                f"the same with `lst.get_many` batches of {BATCH}: times faster than plain",
                C.paired_ratio(r, "plain", "shmstore get_many"),
                ">=",
                2.5,
            )
        )
    if have:
        m, k = res["micro"], res["micro_iter"]
        # The whole call (lookup + the view made and freed) over the empty loop: an upper
        # bound of what a view costs, whatever the lookup's share.
        view_ns = C.median([(a - b) / k * 1e9 for a, b in zip(m['ann["bbox"]'], m["empty"])])
        res["view_diff_ns"] = C.median(
            [(a - b) / k * 1e9 for a, b in zip(m['ann["bbox"]'], m['ann["iscrowd"]'])]
        )
        item_ns = C.median([(a - b) / k * 1e9 for a, b in zip(m["lst[k]"], m["empty"])])
        res["view_ns"], res["item_ns"] = view_ns, item_ns
    else:
        view_ns = item_ns = None
    out.append(_ratio_target(sec, "one view (ns, see below)", view_ns, "<=", 15, " ns"))
    out.append(_ratio_target(sec, "`lst[i]` (ns, see below)", item_ns, "<=", 25, " ns"))
    out.append(
        _ratio_target(
            sec,
            "`lst[i].to_python()` time / `pickle.loads` of the record",
            C.paired_ratio(res["to_python"], "shmstore", "pickle") if have else None,
            "<=",
            0.6,
        )
    )
    out.append(
        _ratio_target(
            sec,
            "build time / pickle-per-record build",
            C.paired_ratio(res["build"], "shmstore", "pickle") if have else None,
            "<=",
            1.0,
        )
    )
    return out


# ----------------------------------------------------------------------------------------------
# First pass vs warm pass, in a fresh process


def plain_map_seconds(path: Any) -> float:
    """The time to map every page of the file at `path` through a plain read-only mmap of
    its own, one read per page: what any reader of the mapped file pays on first touch,
    with no check (the floor of a first pass)."""
    import mmap

    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        C.settle()
        t0 = CLOCK()
        int(np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE].sum())
        return CLOCK() - t0


def first_pass_task(name: str, command: Any) -> Any:
    """Worker (spawned): attach to the store, time the field-touch loop twice.

    "passes": the plain mmap floor (`plain_map_seconds`), then the first pass and the warm
    pass. "verified": `verify()` first (every record checked, every page of the store
    mapped), then the two passes: what the first pass costs besides the first touch. Each
    pass also gives its minor page faults (getrusage)."""
    import resource

    if command not in ("passes", "verified"):
        raise ValueError(command)
    shm = C.load_shmstore()
    lst = shm.SharedList.attach(name)
    try:
        verify_s = map_s = None
        if command == "verified":
            C.settle()
            t0 = CLOCK()
            lst.verify()
            verify_s = CLOCK() - t0
        else:
            map_s = plain_map_seconds(lst.path)
        passes = []
        for _ in range(2):  # the first pass, then the warm pass
            C.settle()
            gc.disable()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = CLOCK()
            acc = C.touch_sequence(lst)
            dt = CLOCK() - t0
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            gc.enable()
            passes.append({"s": dt, "faults": u1.ru_minflt - u0.ru_minflt, "sum": acc})
    finally:
        lst.close()
    return {"passes": passes, "verify": verify_s, "map": map_s}


def run_first(shm: Any, n: int, repeats: int) -> dict[str, Any]:
    records = coco.make_records(n)
    firsts, warms, sums = [], [], set()
    rounds: list[dict[str, Any]] = []
    for rep in range(repeats):
        got = {}
        # Alternate which kind of process goes first (each on a fresh store).
        for command in ("passes", "verified") if rep % 2 == 0 else ("verified", "passes"):
            lst = shm.SharedList(records)  # a fresh store, never read in this process
            try:
                with C.WorkerPool("spawn", 1, first_pass_task, lst.name) as pool:
                    got[command] = pool.broadcast(command)[0]
            finally:
                _free(lst)
        first, warm = got["passes"]["passes"]
        firsts.append(first["s"])
        warms.append(warm["s"])
        sums |= {p["sum"] for g in got.values() for p in g["passes"]}
        rounds.append(got)
        C.log(
            f"first pass: round {rep + 1}/{repeats}: first {first['s']:.3f} s, "
            f"warm {warm['s']:.3f} s; after verify(): "
            f"{got['verified']['passes'][0]['s']:.3f} s / {got['verified']['passes'][1]['s']:.3f} s"
        )
    return {
        "n": n,
        "first": firsts,
        "warm": warms,
        "rounds": rounds,
        "consistent": len(sums) == 1,
    }


def first_targets(res: dict[str, Any]) -> list[Target]:
    ratio = C.median([a / b for a, b in zip(res["first"], res["warm"])])
    t = _ratio_target(
        f"COCO {res['n'] // 1000}k", "first pass / warm pass, fresh process", ratio, "<=", 1.1
    )
    return [t]


# ----------------------------------------------------------------------------------------------
# Irregular records


def run_irregular(shm: Any, n: int, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    records = irregular.make_records(n)
    C.log(f"irregular: {n} records in {time.perf_counter() - t0:.1f} s")
    res: dict[str, Any] = {"n": n, "shapes": len({tuple(r) for r in records})}
    builders: dict[str, Callable[[], Any]] = {"pickle": lambda: C.PickleBuffer.build(records)}
    if shm is not None:
        builders["shmstore"] = lambda: shm.SharedList(records)
    res["build"], built = C.paired_samples(builders, repeats, after=_free_built, clock=CLOCK)
    pb, lst = built["pickle"], built.get("shmstore")
    res["sizes"] = {"pickle": pb.nbytes, "msgpack": msgpack_size(records)}
    try:
        if lst is not None:
            res["sizes"]["shmstore"] = int(lst.nbytes)
            irregular.touch(lst)  # warm
        fns: dict[str, Callable[[], Any]] = {
            "plain": lambda: irregular.touch(records),
            "pickle": lambda: irregular.touch_pickle(pb),
        }
        if lst is not None:
            fns["shmstore"] = lambda: irregular.touch(lst)
        res["touch"], res["touch_sums"] = C.paired_samples(fns, repeats, clock=CLOCK)
        fns = {"pickle": lambda: C.materialize_pickle(pb)}
        if lst is not None:
            fns["shmstore"] = lambda: C.materialize_shmstore(lst)
        res["to_python"], _ = C.paired_samples(fns, repeats, clock=CLOCK)
        if lst is not None:
            step = max(1, n // 2000)
            res["sample_equal"] = all(lst[i].to_python() == records[i] for i in range(0, n, step))
    finally:
        while _BUILT:
            _free(_BUILT.pop())
        _free(lst)
    C.log("irregular: touch " + str(_summary_times(res["touch"])))
    return res


def irregular_targets(res: dict[str, Any]) -> list[Target]:
    sec = f"irregular {res['n'] // 1000}k"
    arc = res["sizes"].get("shmstore")
    have = arc is not None
    return [
        _ratio_target(
            sec,
            "archive bytes / pickle-per-record buffer + offsets",
            arc / res["sizes"]["pickle"] if have else None,
            "<=",
            0.9,
        ),
        _ratio_target(
            sec,
            "field access in order (warm): times faster than pickle-per-record",
            C.paired_ratio(res["touch"], "pickle", "shmstore") if have else None,
            ">=",
            2.0,
        ),
        _ratio_target(
            sec,
            "`lst[i].to_python()` time / `pickle.loads` of the record",
            C.paired_ratio(res["to_python"], "shmstore", "pickle") if have else None,
            "<=",
            0.7,
        ),
    ]


# ----------------------------------------------------------------------------------------------
# SharedDict document store vs py-lmdb (bench_docstore.py's corpus and workers)


def run_docstore(
    shm: Any, docs: int, procs: list[int], lookups: int, repeats: int, where: str
) -> dict[str, Any]:
    import bench_docstore as D

    work = Path(tempfile.mkdtemp(prefix="bench-format-docstore-", dir=where))
    handle = None
    res: dict[str, Any] = {"docs": docs, "lookups": lookups, "procs": procs, "repeats": repeats}
    try:
        t0 = time.perf_counter()
        corpus = work / "corpus.tsv"
        res["raw"] = D.write_corpus(corpus, docs, 150)
        C.log(f"docstore: corpus of {docs} docs in {time.perf_counter() - t0:.1f} s")
        spec: dict[str, Any] = {"corpus": str(corpus), "lmdb": str(work / "lmdb")}
        D.build_lmdb(corpus, work / "lmdb")
        approaches = ["lmdb"]
        if shm is not None:
            handle = shm.SharedDict(D.iter_corpus(corpus))
            spec["name"] = handle.name
            res["archive"] = int(handle.nbytes)
            approaches.append("shmstore")
        first = max(1, min(100_000, lookups))
        rates: dict[tuple[str, int], list[float]] = {}
        firsts: dict[tuple[str, int], list[float]] = {}
        rests: dict[tuple[str, int], list[float]] = {}
        sums: set[Any] = set()
        for p in procs:
            for rep in range(repeats):
                for a in approaches if rep % 2 == 0 else reversed(approaches):
                    r = D.measure(a, spec, p, lookups, first, docs)
                    rates.setdefault((a, p), []).append(r["rate"])
                    firsts.setdefault((a, p), []).append(r["rate_first"])
                    rests.setdefault((a, p), []).append(r["rate_rest"])
                    sums |= r["checksums"]
            C.log(
                f"docstore: {p} procs: "
                + ", ".join(f"{a} {C.median(rates[(a, p)]):,.0f}/s" for a in approaches)
            )
        res["rates"], res["firsts"], res["rests"], res["first"] = rates, firsts, rests, first
        res["consistent"] = len(sums) == 1
    finally:
        _free(handle)
        shutil.rmtree(work, ignore_errors=True)
    return res


def docstore_targets(res: dict[str, Any]) -> list[Target]:
    sec = f"docstore {res['docs'] // 1000}k docs"
    out = []
    rates = res["rates"]
    for p in res["procs"]:
        ratio = None
        if ("shmstore", p) in rates:
            ratio = C.median([s / m for s, m in zip(rates[("shmstore", p)], rates[("lmdb", p)])])
        out.append(
            _ratio_target(sec, f"lookups/s per process, {p} proc: times py-lmdb", ratio, ">=", 2.0)
        )
    return out


# ----------------------------------------------------------------------------------------------
# Report

HOW = f"""\
## How each figure is measured

- **Time**: in this process (all but the doc store), its CPU time (`time.process_time`: user +
  system, all threads), so that other processes taking turns on the cores of a busy machine
  do not count; waiting for memory and page faults do. The doc store's rates are wall time
  (its processes run at once).
- **Paired samples**: in every round each approach runs once, in alternating order (reversed
  every other round); a ratio is the median over the rounds of the per-round ratio. The tables
  below give each approach's median time too.
- **pickle-per-record**: every record `pickle.dumps`'d (highest protocol) into one numpy buffer,
  with an int64 offsets array of n + 1 entries; reading a record is `pickle.loads` of its slice.
  Its size is buffer + offsets. msgpack the same with `msgpack.packb` (for reference). **Arrow
  IPC**: `pyarrow.Table.from_pylist(records)` written as one uncompressed IPC stream.
- **field-touch loop**: `rec = lst[i]`, then `len(rec["file_name"]) + rec["height"]` and, for
  every annotation, `a["bbox"][0] + a["category_id"]` (benchmarks/_common.py); *warm*: every
  record was read once before (validated, pages mapped). *Random order*: the same loop over one
  fixed random permutation of the indices (the same for every approach); the `get_many` variant
  reads the permutation in batches of {BATCH} with `lst.get_many(batch)`.
- **one view (ns)**: on one annotation view `ann` (held), the per-call time of `ann["bbox"]`
  (a key lookup that creates a list view, then frees it) minus that of the same loop with an
  empty body: the lookup and the view together, an upper bound of what a view costs. (The
  difference to `ann["iscrowd"]`, a lookup returning a cached small int, is also reported; it
  no longer isolates the view, since a field's lookup cost depends on its position: `bbox` is
  the first field, `iscrowd` the fourth.) Loops of `--micro-iter` calls, hot in the CPU caches.
- **`lst[i]` (ns)**: the per-call time of `lst[k]` for one fixed k in a loop, minus that of the
  same loop with an empty body: index lookup + creating and freeing the record's view, hot in the
  caches. (Over all records in order, memory included, it is reported below, not a target.)
- **to_python**: `lst[i].to_python()` for every record vs `pickle.loads` of every record.
- **build**: `SharedList(records)` (into shared memory) vs pickling every record into the buffer
  + offsets.
- **first pass vs warm pass**: a fresh store is built and not read; a fresh spawned process
  attaches to it by name and runs the field-touch loop twice: the first pass (pages mapped and
  records validated on first touch) and the warm pass right after; ratio per process, median over
  the rounds (one fresh store and process per round). Beside it, per round, the kernel time and
  page faults the first pass has more than the warm one, and a second fresh process on a second
  fresh store that calls `verify()` before its passes (the time of `verify()`, all checks and
  all pages at once, and its first / warm ratio).
- **irregular**: benchmarks/irregular.py's records; the loop reads `id`, `event`, `score` (may
  be None), the optional `tags` (its length) and `geo["lat"]` (via `.get`).
- **docstore**: bench_docstore.py's corpus (Zipf words, ~1 KB per document) and workers: each
  spawned process attaches to the SharedDict (or opens the py-lmdb environment, all files in RAM)
  and looks up random doc_ids (get + decode to `str`); rate per process, all processes at once.
"""


def _size_table(s: dict[str, Any], n: int, rows: list[tuple[str, str]]) -> str:
    """Sizes of the representations `rows` names (key, label), per record and vs pickle."""
    out = []
    for k, label in rows:
        v = s.get(k)
        if v is None:
            out.append([label, "not measured", "", ""])
        else:
            out.append([label, C.mib(v), f"{v / n:,.0f}", f"{v / s['pickle']:.2f}x"])
    return C.md_table(["", "MiB", "bytes/record", "vs pickle + offsets"], out)


def _time_table(
    title: str, times: dict[str, list[float]], n: int, unit_name: str = "per record"
) -> str:
    med = _summary_times(times)
    rows = [
        [k, _ms(v), _us_per(v, n), ", ".join(f"{t:.3f}" for t in times[k])] for k, v in med.items()
    ]
    return f"**{title}**\n\n" + C.md_table(
        ["approach", "median CPU time", unit_name, "all samples (s, CPU)"], rows
    )


def render(results: dict[str, Any], targets: list[Target], args: argparse.Namespace) -> str:
    version = results.get("coco", {}).get("format_version")
    if version is None:
        version = results.get("format_version", "unknown")
    out = [
        f"# Compact-format targets: archive format version {version}",
        "",
        "`make bench-format` (`python benchmarks/bench_format.py"
        + (f" {' '.join(args.argv)}" if args.argv else "")
        + "`): every target of the compact-format work measured side by side in one run; "
        f"archive format version **{version}** (read from the stores' header).",
        "",
        C.machine_md(),
        f"- **source**: {results.get('source', 'unknown')}",
        "- **load average at the start of the run**: "
        + " / ".join(f"{x:.2f}" for x in results["load_start"]),
        f"- **run time**: {results['elapsed']:.0f} s",
        "",
    ]
    if args.quick or args.notes:
        out += [f"**Note**: {args.notes}" if args.notes else "", ""]
    if C.load_shmstore() is None:
        out += [f"shmstore not importable: {C.shmstore_error()}; its targets not measured.", ""]
    out += ["## Targets", ""]
    rows = []
    for t in targets:
        verdict = "not measured" if t.ok is None else C.verdict(t.ok)
        rows.append([t.section, t.what, t.measured, t.goal, verdict])
    out += [C.md_table(["data", "target", "measured", "goal", "verdict"], rows, left=2), ""]
    n_ok = sum(1 for t in targets if t.ok)
    n_meas = sum(1 for t in targets if t.ok is not None)
    out += [f"{n_ok} of {n_meas} measured targets met.", ""]
    out += [
        "Memory (total PSS vs archive + interpreter baseline for fork/spawn/forkserver, and "
        "under fork vs the pickle buffer): `benchmarks/bench_memory.py`, run separately, "
        "results in [memory.md](memory.md).",
        "",
    ]
    warnings = []
    if "coco" in results:
        r = results["coco"]
        n = r["n"]
        s = r["sizes"]
        out += ["## COCO-like records", ""]
        out += [
            f"{n:,} records ({r['annotations']:,} annotations; benchmarks/coco.py, seed 0), "
            f"one process, {args.repeats} rounds.",
            "",
        ]
        sizes = [
            ("pickled records", "pickled records alone (sum of `pickle.dumps`)"),
            ("pickle", "pickle-per-record buffer + int64 offsets"),
            ("msgpack", "msgpack-per-record buffer + int64 offsets"),
            ("arrow", "Arrow IPC stream, uncompressed"),
            ("shmstore", "shmstore archive (`nbytes`)"),
        ]
        out += [_size_table(s, n, sizes), ""]
        out += [_time_table("build", r["build"], n), ""]
        out += [_time_table("field-touch loop, in order (warm)", r["touch"], n), ""]
        out += [_time_table("field-touch loop, random order", r["random"], n), ""]
        out += [_time_table("to_python vs pickle.loads, every record", r["to_python"], n), ""]
        if "micro" in r:
            m, k = r["micro"], r["micro_iter"]
            seq = C.median(
                [(a - b) / n * 1e9 for a, b in zip(m["lst[i] over n"], m["empty over n"])]
            )
            rows = [
                [name, f"{C.median(v) / (n if 'over n' in name else k) * 1e9:.1f}"]
                for name, v in m.items()
            ]
            out += [
                f"**ns per call** ({k:,} calls per loop, {len(m['empty'])} rounds, medians; "
                "the loops over n go over every record in order):",
                "",
                C.md_table(["loop body", "ns per iteration"], rows),
                "",
                f"One view: {r['view_ns']:.1f} ns (lookup included; minus the `iscrowd` "
                f"lookup: {r.get('view_diff_ns', float('nan')):.1f} ns); "
                f"`lst[k]`: {r['item_ns']:.1f} ns; "
                f"`lst[i]` over all records in order (memory included, not a target): "
                f"{seq:.1f} ns.",
                "",
            ]
            if not r["sample_equal"]:
                warnings.append("COCO: `lst[i].to_python() != records[i]` for some sampled i")
        for key in ("touch_sums", "random_sums"):
            if len(set(r[key].values())) > 1:
                warnings.append(f"COCO: the loops' checksums disagree ({key}): {r[key]}")
    if "first" in results:
        r = results["first"]
        rows = []
        for i, got in enumerate(r["rounds"]):
            (a, b), (va, vb) = got["passes"]["passes"], got["verified"]["passes"]
            rows.append(
                [
                    i + 1,
                    f"{a['s'] * 1e3:.1f}",
                    f"{b['s'] * 1e3:.1f}",
                    f"{a['s'] / b['s']:.2f}",
                    f"{(a['s'] - b['s']) * 1e3:.1f}",
                    f"{a['faults'] - b['faults']:,}",
                    f"{got['passes']['map'] * 1e3:.1f}",
                    f"{got['verified']['verify'] * 1e3:.1f}",
                    f"{va['s'] / vb['s']:.2f}",
                ]
            )
        out += [
            "## First pass vs warm pass",
            "",
            f"{r['n']:,} COCO-like records; per round a fresh store and a fresh spawned process "
            "that runs the field-touch loop twice (first, warm); and another fresh store and "
            "process that calls `verify()` first (every record checked, every page mapped), "
            "then runs the two passes. *Page faults*: how many more minor page faults the "
            "first pass had than the warm pass (getrusage). *Plain mmap*: in the first "
            "process, before its passes, the time to read one byte of every page of the "
            "store's file through a plain read-only `mmap` of it (a mapping of its own, so the "
            "store's pages stay unmapped): what any reader of the mapped file pays for its "
            "first touch, with no check at all, a floor under *first - warm*.",
            "",
            C.md_table(
                [
                    "round",
                    "first pass (ms)",
                    "warm pass (ms)",
                    "ratio",
                    "first - warm (ms)",
                    "first - warm: page faults",
                    "plain mmap, every page (ms)",
                    "verify() (ms)",
                    "after verify(): first / warm",
                ],
                rows,
            ),
            "",
        ]
        if not r["consistent"]:
            warnings.append("first pass: the passes' checksums disagree")
    if "irregular" in results:
        r = results["irregular"]
        n = r["n"]
        s = r["sizes"]
        out += [
            "## Irregular records",
            "",
            f"{n:,} records of benchmarks/irregular.py (seed 0; {r['shapes']} distinct "
            f"top-level key sets, mixed value types per field), one process, "
            f"{args.repeats} rounds.",
            "",
        ]
        sizes = [
            ("pickle", "pickle-per-record buffer + int64 offsets"),
            ("msgpack", "msgpack-per-record buffer + int64 offsets"),
            ("shmstore", "shmstore archive (`nbytes`)"),
        ]
        out += [_size_table(s, n, sizes), ""]
        out += [_time_table("build", r["build"], n), ""]
        out += [_time_table("field access, in order (warm)", r["touch"], n), ""]
        out += [_time_table("to_python vs pickle.loads, every record", r["to_python"], n), ""]
        if len(set(r["touch_sums"].values())) > 1:
            warnings.append(f"irregular: the loops' checksums disagree: {r['touch_sums']}")
        if r.get("sample_equal") is False:
            warnings.append("irregular: `lst[i].to_python() != records[i]` for some sampled i")
    if "docstore" in results:
        r = results["docstore"]
        scaled = (
            ""
            if r["docs"] >= 1_000_000
            else f" **Scaled down** to {r['docs']:,} documents (the target is stated for 1M)."
        )
        arch = f", archive {C.mib(r['archive'])} MiB" if "archive" in r else ""
        out += [
            "## SharedDict document store vs py-lmdb",
            "",
            f"{r['docs']:,} documents ({C.mib(r['raw'])} MiB of text{arch}); "
            f"{r['lookups']:,} random lookups per process, all processes at once on "
            f"{os.cpu_count()} cores; {r['repeats']} rounds per process count.{scaled}",
            "",
        ]
        rows = []
        for (a, p), v in sorted(r["rates"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
            rows.append(
                [
                    p,
                    a,
                    f"{C.median(v):,.0f}",
                    f"{C.median(r['firsts'][(a, p)]):,.0f}",
                    _rate(C.median(r["rests"][(a, p)])),
                    ", ".join(f"{x:,.0f}" for x in v),
                ]
            )
        k = r["first"]
        out += [
            C.md_table(
                [
                    "procs",
                    "approach",
                    "lookups/s per process (median)",
                    f"first {k:,}",
                    f"after the first {k:,}",
                    "all rounds",
                ],
                rows,
                2,
            ),
            "",
            f"The first {k:,} lookups of a fresh process pay for first touches (page faults; "
            "shmstore checks a record's block on first access, a document being a block of its "
            "own); the later ones find more of the documents' pages and blocks already touched.",
            "",
        ]
        if not r["consistent"]:
            warnings.append("docstore: the approaches read different documents (checksums)")
    if warnings:
        out += ["## Warnings", ""] + [f"- **{w}**" for w in warnings] + [""]
    out += [HOW]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (~1 min): a smoke test")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    ap.add_argument("--n", type=int, help="COCO-like records (default 200000)")
    ap.add_argument("--irregular-n", type=int, help="irregular records (default 200000)")
    ap.add_argument("--repeats", type=int, help="rounds of paired samples (default 5)")
    ap.add_argument("--micro-iter", type=int, help="calls per ns loop (default 1000000)")
    ap.add_argument("--first-repeats", type=int, help="fresh processes for first/warm (default 5)")
    ap.add_argument("--docs", type=int, help="documents of the doc store (default 1000000)")
    ap.add_argument("--lookups", type=int, help="lookups per process (default 200000)")
    ap.add_argument("--procs", help="process counts of the doc store (default 1,2,4,8)")
    ap.add_argument("--docstore-repeats", type=int, help="rounds per process count (default 3)")
    ap.add_argument(
        "--dir", default="/dev/shm", help="where the doc store's corpus and py-lmdb files go"
    )
    ap.add_argument("--notes", default="", help="a sentence for the report's header")
    ap.add_argument("--out", type=Path, help="markdown out (default results/format.md)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "n": 20_000 if quick else 200_000,
        "irregular_n": 20_000 if quick else 200_000,
        "repeats": 3 if quick else 5,
        "micro_iter": 200_000 if quick else 1_000_000,
        "first_repeats": 2 if quick else 5,
        "docs": 50_000 if quick else 1_000_000,
        "lookups": 50_000 if quick else 200_000,
        "procs": "1,2" if quick else "1,2,4,8",
        "docstore_repeats": 1 if quick else 3,
        "out": C.RESULTS_DIR / ("format-quick.md" if quick else "format.md"),
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if quick and not args.notes:
        args.notes = (
            "`--quick`: small sizes, a smoke test; the targets are stated for the defaults."
        )
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    shm = C.load_shmstore()
    if shm is None:
        C.log(f"WARNING: shmstore not importable: {C.shmstore_error()}")

    t0 = time.perf_counter()
    results: dict[str, Any] = {"load_start": os.getloadavg(), "source": source_commit()}
    targets: list[Target] = []
    if "coco" in sections:
        results["coco"] = run_coco(shm, args.n, args.repeats, args.micro_iter)
        targets += coco_targets(results["coco"])
    if "first" in sections and shm is not None:
        results["first"] = run_first(shm, args.n, args.first_repeats)
        targets += first_targets(results["first"])
    if "irregular" in sections:
        results["irregular"] = run_irregular(shm, args.irregular_n, args.repeats)
        targets += irregular_targets(results["irregular"])
    if "docstore" in sections:
        procs = [int(p) for p in args.procs.split(",")]
        results["docstore"] = run_docstore(
            shm, args.docs, procs, args.lookups, args.docstore_repeats, args.dir
        )
        targets += docstore_targets(results["docstore"])
    if "coco" not in sections and shm is not None:
        probe = shm.SharedList([{}])
        results["format_version"] = format_version(probe)
        _free(probe)
    results["elapsed"] = time.perf_counter() - t0
    text = render(results, targets, args)
    print(text)
    C.write_result(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
