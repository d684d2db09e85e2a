"""shmstore.cluster and shmstore.dask: one copy per machine, past one machine.

The multi-machine test runs a Dask scheduler and 2 machines x 2 Nanny workers, each machine in
its own mount + network namespace (private /dev/shm, veth + bridge addresses that exist only
there, its own supervisor) when root and unshare allow; otherwise with SHMSTORE_NODE_ID and
separate segment directories, and says so in its output.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import select
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import shmstore
import shmstore.cluster as sc

sys.path.insert(0, os.path.dirname(__file__))
from _machines import machines, wait_for
from conftest import make_records

HERE = Path(__file__).parent


def _env(tmp_path: Path, name: str) -> dict[str, str]:
    d = tmp_path / f"shm-{name}"
    d.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ)
    env.update(
        SHMSTORE_DIR=str(d),
        SHMSTORE_NODE_ID=f"node-{name}-{tmp_path.name}",
        SHMSTORE_SUPERVISOR_NAME=f"shmstore-supervisor-test-{name}-{tmp_path.name}",
        SHMSTORE_FALLBACK="0",
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    return env


_RESOLVE = r"""
import json, pickle, sys, shmstore.cluster as sc
h = pickle.loads(open(sys.argv[1], "rb").read())
print(json.dumps({"len": len(h), "last": h[len(h) - 1].to_python(), "stats": sc.stats(),
                  "fetched": sc.info(h)["fetched"]}))
"""


def _resolve_in(env: dict[str, str], pkl: Path, n: int = 1) -> list[dict]:
    """Resolve the pickled NodeRef in n processes of one 'machine' at once."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESOLVE, str(pkl)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        out.append(json.loads(stdout))
    return out


def test_noderef_fetches_once_per_machine_from_a_shared_file(tmp_path, records):
    lst = shmstore.SharedList(records)
    ref = sc.share(lst, path=tmp_path / "shared.shm")
    pkl = tmp_path / "ref.pkl"
    pkl.write_bytes(pickle.dumps(ref))
    assert len(pkl.read_bytes()) < 1024
    env = _env(tmp_path, "b")
    # 3 processes of machine b at once, each holding the store until all resolved: exactly
    # one fetches (under the machine's lock), the others attach to its copy.
    code = _RESOLVE + "sys.stdin.read()\n"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(pkl)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        outs = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        assert {o["len"] for o in outs} == {len(records)}
        assert all(o["last"] == records[-1] for o in outs)
        assert sum(o["stats"]["fetched"] for o in outs) == 1
        assert sum(o["stats"]["attached"] for o in outs) == 2
        assert all(o["fetched"] for o in outs)  # the copy is marked as fetched
        segs = [n for n in os.listdir(env["SHMSTORE_DIR"]) if n.startswith("shmstore-")]
        assert segs == [lst.name]
        # The CLI shows the copy's digest and that it was fetched; the origin's, built here.
        cli = [sys.executable, "-m", "shmstore", "inspect", lst.name, "--json"]
        there = json.loads(subprocess.run(cli, env=env, capture_output=True, timeout=60).stdout)
        assert (there["digest"], there["copy"]) == (ref.digest, "fetched")
        here = json.loads(subprocess.run(cli, capture_output=True, timeout=60).stdout)
        assert (here["digest"], here["copy"]) == (ref.digest, "built here")
    finally:
        for p in procs:
            p.communicate(timeout=60)
    # Nobody uses the copy any more: the machine's supervisor removes it.
    wait_for(
        lambda: not [n for n in os.listdir(env["SHMSTORE_DIR"]) if n.startswith("shmstore-")],
        "machine b's copy to be removed",
    )
    assert sc.info(lst)["fetched"] is False
    sc.release()
    lst.unlink()


def test_a_small_put_in_an_arena_is_shared_as_a_segment_of_its_own(tmp_path):
    """A small ``put`` lives in a chunk of this process's arena, which no other machine can
    name: ``share()`` gives it a segment of its own (the same value) and shares that, so it
    resolves on another machine and on this one."""
    import numpy as np

    value = {"a": [1, 2.5, "x"], "arr": np.arange(6, dtype=np.int32)}
    r = shmstore.put(value)
    assert "@" in r.name  # a chunk of the arena (the default for small objects)
    ref = sc.share(r, path=tmp_path / "small.shm")
    assert "@" not in ref.name
    pkl = tmp_path / "ref.pkl"
    pkl.write_bytes(pickle.dumps(ref))
    code = r"""
import json, pickle, sys, shmstore.cluster as sc
h = pickle.loads(open(sys.argv[1], "rb").read())
v = h.get()
out = {"a": v["a"].to_python(), "arr": v["arr"].tolist(), "fetched": sc.stats()["fetched"]}
print(json.dumps(out))
"""
    env = _env(tmp_path, "b")
    out = subprocess.run(
        [sys.executable, "-c", code, str(pkl)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert (got["a"], got["arr"], got["fetched"]) == (value["a"], list(range(6)), 1)
    here = pickle.loads(pkl.read_bytes())  # this machine: the shared segment itself
    assert here.get()["a"].to_python() == value["a"]
    here.close()
    sc.release()
    r.close()


def test_noderef_on_its_own_machine_attaches(records):
    lst = shmstore.SharedList(records)
    ref = sc.share(lst)
    sc.release()
    h = pickle.loads(pickle.dumps(ref))
    assert h.name == lst.name and h[3] == records[3]
    assert sc.stats()["origin"] >= 1
    sc.release()
    lst.unlink()


def test_a_dask_scheduler_passes_a_noderef_on_without_resolving_it(records):
    """A Dask scheduler unpickles every task (arguments included) and pickles it again for
    the worker: there a NodeRef must stay a NodeRef (no attach or fetch on the scheduler's
    machine, and the worker gets the NodeRef, not a handle pickled by name)."""
    pytest.importorskip("distributed")
    import asyncio

    from distributed import Scheduler

    lst = shmstore.SharedList(records)
    ref = sc.share(lst)
    sc.release()
    blob = pickle.dumps(ref)

    async def in_scheduler() -> tuple:
        async with Scheduler(port=0, dashboard_address=":0", host="127.0.0.1"):
            before = sc.stats()
            seen = pickle.loads(blob)
            return seen, before, sc.stats(), pickle.dumps(seen)

    seen, before, after, again = asyncio.run(in_scheduler())
    assert not isinstance(seen, shmstore.StoreHandle)
    assert after == before  # nothing attached, fetched or held
    assert again == blob  # the worker receives the very NodeRef the client sent
    sc.release()
    lst.unlink()


def test_chunks_go_at_once_when_every_worker_is_on_this_machine(records, tmp_path):
    """A LocalCluster: every worker attaches to the original, so share() keeps no chunk, and
    tasks read the store."""
    pytest.importorskip("distributed")
    import shmstore.dask
    from distributed import Client, LocalCluster

    lst = shmstore.SharedList(records)
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        local_directory=str(tmp_path / "dask"),  # workers' scratch space: the test's directory
    ) as lc:
        with Client(lc) as client, shmstore.dask.share(client, lst, chunk=4096) as share:
            assert share.chunks_held == 0
            keys = client.get_dataset(share._chunks[0].dataset)["keys"]
            assert len(keys) > 1
            wait_for(
                lambda: not any(client.who_has().get(k) for k in keys),
                "the scheduler to release the chunks",
                60,
            )
            got = client.gather(client.map(lambda h, i: h[i], [lst] * 3, [0, 5, 9], pure=False))
            assert got == [records[0], records[5], records[9]]
    sc.release()
    lst.unlink()


class _Chunks:
    """A source that yields given bytes (picklable: a test double of an engine source)."""

    def __init__(self, blob: bytes, cut: int = 1000) -> None:
        self.blob = blob
        self.cut = cut

    def chunks(self):
        for i in range(0, len(self.blob), self.cut):
            yield self.blob[i : i + self.cut]


def _archive_bytes(h) -> bytes:
    return Path(shmstore._native._store_info(h)["path"]).read_bytes()


def test_a_source_with_other_bytes_is_refused_and_leaves_nothing(tmp_path, records):
    lst = shmstore.SharedList(records)
    blob = _archive_bytes(lst)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    good = sc.share(lst, sources=[_Chunks(bytes(bad)), _Chunks(blob)])
    only_bad = sc.share(lst, sources=[_Chunks(bytes(bad))])
    short = sc.share(lst, sources=[_Chunks(blob[:-8])])
    sc.release()
    env = _env(tmp_path, "c")
    code = r"""
import pickle, sys, shmstore, shmstore.cluster as sc
for f in sys.argv[1:]:
    try:
        h = pickle.loads(open(f, "rb").read())
        print("ok", h[0]["file_name"], sc.stats()["fetched"])
        sc.release(); h.close()
    except shmstore.StoreNotFoundError as e:
        print("refused", "digest" in str(e) or "bytes" in str(e))
"""
    files = []
    for i, r in enumerate((only_bad, short, good)):
        f = tmp_path / f"r{i}.pkl"
        f.write_bytes(pickle.dumps(r))
        files.append(str(f))
    out = subprocess.run(
        [sys.executable, "-c", code, *files], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "refused True"
    assert lines[1] == "refused True"
    assert lines[2] == f"ok {records[0]['file_name']} 1"  # the second source of `good`
    wait_for(lambda: not os.listdir(env["SHMSTORE_DIR"]), "no segment or .part left")
    lst.unlink()


def test_a_different_store_under_the_name_is_never_used(tmp_path, records):
    lst = shmstore.SharedList(records)
    ref = sc.share(lst, sources=[_Chunks(_archive_bytes(lst))])
    sc.release()
    env = _env(tmp_path, "d")
    # Another store with the same name already on machine d.
    code = (
        "import shmstore, sys, pickle\n"
        f"other = shmstore.SharedList([1, 2], name={lst.name!r})\n"
        "try:\n"
        "    pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "except shmstore.StoreExistsError as e:\n"
        "    print('refused', 'another store' in str(e))\n"
    )
    f = tmp_path / "r.pkl"
    f.write_bytes(pickle.dumps(ref))
    out = subprocess.run(
        [sys.executable, "-c", code, str(f)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "refused True", out.stderr
    lst.unlink()


def test_fetch_lock_refuses_a_directory_others_can_write(tmp_path, records):
    lst = shmstore.SharedList(records)
    ref = sc.share(lst, sources=[_Chunks(_archive_bytes(lst))])
    sc.release()
    env = _env(tmp_path, "e")
    os.chmod(env["SHMSTORE_DIR"], 0o777)
    f = tmp_path / "r.pkl"
    f.write_bytes(pickle.dumps(ref))
    code = (
        "import shmstore, sys, pickle\n"
        "try:\n"
        "    pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "except shmstore.StorePermissionError as e:\n"
        "    print('refused', 'refusing to fetch' in str(e))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(f)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "refused True", out.stderr
    lst.unlink()


def test_a_child_forked_during_a_fetch_does_not_keep_the_fetch_lock(tmp_path):
    """A process forked while this one held the machine's fetch lock has a copy of the lock's
    descriptor (fork copies every one, close-on-exec or not). Leaving the lock must release it
    all the same, or the machine's next fetch would wait for that child to exit."""
    d = tmp_path / "segments"
    d.mkdir(mode=0o700)
    r, w = os.pipe()
    with sc._FetchLock(d, timeout=30) as lock:
        assert lock.fd >= 0
        with warnings.catch_warnings():
            # Earlier tests may have left threads (Dask's); the child only reads and exits.
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
        if child == 0:  # holds its copy of the descriptor until the pipe closes
            os.close(w)
            os.read(r, 1)
            os._exit(0)
    os.close(r)
    try:
        # Taken at the first try: a held lock would be retried until the timeout, then
        # raise TimeoutError.
        with sc._FetchLock(d, timeout=30) as again:
            assert again.fd >= 0
    finally:
        os.close(w)
        assert os.waitpid(child, 0)[1] == 0


def test_map_mode_maps_the_shared_file_in_place(tmp_path, records):
    lst = shmstore.SharedList(records)
    ref = sc.share(lst, path=tmp_path / "s.shm", mode="map")
    sc.release()
    env = _env(tmp_path, "f")
    f = tmp_path / "r.pkl"
    f.write_bytes(pickle.dumps(ref))
    (out,) = _resolve_in(env, f)
    assert out["stats"]["mapped"] == 1 and out["stats"]["fetched"] == 0
    assert not [n for n in os.listdir(env["SHMSTORE_DIR"]) if n.startswith("shmstore-")]
    lst.unlink()


# ---------------------------------------------------------------------------------------------
# Dask across machines


def _log(logs: Path, name: str) -> Path:
    return logs / f"{name}.log"


def _tails(logs: Path) -> str:
    return "\n".join(
        f"--- {f.name}:\n" + f.read_text(errors="replace")[-3000:] for f in sorted(logs.iterdir())
    )


@pytest.mark.slow
def test_dask_two_machines_one_copy_each(tmp_path, capsys):
    pytest.importorskip("distributed")
    dask_bin = Path(sys.executable).parent / "dask"
    if not dask_bin.exists():
        pytest.skip("the dask command is not installed")
    shared = tmp_path / "shared"
    shared.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    with machines(["head", "a", "b"], tmp_path) as (ms, mode):
        with capsys.disabled():
            print(f"\n[cluster test] machines as: {mode}")
        head, a, b = ms
        sched_file = shared / "scheduler.json"
        head.popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", head.ip,
             "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
            stdout=subprocess.DEVNULL, log=_log(logs, "scheduler"),
        )  # fmt: skip
        wait_for(sched_file.exists, "the scheduler to start")
        for m in (a, b):
            for i in range(2):  # 2 Nannies per machine, each in its own process
                m.popen(
                    [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                     str(sched_file), "--host", m.ip, "--nworkers", "1", "--nthreads", "1",
                     "--no-dashboard", "--memory-limit", "0",
                     "--local-directory", str(tmp_path / f"dask-{m.name}{i}")],
                    stdout=subprocess.DEVNULL, log=_log(logs, f"worker-{m.name}{i}"),
                )  # fmt: skip
        out = tmp_path / "result.json"
        driver = head.popen(
            [sys.executable, str(HERE / "_cluster_driver.py"), str(sched_file), "4",
             str(shared), str(out)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, log=_log(logs, "driver"),
        )  # fmt: skip
        assert driver.stdout is not None
        wait = float(os.environ.get("CLUSTER_TEST_WAIT", 480))
        ready, _, _ = select.select([driver.stdout], [], [], wait)
        line = driver.stdout.readline() if ready else b""
        assert line.strip() == b"done", f"driver failed (exit {driver.poll()}): {_tails(logs)}"
        res = json.loads(out.read_text())
        nodes = {m.name: None for m in (a, b)}
        # "joblib": the same reads through joblib's Dask backend, one call per worker
        for tag in ("first", "joblib", "second"):
            reads = res[tag + "_reads"]
            assert len(reads) == 4
            want = res["expect_joblib" if tag == "joblib" else "expect"]
            assert {r["sha"] for r in reads} == {want}  # identical records everywhere
            assert len({r["node"] for r in reads}) == 2  # tasks ran on both machines
            by_node: dict[str, dict] = {}
            for seg in res[tag + "_segments"].values():
                by_node.setdefault(seg["node"], seg["files"])
                assert by_node[seg["node"]] == seg["files"]  # workers of a machine agree
            assert len(by_node) == 2  # two machines
            for files in by_node.values():
                # exactly one copy of each of the two stores per machine, marked fetched
                assert len(files) == 2, files
                assert {mode_ for _, mode_ in files.values()} == {0o500}
            nodes_seen = sorted(by_node)
            if tag == "first":
                first_files = by_node
            else:
                # joblib's calls and the Nanny restart attached: the same files (inodes) as
                # before, no refetch, no other copy
                assert by_node == first_files
            # exactly one fetch per machine per store: counted over every process there
            per_node: dict[str, int] = {}
            node_of = {w: s["node"] for w, s in res[tag + "_segments"].items()}
            seen_pids = set()
            for w, (pid, st) in res[tag + "_nanny_stats"].items():
                if pid in seen_pids:
                    continue
                seen_pids.add(pid)
                per_node[node_of.get(w, "?")] = per_node.get(node_of.get(w, "?"), 0) + st["fetched"]
            for w, st in res[tag + "_worker_stats"].items():
                per_node[node_of[w]] = per_node.get(node_of[w], 0) + st["fetched"]
            assert per_node == {n: 2 for n in nodes_seen}, per_node
        assert len(nodes) == 2
        # Once both machines fetched, the scheduler holds none of the chunks any more (each
        # was released as soon as both machines reported it), and the share holds none.
        assert res["chunks_left"]["keys"] > 1
        assert res["chunks_left"]["held"] == {}
        assert res["chunks_held"] == 0
        # A machine that fetches after the chunks are gone reads them from a machine that has
        # its copy: machine a fetched (the chunks stayed, b had not), they were dropped, then
        # machine b got identical records from a's workers.
        assert res["late_chunks"] > 1
        assert res["late_held_after_a"] == res["late_chunks"]
        assert res["late_left_before_b"]["held"] == {}
        assert res["late_a"]["node"] != res["late_b"]["node"]
        assert res["late_a"]["sha"] == res["late_b"]["sha"] == res["late_want"]
        assert res["late_a"]["fetched"] and res["late_b"]["fetched"]
        # SIGKILL everything (scheduler, driver, Nannies, workers) on every machine at once.
        for m in ms:
            m.kill_all()
        for m in ms:
            wait_for(lambda m=m: not m.segments(), f"machine {m.name}'s segments to go", 60)
        assert all(not m.segments() for m in ms)
    shutil.rmtree(shared, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# shared_per_machine across machines (a process group faked with multiprocessing primitives)


class _FakeGroup:
    """A Collective over a Manager dict and barriers: the shape of a torch process group."""

    def __init__(self, rank, world, store, barrier, leader_barrier):
        self.rank, self.world_size = rank, world
        self.store, self._bar, self.leader_barrier = store, barrier, leader_barrier
        self.n = self.nb = 0

    def all_gather_object(self, obj):
        self.n += 1
        self.store[(self.n, self.rank)] = obj
        self._bar.wait(60)
        out = [self.store[(self.n, r)] for r in range(self.world_size)]
        self._bar.wait(60)
        return out

    def leaders(self, ranks):
        self.ranks = ranks

    def broadcast_bytes(self, data, nbytes):
        self.nb += 1
        if data is not None:
            self.store[("b", self.nb)] = data
        self.leader_barrier.wait(60)
        out = self.store[("b", self.nb)]
        self.leader_barrier.wait(60)
        assert len(out) == nbytes
        return out

    def barrier(self):
        self._bar.wait(60)


def _group_rank(rank, world, node, base, store, barrier, leader_barrier, q):
    os.environ.pop("LOCAL_RANK", None)  # as under torch.multiprocessing.spawn
    os.environ["SHMSTORE_NODE_ID"] = f"node-{node}-{base.name}"
    os.environ["SHMSTORE_DIR"] = str(base / f"shm-{node}")
    os.environ["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-supervisor-test-{node}-{base.name}"
    import shmstore.cluster as sc
    import shmstore.torch as st

    st.GROUP_CHUNK = 5000  # several broadcasts
    g = _FakeGroup(rank, world, store, barrier, leader_barrier)
    built = []

    def build():
        built.append(rank)
        from conftest import make_records

        return make_records(200)

    h = st.shared_per_machine(build, group=g)
    q.put((rank, node, h.name, len(h), h[199]["file_name"], built, sc.stats(), sc.info(h)))
    g.all_gather_object(None)  # hold until every rank has read


def test_shared_per_machine_groups_ranks_by_machine_not_local_rank(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    world = 4
    nodes = ["a", "b", "a", "b"]  # not contiguous blocks, and no LOCAL_RANK anywhere
    for n in set(nodes):
        (tmp_path / f"shm-{n}").mkdir(mode=0o700)
    with ctx.Manager() as mgr:
        store = mgr.dict()
        barrier, leader_barrier, q = ctx.Barrier(world), ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(
                target=_group_rank,
                args=(r, world, nodes[r], tmp_path, store, barrier, leader_barrier, q),
            )
            for r in range(world)
        ]
        env_path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), env_path])
        try:
            for p in procs:
                p.start()
        finally:
            os.environ["PYTHONPATH"] = env_path
        reports = sorted(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * world
    assert len({name for _, _, name, *_ in reports}) == 1  # the same store everywhere
    assert all(n == 200 and last == "000000000199.jpg" for _, _, _, n, last, *_ in reports)
    assert [b for *_, b, _, _ in reports] == [[0], [], [], []]  # built once, on rank 0
    stats = {r: s for r, _, _, _, _, _, s, _ in reports}
    assert stats[1]["fetched"] == 1 and stats[3]["attached"] == 1  # b: one copy, via rank 1
    assert stats[2]["origin"] == 1  # a: rank 2 attached to rank 0's store
    fetched = {node: i["fetched"] for _, node, *_, i in reports}
    assert fetched == {"a": False, "b": True}


def _spawned_rank(rank, world, init_file, base, q):
    import torch.distributed as dist

    os.environ.pop("LOCAL_RANK", None)  # torch.multiprocessing.spawn sets none
    os.environ["SHMSTORE_DIR"] = str(base)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import shmstore.torch as st

        h = st.shared_per_machine(lambda: [{"i": i} for i in range(100)])
        q.put((rank, h.name, h[99]["i"]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_spawned_torch_ranks_without_local_rank_build_one_store(tmp_path):
    """Under torch.multiprocessing.spawn nothing sets LOCAL_RANK: every rank used to believe
    it was local rank 0 and build its own store. Ranks are grouped by machine now."""
    pytest.importorskip("torch", reason="torch is not installed (make test-torch installs it)")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    seg = tmp_path / "shm"
    seg.mkdir(mode=0o700)
    procs = [
        ctx.Process(target=_spawned_rank, args=(r, 2, tmp_path / "pg", seg, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    reports = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len({name for _, name, _ in reports}) == 1
    assert [v for *_, v in reports] == [99, 99]


# ---------------------------------------------------------------------------------------------
# torchrun --nnodes=2 across machines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["group", "torch_broadcast"])
def test_torchrun_two_machines_two_ranks_each(tmp_path, capsys, how):
    """torchrun --nnodes=2 --nproc-per-node=2 with gloo, one torchrun per machine: one build
    (global rank 0), one copy per machine (machine b's leader receives it by broadcasts in the
    process group), every rank reads identical records, SIGKILL of everything leaves nothing.

    "torch_broadcast": ``broadcast=torch_broadcast()`` passes names, not bytes: each machine's
    local rank 0 builds, the other rank attaches to its own machine's store. It used to tell
    machines apart by host name and boot id, which machines sharing a kernel (containers,
    these namespaces) have in common: a rank of b took a's store name and failed to attach."""
    pytest.importorskip("torch", reason="torch is not installed (make test-torch installs it)")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    n = 3000
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    with machines(["a", "b"], tmp_path) as (ms, mode):
        with capsys.disabled():
            print(f"\n[torchrun test] machines as: {mode}")
        a = ms[0]
        port = 29500 if a.ns else _free_port()  # a private network namespace has every port
        runs = []
        for i, m in enumerate(ms):
            m.env["GLOO_SOCKET_IFNAME"] = m.iface
            m.env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=2", f"--node-rank={i}", f"--master-addr={a.ip}",
                   f"--master-port={port}", "--max-restarts=0",
                   f"--log-dir={tmp_path / f'torchelastic-{m.name}'}",
                   str(HERE / "_torchrun_rank.py"), str(out), str(n), how]  # fmt: skip
            runs.append(
                m.popen(cmd, stdout=subprocess.DEVNULL, log=_log(logs, f"torchrun-{m.name}"))
            )

        def done() -> bool:
            failed = [r.args for r in runs if r.poll() is not None]
            assert not failed, f"torchrun exited early: {_tails(logs)}"
            return len(list(out.glob("rank*.json"))) == 4

        wait_for(done, "4 ranks to report", float(os.environ.get("CLUSTER_TEST_WAIT", 300)))
        reports = sorted(
            (json.loads(f.read_text()) for f in out.glob("rank*.json")), key=lambda r: r["rank"]
        )
        expect = hashlib.sha256()
        for rec in make_records(n):
            expect.update(repr(rec).encode())
        assert {r["sha"] for r in reports} == {expect.hexdigest()}  # identical records
        assert {r["len"] for r in reports} == {n}
        by_node: dict[str, list[dict]] = {}
        for r in reports:
            by_node.setdefault(r["node"], []).append(r)
        assert len(by_node) == 2  # ranks grouped by machine identity: two machines
        if how == "torch_broadcast":  # one build per machine (its local rank 0), no fetch
            assert [r["built"] for r in reports] == [[0], [], [2], []]
            for rs in by_node.values():
                assert len(rs) == 2 and rs[0]["name"] == rs[1]["name"]
                assert all(r["segments"] == [r["name"]] for r in rs), rs
                assert not any(r["stats"]["fetched"] for r in rs)
            for m in ms:
                m.kill_all()
            for m in ms:
                wait_for(lambda m=m: not m.segments(), f"machine {m.name}'s segments to go", 60)
            return
        assert len({r["name"] for r in reports}) == 1
        assert [r["built"] for r in reports] == [[0], [], [], []]  # one build, global rank 0
        for rs in by_node.values():
            assert len(rs) == 2
            # exactly one segment on each machine: the store (built on a, fetched on b)
            assert all(r["segments"] == [rs[0]["name"]] for r in rs), rs
            fetches = sum(r["stats"]["fetched"] for r in rs)
            if 0 in (r["rank"] for r in rs):
                assert fetches == 0 and not any(r["fetched"] for r in rs)
            else:
                assert fetches == 1  # one fetch on machine b, the other rank attached
                assert sum(r["stats"]["attached"] for r in rs) == 1
                assert all(r["fetched"] for r in rs)
        for m in ms:
            assert m.segments() == [reports[0]["name"]]
        # SIGKILL every process (both torchruns and their ranks) on every machine at once.
        for m in ms:
            m.kill_all()
        for m in ms:
            wait_for(lambda m=m: not m.segments(), f"machine {m.name}'s segments to go", 60)


def _subgroup_rank(rank, world, init_file, base, q):
    import torch.distributed as dist

    os.environ["SHMSTORE_NODE_ID"] = f"node-{rank}-{base.name}"  # ranks 1 and 2: two machines
    os.environ["SHMSTORE_DIR"] = str(base / f"shm-{rank}")
    os.environ["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-supervisor-test-{rank}-{base.name}"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = dist.new_group([1, 2])
        if rank == 0:
            q.put((rank, "not in the group"))
        else:
            import shmstore.torch as st

            try:
                st.shared_per_machine(lambda: [{"i": i} for i in range(10)], group=g)
                q.put((rank, "no error"))
            except ValueError as e:
                q.put((rank, "refused" if "every rank" in str(e) else str(e)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_torch_subgroup_across_machines_is_refused_not_hung(tmp_path):
    """shared_per_machine(group=<a group of ranks 1 and 2 of 3>) on two machines used to hang:
    the leaders' sub-group was made with new_group(), which needs every rank of the job, and
    with group ranks where global ranks are expected. It is refused on every rank now."""
    pytest.importorskip("torch", reason="torch is not installed (make test-torch installs it)")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    for r in range(3):
        (tmp_path / f"shm-{r}").mkdir(mode=0o700)
    procs = [
        ctx.Process(target=_subgroup_rank, args=(r, 3, tmp_path / "pg", tmp_path, q))
        for r in range(3)
    ]
    for p in procs:
        p.start()
    try:
        reports = sorted(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(30)
    assert reports == [(0, "not in the group"), (1, "refused"), (2, "refused")]
    assert [p.exitcode for p in procs] == [0, 0, 0]


def test_a_handle_unpickled_beside_a_scheduler_says_what_it_is(tmp_path: Path) -> None:
    """In a process hosting a Dask scheduler and no worker, an unpickled NodeRef is left
    unopened (the scheduler only passes tasks on): info() says so and how to open it, and
    resolve() opens it."""
    distributed = pytest.importorskip("distributed")
    with shmstore.SharedList([1, 2, 3]) as lst:
        ref = sc.share(lst, path=str(tmp_path / "s.shm"))
        blob = pickle.dumps(ref)
        with distributed.LocalCluster(
            n_workers=0, processes=False, dashboard_address=":0", scheduler_port=0
        ):
            h = pickle.loads(blob)
            assert "unpickled in a Dask scheduler's process" in repr(h)
            with pytest.raises(TypeError, match=r"runs a Dask scheduler .*resolve\(handle\)"):
                sc.info(h)
            opened = sc.resolve(h)
            assert list(opened) == [1, 2, 3]
            assert sc.info(opened)["digest"] == ref.digest
        sc.release()
    with pytest.raises(TypeError, match="takes a NodeRef"):
        sc.resolve("not a ref")


def test_one_host_over_two_segment_directories_is_warned_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process of the host that shared a store but with another SHMSTORE_DIR would make a
    second copy on that host: said once, with what to do."""
    import logging

    monkeypatch.delenv("SHMSTORE_NODE_ID", raising=False)
    with shmstore.SharedList([1, 2]) as lst:
        ref = sc.share(lst)
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        mine = os.environ["SHMSTORE_DIR"]
        monkeypatch.setenv("SHMSTORE_DIR", str(other))
        with caplog.at_level(logging.WARNING, logger="shmstore.cluster"):
            for _ in range(3):
                sc._warn_if_split_host(ref, sc.node_id())
        monkeypatch.setenv("SHMSTORE_DIR", mine)
        with caplog.at_level(logging.WARNING, logger="shmstore.cluster"):
            sc._warn_if_split_host(ref, sc.node_id())  # the same directory: nothing to say
        sc.release()
    warned = [r for r in caplog.records if "SHMSTORE_DIR" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert str(other) in warned[0].getMessage()
