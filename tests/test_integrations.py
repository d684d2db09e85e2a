"""Integrations: multiprocessing Queue, joblib (loky,
multiprocessing, threading), torch-style datasets and the DDP helper, XGBoost.

Worker functions live at module level: spawn and forkserver children import this module.
"""

from __future__ import annotations

import gc
import glob
import io
import multiprocessing as mp
import os
import pickle
import threading
import weakref

import numpy as np
import pytest
import shmstore
from conftest import segment_dir

joblib = pytest.importorskip("joblib", reason="joblib is in requirements-dev.txt")
import shmstore.joblib as sj  # noqa: E402
import shmstore.torch as st  # noqa: E402
from joblib import delayed  # noqa: E402
from shmstore import leaks  # noqa: E402
from shmstore.joblib import _cache, _reduce, _watch  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

METHODS = ["fork", "spawn", "forkserver"]
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# Worker functions


def _record(args):
    lst, i = args
    return lst[i]  # a view: travels back by name


def _queue_worker(inbox, outbox, ack):
    lst, d, ref, view = inbox.get()
    outbox.put((len(lst), d["k"], float(ref.get().sum()), view["file_name"], lst[1]))
    made = shmstore.put(np.arange(1000.0))  # a result this worker creates
    outbox.put(made)
    ack.get()  # keep the creating handle until the parent has attached (docs/lifecycle.md G6)
    made.close()


def _backing_file(x):
    """The file behind a worker's array (its segment), and what joblib wrote for our parent."""
    span = _reduce.file_span(_reduce.root_of(x))
    return None if span is None else span.path


def _slice_task(x, i, parent_pid):
    # joblib's memmapping folder is under JOBLIB_TEMP_FOLDER (this run's private root)
    folder = os.environ["JOBLIB_TEMP_FOLDER"]
    joblib_files = glob.glob(f"{folder}/joblib_memmapping_folder_{parent_pid}_*/*")
    return float(x.sum()), x.flags.writeable, _backing_file(x), len(joblib_files)


def _double(x):
    return x * 2


def _first_rows(x):
    return x[:200_000]  # a view of the input: comes back by name, no new segment


def _cache_state(_):
    _cache.CACHE.sweep()
    return os.getpid(), len(_cache.CACHE.held), sum(map(len, _cache.CACHE.buffers.values()))


class _Model:
    """The instance-method pitfall: ``self`` holds the big data."""

    def __init__(self, weights, records):
        self.weights = weights  # a large numpy array: goes by name
        self.records = records  # a SharedList: goes by name

    def score(self, i):
        return float(self.weights[i]) + self.records[i]["height"]


class _Circular:
    def __init__(self, data):
        self.me = self
        self.data = data


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _make_cycle(i):
    live = len(_LIVE)  # cycles of earlier tasks not collected yet
    c = _Circular(np.ones(2 * MiB // 8) * i)  # 2 MiB pinned by a cycle
    _LIVE.add(c)
    return live


def _loader_worker(dataset, batches, conn):
    # What a DataLoader worker does: index the dataset, collate, send the batch back.
    for batch in batches:
        items = [dataset[i] for i in batch]
        conn.send([(it["image_id"], len(it["annotations"])) for it in items])
    conn.close()


def _height_tensor(record):
    import torch

    return torch.tensor(record["height"])


def _rank_worker(local_rank, rendezvous, q, done):
    handle = st.shared_per_machine(
        lambda: pytest.fail("only local rank 0 builds"),
        local_rank=local_rank,
        broadcast=st.file_broadcast(rendezvous, timeout=300),
    )
    q.put((local_rank, handle.name, handle[3]["image_id"], len(handle)))
    done.wait(300)  # hold the handle until the parent is done


# ---------------------------------------------------------------------------------------------
# multiprocessing (Pool, ProcessPoolExecutor and views returned by workers are covered by
# tests/test_store_processes.py; here: Queue both ways and a result store made by the worker)


@pytest.mark.parametrize("method", METHODS)
def test_queue_both_ways_with_a_result_made_by_the_worker(method, records):
    ctx = mp.get_context(method)
    inbox, outbox, ack = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with (
        shmstore.SharedList(records) as lst,
        shmstore.SharedDict({"k": [1, 2, 3]}) as d,
        shmstore.put(np.ones(1000)) as ref,
    ):
        p = ctx.Process(target=_queue_worker, args=(inbox, outbox, ack))
        p.start()
        inbox.put((lst, d, ref, lst[0]))
        n, k, total, fname, rec1 = outbox.get(timeout=300)
        made = outbox.get(timeout=300)
        values = made.get()
        ack.put(None)
        p.join(300)
    assert (n, k.to_python(), total, fname) == (len(records), [1, 2, 3], 1000.0, "000000000000.jpg")
    assert rec1 == records[1]
    assert isinstance(made, shmstore.Ref) and float(values.sum()) == 499500.0
    assert p.exitcode == 0
    del values
    made.unlink()  # the last user removes the name (the worker has let go)
    made.close()


# ---------------------------------------------------------------------------------------------
# joblib


@pytest.fixture(scope="module")
def big():
    return np.random.default_rng(0).random(2 * MiB)  # 16 MiB of float64


@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_joblib_slices_of_one_array_share_one_segment(backend, big):
    n = len(big) // 8
    par = sj.Parallel(n_jobs=2, backend=backend)
    out = par(
        delayed(_slice_task)(big[i * n : (i + 1) * n], i, os.getpid())
        for i in range(8)
        for _ in range(5)
    )
    assert [o[0] for o in out] == [
        float(big[i * n : (i + 1) * n].sum()) for i in range(8) for _ in range(5)
    ]
    assert not any(o[1] for o in out), "workers get read-only views"
    files = {o[2] for o in out}
    assert len(files) == 1, files  # every task and every slice: the same segment
    (path,) = files
    assert par.stats.segments == 1 and par.stats.sent_by_name == 40
    assert par.stats.copied_bytes == big.nbytes  # /dev/shm holds 1x the array
    assert max(o[3] for o in out) == 0, "joblib's memmapping wrote files"
    assert not os.path.exists(path), "the segment ends with the call"


@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_joblib_large_results_come_back_by_name(backend, big):
    with sj.sharing(backend, n_jobs=2) as stats:
        doubled = joblib.Parallel()(delayed(_double)(big) for _ in range(3))
        heads = joblib.Parallel()(delayed(_first_rows)(big) for _ in range(2))
        segment = stats.names[0]
        for d in doubled:
            np.testing.assert_array_equal(d, big * 2)
            assert not d.flags.writeable
            assert isinstance(_reduce.root_of(d).base, shmstore._native.ArrayOwner)
        # a view of the input comes back as a view of the input's segment: no copy
        assert _reduce.file_span(_reduce.root_of(heads[0])).path.endswith(segment)
        np.testing.assert_array_equal(heads[1], big[:200_000])
        assert stats.segments == 1  # two calls, one array: one segment
        # the workers let go of the result segments once we attached them
        states = joblib.Parallel()(delayed(_cache_state)(i) for i in range(6))
        assert all(held == 0 for _, held, _ in states)
        del doubled, heads
    assert not (segment_dir() / segment).exists()
    if backend == "loky":  # the same reusable workers: the context's mappings are gone
        states = sj.Parallel(n_jobs=2)(delayed(_cache_state)(i) for i in range(6))
        assert all(buffers == 0 for _, _, buffers in states)


def test_joblib_bound_method_sends_names_not_data(records, big):
    with shmstore.SharedList(records) as lst:
        model = _Model(big, lst)
        sharer = sj.Sharer()
        try:
            payload = sharer.dumps(delayed(model.score)(3))
            assert len(payload) < 2048, len(payload)  # self: a segment name + a store name
        finally:
            sharer.close()
        out = sj.Parallel(n_jobs=2)(delayed(model.score)(i) for i in range(10))
    assert out == [float(big[i]) + records[i]["height"] for i in range(10)]


def test_joblib_shmstore_objects_and_store_arrays_go_by_name(records):
    arr = np.arange(4 * MiB // 8, dtype=np.float64)
    with shmstore.put({"arr": arr}) as ref, shmstore.SharedList(records) as lst:
        stored = ref.get()["arr"]  # a read-only array over the store's pages
        par = sj.Parallel(n_jobs=2, backend="multiprocessing")
        out = par(delayed(_slice_task)(stored[i::2], i, os.getpid()) for i in range(2))
        assert [o[0] for o in out] == [float(arr[0::2].sum()), float(arr[1::2].sum())]
        assert {o[2] for o in out} == {str(segment_dir() / ref.name)}  # the store's own segment
        assert par.stats.segments == 0 and par.stats.in_place == 1  # nothing copied
        views = sj.Parallel(n_jobs=2)(delayed(_record)((lst, i)) for i in range(3))
        assert [v.to_python() for v in views] == records[:3]


def test_joblib_threading_backend_collects_cycles_with_gc_guard():
    # the time budget is unlimited (burst): this test is about what the guard frees
    guard = leaks.GcGuard(min_growth=8 * MiB, max_gc_fraction=1.0, burst=float("inf"))
    gc.collect()
    gc.disable()  # as if the automatic gc never ran (threads allocate few objects)
    try:
        joblib.Parallel(n_jobs=2, backend="threading")(delayed(_make_cycle)(i) for i in range(40))
        unguarded = len(_LIVE)
        gc.collect()
        sj.Parallel(n_jobs=2, backend="threading", guard=guard)(
            delayed(_make_cycle)(i) for i in range(40)
        )
        left = len(_LIVE)
    finally:
        gc.enable()
        gc.collect()
    assert unguarded == 40  # plain joblib threads: every cycle (2 MiB each) is still there
    assert guard.stats.tasks == 40
    # 80 MiB of cycles cannot all fit in memory glibc already had, so RSS grows past
    # min_growth and the guard collects during the call (how often depends on how the
    # threads interleave and on glibc's reuse of freed memory: only "at least once")
    assert guard.stats.collections >= 1 and guard.stats.collected_objects >= 1
    assert left == 0  # and the end of the call collects what the last tasks left


_THREAD_LOCAL = threading.local()


class _SlowToEnd:
    """Held by a thread-local: released as its thread ends, and takes a moment then."""

    def __del__(self) -> None:
        threading.Event().wait(0.5)


def _current_thread(_: int) -> threading.Thread:
    _THREAD_LOCAL.held = _SlowToEnd()
    return threading.current_thread()


def test_a_threading_call_ends_with_its_threads_ended():
    """A thread that ends leaves garbage behind (its thread-locals' bookkeeping): the end of
    a gc-guarded threading call waits for its pool's threads to end before the collection
    that leaves nothing behind, so that garbage never appears after the call. Plain joblib
    only tells them to end (here each thread's end takes half a second)."""
    ran = sj.Parallel(n_jobs=2, backend="threading")(delayed(_current_thread)(i) for i in range(8))
    assert ran and threading.current_thread() not in ran
    assert not any(t.is_alive() for t in ran)


def _pid(_: int) -> int:
    return os.getpid()


def test_joblib_prefer_threads_is_honoured_inside_sharing():
    """Libraries ask for threads with ``prefer="threads"`` (scikit-learn does); inside
    ``sharing()`` they get the gc-guarded threading backend, as they would outside it. An
    explicit backend wins over the hint, as in joblib."""
    me = os.getpid()
    with sj.sharing(n_jobs=2):
        threads = joblib.Parallel(prefer="threads")(delayed(_pid)(i) for i in range(4))
        processes = joblib.Parallel()(delayed(_pid)(i) for i in range(4))
    assert set(threads) == {me}
    assert me not in processes
    par = sj.Parallel(n_jobs=2, prefer="threads")
    assert set(par(delayed(_pid)(i) for i in range(4))) == {me}
    assert isinstance(par._backend, sj.GuardedThreadingBackend)
    explicit = sj.Parallel(n_jobs=2, backend="loky", prefer="threads")
    assert me not in explicit(delayed(_pid)(i) for i in range(4))


def _on_a_dask_worker(_: int) -> bool:
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        return False
    return True


def test_joblib_dask_backend_is_kept_inside_and_around_sharing(tmp_path):
    """Code written for shmstore.joblib run under ``parallel_config(backend="dask")`` runs on
    the Dask cluster, whichever way the two are nested (``sharing()`` inside used to put the
    calls on local loky workers); an explicit ``backend`` still wins."""
    pytest.importorskip("distributed", reason="distributed is in requirements-dev.txt")
    from distributed import Client, LocalCluster

    tasks = [delayed(_on_a_dask_worker)(i) for i in range(4)]
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=2,
            processes=False,
            dashboard_address=None,
            # The scheduler's HTTP server (health, metrics) starts even without a dashboard,
            # on 8787 by default: when another process holds that port it warns (an error
            # here). Any free port instead.
            scheduler_kwargs={"dashboard_address": ":0"},
            local_directory=str(tmp_path / "dask"),  # workers' scratch space: the test's directory
        ) as cluster,
        Client(cluster),
    ):
        with joblib.parallel_config(backend="dask"):
            with sj.sharing() as stats:
                assert joblib.Parallel()(tasks) == [True] * 4
                assert sj.Parallel()(tasks) == [True] * 4
                assert sj.Parallel(n_jobs=2, backend="threading")(tasks) == [False] * 4
            assert stats.segments == 0
            assert sj.Parallel()(tasks) == [True] * 4
        with sj.sharing(), joblib.parallel_config(backend="dask"):
            assert joblib.Parallel()(tasks) == [True] * 4
    with sj.sharing(n_jobs=2):  # no Dask backend around: ours, as before
        assert joblib.Parallel()(tasks) == [False] * 4


@pytest.mark.parametrize("mode", ["r+", "w+", "c"])
def test_joblib_writable_mmap_mode_warns(mode, big):
    """Arrays arrive read-only whatever ``mmap_mode`` asks: a writable mode warns."""
    with sj.sharing(n_jobs=2), pytest.warns(sj.WritableMemmapWarning, match=mode) as got:
        out = joblib.Parallel(mmap_mode=mode)(delayed(_first_rows)(big) for _ in range(2))
    assert {w.filename for w in got} == {__file__}  # points at the caller's line
    assert [o.flags.writeable for o in out] == [False, False]
    with sj.sharing(n_jobs=2):  # the default "r": no warning (warnings are errors here)
        joblib.Parallel()(delayed(_pid)(i) for i in range(2))


def test_joblib_threshold_and_arguments():
    assert _reduce.parse_bytes("1M") == MiB and _reduce.parse_bytes("512k") == 512 << 10
    assert _reduce.parse_bytes(None) == 0 and _reduce.parse_bytes(10) == 10
    assert _reduce.parse_bytes("10 MB") == 10**7  # shmstore's one size grammar (SI units)
    with pytest.raises(ValueError):
        _reduce.parse_bytes("lots")
    with pytest.raises(ValueError, match="backend must be"):
        sj.Parallel(backend="dask")
    small = np.arange(100.0)
    sharer = sj.Sharer(threshold="1M")
    try:
        assert sharer.reduce_array(small) is None  # below the threshold: pickled as usual
        assert sharer.stats.segments == 0
    finally:
        sharer.close()


def test_watcher_reports_an_unlinked_segment():
    import threading

    seen = threading.Event()
    ref = shmstore.put(np.zeros(10), arena=False)
    path = shmstore._native._store_info(ref)["path"]
    watcher = _watch.Watcher(lambda p: seen.set() if p == path else None)
    assert watcher.watch(path)
    ref.unlink()
    assert seen.wait(300)
    ref.close()


def test_rebuilt_views_match_any_layout(big):
    grid = big[: 600 * 1000].reshape(600, 1000)
    cases = [grid, grid[::3, 5:], grid.T, grid[::-1, ::-7], np.asfortranarray(grid)[10:, :20]]
    sharer = sj.Sharer(threshold=0)
    try:
        for a in cases:
            b = pickle.loads(sharer.dumps(a))
            np.testing.assert_array_equal(a, b)
            assert b.strides == a.strides
        assert sharer.stats.segments == 2  # grid's buffer, and the Fortran copy's
    finally:
        sharer.close()


# ---------------------------------------------------------------------------------------------
# torch-style datasets and the DDP helper


def test_dataset_in_a_dataloader_shaped_harness(records):
    ctx = mp.get_context("spawn")
    batches = [list(range(i, min(i + 8, len(records)))) for i in range(0, len(records), 8)]
    with shmstore.SharedList(records) as lst:
        ds = st.SharedListDataset(lst)
        assert len(pickle.dumps(ds)) < 512  # what each worker receives
        conns, procs = [], []
        for w in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_loader_worker, args=(ds, batches[w::2], child))
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        got = []
        for conn in conns:
            while True:
                try:
                    got.extend(conn.recv())
                except EOFError:
                    break
        for p in procs:
            p.join(300)
    assert sorted(got) == [(r["image_id"], len(r["annotations"])) for r in records]
    assert all(p.exitcode == 0 for p in procs)


def test_dataset_by_name_path_and_transform(records, tmp_path):
    with shmstore.SharedList(records) as lst:
        lst.save(tmp_path / "a.shm")
        by_name = st.SharedListDataset(lst.name, transform=lambda r: r["image_id"])
        by_path = st.SharedListDataset(tmp_path / "a.shm")
        assert [by_name[i] for i in range(3)] == [0, 1, 2]
        assert by_path[4] == records[4] and len(by_path) == len(records)
        del by_name


def test_a_build_reports_progress_through_tqdm(records):
    """``SharedList(tqdm(records))`` composes: the build consumes the iterable once, in order,
    and the bar ends at the record count."""
    tqdm = pytest.importorskip("tqdm", reason="tqdm is in requirements-dev.txt").tqdm
    out = io.StringIO()
    bar = tqdm((r for r in records), total=len(records), file=out, mininterval=0)
    with shmstore.SharedList(bar) as lst:
        assert len(lst) == len(records) and lst[7] == records[7]
    assert bar.n == len(records)
    assert f"{len(records)}/{len(records)}" in out.getvalue()


def test_dataset_relative_file_path_is_a_file(records, tmp_path, monkeypatch):
    """A bare relative file name (``"coco.shm"``) opens that file when no store has the name;
    when a store has it too, the dataset refuses to guess."""
    monkeypatch.chdir(tmp_path)
    with shmstore.SharedList(records) as lst:
        lst.save("coco.shm")
        ds = st.SharedListDataset("coco.shm")
        assert len(ds) == len(records) and ds[3] == records[3]
        ds.data.close()
        with pytest.raises(shmstore.StoreNotFoundError):
            st.SharedListDataset(f"missing-{os.getpid()}.shm")
        lst.save(lst.name)  # a file named like the live store
        with pytest.raises(ValueError, match="both a store and a file"):
            st.SharedListDataset(lst.name)


def test_real_torch_dataloader(records):
    pytest.importorskip("torch", reason="torch is not installed (make test-torch installs it)")
    from torch.utils.data import DataLoader

    totals = []
    with shmstore.SharedList(records) as lst:
        ds = st.SharedListDataset(lst, transform=_height_tensor)
        for method in ("fork", "spawn"):
            loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=method)
            totals.append(sum(int(b.sum()) for b in loader))
    assert totals == [sum(r["height"] for r in records)] * 2


@pytest.mark.parametrize("from_archive", [False, True])
def test_shared_per_machine_one_copy(records, tmp_path, from_archive):
    ctx = mp.get_context("spawn")
    archive = tmp_path / "data.shm"
    if from_archive:
        with shmstore.SharedList(records) as tmp:
            tmp.save(archive)
    rendezvous = tmp_path / "rendezvous"
    q, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank_worker, args=(r, rendezvous, q, done)) for r in (1, 2)]
    for p in procs:
        p.start()  # the other ranks wait for the name
    built = []
    handle = st.shared_per_machine(
        lambda: built.append(1) or records,
        local_rank=0,
        archive=archive if from_archive else None,
        broadcast=st.file_broadcast(rendezvous),
    )
    reports = sorted(q.get(timeout=300) for _ in procs)
    done.set()
    for p in procs:
        p.join(300)
    assert built == ([] if from_archive else [1])
    assert {name for _, name, _, _ in reports} == {handle.name}
    assert all(img == 3 and n == len(records) for _, _, img, n in reports)
    if from_archive:
        assert handle.name == str(archive)
        handle.close()
    else:
        handle.unlink()  # the creator's job, as a `with` block would do
        handle.close()


def _ddp_rank(rank, world, init_file, n, q):
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        handle = st.shared_per_machine(lambda: [{"i": i, "x": [i] * 3} for i in range(n)])
        total = sum(handle[i]["x"][2] for i in range(len(handle)))
        q.put((rank, handle.name, total))
        dist.barrier()  # rank 0 keeps the store until every rank has read
        if rank == 0:
            handle.unlink()
        handle.close()
    finally:
        dist.destroy_process_group()


def test_shared_per_machine_over_real_torch_distributed(tmp_path):
    """The default broadcast: torch.distributed (gloo) all-gathers only the name."""
    pytest.importorskip("torch", reason="torch is not installed (make test-torch installs it)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, n = 3, 500
    procs = [
        ctx.Process(target=_ddp_rank, args=(r, world, tmp_path / "pg", n, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    reports = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(300)
    assert all(p.exitcode == 0 for p in procs)
    assert len({name for _, name, _ in reports}) == 1  # one store for the machine
    assert [total for _, _, total in reports] == [sum(range(n))] * world


def test_shared_per_machine_needs_a_broadcast(records):
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            pytest.skip("torch.distributed is initialised here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="needs a broadcast"):
        st.shared_per_machine(lambda: records, local_rank=0)


# ---------------------------------------------------------------------------------------------
# XGBoost


def _train(data_ref, rows, seed):
    import xgboost as xgb

    view = data_ref.get()
    X, y = view["X"][rows], view["y"][rows]
    dm = xgb.QuantileDMatrix(X, y, nthread=1)
    booster = xgb.train({"nthread": 1, "max_depth": 3, "seed": seed}, dm, num_boost_round=5)
    return float(booster.predict(xgb.DMatrix(X[:10], nthread=1)).sum())


class _DMatrixHolder:
    """The xgboost 2.x QuantileDMatrix cycle (``_handle_ref -> method -> self``), rebuilt."""

    def __init__(self, dm, X):
        self.dm = dm
        self.X = np.array(X)  # a private copy, as in ``data * i``
        self._handle_ref = self.reset

    def reset(self):
        pass


def _train_with_cycle(data_ref, rows, seed):
    import xgboost as xgb

    view = data_ref.get()
    X, y = view["X"][rows], view["y"][rows]
    dm = xgb.QuantileDMatrix(X, y, nthread=1)
    _DMatrixHolder(dm, X)
    booster = xgb.train({"nthread": 1, "max_depth": 3, "seed": seed}, dm, num_boost_round=3)
    return float(booster.predict(xgb.DMatrix(X[:10], nthread=1)).sum())


@pytest.mark.slow
def test_xgboost_joblib_workload_with_gc_guard_leaves_no_cycles():
    pytest.importorskip("xgboost", reason="xgboost-cpu is in requirements-dev.txt")
    rng = np.random.default_rng(0)
    X = rng.random((40_000, 8))
    y = X @ rng.random(8)
    chunks = [slice(i * 10_000, (i + 1) * 10_000) for i in range(4)]
    with shmstore.put({"X": X, "y": y}) as ref:
        # processes: the training data travels by name (the Ref), never as a pickle
        by_loky = sj.Parallel(n_jobs=2)(delayed(_train)(ref, c, s) for c in chunks for s in (0, 1))
        # threads: every task under gc_guard; the leak detector sees what is left at the end
        guard = leaks.GcGuard(min_growth=0, max_gc_fraction=1.0)
        # Made before the block, as in examples/xgboost_joblib.py: joblib links a Parallel and
        # its backend both ways, a cycle of joblib's own that lives as long as the Parallel
        # (on a free-threaded interpreter the block sees it; with a GIL the backend's closing
        # collection has moved it out of the generation the block reads).
        parallel = sj.Parallel(n_jobs=2, backend="threading", guard=guard)
        with leaks.detect() as report:
            by_threads = parallel(
                delayed(_train_with_cycle)(ref, c, s) for c in chunks for s in (0, 1)
            )
        # the same without the guard: the cycles (and their copies of X) are retained
        with leaks.detect(min_bytes=64 << 10) as unguarded:
            joblib.Parallel(n_jobs=2, backend="threading")(
                delayed(_train_with_cycle)(ref, c, 0) for c in chunks
            )
    assert len(by_loky) == len(by_threads) == 8
    assert all(np.isfinite(by_loky)) and all(np.isfinite(by_threads))
    assert report.cycles == [], str(report)
    assert guard.stats.collections >= 1
    assert len(unguarded.cycles) == len(chunks)
    assert unguarded.retained_bytes >= len(chunks) * 10_000 * 8 * 8
