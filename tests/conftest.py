"""Shared fixtures of the test suite (no tests here).

- Isolation (autouse, nothing to opt into): this pytest process gets a private root
  directory under /dev/shm (mode 0700, removed at exit), its own supervisor
  (``SHMSTORE_SUPERVISOR_NAME``, its log under ``XDG_RUNTIME_DIR`` in the root), its own
  disk-fallback directory, joblib temp folder and dask scratch space; every test gets its
  own segment directory (``SHMSTORE_DIR``) inside that root. Set up by
  ``pytest_configure`` in the pytest process; subprocesses inherit all of it through the
  environment. So no test sees stores that another test, another pytest run or any other
  process on the machine creates, and concurrent runs never share a supervisor.
  `segment_dir()` is the current test's directory.
- `records`: a small COCO-like dataset (the workload shmstore is built for).
- `no_leftover_segments`: fails a test that leaves new segment files behind (sealed segments
  or `*.part-*` files) anywhere in this run's private root. Not autouse: modules opt in with
  `pytestmark = pytest.mark.usefixtures("no_leftover_segments")`.
- `run_checked`: `subprocess.run` with a generous timeout whose failures (non-zero exit or
  timeout) report the child's output.
- hypothesis profiles "ci" (the default) and "fast", chosen with `HYPOTHESIS_PROFILE`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import glob
import itertools
import multiprocessing.forkserver as mp_forkserver
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shmstore
from hypothesis import HealthCheck, settings
from shmstore import _native
from shmstore._util import pid_alive

# --- hypothesis --------------------------------------------------------------------------

# Module-level fixtures (no_leftover_segments) wrap the whole @given test, which is what we
# want: the check runs once, after every example.
_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
settings.register_profile("ci", deadline=None, max_examples=200, suppress_health_check=_SUPPRESS)
settings.register_profile("fast", deadline=None, max_examples=25, suppress_health_check=_SUPPRESS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# --- data --------------------------------------------------------------------------------


def make_records(n: int = 50, seed: int = 0) -> list[dict]:
    """COCO-like records: file_name, height, width, image_id and 1-11 annotations."""
    rng = np.random.default_rng(seed)
    out = []
    ann_id = 0
    for i in range(n):
        anns = []
        for _ in range(int(rng.integers(1, 12))):
            ann_id += 1
            x, y, w, h = (round(float(v), 2) for v in rng.uniform(0, 500, 4))
            anns.append(
                {
                    "bbox": [x, y, w, h],
                    "category_id": int(rng.integers(1, 91)),
                    "area": round(w * h, 2),
                    "iscrowd": 0,
                    "id": ann_id,
                }
            )
        out.append(
            {
                "file_name": f"{i:012d}.jpg",
                "height": int(rng.integers(200, 640)),
                "width": int(rng.integers(200, 640)),
                "image_id": i,
                "annotations": anns,
            }
        )
    return out


@pytest.fixture
def records() -> list[dict]:
    """50 small COCO-like records (fresh per test, so tests may mutate them)."""
    return make_records()


# --- private segment directories ------------------------------------------------------------

SHM_DIR = Path("/dev/shm")
_ROOT_PREFIX = "shmstore_tests-"  # not "shmstore-": no sweep of /dev/shm ever looks at it


def _remove_stale_roots() -> None:
    """Remove the private roots of earlier runs that were killed before cleaning up: this
    user's directories named like ours whose pytest process is gone."""
    for entry in SHM_DIR.glob(f"{_ROOT_PREFIX}*"):
        try:
            st = entry.lstat()
            pid = int(entry.name[len(_ROOT_PREFIX) :].split("-")[0])
        except (OSError, ValueError):
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)  # fd-based: never follows a symlink


def _make_private_root() -> Path:
    """This run's root directory (mode 0700) in /dev/shm, and the environment that points
    shmstore (here and in every subprocess) at it."""
    _remove_stale_roots()
    root = Path(tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=SHM_DIR))
    fallback = root / "fallback"
    fallback.mkdir(mode=0o700)
    (root / "session").mkdir(mode=0o700)  # stores made outside any test (module set-up)
    (root / "joblib").mkdir(mode=0o700)  # joblib's own memmapping folders
    os.environ["SHMSTORE_DIR"] = str(root / "session")
    os.environ["SHMSTORE_FALLBACK_DIR"] = str(fallback)
    # short: the name also names the supervisor's socket file, and socket paths are limited
    os.environ["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-test-{os.getpid()}"
    # a supervisor round trip may take long on a busy machine (the default is tuned for users)
    os.environ.setdefault("SHMSTORE_SUPERVISOR_TIMEOUT", "10")
    os.environ["JOBLIB_TEMP_FOLDER"] = str(root / "joblib")
    # dask's scratch space (its lock files and the workers' spill directories), which it
    # otherwise makes in /tmp/dask-scratch-space and leaves there
    (root / "dask").mkdir(mode=0o700)
    os.environ["DASK_TEMPORARY_DIRECTORY"] = str(root / "dask")
    if "dask" in sys.modules:  # its config read the environment when it was imported
        sys.modules["dask"].config.set({"temporary-directory": str(root / "dask")})
    (root / "run").mkdir(mode=0o700)  # the supervisors' logs (docs/lifecycle.md)
    os.environ["XDG_RUNTIME_DIR"] = str(root / "run")
    creator = os.getpid()

    def remove_root() -> None:
        if os.getpid() == creator:  # not in a forked child that exits through atexit
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove_root)
    return root


PRIVATE_ROOT = Path("/nonexistent")  # set by pytest_configure
_test_numbers = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Set up the private root in the pytest process only: a hook, not import-time code,
    because other processes import this file too (spawned workers re-importing a test
    module, helper scripts using ``make_records``), and they must keep the environment
    they inherited."""
    global PRIVATE_ROOT
    PRIVATE_ROOT = _make_private_root()


def mappings_of(path: str | os.stat_result) -> list[tuple[int, int, str]]:
    """(start, end, perms) of this process's mappings of the file `path` (or of the file
    with that stat result: matched by device and inode, as /proc/self/maps may show
    another name of the file, e.g. the temporary name it was built under)."""
    st = path if isinstance(path, os.stat_result) else os.stat(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            dev = os.makedev(major, minor)
            if int(parts[4]) == st.st_ino and dev == st.st_dev:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


def segment_dir() -> Path:
    """The current test's segment directory (``$SHMSTORE_DIR``)."""
    return Path(os.environ["SHMSTORE_DIR"])


def gather_a_reclaim(released: int) -> None:
    """After this process let go of `released` arena chunks (handles closed), put and let go
    of tiny arena objects until they make a batch, without starting it: this process's next
    small put reclaims them all and takes the best fit among them (docs/arena.md, "Leases":
    released chunks are reclaimed once a batch has gathered)."""
    for _ in range(_native._ARENA_RECLAIM_BATCH - released):
        shmstore.put(b"", arena=True).close()


def _stop_forkserver() -> None:
    """Stop multiprocessing's forkserver if one runs: it keeps the environment it was started
    with, so the next test that uses it gets a fresh one with that test's ``SHMSTORE_DIR``
    (a child that creates a store by name must create it where its parent looks).

    ``_stop`` (what CPython's own tests use) closes the "alive" pipe and waits for the server.
    A forkserver child that a test left running holds that pipe too, and the server would
    not exit before it: after a bounded wait the server is killed."""
    server = getattr(mp_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    stopper = threading.Thread(target=server._stop, daemon=True)
    stopper.start()
    stopper.join(60)
    if stopper.is_alive():
        os.kill(pid, signal.SIGKILL)
        stopper.join(60)


@pytest.fixture(autouse=True)
def _private_segment_dir(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """Every test its own segment directory (mode 0700) in this run's private root. Tests
    that need another one (a small tmpfs, ...) set ``SHMSTORE_DIR`` themselves.

    The directories stay until the end of the run: a reused joblib worker started by an
    earlier test keeps that test's ``SHMSTORE_DIR`` in its environment."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]
    d = PRIVATE_ROOT / f"{next(_test_numbers):04d}-{tag}"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("SHMSTORE_DIR", str(d))
    yield d
    _stop_forkserver()


# --- leftover segments ---------------------------------------------------------------------

LEFTOVER_WAIT = 30.0  # seconds; waited only while something is left (the supervisor's unlink)


def _segment_files() -> set[Path]:
    """Segment files (sealed or ``.part-``) anywhere in this run's private root, and in the
    current ``SHMSTORE_DIR`` / fallback directory if a test pointed them elsewhere."""
    dirs = {PRIVATE_ROOT / "*"}
    for var in ("SHMSTORE_DIR", "SHMSTORE_FALLBACK_DIR"):
        if os.environ.get(var):
            dirs.add(Path(os.environ[var]))
    found: set[Path] = set()
    for d in dirs:
        found.update(Path(p) for p in glob.glob(str(d / "shmstore-*")))
    return found


@pytest.fixture
def no_leftover_segments() -> Iterator[None]:
    """Assert that the test leaves no new shmstore segment (or partial segment) behind.
    Everything in the private root belongs to this run, so every new file counts."""
    # The test's small objects go to an arena of its own (docs/arena.md): one a fixture or
    # an earlier test made is let go of here, and the test's is let go of at the end, so it
    # goes away (and is not reported) once none of its chunks is in use.
    _native._arena_release()
    before = _segment_files()
    yield
    gc.collect()
    _native._arena_release()
    # A segment that forked children mapped is unlinked by the supervisor once they have
    # exited (docs/lifecycle.md), a moment after the test: wait for that, bounded.
    deadline = time.monotonic() + LEFTOVER_WAIT
    while True:
        leftovers = sorted(_segment_files() - before)
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in leftovers:  # clean up so that one failure does not cascade into the next tests
        try:
            p.unlink()
        except OSError:
            pass
    assert not leftovers, f"test left segments behind: {[str(p) for p in leftovers]}"


# --- subprocesses ----------------------------------------------------------------------------

SUBPROCESS_TIMEOUT = 900.0  # seconds: generous, for a machine busy with other work


def _text(out: str | bytes | None, limit: int = 6000) -> str:
    if out is None:
        return ""
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    return out if len(out) <= limit else f"[... {len(out) - limit} chars cut]\n{out[-limit:]}"


def run_checked(
    args: list[str], *, timeout: float = SUBPROCESS_TIMEOUT, check: bool = True, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args)`` capturing text output. A timeout, or (with ``check``) a
    non-zero exit, fails the test with the child's exit status, stdout and stderr."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{args!r} still running after {timeout:.0f} s (killed)\n"
            f"--- stdout\n{_text(e.stdout)}\n--- stderr\n{_text(e.stderr)}"
        )
    if check and proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        pytest.fail(
            f"{args!r} failed ({how})\n"
            f"--- stdout\n{_text(proc.stdout)}\n--- stderr\n{_text(proc.stderr)}"
        )
    return proc


@contextlib.contextmanager
def mounted_tmpfs(base: Path, size: str, mode: str = "0700") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``base/small-shm`` for the block (root only; the test is
    skipped with the reason otherwise), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (run as root to test capacity checks)")
    mnt = base / "small-shm"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


# --- a second Unix user ------------------------------------------------------------------

OTHER_USER = "shmstore-test"


@pytest.fixture(scope="session")
def other_user() -> tuple[int, int]:
    """(uid, gid) of a second, unprivileged user, for attacks by a neighbour. Needs root:
    the user `shmstore-test` is created with `useradd` if missing (else `nobody` is used);
    tests act as it through `subprocess.run(..., user=uid, group=gid)`."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second Unix user (useradd, setuid)")
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            capture_output=True,
            check=False,
        )
        try:
            pw = pwd.getpwnam(OTHER_USER)
        except KeyError:
            pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


@pytest.fixture
def neighbour_dir(other_user: tuple[int, int]) -> Iterator[Path]:
    """A directory in /tmp owned by the other user (mode 0755), which both users can reach."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="shmstore-neighbour-", dir="/tmp"))
    os.chmod(d, 0o755)
    os.chown(d, *other_user)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pytest_report_header() -> list[str]:
    """Which shmstore the suite tests (the working tree's build or an installed wheel), and
    where its private directories are."""
    import shmstore

    native = Path(shmstore._native.__file__).name
    return [
        f"shmstore: {shmstore.__file__} ({native})",
        f"shmstore test root: {PRIVATE_ROOT}",
    ]
