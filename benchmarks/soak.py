"""Fault campaign: random shmstore traffic in several processes, with faults injected at
random points, then an account of what broke (docs/security.md, "Fault campaign").

Workers (each its own seeded random stream) build and put stores (named segments and small
arena objects), attach other workers' stores by name and check their contents against the
digest in the name, pass objects through a shared ``Channel``, and save stores to files and
open them again. Faults, at random moments:

- a *zygote* (a warm parent that imported shmstore once and makes nothing with it) keeps
  ``--workers`` workers alive by ``fork`` (about a millisecond each, against half a second
  for a new interpreter) and injects their faults: SIGKILL (a ``--kill-share`` of them,
  whatever the worker was doing: a creator, a reader, a getter, a putter, or one still
  starting) or SIGSTOP then SIGCONT after a pause (mostly up to 20 ms, a slow peer; one in
  ten up to 300 ms), resumed by a timer so the next fault does not wait; a pause of
  ``--interval`` on average between faults. It only signals its own children, not yet
  reaped, so a pid is never reused under it;
- the controller SIGKILLs the supervisor every ``--supervisor-every`` seconds;
- as root, a second zygote's worker runs with a *planted state directory*
  (``XDG_RUNTIME_DIR`` unset and ``$TMPDIR/shmstore-<uid>`` owned by another uid: its
  supervisor must move to ``$HOME``), and the segment directory is a tiny tmpfs (8 MiB), so
  puts also meet a full file system.

A *keeper* process holds the channel for the campaign and, at the end, takes what is left
in it and exits before the leak count (a live process that maps the channel keeps what it
holds). Pid reuse is not forced (it needs the whole pid space cycled); killed getters and
putters leave dead claims whose pids the system may reuse over a long campaign. Every fault
counted is a signal delivered to a live process.

Everything is private: a root directory under /dev/shm (segments, state directories, saved
files), its own supervisor name; nothing outside it is touched, and it is removed at the end.

Reported: events by kind; *crashes* (a worker that died by a signal the controller did not
send, or raised an exception that is not a documented one: its traceback is kept);
*wrong data* (an attached store whose contents differ from its name's digest); *unlinked
while mapped* (a store a worker holds whose name disappeared); *slow calls* (a call other
than a Channel put/get with a timeout that took over 1 s while its worker was not stopped);
*channel objects lost* (a get whose cell named a store that was gone, in a worker or in the
keeper's last gets); *leaked files and bytes* (what is left in the segment directory once
every worker has ended and the supervisor had up to ``--settle`` seconds to sweep). Exit
status 1 if there was a crash, wrong data, an unlinked mapped store, a lost channel object
or a leak.

    python benchmarks/soak.py --seed 1 --faults 2000 --seconds 60
    python benchmarks/soak.py --seed 1 --faults 100000 --seconds 1500 --interval 0.005 \\
        --out benchmarks/results/soak.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import pickle
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SLOW_S = 1.0


# --- worker ------------------------------------------------------------------------------


def _digest(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=6).hexdigest()


def _value(rng: random.Random) -> Any:
    n = rng.randrange(1, 200)
    kind = rng.randrange(3)
    if kind == 0:
        return [{"id": i, "s": "x" * rng.randrange(20), "f": i / 3} for i in range(n)]
    if kind == 1:
        return {f"k{i}": [i, str(i)] for i in range(n)}
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096)))


def worker(wid: int, seed: int, root: Path, report: Path) -> int:
    import shmstore

    documented = (shmstore.ShmStoreError, queue.Empty, queue.Full, TimeoutError)
    rng = random.Random(seed)
    segdir = Path(os.environ["SHMSTORE_DIR"])
    files = root / "files"
    with open(root / "channel.pkl", "rb") as f:
        ch = pickle.load(f)
    held: list[Any] = []
    out = open(report, "a", buffering=1)

    def note(kind: str, **kw: Any) -> None:
        out.write(json.dumps({"w": wid, "kind": kind, "t": time.time(), **kw}) + "\n")

    def timed(op: str, fn: Any, blocking: bool = False) -> Any:
        t0 = time.time()
        try:
            return fn()
        except documented as e:
            note("expected", op=op, error=type(e).__name__, msg=str(e)[:300])
            return None
        finally:
            dt = time.time() - t0
            if dt > SLOW_S and not blocking:
                note("slow", op=op, seconds=round(dt, 3), start=t0)

    def put_named() -> None:
        v = _value(rng)
        name = f"soak-{wid}-{rng.getrandbits(32):08x}-{_digest(v)}"
        r = timed("put", lambda: shmstore.put(v, name=name, arena=False))
        if r is not None:
            held.append((name, r))

    def attach() -> None:
        names = [p.name[9:] for p in segdir.glob("shmstore-soak-*") if ".part-" not in p.name]
        if not names:
            return
        name = rng.choice(names)
        r = timed("attach", lambda: shmstore.Ref.attach(name))
        if r is None:
            return
        got = timed("read", lambda: r.get())
        if got is not None:
            plain = got if isinstance(got, bytes) else got.to_python()
            if _digest(plain) != name.rsplit("-", 1)[1]:
                note("wrong_data", name=name)
        held.append((name, r))

    def small_put() -> None:
        r = timed("small_put", lambda: shmstore.put({"n": rng.randrange(1000)}))
        if r is not None:
            held.append((None, r))

    def channel_put() -> None:
        timed("channel_put", lambda: ch.put(_value(rng), timeout=2), blocking=True)

    def channel_get() -> None:
        got = timed("channel_get", lambda: ch.get(timeout=2), blocking=True)
        if got is not None and not isinstance(got, bytes):
            timed("channel_read", lambda: got.to_python())

    def save_open() -> None:
        if not held:
            return
        _, r = rng.choice(held)
        path = files / f"w{wid}-{rng.randrange(4)}.shmstore"
        if timed("save", lambda: r.save(path)) is None and not path.exists():
            return
        o = timed("open", lambda: shmstore.Ref.open(path))
        if o is not None:
            timed("open_read", lambda: o.get())
            o.close()

    def release() -> None:
        if held:
            _, r = held.pop(rng.randrange(len(held)))
            r.close()

    def check_held() -> None:
        for name, _ in held:
            if name is not None and not (segdir / f"shmstore-{name}").exists():
                note("unlinked_while_mapped", name=name)

    ops = [put_named, attach, small_put, channel_put, channel_get, save_open, release]
    weights = [3, 4, 2, 2, 2, 1, 3]
    stop = root / "stop"
    note("start", pid=os.getpid())
    for i in range(1_000_000):
        if stop.exists():
            break
        rng.choices(ops, weights)[0]()
        if len(held) > 8:
            release()
        if i % 16 == 0:
            check_held()
    for _, r in held:
        r.close()
    note("end")
    return 0


# --- zygote: forks workers and injects their faults ---------------------------------------


def zygote(zid: int, args: argparse.Namespace, root: Path) -> int:
    """A warm parent: imports shmstore once (and makes nothing with it), then keeps
    ``args.workers`` workers alive by ``fork`` (a worker starts in about a millisecond, not
    the half second of a new interpreter) and injects faults into them at random moments:
    SIGKILL (whatever the worker was doing), or SIGSTOP then SIGCONT after a random pause
    (resumed by a timer, so the next fault does not wait). Killing its own children only
    is safe: a pid not yet reaped cannot be reused. Every fault counted is a signal
    delivered to a live worker. Writes ``zygote-<zid>.json`` (counts, crashes, stop
    intervals) when ``root/stop`` appears."""
    import heapq

    import shmstore  # noqa: F401  (warm: every forked worker has it loaded)

    rng = random.Random(args.seed * 7919 + zid)
    stop = root / "stop"
    live: dict[int, str] = {}  # pid -> its error file
    sent: dict[int, int] = {}
    conts: list[tuple[float, int]] = []  # (when, pid): SIGCONTs due
    stopped: dict[int, list[list[float]]] = collections.defaultdict(list)
    counts: collections.Counter[str] = collections.Counter()
    crashes: list[str] = []
    next_w = 0
    report_at = 0.0

    def spawn() -> None:
        nonlocal next_w
        wid = zid * 10_000_000 + next_w
        next_w += 1
        err = root / f"w{wid}.err"
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 2)
                os.close(fd)
                code = worker(wid, args.seed * 1_000_003 + wid, root, root / "events.jsonl")
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        live[pid] = err.name
        counts["spawn"] += 1

    def reap() -> None:
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            err = live.pop(pid, None)
            # Forget what was sent to it: the system gives its pid to a later fork, which
            # would otherwise count as killed already (never injected again, and held
            # against the cap on workers not reaped: the campaign stalled so once every
            # live worker had a reused pid).
            signalled = sent.pop(pid, None)
            if err is None:
                continue
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            if sig and signalled == sig:
                (root / err).unlink(missing_ok=True)
                continue
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -sig
            if code != 0:
                tail = (root / err).read_text(errors="replace")[-2000:]
                crashes.append(f"worker pid {pid} exit {code}:\n{tail}")
            else:
                (root / err).unlink(missing_ok=True)

    def resume(now: float) -> None:
        while conts and conts[0][0] <= now:
            _, pid = heapq.heappop(conts)
            if pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                stopped[pid][-1][1] = time.time()

    while not stop.exists():
        reap()
        # Killed workers that have not exited yet (a SIGKILL waits for the system call it
        # interrupts) count against a cap: without it, on a busy machine, new workers are
        # forked faster than the killed ones leave, and the campaign measures its own pile-up.
        while (
            len([p for p in live if p not in sent]) < args.workers and len(live) < 4 * args.workers
        ):
            spawn()
        pause = rng.uniform(0, 2 * args.interval)
        end = time.monotonic() + pause
        while True:
            now = time.monotonic()
            if conts and conts[0][0] < end:
                time.sleep(max(0.0, conts[0][0] - now))
                resume(time.monotonic())
                continue
            time.sleep(max(0.0, end - now))
            break
        resume(time.monotonic())
        if time.monotonic() >= report_at:
            report_at = time.monotonic() + 0.5
            tmp = root / f".zygote-{zid}.progress"
            tmp.write_text(str(counts["kill_worker"] + counts["stop_worker"]))
            tmp.replace(root / f"zygote-{zid}.progress")
        alive = [p for p in live if p not in sent]
        if not alive:
            continue
        pid = rng.choice(alive)
        running = all(p != pid for _, p in conts)
        if rng.random() < args.kill_share:
            sent[pid] = signal.SIGKILL
            os.kill(pid, signal.SIGKILL)  # our child, not yet reaped: no reuse
            os.kill(pid, signal.SIGCONT)
            counts["kill_worker"] += 1
        elif running:
            os.kill(pid, signal.SIGSTOP)
            # Mostly short stops (a slow peer), sometimes long ones (a debugger).
            hold = rng.uniform(0, 0.02) if rng.random() < 0.9 else rng.uniform(0, 0.3)
            heapq.heappush(conts, (time.monotonic() + hold, pid))
            stopped[pid].append([time.time(), time.time() + hold])
            counts["stop_worker"] += 1
    # Stop: resume everyone, let workers finish (bounded), then report.
    for _, pid in conts:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    end = time.monotonic() + 60
    while live and time.monotonic() < end:
        reap()
        time.sleep(0.05)
    for pid in list(live):  # stuck after 60 s: a finding
        crashes.append(f"worker pid {pid} did not stop within 60 s (killed)")
        sent[pid] = signal.SIGKILL
        os.kill(pid, signal.SIGKILL)
    while live:
        reap()
        time.sleep(0.01)
    out = {"counts": counts, "crashes": crashes, "stopped": stopped}
    (root / f"zygote-{zid}.json").write_text(json.dumps(out))
    return 0


# --- keeper: holds the campaign's Channel --------------------------------------------------


def keeper(root: Path) -> int:
    """Creates the campaign's ``Channel``, pickles it for the workers and holds it until
    ``root/stop-keeper`` appears; then takes what the workers left in it (so that what
    stays afterwards is a leak, not an object still waiting) and exits, before the leak
    count: a process that maps the channel (adopted by a restarted supervisor) would keep
    it, and what it holds, for as long as it lives."""
    import shmstore

    ch = shmstore.Channel(capacity=16)
    tmp = root / ".channel.pkl"
    tmp.write_bytes(pickle.dumps(ch))
    tmp.replace(root / "channel.pkl")
    counts: collections.Counter[str] = collections.Counter()
    while not (root / "stop-keeper").exists():
        time.sleep(0.1)
    for _ in range(4 * 16):
        try:
            got = ch.get_nowait()
        except queue.Empty:
            break
        except shmstore.ShmStoreError as e:
            counts[f"drained: {type(e).__name__}"] += 1
            continue
        counts["drained"] += 1
        del got
    (root / "keeper.json").write_text(json.dumps(counts))
    return 0


# --- controller --------------------------------------------------------------------------


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="shmstore-soak-", dir="/dev/shm"))
        self.seg = self.root / "seg"
        self.seg.mkdir()
        (self.root / "files").mkdir()
        self.report = self.root / "events.jsonl"
        self.mounted = False
        if args.tmpfs and os.geteuid() == 0:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(self.seg)],
                capture_output=True,
            )
            self.mounted = r.returncode == 0
        self.env = dict(os.environ)
        self.env.update(
            SHMSTORE_DIR=str(self.seg),
            SHMSTORE_FALLBACK="0",
            XDG_RUNTIME_DIR=str(self.root / "run"),
            SHMSTORE_SUPERVISOR_NAME=f"shmstore-soak-{os.getpid()}",
            SHMSTORE_SUPERVISOR_GRACE="0.5",
            SHMSTORE_ARENA_IDLE="1",
        )
        # A planted state directory: a /tmp-like directory where another uid owns ours.
        self.planted_env = dict(self.env)
        del self.planted_env["XDG_RUNTIME_DIR"]
        tmp = self.root / "tmp"
        tmp.mkdir(mode=0o1777)
        home = self.root / "home"
        home.mkdir(mode=0o700)
        self.planted_env.update(TMPDIR=str(tmp), HOME=str(home))
        self.can_plant = os.geteuid() == 0 and args.plant
        if self.can_plant:
            plant = tmp / f"shmstore-{os.geteuid()}"
            plant.mkdir(mode=0o755)
            os.chown(plant, 65534, 65534)
        self.zygotes: list[subprocess.Popen[bytes]] = []
        self.keeper: subprocess.Popen[bytes] | None = None
        self.elapsed = 0.0
        self.stopped: dict[int, list[list[float]]] = collections.defaultdict(list)
        self.events: collections.Counter[str] = collections.Counter()
        self.crashes: list[str] = []

    def log(self, msg: str) -> None:
        if self.args.verbose:
            print(msg, flush=True)

    def start_zygote(self, zid: int, env: dict[str, str], workers: int) -> None:
        a = self.args
        err = open(self.root / f"zygote-{zid}.err", "wb")
        cmd = [sys.executable, __file__, "--zygote", str(zid), "--root", str(self.root)]
        cmd += ["--seed", str(a.seed), "--workers", str(workers), "--interval", str(a.interval)]
        cmd += ["--kill-share", str(a.kill_share)]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        self.zygotes.append(p)

    def supervisor_pids(self) -> list[int]:
        name = self.env["SHMSTORE_SUPERVISOR_NAME"]
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes()
                if b"_supervisor_main" not in cmd:
                    continue
                if f"={name}".encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
        return pids

    def kill_supervisor(self) -> None:
        sups = self.supervisor_pids()
        if sups:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.rng.choice(sups), signal.SIGKILL)
                self.events["kill_supervisor"] += 1

    def worker_faults(self) -> int:
        n = 0
        for p in self.root.glob("zygote-*.progress"):
            with contextlib.suppress(OSError, ValueError):
                n += int(p.read_text())
        return n

    def run(self) -> int:
        # This process uses the campaign's directory and supervisor too (for the leak count).
        os.environ.update(self.env)
        kerr = open(self.root / "keeper.err", "wb")
        cmd = [sys.executable, __file__, "--keeper", "--root", str(self.root)]
        self.keeper = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=kerr)
        kerr.close()
        until = time.monotonic() + 120
        while not (self.root / "channel.pkl").exists():
            if self.keeper.poll() is not None or time.monotonic() > until:
                self.crashes.append("the channel keeper did not start: see keeper.err")
                self.injected = 0
                return self.account()
            time.sleep(0.05)
        a = self.args
        start = time.monotonic()
        deadline = start + a.seconds
        planted = 1 if self.can_plant and a.workers > 1 else 0
        self.start_zygote(0, self.env, a.workers - planted)
        if planted:
            self.start_zygote(1, self.planted_env, planted)
            self.events["planted_zygote"] += 1
        next_sup = start + a.supervisor_every
        try:
            while time.monotonic() < deadline:
                faults = self.worker_faults() + self.events["kill_supervisor"]
                if faults >= a.faults:
                    break
                if any(z.poll() is not None for z in self.zygotes):
                    self.crashes.append("a zygote exited early: see zygote-*.err")
                    break
                if a.supervisor_every > 0 and time.monotonic() >= next_sup:
                    self.kill_supervisor()
                    next_sup = time.monotonic() + a.supervisor_every
                time.sleep(0.1)
        finally:
            (self.root / "stop").touch()
            for z in self.zygotes:
                try:
                    z.wait(150)
                except subprocess.TimeoutExpired:
                    self.crashes.append(f"zygote {z.pid} did not stop within 150 s (killed)")
                    z.kill()
                    z.wait()
            self.elapsed = time.monotonic() - start
            for zf in sorted(self.root.glob("zygote-*.json")):
                z = json.loads(zf.read_text())
                self.events.update(z["counts"])
                self.crashes.extend(z["crashes"])
                for pid, spans in z["stopped"].items():
                    self.stopped[int(pid)].extend(spans)
            for ze in sorted(self.root.glob("zygote-*.err")):
                text = ze.read_text(errors="replace").strip()
                # (a planted state directory's WARNING is said there: not a crash)
                if "Traceback" in text:
                    self.crashes.append(f"{ze.name}:\n{text[-2000:]}")
            (self.root / "stop-keeper").touch()
            try:
                self.keeper.wait(120)
            except subprocess.TimeoutExpired:
                self.crashes.append("the channel keeper did not stop within 120 s (killed)")
                self.keeper.kill()
                self.keeper.wait()
            with contextlib.suppress(OSError, ValueError):
                self.events.update(json.loads((self.root / "keeper.json").read_text()))
            kerr_text = (self.root / "keeper.err").read_text(errors="replace")
            if "Traceback" in kerr_text:
                self.crashes.append(f"keeper.err:\n{kerr_text[-2000:]}")
        self.injected = sum(
            self.events[k] for k in ("kill_worker", "stop_worker", "kill_supervisor")
        )
        return self.account()

    def account(self) -> int:
        import gc as pygc

        import shmstore

        pygc.collect()
        shmstore._native._flush_drops()
        # The supervisor may have just been killed: a store made now starts the next one
        # (as any shmstore call would), whose start-up sweep takes over what is left.
        shmstore.put({"settle": True}, arena=False).close()
        shmstore._native._flush_drops()
        # Leaks: the supervisor sweeps what no process maps; give it a bounded time (a
        # condition polled, not a fixed sleep), then count what is left.
        end = time.monotonic() + self.args.settle
        left: list[Path] = []
        while time.monotonic() < end:
            left = [p for p in self.seg.iterdir()]
            if not left:
                break
            time.sleep(0.1)
        self.leaked = [(p.name, p.stat().st_size) for p in left if p.exists()]
        if os.environ.get("SOAK_DEBUG"):
            print("settle ended", time.time(), [p.name for p in left][:5], file=sys.stderr)
        self.slow: list[dict[str, Any]] = []
        self.worker_events: collections.Counter[str] = collections.Counter()
        self.findings: list[dict[str, Any]] = []
        self.worker_pids: dict[int, int] = {}
        self.lost = 0
        if self.report.exists():
            for line in self.report.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    k = e["kind"]
                    self.worker_events[
                        k if k != "expected" else f"expected {e['op']}: {e['error']}"
                    ] += 1
                    if k == "start":
                        self.worker_pids[e["w"]] = e["pid"]
                    if k == "slow":
                        self.slow.append(e)
                    if k == "expected" and e["op"] == "channel_get":
                        if e["error"] == "StoreNotFoundError":
                            self.lost += 1
                            self.findings.append({**e, "kind": "channel_object_lost"})
                    if k in ("wrong_data", "unlinked_while_mapped"):
                        self.findings.append(e)
        # The keeper's last gets, after every worker ended, count as well.
        for k, n in self.events.items():
            if k == "drained: StoreNotFoundError":
                self.lost += n
                self.findings.append({"kind": "channel_object_lost", "by": "keeper", "n": n})
        failed = bool(self.crashes or self.findings or self.leaked)
        text = self.markdown()
        print(text)
        if self.args.out:
            Path(self.args.out).write_text(text)
        return 1 if failed else 0

    def markdown(self) -> str:
        a = self.args
        lines = [
            "# Fault campaign (benchmarks/soak.py)",
            "",
            f"Command: `python benchmarks/soak.py --seed {a.seed} --faults {a.faults} "
            f"--seconds {a.seconds} --workers {a.workers} --interval {a.interval} "
            f"--kill-share {a.kill_share} --supervisor-every {a.supervisor_every}`; "
            f"faults injected: {self.injected} in {self.elapsed:.0f} s "
            f"({self.injected / max(self.elapsed, 1e-9) * 60:.0f} a minute); "
            f"segment directory on a tiny tmpfs: {'yes' if self.mounted else 'no (not root)'}; "
            f"planted state directories: {'yes' if self.can_plant else 'no (not root)'}.",
            "",
            "| result | count |",
            "|---|---|",
            f"| crashes | {len(self.crashes)} |",
            f"| wrong data / unlinked while mapped | "
            f"{sum(f['kind'] != 'channel_object_lost' for f in self.findings)} |",
            f"| leaked files | {len(self.leaked)} ({sum(s for _, s in self.leaked)} bytes) |",
            f"| slow calls (> {SLOW_S:g} s, worker not stopped) | {len(self.slow_real())} |",
            f"| channel objects lost (a get raised StoreNotFoundError) | {self.lost} |",
            "",
            "## Events",
            "",
            "| event | count |",
            "|---|---|",
        ]
        for k, v in sorted({**self.events, **self.worker_events}.items()):
            lines.append(f"| {k} | {v} |")
        for title, items in (
            ("Crashes", self.crashes),
            ("Findings", [json.dumps(f) for f in self.findings]),
            ("Leaked files", [f"{n} ({s} bytes)" for n, s in self.leaked]),
            ("Slow calls", [json.dumps(s) for s in self.slow_real()[:50]]),
        ):
            if items:
                lines += ["", f"## {title}", ""] + [f"```\n{i}\n```" for i in items[:50]]
        return "\n".join(lines) + "\n"

    def slow_real(self) -> list[dict[str, Any]]:
        # A call that overlapped a SIGSTOP of its own worker is not a slow call.
        out = []
        for e in self.slow:
            pid = self.worker_pids.get(e["w"])
            t0, t1 = e["start"], e["start"] + e["seconds"]
            if not any(a < t1 and b > t0 for a, b in self.stopped.get(pid or -1, [])):
                out.append(e)
        return out

    def close(self) -> None:
        for p in [*self.zygotes, *([self.keeper] if self.keeper else [])]:
            if p.poll() is None:
                p.kill()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.seg)], check=False)
        if self.args.keep:
            print(f"kept {self.root}")
            return
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=200, help="stop after this many faults")
    ap.add_argument("--seconds", type=float, default=60, help="stop after this long")
    ap.add_argument("--workers", type=int, default=4, help="workers alive at any moment")
    ap.add_argument(
        "--interval", type=float, default=0.01, help="mean pause between worker faults (s)"
    )
    ap.add_argument(
        "--kill-share", type=float, default=0.2, help="share of worker faults that are SIGKILL"
    )
    ap.add_argument(
        "--supervisor-every", type=float, default=5, help="SIGKILL the supervisor this often (s)"
    )
    ap.add_argument("--settle", type=float, default=30, help="longest wait for the sweep")
    ap.add_argument("--no-tmpfs", dest="tmpfs", action="store_false")
    ap.add_argument("--no-plant", dest="plant", action="store_false")
    ap.add_argument("--out", help="also write the report (markdown) here")
    ap.add_argument("--keep", action="store_true", help="keep the campaign's directory")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--zygote", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--keeper", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.keeper:
        return keeper(Path(args.root))
    if args.zygote is not None:
        return zygote(args.zygote, args, Path(args.root))
    if args.worker is not None:
        try:
            return worker(args.worker, args.seed, Path(args.root), Path(args.root) / "events.jsonl")
        except BaseException:
            traceback.print_exc()
            return 3
    c = Campaign(args)
    try:
        return c.run()
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main())
