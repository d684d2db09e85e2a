"""Honest memory figures for a process tree: USS, PSS, RSS, shared and swap per process.

RSS counts every shared page in full in every process that maps it, so a dataset shared by
eight workers looks eight times as big. PSS divides each shared page among the processes
that map it (the sum over processes is the real footprint); USS counts the pages no other
process maps that the process owns: its private memory, what killing it gives back. Pages of
a *shared-memory file* (a shmstore segment, any file in /dev/shm or another tmpfs, a memfd,
System V shared memory) that only this process maps are not in USS: they belong to the file,
which keeps them after the process exits, so a lone reader of a store does not look as if it
owned the store. They are reported apart as ``shm_private``. RSS, PSS and the rest come from
``/proc/PID/smaps_rollup`` (Linux >= 4.14; older kernels: summed from ``/proc/PID/smaps``);
``shm_private`` is read per mapping from ``/proc/PID/smaps`` (only when the process maps a
shared-memory file at all).

The PSS of shmstore segments (mappings of ``$SHMSTORE_DIR/shmstore-*``, default /dev/shm)
is read per process from ``/proc/PID/smaps``.

Example::

    >>> from shmstore import memory
    >>> snap = memory.snapshot()                      # this process and its children
    >>> snap.total.pss > 0
    True
    >>> with memory.Monitor(interval=0.1) as mon:     # background sampling
    ...     data = bytearray(50 << 20)
    >>> mon.peak("uss") >= 50 << 20                   # doctest: +SKIP
    True
"""

from __future__ import annotations

import csv
import importlib
import io
import os
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _procmaps, _segments

__all__ = [
    "FIELDS",
    "Monitor",
    "ProcessMemory",
    "Snapshot",
    "process_tree",
    "segment_dir",
    "snapshot",
]

#: The per-process figures, in bytes.
FIELDS = ("rss", "pss", "uss", "shared", "swap", "shm_pss", "shm_private")
_ROLLUP_KEYS = {
    "Rss": "rss",
    "Pss": "pss",
    "Shared_Clean": "shared",
    "Shared_Dirty": "shared",
    "Private_Clean": "uss",
    "Private_Dirty": "uss",
    "Private_Hugetlb": "uss",
    "Swap": "swap",
}


def segment_dir() -> str:
    """Where shmstore segments live: ``$SHMSTORE_DIR``, else /dev/shm."""
    return str(_segments.segment_dir())


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process (or the total of a snapshot), in bytes."""

    pid: int
    name: str
    rss: int = 0
    pss: int = 0
    uss: int = 0
    shared: int = 0
    swap: int = 0
    #: PSS of the shmstore segments the process maps.
    shm_pss: int = 0
    #: Pages of shared-memory files (tmpfs, /dev/shm, memfd, SysV) that only this process
    #: maps: left out of ``uss``, as the file keeps them after the process exits.
    shm_private: int = 0
    #: ``{segment name: PSS}``; a name ending in " (deleted)" was unlinked but is still mapped.
    segments: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "name": self.name,
            **{f: getattr(self, f) for f in FIELDS},
            "segments": dict(self.segments),
        }


@dataclass(frozen=True)
class Snapshot:
    """Memory of a set of processes at one moment (``time`` from ``time.monotonic()``)."""

    time: float
    processes: tuple[ProcessMemory, ...]

    @property
    def total(self) -> ProcessMemory:
        """Sums over the processes (pid 0, name "total"); PSS and USS add up, RSS does not."""
        sums = {f: sum(getattr(p, f) for p in self.processes) for f in FIELDS}
        segs: dict[str, int] = {}
        for p in self.processes:
            for k, v in p.segments.items():
                segs[k] = segs.get(k, 0) + v
        return ProcessMemory(pid=0, name="total", segments=segs, **sums)

    def by_pid(self, pid: int) -> ProcessMemory:
        """The entry of ``pid``; KeyError if it was not measured."""
        for p in self.processes:
            if p.pid == pid:
                return p
        raise KeyError(f"pid {pid} is not in this snapshot (pids: {self.pids})")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "processes": [p.to_dict() for p in self.processes],
            "total": self.total.to_dict(),
        }

    def __str__(self) -> str:
        return _format_rows([(None, p) for p in (*self.processes, self.total)])


def _mib(n: int) -> str:
    return f"{n / (1 << 20):9.1f}"


def _format_rows(rows: Iterable[tuple[Optional[float], ProcessMemory]]) -> str:
    head = f"{'t (s)':>8} {'pid':>8} {'name':<16}" + "".join(
        f"{f.upper().replace('_', ' ') + ' MiB':>12}" for f in FIELDS
    )
    lines = [head]
    for t, p in rows:
        ts = "" if t is None else f"{t:.2f}"
        lines.append(
            f"{ts:>8} {p.pid or '':>8} {p.name[:16]:<16}"
            + "".join(f"{_mib(getattr(p, f)):>12}" for f in FIELDS)
        )
    return "\n".join(lines)


def _read_rollup(pid: int) -> dict[str, int]:
    out = dict.fromkeys(("rss", "pss", "uss", "shared", "swap"), 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessLookupError(pid) from None
        with open(f"/proc/{pid}/smaps", "rb") as f:  # kernel < 4.14: sum the mappings
            text = f.read().decode("ascii", "replace")
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        target = _ROLLUP_KEYS.get(key)
        if target is not None:
            out[target] += int(rest.split()[0]) * 1024
    return out


def _shmem_devices(pid: int) -> frozenset[int]:
    """The devices of the tmpfs mounts that ``pid`` sees (files there are shared memory)."""
    devs = set()
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            for raw in f:
                # "id parent major:minor root mountpoint options... - fstype source superopts"
                left, sep, right = raw.decode("utf-8", "replace").partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 3 or not right.split():
                    continue
                if right.split()[0] in ("tmpfs", "shmem"):
                    major, _, minor = fields[2].partition(":")
                    if major.isdigit() and minor.isdigit():
                        devs.add(os.makedev(int(major), int(minor)))
    except OSError:
        pass
    return frozenset(devs)


_SHMEM_PATHS = ("/dev/shm/", "/memfd:", "/SYSV")


def _is_shmem_file(entry: _procmaps.MapEntry, devices: frozenset[int]) -> bool:
    """Whether a mapping is of a shared-memory file: a file on tmpfs, a memfd, SysV shm.

    A shared anonymous mapping (``/dev/zero (deleted)``, ``[anon_shmem]``) is not: its pages
    go with the last process that maps it, so they are USS when one process does.
    """
    if entry.ident == (0, 0) or not entry.path.startswith("/"):
        return False
    if entry.path.startswith(_SHMEM_PATHS):
        return True
    return entry.ident[0] in devices and not entry.path.startswith("/dev/zero")


def _maps_shmem_file(pid: int, devices: frozenset[int]) -> bool:
    with open(f"/proc/{pid}/maps", "rb") as f:
        for raw in f:
            e = _procmaps.parse_header(raw.decode("utf-8", "replace"))
            if e is not None and _is_shmem_file(e, devices):
                return True
    return False


def _read_smaps(pid: int, prefix: Optional[str]) -> tuple[dict[str, int], int]:
    """One pass over ``/proc/PID/smaps``: PSS per shmstore segment (when ``prefix`` is
    given), and the bytes of shared-memory files only this process maps.

    Segments are keyed by public name. One segment may appear as several mappings (summed).
    The process that built a store may show it under its build name
    (``shmstore-X.part-Y (deleted)``): it is counted under ``shmstore-X`` when that name is
    the same file, so a segment never appears twice. A name still ending in " (deleted)" was
    unlinked while mapped: it still costs memory.

    A shared-memory file's private pages are Private_Clean + Private_Dirty less the
    anonymous (copy-on-write) pages of a private mapping, which are the process's own.
    """
    segs: dict[str, int] = {}
    devices = _shmem_devices(pid)
    shm_private = 0
    current: Optional[str] = None
    shmem = False
    private = anon = 0
    with open(f"/proc/{pid}/smaps", "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace")
            # a header starts with a hex address; a field with its name ("Pss:", "VmFlags:")
            entry = _procmaps.parse_header(line) if line[:1] in _HEX else None
            if entry is not None:
                if shmem:
                    shm_private += max(0, private - anon)
                current = None
                shmem = _is_shmem_file(entry, devices)
                private = anon = 0
                if prefix is not None and entry.path.startswith(prefix):
                    live = _procmaps.live_path(entry.path, entry.ident)
                    current = os.path.basename(live if live is not None else entry.path)
            elif current is not None and line.startswith("Pss:"):
                segs[current] = segs.get(current, 0) + int(line.split()[1]) * 1024
            elif shmem and line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
            elif shmem and line.startswith("Anonymous:"):
                anon += int(line.split()[1]) * 1024
    if shmem:
        shm_private += max(0, private - anon)
    return segs, shm_private


_HEX = frozenset("0123456789abcdef")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return "?"


def process_tree(pid: Optional[int] = None) -> list[int]:
    """``pid`` (default: this process) and all its descendants, parents first."""
    root = os.getpid() if pid is None else pid
    try:
        psutil = importlib.import_module("psutil")  # optional: it lists children everywhere

        try:
            return [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
        except psutil.NoSuchProcess:
            raise ProcessLookupError(root) from None
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out = [root]
    for p in out:
        out.extend(sorted(children.get(p, ())))
    return out


def snapshot(
    pids: Optional[Sequence[int]] = None, *, children: bool = True, segments: bool = True
) -> Snapshot:
    """Measure ``pids`` (default: this process), with their descendants if ``children``.

    Processes that exit while being measured are left out. Reading another user's process
    raises PermissionError.

    Example::

        >>> snap = snapshot()
        >>> snap.by_pid(os.getpid()).uss > 0
        True
    """
    roots = [os.getpid()] if pids is None else list(pids)
    wanted: list[int] = []
    for r in roots:
        try:
            tree = process_tree(r) if children else [r]
        except ProcessLookupError:
            continue
        wanted.extend(p for p in tree if p not in wanted)
    prefix = os.path.join(segment_dir(), _segments.PREFIX)
    procs = []
    now = time.monotonic()
    for pid in wanted:
        try:
            figures = _read_rollup(pid)
            segs: dict[str, int] = {}
            shm_private = 0
            if segments or _maps_shmem_file(pid, _shmem_devices(pid)):
                segs, shm_private = _read_smaps(pid, prefix if segments else None)
            # smaps is read after the rollup: a page faulted in between is in one, not both
            figures["uss"] = max(0, figures["uss"] - shm_private)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except PermissionError as e:
            raise PermissionError(
                f"cannot read /proc/{pid}/smaps_rollup ({e.strerror}); memory figures of "
                "another user's process need root or CAP_SYS_PTRACE"
            ) from e
        procs.append(
            ProcessMemory(
                pid=pid,
                name=_comm(pid),
                shm_pss=sum(segs.values()),
                shm_private=shm_private,
                segments=segs,
                **figures,
            )
        )
    return Snapshot(time=now, processes=tuple(procs))


class Monitor:
    """Sample :func:`snapshot` in a background thread every ``interval`` seconds.

    The process set is re-read at each sample (children that start later are picked up).
    ``samples`` grows until ``max_samples`` (then the oldest are dropped).

    Example::

        >>> mon = Monitor(interval=0.2).start()
        >>> snap = mon.wait_until(lambda s: s.total.pss > 0, timeout=10)
        >>> mon.stop()
        >>> print(mon.table())                              # doctest: +SKIP
    """

    def __init__(
        self,
        pids: Optional[Sequence[int]] = None,
        *,
        interval: float = 0.5,
        children: bool = True,
        segments: bool = True,
        max_samples: Optional[int] = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, not {interval}")
        self.pids = None if pids is None else list(pids)
        self.interval = interval
        self.children = children
        self.segments = segments
        self.max_samples = max_samples
        self.samples: list[Snapshot] = []
        self.started_at: Optional[float] = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def sample(self) -> Snapshot:
        """Take one sample now (also recorded)."""
        snap = snapshot(self.pids, children=self.children, segments=self.segments)
        with self._lock:
            if self.started_at is None:
                self.started_at = snap.time
            self.samples.append(snap)
            if self.max_samples is not None and len(self.samples) > self.max_samples:
                del self.samples[0]
            self._lock.notify_all()
        return snap

    def _run(self) -> None:
        try:
            while True:
                self.sample()
                if self._stop.wait(self.interval):
                    return
        except BaseException as e:  # surfaced by stop() / wait_until()
            self.error = e
            with self._lock:
                self._lock.notify_all()

    def start(self) -> Monitor:
        if self._thread is not None:
            raise RuntimeError("this Monitor is already running; make a new one")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="shmstore-memory-monitor", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (takes one last sample); re-raises a sampling error, if any."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if self.error is None:
                self.sample()
        if self.error is not None:
            raise self.error

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def wait_until(self, predicate: Callable[[Snapshot], bool], timeout: float) -> Snapshot:
        """Block until a new sample satisfies ``predicate``; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            seen = len(self.samples)
            while True:
                for snap in self.samples[seen:]:
                    if predicate(snap):
                        return snap
                seen = len(self.samples)
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.samples[-1] if self.samples else None
                    raise TimeoutError(
                        f"no memory sample matched within {timeout} s; last sample:\n{last}"
                    )
                self._lock.wait(left)

    def _rows(self) -> list[tuple[float, ProcessMemory]]:
        with self._lock:
            samples = list(self.samples)
        t0 = self.started_at or 0.0
        return [(s.time - t0, p) for s in samples for p in (*s.processes, s.total)]

    def peak(self, what: str = "pss", pid: Optional[int] = None) -> int:
        """Largest ``what`` (one of FIELDS) seen, for ``pid`` or (default) the total."""
        if what not in FIELDS:
            raise ValueError(f"what must be one of {FIELDS}, not {what!r}")
        best = 0
        with self._lock:
            for s in self.samples:
                if pid is None:
                    best = max(best, getattr(s.total, what))
                else:
                    best = max(best, *(getattr(p, what) for p in s.processes if p.pid == pid), 0)
        return best

    def table(self) -> str:
        """All samples as a text table (MiB), a total line per sample."""
        return _format_rows(self._rows())

    def to_csv(self, path: Optional[str] = None) -> str:
        """Samples as CSV (bytes; pid 0 is the total); also written to ``path`` if given."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["t", "pid", "name", *FIELDS])
        for t, p in self._rows():
            w.writerow([f"{t:.3f}", p.pid, p.name, *(getattr(p, f) for f in FIELDS)])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(text)
        return text

    def plot(
        self,
        path: Optional[str] = None,
        fields: Sequence[str] = ("pss", "uss"),
        *,
        ax: Any = None,
    ) -> Any:
        """Plot ``fields`` over time, one line per process plus the total (needs matplotlib).

        Follows matplotlib's object API (no pyplot state, no global backend change):

        - ``ax=None``: a new ``matplotlib.figure.Figure`` with one Axes per field, returned.
        - ``ax``: an ``Axes`` (one field) or a sequence of Axes (one per field) to draw into;
          returned as given, so it composes with your own figure.
        - ``path``: also save the figure there (PNG, SVG, PDF... from the file name).

        Raises ImportError naming the extra to install when matplotlib is missing.

        Example::

            >>> mon = Monitor(interval=1); _ = mon.sample()
            >>> fig = mon.plot()                                # doctest: +SKIP
            >>> fig.axes[0].get_ylabel()                        # doctest: +SKIP
            'PSS (MiB)'
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("Monitor.plot needs matplotlib: pip install 'shmstore[plot]'") from e
        for f in fields:
            if f not in FIELDS:
                raise ValueError(f"fields must be among {FIELDS}, not {f!r}")
        fig: Any
        if ax is None:
            fig = Figure(figsize=(7, 3 * len(fields)))
            FigureCanvasAgg(fig)
            axes = [fig.add_subplot(len(fields), 1, i + 1) for i in range(len(fields))]
            result: Any = fig
        else:
            if hasattr(ax, "flat"):  # the array of Axes that Figure.subplots returns
                axes = list(ax.flat)
            else:
                axes = list(ax) if isinstance(ax, (list, tuple)) else [ax]
            if len(axes) != len(fields):
                raise ValueError(
                    f"ax has {len(axes)} Axes for {len(fields)} fields {tuple(fields)}: pass "
                    "one Axes per field (or fields=(...) with one field for a single Axes)"
                )
            fig = axes[0].figure
            result = ax
        series: dict[tuple[int, str], list[tuple[float, ProcessMemory]]] = {}
        for t, p in self._rows():
            series.setdefault((p.pid, p.name), []).append((t, p))
        for i, (f, a) in enumerate(zip(fields, axes)):
            for (pid, name), pts in series.items():
                label = "total" if pid == 0 else f"{name} [{pid}]"
                a.plot(
                    [t for t, _ in pts],
                    [getattr(p, f) / (1 << 20) for _, p in pts],
                    label=label,
                    linewidth=2.0 if pid == 0 else 1.0,
                )
            a.set_ylabel(f"{f.upper()} (MiB)")
            a.grid(True, alpha=0.3)
            if i == 0:
                a.legend(fontsize="small", loc="upper left")
        axes[-1].set_xlabel("time (s)")
        if ax is None:
            fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return result
