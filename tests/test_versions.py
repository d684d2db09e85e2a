"""The version checks of the optional integrations (shmstore._versions) and the declared
bounds: pyproject's extras and requires-python agree with them."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from shmstore import _versions

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("1.6", (1, 6)), ("1.6.0rc1", (1, 6, 0)), ("2.15.0+cpu", (2, 15, 0)), ("v3", (3,)), ("x", ())],
)
def test_parse(text: str, parsed: tuple[int, ...]) -> None:
    assert _versions.parse(text) == parsed


def test_too_old_says_which_versions_and_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", lambda dist: "1.4.2")
    with pytest.raises(ImportError) as e:
        _versions.require("joblib", "shmstore.joblib")
    assert str(e.value) == (
        "shmstore.joblib needs joblib >= 1.6, but joblib 1.4.2 is installed: "
        "pip install 'shmstore[joblib]' (or pip install -U 'joblib>=1.6')"
    )
    assert e.value.name == "joblib"


def test_missing_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(dist: str) -> str:
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'shmstore\[plot\]'"):
        _versions.require("matplotlib", "Monitor.plot")


def test_supported_version_passes() -> None:
    assert _versions.require("pytest", "this test") == pytest.__version__


def test_extras_carry_the_same_lower_bounds() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    for dist, (minimum, extra) in _versions.MINIMUM.items():
        assert f"{dist}>={minimum}" in extras[extra], (dist, extra, extras[extra])


def test_requires_python_is_what_runs_here() -> None:
    spec = PYPROJECT["project"]["requires-python"]
    (minimum,) = re.fullmatch(r">=(3\.\d+)", spec).groups()
    assert sys.version_info[:2] >= _versions.parse(minimum)
    classifiers = PYPROJECT["project"]["classifiers"]
    assert f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}" in (
        classifiers
    ), "the interpreter running the suite is not listed as supported"


@pytest.mark.parametrize(
    ("module", "dist"), [("shmstore.joblib", "joblib"), ("shmstore.dask", "distributed")]
)
def test_integration_refuses_a_version_it_cannot_serve(
    module: str, dist: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shmstore.joblib on joblib 1.4 used to import fine and then do nothing (no segment, no
    array sent by name): now the import says what is wrong."""
    pytest.importorskip(dist)
    importlib.import_module(module)  # imported once as usual (and restored after the test)
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "1.4.2" if d == dist else real(d))
    monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ImportError, match=rf"{module} needs {dist} >= .*but {dist} 1\.4\.2"):
        importlib.import_module(module)


def test_generic_handles_can_be_subscripted_at_run_time() -> None:
    """``SharedList[int]`` in an annotation that is evaluated (no ``from __future__ import
    annotations``, ``typing.get_type_hints``) works like ``list[int]``."""
    import types

    import shmstore
    import shmstore.torch

    alias = shmstore.SharedList[int]
    assert isinstance(alias, types.GenericAlias) and alias.__origin__ is shmstore.SharedList
    assert shmstore.SharedDict[str].__args__ == (str,)
    assert shmstore.torch.SharedListDataset[str].__origin__ is shmstore.torch.SharedListDataset
