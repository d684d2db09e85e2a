"""The client of the multi-machine Dask test (tests/test_cluster.py), run on the head machine.

argv: scheduler file, number of workers, shared directory, output JSON path. Shares a SharedList
(by Dask chunks) and an array (by a file in the shared directory), has every worker read them
through ``client.submit``, then again through joblib's Dask backend (``Parallel()`` under
``parallel_config(backend="dask")``, the user's joblib code unchanged), kills one worker that did
not fetch (its Nanny restarts it), reads again, writes what it saw as JSON, then waits for stdin
to close (the test SIGKILLs it with everything else).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
import shmstore
import shmstore.cluster as sc
import shmstore.dask
import shmstore.joblib
from distributed import Client
from joblib import Parallel, delayed, parallel_config

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_records


def read_all(lst: shmstore.SharedList, ref: shmstore.Ref, extra: np.ndarray | None = None) -> dict:
    """What a worker sees: a digest of every record and of the array (and of ``extra``, a
    plain array argument), and where it runs."""
    h = hashlib.sha256()
    for rec in lst:
        h.update(repr(rec.to_python()).encode())
    arr = ref.get()
    h.update(arr.tobytes())
    if extra is not None:
        h.update(extra.tobytes())
    return {"node": sc.node_id(), "pid": os.getpid(), "sha": h.hexdigest()}


def segment_state() -> dict:
    """This worker's machine: its node id and its segment directory's shmstore files."""
    d = shmstore._native._search_dirs()[0]
    files = {}
    for n in sorted(os.listdir(d)):
        if n.startswith("shmstore-"):
            st = os.stat(os.path.join(d, n))
            files[n] = [st.st_ino, st.st_mode & 0o777]
    return {"node": sc.node_id(), "files": files}


def pid_stats() -> list:
    """(pid, shmstore.cluster.stats()) of this process (two Nannies may share a process)."""
    return [os.getpid(), sc.stats()]


def chunk_keys(client: Client, share: shmstore.dask.DaskShare) -> list:
    return list(client.get_dataset(share._chunks[0].dataset)["keys"])


def chunks_left(client: Client, share: shmstore.dask.DaskShare) -> dict:
    """The workers holding each chunk of ``share`` per the scheduler, once none does (or
    after 120 s: releasing is asynchronous, it follows the fetchers' events)."""
    keys = chunk_keys(client, share)
    deadline = time.monotonic() + 120
    for _ in range(100_000):
        who = {k: v for k, v in client.who_has().items() if k in keys and v}
        if not who or time.monotonic() > deadline:
            return {"keys": len(keys), "held": who}
        time.sleep(0.05)
    raise AssertionError("unreachable")


def read_ref(state: tuple) -> dict:
    """Resolve a NodeRef inside the task (a worker thread, where it may fetch) and read it."""
    lst = sc.resolve(sc.NodeRef._from_state(state))
    h = hashlib.sha256()
    for rec in lst:
        h.update(repr(rec.to_python()).encode())
    return {"node": sc.node_id(), "sha": h.hexdigest(), "fetched": sc.info(lst)["fetched"]}


def late_fetch(client: Client) -> dict:
    """A store shared without plugins: machine a fetches it (from the chunks), the chunks are
    dropped, then machine b fetches it: from a worker of machine a."""
    lst = shmstore.SharedList(make_records(120))
    h = hashlib.sha256()
    for rec in lst:
        h.update(repr(rec.to_python()).encode())
    nodes = client.run(sc.node_id)
    first = sorted(nodes.values())[0]
    wa = next(w for w, n in sorted(nodes.items()) if n == first)
    wb = next(w for w, n in sorted(nodes.items()) if n != first)
    share = shmstore.dask.share(client, lst, chunk=8 << 10, nanny=False, pre_attach=False)
    state = share.ref._state()
    out: dict = {"late_want": h.hexdigest(), "late_chunks": len(chunk_keys(client, share))}
    out["late_a"] = client.submit(read_ref, state, workers=[wa], pure=False).result(timeout=300)
    out["late_held_after_a"] = share.chunks_held  # b has not fetched: all still held
    share.drop_chunks()
    out["late_left_before_b"] = chunks_left(client, share)
    out["late_b"] = client.submit(read_ref, state, workers=[wb], pure=False).result(timeout=300)
    share.close()
    return out


def main() -> None:
    sched_file, n_workers, shared, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    client = Client(scheduler_file=sched_file, timeout="120s")
    client.wait_for_workers(n_workers, timeout=300)
    records = make_records(300)
    lst = shmstore.SharedList(records)
    # 800 KB: a chunk of this process's arena (put's default up to 8 MiB), which share()
    # copies into a segment of its own; tasks are given the chunk's handle.
    arr = shmstore.put(np.arange(100_000, dtype=np.float64))
    assert "@" in arr.name
    big = np.linspace(0.0, 1.0, 300_000)  # 2.4 MB: above joblib's and shmstore.joblib's thresholds
    expect = read_all(lst, arr)["sha"]
    result: dict = {"expect": expect, "expect_joblib": read_all(lst, arr, big[::2])["sha"]}
    s1 = shmstore.dask.share(client, lst, chunk=16 << 10)
    # Both machines fetched while share() ran (its plugins): every chunk goes as soon as both
    # reported it. What the scheduler still has of them, once it settled (bounded wait):
    result["chunks_left"] = chunks_left(client, s1)
    result["chunks_held"] = s1.chunks_held
    s2 = shmstore.dask.share(client, arr, path=os.path.join(shared, "arr.shm"), scatter=False)
    result["digests"] = [s1.ref.digest, s2.ref.digest]

    def round_(tag: str, joblib: bool = False) -> None:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if joblib:
            # Code written for shmstore.joblib (sharing(), a plain array argument too) run on
            # joblib's Dask backend, sharing() outside and inside parallel_config in turn. One
            # call per worker (the backend passes `workers=` on to client.submit), so that
            # every worker of both machines runs one.
            reads = []
            for i, w in enumerate(workers):
                scopes = [shmstore.joblib.sharing(), parallel_config(backend="dask", workers=[w])]
                with contextlib.ExitStack() as stack:
                    for scope in scopes if i % 2 else scopes[::-1]:
                        stack.enter_context(scope)
                    reads += Parallel()(delayed(read_all)(lst, arr, big[::2]) for _ in "x")
            result[tag + "_reads"] = reads
        else:
            futs = [client.submit(read_all, lst, arr, workers=[w], pure=False) for w in workers]
            result[tag + "_reads"] = client.gather(futs)
        result[tag + "_segments"] = client.run(segment_state)
        result[tag + "_worker_stats"] = client.run(sc.stats)
        result[tag + "_nanny_stats"] = client.run(pid_stats, nanny=True)

    round_("first")
    print("first round done", file=sys.stderr, flush=True)
    round_("joblib", joblib=True)
    # Kill (SIGKILL) a worker that attached (did not fetch); its Nanny starts a new one.
    stats = result["first_worker_stats"]
    victim = next(w for w, s in sorted(stats.items()) if s["fetched"] == 0)
    pid = client.run(os.getpid, workers=[victim])[victim]
    result["killed"] = victim
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 300
    for _ in range(100_000):  # the victim leaves, then a new worker joins
        ws = client.scheduler_info(n_workers=-1)["workers"]
        if victim not in ws and len(ws) == n_workers:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the Nanny did not restart the worker")
        time.sleep(0.1)
    round_("second")
    print("second round done", file=sys.stderr, flush=True)
    result.update(late_fetch(client))
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    print("done", flush=True)
    sys.stdin.read()  # hold the stores until the test kills everything


if __name__ == "__main__":
    main()
