"""The release path: the workflow file is valid YAML that publishes only from a tag with
trusted publishing, and .ci/pypi-metadata makes README's links absolute for PyPI."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_metadata_script() -> ModuleType:
    path = ROOT / ".ci" / "pypi-metadata"
    loader = importlib.machinery.SourceFileLoader("pypi_metadata", str(path))
    spec = importlib.util.spec_from_loader("pypi_metadata", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_pypi_metadata_makes_readme_links_absolute_and_adds_project_urls(
    tmp_path: Path,
) -> None:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "pypi-metadata", tmp_path / ".ci")
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    base, commit = "https://github.com/example/shmstore", "0123abc"
    subprocess.run(
        [sys.executable, str(tmp_path / ".ci" / "pypi-metadata"), base, commit],
        check=True,
        timeout=60,
    )
    readme = (tmp_path / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets and all(t.startswith(("https://", "#")) for t in targets), targets
    assert f"]({base}/blob/{commit}/docs/install.md)" in readme
    assert f"]({base}/tree/{commit}/benchmarks/results)" in readme
    meta = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert meta["project"]["urls"]["Homepage"] == base
    assert meta["project"]["urls"]["Changelog"] == f"{base}/blob/{commit}/CHANGELOG.md"
    assert meta["tool"]["maturin"]["module-name"] == "shmstore._native"  # the rest intact


def test_pypi_metadata_doctest_and_bad_arguments() -> None:
    import doctest

    mod = _load_metadata_script()
    assert doctest.testmod(mod).failed == 0
    assert mod.main(["not-a-url", "abc"]) == 2


def test_the_repository_has_no_placeholder_project_urls() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "urls" not in meta["project"]  # written at release time, from the real URL


def test_release_workflow_publishes_only_tags_with_trusted_publishing() -> None:
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    jobs = wf["jobs"]
    publish = jobs["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["if"] == "startsWith(github.ref, 'refs/tags/v')"
    assert set(publish["needs"]) == {"build", "smoke"}
    steps = publish["steps"]
    assert any(s.get("uses", "").startswith("pypa/gh-action-pypi-publish@") for s in steps)
    assert wf["permissions"] == {"contents": "read"}
    build = "\n".join(s.get("run", "") for s in jobs["build"]["steps"])
    assert "make wheels" in build and ".ci/pypi-metadata" in build
    wheels = {
        "cp311-cp311": "python3.11",
        "cp312-cp312": "python3.12",
        "cp313-cp313": "python3.13",
        "cp314-cp314": "python3.14",
        "cp314-cp314t": "python3.14t",
    }
    for tag, interpreter in wheels.items():
        assert tag in build and interpreter in build, tag
    assert "cp311-abi3" in build
    # Every wheel's CPython is smoke-tested, the free-threaded one included.
    assert {"3.11", "3.12", "3.13", "3.14", "3.14t"} <= set(
        jobs["smoke"]["strategy"]["matrix"]["python"]
    )
