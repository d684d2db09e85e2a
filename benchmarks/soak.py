"""Fault campaign: random shmstore traffic in several processes, with faults injected at
random points, then an account of what broke (docs/security.md, "Fault campaign").

Workers (child processes, each its own seeded random stream) build and put stores (named
segments and small arena objects), attach other workers' stores by name and check their
contents against the digest in the name, pass objects through a shared ``Channel``, and save
stores to files and open them again. The controller meanwhile injects faults: SIGKILL of a
worker (a creator, a reader, a getter: whatever it was doing) or of the supervisor,
SIGSTOP then SIGCONT of a worker, and on every worker's start a chance of a *planted state
directory* (``XDG_RUNTIME_DIR`` unset and ``$TMPDIR/shmstore-<uid>`` owned by another uid:
the worker's supervisor must move to ``$HOME``). As root the segment directory is a tiny
tmpfs (8 MiB), so puts also meet a full file system. Pid reuse is not forced (it needs the
whole pid space cycled); killed getters and putters leave dead claims whose pids the system
may reuse over a long campaign.

Everything is private: a root directory under /dev/shm (segments, state directories, saved
files), its own supervisor name; nothing outside it is touched, and it is removed at the end.

Reported: events by kind; *crashes* (a worker that died by a signal the controller did not
send, or raised an exception that is not a documented one: its traceback is kept);
*wrong data* (an attached store whose contents differ from its name's digest); *unlinked
while mapped* (a store a worker holds whose name disappeared); *slow calls* (a call other
than a Channel put/get with a timeout that took over 1 s while its worker was not stopped);
*leaked files and bytes* (what is left in the segment directory once every worker has ended
and the supervisor had up to ``--settle`` seconds to sweep). Exit status 1 if there was a
crash, wrong data, an unlinked mapped store or a leak.

    python benchmarks/soak.py --seed 1 --faults 200 --seconds 60
    python benchmarks/soak.py --seed 1 --faults 100000 --seconds 36000 \\
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
            note("expected", op=op, error=type(e).__name__)
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
        self.procs: dict[int, tuple[subprocess.Popen[bytes], str]] = {}
        self.sent: dict[int, int] = {}  # pid -> signal we sent
        self.stopped: dict[int, list[list[float]]] = collections.defaultdict(list)
        self.events: collections.Counter[str] = collections.Counter()
        self.crashes: list[str] = []
        self.next_id = 0

    def log(self, msg: str) -> None:
        if self.args.verbose:
            print(msg, flush=True)

    def spawn(self) -> None:
        wid = self.next_id
        self.next_id += 1
        planted = self.can_plant and self.rng.random() < 0.2
        env = self.planted_env if planted else self.env
        err = open(self.root / f"w{wid}.err", "wb")
        p = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(wid),
                "--seed",
                str(self.args.seed * 1_000_003 + wid),
                "--root",
                str(self.root),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        err.close()
        self.procs[p.pid] = (p, f"w{wid}.err")
        self.events["spawn_planted" if planted else "spawn"] += 1

    def supervisor_pids(self) -> list[int]:
        name = self.env["SHMSTORE_SUPERVISOR_NAME"]
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes()
                environ = (d / "environ").read_bytes()
                if b"_supervisor_main" in cmd and f"={name}".encode() in environ:
                    pids.append(int(d.name))
        return pids

    def reap(self) -> None:
        for pid, (p, err) in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.procs[pid]
            if rc < 0 and self.sent.get(pid) == -rc:
                continue
            if rc != 0:
                tail = (self.root / err).read_text(errors="replace")[-2000:]
                self.crashes.append(f"worker pid {pid} exit {rc}:\n{tail}")

    def fault(self) -> None:
        live = [pid for pid, (p, _) in self.procs.items() if p.poll() is None]
        kind = self.rng.choices(["kill_worker", "stop_worker", "kill_supervisor"], [4, 5, 1])[0]
        if kind == "kill_supervisor":
            sups = self.supervisor_pids()
            if not sups:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.rng.choice(sups), signal.SIGKILL)
        elif not live:
            return
        elif kind == "kill_worker":
            pid = self.rng.choice(live)
            self.sent[pid] = signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        else:
            pid = self.rng.choice(live)
            t0 = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.rng.uniform(0, 0.3))
                os.kill(pid, signal.SIGCONT)
            self.stopped[pid].append([t0, time.time()])
        self.events[kind] += 1

    def run(self) -> int:
        import shmstore

        ch = shmstore.Channel(capacity=16)
        with open(self.root / "channel.pkl", "wb") as f:
            pickle.dump(ch, f)
        deadline = time.monotonic() + self.args.seconds
        faults = 0
        try:
            while faults < self.args.faults and time.monotonic() < deadline:
                self.reap()
                while len(self.procs) < self.args.workers:
                    self.spawn()
                time.sleep(self.rng.uniform(0, self.args.interval))
                self.fault()
                faults += 1
        finally:
            (self.root / "stop").touch()
            end = time.monotonic() + 60
            while self.procs and time.monotonic() < end:
                self.reap()
                time.sleep(0.05)
            for pid, (p, _) in list(self.procs.items()):  # stuck after 60 s: a finding
                self.crashes.append(f"worker pid {pid} did not stop within 60 s (killed)")
                self.sent[pid] = signal.SIGKILL
                p.kill()
                p.wait()
            self.procs.clear()
            del ch
        self.injected = faults
        return self.account()

    def account(self) -> int:
        import gc as pygc

        import shmstore

        pygc.collect()
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
        self.slow: list[dict[str, Any]] = []
        self.worker_events: collections.Counter[str] = collections.Counter()
        self.findings: list[dict[str, Any]] = []
        self.worker_pids: dict[int, int] = {}
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
                    if k in ("wrong_data", "unlinked_while_mapped"):
                        self.findings.append(e)
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
            f"--seconds {a.seconds} --workers {a.workers}`; faults injected: {self.injected}; "
            f"segment directory on a tiny tmpfs: {'yes' if self.mounted else 'no (not root)'}; "
            f"planted state directories: {'yes' if self.can_plant else 'no (not root)'}.",
            "",
            "| result | count |",
            "|---|---|",
            f"| crashes | {len(self.crashes)} |",
            f"| wrong data / unlinked while mapped | {len(self.findings)} |",
            f"| leaked files | {len(self.leaked)} ({sum(s for _, s in self.leaked)} bytes) |",
            f"| slow calls (> {SLOW_S:g} s, worker not stopped) | {len(self.slow_real())} |",
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
        for p, _ in self.procs.values():
            p.kill()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.seg)], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=200, help="stop after this many faults")
    ap.add_argument("--seconds", type=float, default=60, help="stop after this long")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.2, help="longest pause between faults")
    ap.add_argument("--settle", type=float, default=30, help="longest wait for the sweep")
    ap.add_argument("--no-tmpfs", dest="tmpfs", action="store_false")
    ap.add_argument("--no-plant", dest="plant", action="store_false")
    ap.add_argument("--out", help="also write the report (markdown) here")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
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
