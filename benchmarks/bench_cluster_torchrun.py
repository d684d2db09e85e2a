"""torchrun across machines: memory per machine, one shmstore copy vs each rank loading its own.

    .venv-torch/bin/python benchmarks/bench_cluster_torchrun.py [--records N] [--array-mib M]

(``make test-torch`` creates .venv-torch: torch from PyPI, run on CPU with gloo.)

Two simulated machines (each its own segment directory in /dev/shm, ``SHMSTORE_NODE_ID`` and
supervisor; the same code paths as separate hosts; tests/test_cluster.py runs the same torchrun
job across real network namespaces), one ``torchrun --nnodes=2 --nproc-per-node=--ranks``
per machine, gloo over 127.0.0.1. The data set is a file, as it would be on a shared file
system: the pickled COCO-like records, or the float64 array as ``.npy``. Two ways:

- ``shmstore.torch.shared_per_machine``: global rank 0 loads the file and builds the store,
  the other machine's lowest rank receives the archive through the process group (chunked gloo
  broadcasts), every other rank attaches;
- each rank loads its own copy (``pickle.load`` / ``np.load``), what a DDP script does by
  default.

Every rank then touches every record (sum of the annotation areas) or sums the array once.
Memory per machine: the sum, over its torchrun agent and ranks, of PSS without shared-memory
pages, plus the bytes of its segments (a store counts once per machine), sampled every 0.2 s;
the peak, the value once every rank has read (data held), and the same measure once every rank
has joined the process group and before any data ("idle": interpreters with torch imported).
Times from the go signal (after "idle") to the first rank starting to read and to the last rank
done.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MiB, machine_md, machine_memory, md_table, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "cluster-torchrun.md"


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(10_000_000):
        if path.exists():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:g} s")
        time.sleep(0.05)


def rank_main(kind: str, how: str, data: str, sync: str) -> None:
    """One rank (run by torchrun): wait for go, get the data, read it all, report, hold."""
    import shmstore  # both ways import it: the same interpreter baselines
    import shmstore.torch as st
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sync_dir = Path(sync)
    (sync_dir / f"joined{rank}").touch()
    _wait_file(sync_dir / "go", 600)
    if kind == "records":
        if how == "shmstore":

            def build() -> Any:
                with open(data, "rb") as f:
                    return shmstore.SharedList(pickle.load(f))

            obj: Any = st.shared_per_machine(build)
        else:
            with open(data, "rb") as f:
                obj = pickle.load(f)
        t0 = time.time()
        total = 0.0
        for rec in obj:
            for a in rec["annotations"]:
                total += a["area"]
    else:
        if how == "shmstore":
            obj = st.shared_per_machine(lambda: shmstore.put(np.load(data))).get()
        else:
            obj = np.load(data)
        t0 = time.time()
        total = float(np.sum(obj))
    report = {"rank": rank, "first": t0, "done": time.time(), "total": total}
    (sync_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    _wait_file(sync_dir / "stop", 900)  # hold the data while the driver measures
    dist.barrier()
    dist.destroy_process_group()


class Job:
    """Two torchrun agents (one per simulated machine) and their ranks."""

    def __init__(self, args: argparse.Namespace, kind: str, how: str, data: Path, base: Path):
        self.sync = base / "sync"
        self.sync.mkdir()
        self.dirs: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for m in range(2):
            d = Path(f"/dev/shm/shmstore-bench-torchrun-{os.getpid()}-m{m}")
            d.mkdir(mode=0o700)
            self.dirs.append(d)
            env = dict(os.environ, SHMSTORE_NODE_ID=f"bench-m{m}", SHMSTORE_DIR=str(d))
            env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-sv-bench-torchrun-{os.getpid()}-{m}"
            env["SHMSTORE_FALLBACK"] = "0"
            env["GLOO_SOCKET_IFNAME"] = "lo"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   f"--nproc-per-node={args.ranks}", f"--node-rank={m}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                   __file__, "--rank-of", kind, how, str(data), str(self.sync)]  # fmt: skip
            with open(base / f"log-m{m}.txt", "wb") as log:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))

    def memory(self) -> list[int]:
        return [machine_memory([p.pid], d) for p, d in zip(self.procs, self.dirs)]

    def wait_files(self, pattern: str, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(10_000_000):
            if len(list(self.sync.glob(pattern))) >= n:
                return
            failed = [p.args for p in self.procs if p.poll() is not None]
            if failed:
                raise RuntimeError(f"torchrun exited early (logs in {self.sync.parent})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g} s for {n} x {pattern}")
            time.sleep(0.05)

    def close(self) -> None:
        (self.sync / "stop").touch()
        for p in self.procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


class Sampler:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.peak = [0, 0]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        for _ in range(1_000_000):
            self.peak = [max(a, b) for a, b in zip(self.peak, self.job.memory())]
            if self._stop.wait(0.2):
                return

    def stop(self) -> list[int]:
        self._stop.set()
        self._t.join(30)
        return [max(a, b) for a, b in zip(self.peak, self.job.memory())]


def run(args: argparse.Namespace, kind: str, how: str, data: Path) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
    job = Job(args, kind, how, data, base)
    world = 2 * args.ranks
    try:
        job.wait_files("joined*", world, args.budget)
        idle = job.memory()
        sampler = Sampler(job)
        t0 = time.time()
        (job.sync / "go").touch()
        job.wait_files("rank*.json", world, args.budget)
        peak = sampler.stop()
        steady = job.memory()
        reports = [json.loads(f.read_text()) for f in job.sync.glob("rank*.json")]
    except Exception:
        print(f"torchrun {kind} {how} failed; logs kept in {base}", flush=True)
        job.close()
        raise
    job.close()
    shutil.rmtree(base, ignore_errors=True)
    assert len({round(r["total"], 3) for r in reports}) == 1, "ranks disagree"
    return {
        "idle": idle,
        "peak": peak,
        "steady": steady,
        "first": min(r["first"] for r in reports) - t0,
        "wall": max(r["done"] for r in reports) - t0,
    }


HEADERS = [
    "data",
    "how",
    "peak MiB / machine",
    "idle",
    "peak - idle",
    "vs shmstore",
    "after reads",
    "vs shmstore",
    "to 1st read s",
    "wall s",
]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        rank_main(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--array-mib", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per machine (2 machines)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=float, default=900, help="seconds per step")
    ap.add_argument("--kinds", default="records,array")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    try:
        import torch.distributed  # noqa: F401
    except ImportError:  # `make bench` runs every script with .venv, which has no torch
        print("torch is not installed here: run this with .venv-torch/bin/python (make test-torch)")
        return
    from coco import make_records

    tmp = Path(tempfile.mkdtemp(prefix="bench-torchrun-data-"))
    files = {}
    kinds = args.kinds.split(",")
    if "records" in kinds:
        files["records"] = tmp / "records.pkl"
        with open(files["records"], "wb") as f:
            pickle.dump(make_records(args.records), f, protocol=pickle.HIGHEST_PROTOCOL)
    if "array" in kinds:
        files["array"] = tmp / "array.npy"
        np.save(files["array"], np.random.default_rng(0).random(args.array_mib * MiB // 8))
    hows = ["shmstore", "own-copy"]
    labels = {
        "shmstore": "shmstore.torch.shared_per_machine",
        "own-copy": "each rank loads its own copy",
    }
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for kind in kinds:
            for rep in range(args.repeats):
                for how in hows:  # round-robin: both see the same load
                    r = run(args, kind, how, files[kind])
                    print(kind, how, rep, r, flush=True)
                    results.setdefault((kind, how), []).append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    verdicts = []
    for kind in kinds:
        base: dict[str, float] = {}
        for how in hows:
            rs = results[(kind, how)]
            peak = statistics.median(max(r["peak"]) for r in rs)
            steady = statistics.median(max(r["steady"]) for r in rs)
            idle = statistics.median(max(r["idle"]) for r in rs)
            if how == "shmstore":
                base = {"peak": peak, "steady": steady, "data": steady - idle}
            else:
                verdicts.append(
                    f"{kind}: {peak / base['peak']:.2f}x peak, {steady / base['steady']:.2f}x "
                    f"after reads, {(steady - idle) / base['data']:.2f}x data held"
                )
            rows.append(
                [
                    kind,
                    labels[how],
                    f"{peak / MiB:,.0f}",
                    f"{idle / MiB:,.0f}",
                    f"{(peak - idle) / MiB:,.0f}",
                    f"{peak / base['peak']:.2f}x",
                    f"{steady / MiB:,.0f}",
                    f"{steady / base['steady']:.2f}x",
                    f"{statistics.median(r['first'] for r in rs):.2f}",
                    f"{statistics.median(r['wall'] for r in rs):.2f}",
                ]
            )
    arch = f"{args.records:,} COCO-like records; {args.array_mib} MiB float64 array"
    text = f"""# torchrun across machines: memory per machine, one copy vs a copy per rank

`.venv-torch/bin/python benchmarks/bench_cluster_torchrun.py` ({arch}; 2 simulated machines x
{args.ranks} ranks, `torchrun --nnodes=2` per machine, gloo on CPU; medians of {args.repeats}
round-robin run(s)). See the script's docstring for the method. Memory per machine: the sum,
over its torchrun agent and ranks, of PSS without shared-memory pages, plus its segments (a
store counts once per machine); "idle" is the same job once every rank joined the process
group, before any data (interpreters with torch imported). Times from the go signal to the
first rank starting to read and to the last rank done.

{machine_md()}

{md_table(HEADERS, rows, left=2)}

Each rank loading its own copy, against shmstore: {"; ".join(verdicts)}.
"""
    write_result(args.out, text)


if __name__ == "__main__":
    main()
