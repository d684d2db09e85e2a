"""Large arrays: `put` throughput against the plain way to fill a /dev/shm file, the extra memory
`put` needs, and the first attach + get of an array in a fresh process against
`SharedMemory(name)` + `np.ndarray`.

Run: .venv/bin/python benchmarks/bench_arrays.py  ->  benchmarks/results/arrays.md
(`--sizes 256,1024` in MiB; `--repeats 5`). Every ratio is measured side by side in one run:
the approaches alternate within each repeat and the table shows medians. The machine is
measured as it is: no kernel or VM setting is changed unless `--hold-reporting` asks (on a VM
whose balloon hands freed pages back to the host, run as root, that holds the reports while
the large-put rounds run and restores them after). The results say how the machine was.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

# No BLAS thread pool: nothing here uses BLAS, and its idle threads spin on a small machine
# (a fifth of the putting process's CPU samples in a profile of the small-object rounds),
# taking cores from the processes measured, whichever way they exchange objects.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shmstore
from _common import machine_md, md_table, verdict

MiB = 1 << 20
CHUNK = 16 * MiB


# The kernel's free page reporting (a virtio balloon handing freed pages back to the host).
REPORTING = Path("/sys/module/page_reporting/parameters")
# While the large puts run: report no page freed less than this long ago (5 min, the most
# the knob takes).
HOLD_MS = 300_000


# Where a run that holds the reports notes the setting it found, so that the next run puts
# back the machine's own setting when a run was killed (SIGKILL) before it could: a file in
# root's /run, trusted only as root's regular file (not a link) holding a number.
SAVED = Path("/run/shmstore-bench-page-reporting")


def saved_setting() -> str | None:
    """The setting a killed run found and could not put back, if it left its note."""
    try:
        fd = os.open(SAVED, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        text = f.read(32).strip()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or not text.isdigit():
        return None
    return text


def note_setting(value: str) -> None:
    fd = os.open(SAVED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: the setting is put back on the way out


@contextlib.contextmanager
def page_reporting_held(hold: bool) -> Iterator[str]:
    """Keep the balloon from handing the pages each round frees back to the host while the
    large puts are measured, where the kernel lets root say so; restored after (also on
    SIGTERM, SIGINT and SIGHUP; after a SIGKILL, by the next run). Yields the sentence the
    results give about it.

    Without this, on such a VM a round that lands on pages the host must supply again takes
    2-4x as long, for either way of filling, at random: the ratio of medians then says which
    approach met more of those rounds. Holding the reports removes that noise from both
    sides alike. Only with `--hold-reporting` (`hold`): by default the machine is measured as
    it is and nothing is written.
    """
    knob = REPORTING / "min_free_ms"
    if not REPORTING.is_dir():
        yield "The kernel has no free page reporting (no balloon hands freed pages back)."
        return
    if not knob.exists():
        yield (
            "The kernel reports free pages to the host (free page reporting); it offers no "
            "`min_free_ms` to hold the reports, so the rounds ran with it on."
        )
        return
    found = knob.read_text().strip()
    saved = saved_setting()
    # A note left means a run was killed while holding: what it found is the machine's.
    own = saved if saved is not None else found
    if not hold:
        left = (
            f" (an earlier `--hold-reporting` run was killed holding it; its setting was {saved}:"
            " rerun with `--hold-reporting` to restore it)"
            if saved is not None
            else ""
        )
        yield (
            f"Free page reporting was on, as the machine has it (`min_free_ms` {found}){left}; "
            "not changed (`--hold-reporting` holds it during the large puts): rounds that land "
            "on pages the host must supply again take 2-4x as long."
        )
        return
    try:
        note_setting(own)
        knob.write_text(str(HOLD_MS))
    except OSError as e:
        yield (
            f"Free page reporting was on and could not be held (`{knob}`: {e.strerror}): "
            "rounds that land on pages the host must supply again take 2-4x as long."
        )
        return
    print(
        f"holding free page reporting during the large puts: {knob} {own} -> {HOLD_MS}, "
        "put back at the end",
        file=sys.stderr,
    )
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {sig: signal.signal(sig, _stop) for sig in signals}
    try:
        killed = (
            f"; it was found at {found}, left so by an earlier run that was killed"
            if saved is not None
            else ""
        )
        yield (
            f"The VM's free page reporting was held during these rounds: `{knob}` {own} -> "
            f"{HOLD_MS} (no page freed less than 5 minutes ago handed back to the host), then "
            f"put back to {own}{killed}. Both ways of filling then reuse pages the guest "
            "already has (`--hold-reporting`; by default it is left as it is)."
        )
    finally:
        knob.write_text(own)
        SAVED.unlink(missing_ok=True)
        for sig, handler in before.items():
            signal.signal(sig, handler)


def seg_dir() -> Path:
    d = Path(os.environ.get("SHMSTORE_DIR", "/dev/shm"))
    d.mkdir(mode=0o700, exist_ok=True)
    return d


# --- put throughput -----------------------------------------------------------------------


def fallocate_write(a: np.ndarray, d: Path) -> float:
    """The plain way: open a new file in `d`, fallocate, write() the buffer in 16 MiB pieces."""
    path = d / f"bench-arrays-plain-{os.getpid()}"
    mv = memoryview(a).cast("B")
    t = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, len(mv))
        for off in range(0, len(mv), CHUNK):
            view = mv[off : off + CHUNK]
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def shmstore_put(a: np.ndarray, d: Path) -> float:
    t = time.perf_counter()
    ref = shmstore.put(a, dir=str(d))
    dt = time.perf_counter() - t
    ref.unlink()
    ref.close()
    return dt


PEAK_CHILD = r"""
import os, sys, numpy as np, shmstore
n, d = int(sys.argv[1]), sys.argv[2]
a = np.ones(n, dtype=np.uint8)          # faulted in: part of the baseline
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")   # reset VmHWM to the current RSS
before = status("VmRSS:")
ref = shmstore.put(a, dir=d)
peak = status("VmHWM:")
ref.unlink(); ref.close()
print(peak - before)
"""


def peak_extra(nbytes: int, d: Path) -> int:
    """Peak RSS growth of a fresh process while it puts an array of `nbytes` (array excluded)."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(nbytes), str(d)],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip())


# --- first attach + get in a fresh process ------------------------------------------------------

ATTACH_CHILD = r"""
import sys, time, numpy as np, shmstore
from multiprocessing import resource_tracker, shared_memory
# Attaching must not register the segment (the tracker would unlink it at exit, and starting
# the tracker process would be timed): what `track=False` of Python 3.13 does.
resource_tracker.register = lambda *args: None
how, name, d, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t = time.perf_counter()
if how == "shmstore":
    a = shmstore.Ref.attach(name, dir=d).get()
    x = int(a[n // 2])
else:
    shm = shared_memory.SharedMemory(name)
    a = np.ndarray((n,), dtype=np.uint8, buffer=shm.buf)
    x = int(a[n // 2])
dt = time.perf_counter() - t
print(dt)
"""


def first_attach(how: str, name: str, d: Path, n: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", ATTACH_CHILD, how, name, str(d), str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    # Only the child's own measurement counts (not interpreter start-up or imports).
    return float(out.stdout.strip().splitlines()[-1])


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms"


def bench_large(sizes_mib: list[int], repeats: int, hold: bool) -> tuple[str, list[str]]:
    with page_reporting_held(hold) as reporting:
        return bench_large_rounds(sizes_mib, repeats, reporting)


def bench_large_rounds(sizes_mib: list[int], repeats: int, reporting: str) -> tuple[str, list[str]]:
    d = seg_dir()
    rows: list[list[Any]] = []
    raw: list[str] = []
    attach_rows: list[list[Any]] = []
    for size in sizes_mib:
        n = size * MiB
        a = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        plain, put = [], []
        for r in range(repeats + 1):
            pair = (fallocate_write, shmstore_put) if r % 2 else (shmstore_put, fallocate_write)
            res = {f: f(a, d) for f in pair}
            if r == 0:
                continue  # warm-up: first faults of the allocator, page cache
            plain.append(res[fallocate_write])
            put.append(res[shmstore_put])
        mp, mu = statistics.median(plain), statistics.median(put)
        ratio = (n / mu) / (n / mp)
        extra = peak_extra(n, d)
        rows.append(
            [
                f"{size} MiB",
                f"{n / mp / 1e9:.2f} GB/s",
                f"{n / mu / 1e9:.2f} GB/s",
                f"{ratio:.2f}x",
                verdict(ratio >= 1.0),
                f"{extra / MiB:.2f} MiB ({extra / n:.2%})",
                verdict(extra <= n / 100),
            ]
        )
        raw.append(
            f"{size} MiB: fallocate+write {', '.join(f'{x:.3f}' for x in plain)}; "
            f"put {', '.join(f'{x:.3f}' for x in put)}"
        )

        row, line = attach_size(a, size, repeats)
        attach_rows.append(row)
        raw.append(line)
        del a
    text = "## put of a large uint8 array\n\n"
    text += (
        "`shmstore.put(a)` against the plain way to fill a file in the same directory "
        "(`open` + `posix_fallocate` + `write()` of 16 MiB pieces), alternating, median of "
        f"{repeats} (after one warm-up pair). Peak extra memory: the growth of VmHWM over VmRSS "
        "of a fresh process that holds the (faulted-in) array while it puts it. "
        f"{reporting}\n\n"
    )
    text += md_table(
        [
            "size",
            "fallocate + write",
            "put",
            "put vs plain",
            "target >= 1.0x",
            "peak extra memory",
            "target <= 1 %",
        ],
        rows,
    )
    text += "\n\n" + attach_md(attach_rows, repeats)
    return text, raw


ATTACH_TITLE = "## first `Ref.attach(name).get()` in a fresh process"


def attach_size(a: np.ndarray, size: int, repeats: int) -> tuple[list[Any], str]:
    """First attach + get of the array `a` (`size` MiB) in fresh processes, both ways,
    alternating: (table row, raw timings line)."""
    from multiprocessing import shared_memory

    d = seg_dir()
    n = a.nbytes
    ref = shmstore.put(a, dir=str(d))
    shm = shared_memory.SharedMemory(create=True, size=n)
    np.ndarray((n,), dtype=np.uint8, buffer=shm.buf)[:] = a
    sa, sb = [], []
    try:
        for r in range(repeats):
            order = ("shmstore", "shm") if r % 2 else ("shm", "shmstore")
            for how in order:
                name = ref.name if how == "shmstore" else shm.name
                (sa if how == "shmstore" else sb).append(first_attach(how, name, d, n))
    finally:
        ref.unlink()
        ref.close()
        shm.close()
        shm.unlink()
    ma, mb = statistics.median(sa), statistics.median(sb)
    row = [
        f"{size} MiB",
        fmt_ms(mb),
        fmt_ms(ma),
        f"{ma / mb:.1f}x",
        verdict(ma <= 1e-3 and ma <= 5 * mb),
    ]
    line = (
        f"{size} MiB attach: shmstore {', '.join(f'{x * 1e3:.2f}' for x in sa)} ms; "
        f"SharedMemory {', '.join(f'{x * 1e3:.2f}' for x in sb)} ms"
    )
    return row, line


def attach_md(rows: list[list[Any]], repeats: int) -> str:
    text = ATTACH_TITLE + "\n\n"
    text += (
        "Timed inside a freshly started process (numpy and shmstore already imported), up to "
        "reading one element of the array: `shmstore.Ref.attach(name).get()` against "
        "`SharedMemory(name)` + `np.ndarray`. Median of "
        f"{repeats}, alternating. Importing shmstore connects to a running supervisor "
        "(docs/lifecycle.md), so the attach writes its `USE` on an open connection and does not "
        "wait for the answer.\n\n"
    )
    text += md_table(
        [
            "size",
            "SharedMemory + ndarray",
            "Ref.attach().get()",
            "ratio",
            "target <= 1 ms and <= 5x",
        ],
        rows,
    )
    return text


def attach_only(sizes_mib: list[int], repeats: int, out: Path) -> None:
    """Re-run only the attach table and put it into `out` in place of the one there; the
    other tables stay from the run the file describes, which the new section says."""
    start_load = os.getloadavg()
    rows, raw = [], []
    for size in sizes_mib:
        a = np.random.default_rng(0).integers(0, 255, size * MiB, dtype=np.uint8)
        row, line = attach_size(a, size, repeats)
        rows.append(row)
        raw.append(line)
        del a
    end_load = os.getloadavg()
    load = " / ".join(f"{x:.2f}" for x in start_load)
    section = attach_md(rows, repeats)
    section += (
        f"\n\nThis table alone was re-run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"(`--attach-only`; same machine; load average at start {load}, at the end "
        f"{' / '.join(f'{x:.2f}' for x in end_load)}); the other tables are from the run "
        "described at the top. Raw timings:\n\n"
    )
    section += "\n".join(f"- {line}" for line in raw)
    text = out.read_text() if out.exists() else "# Arrays and small objects\n\n"
    start = text.find(ATTACH_TITLE)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        end = text.find("\n## ", start + len(ATTACH_TITLE))
        end = len(text) if end < 0 else end
        text = text[:start] + section + "\n\n" + text[end:].lstrip("\n")
    # The earlier run's raw attach timings go with its table.
    raw_at = text.find("## raw timings")
    if raw_at >= 0:
        kept = [
            line
            for line in text[raw_at:].split("\n")
            if not (line.startswith("- ") and " MiB attach: " in line)
        ]
        text = text[:raw_at] + "\n".join(kept)
    out.write_text(text)
    print(section)


# --- small objects across processes -------------------------------------------------------------


def small_consumer(conn, q, how: str, n: int) -> None:
    """Receive `n` objects (a pickled Ref, or the object through a Queue or Channel), read
    each, then say done. "transport": only unpickle what came (a handle's fields), read
    nothing."""
    import pickle as pk

    conn.send("ready")
    total = 0
    for _ in range(n):
        if how == "transport":
            pk.loads(conn.recv_bytes())
            continue
        if q is not None:
            a = q.get()
        else:
            ref = pk.loads(conn.recv_bytes())
            a = ref.get()
        total += int(a[-1])
    conn.send(total)


def small_round(how: str, size: int, n: int, ctx: Any) -> float:
    """Seconds per object: put in this process, get (and read) in another."""
    import pickle as pk

    parent, child = ctx.Pipe()
    # A `multiprocessing.Queue` pickles the array; a `shmstore.Channel` writes it once into
    # shared memory and passes its handle through a ring both processes map.
    q = ctx.Queue() if how == "queue" else shmstore.Channel() if how == "channel" else None
    p = ctx.Process(target=small_consumer, args=(child, q, how, n))
    p.start()
    assert parent.recv() == "ready"
    objs = [np.full(size, i % 251, dtype=np.uint8) for i in range(n)]
    keep = []
    fields = []
    if how == "transport":
        # Put before the clock starts: only the handles' fields travel, as a plain tuple
        # (what a chunk's Ref pickles: arena path, offset, size, generation).
        keep = [shmstore.put(a) for a in objs]
        for ref in keep:
            chunk = ref.name.split("@")[1].split(":")
            fields.append((str(ref.path), *(int(x) for x in chunk)))
    t = time.perf_counter()
    for f in fields:
        parent.send_bytes(pk.dumps(f))
    for a in [] if how == "transport" else objs:
        if q is not None:
            q.put(a)
        else:
            ref = shmstore.put(a, arena=(how == "arena"))  # arena=False: a segment
            keep.append(ref)  # the creator keeps its handle until the receiver is done
            parent.send_bytes(pk.dumps(ref))
    total = parent.recv()
    dt = time.perf_counter() - t
    p.join(60)
    assert how == "transport" or total == sum(i % 251 for i in range(n)), total
    for ref in keep:
        ref.close()
    return dt / n


def held_consumer(conn, ch: Any, held: int) -> None:
    """Get `held` objects from the channel and keep them (their leases) until told to go."""
    kept = [ch.get() for _ in range(held)]
    conn.send(sum(int(a[-1]) for a in kept))
    conn.recv()


def bench_held(counts: list[int], rounds: int, repeats: int) -> tuple[str, list[str]]:
    """A channel's put + get in this process while a second process keeps `held` objects
    this process put: what the creator's reuse of chunks costs when others hold many."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    a = np.ones(1024, dtype=np.uint8)
    rows, raw = [], []
    base = None
    for held in counts:
        ch = shmstore.Channel(8192)
        parent, child = ctx.Pipe()
        p = ctx.Process(target=held_consumer, args=(child, ch, held))
        p.start()
        for _ in range(held):
            ch.put(a)
        assert parent.recv() == held
        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            for _ in range(rounds):
                ch.put(a)
                ch.get()
            if r:
                times.append((time.perf_counter() - t) / rounds)
        parent.send("go")
        p.join()
        shmstore._native._arena_release()
        med = statistics.median(times)
        base = med if base is None else base
        rows.append([f"{held:,}", f"{med * 1e6:,.1f} µs", f"{med / base:.1f}x"])
        raw.append(
            f"put + get with {held} held elsewhere, µs: "
            + ", ".join(f"{x * 1e6:.1f}" for x in times)
        )
    text = "\n\n## put + get while another process holds many objects\n\n"
    text += (
        "A `shmstore.Channel` of 1 KiB uint8 arrays: a second process (forkserver) gets "
        "*held* of them and keeps them; then this process puts and gets one at a time "
        f"({rounds} per round, median of {repeats}). The creator's chunks that the holder "
        "still leases are tried again one per `put` (docs/arena.md), so the cost "
        "does not grow with what others hold.\n\n"
    )
    text += md_table(["held elsewhere", "put + get", "vs none held"], rows)
    return text, raw


def bench_small(sizes: list[int], n: int, repeats: int) -> tuple[str, list[str]]:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    hows = ["segment", "arena", "channel", "queue", "transport"]
    rows, raw = [], []
    for size in sizes:
        got: dict[str, list[float]] = {h: [] for h in hows}
        for r in range(repeats + 1):
            order = hows[r % len(hows) :] + hows[: r % len(hows)]
            for how in order:
                dt = small_round(how, size, n, ctx)
                if r:
                    got[how].append(dt)
        med = {h: statistics.median(v) for h, v in got.items()}
        vs_seg = med["segment"] / med["arena"]
        vs_q = med["queue"] / med["channel"]
        rows.append(
            [
                f"{size // 1024} KiB",
                f"{med['segment'] * 1e6:,.0f} µs",
                f"{med['queue'] * 1e6:,.1f} µs",
                f"{med['arena'] * 1e6:,.1f} µs",
                f"{med['channel'] * 1e6:,.1f} µs",
                f"{vs_seg:.1f}x",
                verdict(vs_seg >= 10),
                f"{vs_q:.1f}x",
                verdict(vs_q >= 2),
                f"{med['queue'] / med['arena']:.1f}x",
                f"{med['transport'] * 1e6:,.1f} µs",
            ]
        )
        raw.append(
            f"{size // 1024} KiB small objects, µs per object: "
            + "; ".join(f"{h} {', '.join(f'{x * 1e6:.0f}' for x in v)}" for h, v in got.items())
        )
        shmstore._native._arena_release()
    text = "\n\n## small objects: put in one process, get in another\n\n"
    text += (
        f"{n} uint8 arrays per run, each put by this process and read by a consumer process "
        "(forkserver). *segment per object*: `put(a, arena=False)`, the pickled `Ref` sent "
        "through a Pipe. *arena*: `put(a)` (a chunk of this process's arena, the default), the "
        "pickled `Ref` sent through a Pipe; the creator keeps its handles until the consumer "
        "is done (docs/arena.md). *channel*: `shmstore.Channel.put(a)` / `.get()`: the array "
        "written once into a chunk of the arena, its handle passed through a ring in shared "
        "memory (docs/channel.md). *Queue*: the array itself through a "
        "`multiprocessing.Queue`. Time from the first put until the consumer has read the "
        f"last, per object; median of {repeats}, the five ways alternating. "
        "`OPENBLAS_NUM_THREADS=1` in all processes (idle BLAS threads spin and take cores from "
        "either side).\n\n"
        "*arena vs Queue* is the Ref-through-a-Pipe way: a handle sent through a pipe pays "
        "the pipe's own cost, measured by *handle transport only* (the fields a chunk's `Ref` "
        "pickles, as a plain tuple, pickled, sent, received and unpickled, with no put, "
        "attach or get), which is why that way stays near the Queue at 1-8 KiB; the channel's "
        "ring makes no system call per object while both sides keep up (the arena's lock "
        "operations remain: docs/arena.md).\n\n"
    )
    text += md_table(
        [
            "size",
            "segment per object",
            "Queue",
            "arena",
            "channel",
            "arena vs segment",
            "target >= 10x",
            "channel vs Queue",
            "target >= 2x",
            "arena vs Queue",
            "handle transport only",
        ],
        rows,
    )
    return text, raw


def bench_fragmentation(ops: int) -> tuple[str, list[str]]:
    sim = shmstore._native._arena_simulate
    rows, raw = [], []
    for hi, policy in [(h, p) for h in (1, 8) for p in ("best-fit", "first-fit")]:
        r = sim(policy, ops, lo=64, hi=hi * MiB, live_target=1000, seed=1)
        ratio = r["peak_end"] / r["peak_live"]
        rows.append(
            [
                f"{hi} MiB",
                "best fit + coalescing (the arena)"
                if policy == "best-fit"
                else "first fit, no coalescing",
                f"{r['peak_live'] / MiB:,.1f} MiB",
                f"{r['peak_end'] / MiB:,.1f} MiB",
                f"{ratio:.2f}x",
                verdict(ratio <= 1.3) if policy == "best-fit" else "",
                f"{r['seconds']:.2f} s",
            ]
        )
        raw.append(f"{policy}, up to {hi} MiB: {r}")
    text = "\n\n## fragmentation: random put/free\n\n"
    text += (
        f"{ops:,} operations on the same seeded sequence for both allocators (the arena's "
        "allocator, src/arena/alloc.rs, in a simulation without I/O): sizes log-uniform "
        "from 64 B to 1 MiB (any object an arena takes) and to 8 MiB (arrays and bytes, "
        "docs/arena.md); a put is twice as likely as a free below 1000 live objects, a free "
        "twice as likely above; a free takes a random live object. Arena bytes = the "
        "highest end of the region (it only grows), against the peak of the live bytes.\n\n"
    )
    text += md_table(
        [
            "largest object",
            "allocator",
            "peak live",
            "arena bytes",
            "ratio",
            "target <= 1.3x",
            "simulation time",
        ],
        rows,
    )
    return text, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="256,1024", help="array sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "arrays.md"))
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument(
        "--attach-only",
        action="store_true",
        help="run only the first-attach table and replace it in --out (the rest is kept)",
    )
    ap.add_argument(
        "--hold-reporting",
        action="store_true",
        help="as root on a VM with free page reporting, hold it during the large-put rounds "
        "and restore it after (by default no kernel or VM setting is changed)",
    )
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-fragmentation", action="store_true")
    ap.add_argument("--skip-held", action="store_true")
    ap.add_argument("--small-sizes", default="1,8,64", help="small object sizes in KiB")
    ap.add_argument("--small-n", type=int, default=2000, help="small objects per run")
    ap.add_argument("--ops", type=int, default=1_000_000, help="fragmentation operations")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.attach_only:
        attach_only(sizes, args.repeats, Path(args.out))
        return
    parts = ["# Arrays and small objects\n", machine_md(), ""]
    raw: list[str] = []
    if not args.skip_large:
        text, r = bench_large(sizes, args.repeats, args.hold_reporting)
        parts.append(text)
        raw += r
    if not args.skip_small:
        text, r = bench_small(
            [int(k) * 1024 for k in args.small_sizes.split(",") if k], args.small_n, args.repeats
        )
        parts.append(text)
        raw += r
    if not args.skip_held:
        text, r = bench_held([0, 100, 5000], 500, args.repeats)
        parts.append(text)
        raw += r
    if not args.skip_fragmentation:
        text, r = bench_fragmentation(args.ops)
        parts.append(text)
        raw += r
    parts.append(
        f"\nLoad average at the end (1/5/15 min): {' / '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    parts.append("\n## raw timings (s unless marked)\n")
    parts += [f"- {line}" for line in raw]
    out = Path(args.out)
    out.write_text("\n".join(parts) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
