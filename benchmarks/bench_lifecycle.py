"""Segment lifecycle benchmarks; writes benchmarks/results/lifecycle.md.

1. Cleanup latency after SIGKILL of all clients: time from the kill to the segment file
   disappearing (busy polling every ~1 ms, no inotify), median and p99 over >= 100 runs,
   with 1 client (the creator) and 3 clients (creator + 2 attached readers); and a mass
   death: 64 / 1000 clients, each with its own segment, gone at once.
2. Create + attach (in another process) + unlink of a 1 KiB store, per operation, against
   ``multiprocessing.shared_memory.SharedMemory`` doing the same.
3. Supervisor RSS with 1, 64 and 1000 clients.
4. Hostile conditions: attach latency of a fresh process while the supervisor is SIGSTOPped
   (with and without a full listen backlog) or its old abstract name is squatted; time to
   release 10k handles; whether a LIST of 100k registered segments arrives complete.

Everything runs in an isolated world: its own segment directory under /dev/shm, its own
supervisor (``SHMSTORE_SUPERVISOR_NAME``), log directory and fallback directory, all removed
at the end; the user's real supervisor and /dev/shm are never touched.

    python benchmarks/bench_lifecycle.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import shmstore
from _common import RESULTS_DIR, machine_md, md_table, verdict, write_result
from shmstore import _native
from shmstore._util import pid_alive

HERE = Path(__file__).resolve()
POLL_S = 0.001  # the polling period of the latency measurement
PAYLOAD = b"\x5a" * 1024  # the "small store" of the overhead comparison
SEALED_MTIME_NSEC = 314_159_265  # src/segment/mod.rs: the writer's seal mark
ROUNDS = 4  # alternating runs of the overhead comparison
LAT_HEADERS = ["clients killed", "runs", "median (ms)", "p99 (ms)", "max (ms)", "p99 <= 2 s"]
MASS_HEADERS = [
    "clients (own segment each)",
    "all unlinked after (s)",
    "supervisor RSS while open (MiB)",
    "<= 2 s",
]


# --- small utilities -----------------------------------------------------------------------


def read_line(fd: int, timeout: float = 60.0) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"no line within {timeout} s (got {buf!r})")
        chunk = os.read(fd, 1)  # byte by byte: several lines may follow on the same pipe
        if not chunk:
            raise EOFError(f"pipe closed after {buf!r}")
        buf += chunk
    return buf.decode().strip()


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting until {what}")
        time.sleep(0.005)


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if v.strip().endswith("kB"):
            out[k] = int(v.split()[0]) * 1024
    return out


def n_processes() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def us(x: float) -> str:
    return f"{x * 1e6:.1f}"


class World:
    """The isolated environment (set in os.environ: children inherit it)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:12]
        self.dir = Path(f"/dev/shm/shmstore_bench-{tag}")
        self.dir.mkdir(mode=0o700)
        self.tmp = Path(tempfile.mkdtemp(prefix="shmstore-bench-"))
        self.name = f"shmstore-bench-{tag}"
        os.environ.update(
            SHMSTORE_DIR=str(self.dir),
            SHMSTORE_SUPERVISOR_NAME=self.name,
            SHMSTORE_SUPERVISOR_GRACE="2",
            SHMSTORE_FALLBACK_DIR=str(self.tmp / "fallback"),
            XDG_RUNTIME_DIR=str(self.tmp / "run"),
            # Generous: on a loaded machine a busy supervisor may miss the default deadline,
            # and these figures are not about deadlines (section 4 uses the default).
            SHMSTORE_SUPERVISOR_TIMEOUT="10",
        )
        for k in ("SHMSTORE_SUPERVISOR", "SHMSTORE_FALLBACK"):
            os.environ.pop(k, None)
        self.children: list[subprocess.Popen[Any]] = []
        self.state_fd: int | None = None

    def child(self, *args: str, **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen([sys.executable, str(HERE), "--child", *args], **kw)
        self.children.append(p)
        return p

    def supervisor_pid(self) -> int:
        info = _native.supervisor_info()
        if info is None:
            raise RuntimeError("no supervisor is running")
        return int(info["pid"])

    def socket_path(self) -> str:
        """The supervisor's socket, through a descriptor of its (private) directory."""
        if self.state_fd is None:
            self.state_fd = os.open(self.tmp / "run" / "shmstore", os.O_RDONLY | os.O_DIRECTORY)
        return f"/proc/self/fd/{self.state_fd}/{self.name}.sock"

    def raw(self, uses: list[str]) -> socket.socket:
        """A raw client connection (what a client says, without a process behind it)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(self.socket_path())
        f = s.makefile("rb")
        for line in [f"HELLO {os.getpid()}", *(f"USE {u}" for u in uses)]:
            s.sendall(line.encode() + b"\n")
            reply = f.readline()
            if not reply.startswith(b"OK"):
                raise RuntimeError(f"supervisor said {reply!r} to {line!r}")
        f.close()
        return s

    def close(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.kill()
            p.communicate()
        # the supervisor exits by itself once idle (grace 2 s); it is ours, so make sure
        sups = [
            int(e.name)
            for e in Path("/proc").iterdir()
            if e.name.isdigit() and _environ_has(int(e.name), self.name)
        ]
        deadline = time.monotonic() + 20
        while any(pid_alive(p) for p in sups) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in sups:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.state_fd is not None:
            os.close(self.state_fd)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _environ_has(pid: int, name: str) -> bool:
    if pid == os.getpid():
        return False
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"SHMSTORE_SUPERVISOR_NAME={name}\0".encode() in env + b"\0"


# --- children --------------------------------------------------------------------------------


def child_main(role: str, args: list[str]) -> None:
    if role == "holder":  # create a store, print its name and path, hold it until stdin closes
        ref = shmstore.put(PAYLOAD, arena=False)
        print(ref.name, _native._store_info(ref)["path"], flush=True)
        sys.stdin.read()
    elif role == "attacher":  # attach NAME, say so, hold it until stdin closes
        ref = shmstore.Ref.attach(args[0])
        assert ref.get() == PAYLOAD
        print("ok", flush=True)
        sys.stdin.read()
    elif role == "timed-attach":  # attach NAME (first contact with the supervisor), time it
        t0 = time.perf_counter()
        ref = shmstore.Ref.attach(args[0])
        print(f"{time.perf_counter() - t0:.6f}", flush=True)
        assert ref.get() == PAYLOAD
    elif role == "release":  # put N stores, then on a line from stdin release them all
        import gc

        refs = [shmstore.put(i, arena=False) for i in range(int(args[0]))]
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.perf_counter()
        refs.clear()
        gc.collect()
        t1 = time.perf_counter()
        _native._flush_drops()
        print(f"{t1 - t0:.6f} {time.perf_counter() - t0:.6f}", flush=True)
        sys.stdin.read()
    elif role in ("overhead-a", "overhead-b"):
        overhead_child(role, args[0], int(args[1]), int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown role {role}")


def overhead_child(role: str, kind: str, n: int, rfd: int, wfd: int) -> None:
    """One side of the create/attach/unlink loop. A creates, sends the name, waits for B to
    attach, read and detach, then unlinks. Each side times its own steps."""
    from multiprocessing import resource_tracker, shared_memory

    times: dict[str, list[float]] = {}

    def note(k: str, dt: float) -> None:
        times.setdefault(k, []).append(dt)

    pc = time.perf_counter
    for _ in range(n):
        if role == "overhead-a":
            t0 = pc()
            if kind == "shmstore":
                h = shmstore.put(PAYLOAD, arena=False)
                name = h.name
            else:
                shm = shared_memory.SharedMemory(create=True, size=len(PAYLOAD))
                shm.buf[: len(PAYLOAD)] = PAYLOAD
                name = shm.name
            t1 = pc()
            os.write(wfd, name.encode() + b"\n")
            read_line(rfd)
            t2 = pc()
            if kind == "shmstore":
                h.unlink()
                h.close()
                del h
            else:
                shm.close()
                shm.unlink()
            t3 = pc()
            note("create", t1 - t0)
            note("unlink", t3 - t2)
            note("total", t3 - t0)
        else:
            name = read_line(rfd)
            t0 = pc()
            if kind == "shmstore":
                r = shmstore.Ref.attach(name)
                ok = r.get() == PAYLOAD
            else:
                s = shared_memory.SharedMemory(name=name)
                # CPython < 3.13 registers an attached segment with the resource tracker,
                # which would unlink it when this process exits (python/cpython#82300).
                resource_tracker.unregister(s._name, "shared_memory")  # type: ignore[attr-defined]
                ok = bytes(s.buf[: len(PAYLOAD)]) == PAYLOAD
            t1 = pc()
            if kind == "shmstore":
                r.close()
                del r
            else:
                s.close()
            t2 = pc()
            assert ok
            note("attach", t1 - t0)
            note("detach", t2 - t1)
            os.write(wfd, b"done\n")
    print(json.dumps(times), flush=True)


# --- 1. cleanup latency ----------------------------------------------------------------------


def _fork_client(attach: str | None) -> tuple[int, str]:
    """Fork a child that creates a store (or attaches ``attach``), reports, then pauses."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if attach is None:
                h = shmstore.put(PAYLOAD, arena=False)
                msg = _native._store_info(h)["path"]
            else:
                h = shmstore.Ref.attach(attach)
                msg = "ok"
            os.write(w, msg.encode() + b"\n")
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    try:
        return pid, read_line(r)
    finally:
        os.close(r)


def cleanup_latency(runs: int, attachers: int) -> list[float]:
    out = []
    for _ in range(runs):
        creator, path_s = _fork_client(None)
        pids = [creator]
        name = Path(path_s).name
        for _ in range(attachers):
            pids.append(_fork_client(name)[0])
        path = Path(path_s)
        t0 = time.perf_counter()
        for p in pids:
            os.kill(p, signal.SIGKILL)
        while path.exists():
            time.sleep(POLL_S)
        out.append(time.perf_counter() - t0)
        for p in pids:
            os.waitpid(p, 0)
    return out


def mass_death(world: World, clients: int) -> tuple[float, int]:
    """``clients`` connections, each using its own segment file, all closed at once (what
    the supervisor sees when as many clients are SIGKILLed together): seconds until the
    last file is gone. Also the supervisor's RSS while they were open."""
    paths = []
    for i in range(clients):
        p = world.dir / f"shmstore-mass-{i:05d}"
        p.write_bytes(PAYLOAD)
        # sealed as shmstore's writer leaves a segment: read-only, its mark in the mtime
        now = time.time_ns()
        os.utime(p, ns=(now, now // 10**9 * 10**9 + SEALED_MTIME_NSEC))
        p.chmod(0o400)
        paths.append(p)
    socks = [world.raw([str(p)]) for p in paths]
    rss = proc_status(world.supervisor_pid())["VmRSS"]
    t0 = time.perf_counter()
    for s in socks:
        s.close()
    while any(p.exists() for p in paths):
        time.sleep(POLL_S)
    return time.perf_counter() - t0, rss


# --- 4. hostile conditions ------------------------------------------------------------------


def timed_attaches(world: World, name: str, runs: int) -> list[float]:
    """Attach times of fresh processes with the default deadline (0.5 s)."""
    env = {k: v for k, v in os.environ.items() if k != "SHMSTORE_SUPERVISOR_TIMEOUT"}
    out = []
    for _ in range(runs):
        p = world.child("timed-attach", name, stdout=subprocess.PIPE, text=True, env=env)
        o, _ = p.communicate(timeout=120)
        out.append(float(o.split()[0]))
    return out


def hostile_attach(world: World, runs: int) -> dict[str, list[float]]:
    """Attach latency of fresh processes (their first round trip with the supervisor)."""
    keeper = world.child("holder", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert keeper.stdout is not None
    name = keeper.stdout.readline().split()[0]
    sup = world.supervisor_pid()
    out: dict[str, list[float]] = {"supervisor running": timed_attaches(world, name, runs)}
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind("\0" + world.name)  # the abstract name older versions used
    squat.listen(1)
    out["old abstract name squatted"] = timed_attaches(world, name, runs)
    squat.close()
    os.kill(sup, signal.SIGSTOP)
    backlog: list[socket.socket] = []
    try:
        out["supervisor SIGSTOPped"] = timed_attaches(world, name, runs)
        for _ in range(10_000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            backlog.append(s)
            try:
                s.connect(world.socket_path())
            except BlockingIOError:
                break
        out["SIGSTOPped, listen backlog full"] = timed_attaches(world, name, runs)
    finally:
        os.kill(sup, signal.SIGCONT)
        for s in backlog:
            s.close()
    keeper.communicate()
    return out


def release_many(world: World, n: int) -> tuple[float, float, float]:
    """A process holding n stores releases them all: (seconds until the handles are gone,
    until the DROPs are sent, until the last file is unlinked)."""
    p = world.child("release", str(n), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    files = [f for f in world.dir.iterdir() if f.name.startswith("shmstore-")]
    t0 = time.perf_counter()
    p.stdin.write("go\n")
    p.stdin.flush()
    released, sent = map(float, p.stdout.readline().split())
    while any(f.exists() for f in files):
        time.sleep(POLL_S)
    gone = time.perf_counter() - t0
    p.communicate()
    return released, sent, gone


def list_many(world: World, n: int) -> tuple[bool, float]:
    """n registrations (names only) on one raw connection; is `supervisor_info()` complete?"""
    keeper = world.child("holder", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert keeper.stdout is not None
    keeper.stdout.readline()
    s = world.raw([])
    f = s.makefile("rb")
    for start in range(0, n, 2000):
        s.sendall(
            b"".join(
                b"USE %s/shmstore-fake-%06d\n" % (str(world.dir).encode(), i)
                for i in range(start, start + 2000)
            )
        )
        for _ in range(2000):
            f.readline()
    t0 = time.perf_counter()
    info = _native.supervisor_info()
    dt = time.perf_counter() - t0
    complete = info is not None and len(info["segments"]) == n + 1
    f.close()
    s.close()
    keeper.communicate()
    return complete, dt


# --- 2. overhead -----------------------------------------------------------------------------


def overhead(world: World, kind: str, n: int) -> dict[str, list[float]]:
    a_r, b_w = os.pipe()  # B -> A
    b_r, a_w = os.pipe()  # A -> B
    a = world.child(
        "overhead-a", kind, str(n), str(a_r), str(a_w), pass_fds=(a_r, a_w), stdout=subprocess.PIPE
    )
    b = world.child(
        "overhead-b", kind, str(n), str(b_r), str(b_w), pass_fds=(b_r, b_w), stdout=subprocess.PIPE
    )
    for fd in (a_r, b_w, b_r, a_w):
        os.close(fd)
    out_a, _ = a.communicate(timeout=600)
    out_b, _ = b.communicate(timeout=600)
    if a.returncode or b.returncode:
        raise RuntimeError(f"overhead children failed ({a.returncode}, {b.returncode})")
    times = {**json.loads(out_a), **json.loads(out_b)}
    warm = n // 10  # the first 10 % of each run are warm-up
    return {k: v[warm:] for k, v in times.items()}


# --- 3. supervisor RSS -----------------------------------------------------------------------


def rss_table(world: World) -> tuple[list[list[str]], dict[int, int]]:
    holder = world.child("holder", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdin is not None
    name, path = holder.stdout.readline().split()
    sup = world.supervisor_pid()
    rows = []
    rss: dict[int, int] = {}

    def measure(clients: int, how: str) -> None:
        st = proc_status(sup)
        rss[clients] = st["VmRSS"]
        rows.append(
            [
                str(clients),
                how,
                f"{st['VmRSS'] / 2**20:.1f}",
                f"{st['VmHWM'] / 2**20:.1f}",
                verdict(st["VmRSS"] <= 20 * 2**20),
            ]
        )

    measure(1, "1 process (the creator)")
    attachers = [
        world.child("attacher", name, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(63)
    ]
    for a in attachers:
        assert a.stdout is not None and a.stdout.readline().strip() == "ok"
    info = _native.supervisor_info()
    assert info is not None and len(info["segments"][path]) == 64, info
    measure(64, "64 processes (creator + 63 attached)")
    for a in attachers:
        a.communicate()
    socks = [world.raw([path]) for _ in range(999)]
    info = _native.supervisor_info()
    assert info is not None and len(info["segments"][path]) >= 2, info
    measure(1000, "creator + 999 raw connections, all using its segment")
    for s in socks:
        s.close()
    holder.communicate()
    return rows, rss


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs (a smoke test)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.child[0], args.child[1:])
        return 0

    runs = 20 if args.quick else 200
    ops = 200 if args.quick else 3000
    world = World()
    try:
        procs_on_machine = n_processes()
        # a long-lived client, so that one supervisor serves the whole latency run
        keeper = world.child("holder", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert keeper.stdout is not None
        keeper.stdout.readline()
        sup = world.supervisor_pid()
        lat1 = cleanup_latency(runs, 0)
        lat3 = cleanup_latency(runs, 2)
        print(f"latency 1 client: median {ms(statistics.median(lat1))} ms", flush=True)
        print(f"latency 3 clients: median {ms(statistics.median(lat3))} ms", flush=True)
        mass = {n: mass_death(world, n) for n in (64, 1000)}
        print("mass death", mass, flush=True)
        assert world.supervisor_pid() == sup, "the supervisor restarted during the run"
        keeper.communicate()

        # alternate the two in rounds, so that a change in the machine's load hits both
        samples: dict[str, dict[str, list[float]]] = {"shmstore": {}, "shm": {}}
        for _ in range(ROUNDS):
            for kind in ("shmstore", "shm"):
                for step, values in overhead(world, kind, ops // ROUNDS).items():
                    samples[kind].setdefault(step, []).extend(values)
        over = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in samples.items()}
        n_ops = len(samples["shm"]["total"])
        print("overhead", over, flush=True)
        # a fresh supervisor for the RSS figures: this one exits after its 2 s grace (watch
        # its pid: asking the supervisor would itself count as a client and keep it alive)
        info = _native.supervisor_info()
        if info is not None:
            old = int(info["pid"])
            wait_until(lambda: not pid_alive(old), 60, "the supervisor exits")
        rss_rows, rss = rss_table(world)
        print("rss", rss, flush=True)
        hostile = hostile_attach(world, 5 if args.quick else 10)
        print("hostile attach", hostile, flush=True)
        released, sent, gone = release_many(world, 10_000)
        print("release 10k", released, sent, gone, flush=True)
        list_ok, list_s = list_many(world, 100_000)
        print("list 100k", list_ok, list_s, flush=True)
    finally:
        world.close()

    lat_rows = []
    for label, lat in (("1 (the creator)", lat1), ("3 (creator + 2 attached)", lat3)):
        lat_rows.append(
            [
                label,
                str(len(lat)),
                ms(statistics.median(lat)),
                ms(pct(lat, 0.99)),
                ms(max(lat)),
                verdict(pct(lat, 0.99) <= 2.0),
            ]
        )
    mass_rows = [
        [str(n), f"{t:.3f}", f"{rss_b / 2**20:.1f}", verdict(t <= 2.0)]
        for n, (t, rss_b) in mass.items()
    ]
    phases = ["create", "attach", "detach", "unlink", "total"]
    o_rows = []
    for ph in phases:
        a, b = over["shmstore"][ph], over["shm"][ph]
        o_rows.append([ph, us(a), us(b), f"{a / b:.1f}x"])
    ratio = over["shmstore"]["total"] / over["shm"]["total"]

    text = f"""# Segment lifecycle benchmarks

{machine_md()}
- **processes on the machine** (the supervisor's /proc scan visits each): {procs_on_machine}

Produced by `python benchmarks/bench_lifecycle.py{" --quick" if args.quick else ""}`
(`make bench`). Everything ran in an isolated world: its own segment directory under
/dev/shm and its own supervisor (`SHMSTORE_SUPERVISOR_NAME`). The machine was shared with
other builds and benchmarks while this ran (see the load average above).

## Cleanup latency after SIGKILL of all clients

Clients are forked from the benchmark process: one creates a 1 KiB store (`put`), the
others attach it by name; once all have reported, all are SIGKILLed. The latency is the
time from the first `kill()` to the segment file disappearing, polled every {POLL_S * 1e3:.0f}
ms (no inotify; resolution ~1 ms). One supervisor served all runs. Bound (docs/lifecycle.md): 2 s.

{md_table(LAT_HEADERS, lat_rows)}

When a segment's last client dies, the supervisor scans `/proc/*/maps` and `/proc/*/fd` of
every process before unlinking (a forked child may map the segment without being a client),
so the latency grows with the number of processes on the machine ({procs_on_machine} here).

**Mass death**: N clients, each using its own segment, all gone at once. Simulated with N raw
connections from this process (each `HELLO` + `USE` of its own small file in the segment
directory), closed together: the supervisor sees exactly what it sees when N clients are
SIGKILLed. Time until the last file is gone; the supervisor handles the deaths one by one,
each with a full /proc scan.

{md_table(MASS_HEADERS, mass_rows)}

## Create + attach + unlink overhead per store (1 KiB)

Two processes, A and B, connected by pipes. Per operation: A creates the store and sends its
name; B attaches, reads the 1 KiB, detaches and answers; A unlinks. Each process times its own
steps; *total* is A's wall time for the whole operation (two pipe round trips included, the
same for both). Medians over {n_ops} operations per library: {ROUNDS} alternating runs of
{ops // ROUNDS} for each, the first 10 % of every run dropped as warm-up.

- shmstore: `put(payload, arena=False)` (a segment per object); `Ref.attach(name).get()`;
  `close()`; `unlink()` + `close()`.
  Creating and attaching each tell the supervisor (`USE`, one round trip on the socket),
  detaching and unlinking say `DROP`.
- SharedMemory: `SharedMemory(create=True, size=1024)` + copy; `SharedMemory(name)` +
  `resource_tracker.unregister(...)` (needed on Python < 3.13, python/cpython#82300) + read;
  `close()`; `close()` + `unlink()`.

{md_table(["step", "shmstore (us)", "SharedMemory (us)", "ratio"], o_rows)}

Overall: shmstore's create+attach+unlink costs **{ratio:.1f}x** SharedMemory's
({us(over["shmstore"]["total"])} us vs {us(over["shm"]["total"])} us per store). The extra
time is mostly the supervisor round trips (`USE`/`DROP`) and building and checking the
archive; it buys a typed, checked store and a name that is removed whatever kills the
processes (SharedMemory leaves the segment behind if its creator is SIGKILLed).

## Supervisor RSS

VmRSS (and the peak, VmHWM) of a freshly started supervisor process. 1 and 64 clients are
real processes (one creates a store, the others attach it). **1000 clients** would be 1000
Python processes, too heavy for this 2-core machine: it is the creator plus 999 raw connections
opened from the benchmark process (`socket.AF_UNIX` to the supervisor's socket, each sending
`HELLO <pid>` and `USE <path>` and reading the `OK` replies) — to the supervisor each is a
client like any other. Bound: 20 MB.

{md_table(["clients", "how", "VmRSS (MiB)", "VmHWM (MiB)", "<= 20 MB"], rss_rows, left=2)}

Note: each client is one file descriptor in the supervisor, which inherits the soft
`RLIMIT_NOFILE` of the process that started it. This machine's soft limit is
{_soft_nofile()}; with the common default of 1024 the supervisor runs out of descriptors
near 1000 clients (see `test_g4_supervisor_serves_more_clients_than_its_soft_fd_limit` in
tests/test_lifecycle.py).
"""
    h_rows = [
        [label, str(len(v)), ms(statistics.median(v)), ms(max(v)), verdict(max(v) <= 0.5)]
        for label, v in hostile.items()
    ]
    text += f"""
## Hostile conditions

Sections 1-3 ran with `SHMSTORE_SUPERVISOR_TIMEOUT=10` (a busy supervisor on this loaded
machine must not turn clients unsupervised there); this section uses the default.

**Attach latency to a clear outcome.** Fresh processes attach a 1 KiB store (their first
contact with the supervisor: connect, `HELLO`, `USE`), timed inside the process. With the
supervisor SIGSTOPped, the connect succeeds (the kernel queues it) but no answer comes: the
client sees that the supervisor is stopped (`/proc/PID/stat`), gives up at its deadline
(`SHMSTORE_SUPERVISOR_TIMEOUT`, default 0.5 s) and attaches unsupervised, with one
WARNING. With the listen backlog also full, the non-blocking connect
fails at once and is retried until the same deadline. The abstract socket name that older
versions listened on is bound by someone else (here by the benchmark itself): it is no longer
used, so it changes nothing. Target: <= 0.5 s.

{md_table(["condition", "runs", "median (ms)", "max (ms)", "<= 0.5 s"], h_rows)}

**Releasing 10k handles.** One process holds 10 000 stores (`put`) and drops them all:
the handles are gone after {released:.3f} s (no I/O: each release queues a DROP), the DROPs
are sent (up to ~1 MiB of paths per `DROP` line) after {sent:.3f} s, and the supervisor has
unlinked all 10 000 files {gone:.3f} s after the release started (one /proc scan per line).
Target: <= 2 s ({verdict(gone <= 2.0)}).

**LIST with 100k segments.** 100 000 registrations (names only) on one connection, then
`supervisor_info()`: complete = **{"yes" if list_ok else "no"}**, in {list_s:.2f} s (the
reply streams through a per-client buffer; `END <count>` lets the client check it has all).
"""
    write_result(RESULTS_DIR / "lifecycle.md", text)
    return 0


def _soft_nofile() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


if __name__ == "__main__":
    sys.exit(main())
