"""Every examples/*.py script runs as the guides in docs/guides/ show it (small sizes)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_checked

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

SCRIPTS = {
    "joblib_slices.py": (["--mib", "16"], ["joblib"]),
    "dataloader_ddp.py": (["--n", "2000"], []),
    "ddp_multinode.py": (["--n", "3000"], []),
    "dask_cluster.py": (["--n", "3000"], ["distributed", "joblib"]),
    "docstore.py": (["--docs", "3000", "--ranks", "3"], []),
    "xgboost_joblib.py": (["--rows", "8000"], ["joblib", "xgboost"]),
    "copy_on_read.py": (["--n", "20000"], []),
    "typed_usage.py": ([], []),  # also checked by mypy --strict and pyright (make lint)
}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return run_checked([sys.executable, *args], cwd=ROOT)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs(script: str) -> None:
    args, needs = SCRIPTS[script]
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (requirements-dev.txt has it)")
    _run([str(EXAMPLES / script), *args])


def test_pytest_guide_example() -> None:
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/pytest_guide_test.py"])
    assert "1 passed, 1 xfailed" in proc.stdout


def test_every_example_is_covered() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"pytest_guide_test.py"}
    assert scripts == set(SCRIPTS)
