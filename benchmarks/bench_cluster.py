"""Dask across machines: memory per machine and time to the first task, three ways.

    python benchmarks/bench_cluster.py [--records 200000] [--array-mib 1024] [--workers 4]

A Dask scheduler and 2 simulated machines x ``--workers`` Nanny workers (1 thread each) on this
host; each machine has its own segment directory in /dev/shm and ``SHMSTORE_NODE_ID`` (the
same code paths as separate hosts; tests/test_cluster.py runs real namespaces). The client is
a third "machine" (not counted). Two data sets, each shipped three ways:

- ``shmstore.dask.share`` (chunks scattered once, fetched once per machine, each chunk released
  by the share as soon as both machines have it), tasks take the handle;
- ``client.scatter`` of the data to every worker (one scatter per worker: the state
  ``broadcast=True`` ends in, a deserialized copy in every worker process; ``broadcast=True``
  itself, scatter + replicate, did not finish within minutes with 8 workers on this 2-core
  machine under load), tasks take the future;
- joblib's Dask backend default (``parallel_config(backend="dask")``, the data passed as an
  argument: joblib scatters it).

Every worker runs one task that touches every record (sum of the annotation areas) or reads the
whole array once. Memory per machine: sum over its processes (Nannies and workers) of PSS
without shared-memory pages, plus the bytes of its segments in /dev/shm (so a store counts once
per machine, however many processes map it), sampled every 0.2 s; the peak is reported, and
the same measure of the idle cluster (interpreter baselines). Times: from the start of shipping
(share / scatter / Parallel) to the first task starting, and to the last result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MiB, machine_md, machine_memory, md_table, write_result
from coco import make_records

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.md"


class Box:
    """One object around the records: ``client.scatter`` splits a bare list into one future
    per element."""

    def __init__(self, records: Any) -> None:
        self.records = records


def touch_records(data: Any) -> tuple[float, float]:
    t0 = time.time()
    data = data.records if isinstance(data, Box) else data
    total = 0.0
    for rec in data:
        for a in rec["annotations"]:
            total += a["area"]
    return t0, total


def touch_array(data: Any) -> tuple[float, float]:
    t0 = time.time()
    arr = data.get() if hasattr(data, "get") and not isinstance(data, np.ndarray) else data
    return t0, float(np.sum(arr))


class Cluster:
    """Scheduler + machines of Nanny workers, started as separate processes."""

    def __init__(self, machines: int, workers: int, base: Path) -> None:
        self.base = base
        self.procs: list[subprocess.Popen[bytes]] = []
        self.machine_roots: list[list[int]] = []
        self.dirs: list[Path] = []
        sched = base / "scheduler.json"
        self.sched = sched
        self._start(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
             "--port", "0", "--no-dashboard", "--scheduler-file", str(sched)],
            dict(os.environ),
        )  # fmt: skip
        for m in range(machines):
            d = Path(f"/dev/shm/shmstore-bench-cluster-{os.getpid()}-m{m}")
            d.mkdir(mode=0o700)
            self.dirs.append(d)
            env = dict(os.environ, SHMSTORE_NODE_ID=f"bench-m{m}", SHMSTORE_DIR=str(d))
            env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-sv-bench-{os.getpid()}-{m}"
            env["SHMSTORE_FALLBACK"] = "0"
            roots = []
            for _ in range(workers):
                p = self._start(
                    [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                     str(sched), "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard",
                     "--memory-limit", "0"],
                    env,
                )  # fmt: skip
                roots.append(p.pid)
            self.machine_roots.append(roots)

    def _start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.base / f"log-{len(self.procs)}.txt", "wb") as log:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(p)
        return p

    def memory(self) -> list[int]:
        """Per machine: sum of (PSS - shared-memory PSS) of its processes + its segments."""
        return [machine_memory(roots, d) for roots, d in zip(self.machine_roots, self.dirs)]

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


class Sampler:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.peak = [0] * len(cluster.dirs)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        for _ in range(1_000_000):
            m = self.cluster.memory()
            self.peak = [max(a, b) for a, b in zip(self.peak, m)]
            if self._stop.wait(0.2):
                return

    def stop(self) -> list[int]:
        self._stop.set()
        self._t.join(30)
        m = self.cluster.memory()
        return [max(a, b) for a, b in zip(self.peak, m)]


def run_method(
    method: str, data_kind: str, args: argparse.Namespace, records: Any, array: Any
) -> dict[str, Any]:
    import joblib
    import shmstore
    import shmstore.dask
    from distributed import Client, wait

    base = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    cluster = Cluster(2, args.workers, base)
    n = 2 * args.workers
    try:
        for _ in range(600):
            if cluster.sched.exists():
                break
            time.sleep(0.1)
        with Client(scheduler_file=str(cluster.sched), timeout="120s") as client:
            client.wait_for_workers(n, timeout=300)
            workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
            idle = cluster.memory()
            task: Callable[[Any], Any] = touch_records if data_kind == "records" else touch_array
            src = records if data_kind == "records" else array
            if method.startswith("shmstore"):
                h = shmstore.SharedList(src) if data_kind == "records" else shmstore.put(src)
            sampler = Sampler(cluster)
            t0 = time.time()
            if method in ("shmstore", "shmstore-file"):
                if method == "shmstore":
                    share = shmstore.dask.share(client, h)
                else:
                    share = shmstore.dask.share(client, h, path=base / "data.shm", scatter=False)
                # No drop_chunks(): each chunk is released as soon as both machines have it.
                futs = [client.submit(task, h, workers=[w], pure=False) for w in workers]
                wait(futs, timeout=args.budget)
                out = client.gather(futs)
            elif method == "broadcast":
                box = Box(src) if data_kind == "records" else src
                fut = client.scatter(box, broadcast=True, hash=False, timeout=args.budget)
                futs = [client.submit(task, fut, workers=[w], pure=False) for w in workers]
                wait(futs, timeout=args.budget)
                out = client.gather(futs)
            elif method == "scatter":
                box = Box(src) if data_kind == "records" else src
                # One scatter per worker: what broadcast=True ends with (a copy in every
                # worker). broadcast=True itself (scatter + replicate) did not finish within
                # minutes with 8 workers on this 2-core machine under load.
                held = [client.scatter(box, workers=[w], hash=False) for w in workers]
                futs = [
                    client.submit(task, f, workers=[w], pure=False) for f, w in zip(held, workers)
                ]
                wait(futs, timeout=args.budget)
                out = client.gather(futs)
            else:
                with joblib.parallel_config(backend="dask"):
                    box = Box(src) if data_kind == "records" else src
                    out = joblib.Parallel(n_jobs=n)(joblib.delayed(task)(box) for _ in range(n))
            t_end = time.time()
            wait([])
            peak = sampler.stop()
            steady = cluster.memory()  # after the tasks, the data still held
            chunks_left = None
            if method.startswith("shmstore"):
                chunks_left = share.chunks_held
                share.close()
                h.unlink()
            firsts = [t for t, _ in out]
            assert len({round(v, 3) for _, v in out}) == 1, "workers disagree"
            result = {
                "peak": peak,
                "steady": steady,
                "idle": idle,
                "first": min(firsts) - t0,
                "wall": t_end - t0,
                "chunks_left": chunks_left,
            }
    except Exception:
        print(f"{method} {data_kind} failed; logs kept in {base}", flush=True)
        cluster.close()
        raise
    cluster.close()
    shutil.rmtree(base, ignore_errors=True)
    return result


HEADERS = [
    "data",
    "how",
    "peak MiB / machine",
    "idle",
    "peak - idle",
    "vs shmstore",
    "after tasks",
    "vs shmstore",
    "to 1st task s",
    "wall s",
]


def _verdict(ratios: list[float]) -> str:
    ok = bool(ratios) and min(ratios) >= 3
    return ", ".join(f"{r:.2f}x" for r in ratios) + f" -> **{'PASS' if ok else 'FAIL'}**"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--array-mib", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=4, help="workers per machine (2 machines)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=float, default=600, help="seconds per shipping/run step")
    ap.add_argument("--only", default="", help="comma-separated methods (default: all)")
    ap.add_argument("--kinds", default="records,array")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    records = make_records(args.records)
    array = np.random.default_rng(0).random(args.array_mib * MiB // 8)
    methods = ["shmstore", "shmstore-file", "broadcast", "scatter", "joblib"]
    labels = {
        "shmstore": "shmstore.dask.share (chunks)",
        "shmstore-file": "shmstore.dask.share (shared file)",
        "broadcast": "client.scatter(broadcast=True)",
        "scatter": "client.scatter to every worker",
        "joblib": "joblib Dask backend (default)",
    }
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    kinds = args.kinds.split(",")
    if args.only:
        methods = args.only.split(",")
    for kind in kinds:
        for rep in range(args.repeats):
            for m in methods:  # round-robin: the methods see the same load
                t_run = time.monotonic()
                try:
                    r = run_method(m, kind, args, records, array)
                except Exception as e:  # e.g. a time-out: reported, the others still run
                    r = {"error": f"{type(e).__name__} after {time.monotonic() - t_run:.0f} s"}
                print(kind, m, rep, r, flush=True)
                results.setdefault((kind, m), []).append(r)
    rows = []
    ratios: list[float] = []
    ratios_steady: list[float] = []
    ratios_data: list[float] = []
    compared: list[str] = []
    base_data = 0.0
    for kind in kinds:
        base = None
        for m in methods:
            rs = [r for r in results[(kind, m)] if "error" not in r]
            if not rs:
                err = results[(kind, m)][0]["error"]
                rows.append([kind, labels[m], err] + ["-"] * (len(HEADERS) - 3))
                continue
            per_machine = statistics.median(max(r["peak"]) for r in rs)
            steady = statistics.median(max(r["steady"]) for r in rs)
            idle = statistics.median(max(r["idle"]) for r in rs)
            data = per_machine - idle
            if m == "shmstore":
                base, base_steady, base_data = per_machine, steady, data
            ratio = per_machine / base if base else float("nan")
            ratio_steady = steady / base_steady if base else float("nan")
            if m in ("broadcast", "scatter"):
                ratios.append(ratio)
                ratios_steady.append(ratio_steady)
                ratios_data.append(data / base_data if base_data > 0 else float("nan"))
                compared.append(f"{kind} vs {m}")
            rows.append(
                [
                    kind,
                    labels[m],
                    f"{per_machine / MiB:,.0f}",
                    f"{idle / MiB:,.0f}",
                    f"{data / MiB:,.0f}",
                    f"{ratio:.2f}x",
                    f"{steady / MiB:,.0f}",
                    f"{ratio_steady:.2f}x",
                    f"{statistics.median(r['first'] for r in rs):.2f}",
                    f"{statistics.median(r['wall'] for r in rs):.2f}",
                ]
            )
    arch = f"{args.records:,} COCO-like records; {args.array_mib} MiB float64 array"
    chunks_left = (
        ", ".join(
            f"{k} {r.get('chunks_left')}"
            for k in kinds
            for r in results.get((k, "shmstore"), [])
            if "error" not in r
        )
        or "-"
    )
    text = f"""# Dask across machines: memory per machine, time to the first task

`python benchmarks/bench_cluster.py` ({arch}; 2 simulated machines x {args.workers} Nanny
workers, 1 thread each; medians of {args.repeats} round-robin run(s)). See the script's
docstring for the method. Memory per machine: the peak over the run of the sum, over the
machine's Nannies and workers, of PSS without shared-memory pages, plus its segments in
/dev/shm (a store counts once per machine); "idle" is the same cluster before any data
(interpreter baselines); "data" = peak - idle. Times from the start of shipping
(share / scatter / Parallel) to the first task starting and to the last result.

{machine_md()}

{md_table(HEADERS, rows, left=2)}

Target: shmstore >= 3x less memory per machine than `client.scatter(broadcast=True)` (and a
copy scattered to every worker) at {args.workers} workers per machine. Peak: {_verdict(ratios)};
after the tasks (data held): {_verdict(ratios_steady)}; data only (peak - idle):
{_verdict(ratios_data)} (in order: {", ".join(compared)}; "vs shmstore" is against the chunks
row).

Notes: `shmstore.dask.share` releases each scattered chunk as soon as both machines have
fetched it (no `drop_chunks()` call; the chunks still held after the tasks, per run:
{chunks_left}).
joblib's Dask backend runs its {2 * args.workers} tasks where the scheduler puts them, so a
worker may run two and another none.
"""
    write_result(args.out, text)


if __name__ == "__main__":
    main()
