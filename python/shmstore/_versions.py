"""The oldest versions of the optional libraries that shmstore's integrations can serve, and
the one check that says so clearly instead of failing (or, worse, doing nothing) later.

The same bounds are the lower bounds of the extras in pyproject.toml; docs/install.md lists
the versions the test suite ran with.

Example::

    >>> from shmstore import _versions
    >>> _versions.parse("1.6.0rc1") >= _versions.parse("1.6")
    True
    >>> try:
    ...     _versions.require("no-such-dist", "shmstore.x")
    ... except ImportError as e:
    ...     print(e)
    shmstore.x needs no-such-dist, which is not installed: pip install 'no-such-dist'
"""

from __future__ import annotations

import re
from importlib import metadata

# distribution -> (oldest supported version, the shmstore extra that installs it)
MINIMUM: dict[str, tuple[str, str]] = {
    "numpy": ("1.23", "numpy"),
    "psutil": ("5.9", "memory"),
    "matplotlib": ("3.5", "plot"),
    "joblib": ("1.6", "joblib"),
    "cloudpickle": ("2.0", "joblib"),
    "torch": ("2.0", "torch"),
    "dask": ("2024.8", "dask"),
    "distributed": ("2024.8", "dask"),
    "ray": ("2.9", "ray"),
    "pytest": ("8.0", "pytest"),
}


def parse(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string (``"1.6.0rc1"`` -> ``(1, 6, 0)``)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def installed(dist: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require(dist: str, feature: str) -> str:
    """Check that ``dist`` is installed in a version ``feature`` can serve; return the
    version. Raises ModuleNotFoundError (missing) or ImportError (too old) naming both
    versions and the command that fixes it."""
    minimum, extra = MINIMUM.get(dist, ("0", ""))
    hint = f"pip install 'shmstore[{extra}]'" if extra else f"pip install '{dist}'"
    version = installed(dist)
    if version is None:
        raise ModuleNotFoundError(
            f"{feature} needs {dist}, which is not installed: {hint}", name=dist
        )
    if parse(version) < parse(minimum):
        raise ImportError(
            f"{feature} needs {dist} >= {minimum}, but {dist} {version} is installed: "
            f"{hint} (or pip install -U '{dist}>={minimum}')",
            name=dist,
        )
    return version
