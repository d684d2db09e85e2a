"""Hostile archives with valid checksums: each once crashed a reader (stack overflow,
PanicException) or raised the wrong exception (OverflowError, TypeError). Every read path
must now give CorruptStoreError (docs/security.md). The archives are made by the Rust
side (`_native._crafted_archive`, src/archive/fuzz.rs)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import shmstore
from shmstore import _native

HOOKS = hasattr(_native, "_crafted_archive")
pytestmark = pytest.mark.skipif(
    not HOOKS,
    reason="the fuzzer's testing hooks are not in this build of shmstore._native "
    "(cargo feature 'fuzzing': `make build` has it, wheels do not)",
)

# Every named attack the Rust side crafts (src/archive/fuzz.rs, `CRAFTED`), but those at
# the depth limits (their names end in "-ok"), which are valid.
ATTACKS = [name for name in _native._crafted_names() if not name.endswith("-ok")] if HOOKS else []


def _save(tmp_path: Path, name: str) -> Path:
    p = tmp_path / (name.replace("^", "") + ".shmstore")
    p.write_bytes(_native._crafted_archive(name))
    return p


def _read_paths(path: Path) -> dict[str, object]:
    """Each read path a user has, run on its own; its exception (or None)."""
    out: dict[str, object] = {}

    def attempt(what: str, f) -> None:  # type: ignore[no-untyped-def]
        try:
            f()
            out[what] = None
        except BaseException as e:  # PanicException is a BaseException
            out[what] = e

    def get():  # type: ignore[no-untyped-def]
        return shmstore.Ref.open(path).get()

    def plain(v):  # type: ignore[no-untyped-def]
        return v.to_python() if isinstance(v, (shmstore.ListView, shmstore.DictView)) else v

    attempt("open+verify", lambda: shmstore.Ref.open(path).verify())
    attempt("get", get)
    attempt("to_python", lambda: plain(get()))
    attempt("==", lambda: get() == get())
    attempt("repr", lambda: repr(get()))
    attempt("iterate", lambda: list(get()) if hasattr(get(), "__iter__") else None)
    attempt("put(view)", lambda: shmstore.put(get()).close())
    attempt("pickle", lambda: pickle.loads(pickle.dumps(get())))

    def lookups():  # type: ignore[no-untyped-def]
        v = get()
        if isinstance(v, shmstore.DictView):
            for k in v:
                _ = v[k], k in v, v.get(k)
            _ = "b" in v

    attempt("lookups", lookups)
    return out


@pytest.mark.parametrize("attack", ATTACKS)
def test_hostile_archive_gives_corrupt_store_error(tmp_path, attack):
    path = _save(tmp_path, attack)
    results = _read_paths(path)
    wrong = {
        w: f"{type(e).__name__}: {e}"
        for w, e in results.items()
        if e is not None and not isinstance(e, shmstore.CorruptStoreError)
    }
    assert not wrong, wrong
    # Every attack is noticed by the full check: verify() refuses whatever a read refuses.
    assert isinstance(results["open+verify"], shmstore.CorruptStoreError), results


def test_deepest_valid_nesting_reads_back_and_puts_again(tmp_path):
    """Containers nested as deep as a writer makes them (100), and a key of tuples nested as
    deep as a key may be (32) in the deepest dict, read back, and ``put`` takes the view
    back: the reader refuses exactly what a writer cannot make (docs/format.md, "Depth")."""
    for name, key_depth in (("deep-ok", 0), ("deep-key-ok", 32)):
        path = _save(tmp_path, name)
        with shmstore.Ref.open(path) as r:
            r.verify()
            view = r.get()
            v = view.to_python()
            depth = 0
            while isinstance(v, list) and v:
                v, depth = v[0], depth + 1
            if key_depth:
                assert isinstance(v, dict)
                (key,) = v
                depth, keys = depth + 1, 0
                while isinstance(key, tuple):
                    key, keys = key[0], keys + 1
                assert (keys, key) == (key_depth, 7)
            assert depth == 100
            with shmstore.put(view) as again:
                assert again.get() == view


@pytest.mark.parametrize("name", ["deep-limit", "deep-key-limit"])
def test_one_level_deeper_than_a_writer_makes_is_corrupt(tmp_path, name):
    path = _save(tmp_path, name)
    with shmstore.Ref.open(path) as r:
        with pytest.raises(shmstore.CorruptStoreError, match=r"deeper than (100|32) levels"):
            r.get().to_python()
        with pytest.raises(shmstore.CorruptStoreError):
            r.verify()


def test_too_deep_is_corrupt_in_a_thread_with_a_small_stack(tmp_path):
    """The depth limits hold where recursion hurts first: a worker thread with a 512 KiB
    stack (CPython's default thread stack is 8 MiB on Linux)."""
    paths = {
        name: _save(tmp_path, name) for name in ("deep", "deep-mixed", "deep-limit", "deep-ok")
    }
    script = r"""
import sys, threading
import shmstore
results = {}
def work():
    for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            r = shmstore.Ref.open(path)
            r.verify()
            v = r.get()
            v.to_python(); v == v; repr(v)
            shmstore.put(v).close()
            results[name] = "ok"
        except shmstore.CorruptStoreError:
            results[name] = "corrupt"
        except BaseException as e:
            results[name] = f"{type(e).__name__}: {e}"
threading.stack_size(512 * 1024)
t = threading.Thread(target=work)
t.start()
t.join()
print(results)
"""
    args = [str(x) for kv in paths.items() for x in kv]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert eval(proc.stdout) == {
        "deep": "corrupt",
        "deep-mixed": "corrupt",
        "deep-limit": "corrupt",
        "deep-ok": "ok",
    }


def test_worker_thread_small_stack_in_process(tmp_path):
    """Same in this process (no crash means pytest survives)."""
    path = _save(tmp_path, "deep")
    caught: list[BaseException] = []

    def work() -> None:
        try:
            shmstore.Ref.open(path).get()
        except BaseException as e:
            caught.append(e)

    old = threading.stack_size(512 * 1024)
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    assert len(caught) == 1 and isinstance(caught[0], shmstore.CorruptStoreError), caught
    assert "record 0" in str(caught[0])


def test_misses_in_large_stored_dicts_are_plain_misses(tmp_path):
    """A lookup that misses in a stored dict with a hash index (> 8 entries) checks the
    record's indexes once; for a dict a writer made, that check passes: `in` is False, `get`
    gives the default, `[]` raises KeyError — never CorruptStoreError."""
    rec = {f"field{i}": i for i in range(40)} | {(1, "t"): 1, 2.5: 2, None: 3, b"b": 4}
    with shmstore.SharedList([rec, {"inner": rec}]) as lst:
        for v in (lst[0], lst[1]["inner"]):
            assert "absent" not in v and 12345 not in v and (9, 9) not in v
            assert v.get("absent", "dflt") == "dflt"
            with pytest.raises(KeyError):
                v["absent"]
            assert v["field39"] == 39 and v[(1, "t")] == 1 and v[None] == 3


@pytest.mark.skipif(not HOOKS, reason="needs the testing hooks (cargo feature 'fuzzing')")
@pytest.mark.parametrize("name", ["general-key-twice", "general-key-twice-indexed"])
def test_a_dict_holding_one_key_twice_is_refused_whole(tmp_path, name):
    """Two stored keys equal in Python's sense (``1`` and ``True``; ``2`` and ``2.0``) would
    make ``to_python()`` one entry shorter than ``len()``: both it and ``verify()`` refuse
    the dict, naming what is wrong."""
    path = _save(tmp_path, name)
    with shmstore.Ref.open(path) as r:
        with pytest.raises(shmstore.CorruptStoreError, match="holds a key twice"):
            r.get().to_python()
        with pytest.raises(shmstore.CorruptStoreError, match="twice"):
            r.verify()


@pytest.mark.skipif(not HOOKS, reason="needs the testing hooks (cargo feature 'fuzzing')")
def test_distinct_general_keys_nans_included_read_back_whole(tmp_path):
    """Keys that only look alike (``2.5``, ``"2"`` and ``(2,)`` beside the int ``2``) are not
    taken for one key twice."""
    path = _save(tmp_path, "general-keys-ok")
    with shmstore.Ref.open(path) as r:
        r.verify()
        d = r.get().to_python()
        assert len(d) == len(r.get()) == 13
        assert (d[2], d[2.5], d["2"], d[(2,)]) == (2, -1, -2, -3)
