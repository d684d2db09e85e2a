"""Store handles: names, sizes, close/unlink, context managers, save/open, attach, pickling,
GC/weakref properties, zero-copy read-only arrays, segment permissions (docs/api.md)."""

from __future__ import annotations

import gc
import os
import pickle
import re
import stat
import sys
import sysconfig
import weakref

import numpy as np
import pytest
import shmstore
from conftest import mappings_of, segment_dir

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

NAME_RE = re.compile(r"^shmstore-[0-9a-f]{32}$")


def make(kind: str, value=None):
    """A fresh store of `kind` ("list", "dict" or "ref"), a segment of its own (a small
    object's chunk of an arena is tested in test_arena.py)."""
    if kind == "list":
        return shmstore.SharedList(value if value is not None else [{"a": [1, 2]}, 3])
    if kind == "dict":
        return shmstore.SharedDict(value if value is not None else {"k": {"a": [1, 2]}, "n": 3})
    obj = value if value is not None else {"a": [1, 2], "arr": np.arange(4)}
    return shmstore.put(obj, arena=False)


CLASSES = {"list": shmstore.SharedList, "dict": shmstore.SharedDict, "ref": shmstore.Ref}
KINDS = list(CLASSES)


def first(store):
    """A view from the store (a container inside its first record)."""
    if isinstance(store, shmstore.SharedList):
        return store[0]["a"]
    if isinstance(store, shmstore.SharedDict):
        return store["k"]["a"]
    return store.get()["a"]


def data_address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


# --- names, sizes, files ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_name_nbytes_and_segment_file(kind):
    with make(kind) as s:
        assert NAME_RE.match(s.name), s.name
        path = segment_dir() / s.name
        st = path.stat()
        assert s.nbytes == st.st_size > 128  # header + records
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o400  # sealed: read-only, owner only
        assert st.st_uid == os.geteuid()
        assert s.name in repr(s)
        assert not s.closed
    assert not path.exists()


def test_names_are_unguessable():
    names = set()
    for _ in range(100):
        with shmstore.put(None, arena=False) as r:
            assert NAME_RE.match(r.name)
            names.add(r.name)
    assert len(names) == 100
    # 128 random bits: every hex digit position takes many values.
    digits = [{n[len("shmstore-") + i] for n in names} for i in range(32)]
    assert all(len(d) >= 8 for d in digits), digits


def test_nbytes_grows_with_data():
    with shmstore.put(b"x" * 1000) as small, shmstore.put(b"x" * 1_000_000) as big:
        assert big.nbytes - small.nbytes >= 999_000


# --- user-given names ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_user_name_gets_prefix_and_can_be_attached(kind):
    short = f"test-api-{kind}-{os.getpid()}"
    build = {
        "list": lambda: shmstore.SharedList([1, 2], name=short),
        "dict": lambda: shmstore.SharedDict({"a": 1}, name=short),
        "ref": lambda: shmstore.put([1, 2], name=short),
    }[kind]
    with build() as s:
        assert s.name == f"shmstore-{short}"
        assert (segment_dir() / s.name).exists()
        for n in (short, s.name):
            with CLASSES[kind].attach(n) as a:
                assert a.name == s.name and a.nbytes == s.nbytes
    assert not (segment_dir() / f"shmstore-{short}").exists()


def test_user_name_with_prefix_is_kept():
    name = f"shmstore-already-prefixed-{os.getpid()}"
    with shmstore.SharedList([1], name=name) as s:
        assert s.name == name


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_name_raises_store_exists(kind):
    short = f"test-dup-{kind}-{os.getpid()}"
    with shmstore.SharedList(["original"], name=short) as s:
        before = sorted(p.name for p in segment_dir().iterdir())
        with pytest.raises(shmstore.StoreExistsError) as e:
            if kind == "list":
                shmstore.SharedList(["other"], name=short)
            elif kind == "dict":
                shmstore.SharedDict({"other": 1}, name=f"shmstore-{short}")
            else:
                shmstore.put(np.zeros(1000), name=short)
        assert isinstance(e.value, FileExistsError)
        assert s.name in str(e.value)
        assert sorted(p.name for p in segment_dir().iterdir()) == before  # no *.part-* left
        assert s[0] == "original"
        with shmstore.SharedList.attach(short) as a:
            assert a.to_python() == ["original"]


@pytest.mark.parametrize(
    "bad", ["", "a/b", "../etc", ".hidden", "x" * 250, "sp ace", "a.part-b", "ünï"]
)
def test_invalid_names_are_refused(bad):
    with pytest.raises(shmstore.InvalidInputError):
        shmstore.SharedList([1], name=bad)
    with pytest.raises((shmstore.InvalidInputError, shmstore.StoreNotFoundError)):
        shmstore.SharedList.attach(bad)


# --- close / unlink / context manager ---------------------------------------------------------


def _handle_calls(s, kind):
    """Calls that need the store behind a handle."""
    calls = [lambda: s.nbytes, lambda: s.save("/tmp/never-written"), lambda: s.unlink()]
    return (
        calls
        + {
            "list": [lambda: len(s), lambda: s[0], lambda: iter(s), lambda: s.to_python()],
            "dict": [lambda: len(s), lambda: s["k"], lambda: "k" in s, lambda: list(s.keys())],
            "ref": [lambda: s.get()],
        }[kind]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_use_after_close_raises_and_views_keep_working(kind):
    s = make(kind)
    name = s.name
    view = first(s)
    arr = s.get()["arr"] if kind == "ref" else None
    s.close()
    assert s.closed
    assert s.name == name  # still known, for messages
    assert "closed" in repr(s)
    calls = _handle_calls(s, kind)
    for call in calls:
        with pytest.raises(shmstore.StoreClosedError) as e:
            call()
        assert isinstance(e.value, ValueError)
        assert name in str(e.value)
    with pytest.raises(shmstore.StoreClosedError):
        pickle.dumps(s)
    s.close()  # idempotent
    # What was handed out before keeps working (and keeps the mapping alive).
    assert view == [1, 2] and view.to_python() == [1, 2]
    if arr is not None:
        assert arr.tolist() == [0, 1, 2, 3]
    del calls, s
    gc.collect()
    assert view[-1] == 2 and list(view) == [1, 2]
    if arr is not None:
        assert int(arr.sum()) == 6


@pytest.mark.parametrize("kind", KINDS)
def test_unlink_removes_name_but_mappings_keep_working(kind):
    s = make(kind)
    name = s.name
    attached = CLASSES[kind].attach(name)
    view = first(s)
    s.unlink()
    assert not (segment_dir() / name).exists()
    s.unlink()  # idempotent
    with pytest.raises(shmstore.StoreNotFoundError):
        CLASSES[kind].attach(name)
    assert view == [1, 2]
    assert first(attached) == [1, 2]  # handles keep working too
    assert first(s) == [1, 2]
    s.close()
    attached.close()
    del s, attached
    gc.collect()
    assert view.to_python() == [1, 2]


def test_views_survive_everything_else():
    """Close, unlink, drop the handle and every other reference: views and arrays still read."""
    lst = shmstore.SharedList([{"arr": np.arange(10.0), "x": [1, (2, 3)]}])
    rec = lst[0]
    arr = rec["arr"]
    inner = rec["x"][1]
    it = iter(rec["x"])
    lst.unlink()
    lst.close()
    del lst, rec
    gc.collect()
    assert arr.sum() == 45.0
    assert inner == (2, 3)
    assert next(it) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_context_manager_of_creator_unlinks(kind):
    with make(kind) as s:
        name = s.name
        view = first(s)
        assert (segment_dir() / name).exists()
    assert s.closed
    assert not (segment_dir() / name).exists()
    assert view == [1, 2]


def test_context_manager_unlinks_on_exception():
    with pytest.raises(KeyError, match="boom"):
        with shmstore.SharedList([1]) as s:
            name = s.name
            raise KeyError("boom")
    assert not (segment_dir() / name).exists()


@pytest.mark.parametrize("kind", KINDS)
def test_context_manager_of_attached_handle_only_closes(kind):
    with make(kind) as s:
        with CLASSES[kind].attach(s.name) as a:
            assert a.nbytes == s.nbytes
        assert a.closed
        assert (segment_dir() / s.name).exists()  # an attached handle does not unlink
        assert not s.closed and first(s) == [1, 2]


# --- save / open --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("as_str", [False, True], ids=["Path", "str"])
def test_save_and_open(kind, as_str, tmp_path):
    path = tmp_path / f"saved-{kind}.shmstore"
    with make(kind) as s:
        s.save(str(path) if as_str else path)
        expected = s.to_python() if kind != "ref" else s.get().to_python()
        nbytes = s.nbytes
    assert path.stat().st_size == nbytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left
    opened = CLASSES[kind].open(str(path) if as_str else path)
    got = opened.to_python() if kind != "ref" else opened.get().to_python()
    assert str(got) == str(expected)
    assert opened.nbytes == nbytes
    assert str(path) in opened.name
    view = first(opened)
    assert pickle.loads(pickle.dumps(view)) == [1, 2]
    with pytest.raises(shmstore.InvalidInputError):
        opened.unlink()  # a file is not a segment
    assert path.exists()
    opened.close()
    assert view == [1, 2]


def test_saved_file_is_independent_of_the_segment(tmp_path, records):
    path = tmp_path / "records.shmstore"
    with shmstore.SharedList(records) as s:
        s.save(path)
    # The segment is gone; the file still opens, by several handles sharing one mapping.
    a = shmstore.SharedList.open(path)
    b = shmstore.SharedList.open(path)
    assert a.to_python() == records == b.to_python()
    assert len(mappings_of(str(path))) == 1
    a.verify()
    a.close()
    b.close()


def test_open_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with shmstore.put([1, 2, 3]) as r:
        r.save("rel.shmstore")
    ref = shmstore.Ref.open("rel.shmstore")
    monkeypatch.chdir("/")
    assert pickle.loads(pickle.dumps(ref)).get() == [1, 2, 3]  # pickles an absolute path


def test_save_overwrites_atomically(tmp_path):
    path = tmp_path / "x.shmstore"
    with shmstore.put([1]) as a, shmstore.put([2, 2]) as b:
        a.save(path)
        b.save(path)
    assert shmstore.Ref.open(path).get() == [2, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["x.shmstore"]


def test_saving_over_an_opened_file(tmp_path):
    """save() replaces the file atomically: a process that has the old file open keeps its
    (old) content; opening the path again gives the new archive."""
    path = tmp_path / "x.shmstore"
    with shmstore.put(["old"]) as a:
        a.save(path)
    old = shmstore.Ref.open(path)
    old_view = old.get()
    with shmstore.put(["new", "er"]) as b:
        b.save(path)
    assert old_view == ["old"] and old.get() == ["old"]
    new = shmstore.Ref.open(path)
    assert new.get() == ["new", "er"]
    assert pickle.loads(pickle.dumps(new.get())) == ["new", "er"]
    old.close()
    new.close()


def test_a_recreated_name_is_a_new_store():
    name = f"test-recreate-{os.getpid()}"
    first_store = shmstore.SharedList(["old"], name=name)
    attached = shmstore.SharedList.attach(name)
    first_store.unlink()
    with shmstore.SharedList(["new"], name=name) as second:
        assert shmstore.SharedList.attach(name)[0] == "new"
        assert attached[0] == "old"  # the old mapping is still the old store
        assert second.name == first_store.name
    attached.close()
    first_store.close()


def test_open_missing_file(tmp_path):
    missing = tmp_path / "missing.shmstore"
    with pytest.raises(shmstore.StoreNotFoundError) as e:
        shmstore.SharedList.open(missing)
    assert isinstance(e.value, FileNotFoundError)
    assert str(missing) in str(e.value)


# --- attach -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "wrong"),
    [("dict", "list"), ("list", "dict"), ("ref", "list"), ("list", "ref"), ("dict", "ref")],
)
def test_attach_with_the_wrong_class_is_a_clear_error(kind, wrong, tmp_path):
    with make(kind) as s:
        with pytest.raises(shmstore.InvalidInputError) as e:
            CLASSES[wrong].attach(s.name)
        msg = str(e.value)
        assert s.name in msg
        assert CLASSES[kind].__name__ in msg  # says which class to use
        s.save(tmp_path / "f")
    with pytest.raises(shmstore.InvalidInputError):
        CLASSES[wrong].open(tmp_path / "f")


def test_attach_missing_name():
    for cls in CLASSES.values():
        with pytest.raises(shmstore.StoreNotFoundError) as e:
            cls.attach("no-such-store-anywhere")
        assert isinstance(e.value, FileNotFoundError)
        assert "shmstore-no-such-store-anywhere" in str(e.value)


def test_attach_many_times_shares_one_mapping():
    with shmstore.SharedList([{"arr": np.arange(1000)}]) as s:
        path = str(segment_dir() / s.name)
        handles = [shmstore.SharedList.attach(s.name) for _ in range(10)]
        handles += [pickle.loads(pickle.dumps(s)) for _ in range(5)]
        assert len(mappings_of(path)) == 1
        addrs = {data_address(h[0]["arr"]) for h in [s, *handles]}
        assert len(addrs) == 1
        for h in handles:
            h.close()


# --- zero-copy, read-only arrays ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_arrays_are_read_only_zero_copy_views_of_the_mapping(kind):
    big = np.arange(1_000_000, dtype=np.float64)
    value = {"k": {"a": [1, 2]}, "arr": big}
    with make(kind, value if kind != "list" else [value]) as s:
        get = {
            "list": lambda: s[0]["arr"],
            "dict": lambda: s["arr"],
            "ref": lambda: s.get()["arr"],
        }[kind]
        a1, a2 = get(), get()
        assert np.array_equal(a1, big)
        assert not a1.flags.writeable and not a1.flags.owndata
        with pytest.raises(ValueError):
            a1.flags.writeable = True
        with pytest.raises(ValueError):
            a1[0] = 5.0
        with pytest.raises(ValueError):
            np.add(a1, 1, out=a1)
        # Zero copy: both reads point at the same bytes, inside this process's mapping.
        assert data_address(a1) == data_address(a2)
        (lo, hi, perms) = mappings_of(str(segment_dir() / s.name))[0]
        assert lo <= data_address(a1) and data_address(a1) + a1.nbytes <= hi
        assert perms.startswith("r-"), perms  # mapped read-only
        assert data_address(a1) % 64 == 0
        assert a1[-1] == 999_999.0


def test_array_keeps_the_mapping_alive():
    s = shmstore.put(np.arange(100, dtype=np.int32), arena=False)
    arr = s.get()
    path = os.stat(segment_dir() / s.name)
    s.unlink()
    s.close()
    del s
    gc.collect()
    assert len(mappings_of(path)) == 1
    assert int(arr.sum()) == 4950
    del arr
    gc.collect()
    assert mappings_of(path) == []  # the last user gone: unmapped


# --- GC / weakref / pickling --------------------------------------------------------------------


def _all_objects(s):
    items = {"handle": s, "attached": type(s).attach(s.name)}
    if isinstance(s, shmstore.SharedList):
        rec = s[0]
    elif isinstance(s, shmstore.SharedDict):
        rec = s["r"]
    else:
        rec = s.get()
    items.update(
        dictview=rec,
        listview=rec["l"],
        tupleview=rec["t"],
        array_owner=rec["arr"].base,
        list_iter=iter(rec["l"]),
        dict_iter=iter(rec),
    )
    return items


RECORD = {"l": [1, [2]], "t": (3, 4), "arr": np.arange(10), "big": b"x" * 100_000}


def _store(kind):
    return make(kind, {"list": [RECORD], "dict": {"r": RECORD}, "ref": RECORD}[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_is_tracked_by_the_gc(kind):
    with _store(kind) as s:
        objs = _all_objects(s)
        tracked = [f"{what} ({type(o).__name__})" for what, o in objs.items() if gc.is_tracked(o)]
        assert tracked == [], "GC-tracked"
        for what, obj in objs.items():
            # Reports no Python references (a heap type's instance may report its type): a
            # view's one reference, to its store's holder object, leads to nothing further.
            assert set(map(id, gc.get_referents(obj))) <= {id(type(obj))}, what
        arr = (s[0] if kind == "list" else s["r"] if kind == "dict" else s.get())["arr"]
        assert type(arr.base).__name__ == "ArrayOwner"


@pytest.mark.parametrize("kind", KINDS)
def test_weakrefs(kind):
    with _store(kind) as s:
        objs = _all_objects(s)
        for what in ("handle", "attached", "dictview", "listview", "tupleview", "array_owner"):
            obj = objs.pop(what)
            called = []
            r = weakref.ref(obj, called.append)
            assert r() is obj, what
            del obj
            if what != "handle":  # `s` still refers to the handle
                assert r() is None and called, f"{what} still alive after del"


def test_views_made_again_after_many_were_dropped_are_fresh():
    """Views are recycled (a free list per type): a recycled one must be a new object in every
    way that shows: correct contents, no weakref of its predecessor pointing at it, its own
    weakrefs cleared when it goes."""
    records = [{"l": [i, [i]], "t": (i, -i), "d": {"k": i}} for i in range(600)]
    with make("list", records) as s:
        for rounds in range(3):
            # More views alive at once than a free list keeps, then all dropped at once.
            views = [s[i]["l"] for i in range(600)]
            dicts = [s[i]["d"] for i in range(600)]
            refs = [weakref.ref(v) for v in views[:50]]
            assert [v[0] for v in views] == list(range(600))
            assert [d["k"] for d in dicts] == list(range(600))
            del views, dicts
            assert all(r() is None for r in refs), rounds
            again = [s[i]["t"] for i in range(100)]
            assert all(r() is None for r in refs), "a weakref followed a recycled view"
            assert [tuple(v) for v in again] == [(i, -i) for i in range(100)]
            it = iter(s[5]["l"])
            assert list(it) == [5, [5]]
            assert not any(gc.is_tracked(v) for v in again)


def test_dropped_views_and_iterators_give_their_store_back():
    """Views and iterators are made and released outside pyo3's generic path: every one of
    them must give back exactly the reference to the store it took. The mapping stays while
    one of them lives on after its handle closed, and goes with the last one."""
    records = [{"l": [i, [i]], "t": (i, -i), "d": {"k": i}, "f": [0.5, 1.5]} for i in range(300)]
    lst = shmstore.SharedList(records)
    dct = shmstore.SharedDict({str(i): r for i, r in enumerate(records[:50])})
    path, dpath = (os.stat(segment_dir() / h.name) for h in (lst, dct))
    for _ in range(3):
        made = [lst[i]["l"] for i in range(300)] + [lst[i]["d"] for i in range(300)]
        made += [iter(v) for v in made[:50]] + [iter(lst), iter(dct), iter(dct["7"])]
        assert sum(v[0] for v in made[:300]) == sum(range(300))
        del made
    kept = (lst[3]["t"], iter(lst[4]["d"]), iter(lst), dct["9"], iter(dct))
    for h in (lst, dct):
        h.unlink()
        h.close()
    del lst, dct
    gc.collect()
    assert len(mappings_of(path)) == 1 and len(mappings_of(dpath)) == 1
    assert tuple(kept[0]) == (3, -3) and list(kept[1]) == ["k"] and kept[3]["d"]["k"] == 9
    del kept
    gc.collect()
    assert mappings_of(path) == [] and mappings_of(dpath) == []


@pytest.mark.skipif(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="free-threaded interpreter: a heap type's references are counted per thread "
    "(deferred), and the view types are immortal there, so sys.getrefcount of a type says "
    "nothing",
)
def test_made_and_dropped_views_leave_their_types_reference_counts_alone():
    """A recycled view or iterator keeps its reference to its type while it waits in a free
    list, and hands it on when reused: whether a dropped one is kept or freed, the types'
    reference counts must not drift over rounds of making and dropping many of them."""
    records = [{"l": [i, [i]], "d": {"k": i}, "f": [0.5, 1.5]} for i in range(600)]
    with make("list", records) as s:

        def round_():
            # More alive at once than a free list keeps: some are kept, the rest freed.
            made = [s[i]["l"] for i in range(600)] + [s[i]["d"] for i in range(600)]
            made += [iter(v) for v in made[:600]] + [iter(v) for v in made[600:]]
            made += [iter(s) for _ in range(300)]
            assert sum(v[0] for v in made[:600]) == sum(range(600))
            types = {type(v) for v in made}
            del made
            return types

        types = round_()  # fills the free lists
        assert len(types) == 5  # ListView, DictView and their iterators, the records' one
        types = sorted(types, key=lambda t: t.__name__)
        counts = [sys.getrefcount(t) for t in types]
        for _ in range(3):
            round_()
            for _ in range(300):
                next(iter(s[7]["l"]))  # made and dropped at once, one at a time
        assert [sys.getrefcount(t) for t in types] == counts


def test_subscript_fast_and_long_ways_agree():
    """`lst[i]`, `view[i]` and `view["key"]` take a fast path for an exact int or str and hand
    everything else to the general one: both give the same values and the same errors, and
    an int too large for the fast path leaves no exception pending behind it."""
    records = [{"a": [10, 20], "b": 2, "\u00e9": "x"} for _ in range(3)]
    lst = shmstore.SharedList(records)
    try:
        rec, seq = lst[0], lst[0]["a"]
        for i in (0, 2, -1, -3, True, np.int64(1), np.int8(-2)):
            assert lst[i] == records[i]
        for i in (0, 1, -1, -2, False, np.int32(1)):
            assert seq[i] == [10, 20][i]
        assert lst[1:3] == records[1:3] and seq[::-1] == [20, 10]
        for big in (2**70, -(2**70), 2**63, -(2**63) - 1, 3, -4):
            with pytest.raises(IndexError, match="SharedList index"):
                lst[big]
            assert lst[0]["b"] == 2  # nothing left pending by the failed read
        for big in (2**70, -(2**70), 2**63, -(2**63) - 1, 2, -3):
            with pytest.raises(IndexError, match="ListView index"):
                seq[big]
            assert seq[0] == 10
        for bad in (1.0, "1", None):
            with pytest.raises(TypeError, match="indices must be integers"):
                lst[bad]
            with pytest.raises(TypeError, match="indices must be integers"):
                seq[bad]
        assert rec["\u00e9"] == "x" and rec["".join(["a"])] == [10, 20]  # a non-interned key

        class Key(str):
            pass

        assert rec[Key("b")] == 2
        for missing in ("zz", "\ud800", 1, None, b"a"):
            with pytest.raises(KeyError):
                rec[missing]
        with pytest.raises(TypeError):
            rec[["unhashable"]]
        it = iter(seq)
        assert (next(it), next(it)) == (10, 20)
        for _ in range(3):
            with pytest.raises(StopIteration):
                next(it)
        lst.unlink()
        lst.close()
        with pytest.raises(shmstore.StoreClosedError):
            lst[0]
        assert rec["b"] == 2 and seq[1] == 20  # views keep their store
    finally:
        lst.close()
    d = shmstore.SharedDict({"a": 1, "\u00e9": [2], 3: "x", "": None})
    try:
        assert (d["a"], d["\u00e9"], d[3], d[""], d[Key("a")]) == (1, [2], "x", None, 1)
        for missing in ("zz", "\ud800", 4, None, b"a"):
            with pytest.raises(KeyError):
                d[missing]
        with pytest.raises(TypeError):
            d[["unhashable"]]
        d.unlink()
        d.close()
        with pytest.raises(shmstore.StoreClosedError):
            d["a"]
    finally:
        d.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [10, 20_000_000], ids=["small", "20MB"])
def test_pickles_are_small(kind, size, tmp_path):
    value = {"l": [1, [2]], "t": (3, 4), "blob": b"x" * size, "arr": np.zeros(size // 8)}
    with make(kind, {"list": [value], "dict": {"r": value}, "ref": value}[kind]) as s:
        rec = s[0] if kind == "list" else s["r"] if kind == "dict" else s.get()
        for obj in (s, rec, rec["l"], rec["l"][1], rec["t"]):
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            assert len(data) < 256, (type(obj).__name__, len(data))
            assert len(pickle.dumps(obj, protocol=2)) < 256
            back = pickle.loads(data)
            assert type(back) is type(obj)
        assert pickle.loads(pickle.dumps(rec["l"])) == [1, [2]]
        assert pickle.loads(pickle.dumps(rec["t"])) == (3, 4)
        assert pickle.loads(pickle.dumps(rec))["blob"] == value["blob"]
        # The same from a saved file.
        path = tmp_path / "p.shmstore"
        s.save(path)
        f = CLASSES[kind].open(path)
        frec = f[0] if kind == "list" else f["r"] if kind == "dict" else f.get()
        for obj in (f, frec["l"]):
            assert len(pickle.dumps(obj)) < 256
        assert pickle.loads(pickle.dumps(frec["l"])) == [1, [2]]
        f.close()


def test_unpickled_handle_reads_the_same_store(records):
    with shmstore.SharedList(records) as s:
        back = pickle.loads(pickle.dumps(s))
        assert type(back) is shmstore.SharedList
        assert back.name == s.name and back.to_python() == records
        back.close()
        assert (segment_dir() / s.name).exists()  # an unpickled handle does not own the name


def test_pickles_name_their_function_in_the_package(records):
    """Handles, chunks, views and channels pickle as a call of `shmstore.<function>` (one
    top-level module to import), whatever the protocol and through `copy` too; a pickle
    naming the same function in `shmstore._native` (as older versions wrote) still loads."""
    import copy
    import pickletools

    def global_of(data: bytes) -> tuple[str, str]:
        """The first global a pickle names (GLOBAL's text, or STACK_GLOBAL's two strings)."""
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                module, name = arg.split(" ")
                return module, name
            if op.name == "STACK_GLOBAL":
                return strings[-2], strings[-1]
            if isinstance(arg, str):
                strings.append(arg)
        raise AssertionError("no global")

    ch = shmstore.Channel(4)
    with shmstore.SharedList(records) as s:
        ref = shmstore.put(np.arange(5))
        cases = [(s, "_rebuild"), (ref, "_rebuild_chunk"), (s[0], "_rebuild_view")]
        cases += [(ch, "_rebuild_channel")]
        for obj, name in cases:
            fn = getattr(shmstore, name)
            assert fn is getattr(shmstore._native, name) and fn.__module__ == "shmstore"
            for proto in range(pickle.HIGHEST_PROTOCOL + 1):
                data = pickle.dumps(obj, protocol=proto)
                assert global_of(data) == ("shmstore", name), (proto, name)
                assert type(pickle.loads(data)) is type(obj)
            if obj is not ch:
                assert obj.__reduce_ex__(2) == obj.__reduce__()
        assert copy.copy(ref).get().tolist() == [0, 1, 2, 3, 4]
        assert copy.deepcopy(s[0]) == s[0]
        old = pickle.dumps(ref, protocol=2).replace(b"cshmstore\n", b"cshmstore._native\n")
        assert global_of(old) == ("shmstore._native", "_rebuild_chunk")
        assert pickle.loads(old).get().tolist() == [0, 1, 2, 3, 4]
        ref.close()
    ch.close()


def test_verify_accepts_a_fresh_store(records):
    with shmstore.SharedList(records) as s, shmstore.SharedDict(enumerate(records)) as d:
        s.verify()
        d.verify()


def test_error_hierarchy():
    E = shmstore
    assert issubclass(E.StoreNotFoundError, (E.ShmStoreError, FileNotFoundError))
    for cls, builtin in [
        (E.StoreNotFoundError, FileNotFoundError),
        (E.CorruptStoreError, ValueError),
        (E.UnsupportedTypeError, TypeError),
        (E.StoreClosedError, ValueError),
        (E.OutOfSharedMemoryError, MemoryError),
        (E.StoreExistsError, FileExistsError),
        (E.InvalidInputError, ValueError),
    ]:
        assert issubclass(cls, E.ShmStoreError) and issubclass(cls, builtin), cls
        assert cls.__module__ == "shmstore"
    assert issubclass(E.ShmStoreError, Exception)


def test_get_many_reads_a_batch_in_order(records):
    with shmstore.SharedList(records) as lst:
        idx = [7, 2, -1, 0, 7, np.int64(3)]
        got = lst.get_many(idx)
        assert isinstance(got, list)
        assert [r.to_python() for r in got] == [records[int(i)] for i in idx]
        assert lst.get_many([]) == []
        assert [r["image_id"] for r in lst.get_many(range(3))] == [
            records[i]["image_id"] for i in range(3)
        ]
        with pytest.raises(IndexError, match="out of range"):
            lst.get_many([0, len(records)])
        with pytest.raises(TypeError):
            lst.get_many([0, "1"])
    with pytest.raises(shmstore.StoreClosedError):
        lst.get_many([0])


def test_dataset_getitems_is_a_batch_of_getitem(records):
    """What DataLoader calls for a whole batch when the dataset has it."""
    import shmstore.torch as st

    with shmstore.SharedList(records) as lst:
        plain = st.SharedListDataset(lst)
        assert [r.to_python() for r in plain.__getitems__([3, 1])] == [records[3], records[1]]
        ids = st.SharedListDataset(lst, transform=lambda r: r["image_id"])
        assert ids.__getitems__([5, 0]) == [ids[5], ids[0]]


def test_a_large_array_is_hashed_as_written_and_verify_finds_a_changed_byte(tmp_path):
    """A payload of 16 MiB or more is hashed on a second thread while it is written
    (docs/api.md, "Putting large arrays"): the stored checksum is that of the bytes written,
    so `verify()` passes, and finds a byte changed afterwards."""
    data = np.random.default_rng(3).integers(0, 255, (24 << 20) + 4099, dtype=np.uint8)
    path = tmp_path / "large.shm"
    with shmstore.put(data, arena=False) as ref:
        got = ref.get()
        assert np.array_equal(got, data)
        ref.verify()
        ref.save(path)
        del got
    with shmstore.Ref.open(path) as opened:
        opened.verify()
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        at = raw.index(data[(20 << 20) : (20 << 20) + 64].tobytes())
        f.seek(at + 7)
        f.write(bytes([raw[at + 7] ^ 0x10]))
    with (
        shmstore.Ref.open(path) as opened,
        pytest.raises(shmstore.CorruptStoreError, match="modified"),
    ):
        opened.verify()


LAZY_TOOLS = r"""
import sys
import shmstore
heavy = ("multiprocessing", "subprocess", "tempfile", "tracemalloc", "csv",
         "shmstore.cow", "shmstore.leaks", "shmstore.memory")
print(sorted(m for m in heavy if m in sys.modules))
print("cow" in dir(shmstore), shmstore.cow.__name__)
from shmstore import leaks
import shmstore.memory
print(leaks.__name__, shmstore.memory.__name__, shmstore.leaks is leaks)
ns = {}
exec("from shmstore import *", ns)
print(sorted(n for n in ("cow", "leaks", "memory", "put") if n in ns))
try:
    shmstore.no_such_thing
except AttributeError as e:
    print(e)
"""


def test_importing_the_package_leaves_the_tools_beside_it_for_their_first_use():
    """``import shmstore`` in a fresh process (a spawned worker that only reads) does not
    import ``cow``, ``leaks`` and ``memory`` and the standard library they need (~75 ms of
    start-up); each is there on first use, by attribute, ``from`` import or ``import``."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", LAZY_TOOLS], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out == [
        "[]",
        "True shmstore.cow",
        "shmstore.leaks shmstore.memory True",
        "['cow', 'leaks', 'memory', 'put']",
        "module 'shmstore' has no attribute 'no_such_thing'",
    ], out
