"""shmstore's PEP 517 build backend: maturin's, with no silent Rust download.

pip uses it only when no wheel fits (building the sdist or a git checkout). maturin's own
backend downloads a temporary Rust toolchain (about 735 MB, a couple of minutes, with one line
of output) when ``cargo`` is not on PATH. This wrapper instead stops at once with what to
install, unless the user asks for the download with ``SHMSTORE_INSTALL_RUST=1``
(docs/install.md). Everything else is maturin's backend unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import maturin

_HOW = """
shmstore: building from source needs Rust (cargo >= 1.85 on PATH), and none was found.

  - Wheels exist for Linux x86_64 (glibc >= 2.17) and CPython >= 3.11: if pip is building
    from source instead, check `pip --version` (pip >= 20.3) and `python --version`.
  - Install Rust >= 1.85 with rustup (https://rustup.rs), or your distribution's cargo
    package if it is that recent (Debian 13: apt install cargo), and run pip again.
  - Or let the build download a temporary toolchain (about 735 MB) for this one build:
    SHMSTORE_INSTALL_RUST=1 pip install <what you asked pip for: ., shmstore, ...>
"""


def _check_rust() -> None:
    if os.environ.get("SHMSTORE_INSTALL_RUST") == "1":
        return  # maturin downloads a toolchain if cargo is missing (its default)
    os.environ["MATURIN_NO_INSTALL_RUST"] = "1"
    if shutil.which("cargo") is None:
        sys.stderr.write(_HOW)
        raise SystemExit(1)


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    _check_rust()
    return list(maturin.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    _check_rust()
    return list(maturin.get_requires_for_build_editable(config_settings))


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    # Making an sdist compiles nothing: no Rust needed, and never a download.
    os.environ.setdefault("MATURIN_NO_INSTALL_RUST", "1")
    return list(maturin.get_requires_for_build_sdist(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    _check_rust()
    return str(maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings))


def build_wheel(
    wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None
) -> str:
    _check_rust()
    return str(maturin.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(
    wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None
) -> str:
    _check_rust()
    return str(maturin.build_editable(wheel_directory, config_settings, metadata_directory))


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    os.environ.setdefault("MATURIN_NO_INSTALL_RUST", "1")
    return str(maturin.build_sdist(sdist_directory, config_settings))
