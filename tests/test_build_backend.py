"""Building from source without Rust (build_backend/shmstore_build.py, docs/install.md):
pip stops at once with what to install, instead of maturin's silent toolchain download."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "build_backend" / "shmstore_build.py"
TIMEOUT_S = 300


def _backend() -> ModuleType:
    pytest.importorskip("maturin")
    spec = importlib.util.spec_from_file_location("shmstore_build", BACKEND)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_without_cargo_stops_with_what_to_install(tmp_path: Path) -> None:
    """``pip wheel`` of the source tree with no ``cargo`` on PATH (only this Python, through
    its absolute path): exits non-zero, naming Rust, the version needed and the opt-in
    download; maturin is never asked to build."""
    pytest.importorskip("maturin")
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("not run from a source checkout")
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MATURIN", "SHMSTORE_INST"))}
    env["PATH"] = str(empty)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]
    proc = subprocess.run(
        [*pip, "--no-index", "-w", str(tmp_path / "out"), str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    assert "building from source needs Rust (cargo >= 1.85 on PATH)" in said, said
    assert "SHMSTORE_INSTALL_RUST=1" in said, said
    assert not list((tmp_path / "out").glob("*.whl"))


def test_with_cargo_the_build_never_downloads_rust(monkeypatch: pytest.MonkeyPatch) -> None:
    """With cargo found, the backend still tells maturin not to install a toolchain; with
    ``SHMSTORE_INSTALL_RUST=1`` it leaves maturin's default alone."""
    backend = _backend()
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("MATURIN_NO_INSTALL_RUST", raising=False)
    monkeypatch.delenv("SHMSTORE_INSTALL_RUST", raising=False)
    backend._check_rust()
    assert os.environ["MATURIN_NO_INSTALL_RUST"] == "1"
    monkeypatch.delenv("MATURIN_NO_INSTALL_RUST")
    monkeypatch.setenv("SHMSTORE_INSTALL_RUST", "1")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    backend._check_rust()  # no SystemExit: the user asked for the download
    assert "MATURIN_NO_INSTALL_RUST" not in os.environ
