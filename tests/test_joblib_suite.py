"""joblib's own tests, run with shmstore.joblib's backends in place of joblib's.

joblib ships its test suite inside the package (``joblib.test``). ``test_parallel`` and
``test_memmapping`` run in a subprocess with the plugin ``tests/joblib_suite/shmstore_backends.py``,
which registers our backends under joblib's names ("loky", "multiprocessing", "threading"), so
every ``Parallel`` of those tests runs through ours. The expected differences are listed, with
the reason for each, in that plugin's ``EXPECTED`` (strict xfail: each must fail, nothing else
may). For time, :data:`SLOW` leaves out the slowest test functions (the reasons are there);
everything else of the two modules runs: about 600 tests, 3-4 minutes on 2 busy cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("joblib.test", reason="joblib (with its tests) is in requirements-dev.txt")

PLUGIN_DIR = Path(__file__).parent / "joblib_suite"
TIMEOUT_S = 900

#: test functions left out for time (about a third of the run), none of which tests what our
#: backends change (how a task batch and its arrays are pickled):
SLOW = (
    # what a worker process does on its own: BLAS/OpenMP thread limits, initializers
    "test_threadpool_limitation_in_child",
    "test_threadpool_limitation_in_child_context_manager",
    "test_threadpool_limitation_in_child_override",
    "test_no_blas_crash_or_freeze_with_subprocesses",
    "test_initializer_context",
    "test_initializer_not_reused",
    "test_initializer_reused",
    "test_initializer_parallel",
    # joblib's MemmappingPool used directly (no backend involved)
    "test_pool_with_memmap",
    "test_pool_with_memmap_array_view",
    # many pools started to provoke races in joblib's own dispatch and abort paths
    "test_dispatch_race_condition",
    "test_error_capture",
    "test_abort_backend",
)


@pytest.mark.slow
def test_joblib_own_suite_passes_with_shmstore_backends(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    segdir = Path(tempfile.mkdtemp(prefix="shmstore-joblib-suite-", dir="/dev/shm"))
    # joblib's tests check its default temp folder (/dev/shm when large enough): no override
    env = {k: v for k, v in os.environ.items() if k != "JOBLIB_TEMP_FOLDER"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]),
        SHMSTORE_DIR=str(segdir),
        SHMSTORE_SUPERVISOR_NAME=f"shmstore-joblib-suite-{uuid.uuid4().hex[:12]}",
    )
    deselect = " and ".join(f"not {name}" for name in SLOW)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "shmstore_backends",
        "-c",
        str(tmp_path / "pytest.ini"),
        "--rootdir",
        str(tmp_path),
        "-rfX",
        "-k",
        deselect,
        "--pyargs",
        "joblib.test.test_parallel",
        "joblib.test.test_memmapping",
    ]
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    finally:
        shutil.rmtree(segdir, ignore_errors=True)
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    assert proc.returncode == 0, f"joblib's suite with shmstore's backends failed:\n{tail}"
    assert " passed" in proc.stdout and "xfailed" in proc.stdout, tail
