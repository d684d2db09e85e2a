"""A map-style dataset over a SharedList, read by DataLoader workers; one copy per machine.

    python examples/dataloader_ddp.py [--n 20000]

Two "local ranks" are started here with multiprocessing (torchrun would start them): local rank
0 builds the SharedList, the other attaches by name, the name being the only thing broadcast
(through a file here; through torch.distributed when it is initialised). Each rank then reads
the dataset with torch's DataLoader (2 workers) if torch is installed, else with a
multiprocessing pool shaped like one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile

import shmstore
import shmstore.torch as st


def make_records(n):
    for i in range(n):
        yield {"image_id": i, "file_name": f"{i:012d}.jpg", "boxes": [[1.0, 2.0, 3.0, 4.0]] * 3}


def to_sample(record):  # the transform: whatever the collate function wants
    return record["image_id"], len(record["boxes"])


def read_all(dataset, workers: int) -> int:
    try:
        from torch.utils.data import DataLoader
    except ImportError:
        DataLoader = None
    if DataLoader is not None:
        loader = DataLoader(dataset, batch_size=64, num_workers=workers, collate_fn=list)
        return sum(image_id for batch in loader for image_id, _ in batch)
    # the same shape without torch: the dataset goes to each worker pickled (by name)
    with mp.get_context("spawn").Pool(workers) as pool:
        samples = pool.map(dataset.__getitem__, range(len(dataset)), chunksize=1024)
    return sum(image_id for image_id, _ in samples)


def rank_main(local_rank: int, n: int, rendezvous: str, out, done) -> None:
    store = st.shared_per_machine(
        lambda: shmstore.SharedList(make_records(n)),  # runs on local rank 0 only
        local_rank=local_rank,
        broadcast=st.file_broadcast(rendezvous),  # or leave out: torch.distributed
    )
    dataset = st.SharedListDataset(store, transform=to_sample)
    total = read_all(dataset, workers=2)
    out.put((local_rank, store.name, len(dataset), total))
    if local_rank == 0:
        done.wait()  # rank 0 keeps its store until every rank is done
        store.unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "store-name")
        out, done = ctx.Queue(), ctx.Event()
        ranks = [
            ctx.Process(target=rank_main, args=(r, args.n, rendezvous, out, done)) for r in (0, 1)
        ]
        for p in ranks:
            p.start()
        reports = sorted(out.get(timeout=120) for _ in ranks)
        done.set()
        for p in ranks:
            p.join(120)
    names = {name for _, name, _, _ in reports}
    print(f"{len(ranks)} local ranks, one store: {names}")
    for rank, _, n, total in reports:
        print(f"rank {rank}: {n} samples, sum of image ids {total}")
    assert len(names) == 1 and all(t == args.n * (args.n - 1) // 2 for *_, t in reports)
    sys.exit(max(p.exitcode for p in ranks))


if __name__ == "__main__":
    main()
