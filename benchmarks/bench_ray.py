"""Ray across nodes: memory per node, load and field-touch times, two ways.

    python benchmarks/bench_ray.py [--records 200000] [--workers 8] [--nodes 2] [--touches 1000]

Needs ray (``make test-ray`` makes ``.venv-ray``; run this with ``.venv-ray/bin/python``). A
``ray.cluster_utils.Cluster`` of ``--nodes`` nodes on this host, each its own raylet and object
store; on each node ``--workers`` actors (one CPU each, pinned to the node). The driver (not
counted) ships the same COCO-like records two ways:

- ``ray.put(records)``: each actor ``ray.get``s them (Ray unpickles the list in every worker);
- ``shmstore.ray.share(SharedList(records))``: each actor receives the ``RayShared`` and
  reads Ray's copy of the archive in place (the segment it came from is closed first).

Per way, in fresh actors:

- **load**: in the actor, from receiving the reference to holding the data (``ray.get`` /
  unpickling the handle), median over actors;
- **touch**: then reading one field (``rec["annotations"][0]["area"]``) of ``--touches`` random
  records, median over actors; **load + touch** is what a short task pays;
- **node memory**: each node's raylet and its descendants (its workers, the object store's
  shared memory counted once through PSS), after every actor loaded and touched, and the same
  measure with the actors idle (the baseline); the target is shmstore's ≤ 1.05 x (archive +
  idle baseline);
- **copies**: the nodes whose object store holds the object (``get_object_locations``): one
  copy per node, fetched once (Ray's pull manager serves every worker of a node from one
  transfer);
- **handle**: bytes of a pickled ``RayShared``.

Results to stdout and ``benchmarks/results/ray.md`` (``--quick``: a small run that only checks
that everything works, written to ``ray-quick.md``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shmstore
from _common import MiB, descendants, machine_md, md_table, mib, smaps_rollup, write_result
from coco import make_records

RESULTS = Path(__file__).resolve().parent / "results"

try:
    import ray
    import shmstore.ray
    from ray.cluster_utils import Cluster
except ImportError:  # `make bench` runs every script with .venv, which has no ray
    ray = None


class Worker:
    def ping(self) -> int:
        """The worker's pid, with shmstore.ray imported (part of the idle baseline, as the
        records' unpickling machinery is part of Ray's)."""
        import os

        import shmstore.ray  # noqa: F401

        return os.getpid()

    def load(self, payload: bytes, touches: int, seed: int) -> dict[str, float]:
        """``payload``: the pickled ObjectRef of the records, or the pickled RayShared (as
        bytes, so that Ray does not resolve or unpickle it before the timer starts)."""
        t0 = time.perf_counter()
        item = ray.cloudpickle.loads(payload)
        self.data = ray.get(item) if isinstance(item, ray.ObjectRef) else item
        t1 = time.perf_counter()
        data = self.data
        rng = random.Random(seed)
        picks = [rng.randrange(len(data)) for _ in range(touches)]
        total = 0.0
        for i in picks:
            total += data[i]["annotations"][0]["area"]
        t2 = time.perf_counter()
        return {"load": t1 - t0, "touch": t2 - t1, "check": total}

    def drop(self) -> None:
        self.data = None


if ray is not None:
    Worker = ray.remote(num_cpus=1)(Worker)  # type: ignore[misc]


def node_memory(raylet_pid: int) -> int:
    """The node's raylet and its descendants: PSS (the object store's shared pages split among
    the processes that map them, so counted once in the sum)."""
    total = 0
    for pid in [raylet_pid, *descendants(raylet_pid)]:
        try:
            total += smaps_rollup(pid).get("Pss", 0)
        except OSError:
            continue
    return total


def raylet_pids(cluster: Any) -> list[int]:
    from ray._private import ray_constants

    nodes = [cluster.head_node, *cluster.worker_nodes]
    return [
        n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid  # type: ignore[attr-defined]
        for n in nodes
    ]


def run_way(
    name: str, payload: bytes, nodes: int, workers: int, touches: int, raylets: list[int]
) -> dict[str, Any]:
    actors = [
        Worker.options(resources={f"node{k}": 1}).remote()  # type: ignore[attr-defined]
        for k in range(nodes)
        for _ in range(workers)
    ]
    ray.get([a.ping.remote() for a in actors])
    time.sleep(1.0)  # let the new workers settle before the baseline is read
    idle = [node_memory(p) for p in raylets]
    out = ray.get([a.load.remote(payload, touches, i) for i, a in enumerate(actors)])
    loaded = [node_memory(p) for p in raylets]
    result = {
        "way": name,
        "load": statistics.median(o["load"] for o in out),
        "touch": statistics.median(o["touch"] for o in out),
        "load+touch": statistics.median(o["load"] + o["touch"] for o in out),
        "idle": idle,
        "loaded": loaded,
        "checks": [round(o["check"], 3) for o in out],
    }
    ray.get([a.drop.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=8, help="actors per node")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--touches", type=int, default=1000)
    ap.add_argument("--object-store-mib", type=int, default=0, help="per node (default: 4x data)")
    ap.add_argument("--quick", action="store_true", help="a small run: 5000 records, 2 workers")
    args = ap.parse_args()
    if ray is None:
        print("ray is not installed here: run this with .venv-ray/bin/python (make test-ray)")
        return
    if args.quick:
        args.records, args.workers, args.touches = 5000, 2, 200

    records = make_records(args.records)
    lst = shmstore.SharedList(records)
    archive = lst.nbytes
    store_mib = args.object_store_mib or max(256, 4 * archive // MiB + 128)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.workers,
            "resources": {"node0": args.workers},
            "object_store_memory": store_mib * MiB,
            "include_dashboard": False,
        },
    )
    for k in range(1, args.nodes):
        cluster.add_node(
            num_cpus=args.workers,
            resources={f"node{k}": args.workers},
            object_store_memory=store_mib * MiB,
        )
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    raylets = raylet_pids(cluster)
    try:
        put_ref = ray.put(records)
        del records
        shared = shmstore.ray.share(lst)
        lst.unlink()
        lst.close()
        handle = ray.cloudpickle.dumps(shared, protocol=5)
        handle_bytes = len(handle)
        put_payload = ray.cloudpickle.dumps(put_ref, protocol=5)
        rows = []
        way = (args.nodes, args.workers, args.touches, raylets)
        results = [
            run_way("ray.put(records)", put_payload, *way),
            run_way("shmstore.ray.share", handle, *way),
        ]
        locations = ray.experimental.get_object_locations([shared.ref])[shared.ref]
        for r in results:
            for k in range(args.nodes):
                rows.append(
                    [
                        r["way"],
                        f"node {k}",
                        f"{r['load'] * 1e3:,.1f}",
                        f"{r['touch'] * 1e3:,.2f}",
                        f"{r['load+touch'] * 1e3:,.1f}",
                        mib(r["idle"][k]),
                        mib(r["loaded"][k]),
                        mib(r["loaded"][k] - r["idle"][k]),
                    ]
                )
        put, shm = results
        if put["checks"] != shm["checks"]:
            raise SystemExit("the two ways read different records: a bug")
        ratio_mem = [shm["loaded"][k] / (archive + shm["idle"][k]) for k in range(args.nodes)]
        text = "\n\n".join(
            [
                "# Ray: one copy per node (benchmarks/bench_ray.py)",
                machine_md(),
                f"- **ray**: {ray.__version__}; {args.records:,} COCO-like records, archive "
                f"{mib(archive)} MiB; {args.nodes} nodes x {args.workers} actors; "
                f"{args.touches} field touches per actor",
                md_table(
                    [
                        "way",
                        "node",
                        "load ms",
                        "touch ms",
                        "load+touch ms",
                        "idle MiB",
                        "loaded MiB",
                        "added MiB",
                    ],
                    rows,
                    left=2,
                ),
                "\n".join(
                    [
                        "- node memory / (archive + idle baseline), shmstore: "
                        + ", ".join(f"{x:.3f}" for x in ratio_mem)
                        + " (target <= 1.05)",
                        f"- load: ray.put / shmstore = {put['load'] / shm['load']:.1f}x "
                        "(target >= 5x)",
                        f"- load + touch: ray.put / shmstore = "
                        f"{put['load+touch'] / shm['load+touch']:.1f}x (target >= 4x)",
                        f"- nodes holding Ray's copy of the archive: "
                        f"{len(locations['node_ids'])} of {args.nodes} (one copy per node)",
                        f"- a pickled RayShared: {handle_bytes} bytes (target < 512)",
                    ]
                ),
            ]
        )
        print(text)
        write_result(RESULTS / ("ray-quick.md" if args.quick else "ray.md"), text + "\n")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
