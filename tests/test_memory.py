"""shmstore.memory: USS/PSS of a process tree, checked against children of known size."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import shmstore
from shmstore import memory

MiB = 1 << 20
pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/smaps"), reason="needs Linux /proc smaps"
)

# The child allocates N MiB of private memory that it touches (b"x" * n writes every page),
# maps an optional file and touches it, says "ready", then waits for stdin to close.
CHILD = r"""
import mmap, os, sys
n = int(sys.argv[1])
data = b"x" * (n << 20)
m = None
if len(sys.argv) > 2:
    fd = os.open(sys.argv[2], os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    total = sum(m[i] for i in range(0, len(m), 4096))
print("ready", flush=True)
sys.stdin.read()
"""


def _spawn(mib: int, path: str | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", CHILD, str(mib), *([path] if path else [])]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the child is ready (or EOF if it died)
    assert line.strip() == "ready", f"child failed: {line!r}"
    return proc


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()


@pytest.fixture
def child64() -> Iterator[subprocess.Popen[str]]:
    proc = _spawn(64)
    yield proc
    _finish(proc)


def test_snapshot_of_this_process_is_consistent() -> None:
    snap = memory.snapshot(children=False)
    (me,) = snap.processes
    assert me.pid == os.getpid() and me.name
    assert 0 < me.uss <= me.pss <= me.rss
    assert me.shared <= me.rss
    assert snap.total.pss == me.pss
    assert str(os.getpid()) in str(snap)


def test_forked_child_with_known_allocation(child64: subprocess.Popen[str]) -> None:
    snap = memory.snapshot()  # this process and its children
    assert snap.pids[0] == os.getpid() and child64.pid in snap.pids
    child = snap.by_pid(child64.pid)
    # 64 MiB of private pages plus the interpreter's own (a few MiB)
    assert 64 * MiB <= child.uss <= 64 * MiB + 48 * MiB
    assert child.uss <= child.pss <= child.rss
    assert snap.total.uss == sum(p.uss for p in snap.processes)
    only = memory.snapshot([child64.pid], children=False)
    assert only.pids == [child64.pid]


def test_monitor_sees_a_child_grow_and_reports_it() -> None:
    with memory.Monitor(interval=0.05) as mon:
        proc = _spawn(64)
        try:
            snap = mon.wait_until(
                lambda s: any(p.pid == proc.pid and p.uss >= 64 * MiB for p in s.processes),
                timeout=60,
            )
        finally:
            _finish(proc)
    assert snap.by_pid(proc.pid).uss >= 64 * MiB
    assert mon.peak("uss", pid=proc.pid) >= 64 * MiB
    assert mon.peak("uss") >= 64 * MiB
    assert len(mon.samples) >= 2
    table = mon.table()
    assert "total" in table and "PSS MiB" in table
    csv_text = mon.to_csv()
    header, *rows = csv_text.splitlines()
    assert header == "t,pid,name,rss,pss,uss,shared,swap,shm_pss,shm_private"
    assert any(r.split(",")[1] == str(proc.pid) for r in rows)


def test_segment_pss_is_split_between_the_processes_mapping_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHMSTORE_DIR", str(tmp_path))
    name = f"shmstore-test-{uuid.uuid4().hex[:8]}"
    path = tmp_path / name
    path.write_bytes(b"\x01" * (8 * MiB))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert sum(m[i] for i in range(0, len(m), 4096)) == 2048  # touch every page
        proc = _spawn(1, str(path))
        try:
            snap = memory.snapshot()
        finally:
            _finish(proc)
        mine = snap.by_pid(os.getpid())
        theirs = snap.by_pid(proc.pid)
        assert mine.segments == {name: 4 * MiB}
        assert theirs.segments == {name: 4 * MiB}
        assert mine.shm_pss == theirs.shm_pss == 4 * MiB
        assert snap.total.shm_pss == 8 * MiB
        assert memory.snapshot(segments=False).by_pid(os.getpid()).shm_pss == 0
    finally:
        m.close()


# A second process attaches a store by name, reads every record (which maps every page of
# the segment), and reports its USS before and after: the store's pages are not its own.
READER = r"""
import sys
import shmstore
from shmstore import memory
lst = shmstore.SharedList.attach(sys.argv[1])
before = memory.snapshot(children=False)
total = sum(len(r) for r in lst)  # every record read: every page of the store mapped
after = memory.snapshot(children=False)
b, a = before.processes[0], after.processes[0]
print(b.uss, a.uss, a.shm_private, total, flush=True)
lst.close()
"""


def test_a_lone_reader_does_not_own_the_store_it_reads() -> None:
    """USS of a process that alone maps a store's pages grows by <= 1 MiB while it reads a
    15 MiB store: the pages are the segment's (shm_private), not the reader's."""
    records = [b"r" * 1000 + i.to_bytes(4, "little") for i in range(15_000)]  # ~15 MiB
    with shmstore.SharedList(records) as lst:
        size = os.path.getsize(lst.path)
        assert size >= 14 * MiB
        out = subprocess.run(
            [sys.executable, "-c", READER, lst.name],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    uss_before, uss_after, shm_private, total = map(int, out.split())
    assert total == sum(len(r) for r in records)
    assert uss_after - uss_before <= 1 * MiB, (uss_before, uss_after, shm_private)
    assert shm_private >= size - 1 * MiB  # reported apart: every page, read by this one process


def test_a_shared_memory_file_mapped_alone_is_shm_private_not_uss(tmp_path: Path) -> None:
    """Any file in /dev/shm counts so, not only shmstore's (a plain tmpfs file by path)."""
    path = Path("/dev/shm") / f"memtest-{uuid.uuid4().hex[:8]}"  # not named like a segment
    try:
        path.write_bytes(b"\x01" * (16 * MiB))
    except OSError:
        pytest.skip("no writable /dev/shm")
    try:
        before = memory.snapshot(children=False).processes[0]
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            assert sum(m[i] for i in range(0, len(m), 4096)) == 4096
            after = memory.snapshot(children=False, segments=False).processes[0]
        finally:
            m.close()
    finally:
        path.unlink()
    assert after.shm_private - before.shm_private >= 15 * MiB
    assert after.uss - before.uss <= 4 * MiB


def test_process_tree_without_psutil_matches(
    child64: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with_psutil = memory.process_tree()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    assert memory.process_tree() == with_psutil
    assert child64.pid in with_psutil


def test_exited_process_is_left_out() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    assert memory.snapshot([proc.pid]).processes == ()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    mon = memory.Monitor(interval=1)
    mon.sample()
    mon.sample()
    fig = mon.plot(str(tmp_path / "mem.png"))
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [a.get_ylabel() for a in fig.axes] == ["PSS (MiB)", "USS (MiB)"]
    with pytest.raises(ValueError, match="fields"):
        mon.plot(str(tmp_path / "x.png"), fields=("vms",))


def test_plot_returns_the_figure_or_draws_into_given_axes() -> None:
    """matplotlib's object-API convention: a new Figure when no ``ax``, else the given Axes
    (one per field) drawn into and returned."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    mon = memory.Monitor(interval=1)
    mon.sample()
    mon.sample()
    fig = mon.plot(fields=("uss",))
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    total = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "total"]
    assert len(total) == 1 and len(total[0].get_xdata()) == 2
    mine = Figure()
    ax = mine.add_subplot()
    assert mon.plot(ax=ax, fields=("pss",)) is ax
    assert ax.get_ylabel() == "PSS (MiB)" and ax.get_lines()
    two = mine.subplots(1, 2)
    assert mon.plot(ax=two) is two
    with pytest.raises(ValueError, match="one Axes per field"):
        mon.plot(ax=ax)  # two default fields, one Axes


def test_plot_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    mon = memory.Monitor()
    mon.sample()
    with pytest.raises(ImportError, match=r"shmstore\[plot\]"):
        mon.plot(str(tmp_path / "mem.png"))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="interval"):
        memory.Monitor(interval=0)
    with pytest.raises(ValueError, match="what"):
        memory.Monitor().peak("vms")
    with pytest.raises(KeyError, match="not in this snapshot"):
        memory.snapshot(children=False).by_pid(-5)


def test_a_created_store_is_counted_under_its_public_name() -> None:
    """The creator maps its store under the public name, not ``…part-<id> (deleted)``, so a
    store is one entry of ``segments`` (not two, with its PSS split, under DDP)."""
    with shmstore.SharedList(range(1000)) as lst:
        segs = memory.snapshot(children=False).by_pid(os.getpid()).segments
        assert [k for k in segs if lst.name in k] == [lst.name], segs


def test_build_names_resolve_to_the_public_name_of_the_same_file(tmp_path: Path) -> None:
    from shmstore import _procmaps

    public = tmp_path / "shmstore-x"
    public.write_bytes(b"x")
    st = public.stat()
    ident = (st.st_dev, st.st_ino)
    built = f"{tmp_path}/shmstore-x.part-0123abcd (deleted)"
    assert _procmaps.live_path(built, ident) == str(public)
    assert _procmaps.live_path(built, (st.st_dev, st.st_ino + 1)) is None  # another file
    assert _procmaps.live_path(f"{public} (deleted)", ident) is None  # really unlinked
    assert _procmaps.live_path(str(public), ident) == str(public)
