"""Document store (the IR-training seed): random lookups by doc_id from 1, 2, 4 and 8 processes.

Approaches, each in fresh spawn processes (one per "GPU rank"):

- ``dict``: every process loads the corpus file into a Python dict (the paper's "in-memory");
- ``indexed``: every process scans the file once for an offset dict, then seek + readline;
- ``lmdb``: py-lmdb, one environment on disk, a read transaction per process, get + decode;
- ``lz4``: our ir_datasets-style docstore: every document lz4-compressed into one file, a sorted
  doc_id array and an offsets array memmapped with numpy (``np.load(mmap_mode="r")``),
  ``searchsorted`` + ``os.pread`` + decompress + decode;
- ``shmstore``: a ``SharedDict`` in /dev/shm, attached by name;
- ``shmstore-file``: the same archive saved to a file on disk, ``SharedDict.open(path)``.

Memory: total PSS of the processes after their lookups, minus the PSS of as many processes that
ran the same lookup loop without a store (the interpreter baseline). For ``shmstore`` the whole
segment counts, touched or not: the total is sum(PSS - Pss_Shmem) - baseline + the segment size.
File-backed approaches (indexed, lmdb, lz4, shmstore-file) also use the page cache, shared by
all processes and evictable; it is listed apart.

    python benchmarks/bench_docstore.py                       # 250k docs (~250 MB), defaults
    python benchmarks/bench_docstore.py --docs 1000000        # the full 1M docs (~1 GB)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before numpy is imported (here and in the spawned workers, which inherit the environment):
# OpenBLAS's idle server threads otherwise spin on a core that the lookup loops need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _common as C
import numpy as np

APPROACHES = ("dict", "indexed", "lmdb", "lz4", "shmstore", "shmstore-file")
TITLES = {
    "none": "no store (baseline)",
    "dict": "Python dict loaded in each process",
    "indexed": "indexed file (offset dict + seek/readline)",
    "lmdb": "py-lmdb get + decode",
    "lz4": "lz4 docstore, numpy-memmapped index",
    "shmstore": "shmstore SharedDict in /dev/shm",
    "shmstore-file": "shmstore SharedDict, saved file open()",
}


READING = """

## Reading the numbers

- A lookup that returns a `str` must build it: every approach but `dict` ends in a copy (and
  UTF-8 check) of ~1 KB. The rest of a lookup in a store far larger than the CPU caches is
  waiting for memory: shmstore's lookup touches the hash-table slot, the key and the record;
  the slot carries hints (docs/format.md, "The dict table") so that the key and the record are
  fetched at the same time, after the slot, instead of one after the other. py-lmdb walks its
  B-tree (upper pages cached), then copies the value into a `bytes` and decodes that.
- The first lookups after loading pay for first touches: page faults for every approach that
  maps the data, and for shmstore its per-record check (checksum + structure) on first access.
  The run is one epoch so that this start-up cost weighs as it does in training; the "first"
  column shows the cold start alone.
- With more processes than cores per-process rates fall for every approach, and other work on
  the machine (see the load average) moves them: compare approaches within a group of rows.
  py-lmdb's per-process rate falls by less than its CPU share at 4 and 8 processes (at 2 its
  processes are not fully CPU-bound; we have not pinned down on what they wait), so its ratio
  to shmstore narrows there; shmstore's lookups are CPU- and memory-bound and halve as expected.
- The file-backed stores live in /dev/shm by default (`--dir`): this machine's host reclaims
  the page cache within seconds, which would send lmdb, the indexed file and the lz4 store to
  disk in their timed loops.
- shmstore's memory: the archive (hash index included) is a few percent larger than the raw
  text, and each process adds a few MiB of its own.
"""


def doc_id(i: int) -> str:
    return f"D{i:08d}"


# ---------------------------------------------------------------------------------------------
# Corpus and stores (built once by the driver)


def write_corpus(path: Path, n: int, words_per_doc: int) -> int:
    """A TSV ``doc_id\\ttext\\n``; Zipf-like words so compression behaves like real text."""
    rng = random.Random(0)
    vocab = [f"w{i}" + "abcdefgh"[: i % 7] for i in range(20_000)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    cum = list(np.cumsum(weights))
    raw = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choices(vocab, cum_weights=cum, k=words_per_doc))
            did = doc_id(i)
            f.write(f"{did}\t{text}\n")
            raw += len(did) + len(text)
    return raw


def iter_corpus(path: Path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            did, text = line.rstrip("\n").split("\t", 1)
            yield did, text


def build_lmdb(corpus: Path, where: Path) -> None:
    import lmdb

    env = lmdb.open(str(where), map_size=1 << 40, writemap=False, sync=False)
    with env.begin(write=True) as txn:
        for did, text in iter_corpus(corpus):
            txn.put(did.encode(), text.encode())
    env.sync()
    env.close()


def build_lz4(corpus: Path, where: Path) -> None:
    import lz4.block

    where.mkdir(parents=True, exist_ok=True)
    ids, offsets = [], [0]
    with open(where / "docs.lz4", "wb") as f:
        for did, text in iter_corpus(corpus):  # already sorted by doc_id
            blob = lz4.block.compress(text.encode(), store_size=True)
            f.write(blob)
            ids.append(did.encode())
            offsets.append(offsets[-1] + len(blob))
    np.save(where / "ids.npy", np.array(ids))
    np.save(where / "offsets.npy", np.array(offsets, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# Worker side

_STATE: dict = {}


class IndexedFile:
    def __init__(self, path: str) -> None:
        self.f = open(path, "rb")
        self.index: dict[str, int] = {}
        pos = 0
        for line in self.f:
            self.index[line[: line.index(b"\t")].decode()] = pos
            pos += len(line)

    def __getitem__(self, did: str) -> str:
        self.f.seek(self.index[did])
        return self.f.readline().decode().rstrip("\n").split("\t", 1)[1]


class LmdbStore:
    def __init__(self, path: str) -> None:
        import lmdb

        self.env = lmdb.open(path, readonly=True, lock=False, readahead=False)
        self.txn = self.env.begin(buffers=False)

    def __getitem__(self, did: str) -> str:
        return self.txn.get(did.encode()).decode()


class Lz4Store:
    def __init__(self, path: str) -> None:
        import lz4.block

        self.decompress = lz4.block.decompress
        self.ids = np.load(os.path.join(path, "ids.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(path, "offsets.npy"), mmap_mode="r")
        self.fd = os.open(os.path.join(path, "docs.lz4"), os.O_RDONLY)

    def __getitem__(self, did: str) -> str:
        key = did.encode()
        i = int(np.searchsorted(self.ids, key))
        if i >= len(self.ids) or self.ids[i] != key:
            raise KeyError(did)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.decompress(os.pread(self.fd, b - a, a)).decode()


class Empty:
    """The baseline's store: same lookup loop and keys, no data."""

    def __getitem__(self, did: str) -> str:
        return ""


def load(approach: str, spec: dict):
    if approach == "none":
        return Empty()
    if approach == "dict":
        with open(spec["corpus"], encoding="utf-8") as f:
            return dict(line.rstrip("\n").split("\t", 1) for line in f)
    if approach == "indexed":
        return IndexedFile(spec["corpus"])
    if approach == "lmdb":
        return LmdbStore(spec["lmdb"])
    if approach == "lz4":
        return Lz4Store(spec["lz4"])
    shm = C.load_shmstore()
    if approach == "shmstore":
        return shm.SharedDict.attach(spec["name"])
    return shm.SharedDict.open(spec["file"])


def task(spec: dict, command):
    op = command[0]
    if op == "load":
        _STATE["store"] = load(spec["approach"], spec)
        C.settle()
        return True
    if op == "lookup":
        _, seed, m, first, n_docs = command
        store = _STATE["store"]
        keys = [doc_id(int(i)) for i in np.random.default_rng(seed).integers(0, n_docs, m)]
        total = 0
        t0 = time.perf_counter()
        for k in keys[:first]:
            total += len(store[k])
        t1 = time.perf_counter()
        for k in keys[first:]:
            total += len(store[k])
        t2 = time.perf_counter()
        del keys
        C.settle()  # measure what the store keeps, not the lookup loop's garbage
        return t2 - t0, t1 - t0, total
    raise ValueError(command)


# ---------------------------------------------------------------------------------------------
# Driver


# The on-disk files each approach reads (the page cache is warmed before each measurement,
# so that no approach pays for disk reads in its timed loop).
FILES = {
    "indexed": ("corpus",),
    "dict": ("corpus",),
    "lmdb": ("lmdb",),
    "lz4": ("lz4",),
    "shmstore-file": ("file",),
}


def warm_page_cache(approach: str, spec: dict) -> None:
    for key in FILES.get(approach, ()):
        p = Path(spec[key])
        for f in [p] if p.is_file() else sorted(p.iterdir()):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def measure(approach: str, spec: dict, procs: int, lookups: int, first: int, n_docs: int) -> dict:
    spec = dict(spec, approach=approach)
    warm_page_cache(approach, spec)
    with C.WorkerPool("spawn", procs, task, spec) as pool:
        t0 = time.perf_counter()
        pool.broadcast(("load",))
        load_s = time.perf_counter() - t0
        results = pool.broadcast(("lookup", 1234, lookups, first, n_docs))
        mem = [C.smaps_rollup(pid) for pid in pool.pids]
    rates = [lookups / dt for dt, _, _ in results]
    firsts = [first / dt1 for _, dt1, _ in results]
    # the lookups after the first ones (none when first == lookups)
    rests = [(lookups - first) / (dt - dt1) for dt, dt1, _ in results if lookups > first]
    return {
        "load_s": load_s,
        "rate": sum(rates) / len(rates),
        "rate_first": sum(firsts) / len(firsts),
        "rate_rest": sum(rests) / len(rests) if rests else float("nan"),
        "checksums": {c for _, _, c in results},
        "pss": sum(m["Pss"] for m in mem),
        "pss_shmem": sum(m.get("Pss_Shmem", 0) for m in mem),
    }


def median_run(runs: list[dict]) -> dict:
    """Per-field medians of repeated measurements (checksums: all of them)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "checksums"}
    out["checksums"] = set().union(*(r["checksums"] for r in runs))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--docs", type=int, default=250_000)
    ap.add_argument("--words", type=int, default=150, help="words per document (~1 KB)")
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument(
        "--lookups",
        type=int,
        default=0,
        help="random lookups per process (default: one epoch, as many as documents)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="measure each (approach, processes) this many times, round-robin; report medians",
    )
    ap.add_argument(
        "--first",
        type=int,
        default=100_000,
        help="the first lookups after attaching, also reported apart (cold start)",
    )
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument(
        "--dir",
        default="/dev/shm",
        help="where the file-backed stores go (default /dev/shm: in RAM, so that no approach "
        "reads the disk in its timed loop)",
    )
    ap.add_argument("--out", default=str(C.RESULTS_DIR / "docstore.md"))
    args = ap.parse_args(argv)
    args.lookups = args.lookups or args.docs
    args.first = max(1, min(args.first, args.lookups))
    shm = C.load_shmstore()
    approaches = args.approaches.split(",")
    procs_list = [int(p) for p in args.procs.split(",")]

    work = Path(tempfile.mkdtemp(prefix="bench-docstore-", dir=args.dir))
    handle = None
    try:
        t0 = time.perf_counter()
        corpus = work / "corpus.tsv"
        raw = write_corpus(corpus, args.docs, args.words)
        print(f"corpus: {args.docs} docs, {C.mib(raw)} MiB in {time.perf_counter() - t0:.1f} s")
        spec: dict = {"corpus": str(corpus)}
        builds = {}
        if "lmdb" in approaches:
            t0 = time.perf_counter()
            build_lmdb(corpus, work / "lmdb")
            builds["lmdb"] = time.perf_counter() - t0
            spec["lmdb"] = str(work / "lmdb")
        if "lz4" in approaches:
            t0 = time.perf_counter()
            build_lz4(corpus, work / "lz4")
            builds["lz4"] = time.perf_counter() - t0
            spec["lz4"] = str(work / "lz4")
        if {"shmstore", "shmstore-file"} & set(approaches):
            t0 = time.perf_counter()
            handle = shm.SharedDict(iter_corpus(corpus))
            builds["shmstore"] = time.perf_counter() - t0
            spec["name"] = handle.name
            spec["file"] = str(work / "docs.shm")
            handle.save(spec["file"])
        sizes = {
            "dict": 0,
            "indexed": corpus.stat().st_size,
            "lmdb": sum(f.stat().st_size for f in (work / "lmdb").iterdir())
            if "lmdb" in spec
            else 0,
            "lz4": sum(f.stat().st_size for f in (work / "lz4").iterdir()) if "lz4" in spec else 0,
            "shmstore": handle.nbytes if handle else 0,
            "shmstore-file": handle.nbytes if handle else 0,
        }
        print("built:", {k: f"{v:.1f} s" for k, v in builds.items()}, flush=True)

        base = {
            p: measure("none", spec, p, args.lookups, args.first, args.docs) for p in procs_list
        }
        rows, res = [], {}
        for p in procs_list:
            runs: dict[str, list[dict]] = {a: [] for a in approaches}
            for _ in range(args.repeat):  # round-robin, so that drifting load hits all alike
                for a in approaches:
                    runs[a].append(measure(a, spec, p, args.lookups, args.first, args.docs))
            for a in approaches:
                r = median_run(runs[a])
                res[(a, p)] = r
                mem = r["pss"] - base[p]["pss"]
                if a == "shmstore":
                    mem = mem - r["pss_shmem"] + sizes["shmstore"]
                r["mem"] = mem
                cache = sizes[a] if a in ("indexed", "lmdb", "lz4", "shmstore-file") else 0
                rows.append(
                    [
                        p,
                        TITLES[a],
                        f"{r['rate']:,.0f}",
                        f"{r['rate_first']:,.0f}",
                        f"{r['rate'] * p:,.0f}",
                        C.mib(mem),
                        f"{mem / raw:.2f}x",
                        C.mib(cache) if cache else "-",
                        f"{r['load_s']:.1f}",
                    ]
                )
                print(
                    p,
                    a,
                    f"{r['rate']:,.0f}/s per process (first {args.first:,}: "
                    f"{r['rate_first']:,.0f}/s)",
                    C.mib(mem),
                    "MiB",
                    flush=True,
                )
        # all approaches read the same documents
        sums = {(a, p): r["checksums"] for (a, p), r in res.items()}
        consistent = all(v == sums[(approaches[0], p)] for (a, p), v in sums.items())
    finally:
        if handle is not None:
            handle.unlink()
            handle.close()
        shutil.rmtree(work, ignore_errors=True)

    pmax = max(procs_list)
    checks = []
    if ("shmstore", pmax) in res:
        m = res[("shmstore", pmax)]["mem"]
        checks.append(
            (
                f"shmstore total memory with {pmax} processes <= 1.1x one copy of the corpus "
                f"(raw text {C.mib(raw)} MiB): {C.mib(m)} MiB = {m / raw:.2f}x",
                m <= 1.1 * raw,
            )
        )
        checks.append(
            (
                f"shmstore total memory with {pmax} processes <= 1.1x one copy of the corpus as "
                f"stored (the archive, {C.mib(sizes['shmstore'])} MiB): "
                f"{m / sizes['shmstore']:.2f}x",
                m <= 1.1 * sizes["shmstore"],
            )
        )
    cold = []
    for p in procs_list:
        if ("shmstore", p) in res and ("lmdb", p) in res:
            s, lm = res[("shmstore", p)]["rate"], res[("lmdb", p)]["rate"]
            checks.append(
                (
                    f"{p} proc: shmstore lookups/s per process >= 2x py-lmdb: "
                    f"{s:,.0f} vs {lm:,.0f} = {s / lm:.2f}x",
                    s >= 2 * lm,
                )
            )
            s1, lm1 = res[("shmstore", p)]["rate_first"], res[("lmdb", p)]["rate_first"]
            cold.append(
                f"- {p} proc: {s1:,.0f} vs {lm1:,.0f} = **{s1 / lm1:.2f}x** py-lmdb "
                f"({s1 / s:.0%} of shmstore's whole-run rate, {lm1 / lm:.0%} of py-lmdb's)"
            )
        if ("shmstore", p) in res and ("indexed", p) in res:
            s, ix = res[("shmstore", p)]["rate"], res[("indexed", p)]["rate"]
            checks.append(
                (
                    f"{p} proc: shmstore lookups/s per process >= indexed file: "
                    f"{s:,.0f} vs {ix:,.0f} = {s / ix:.2f}x",
                    s >= ix,
                )
            )
    checks.append(("every approach read the same documents (checksums)", consistent))
    scaled = (
        ""
        if args.docs >= 1_000_000
        else f"\n**Scaled down**: {args.docs:,} documents instead of the full 1M, to keep the "
        "run within ~10 minutes on 2 cores with 8 processes each loading a dict; "
        "`--docs 1000000` runs the full size.\n"
    )
    headers = [
        "procs",
        "approach",
        "lookups/s per proc",
        f"first {args.first // 1000}k",
        "lookups/s total",
        "memory MiB",
        "x corpus",
        "page cache MiB",
        "load s",
    ]
    store_sizes = ", ".join(
        f"{k} {C.mib(sizes[k])} MiB" for k in ("shmstore", "lmdb", "lz4", "indexed") if sizes[k]
    )
    build_times = ", ".join(f"{k} {v:.1f} s" for k, v in builds.items())
    epoch = " (one epoch: as many as there are documents)" if args.lookups == args.docs else ""
    text = (
        f"""# Document store: random lookups by doc_id from 1-{pmax} processes

`python benchmarks/bench_docstore.py` (retrieval training: every rank looks up passages by
id). Synthetic corpus:
{args.docs:,} documents of {args.words} Zipf-distributed words, **{C.mib(raw)} MiB of text**
(doc ids + texts, as UTF-8). Every process (spawned, like DDP ranks) loads its store, then does
{args.lookups:,} lookups of random doc_ids (get + decode to `str`){epoch}; all processes of a row
run at once on {os.cpu_count()} cores, so per-process rates fall as processes are added. Each
row is the median of {args.repeat} runs, taken round-robin over the approaches.
{scaled}
- **lookups/s per proc**: over the whole run; **first {args.first // 1000}k**: over the first
  {args.first:,} lookups after the store is loaded, which pay for first touches (page faults,
  and shmstore's per-record check on first access) more than later ones.
- **memory**: total PSS of the processes after their lookups minus that of as many processes
  that ran the same loop over the same keys without a store (same modules imported). For
  shmstore in /dev/shm the whole segment is counted,
  touched or not (sum(PSS - Pss_Shmem) - baseline + segment size).
- **page cache**: the on-disk files the approach reads through the page cache (shared between
  processes and evictable under memory pressure; not in PSS unless mapped and touched).
- **x corpus**: memory / raw text size. Store sizes: {store_sizes}. Build times: {build_times}.

{C.machine_md()}

{C.md_table(headers, rows, left=2)}

## Targets

"""
        + "\n".join(f"- {C.verdict(ok)}: {what}" for what, ok in checks)
        + (
            f"\n\nNot a target, for the record: shmstore vs py-lmdb over the first "
            f"{args.first:,} lookups after loading (cold start):\n\n" + "\n".join(cold)
            if cold
            else ""
        )
        + READING
    )
    C.write_result(Path(args.out), text)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
