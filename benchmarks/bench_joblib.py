"""The joblib slices scenario (docs/guides/joblib.md): one big array, 8 slices x 20 tasks,
2 workers.

joblib's default memmapping writes one file per slice *object* (keyed by id()), so every task
writes its slice again: 20x the array in /dev/shm. shmstore.joblib writes the array once.

For each approach a fresh process runs the workload (``--run``) while this driver samples the
bytes that new files in /dev/shm occupy (st_blocks, recursively, every 10 ms) and reads the
tasks' progress from the child's stdout. A run whose /dev/shm usage passes ``--cap`` is stopped
(SIGKILL to its process group, then its joblib folder is removed): that is joblib's
"No space left on device", caught before it takes the machine down.

    python benchmarks/bench_joblib.py                     # 2 GiB and 256 MiB, both backends
    python benchmarks/bench_joblib.py --sizes 512M --backends loky
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _common as C
from shmstore._util import parse_size

SHM = Path("/dev/shm")
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# The workload (child process)


def parallel_f(data_slice, i, j):
    # Touch one value per page, as a real task would read its slice.
    return float(data_slice[::512].sum())


def parallel_f_whole(data, i, j, step):
    # The blog's workaround: the whole array is passed, the task slices it.
    return parallel_f(data[i * step : (i + 1) * step], i, j)


def run_workload(approach: str, backend: str, nbytes: int, slices: int, tasks: int) -> None:
    import numpy as np
    from joblib import Parallel, delayed

    n = nbytes // 8
    data = np.random.default_rng(0).random(n)
    step = n // slices
    jobs = (
        (delayed(parallel_f)(data[i * step : (i + 1) * step], i, j))
        for i in range(slices)
        for j in range(tasks)
    )
    whole = (
        delayed(parallel_f_whole)(data, i, j, step) for i in range(slices) for j in range(tasks)
    )
    # progress as results arrive (the multiprocessing backend only returns a list)
    ret = "generator" if backend == "loky" else "list"
    print("ready", flush=True)
    t0 = time.perf_counter()
    if approach == "joblib":
        gen = Parallel(n_jobs=2, backend=backend, return_as=ret)(jobs)
    elif approach == "joblib-whole":  # the blog's workaround: pass the same object every time
        gen = Parallel(n_jobs=2, backend=backend, return_as=ret)(whole)
    else:
        import shmstore.joblib

        gen = shmstore.joblib.Parallel(n_jobs=2, backend=backend, return_as=ret)(jobs)
    done = 0
    for _ in gen:
        done += 1
        print(f"done {done}", flush=True)
    print(f"wall {time.perf_counter() - t0:.3f}", flush=True)


# ---------------------------------------------------------------------------------------------
# Driver


def _blocks(path: Path) -> int:
    total = 0
    try:
        if path.is_dir():
            for f in path.rglob("*"):
                try:
                    total += f.lstat().st_blocks * 512
                except OSError:
                    pass
        else:
            total += path.lstat().st_blocks * 512
    except OSError:
        pass
    return total


def _creator_pid(path: Path) -> int:
    """The creator pid in a shmstore segment's header (u32 LE at byte 96), or -1."""
    try:
        with open(path, "rb") as f:
            head = f.read(128)
        return int.from_bytes(head[96:100], "little") if len(head) >= 100 else -1
    except OSError:
        return -1


def shm_usage(before: set[str], pids: set[int], mine: dict[str, bool]) -> int:
    """Bytes that the run's new files in /dev/shm occupy (st_blocks, recursive): joblib's
    folders of the run's processes and shmstore segments they created. Files other processes
    on the machine make at the same time are left out."""
    total = 0
    for entry in SHM.iterdir():
        name = entry.name
        if name in before:
            continue
        if name not in mine:
            if name.startswith("joblib_memmapping_folder_"):
                mine[name] = int(name.split("_")[3]) in pids
            elif name.startswith("shmstore-") and ".part-" not in name:
                mine[name] = _creator_pid(entry) in pids
            elif name.startswith("shmstore-"):
                continue  # being written: decided once sealed
            else:
                mine[name] = False
        if mine[name]:
            total += _blocks(entry)
    return total


def run_one(approach: str, backend: str, nbytes: int, slices: int, tasks: int, cap: int) -> dict:
    before = {p.name for p in SHM.iterdir()}
    cmd = [sys.executable, __file__, "--run", approach, backend, str(nbytes), str(slices)]
    cmd.append(str(tasks))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    state = {"peak": 0, "killed": False, "done": 0, "wall": None, "t_start": None}
    stop = threading.Event()

    mine: dict[str, bool] = {}

    def sample() -> None:
        while not stop.is_set():
            pids = {proc.pid, *C.descendants(proc.pid)}
            used = shm_usage(before, pids, mine)
            state["peak"] = max(state["peak"], used)
            if used > cap and not state["killed"]:
                state["killed"] = True
                os.killpg(proc.pid, signal.SIGKILL)
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert proc.stdout is not None
    t_kill = None
    for line in proc.stdout:
        if line.startswith("ready"):
            state["t_start"] = time.perf_counter()
        elif line.startswith("done"):
            state["done"] = int(line.split()[1])
        elif line.startswith("wall"):
            state["wall"] = float(line.split()[1])
    proc.wait()
    if state["killed"] and state["t_start"] is not None:
        t_kill = time.perf_counter() - state["t_start"]
    stop.set()
    sampler.join()
    # A killed run leaves its files: remove what it created (joblib folders, segments).
    for entry in SHM.iterdir():
        if entry.name not in before and (
            entry.name.startswith(f"joblib_memmapping_folder_{proc.pid}_")
            or entry.name.startswith("loky-")
        ):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
    return {
        "approach": approach,
        "backend": backend,
        "nbytes": nbytes,
        "peak": state["peak"],
        "killed": state["killed"],
        "done": state["done"],
        "tasks": slices * tasks,
        "wall": state["wall"] if state["wall"] is not None else t_kill,
        "rc": proc.returncode,
    }


HEADERS = ["array", "backend", "approach", "peak /dev/shm", "x array", "wall s", "result"]
TITLES = {
    "joblib": "joblib default memmapping (slices)",
    "joblib-whole": "joblib, whole array passed (blog's workaround)",
    "shmstore": "shmstore.joblib.Parallel (slices)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--run", nargs=5, metavar=("APPROACH", "BACKEND", "NBYTES", "S", "T"))
    ap.add_argument(
        "--sizes",
        default="2G,256M",
        help="array sizes (comma-separated; 2G = 2 GiB, 2GB = 2*10**9)",
    )
    ap.add_argument("--backends", default="loky,multiprocessing")
    ap.add_argument("--approaches", default="joblib,joblib-whole,shmstore")
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=20, help="tasks per slice")
    ap.add_argument("--cap", default="8G", help="stop a run when its /dev/shm usage passes this")
    ap.add_argument("--out", default=str(C.RESULTS_DIR / "joblib.md"))
    args = ap.parse_args(argv)
    if args.run:
        a, b, n, s, t = args.run
        run_workload(a, b, int(n), int(s), int(t))
        return 0

    cap = parse_size(args.cap)
    free = shutil.disk_usage(SHM).free
    cap = min(cap, int(free * 0.8))
    rows = []
    results = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        for backend in args.backends.split(","):
            for approach in args.approaches.split(","):
                print(f"--- {approach} {backend} {size / GiB:.2f} GiB", flush=True)
                r = run_one(approach, backend, size, args.slices, args.tasks, cap)
                print(json.dumps(r), flush=True)
                results.append(r)
                ratio = r["peak"] / size
                done = f"{r['done']}/{r['tasks']}" if backend == "loky" else "?"
                status = (
                    f"stopped at the {args.cap} cap ({done} tasks done)"
                    if r["killed"]
                    else ("ok" if r["rc"] == 0 else f"exit {r['rc']}")
                )
                wall = "n/a" if r["wall"] is None else f"{r['wall']:.1f}"
                rows.append(
                    [
                        f"{size / GiB:.2f} GiB",
                        backend,
                        TITLES[approach],
                        f"{r['peak'] / GiB:.2f} GiB",
                        f"{ratio:.2f}x",
                        wall,
                        status,
                    ]
                )
    ok = all(
        r["peak"] <= 1.05 * r["nbytes"] and not r["killed"] and r["rc"] == 0
        for r in results
        if r["approach"] == "shmstore"
    )
    text = f"""# joblib: one big array, {args.slices} slices x {args.tasks} tasks, 2 workers

`python benchmarks/bench_joblib.py` (joblib's "No space left on device" with slices, scaled to this
machine). Each run is a fresh process: a float64 array is cut into {args.slices} slices and every
slice is passed to {args.tasks} tasks (`data[i*step:(i+1)*step]`, a new view object each time),
run by 2 workers; each task reads one value per page of its slice. The driver samples every
10 ms the bytes occupied by files created in /dev/shm during the run (`st_blocks`, recursively,
so joblib's folders count). A run that passes the cap ({args.cap}, or 80% of the free space of
/dev/shm) is killed: with joblib's default memmapping this is joblib's "No space left on
device", stopped before it takes the machine down. Wall time: from the array being ready to the
last result (for a stopped run, until it was stopped).

{C.machine_md()}

{C.md_table(HEADERS, rows, left=3)}

Target (shmstore): peak /dev/shm <= 1.05x the array size, every run complete:
**{C.verdict(ok)}**.

Why joblib writes so much: its reducer keys the temporary file by `id()` of the array object it
pickles (`joblib/_memmapping_reducer.py`, `_WeakArrayKeyMap`); each slice expression makes a new
view object, so each task dumps its slice again, and the files live until the call ends. The
blog's workaround (pass the whole array and slice in the task) needs the code to change;
`shmstore.joblib` traces every view to its base buffer and sends `(segment, offset, shape,
strides, dtype)`, so the code stays as it was.
"""
    C.write_result(Path(args.out), text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
