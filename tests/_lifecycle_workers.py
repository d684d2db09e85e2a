"""Worker processes for tests/test_lifecycle.py and benchmarks/bench_lifecycle.py.

Run as ``python tests/_lifecycle_workers.py ROLE [ARGS...]`` with the test's environment
(``SHMSTORE_DIR``, ``SHMSTORE_SUPERVISOR_NAME``, ...). Roles:

- ``client``: a scripted shmstore user. Reads one command per line on stdin and answers one
  line on stdout: ``OK ...`` or ``ERR <ExceptionType> <message>``. Commands:

  ``ping``                       ``OK <pid>``
  ``create N [NAME]``            build a SharedList of N records: ``OK <name> <path>``
  ``put NBYTES``                 ``shmstore.put(bytes)``: ``OK <name> <path>``
  ``attach NAME``                attach and check every record: ``OK <path>``
  ``attachref NAME``             ``Ref.attach(NAME)``: ``OK <path> <len of the value>``
  ``read NAME``                  check every record of an attached/created store: ``OK <n>``
  ``readloop NAME``              start a thread that keeps checking every record
  ``readstat``                   ``OK <passes> <errors>`` of the read loops
  ``close NAME``                 close and forget the handle (its last mapping here goes)
  ``unlink NAME``                ``unlink()``: ``OK <whether the file still exists>``
  ``pickle NAME``                ``OK <hex of pickle.dumps(handle)>``
  ``unpickle HEX``               unpickle, check every record: ``OK <name>``
  ``fork_create N``              fork a child that creates its own store and waits:
                                 ``OK <child pid> <name> <path>``
  ``fork_reader NAME GO RESULT`` fork a child that only reads the inherited handle (no shmstore
                                 call that would register it), waits for a byte on fd GO,
                                 reads again and writes ``OK <n>`` to fd RESULT: ``OK <pid>``
  ``child_exit PID``             tell that child to exit normally, reap it: ``OK <status>``
  ``reap PID``                   wait for that child (e.g. after the test SIGKILLed it)
  ``build_blocking N``           start building a SharedList, print ``MID <pid>`` after N
                                 records, then block (reading stdin) inside the build
  ``create_in DIR N NAME``       build a SharedList of N records named NAME in DIR (``dir=``)
  ``save NAME PATH [MODE]``      ``save()`` that store's archive to PATH (octal MODE): ``OK``
  ``attach_in NAME DIR``         attach by name with ``dir=DIR``, check it: ``OK <path>``
  ``timed_attach NAME``          attach (a ticker thread runs meanwhile), close it again:
                                 ``OK <seconds for attach> <seconds for close> <ticks>``
  ``putmany K``                  ``put()`` K tiny stores (kept): ``OK <first path>``
  ``closeall``                   drop every handle, flush the queued DROPs: ``OK <seconds>``
  ``forkstorm K [arena]``        a thread creates and unlinks stores in a loop while the main
                                 thread forks K children that each create a store and exit
                                 (segments; ``arena``: small objects' chunks of arenas):
                                 ``OK <children that hung> <that failed> <stores the thread
                                 made>`` (a failure's traceback goes to stderr)
  ``nodump``                     make this process non-dumpable (prctl): its /proc entries
                                 become unreadable to other processes of the same user
  ``warnings``                   the shmstore WARNING log records so far, joined by ``|``
  ``registered NAME``            ``OK True`` if this process told the supervisor it uses
                                 that store and was not refused, else ``OK False``
  ``sync``                       two HELLO round trips with this user's supervisor on a
                                 connection kept open (see ``Lifecycle.sync``): ``OK``
  ``raise``                      raise an exception out of the main module (exit code 1)
  ``exit``                       ``OK`` then a normal exit

- ``cycler K RECORDS``: K times fork a child that creates a store, wait until it has, then
  SIGKILL it. Prints ``DONE <K>``.

Records are ``record(i)`` below, so every reader can check what it reads.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback


def record(i: int) -> dict:
    return {"i": i, "s": f"rec-{i}", "xs": [i, 2 * i, 3 * i], "f": i / 4}


def proc_state(pid: int | str, task: int | str | None = None) -> str:
    """State, kernel wait channel and system call of a process (or one of its threads)."""
    base = f"/proc/{pid}" + (f"/task/{task}" if task is not None else "")
    out = []
    for name in ("stat", "wchan", "syscall"):
        try:
            with open(f"{base}/{name}") as f:
                text = f.read().strip()
        except OSError as e:
            text = f"({e.strerror})"
        if name == "stat":  # "pid (comm) S ...": the state follows the last ')'
            text = text.rpartition(")")[2].split()[0] if ")" in text else text
        out.append(f"{name}={text}")
    return " ".join(out)


def describe_hung(pid: int) -> str:
    """What a hung child is doing, for the failure's output: each thread's state, wait
    channel and system call, the supervisor's (its pid from its lock file), and the
    threads' stacks when gdb is installed (bounded)."""
    import shutil
    import subprocess

    lines = [f"child {pid}:"]
    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError as e:
        tasks = []
        lines.append(f"  no /proc entry ({e.strerror})")
    lines += [f"  thread {t}: {proc_state(pid, t)}" for t in tasks]
    run = os.environ.get("XDG_RUNTIME_DIR", "")
    name = os.environ.get("SHMSTORE_SUPERVISOR_NAME", "shmstore-supervisor")
    try:
        with open(os.path.join(run, "shmstore", f"{name}.lock")) as f:
            sup = f.read().strip()
        lines.append(f"supervisor {sup}: {proc_state(sup)}")
    except OSError as e:
        lines.append(f"supervisor: no lock file ({e.strerror})")
    gdb = shutil.which("gdb")
    if gdb:
        try:
            bt = subprocess.run(
                [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            lines += [f"  {line}" for line in bt.splitlines() if line.startswith(("#", "Thread"))]
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"gdb: {e}")
    return "\n".join(lines)


def connect_waiting(s, path: str, timeout: float) -> None:
    """Connect the AF_UNIX stream socket ``s`` to ``path`` as shmstore's own client does:
    while the listen backlog is full (a flood of connections the supervisor has not
    accepted yet), wait for room, for at most ``timeout`` seconds; then give ``s`` that
    timeout for its reads and writes.

    A socket with a Python timeout is non-blocking underneath, and a non-blocking connect
    to a full backlog fails at once with ``EAGAIN`` (``BlockingIOError``); a blocking one
    waits in the kernel until the server accepts, bounded by ``SO_SNDTIMEO``.
    """
    import socket
    import struct

    s.settimeout(None)
    whole = int(timeout)
    s.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_SNDTIMEO,
        struct.pack("ll", whole, int((timeout - whole) * 1_000_000)),
    )
    s.connect(path)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
    s.settimeout(timeout)


def check_all(handle) -> int:
    n = len(handle)
    for i in range(n):
        got = handle[i]
        if got["i"] != i or got["s"] != f"rec-{i}" or list(got["xs"]) != [i, 2 * i, 3 * i]:
            raise AssertionError(f"record {i} reads {got.to_python()!r}")
    return n


class Client:
    def __init__(self) -> None:
        import shmstore

        self.shmstore = shmstore
        self.handles: dict[str, object] = {}
        self.children: dict[int, int] = {}  # child pid -> write end of its "exit" pipe
        self.loops: list[list[int]] = []  # [passes, errors] per read loop
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[object] = []
        self.warned: list[logging.LogRecord] = []
        warned = self.warned

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warned.append(record)

        logger = logging.getLogger("shmstore")
        logger.addHandler(Keep(logging.WARNING))
        logger.setLevel(logging.DEBUG if os.environ.get("SHMSTORE_TEST_DEBUG") else logging.INFO)

    def cmd_create_in(self, directory: str, n: str, name: str) -> str:
        h = self.shmstore.SharedList((record(i) for i in range(int(n))), name=name, dir=directory)
        self.handles[h.name] = h
        return f"OK {h.name} {self.shmstore._native._store_info(h)['path']}"

    def cmd_save(self, name: str, path: str, mode: str = "600") -> str:
        self.handles[name].save(path, mode=int(mode, 8))
        return "OK"

    def cmd_attach_in(self, name: str, directory: str) -> str:
        h = self.shmstore.SharedList.attach(name, dir=directory)
        check_all(h)
        self.handles[h.name] = h
        return f"OK {self.shmstore._native._store_info(h)['path']}"

    def cmd_timed_attach(self, name: str) -> str:
        ticks = [0]
        done = threading.Event()

        def tick() -> None:  # needs the GIL: stalls if a wait holds it
            while not done.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        t = threading.Thread(target=tick, daemon=True)
        t.start()
        t0 = time.monotonic()
        h = self.shmstore.SharedList.attach(name)
        t1 = time.monotonic()
        check_all(h)
        t2 = time.monotonic()
        h.close()
        del h
        gc.collect()
        t3 = time.monotonic()
        done.set()
        t.join()
        return f"OK {t1 - t0:.4f} {t3 - t2:.4f} {ticks[0]}"

    def cmd_putmany(self, k: str) -> str:
        first = ""
        for i in range(int(k)):
            h = self.shmstore.put(i, arena=False)
            self.handles[h.name] = h
            if not first:
                first = self.shmstore._native._store_info(h)["path"]
        return f"OK {first}"

    def cmd_closeall(self) -> str:
        t0 = time.monotonic()
        self.handles.clear()
        gc.collect()
        self.shmstore._native._flush_drops()
        return f"OK {time.monotonic() - t0:.4f}"

    def cmd_forkstorm(self, k: str, how: str = "segment") -> str:
        stop = threading.Event()
        made = [0]
        arena = how == "arena"

        def churn() -> None:  # supervisor round trips (or arena work), all the time
            while not stop.is_set():
                h = self.shmstore.put(made[0], arena=arena)
                h.unlink()
                h.close()
                made[0] += 1

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        hung = failed = 0
        try:
            for _ in range(int(k)):
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        h = self.shmstore.put(b"child", arena=arena)
                        h.unlink()
                        h.close()
                        code = 0
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        os._exit(code)
                deadline = time.monotonic() + 20
                while True:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        if os.waitstatus_to_exitcode(status) != 0:
                            failed += 1
                        break
                    if time.monotonic() > deadline:
                        print(f"child {pid} hung", file=sys.stderr, flush=True)
                        print(describe_hung(pid), file=sys.stderr, flush=True)
                        if os.environ.get("SHMSTORE_TEST_HANG_DEBUG"):
                            time.sleep(3600)
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        hung += 1
                        break
                    time.sleep(0.001)
        finally:
            stop.set()
            t.join()
        return f"OK {hung} {failed} {made[0]}"

    def cmd_nodump(self) -> str:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
            return f"ERR OSError prctl errno {ctypes.get_errno()}"
        return "OK"

    def cmd_registered(self, name: str) -> str:
        return f"OK {self.shmstore._native._store_info(self.handles[name])['registered']}"

    def cmd_warnings(self) -> str:
        return "OK " + "|".join(r.getMessage().replace("\n", " ") for r in self.warned)

    def cmd_sync(self) -> str:
        import socket

        run = os.environ.get("XDG_RUNTIME_DIR")
        assert run, "sync needs XDG_RUNTIME_DIR"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socks.append(s)
        name = os.environ["SHMSTORE_SUPERVISOR_NAME"] + ".sock"
        connect_waiting(s, os.path.join(run, "shmstore", name), 60)
        for _ in range(2):
            s.sendall(b"HELLO %d\n" % os.getpid())
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(256)
                if not chunk:
                    return "ERR EOFError the supervisor closed the connection"
                buf += chunk
        return "OK"

    def cmd_ping(self) -> str:
        return f"OK {os.getpid()}"

    def cmd_create(self, n: str, name: str | None = None) -> str:
        h = self.shmstore.SharedList((record(i) for i in range(int(n))), name=name)
        self.handles[h.name] = h
        return f"OK {h.name} {self.shmstore._native._store_info(h)['path']}"

    def cmd_put(self, nbytes: str) -> str:
        h = self.shmstore.put(b"\x5a" * int(nbytes), arena=False)
        self.handles[h.name] = h
        return f"OK {h.name} {self.shmstore._native._store_info(h)['path']}"

    def cmd_putarena(self, nbytes: str) -> str:
        h = self.shmstore.put(b"\x5a" * int(nbytes), arena=True)
        self.handles[h.name] = h
        return f"OK {h.name} {self.shmstore._native._store_info(h)['path']}"

    def cmd_build_blocking(self, n: str) -> str:
        def records():
            for i in range(int(n)):
                yield record(i)
            print(f"MID {os.getpid()}", flush=True)
            sys.stdin.readline()  # the test SIGKILLs us here, in the middle of the build
            yield record(int(n))

        h = self.shmstore.SharedList(records())
        self.handles[h.name] = h
        return f"OK {h.name}"

    def cmd_attach(self, name: str) -> str:
        h = self.shmstore.SharedList.attach(name)
        check_all(h)
        self.handles[h.name] = h
        return f"OK {self.shmstore._native._store_info(h)['path']}"

    def cmd_attachref(self, name: str) -> str:
        h = self.shmstore.Ref.attach(name)
        self.handles[h.name] = h
        return f"OK {self.shmstore._native._store_info(h)['path']} {len(h.get())}"

    def cmd_read(self, name: str) -> str:
        return f"OK {check_all(self.handles[name])}"

    def cmd_readloop(self, name: str) -> str:
        h = self.handles[name]
        stat = [0, 0]
        self.loops.append(stat)

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    check_all(h)
                except Exception:
                    stat[1] += 1
                stat[0] += 1

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append(t)
        return "OK"

    def cmd_readstat(self) -> str:
        return f"OK {sum(s[0] for s in self.loops)} {sum(s[1] for s in self.loops)}"

    def cmd_close(self, name: str) -> str:
        h = self.handles.pop(name)
        h.close()
        del h
        gc.collect()
        return "OK"

    def cmd_unlink(self, name: str) -> str:
        h = self.handles[name]
        path = self.shmstore._native._store_info(h)["path"]
        h.unlink()
        return f"OK {os.path.exists(path)}"

    def cmd_pickle(self, name: str) -> str:
        return f"OK {pickle.dumps(self.handles[name]).hex()}"

    def cmd_unpickle(self, data: str) -> str:
        h = pickle.loads(bytes.fromhex(data))
        check_all(h)
        self.handles[h.name] = h
        return f"OK {h.name}"

    def cmd_fork_create(self, n: str) -> str:
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: its own store, then wait for "exit" (or a SIGKILL)
            code = 0
            try:
                os.close(ready_r)
                os.close(exit_w)
                h = self.shmstore.SharedList(record(i) for i in range(int(n)))
                check_all(h)
                path = self.shmstore._native._store_info(h)["path"]
                os.write(ready_w, f"{h.name} {path}\n".encode())
                os.read(exit_r, 1)
                check_all(h)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(exit_r)
        line = read_line(ready_r, 30.0)
        os.close(ready_r)
        self.children[pid] = exit_w
        return f"OK {pid} {line}"

    def cmd_fork_reader(self, name: str, go_fd: str, result_fd: str) -> str:
        h = self.handles[name]
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(ready_r)
                check_all(h)
                os.write(ready_w, b"ready\n")
                os.read(int(go_fd), 1)  # the test holds the write end
                n = check_all(h)
                os.write(int(result_fd), f"OK {n}\n".encode())
                code = 0
            except BaseException as e:
                os.write(int(result_fd), f"ERR {type(e).__name__} {e}\n".encode())
            finally:
                os._exit(code)
        os.close(ready_w)
        read_line(ready_r, 30.0)
        os.close(ready_r)
        return f"OK {pid}"

    def cmd_child_exit(self, pid: str) -> str:
        os.close(self.children.pop(int(pid)))
        _, status = os.waitpid(int(pid), 0)
        return f"OK {os.waitstatus_to_exitcode(status)}"

    def cmd_reap(self, pid: str) -> str:
        fd = self.children.pop(int(pid), None)
        if fd is not None:
            os.close(fd)
        _, status = os.waitpid(int(pid), 0)
        return f"OK {os.waitstatus_to_exitcode(status)}"

    def run(self) -> None:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "raise":
                raise RuntimeError("exit by exception (requested by the test)")
            if words[0] == "exit":
                self.stop.set()
                for t in self.threads:
                    t.join()
                print("OK", flush=True)
                return
            try:
                reply = getattr(self, "cmd_" + words[0])(*words[1:])
            except Exception as e:
                msg = " ".join(str(e).split())
                reply = f"ERR {type(e).__name__} {msg}"
            print(reply, flush=True)


def read_line(fd: int, timeout: float) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError("no line from the child")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise EOFError(f"child closed the pipe after {buf!r}")
        buf += chunk
    return buf.decode().strip()


def cycler(k: int, n: int) -> None:
    """K times: fork a child that creates a store and then blocks; SIGKILL it once it has."""
    import shmstore

    for _ in range(k):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                h = shmstore.SharedList(record(i) for i in range(n))
                os.write(w, h.name.encode() + b"\n")
                while True:
                    signal.pause()
            finally:
                os._exit(1)
        os.close(w)
        try:
            read_line(r, 30.0)
        finally:
            os.close(r)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    print(f"DONE {k}", flush=True)


def main() -> None:
    role = sys.argv[1]
    if role == "client":
        # A program started in a terminal: Ctrl-C raises KeyboardInterrupt. Python installs
        # that handler only if SIGINT is not ignored at startup, and a test suite run as a
        # background job of a non-interactive shell (CI scripts, `cmd &`) passes SIGINT on
        # ignored; the tests that send SIGINT would then wait for nothing.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        Client().run()
    elif role == "cycler":
        cycler(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
