"""The copy-on-read gate of shmstore's pytest plugin (loaded by ``shmstore.pytest_plugin``).

- ``@pytest.mark.no_cow(max="1 MiB", workers=2, start_method="fork", collect=False)``: the
  test's fixtures are set up in the pytest process as usual; the test *body* then runs in
  ``workers`` worker processes started with ``start_method`` (plus a no-op control), and
  the test fails when a worker un-shares more than ``max`` of the parent's memory beyond
  the control, with the report of :mod:`shmstore.cow` (which objects, by type). Under
  ``forkserver`` the test function and its fixture values are pickled to the workers.
  ``start_method="spawn"`` is refused: spawned workers share nothing.
- ``--shmstore-cow=SIZE``: the limit for markers and fixture calls that give none
  (default 1 MiB).
- fixture ``cow_measure``: ``cow_measure(fn, **options)`` runs :func:`shmstore.cow.measure`
  with the same limit, fails the test when it is exceeded, and returns the report.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

from . import cow as _cow
from ._util import parse_size

_COW_MARKER_DOC = (
    "no_cow(max='1 MiB', workers=2, start_method='fork', collect=False): run the test body in "
    "forked workers and fail if one un-shares more than `max` of the parent's memory beyond "
    "a no-op worker (copy-on-read; shmstore plugin)"
)
_COW_OPTIONS = ("max", "workers", "start_method", "collect", "timeout")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmstore", "shmstore leak checks")
    group.addoption(
        "--shmstore-cow",
        action="store",
        default=None,
        dest="shmstore_cow",
        metavar="SIZE",
        help="bytes (or '4 MiB') a forked worker may un-share of the parent's memory beyond a "
        "no-op worker, for @pytest.mark.no_cow tests and cow_measure calls that give no "
        "max (default 1 MiB)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _COW_MARKER_DOC)


def _default_limit(config: pytest.Config) -> int:
    opt = config.getoption("shmstore_cow", None)
    return _cow.DEFAULT_LIMIT if opt is None else parse_size(opt, what="--shmstore-cow")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    marker = pyfuncitem.get_closest_marker("no_cow")
    if marker is None:
        return None
    nodeid = pyfuncitem.nodeid
    if marker.args:
        pytest.fail(
            f"{nodeid}: no_cow takes keyword arguments only ({', '.join(_COW_OPTIONS)})",
            pytrace=False,
        )
    unknown = set(marker.kwargs) - set(_COW_OPTIONS)
    if unknown:
        pytest.fail(
            f"{nodeid}: unknown no_cow option(s) {sorted(unknown)}; "
            f"known: {', '.join(_COW_OPTIONS)}",
            pytrace=False,
        )
    fn = pyfuncitem.obj
    if inspect.iscoroutinefunction(fn):
        pytest.fail(
            f"{nodeid}: no_cow runs the test body in workers: it needs a sync test", pytrace=False
        )
    opts = dict(marker.kwargs)
    opts.setdefault("max", _default_limit(pyfuncitem.config))
    opts.setdefault("workers", 2)
    names = [n for n in inspect.signature(fn).parameters if n in pyfuncitem.funcargs]
    kwargs = {n: pyfuncitem.funcargs[n] for n in names}
    problem = None
    try:
        report = _cow.measure(fn, kwargs=kwargs, roots=kwargs, **opts)
    except _cow.WorkerError as e:
        problem = f"{nodeid}: the test body failed in a worker:\n{e}"
    except ValueError as e:  # spawn, a bad option
        problem = f"{nodeid}: no_cow: {e}"
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    if not report.ok:
        pytest.fail(str(report), pytrace=False)
    return True


@pytest.fixture
def cow_measure(request: pytest.FixtureRequest) -> Callable[..., _cow.CowReport]:
    """``cow_measure(fn, **options)``: :func:`shmstore.cow.measure` that fails the test when
    a worker un-shares more than ``max`` (default: ``--shmstore-cow``, else 1 MiB)::

        def test_reader(cow_measure):
            data = build()
            report = cow_measure(lambda: read(data), workers=4)
            assert report.excess < 2 << 20
    """
    limit = _default_limit(request.config)

    def run(fn: Callable[..., Any], **options: Any) -> _cow.CowReport:
        options.setdefault("max", limit)
        report = _cow.measure(fn, **options)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    return run
