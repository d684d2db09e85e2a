"""Dask across machines: one copy of a store per machine, read in place by every worker there.

    python examples/dask_cluster.py --machines 2 --workers 2 --n 20000

Starts a Dask scheduler and, per simulated machine, ``--workers`` Nanny workers (each machine
its own segment directory and ``SHMSTORE_NODE_ID``; on a real cluster each machine's /dev/shm
is its own and neither is needed), shares a SharedList with ``shmstore.dask.share``, and:

- runs tasks that take the handle itself as an argument (``client.map``);
- runs the same through joblib's Dask backend (``parallel_config(backend="dask")``);

then prints, per machine, the segments it holds and how many times it fetched the store.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import shmstore
import shmstore.cluster as sc
import shmstore.dask
from distributed import Client
from joblib import Parallel, delayed, parallel_config


def load_records(n: int) -> list[dict[str, Any]]:
    return [{"image_id": i, "bbox": [float(i), 2.0, 3.0, 4.0]} for i in range(n)]


def area_sum(lst: shmstore.SharedList, start: int, stop: int) -> float:
    """A task: the store arrives as a handle (it travelled as a NodeRef)."""
    return sum(r["bbox"][2] * r["bbox"][3] for r in lst[start:stop])


def where_am_i() -> tuple[str, list[str], dict[str, int]]:
    d = shmstore._native._search_dirs()[0]
    segs = sorted(f for f in os.listdir(d) if f.startswith("shmstore-"))
    return sc.node_id(), segs, sc.stats()


def start(cmd: list[str], env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> None:
    procs.append(
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="Nanny workers per machine")
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as base:
        sched = os.path.join(base, "scheduler.json")
        try:
            start(
                [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                 "--port", "0", "--no-dashboard", "--scheduler-file", sched],
                dict(os.environ), procs,
            )  # fmt: skip
            for m in range(args.machines):  # a simulated machine: its own /dev/shm stand-in
                env = dict(os.environ, SHMSTORE_NODE_ID=f"machine{m}")
                env["SHMSTORE_DIR"] = os.path.join(base, f"machine{m}")
                env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-sv-{m}-{os.path.basename(base)}"
                os.mkdir(env["SHMSTORE_DIR"], 0o700)
                for _ in range(args.workers):
                    start(
                        [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                         sched, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard"],
                        env, procs,
                    )  # fmt: skip
            deadline = time.monotonic() + 120
            while not os.path.exists(sched) and time.monotonic() < deadline:
                time.sleep(0.05)
            run(sched, args)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)


def run(sched: str, args: argparse.Namespace) -> None:
    n_workers = args.machines * args.workers
    with Client(scheduler_file=sched, timeout="60s") as client:
        client.wait_for_workers(n_workers, timeout=120)
        with shmstore.SharedList(load_records(args.n)) as lst, shmstore.dask.share(client, lst):
            step = max(1, args.n // 20)
            starts = list(range(0, args.n, step))
            futures = client.map(area_sum, [lst] * len(starts), starts, [s + step for s in starts])
            total = sum(client.gather(futures))
            with parallel_config(backend="dask"):  # joblib's Dask backend, unchanged code
                total_joblib = sum(Parallel()(delayed(area_sum)(lst, s, s + step) for s in starts))
            expect = 12.0 * args.n
            assert total == expect == total_joblib, (total, total_joblib, expect)
            machines: dict[str, tuple[list[str], int]] = {}
            for node, segs, stats in client.run(where_am_i).values():
                seen = machines.get(node, (segs, 0))
                machines[node] = (segs, seen[1] + stats["fetched"])
            nanny_fetches: dict[str, int] = {}  # the Nannies fetch (KeepOnNanny)
            nanny_pids: set[int] = set()
            for w, (pid, stats) in client.run(
                lambda: (os.getpid(), sc.stats()), nanny=True
            ).items():
                if pid not in nanny_pids:
                    nanny_pids.add(pid)
                    node = client.run(sc.node_id, workers=[w])[w]
                    nanny_fetches[node] = nanny_fetches.get(node, 0) + stats["fetched"]
            print(f"sum of areas {total:.0f} (tasks) = {total_joblib:.0f} (joblib's Dask backend)")
            for node, (segs, fetches) in sorted(machines.items()):
                fetched = fetches + nanny_fetches.get(node, 0)
                print(f"{node}: segments {segs}, fetched {fetched} time(s)")
                assert len(segs) == 1 and fetched == 1
    sc.release()


if __name__ == "__main__":
    main()
