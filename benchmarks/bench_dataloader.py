"""DataLoader-shaped harness: 2 "ranks" x 4 workers reading one data set: total PSS.

Each rank is a spawned process (as DDP starts them); each rank forks 4 loader workers (the
DataLoader default on Linux), and every worker reads its quarter of the records, touching the
same fields as the memory benchmark. Approaches:

- ``plain``: every rank builds its own Python list; the forked workers inherit it and copy it
  as they read (copy-on-read: refcounts and the gc write to every object they touch);
- ``shmstore``: local rank 0 builds one SharedList (``shmstore.torch.shared_per_machine``), rank
  1 attaches by name (the name travels through ``shmstore.torch.file_broadcast``); the
  workers read it through ``shmstore.torch.SharedListDataset``.

Measured with every process idle after reading: total PSS of the 2 ranks and their 8 workers,
minus the same tree with no data (``none``), from /proc/PID/smaps_rollup.

    python benchmarks/bench_dataloader.py [--n 200000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

import _common as C
from coco import iter_records, make_records

_RANK: dict = {}


def _loader_worker(data, w: int, nworkers: int, conn) -> None:
    n = len(data)
    acc = 0.0
    for i in range(w, n, nworkers):
        rec = data[i]
        acc += len(rec["file_name"]) + rec["height"]
        for a in rec["annotations"]:
            acc += a["bbox"][0] + a["category_id"]
    conn.send(acc)
    conn.recv()  # stay alive (and idle) until the rank is measured


def rank_task(spec: dict, command):
    op = command[0]
    if op == "start":
        _, rank = command
        approach = spec["approach"]
        if approach == "plain":
            data = make_records(spec["n"])
        elif approach == "shmstore":
            import shmstore.torch as st

            handle = st.shared_per_machine(
                lambda: C.load_shmstore().SharedList(iter_records(spec["n"])),
                local_rank=rank,
                broadcast=st.file_broadcast(spec["rendezvous"]),
            )
            _RANK["handle"] = handle
            data = st.SharedListDataset(handle)
        else:
            data = list(range(spec["n"]))[:0]
        C.settle()
        ctx = mp.get_context("fork")
        _RANK["workers"] = []
        for w in range(spec["workers"]):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_loader_worker, args=(data, w, spec["workers"], child))
            p.start()
            child.close()
            _RANK["workers"].append((p, parent))
        sums = [conn.recv() for _, conn in _RANK["workers"]]
        return [p.pid for p, _ in _RANK["workers"]], sum(sums)
    if op == "stop":
        for p, conn in _RANK.pop("workers"):
            conn.send(None)
            p.join()
        handle = _RANK.pop("handle", None)
        if handle is not None:
            if command[1] == 0:
                handle.unlink()
            handle.close()
        return True
    raise ValueError(command)


class RankPool(C.WorkerPool):
    """``_common.WorkerPool``, but the processes are not daemons: ranks fork workers."""

    def __init__(self, n: int, spec: dict) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=C.serve, args=(child, rank_task, spec), daemon=False)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [self._recv(conn)[1] for conn in self.conns]


def run(approach: str, n: int, ranks: int, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "approach": approach,
            "n": n,
            "workers": workers,
            "rendezvous": str(Path(tmp) / "name"),
        }
        with RankPool(ranks, spec) as pool:
            for conn, r in zip(pool.conns, range(ranks)):
                conn.send(("start", r))
            replies = [pool._recv(conn)[1] for conn in pool.conns]
            pids = list(pool.pids) + [pid for wp, _ in replies for pid in wp]
            mem = [C.smaps_rollup(pid) for pid in pids]
            for conn, r in zip(pool.conns, range(ranks)):
                conn.send(("stop", r))
            for conn in pool.conns:
                pool._recv(conn)
    return {
        "pss": sum(m["Pss"] for m in mem),
        "ranks_pss": sum(m["Pss"] for m in mem[:ranks]),
        "workers_pss": sum(m["Pss"] for m in mem[ranks:]),
        "uss": sum(m["uss"] for m in mem),
        "checksums": {round(s, 3) for _, s in replies},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default=str(C.RESULTS_DIR / "dataloader.md"))
    args = ap.parse_args(argv)
    shm = C.load_shmstore()
    with shm.SharedList(iter_records(args.n)) as probe:
        archive = probe.nbytes

    res = {a: run(a, args.n, args.ranks, args.workers) for a in ("none", "plain", "shmstore")}
    base = res["none"]["pss"]
    rows = []
    for a in ("plain", "shmstore"):
        r = res[a]
        rows.append(
            [
                a,
                C.mib(r["pss"] - base),
                C.mib(r["ranks_pss"] - res["none"]["ranks_pss"]),
                C.mib(r["workers_pss"] - res["none"]["workers_pss"]),
                f"{(r['pss'] - base) / archive:.2f}x",
            ]
        )
    plain, shmem = res["plain"]["pss"] - base, res["shmstore"]["pss"] - base
    same = res["plain"]["checksums"] == res["shmstore"]["checksums"]
    ok = shmem <= 1.1 * archive and same
    nproc = args.ranks * (1 + args.workers)
    text = f"""# DataLoader-shaped harness: {args.ranks} ranks x {args.workers} workers

`python benchmarks/bench_dataloader.py`. {args.n:,} COCO-like records
(`benchmarks/coco.py`); {args.ranks} spawned "ranks", each forking {args.workers} loader workers
that read a quarter of the records each (the fields of the memory benchmark). Total PSS of the
{nproc} processes while idle after reading, minus the same process tree holding no data
({C.mib(base)} MiB). shmstore archive: {C.mib(archive)} MiB.

{C.machine_md()}

{C.md_table(["approach", "total PSS MiB", "ranks MiB", "workers MiB", "x archive"], rows)}

- plain lists: each rank holds its own copy and its forked workers copy what they read
  (copy-on-read): **{plain / shmem:.1f}x** the memory of shmstore.
- shmstore: one copy per machine (rank 0 builds, rank 1 attaches by name, the workers read the
  same pages): {shmem / archive:.2f}x the archive. Target <= 1.1x: **{C.verdict(ok)}**
  (checksums agree: {same}).
"""
    C.write_result(Path(args.out), text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
