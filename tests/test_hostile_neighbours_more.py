"""More attacks by a neighbour (docs/security.md): a planted state directory, a write
descriptor kept across ``chmod g-w``, swapped stores in a group-writable directory, sparse
files, a planted fetch lock, forged pickles, deep nesting in threads with small stacks.
Tests that need a second Unix user run as root (the `other_user` fixture) and skip
otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import shmstore

from conftest import run_checked

# --- a state directory planted in /tmp ---------------------------------------------------


@pytest.fixture
def sticky_tmp(other_user: tuple[int, int]) -> Iterator[Path]:
    """A world-writable sticky directory, as /tmp is, that the other user can reach."""
    d = Path(tempfile.mkdtemp(prefix="shmstore-sticky-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


CHANNEL_USER = r"""
import logging, sys
import shmstore
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
ch = shmstore.Channel()
ch.put([1, 2, 3])
print("got", ch.get(timeout=30).to_python())
with shmstore.put({"a": 1}) as r:
    print("store", r.get()["a"])
"""


def test_a_state_directory_planted_in_tmp_sends_the_user_to_home(
    sticky_tmp, tmp_path, other_user
):
    """With XDG_RUNTIME_DIR unset, another user who creates ``$TMPDIR/shmstore-<uid>`` first
    used to turn supervision off for good (Channel() raised, gc refused). Now this user's
    supervisor lives under $HOME, and everything (supervisor, Channel, gc) agrees on it."""
    planted = sticky_tmp / f"shmstore-{os.geteuid()}"
    subprocess.run(
        ["mkdir", "-m", "755", str(planted)],
        user=other_user[0],
        group=other_user[1],
        check=True,
    )
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(sticky_tmp), HOME=str(home), SHMSTORE_SUPERVISOR_GRACE="0.2")
    env["SHMSTORE_SUPERVISOR_NAME"] = f"shmstore-plant-{os.getpid()}"
    proc = run_checked([sys.executable, "-c", CHANNEL_USER], env=env)
    out = proc.stdout + proc.stderr  # said at import, before logging is configured
    assert "got [1, 2, 3]" in out and "store 1" in out, out
    state = home / ".cache" / "shmstore"
    runs = list(state.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("run-"), runs
    assert (runs[0].stat().st_mode & 0o777) == 0o700
    assert str(runs[0]) in out, out  # said where, once
    assert out.count("supervisor keeps its state in") == 1, out
    gc = run_checked([sys.executable, "-m", "shmstore", "gc", "--dry-run"], env=env, check=False)
    assert gc.returncode in (0, 1), gc.stdout + gc.stderr
    assert "refusing" not in gc.stdout + gc.stderr
    # The planter removing its directory later does not split this user's processes.
    subprocess.run(["rmdir", str(planted)], user=other_user[0], group=other_user[1], check=True)
    out = run_checked([sys.executable, "-c", CHANNEL_USER], env=env).stdout
    assert "got [1, 2, 3]" in out, out
    assert not planted.exists()
