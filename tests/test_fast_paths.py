"""Every fast path of reading that should be on for this interpreter and build is on
(`shmstore._native._fast_paths()`, src/py/read/fastpaths.rs): a layout assumption that stops
holding (a new pyo3 or CPython) fails here, not silently in a benchmark."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig

import pytest
import shmstore
from shmstore import _native

VIEW_PATHS = [
    "freelist.ListView",
    "freelist.DictView",
    "freelist.ListIter",
    "freelist.DictIter",
    "freelist.RecordIter",
    "freelist.KeyIter",
    "direct.ListView",
    "direct.DictView",
    "direct.ListIter",
    "direct.DictIter",
    "direct.RecordIter",
    "direct.KeyIter",
    "slots.ListView.subscript",
    "slots.DictView.subscript",
    "slots.SharedList.subscript",
    "slots.SharedDict.subscript",
    "slots.ListView.len",
    "slots.DictView.len",
    "slots.ListView.iter",
    "slots.DictView.iter",
    "slots.ListIter.next",
    "slots.DictIter.next",
    "slots.RecordIter.next",
    "slots.KeyIter.next",
    "slots.int_index",
]


def _abi3() -> bool:
    return ".abi3." in os.path.basename(_native.__file__)


def _free_threaded() -> bool:
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def test_every_fast_path_this_build_should_have_is_on() -> None:
    paths = _native._fast_paths()
    assert set(VIEW_PATHS) <= set(paths), "every view fast path is reported"
    for name in VIEW_PATHS:
        state = paths[name]
        if _abi3():
            # The stable ABI hides the type objects' slots: the views use pyo3's paths.
            assert isinstance(state, str) and "abi3" in state, (name, state)
        else:
            # Without a GIL too: there each thread recycles its views in lists of its own.
            assert state is True, f"{name} is off: {state}"
    if _free_threaded():
        # The types of what reads make are immortal there, so that threads making views in
        # parallel do not take turns at their reference counts.
        assert paths["freethreaded.immortal_view_types"] is True
    else:
        assert "freethreaded.immortal_view_types" not in paths
    avx2 = paths["hash.xxh3_avx2"]
    if platform.machine() == "x86_64" and _has_avx2():
        assert avx2 is True, avx2
    else:
        assert isinstance(avx2, str), avx2


def test_views_made_by_the_fast_paths_read_correctly() -> None:
    """The fast paths are used (on) and give what the slow ones would."""
    lst = shmstore.SharedList([{"a": [1, 2.5, "x"], "b": None}] * 3)
    try:
        rec = lst[1]
        assert rec["a"][2] == "x" and rec["b"] is None and len(rec) == 2
        assert [v.to_python() for v in lst] == [{"a": [1, 2.5, "x"], "b": None}] * 3
        assert list(iter(rec["a"])) == [1, 2.5, "x"]
    finally:
        del rec
        lst.close()


def test_int_indexes_read_the_same_on_either_side_of_the_compact_layout() -> None:
    """An `int` index of one digit (below 2**30) is read from the int object itself
    (`slots.int_index`); larger ones, and other index types, go through the interpreter's
    conversion. Both give the same record, the same negative-index arithmetic and the same
    IndexError, for a list view as for the list."""
    n = 5
    lst = shmstore.SharedList([[i, -i] for i in range(n)])
    try:
        view = lst[1]
        for i in range(-n, n):
            assert lst[i].to_python() == [i % n, -(i % n)]
        for i in (-2, -1, 0, 1):
            assert view[i] == [1, -1][i]
        big = [2**30 - 1, 2**30, -(2**30), 2**40, 2**62, 2**63, 2**64, -(2**64), 2**100]
        for i in big:
            for seq in (lst, view):
                with pytest.raises(IndexError):
                    seq[i]

        class Index:
            def __index__(self) -> int:
                return 3

        # Not an exact int: the interpreter's conversion, the same records.
        assert lst[True].to_python() == [1, -1]
        assert lst[Index()].to_python() == [3, -3]
        assert view[False] == 1
    finally:
        del view
        lst.close()


def test_require_fast_paths_imports_where_they_are_on() -> None:
    """`SHMSTORE_REQUIRE_FAST_PATHS=1` (for CI and benchmark machines) raises at import only
    when a fast path is off for another reason than the build's; here all are on."""
    env = dict(os.environ, SHMSTORE_REQUIRE_FAST_PATHS="1")
    out = subprocess.run(
        [sys.executable, "-c", "import shmstore._native as n; print(len(n._fast_paths()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= len(VIEW_PATHS)
