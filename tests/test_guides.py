"""The guides' code runs as written: each guide's ```python blocks, in order, as one script
(or, for a guide whose code is a test file, through pytest), in a fresh interpreter.

A block whose first line is ``# illustrative: <why>`` is left out (and listed in the test's
output); every other block runs. A guide that imports a package that is not installed (torch,
xgboost, distributed) is skipped, naming it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_checked

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
ILLUSTRATIVE = "# illustrative:"


def guide_script(text: str) -> tuple[str, list[str]]:
    """The code that runs (blocks joined) and the reasons of the blocks left out."""
    code, left_out = [], []
    for m in BLOCK.finditer(text):
        block = m.group(1)
        first = block.lstrip().splitlines()[0] if block.strip() else ""
        if first.startswith(ILLUSTRATIVE):
            left_out.append(first[len(ILLUSTRATIVE) :].strip())
        else:
            code.append(block)
    return "\n".join(code), left_out


def imported_packages(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device (asked in a child: importing torch
    here would slow every other test of this process)."""
    if importlib.util.find_spec("torch") is None:
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], timeout=300).returncode == 0


def test_the_marker_is_rare_and_says_why() -> None:
    reasons = [r for g in GUIDES for r in guide_script(g.read_text())[1]]
    assert len(reasons) <= 2, reasons
    assert all(len(r) > 10 for r in reasons), reasons


def test_each_guide_says_what_it_needs() -> None:
    for g in GUIDES:
        assert "Needs:" in g.read_text().split("\n## ", 1)[0], f"{g.name}: no 'Needs:' at the top"


@pytest.mark.slow
@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_guide_code_runs_as_written(guide: Path, tmp_path: Path) -> None:
    code, left_out = guide_script(guide.read_text())
    assert code.strip(), f"{guide.name} has no runnable code"
    if left_out:
        print(f"{guide.name}: left out (illustrative): {left_out}")
    missing = sorted(p for p in imported_packages(code) if importlib.util.find_spec(p) is None)
    if missing:
        pytest.skip(f"{guide.name} needs {', '.join(missing)}, not installed")
    if re.search(r"[\"']cuda[\"':]", code) and not cuda_available():
        pytest.skip(f"{guide.name} needs a CUDA device (its code copies to one)")
    script = tmp_path / f"test_guide_{guide.stem}.py"
    script.write_text(code)
    if re.search(r"^def test_", code, re.M):
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        args = [sys.executable, str(script)]
    run_checked(args, cwd=tmp_path, timeout=600)
