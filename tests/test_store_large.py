"""Archives larger than 4 GiB (64-bit offsets everywhere). Slow-marked; CI runs them.

Memory: the arrays are np.zeros (calloc: untouched pages are the shared zero page and cost no
RAM) with a few marker bytes written, so the only real memory is the archive in /dev/shm.
One archive exists at a time, a little over 4 GiB (the least that puts data past 2**32).
A test that would not find room for it, in its segment directory's filesystem or in memory
(tmpfs pages are RAM or swap), is skipped and says how much it needed and found."""

from __future__ import annotations

import gc
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import shmstore
from conftest import run_checked, segment_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_segments")]

GiB = 1 << 30
MiB = 1 << 20
# Room asked for beyond the data: the archive's own bytes (header, index, alignment) are far
# less; the rest is slack for the directory's metadata and the test process.
MARGIN = 64 * MiB


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _memory_free() -> int:
    """MemAvailable + SwapFree from /proc/meminfo, in bytes: what a tmpfs file may still use."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024  # kB
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def _room_for(nbytes: int) -> None:
    """Skip the test unless its segment directory's filesystem and memory both hold
    ``nbytes`` of data plus ``MARGIN``."""
    need = nbytes + MARGIN
    d = segment_dir()
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    if free < need:
        pytest.skip(f"{d} has {_gib(free)} free (statvfs), the test needs {_gib(need)}")
    memory = _memory_free()
    if memory < need:
        pytest.skip(f"{_gib(memory)} of memory available (RAM + swap), the test needs {_gib(need)}")


def _marked(size: int, mark: int) -> np.ndarray:
    a = np.zeros(size, dtype=np.uint8)
    a[:8] = mark
    a[size // 2] = mark
    a[-8:] = mark
    return a


def _mapping_start(path: Path) -> int:
    st = os.stat(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) == st.st_ino:
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) == st.st_dev:
                    return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"{path} is not mapped")


def test_shared_list_larger_than_4gib():
    n, size = 4, GiB + 32 * MiB  # the last big record ends past 4 GiB
    _room_for(n * size + 1000)

    def records():  # streamed: one big array alive at a time
        for i in range(n):
            yield {"i": i, "data": _marked(size, 10 + i), "tail": [i, "x" * i]}
        # A last, small record that lies entirely past 4 GiB.
        yield {"i": n, "data": _marked(1000, 10 + n), "tail": [n, "x" * n]}

    with shmstore.SharedList(records(), dir=segment_dir()) as lst:
        assert lst.nbytes > 4 * GiB
        assert len(lst) == n + 1
        base = _mapping_start(segment_dir() / lst.name)
        for i in (0, n - 1, n, -1, -2):
            j = i % (n + 1)
            rec = lst[i]
            assert rec["i"] == j and rec["tail"] == [j, "x" * j]
            data = rec["data"]
            length = size if j < n else 1000
            assert data.shape == (length,) and data.dtype == np.uint8
            assert not data.flags.writeable
            assert data[:8].tolist() == [10 + j] * 8
            assert data[length // 2] == 10 + j and data[length // 2 - 1] == 0
            assert data[-8:].tolist() == [10 + j] * 8
        last = lst[-1]["data"]
        assert last.__array_interface__["data"][0] - base > 4 * GiB  # offsets past 2**32
        big_end = lst[n - 1]["data"]
        assert big_end.__array_interface__["data"][0] + size - base > 4 * GiB
        # Views whose positions are past 4 GiB pickle and unpickle (u64 positions).
        view = lst[-1]["tail"]
        assert pickle.loads(pickle.dumps(view)) == [n, "x" * n]
        assert pickle.loads(pickle.dumps(lst[-1]))["i"] == n
        lst.verify()
        assert [r["i"] for r in lst] == list(range(n + 1))
        # Another process reads the end of the archive.
        code = (
            "import shmstore\n"
            f"lst = shmstore.SharedList.attach({lst.name!r})\n"
            "d = lst[-2]['data']\n"
            "print(lst[-1]['i'], int(d[-1]), int(d[len(d) // 2]), lst.nbytes)\n"
        )
        proc = run_checked([sys.executable, "-c", code])
        expected = [str(n), str(10 + n - 1), str(10 + n - 1), str(lst.nbytes)]
        assert proc.stdout.split() == expected
        del rec, data, last, big_end, view
    gc.collect()


def test_put_of_one_array_larger_than_4gib():
    size = 4 * GiB + 64 * MiB
    _room_for(size)
    arr = _marked(size, 7)
    arr[(1 << 32) - 1] = 1  # around the 32-bit boundary
    arr[1 << 32] = 2
    with shmstore.put(arr, dir=segment_dir()) as ref:
        del arr
        gc.collect()
        assert ref.nbytes > size
        got = ref.get()
        assert got.shape == (size,) and got.dtype == np.uint8
        assert got[:8].tolist() == [7] * 8 and got[-8:].tolist() == [7] * 8
        assert got[size // 2] == 7
        assert got[(1 << 32) - 1] == 1 and got[1 << 32] == 2 and got[(1 << 32) + 1] == 0
        assert got[-9] == 0
        ref.verify()
        del got
    gc.collect()
