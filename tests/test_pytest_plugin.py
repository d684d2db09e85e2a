"""The shmstore pytest plugin, run on small test files through pytester."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shmstore import pytest_plugin

pytest_plugins = ["pytester"]

LEAKY = """
import pytest

class Circular:
    def __init__(self):
        self.circular = self
        self.data = bytearray(1 << 20)

@pytest.mark.no_leaks
def test_leaky():
    Circular()

@pytest.mark.no_leaks
def test_clean():
    data = [bytearray(10) for _ in range(100)]
    assert len(data) == 100

def test_unmarked_leaky():
    Circular()
"""


@pytest.fixture(autouse=True)
def own_segment_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test sees its own empty segment directory."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("SHMSTORE_DIR", str(d))
    return d


MANY = """
import pytest

@pytest.mark.no_leaks
def test_many():
    for _ in range(5000):
        a = []
        a.append(a)
"""


def test_five_thousand_identical_cycles_fail_in_at_most_fifty_lines(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(MANY)
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(failed=1)
    lines = result.stdout.lines
    start = next(i for i, ln in enumerate(lines) if "reference cycles left by the test" in ln)
    end = next(i for i, ln in enumerate(lines) if "short test summary" in ln)
    assert end - start <= 50, "\n".join(lines[start:end])
    assert len(lines) <= 80, result.stdout.str()
    result.stdout.fnmatch_lines(["*5000 reference cycle(s)*", "*5000 cycles of this shape*"])
    verbose = pytester.runpytest("-p", "no:cacheprovider", "-q", "--shmstore-leaks-verbose")
    verbose.assert_outcomes(failed=1)
    assert len(verbose.stdout.lines) > 10_000
    verbose.stdout.fnmatch_lines(["*#5000 *"])


def test_leaky_test_fails_with_the_cycle_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LEAKY)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*reference cycles left by the test*",
            "*1 reference cycle(s) retain 1.0 MiB*",
            "*keeps alive: 1 x bytearray*",
            "FAILED *::test_leaky - Failed: r*",
        ]
    )
    assert "path: Circular.__dict__['circular'] -> Circular" in out
    assert "test_clean" not in "".join(ln for ln in out.splitlines() if ln.startswith("FAILED"))


def test_option_checks_every_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LEAKY)
    result = pytester.runpytest("--shmstore-leaks")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*FAILED*test_unmarked_leaky*"])


def test_allowlist_from_ini_and_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        cache="""
class Cache:
    def __init__(self):
        self.me = self
"""
    )
    pytester.makepyfile(
        """
import pytest
from cache import Cache

class Other:
    def __init__(self):
        self.me = self

@pytest.mark.no_leaks
def test_cache():
    Cache()

@pytest.mark.no_leaks(allow=[Other])
def test_other_allowed():
    Other()

@pytest.mark.no_leaks
def test_other_not_allowed():
    Other()
"""
    )
    pytester.makeini("[pytest]\nshmstore_leaks_allow =\n    cache\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_other_not_allowed*"])


def test_memory_growth_with_warmup_and_repeat(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

KEPT = []
RUNS = []

@pytest.mark.no_leaks(cycles=False, memory="8 MiB", warmup=1, repeat=3)
def test_grows():
    KEPT.append(b"x" * (16 << 20))   # 16 MiB more every run: a leak

@pytest.mark.no_leaks(memory="8 MiB", warmup=1, repeat=3)
def test_cache_filled_once():
    RUNS.append(1)
    if not KEPT:
        KEPT.append(b"y" * (16 << 20))  # warmup fills the cache; later runs add nothing

def test_runs_counted():
    assert len(RUNS) == 4  # warmup + repeat
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*memory grew by*over 3 run(s) after 1 warmup run(s); allowed: 8.0 MiB*"]
    )


def test_leftover_segments_fail_at_teardown(
    pytester: pytest.Pytester, own_segment_dir: Path
) -> None:
    pytester.makepyfile(
        f"""
import os, pytest

SEG_DIR = {str(own_segment_dir)!r}

@pytest.fixture
def segment():
    path = os.path.join(SEG_DIR, "shmstore-from-fixture")
    open(path, "wb").close()
    yield path
    os.unlink(path)

@pytest.mark.no_leaks(cycles=False)
def test_leaves_one():
    open(os.path.join(SEG_DIR, "shmstore-forgotten"), "wb").close()

@pytest.mark.no_leaks(cycles=False)
def test_cleans_up(segment):
    assert os.path.exists(segment)

@pytest.mark.no_leaks(cycles=False, segments=False)
def test_not_checked():
    open(os.path.join(SEG_DIR, "shmstore-unchecked"), "wb").close()
"""
    )
    pytester.makeini("[pytest]\nshmstore_segments_wait = 0.1\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*the test left 1 shmstore segment(s) behind in*: shmstore-forgotten*"]
    )


def test_small_objects_arena_is_reported_only_while_in_use(
    pytester: pytest.Pytester, own_segment_dir: Path
) -> None:
    """Small objects go into the process's arena (docs/arena.md): a test that lets go of
    them leaves nothing behind; one that keeps a handle alive is told its arena is left."""
    pytester.makepyfile(
        """
import pytest, shmstore

KEPT = []

@pytest.fixture(scope="module")
def module_small():
    ref = shmstore.put({"module": 1})
    yield ref
    ref.close()

@pytest.mark.no_leaks(cycles=False)
def test_lets_go():
    refs = [shmstore.put({"i": i}) for i in range(10)]
    assert all("@" in r.name for r in refs)
    views = [r.get() for r in refs]
    assert views[3]["i"] == 3

@pytest.mark.no_leaks(cycles=False)
def test_a_cycle_holds_one_until_collected():
    class Holder:
        pass
    h = Holder()
    h.me = h
    h.ref = shmstore.put(b"in a cycle")

@pytest.mark.no_leaks(cycles=False)
def test_uses_the_module_fixture(module_small):
    assert module_small.get()["module"] == 1
    assert shmstore.put(b"x").get() == b"x"

@pytest.mark.no_leaks(cycles=False)
def test_keeps_one():
    KEPT.append(shmstore.put([1, 2, 3]))
"""
    )
    pytester.makeini("[pytest]\nshmstore_segments_wait = 2\n")
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_keeps_one*", "*the test left 1 shmstore segment(s) behind*(1 of them arena(s)*"]
    )


def test_fixtures(pytester: pytest.Pytester, own_segment_dir: Path) -> None:
    pytester.makepyfile(
        f"""
import os

def test_leak_report(leak_report):
    with leak_report() as report:
        a = []
        a.append(a)
        del a
    assert [c.path for c in report.cycles] == ["list[0] -> list"]

def test_memory_monitor(memory_monitor):
    data = b"z" * (32 << 20)
    snap = memory_monitor.wait_until(lambda s: s.total.uss >= 32 << 20, timeout=300)
    assert snap.by_pid(os.getpid()).uss >= 32 << 20
    del data

def test_shm_segments(shm_segments):
    path = os.path.join({str(own_segment_dir)!r}, "shmstore-abc")
    open(path, "wb").close()
    assert shm_segments.new() == {{"shmstore-abc"}}
    os.unlink(path)
    assert shm_segments.new() == set()
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=3)


def test_bad_marker_arguments(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.no_leaks(colour="red")
def test_x():
    pass
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    assert "unknown no_leaks option(s) ['colour']" in result.stdout.str()


@pytest.mark.slow
def test_works_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(LEAKY)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    assert "path: Circular.__dict__['circular'] -> Circular" in result.stdout.str()


def test_parse_bytes() -> None:
    assert pytest_plugin.parse_bytes(1024) == 1024
    assert pytest_plugin.parse_bytes("10 MB") == 10_000_000
    assert pytest_plugin.parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(ValueError, match="cannot read"):
        pytest_plugin.parse_bytes("lots")
    with pytest.raises(TypeError):
        pytest_plugin.parse_bytes(True)


def test_list_segments_only_sees_ours(own_segment_dir: Path) -> None:
    (own_segment_dir / "shmstore-a").write_bytes(b"")
    (own_segment_dir / "other-b").write_bytes(b"")
    assert pytest_plugin.list_segments() == {"shmstore-a"}
    os.unlink(own_segment_dir / "shmstore-a")
    assert pytest_plugin.list_segments() == frozenset()


THREADED = """
import threading
import tracemalloc

import pytest


@pytest.fixture
def worker():
    go = threading.Event()
    t = threading.Thread(target=go.wait, args=(300,))
    t.start()
    yield
    go.set()
    t.join(300)


@pytest.mark.no_leaks(threads="%s")
def test_with_a_thread(worker):
    assert tracemalloc.is_tracing() is %s
"""


# The inner session's interpreter taken for a free-threaded one (a no-op on one), and
# whether tracemalloc still runs once the plugin's session has ended.
FREE_THREADED_CONFTEST = """
import tracemalloc

from shmstore.leaks import _detect

_detect._free_threaded = lambda: True


def pytest_unconfigure(config):
    with open("tracing-at-exit", "w") as f:
        f.write(str(tracemalloc.is_tracing()))
"""


@pytest.mark.parametrize("threads", ["current", "all"])
def test_tracemalloc_is_started_before_the_tests_where_only_then_it_can_be(
    pytester: pytest.Pytester, threads: str
) -> None:
    """On a free-threaded interpreter tracemalloc cannot be started once other threads run:
    the plugin starts it after collection when a selected test asks for threads="current",
    so a test whose fixture started a thread runs attributed, without a warning; it stops
    it at the session's end. Nothing is started where no test asks. (A pytest process of
    its own: earlier tests may have left threads in this one.)"""
    pytester.makeconftest(FREE_THREADED_CONFTEST)
    pytester.makepyfile(THREADED % (threads, threads == "current"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error::RuntimeWarning")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "tracing-at-exit").read_text() == "False"
