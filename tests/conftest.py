"""Shared fixtures of the test suite (no tests here).

- `records`: a small COCO-like dataset (the workload shmstore is built for).
- `no_leftover_segments`: fails a test that leaves new `/dev/shm/shmstore-*` files behind
  (sealed segments or `*.part-*` files). Not autouse: modules opt in with
  `pytestmark = pytest.mark.usefixtures("no_leftover_segments")`.
- hypothesis profiles "ci" (the default) and "fast", chosen with `HYPOTHESIS_PROFILE`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
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


# --- leftover segments ---------------------------------------------------------------------

SHM_DIR = Path("/dev/shm")
LEFTOVER_WAIT = 5.0  # seconds
_PID_AT = 96  # creator pid (u32 LE) in the 128-byte header (src/archive/header.rs)


def _watched_dirs() -> list[Path]:
    """/dev/shm and the disk fallback directory (docs/lifecycle.md)."""
    fallback = os.environ.get("SHMSTORE_FALLBACK_DIR") or f"/var/tmp/shmstore-{os.geteuid()}"
    return [SHM_DIR, Path(fallback)]


def _segment_files() -> set[Path]:
    return {p for d in _watched_dirs() for p in d.glob("shmstore-*")}


def _descendants() -> set[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dev dependency
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _holders(path: Path) -> set[int]:
    """Pids that have `path` open (scan of /proc/*/fd)."""
    target = str(path)
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        pids.add(int(proc.name))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids


def _is_ours(path: Path) -> bool:
    """Whether a new file was left by this test (not by an unrelated, concurrent process,
    e.g. a benchmark someone else runs on this machine)."""
    mine = {os.getpid()} | _descendants()
    if ".part-" in path.name:
        # A file being written: foreign if only a live foreign process has it open.
        holders = _holders(path)
        return not holders or bool(holders & mine)
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except FileNotFoundError:
        return False  # removed meanwhile
    except OSError:
        return True
    if len(head) < _PID_AT + 4:
        return True
    (pid,) = struct.unpack_from("<I", head, _PID_AT)
    return pid in mine or not pid_alive(pid)


@pytest.fixture
def no_leftover_segments():
    """Assert that the test leaves no new shmstore segment (or partial segment) in /dev/shm
    (or in the disk fallback directory)."""
    before = _segment_files()
    yield
    gc.collect()
    # A segment that forked children mapped is unlinked by the supervisor once they have
    # exited (docs/lifecycle.md), a moment after the test: wait for that, bounded.
    deadline = time.monotonic() + LEFTOVER_WAIT
    while True:
        leftovers = [p for p in sorted(_segment_files() - before) if _is_ours(p)]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for p in leftovers:  # clean up so that one failure does not cascade into the next tests
        try:
            p.unlink()
        except OSError:
            pass
    assert not leftovers, f"test left segments behind: {[str(p) for p in leftovers]}"


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
