"""Several "machines" on one host, for the cluster tests and benchmark.

With root and working ``unshare``: each machine is a holder process in its own mount namespace
(a private tmpfs on /dev/shm) and network namespace; a bridge in the first machine ("head")
joins them through veth pairs, with 10.213.0.0/24 addresses that exist only inside these
namespaces. Commands run in a machine through ``nsenter``. Each machine has its own supervisor
(its own abstract-socket namespace, and its own ``SHMSTORE_SUPERVISOR_NAME``).

Without them (no root, no unshare): each machine is a set of environment variables
(``SHMSTORE_NODE_ID``, its own ``SHMSTORE_DIR`` and supervisor name) on 127.0.0.1; ``mode``
says which, and the tests print it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

import psutil

_HOLDER = r"""
import os, subprocess, sys
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s,mode=1777", "tmpfs", "/dev/shm"], check=True)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
print("ready", flush=True)
sys.stdin.read()
"""


def namespaces_available() -> tuple[bool, str]:
    """Whether machines can be namespaces here, and if not, why."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            return False, f"{tool} not found"
    probe = subprocess.run(
        ["unshare", "-m", "-n", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return False, f"unshare failed: {probe.stderr.strip()}"
    return True, ""


class Machine:
    """One machine: where its processes run, its address, its segment directory."""

    def __init__(self, name: str, index: int, base: Path, ns: bool, shm_size: str) -> None:
        self.name = name
        self.index = index
        self.ns = ns
        self.ip = f"10.213.0.{index + 1}" if ns else "127.0.0.1"
        self.iface = "lo"  # the interface of ``ip`` (GLOO_SOCKET_IFNAME); set by _start/_link
        self.procs: list[subprocess.Popen[bytes]] = []
        self.holder: Optional[subprocess.Popen[str]] = None
        self.env = dict(os.environ)
        self.env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-supervisor-test-{name}-{base.name}"
        self.env["SHMSTORE_FALLBACK"] = "0"
        self.env.pop("SHMSTORE_NODE_ID", None)
        if ns:
            self.env.pop("SHMSTORE_DIR", None)
            self.segment_dir = Path("/dev/shm")
            self.holder = subprocess.Popen(
                [
                    "unshare",
                    "-m",
                    "-n",
                    "--propagation",
                    "private",
                    sys.executable,
                    "-c",
                    _HOLDER.replace("%s", shm_size),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.holder.stdout is not None
            line = self.holder.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"machine {name} did not start: {line!r}")
        else:
            self.segment_dir = base / f"shm-{name}"
            self.segment_dir.mkdir(mode=0o700)
            self.env["SHMSTORE_DIR"] = str(self.segment_dir)
            self.env["SHMSTORE_NODE_ID"] = f"test-{name}-{base.name}"

    def _prefix(self) -> list[str]:
        if not self.ns:
            return []
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--"]

    def run(self, cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        """Run a command in this machine and wait (60 s at most)."""
        return subprocess.run(
            self._prefix() + cmd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            **kw,  # type: ignore[arg-type]
        )

    def popen(
        self, cmd: list[str], log: Optional[Path] = None, **kw: object
    ) -> subprocess.Popen[bytes]:
        """Start a long-running process in this machine (tracked, killed at the end); its
        stderr goes to ``log`` if given."""
        with contextlib.ExitStack() as stack:
            if log is not None:
                kw["stderr"] = stack.enter_context(open(log, "wb"))
            p = subprocess.Popen(self._prefix() + cmd, env=self.env, **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def segments(self) -> list[str]:
        """Names of the shmstore segments (and .part files) in this machine's directory."""
        if self.ns:
            out = self.run(["ls", "-A", "/dev/shm"]).stdout.split()
        else:
            out = os.listdir(self.segment_dir)
        return sorted(n for n in out if n.startswith("shmstore-"))

    def tree(self) -> list[psutil.Process]:
        """Every process this machine's tracked processes started (nsenter, its child, and
        their descendants: nannies' workers included)."""
        out = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                out.append(root)
                out.extend(root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return out

    def kill_all(self) -> None:
        """SIGKILL every tracked process of this machine at once (not its supervisor)."""
        procs = self.tree()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()

    def netns_pids(self) -> list[int]:
        """Every process in this machine's network namespace (the supervisor included)."""
        if not self.ns or self.holder is None:
            return []
        try:
            mine = os.stat(f"/proc/{self.holder.pid}/ns/net").st_ino
        except OSError:
            return []
        out = []
        for pid in psutil.pids():
            if pid == self.holder.pid:
                continue
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}/ns/net").st_ino == mine:
                    out.append(pid)
        return out

    def close(self) -> None:
        self.kill_all()
        for pid in self.netns_pids():  # only processes inside our private namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.holder is not None:
            assert self.holder.stdin is not None and self.holder.stdout is not None
            self.holder.stdin.close()
            self.holder.stdout.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.holder.wait(timeout=30)
            if self.holder.poll() is None:
                self.holder.kill()
                self.holder.wait(timeout=30)


def _link(head: Machine, other: Machine, bridge: str, tag: str) -> None:
    assert head.holder is not None and other.holder is not None
    a, b = f"sh{tag}{other.index}h", f"sh{tag}{other.index}m"
    cmds = [
        ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
        ["ip", "link", "set", a, "netns", str(head.holder.pid)],
        ["ip", "link", "set", b, "netns", str(other.holder.pid)],
    ]
    for c in cmds:
        subprocess.run(c, check=True, capture_output=True, timeout=30)
    steps = [
        (head, ["ip", "link", "set", a, "master", bridge]),
        (head, ["ip", "link", "set", a, "up"]),
        (other, ["ip", "addr", "add", f"{other.ip}/24", "dev", b]),
        (other, ["ip", "link", "set", b, "up"]),
    ]
    for m, c in steps:
        r = m.run(c)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(c)}: {r.stderr.strip()}")
    other.iface = b


def _start(names: list[str], base: Path, ns: bool, shm_size: str) -> list[Machine]:
    started: list[Machine] = []
    try:
        for i, n in enumerate(names):
            started.append(Machine(n, i, base, ns, shm_size))
        if ns:
            head = started[0]
            tag = uuid.uuid4().hex[:4]
            bridge = "br0"
            for c in (
                ["ip", "link", "add", bridge, "type", "bridge"],
                ["ip", "addr", "add", f"{head.ip}/24", "dev", bridge],
                ["ip", "link", "set", bridge, "up"],
            ):
                r = head.run(c)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(c)}: {r.stderr.strip()}")
            head.iface = bridge
            for m in started[1:]:
                _link(head, m, bridge, tag)
    except BaseException:
        for m in started:
            m.close()
        raise
    return started


@contextlib.contextmanager
def machines(
    names: list[str], base: Path, *, force_env: bool = False, shm_size: str = "512m"
) -> Iterator[tuple[list[Machine], str]]:
    """Start the machines (the first is the head: the bridge is there); yields them and the
    mode ("namespaces" or "SHMSTORE_NODE_ID (no namespaces: <why>)"); tears everything down.
    Namespaces that start but cannot be networked fall back to the second mode too."""
    force_env = force_env or os.environ.get("SHMSTORE_TEST_NO_NAMESPACES") == "1"
    ok, why = (False, "asked for") if force_env else namespaces_available()
    started: list[Machine] = []
    try:
        if ok:
            try:
                started = _start(names, base, True, shm_size)
            except (RuntimeError, OSError, subprocess.SubprocessError, AssertionError) as e:
                ok, why = False, f"namespace set-up failed: {e}"
        if not ok:
            started = _start(names, base, False, shm_size)
        yield started, "namespaces" if ok else f"SHMSTORE_NODE_ID (no namespaces: {why})"
    finally:
        for m in started:
            m.close()


def wait_for(pred, what: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    """Wait until ``pred()`` is truthy (bounded in time and count); returns its value."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    for _ in range(100_000):
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    raise TimeoutError(f"gave up waiting for {what}")
