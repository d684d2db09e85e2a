"""Multi-node DDP: one build, one copy of the dataset per machine, every rank reads it in place.

    python examples/ddp_multinode.py --machines 2 --ranks 2 --n 20000

Spawns machines x ranks processes (as ``torch.multiprocessing.spawn`` would: no LOCAL_RANK)
in one process group: a real ``torch.distributed`` gloo group when torch is installed, else a
small stand-in with the same collectives (``shmstore.torch.Collective``). The "machines" are
simulated on this host: each has its own segment directory and ``SHMSTORE_NODE_ID``. On a real
cluster leave both out: each machine's /dev/shm is its own.

Global rank 0 builds the records; the lowest rank of every other machine receives the archive
through the process group; all other ranks attach. Prints, per machine, the segments its
directory holds (one) and whether the copy was built there or fetched.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
from typing import Any, Optional

import shmstore
import shmstore.cluster as sc
import shmstore.torch as st


def load_records(n: int) -> list[dict[str, Any]]:
    return [{"file_name": f"{i:012d}.jpg", "bbox": [i, i + 1.5, 10.0, 20.0]} for i in range(n)]


class PipeGroup:
    """A stand-in process group (when torch is absent): a Manager dict and two barriers."""

    def __init__(self, rank: int, world: int, shared: Any, everyone: Any, leaders: Any) -> None:
        self.rank, self.world_size = rank, world
        self._shared, self._everyone, self._leaders = shared, everyone, leaders
        self._n = self._nb = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._n += 1
        self._shared[("g", self._n, self.rank)] = obj
        self._everyone.wait(120)
        out = [self._shared[("g", self._n, r)] for r in range(self.world_size)]
        self._everyone.wait(120)
        return out

    def leaders(self, ranks: list[int]) -> None:
        pass  # the leaders' barrier was made for them up front

    def broadcast_bytes(self, data: Optional[bytes], nbytes: int) -> bytes:
        self._nb += 1
        if data is not None:
            self._shared[("b", self._nb)] = data
        self._leaders.wait(120)
        out: bytes = self._shared[("b", self._nb)]
        self._leaders.wait(120)
        return out

    def barrier(self) -> None:
        self._everyone.wait(120)


def rank_main(rank: int, world: int, machine: int, base: str, n: int, pg: Any, q: Any) -> None:
    # Simulating machines on one host; on a real cluster these two lines go.
    os.environ["SHMSTORE_DIR"] = os.path.join(base, f"machine{machine}")
    os.environ["SHMSTORE_NODE_ID"] = f"machine{machine}"
    os.environ["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-sv-{machine}-{os.path.basename(base)}"
    group: Any = None
    if pg is None:
        import torch.distributed as dist

        init = f"file://{os.path.join(base, 'pg')}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:
        group = PipeGroup(rank, world, *pg)
    store = st.shared_per_machine(lambda: load_records(n), group=group)
    total = sum(rec["bbox"][0] for rec in store)  # every rank reads every record in place
    info = sc.info(store)
    segs = sorted(f for f in os.listdir(os.environ["SHMSTORE_DIR"]) if f.startswith("shmstore-"))
    q.put((rank, machine, total, info["fetched"], segs))
    if group is None:
        import torch.distributed as dist

        dist.barrier()  # hold the store until every rank has read
        dist.destroy_process_group()
    else:
        group.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per machine")
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    world = args.machines * args.ranks
    try:
        import torch.distributed  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as base, ctx.Manager() as mgr:
        for m in range(args.machines):
            os.mkdir(os.path.join(base, f"machine{m}"), 0o700)
        pg = None if have_torch else (mgr.dict(), ctx.Barrier(world), ctx.Barrier(args.machines))
        # Ranks placed round-robin (rank r on machine r % machines): not contiguous blocks.
        procs = [
            ctx.Process(target=rank_main, args=(r, world, r % args.machines, base, args.n, pg, q))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        reports = sorted(q.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(120)
    expect = sum(range(args.n))
    print(f"process group: {'torch.distributed (gloo)' if have_torch else 'stand-in'}")
    for rank, machine, total, fetched, segs in reports:
        how = "fetched" if fetched else "built here"
        print(f"rank {rank} on machine {machine}: sum {total:.0f}, copy {how}, segments {segs}")
        assert total == expect and len(segs) == 1
    assert all(p.exitcode == 0 for p in procs)
    assert len({tuple(s) for *_, s in reports}) == 1  # the same store name everywhere
    print(f"one build, {args.machines} copies (one per machine) for {world} ranks")


if __name__ == "__main__":
    main()
    shmstore.cluster.release()
