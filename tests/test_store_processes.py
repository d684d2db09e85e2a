"""Stores shared between processes: pool workers under fork, spawn and forkserver, an
unrelated process attaching by name, forked children creating or dropping stores.

Synchronisation is by pipes, queues and joins only (no sleeps, no timing asserts)."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import pickle
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import shmstore
from conftest import run_checked, segment_dir

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

METHODS = ["fork", "spawn", "forkserver"]

# --- worker functions (module level: importable under spawn and forkserver) --------------------


def deep(x):
    return x.to_python() if isinstance(x, (shmstore.ListView, shmstore.DictView)) else x


def read_list(lst):
    assert isinstance(lst, shmstore.SharedList)
    return [deep(r) for r in lst], len(lst), lst.name


def touch_fields(args):
    """The benchmark's field-touch loop over a slice of records."""
    lst, lo, hi = args
    out = []
    for i in range(lo, hi):
        r = lst[i]
        out.append(
            (
                r["file_name"],
                r["height"],
                [(a["bbox"][0], a["category_id"]) for a in r["annotations"]],
            )
        )
    return out


def read_dict(d):
    assert isinstance(d, shmstore.SharedDict)
    return {k: deep(d[k]) for k in d}, d.get("missing", "default")


def read_ref(ref):
    assert isinstance(ref, shmstore.Ref)
    v = ref.get()
    arr = v["arr"]
    return float(arr.sum()), arr.shape, str(arr.dtype), arr.flags.writeable, deep(v["meta"])


def read_view(view):
    return type(view).__name__, deep(view), len(view)


def return_views(lst, i):
    """Views (and a handle) as results: pickled by name, attached in the parent."""
    rec = lst[i]
    return rec, rec["annotations"], rec["annotations"][0]["bbox"], lst


def create_in_child(conn):
    """A child that creates its own store, hands out its name, and waits for the parent."""
    s = shmstore.SharedList([{"from": "child", "pid": os.getpid()}, np.arange(5)])
    conn.send(s.name)
    assert conn.recv() == "done"  # the parent has attached and read
    conn.send(s[0].to_python())
    conn.close()


KEEP = []


def create_and_keep_in_child(conn):
    """A child whose store is still alive when it exits (multiprocessing children end with
    os._exit: no atexit handlers run)."""
    s = shmstore.SharedList(["kept until exit"])
    KEEP.append(s)
    conn.send(s.name)
    conn.close()


def drop_inherited(conn):
    """A forked child that drops every inherited handle, view and array."""
    for obj in list(INHERITED):
        if isinstance(obj, shmstore.StoreHandle):
            obj.close()
    INHERITED.clear()
    gc.collect()
    conn.send("dropped")
    conn.close()


INHERITED: list = []

# --- pool workers --------------------------------------------------------------------------------


@pytest.fixture
def shared(records):
    """A SharedList, a SharedDict, a Ref and a view, with the expected plain values."""
    arr = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    meta = {"k": (1, 2), "s": "x"}
    stores = {
        "list": shmstore.SharedList(records),
        "dict": shmstore.SharedDict({r["file_name"]: r for r in records[:20]}),
        "ref": shmstore.put({"arr": arr, "meta": meta}),
    }
    expected = {
        "list": records,
        "dict": {r["file_name"]: r for r in records[:20]},
        "arr_sum": float(arr.sum()),
        "meta": meta,
    }
    yield stores, expected
    for s in stores.values():
        s.unlink()
        s.close()


def _check_results(results, stores, expected, records):
    (lst_items, n, name) = results["list"]
    assert lst_items == records and n == len(records) and name == stores["list"].name
    (d_items, dflt) = results["dict"]
    assert d_items == expected["dict"] and dflt == "default"
    (s, shape, dtype, writeable, meta) = results["ref"]
    assert s == expected["arr_sum"] and shape == (100, 100) and dtype == "float32"
    assert writeable is False
    assert meta == expected["meta"]
    anns = records[7]["annotations"]
    assert results["view"] == ("ListView", anns, len(anns))
    assert results["dictview"] == ("DictView", records[3], len(records[3]))


def _expected_touch(records, lo, hi):
    return [
        (
            r["file_name"],
            r["height"],
            [(a["bbox"][0], a["category_id"]) for a in r["annotations"]],
        )
        for r in records[lo:hi]
    ]


@pytest.mark.parametrize("method", METHODS)
def test_pool_workers_read_every_kind_of_object(method, shared, records):
    stores, expected = shared
    lst = stores["list"]
    ctx = mp.get_context(method)
    with ctx.Pool(2) as pool:
        results = {
            "list": pool.apply_async(read_list, (lst,)),
            "dict": pool.apply_async(read_dict, (stores["dict"],)),
            "ref": pool.apply_async(read_ref, (stores["ref"],)),
            "view": pool.apply_async(read_view, (lst[7]["annotations"],)),
            "dictview": pool.apply_async(read_view, (lst[3],)),
        }
        chunks = [(lst, i, min(i + 10, len(records))) for i in range(0, len(records), 10)]
        touched = pool.map(touch_fields, chunks, chunksize=1)
        results = {k: r.get() for k, r in results.items()}
    _check_results(results, stores, expected, records)
    assert [x for chunk in touched for x in chunk] == _expected_touch(records, 0, len(records))


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor_workers(method, shared, records):
    stores, expected = shared
    lst = stores["list"]
    with ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        futures = {
            "list": ex.submit(read_list, lst),
            "dict": ex.submit(read_dict, stores["dict"]),
            "ref": ex.submit(read_ref, stores["ref"]),
            "view": ex.submit(read_view, lst[7]["annotations"]),
            "dictview": ex.submit(read_view, lst[3]),
        }
        touched = list(ex.map(touch_fields, [(lst, 0, 25), (lst, 25, len(records))]))
        results = {k: f.result() for k, f in futures.items()}
    _check_results(results, stores, expected, records)
    assert touched[0] + touched[1] == _expected_touch(records, 0, len(records))


@pytest.mark.parametrize("method", METHODS)
def test_views_returned_from_workers_work_in_the_parent(method, records):
    with shmstore.SharedList(records) as lst, mp.get_context(method).Pool(1) as pool:
        rec, anns, bbox, handle = pool.apply(return_views, (lst, 5))
        assert isinstance(rec, shmstore.DictView) and rec == records[5]
        assert isinstance(anns, shmstore.ListView) and anns == records[5]["annotations"]
        assert isinstance(bbox, shmstore.ListView)
        assert bbox == records[5]["annotations"][0]["bbox"]
        assert isinstance(handle, shmstore.SharedList) and handle.name == lst.name
        assert handle[0] == records[0]
        handle.close()
        # Results share the parent's mapping of the store (no second copy).
        assert _count_mappings(segment_dir() / lst.name) == 1


def _count_mappings(path: Path) -> int:
    st = os.stat(path)
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) == st.st_ino:
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                n += os.makedev(major, minor) == st.st_dev
    return n


# --- an unrelated process -----------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, pickle, sys
    import shmstore

    names = json.loads(sys.argv[1])
    out = {}
    lst = shmstore.SharedList.attach(names["list"])
    out["list"] = lst.to_python()
    d = shmstore.SharedDict.attach(names["dict"])
    out["dict"] = d.to_python()
    r = shmstore.Ref.attach(names["ref"])
    out["ref"] = r.get()["arr"].tolist()
    # A pickled handle and a pickled view, hex-encoded in argv.
    handle, view = pickle.loads(bytes.fromhex(sys.argv[2]))
    out["pickled_handle"] = handle[1]["image_id"]
    out["pickled_view"] = view.to_python()
    try:
        shmstore.SharedList.attach(names["missing"])
    except shmstore.StoreNotFoundError as e:
        out["missing"] = str(e)
    print(json.dumps(out))
    """
)


def test_unrelated_process_attaches_by_name(records):
    lst = shmstore.SharedList(records)
    d = shmstore.SharedDict({"a": records[0], "b": [1, 2]})
    r = shmstore.put({"arr": np.arange(6).reshape(2, 3)})
    with lst, d, r:
        names = {"list": lst.name, "dict": d.name, "ref": r.name, "missing": "not-there"}
        payload = pickle.dumps((lst, lst[4]["annotations"]))
        assert len(payload) < 512
        proc = run_checked([sys.executable, "-c", CHILD, json.dumps(names), payload.hex()])
        out = json.loads(proc.stdout)
        assert out["list"] == records
        assert out["dict"] == {"a": records[0], "b": [1, 2]}
        assert out["ref"] == [[0, 1, 2], [3, 4, 5]]
        assert out["pickled_handle"] == 1
        assert out["pickled_view"] == records[4]["annotations"]
        assert "shmstore-not-there" in out["missing"]
        # The other process only attached: the store is still there for us.
        assert (segment_dir() / lst.name).exists() and lst[2] == records[2]


def test_unrelated_process_cannot_attach_after_unlink():
    s = shmstore.SharedList([1, 2, 3])
    name = s.name
    s.unlink()
    code = (
        "import shmstore, sys\n"
        "try:\n"
        f"    shmstore.SharedList.attach({name!r})\n"
        "except FileNotFoundError as e:\n"
        "    print(type(e).__name__, e)\n"
        "    sys.exit(3)\n"
    )
    proc = run_checked([sys.executable, "-c", code], check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.startswith("StoreNotFoundError") and name in proc.stdout
    assert s[2] == 3  # this process's mapping still works
    s.close()


# --- children that create or drop stores -------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_child_creates_its_own_store(method):
    ctx = mp.get_context(method)
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=create_in_child, args=(child_end,))
    p.start()
    child_end.close()
    name = parent_end.recv()
    with shmstore.SharedList.attach(name) as s:
        assert s[0]["from"] == "child" and s[0]["pid"] == p.pid
        assert s[1].tolist() == [0, 1, 2, 3, 4]
        parent_end.send("done")
        assert parent_end.recv() == {"from": "child", "pid": p.pid}
        p.join()
        assert p.exitcode == 0
        # The creator has exited; our attachment keeps the store readable.
        assert s[0]["from"] == "child"
        view = s[0]
    assert view["pid"] == p.pid
    del view, s
    gc.collect()
    # Nobody uses it any more: it must go (checked by no_leftover_segments, with a bounded
    # wait for the supervisor).


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_store_kept_alive_until_child_exit_is_removed(method):
    """multiprocessing children exit with os._exit (no atexit): a store the child still
    held must not be left in /dev/shm (checked by no_leftover_segments)."""
    ctx = mp.get_context(method)
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=create_and_keep_in_child, args=(child_end,))
    p.start()
    child_end.close()
    name = parent_end.recv()
    p.join()
    assert p.exitcode == 0
    assert name.startswith("shmstore-")


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_forked_child_dropping_inherited_handles_keeps_the_parents_store(records):
    ctx = mp.get_context("fork")
    with shmstore.SharedList(records) as lst:
        attached = shmstore.SharedList.attach(lst.name)
        INHERITED[:] = [lst, attached, lst[0], lst[1]["annotations"]]
        try:
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=drop_inherited, args=(child_end,))
            p.start()
            child_end.close()
            assert parent_end.recv() == "dropped"
            p.join()
            assert p.exitcode == 0
        finally:
            INHERITED.clear()
        assert (segment_dir() / lst.name).exists()
        assert lst.to_python() == records
        # Another process can still attach.
        code = f"import shmstore; print(len(shmstore.SharedList.attach({lst.name!r})))"
        proc = run_checked([sys.executable, "-c", code])
        assert proc.stdout.strip() == str(len(records))
        attached.close()


FORK_AND_EXIT = textwrap.dedent(
    """
    import os, sys
    import shmstore

    s = shmstore.SharedList(["parent's"])
    pid = os.fork()
    if pid == 0:
        # The child reads the inherited store and exits normally (atexit handlers run).
        assert s[0] == "parent's"
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The child's exit did not remove the parent's store.
    path = os.path.join(os.environ.get("SHMSTORE_DIR") or "/dev/shm", s.name)
    assert os.path.exists(path), "removed by the child's exit"
    assert shmstore.SharedList.attach(s.name)[0] == "parent's"
    print("ok")
    """
)


def test_forked_child_exit_does_not_remove_the_parents_store():
    proc = run_checked([sys.executable, "-c", FORK_AND_EXIT])
    assert proc.stdout.strip() == "ok"


STARTED_BY_A_FORKSERVER_CHILD = textwrap.dedent(
    """
    import json, multiprocessing as mp, os
    import shmstore
    from shmstore import _native

    def child(conn):
        with shmstore.SharedList([1]):  # the first store of this run: starts the supervisor
            conn.send(_native.supervisor_info()["pid"])
            conn.recv()  # keep the store (and so the supervisor) until the parent has looked

    if __name__ == "__main__":
        ctx = mp.get_context("forkserver")
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=child, args=(theirs,))
        p.start()
        theirs.close()
        pid = ours.recv()
        fds = f"/proc/{pid}/fd"
        kinds = [os.readlink(f"{fds}/{fd}").split(":")[0] for fd in os.listdir(fds)]
        print(json.dumps(sorted(kinds)))
        ours.send("done")
        p.join()
    """
)


def test_supervisor_keeps_no_descriptor_of_the_process_that_started_it(tmp_path):
    """A forkserver child receives the forkserver's "alive" pipe without close-on-exec; a
    supervisor started from there used to keep it, and the forkserver then never exited."""
    script = tmp_path / "starter.py"
    script.write_text(STARTED_BY_A_FORKSERVER_CHILD)
    name = os.environ["SHMSTORE_SUPERVISOR_NAME"] + "-starter"  # a supervisor of its own
    env = {**os.environ, "SHMSTORE_SUPERVISOR_NAME": name}
    proc = run_checked([sys.executable, str(script)], env=env)
    kinds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "pipe" not in kinds, kinds
