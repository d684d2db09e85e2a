"""Shared helpers of the benchmarks: machine info, markdown tables, PSS/USS, worker harness, timing,
and the three ways of holding the data set (plain list, pickle-per-record buffer, shmstore).

Worker processes import this module by name (spawn/forkserver), so everything a worker runs lives
here at module level, and the benchmarks directory is put on ``sys.path`` (children inherit it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import os
import pickle
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

MiB = 1024 * 1024
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

# ----------------------------------------------------------------------------------------------
# shmstore (optional until the extension builds)

_SHMSTORE: Any = None
_SHMSTORE_ERROR: str | None = None


def load_shmstore() -> Any:
    """Return the ``shmstore`` module, or None (the reason is in ``shmstore_error()``)."""
    global _SHMSTORE, _SHMSTORE_ERROR
    if _SHMSTORE is None and _SHMSTORE_ERROR is None:
        try:
            import shmstore

            shmstore.SharedList  # noqa: B018  (fail here if the package is only a skeleton)
            _SHMSTORE = shmstore
        except Exception as exc:  # ImportError, AttributeError, a panic while importing...
            _SHMSTORE_ERROR = f"{type(exc).__name__}: {exc}"
    return _SHMSTORE


def shmstore_error() -> str | None:
    load_shmstore()
    return _SHMSTORE_ERROR


# Import it now, so that every process of a benchmark (main, workers, forkserver) has the same
# modules loaded (numpy and shmstore) whatever the approach: same interpreter baseline for all.
load_shmstore()


# ----------------------------------------------------------------------------------------------
# Machine description and markdown


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1024**3
    except OSError:
        pass
    return float("nan")


def machine_info() -> dict[str, str]:
    """Date, CPUs, CPU model, RAM, OS, Python, numpy and shmstore versions."""
    shm = load_shmstore()
    if shm is not None:
        shm_version = str(getattr(shm, "__version__", "importable (no __version__)"))
    else:
        shm_version = f"not importable ({shmstore_error()})"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "ram": f"{_ram_gib():.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "shmstore": shm_version,
        # Other work on the machine skews timings; the 5 and 15 min averages cover the run.
        "load average (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def machine_md() -> str:
    info = machine_info()
    return "\n".join(f"- **{k}**: {v}" for k, v in info.items())


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A GitHub markdown table; the first ``left`` columns left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i < left else row[i].rjust(widths[i])
            for i in range(len(row))
        ]
        return "| " + " | ".join(parts) + " |"

    sep = "|".join(
        ("-" * (w + 2)) if i < left else ("-" * (w + 1) + ":") for i, w in enumerate(widths)
    )
    return "\n".join([line(cells[0]), "|" + sep + "|", *(line(r) for r in cells[1:])])


def per_call(step: Callable[[], Any], ops: int, rounds: int) -> float:
    """Seconds per call of `step`, the median of `rounds` rounds of `ops` calls."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(ops):
            step()
        times.append((time.perf_counter() - t0) / ops)
    return statistics.median(times)


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def write_result(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# Memory: PSS and USS from /proc/PID/smaps_rollup


def smaps_rollup(pid: int) -> dict[str, int]:
    """The fields of /proc/PID/smaps_rollup in bytes, plus ``uss`` (Private_Clean + Private_Dirty,
    psutil's definition): memory that would be freed if the process exited."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    out["uss"] = out.get("Private_Clean", 0) + out.get("Private_Dirty", 0)
    return out


def machine_memory(roots: list[int], segment_dir: Path) -> int:
    """One "machine"'s memory: the sum over ``roots`` and their descendants of PSS minus its
    shared-memory part, plus the files in ``segment_dir`` (its segments, counted once)."""
    total = 0
    for pid in [p for r in roots for p in [r, *descendants(r)]]:
        try:
            s = smaps_rollup(pid)
        except OSError:  # exited meanwhile
            continue
        total += s.get("Pss", 0) - s.get("Pss_Shmem", 0)
    try:
        files = list(segment_dir.iterdir())
    except OSError:  # closed meanwhile
        files = []
    for f in files:
        try:
            total += f.stat().st_blocks * 512
        except OSError:
            pass
    return total


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children, grandchildren...), from /proc/*/stat."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        parent_of[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found.extend(kids)
        frontier.extend(kids)
    return sorted(found)


_libc: Any = None


def malloc_trim() -> None:
    """Give free heap memory back to the OS (glibc); a no-op elsewhere."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def settle() -> None:
    """Drop set-up garbage before a measurement: gc.collect() and malloc_trim()."""
    gc.collect()
    malloc_trim()


# ----------------------------------------------------------------------------------------------
# Worker harness: N processes that each run ``task(data, command)`` on command; no sleeps.


class Pickled:
    """Data handed to a worker as a pickle whatever the start method (even fork, where Process
    arguments are otherwise inherited); ``serve`` unpickles it before reporting ready."""

    def __init__(self, obj: Any) -> None:
        self.blob = pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def serve(conn: Connection, task: Callable[[Any, Any], Any], data: Any) -> None:
    """Worker main loop. Reports ("ready", pid), then for every command received runs
    ``task(data, command)`` and sends the reply back; a ``None`` command ends the worker.
    Between commands the worker blocks in ``recv()``: that is when the parent measures it."""
    if isinstance(data, Pickled):
        data = pickle.loads(data.blob)
    conn.send(("ready", os.getpid()))
    while True:
        command = conn.recv()
        if command is None:
            break
        try:
            conn.send(("ok", task(data, command)))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
    conn.close()


class WorkerPool:
    """Start ``n`` processes with ``method`` that run ``serve(conn, task, data)``.

    ``data`` is passed as a Process argument: inherited under fork, pickled under spawn and
    forkserver, exactly like a DataLoader's dataset. Every method blocks until every worker has
    answered, so measurements taken between calls see all workers waiting."""

    def __init__(self, method: str, n: int, task: Callable[[Any, Any], Any], data: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context(method)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, task, data), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids: list[int] = []
        for conn in self.conns:
            _tag, pid = self._recv(conn)
            self.pids.append(pid)

    @staticmethod
    def _recv(conn: Connection) -> Any:
        try:
            tag, value = conn.recv()
        except EOFError:
            raise RuntimeError("a worker died before answering (see its traceback above)") from None
        if tag == "error":
            raise RuntimeError(f"worker failed: {value}")
        return tag, value

    def broadcast(self, command: Any) -> list[Any]:
        """Send ``command`` to every worker, then wait for every reply."""
        for conn in self.conns:
            conn.send(command)
        return [self._recv(conn)[1] for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Timing


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call, with the cyclic GC off during it (as timeit does), and its result
    (so that freeing the result is not timed)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result
    finally:
        if was_enabled:
            gc.enable()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ----------------------------------------------------------------------------------------------
# The approaches: how the records are held and how one reads them.
# The loops are written out in full for each approach (no per-record helper call), and use the
# same field accesses, so that the timings compare record access and nothing else.

APPROACHES = ("plain", "pickle", "shmstore")
APPROACH_TITLES = {
    "none": "no data (interpreter baseline)",
    "plain": "plain Python list",
    "pickle": "pickle-per-record numpy buffer",
    "shmstore": "shmstore SharedList",
    # Optional (not in APPROACHES): the SharedList as a plain Process argument, so that under
    # fork the workers inherit the parent's handle instead of attaching by name.
    "shmstore-inherit": "shmstore SharedList, inherited handle",
}


class PickleBuffer:
    """The usual fix (detectron2's): every record pickled into one numpy uint8 buffer, and an int64
    offsets array (n + 1 entries, offsets[0] == 0). Pickling it (spawn) copies the whole buffer."""

    def __init__(self, buf: np.ndarray, offsets: np.ndarray) -> None:
        self.buf = buf
        self.offsets = offsets

    @classmethod
    def build(cls, records: Iterable[Any]) -> PickleBuffer:
        dumps = pickle.dumps
        chunks = [dumps(r, protocol=PICKLE_PROTOCOL) for r in records]
        offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in chunks], out=offsets[1:])
        buf = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        return cls(buf, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes + self.offsets.nbytes)

    def __getitem__(self, i: int) -> Any:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return pickle.loads(memoryview(self.buf)[a:b])


def touch_sequence(lst: Any) -> float:
    """The field-touch loop over a sequence of records (plain list or shmstore SharedList)."""
    acc = 0.0
    for i in range(len(lst)):
        rec = lst[i]
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["bbox"][0] + a["category_id"]
    return acc


def touch_pickle(pb: PickleBuffer) -> float:
    """The field-touch loop over a PickleBuffer: unpickle each record, then touch it."""
    loads = pickle.loads
    mv = memoryview(pb.buf)
    off = memoryview(pb.offsets)  # indexing a memoryview gives Python ints, fast, no copy
    acc = 0.0
    for i in range(len(off) - 1):
        rec = loads(mv[off[i] : off[i + 1]])
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["bbox"][0] + a["category_id"]
    return acc


def materialize_pickle(pb: PickleBuffer) -> None:
    """Every record as plain Python objects: pickle.loads per record."""
    loads = pickle.loads
    mv = memoryview(pb.buf)
    off = memoryview(pb.offsets)
    for i in range(len(off) - 1):
        loads(mv[off[i] : off[i + 1]])


def materialize_shmstore(lst: Any) -> None:
    """Every record as plain Python objects: lst[i].to_python() per record."""
    for i in range(len(lst)):
        lst[i].to_python()


def read_task(data: Any, command: Any) -> Any:
    """Worker task of the memory benchmark: ``("touch", approach)`` reads every record once."""
    op, approach = command
    if op != "touch":
        raise ValueError(f"unknown command {command!r}")
    if approach == "none":
        return 0.0
    if approach == "pickle":
        return touch_pickle(data)
    return touch_sequence(data)


def payload_size(data: Any) -> int:
    """Bytes a spawn/forkserver worker receives for ``data`` (its pickle)."""
    return len(pickle.dumps(data, protocol=PICKLE_PROTOCOL))


def touch_indices(seq: Any, indices: Sequence[int]) -> float:
    """The field-touch loop of ``touch_sequence``, over the records at ``indices`` in that order
    (a permutation: random order)."""
    acc = 0.0
    for i in indices:
        rec = seq[i]
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["bbox"][0] + a["category_id"]
    return acc


def touch_pickle_indices(pb: PickleBuffer, indices: Sequence[int]) -> float:
    """``touch_pickle`` over the records at ``indices``, in that order."""
    loads = pickle.loads
    mv = memoryview(pb.buf)
    off = memoryview(pb.offsets)
    acc = 0.0
    for i in indices:
        rec = loads(mv[off[i] : off[i + 1]])
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["bbox"][0] + a["category_id"]
    return acc


def paired_samples(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    gc_collect: bool = True,
    after: Callable[[str, Any], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time every function of ``fns`` once per repeat, alternating: the order is reversed every
    other repeat, so that a drift of the machine's load hits every function alike. Returns the
    times per function (seconds, in repeat order: sample ``k`` of every function comes from the
    same round) and each function's last result. ``gc_collect=False`` skips the collection
    before each call (micro-benchmarks; the GC is off during every call either way).
    ``after(key, result)``, if given, runs after each call, untimed (e.g. to free a store that
    the call built, keeping only the last)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    results: dict[str, Any] = {}
    keys = list(fns)
    for rep in range(repeats):
        for k in keys if rep % 2 == 0 else reversed(keys):
            if gc_collect:
                gc.collect()
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                t0 = clock()
                results[k] = fns[k]()
                dt = clock() - t0
            finally:
                if was_enabled:
                    gc.enable()
            times[k].append(dt)
            if after is not None:
                after(k, results[k])
    return times, results


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over the rounds of ``times[num][k] / times[den][k]`` (paired samples)."""
    return median([a / b for a, b in zip(times[num], times[den])])


def per_record_buffer_size(records: Iterable[Any], dumps: Callable[[Any], bytes]) -> int:
    """Bytes of every record serialised by ``dumps`` into one buffer + int64 offsets (n + 1)."""
    total = 0
    n = 0
    for r in records:
        total += len(dumps(r))
        n += 1
    return total + 8 * (n + 1)


def log(message: str) -> None:
    """Progress on stderr (the results go to stdout and the results file)."""
    print(message, file=sys.stderr, flush=True)
