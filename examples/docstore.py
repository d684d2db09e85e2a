"""A doc_id -> text store shared by every rank of a training job (the IR-training seed).

    python examples/docstore.py [--docs 50000] [--ranks 4]

A corpus is written as a TSV (doc_id, text). Local rank 0 builds a SharedDict from it once and
saves the archive next to the corpus; the next run (or the next job) opens the saved archive
instead of rebuilding. The other ranks attach by name: the name is all that travels (through a
file here; through torch.distributed when it is initialised). Every rank then looks documents up
by id, as a training loop does when it assembles (query, positive, negatives) batches, and the
script prints the memory of the whole process tree: one copy of the corpus, however many ranks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import tempfile

import shmstore
import shmstore.memory
import shmstore.torch as st

try:  # progress of the build: a build consumes its iterable once, as it writes
    from tqdm import tqdm
except ImportError:  # tqdm is optional here

    def tqdm(iterable, **_):
        return iterable


def write_corpus(path: str, n: int) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(f"D{i:08d}\t{' '.join(rng.choices(words, k=150))}\n")


def read_corpus(path: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            doc_id, text = line.rstrip("\n").split("\t", 1)
            yield doc_id, text


def build(corpus: str, n: int) -> shmstore.SharedDict:
    """Local rank 0 only, first run only: a streaming build with a progress bar."""
    return shmstore.SharedDict(tqdm(read_corpus(corpus), total=n, desc="building", unit="doc"))


def rank_main(local_rank: int, corpus: str, n: int, rendezvous: str, out, done) -> None:
    docs = st.shared_per_machine(
        lambda: build(corpus, n),  # local rank 0 only, first run only
        archive=corpus + ".shm",  # later runs open the saved archive instead of rebuilding
        local_rank=local_rank,
        broadcast=st.file_broadcast(rendezvous),  # or leave out: torch.distributed
    )
    rng = random.Random(local_rank)
    ids = [f"D{rng.randrange(len(docs)):08d}" for _ in range(20_000)]
    chars = sum(len(docs[i]) for i in ids)  # each lookup returns a str built in this process
    assert docs.get("no such doc") is None and ids[0] in docs
    out.put((local_rank, docs.name, len(docs), chars, os.getpid()))
    done.wait()  # keep the store until the parent has measured every rank


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")  # what torchrun's processes amount to: nothing inherited
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.tsv")
        write_corpus(corpus, args.docs)
        raw = os.path.getsize(corpus)
        for run in ("first run (builds)", "second run (opens the saved archive)"):
            rendezvous = os.path.join(tmp, f"rendezvous-{run[:5]}")
            out, done = ctx.Queue(), ctx.Event()
            ranks = [
                ctx.Process(target=rank_main, args=(r, corpus, args.docs, rendezvous, out, done))
                for r in range(args.ranks)
            ]
            for p in ranks:
                p.start()
            reports = sorted(out.get(timeout=300) for _ in ranks)
            snap = shmstore.memory.snapshot([pid for *_, pid in reports], children=False)
            done.set()
            for p in ranks:
                p.join(120)
            assert all(p.exitcode == 0 for p in ranks)
            assert len({name for _, name, *_ in reports}) == 1, "one store per machine"
            total, mib = snap.total, 2**20
            print(
                f"{run}: {args.ranks} ranks read {sum(r[3] for r in reports):,} characters "
                f"from {reports[0][2]:,} docs (corpus {raw / mib:.1f} MiB, archive "
                f"{os.path.getsize(corpus + '.shm') / mib:.1f} MiB); all ranks together: "
                f"PSS {total.pss / mib:.1f} MiB, private (USS) {total.uss / mib:.1f} MiB"
            )


if __name__ == "__main__":
    main()
