"""pytest plugin: fail tests that leave reference cycles, grow memory, or leave segments.

Registered through the ``pytest11`` entry point, so installing shmstore enables it.

- ``@pytest.mark.no_leaks(cycles=True, memory=None, segments=True, allow=(), warmup=0,
  repeat=1, threads="all")`` checks one test; ``--shmstore-leaks`` checks every test
  (a marker on a test still overrides the defaults);
- ``cycles``: the test body runs inside :func:`shmstore.leaks.detect`; cycles it leaves fail
  the test with their types, reference path and retained bytes;
- ``memory``: bytes (or ``"10 MB"``, ``"1.5 GiB"``) the process USS may grow by, measured
  over ``repeat`` runs of the test body after ``warmup`` runs (fixtures are set up once);
- ``segments``: shmstore segments (``$SHMSTORE_DIR/shmstore-*`` of this user) that appear
  during the test and are still there after its teardown fail it at teardown; the process's
  arenas (small objects' chunks, docs/arena.md) are let go of before and after the test,
  so an arena is reported only while a handle or view of one of its chunks is still alive;
- ``allow``: types or module names whose cycles are expected (caches); the ini option
  ``shmstore_leaks_allow`` adds to it for every test;
- ``threads``: ``"current"`` leaves out cycles other threads allocated (tracemalloc; on a
  free-threaded interpreter the plugin starts it once, after collection, when a selected
  test asks for this).

Fixtures: ``leak_report`` (a ``detect`` factory with the allowlist applied),
``memory_monitor`` (a running :class:`shmstore.memory.Monitor`), ``shm_segments`` (the
segments present when the test started, and what appeared since).

Example::

    import pytest

    @pytest.mark.no_leaks(memory="5 MB", warmup=1, repeat=3)
    def test_training_step():
        run_one_step()
"""

from __future__ import annotations

import gc
import inspect
import time
import tracemalloc
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

from . import _native, _segments, _versions
from . import memory as _memory
from ._util import format_bytes, parse_size
from .leaks import _detect, detect

# Loaded into every pytest run of an environment that has shmstore (the pytest11 entry point):
# on a pytest this plugin cannot serve, say so plainly instead of failing on a hook below.
_versions.require("pytest", "shmstore's pytest plugin (turn it off with -p no:shmstore)")

__all__ = ["SegmentTracker", "list_segments", "release_arenas"]

_MARKER_DOC = (
    "no_leaks(cycles=True, memory=None, segments=True, allow=(), warmup=0, repeat=1, "
    "threads='all'): fail the test if it leaves reference cycles, grows memory by more than "
    "`memory` bytes, or leaves shmstore segments behind (shmstore plugin)"
)
_SEGMENTS_BEFORE = pytest.StashKey[frozenset[str]]()
_OPTIONS = ("cycles", "memory", "segments", "allow", "warmup", "repeat", "threads")


def list_segments() -> frozenset[str]:
    """Names of this user's shmstore segments (files ``$SHMSTORE_DIR/shmstore-*``).

    The one place the plugin lists segments: it follows the store's own listing.
    """
    return frozenset(p.name for p in _segments.segment_paths())


def _mapped_by_other_processes(names: frozenset[str]) -> frozenset[str]:
    """Which of ``names`` another live process maps or holds (e.g. another xdist worker's)."""
    paths = [p for p in _segments.segment_paths() if p.name in names]
    return frozenset(p.name for p, pids in _segments.segment_users(paths).items() if pids)


def parse_bytes(value: Any) -> int:
    """``1024``, ``"10 MB"``, ``"1.5GiB"`` -> bytes: the one size grammar of shmstore
    (``"10 MB"`` is 10**7 bytes, ``"10 MiB"`` 10 * 2**20; see ``shmstore._util``)."""
    return parse_size(value, what="memory")


@dataclass(frozen=True)
class _Settings:
    cycles: bool = True
    memory: Optional[int] = None
    segments: bool = True
    allow: tuple[Any, ...] = ()
    warmup: int = 0
    repeat: int = 1
    threads: str = "all"


def _settings(item: pytest.Item) -> Optional[_Settings]:
    marker = item.get_closest_marker("no_leaks")
    if marker is None and not item.config.getoption("shmstore_leaks"):
        return None
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        pytest.fail(
            f"{item.nodeid}: no_leaks takes keyword arguments only ({', '.join(_OPTIONS)})",
            pytrace=False,
        )
    unknown = set(kwargs) - set(_OPTIONS)
    if unknown:
        pytest.fail(
            f"{item.nodeid}: unknown no_leaks option(s) {sorted(unknown)}; "
            f"known: {', '.join(_OPTIONS)}",
            pytrace=False,
        )
    allow = tuple(item.config.getini("shmstore_leaks_allow")) + tuple(kwargs.pop("allow", ()))
    mem = kwargs.pop("memory", None)
    s = _Settings(allow=allow, memory=None if mem is None else parse_bytes(mem), **kwargs)
    if s.warmup < 0 or s.repeat < 1:
        pytest.fail(f"{item.nodeid}: no_leaks needs warmup >= 0 and repeat >= 1", pytrace=False)
    return s


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmstore", "shmstore leak checks")
    group.addoption(
        "--shmstore-leaks",
        action="store_true",
        default=False,
        dest="shmstore_leaks",
        help="check every test for reference cycles and leftover shmstore segments, as if "
        "marked @pytest.mark.no_leaks()",
    )
    group.addoption(
        "--shmstore-leaks-verbose",
        action="store_true",
        default=False,
        dest="shmstore_leaks_verbose",
        help="list every reference cycle in a leak failure, one by one (default: cycles of "
        "the same shape grouped, the 10 largest groups shown, each with one example path)",
    )
    parser.addini(
        "shmstore_leaks_allow",
        type="linelist",
        default=[],
        help="types ('module.QualName') or modules whose reference cycles are expected",
    )
    parser.addini(
        "shmstore_segments_wait",
        default="2.0",
        help="seconds to wait for a test's shmstore segments to go away after its teardown",
    )


# Frames kept per allocation when the session starts tracemalloc: whole stacks of a test's
# body under pytest's own frames (a block asks for its depth + 64).
_SESSION_FRAMES = 256


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_DOC)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a free-threaded interpreter, tests marked ``threads="current"`` need tracemalloc,
    which cannot be started there once other threads run (docs/free-threading.md): start it
    now, before the tests start any, when one of the selected tests asks for it. Where it
    cannot be started now either, each such test warns."""
    if not _detect._free_threaded() or tracemalloc.is_tracing():
        return
    for item in session.items:
        marker = item.get_closest_marker("no_leaks")
        if marker is not None and marker.kwargs.get("threads") == "current":
            _detect._start_tracing(_SESSION_FRAMES)
            return


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the tracemalloc started for the session (when that is safe; docs/leaks.md)."""
    _detect._stop_tracing(mine=0)


def _uss() -> int:
    gc.collect()
    return _memory.snapshot(children=False, segments=False).processes[0].uss


def _runner(item: pytest.Function) -> Callable[[], Any]:
    fn = item.obj
    if inspect.iscoroutinefunction(fn):
        pytest.fail(f"{item.nodeid}: no_leaks warmup/repeat needs a sync test", pytrace=False)
    names = [n for n in inspect.signature(fn).parameters if n in item.funcargs]
    return lambda: fn(**{n: item.funcargs[n] for n in names})


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
    s = _settings(pyfuncitem)
    if s is None or not (s.cycles or s.memory is not None):
        return (yield)
    before = 0
    if s.memory is not None:
        run = _runner(pyfuncitem)
        for _ in range(s.warmup):
            run()
        before = _uss()
        for _ in range(s.repeat - 1):  # the last run is pytest's own, below
            run()
    failures = []
    if s.cycles:
        with detect(allow=s.allow, threads=s.threads) as report:  # type: ignore[arg-type]
            result = yield
        if report.cycles:
            verbose = bool(pyfuncitem.config.getoption("shmstore_leaks_verbose"))
            failures.append(f"reference cycles left by the test:\n{report.format(verbose=verbose)}")
    else:
        result = yield
    if s.memory is not None:
        after = _uss()
        growth = after - before
        if growth > s.memory:
            failures.append(
                f"memory grew by {format_bytes(growth)} (USS {format_bytes(before)} -> "
                f"{format_bytes(after)}) over {s.repeat} run(s) after {s.warmup} warmup "
                f"run(s); allowed: {format_bytes(s.memory)}"
            )
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    result = yield
    s = _settings(item)
    if s is not None and s.segments:
        # The test's small objects go to an arena of their own, not one a fixture made.
        _native._arena_release()
        # After setup: segments that fixtures of a wider scope create belong to them.
        item.stash[_SEGMENTS_BEFORE] = list_segments()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    result = yield
    before = item.stash.get(_SEGMENTS_BEFORE, None)
    if before is None:
        return result
    _native._arena_release()  # garbage is collected only if something is left (below)
    left = _leftover_segments(before, float(item.config.getini("shmstore_segments_wait")))
    if left:
        arenas = _arenas(left)
        hint = (
            f" ({len(arenas)} of them arena(s): a Ref, view or array of a small object put "
            "during the test is still alive)"
            if arenas
            else ""
        )
        pytest.fail(
            f"the test left {len(left)} shmstore segment(s) behind in "
            f"{_memory.segment_dir()}: {', '.join(sorted(left))}{hint}",
            pytrace=False,
        )
    return result


def release_arenas() -> int:
    """Collect garbage, then let go of this process's arenas (docs/arena.md): each goes away
    once no handle, view or array of its chunks is alive in any process, like a segment
    whose last handle is gone. New small objects go into a new arena. Returns how many
    arenas this process let go of.

    >>> release_arenas() >= 0
    True
    """
    gc.collect()
    return _native._arena_release()


def _arenas(names: frozenset[str]) -> list[str]:
    """Which of ``names`` are arenas."""
    return [
        p.name
        for p in _segments.segment_paths()
        if p.name in names and _segments.arena_creator(p) is not None
    ]


def _leftover_segments(before: frozenset[str], wait: float) -> frozenset[str]:
    """New segments still present after up to ``wait`` s (the store may unlink them a little
    later, from its supervisor), not counting those another process maps (xdist workers)."""
    deadline = time.monotonic() + wait
    collected = False
    while True:
        left = list_segments() - before
        if left and not collected:
            # Handles in reference cycles keep their segments (and arenas) until collected:
            # paid only by a test that left something (a clean test pays no collection).
            gc.collect()
            collected = True
            continue
        if left:
            left = left - _mapped_by_other_processes(left)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)  # polling a directory: no event to wait on


class SegmentTracker:
    """The ``shm_segments`` fixture: the shmstore segments seen when the test started."""

    def __init__(self) -> None:
        self.before = list_segments()

    def current(self) -> frozenset[str]:
        """The segments present now."""
        return list_segments()

    def new(self) -> frozenset[str]:
        """The segments that appeared since the test started and are still present."""
        return list_segments() - self.before


class _LeakReporter:
    def __init__(self, allow: tuple[Any, ...]) -> None:
        self.allow = allow

    def __call__(self, **kwargs: Any) -> detect:
        """``with leak_report() as report:`` — :func:`shmstore.leaks.detect` with the
        plugin's allowlist (``allow=`` adds to it)."""
        kwargs["allow"] = self.allow + tuple(kwargs.get("allow", ()))
        return detect(**kwargs)


@pytest.fixture
def leak_report(request: pytest.FixtureRequest) -> _LeakReporter:
    """A :func:`shmstore.leaks.detect` factory with the ini allowlist applied::

    def test_x(leak_report):
        with leak_report() as report:
            run()
        assert report.cycles == [], str(report)
    """
    return _LeakReporter(tuple(request.config.getini("shmstore_leaks_allow")))


@pytest.fixture
def memory_monitor() -> Iterator[_memory.Monitor]:
    """A :class:`shmstore.memory.Monitor` of this process and its children, sampling every
    50 ms during the test (stopped at teardown)."""
    mon = _memory.Monitor(interval=0.05).start()
    yield mon
    mon.stop()


@pytest.fixture
def shm_segments() -> SegmentTracker:
    """The shmstore segments present at the start of the test, and ``.new()`` since."""
    return SegmentTracker()


# --- copy-on-read gate ----------------------------------------------------------------------
# The no_cow marker, --shmstore-cow and the cow_measure fixture live in their own module,
# loaded with this plugin (and switched off with it: -p no:shmstore).
pytest_plugins = ["shmstore._pytest_cow"]
