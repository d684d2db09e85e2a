"""One rank of the multi-machine torchrun test (tests/test_cluster.py), started by ``torchrun``.

argv: output directory, number of records, how ("group": the process group itself, or
"torch_broadcast": ``broadcast=shmstore.torch.torch_broadcast()``, each machine's local rank 0
builds). Joins the gloo process group torchrun set up, gets its machine's copy with
``shmstore.torch.shared_per_machine`` (small broadcast chunks, so the copy crosses the
machines in several broadcasts), reads every record, writes what it saw to
``<out>/rank<RANK>.json``, waits for every rank, then holds the store until the test kills
everything (or 600 s pass).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading

import shmstore
import shmstore.cluster as sc
import shmstore.torch as st
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_records


def main() -> None:
    out, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    st.GROUP_CHUNK = 256 << 10  # several broadcasts per copy
    built: list[int] = []

    def build() -> list[dict]:
        built.append(rank)
        return make_records(n)

    if how == "group":
        h = st.shared_per_machine(build)
    else:
        h = st.shared_per_machine(build, broadcast=st.torch_broadcast())
    digest = hashlib.sha256()
    for rec in h:  # every record, read in place
        digest.update(repr(rec.to_python()).encode())
    d = shmstore._native._search_dirs()[0]
    segs = sorted(f for f in os.listdir(d) if f.startswith("shmstore-"))
    report = {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": sc.node_id(),
        "name": h.name,
        "len": len(h),
        "sha": digest.hexdigest(),
        "built": built,
        "stats": sc.stats(),
        "fetched": sc.info(h)["fetched"],
        "segments": segs,
    }
    tmp = os.path.join(out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))
    dist.barrier()
    threading.Event().wait(600)  # hold the copy: the test SIGKILLs every process


if __name__ == "__main__":
    main()
