"""shmstore.cow: what forked workers un-share of the parent's memory, and which objects."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from shmstore import _attribution, cow

pytest_plugins = ["pytester"]

N = 20_000  # records: a few MiB of dicts, lists, floats and ints


def make_records(n: int = N) -> list[dict[str, Any]]:
    return [
        {"bbox": [float(i), 2.5, 3.5, 4.5], "id": 1000 + i, "name": f"img{i:08d}.jpg"}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return make_records()


def test_plain_list_read_in_workers_fails_with_types(
    records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every object looked at (no sample however many this process holds): exact counts.
    monkeypatch.setattr(_attribution, "_SAMPLE", 1 << 40)

    def read_all() -> None:
        for r in records:
            r["bbox"][0]
            r["id"]

    report = cow.measure(read_all, workers=2, max="1 MiB")
    assert not report.ok
    assert report.method == "pagemap"
    assert report.excess > 2 << 20
    with pytest.raises(cow.CopyOnReadError, match="TOO MUCH"):
        report.check()
    a = report.attribution
    assert a is not None
    by_type = {r.type: r for r in a.rows}
    # Most records' dicts and lists are found on the copied pages (not all: in a process
    # whose heap is large and mixed, as the whole suite's is, some of their pages were
    # already the worker's own before it started to read, and are not counted).
    assert by_type["dict"].count >= N // 2 and by_type["list"].count >= N // 2
    assert by_type["dict"].example == "records[i]"
    assert by_type["list"].example == "records[i]['bbox']"
    assert by_type["float"].example == "records[i]['bbox'][j]"
    # the records' own objects fill the pages (the names too where they share the dicts'
    # allocator pools, as with pymalloc; the free-threaded build's allocator keeps each size
    # apart, so there the unread names' pages stay shared)
    data = sum(by_type[t].nbytes for t in ("dict", "list", "float", "int", "str") if t in by_type)
    # (mimalloc, the free-threaded build's allocator, keeps more of a page free or for
    # other objects of the size: 0.89 of the pages there where pymalloc's are >= 0.9)
    assert data >= (0.8 if sysconfig.get_config_var("Py_GIL_DISABLED") else 0.9) * a.page_bytes


READER_PASSES = """
import sys
sys.path.insert(0, %r)
import shmstore
from shmstore import cow
from test_cow import make_records

shared = shmstore.SharedList(make_records())
try:
    def read_all():
        for r in shared:
            r["bbox"][0]
            r["id"]

    report = cow.measure(read_all, workers=2, max="1 MiB")
    assert report.check() is report  # raises CopyOnReadError if the report is not ok
    print("reader passes:", report.ok)
finally:
    shared.unlink()
"""


def test_shared_list_reader_passes() -> None:
    # In a process of its own, whose memory the earlier tests of this session did not shape
    # (as the plugin's test below): a free-threaded interpreter's allocator gives memory back
    # 10 ms after it is freed, and a worker forked before then un-shares what it reuses of it
    # (MIMALLOC_PURGE_DELAY=0 gives it back at once; with a GIL it changes nothing).
    env = {**os.environ, "MIMALLOC_PURGE_DELAY": "0"}
    run = subprocess.run(
        [sys.executable, "-c", READER_PASSES % str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "reader passes: True" in run.stdout, run.stdout + run.stderr


def test_small_dirtying_is_detected(records: list[dict[str, Any]]) -> None:
    # A few thousand of the records (well under 1 % of a large heap) read in a worker.
    few = records[:4000]

    def read_few() -> None:
        for r in few:
            r["bbox"][0]

    report = cow.measure(read_few, workers=1, max="256 KiB")
    assert not report.ok, str(report)
    assert report.excess >= 256 << 10
    assert cow.measure(None, workers=1, max="256 KiB").ok


def test_report_is_grouped_and_short(records: list[dict[str, Any]]) -> None:
    report = cow.measure(lambda: [r["name"] for r in records], workers=12, max=0)
    text = str(report)
    assert len(text.splitlines()) <= 50
    assert "more worker(s)" in text
    assert text.count("\n  dict ") <= 1  # one row per type
    assert "control" in text and "pagemap" in text


def test_collect_and_gc_freeze_are_reported() -> None:
    data = make_records(5000)
    report = cow.measure(None, workers=1, collect=True)
    # a collection writes every tracked object's GC header: the control un-shares them too
    assert report.control.unshared > 1 << 20
    assert "one full collection" in str(report)
    del data


def test_pages_with_no_object_on_a_free_threaded_interpreter_are_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Most of the excess on pages that held no object: on a free-threaded interpreter the
    report names the allocator's delayed purge and what turns it off; elsewhere it does not."""
    report = cow.CowReport(
        start_method="fork",
        method="pagemap",
        collect=False,
        workers=(cow.WorkerResult(101, 4 << 20),),
        control=cow.WorkerResult(102, 1 << 20),
        limit=1 << 20,
        attribution=_attribution.Attribution(
            page_bytes=3 << 20, rows=(_attribution.TypeRow("tuple", 8, 4096, ""),)
        ),
        frozen=0,
    )
    monkeypatch.setattr(cow, "_FREE_THREADED", True)
    assert "MIMALLOC_PURGE_DELAY=0" in str(report)
    monkeypatch.setattr(cow, "_FREE_THREADED", False)
    assert "MIMALLOC_PURGE_DELAY" not in str(report)
    # Mostly objects' pages: no such line, free-threaded or not.
    monkeypatch.setattr(cow, "_FREE_THREADED", True)
    rows = (_attribution.TypeRow("dict", 20_000, 2 << 20, "records[i]"),)
    mostly_objects = _attribution.Attribution(page_bytes=3 << 20, rows=rows)
    assert "MIMALLOC_PURGE_DELAY" not in str(
        dataclasses.replace(report, attribution=mostly_objects)
    )


def test_spawn_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="shares no memory with its parent"):
        cow.measure(None, start_method="spawn")
    with pytest.raises(ValueError, match="'fork' or 'forkserver'"):
        cow.measure(None, start_method="threads")
    with pytest.raises(ValueError, match="workers"):
        cow.measure(None, workers=0)


def _raise() -> None:
    raise KeyError("boom in worker")


def test_worker_error_carries_its_traceback() -> None:
    with pytest.raises(cow.WorkerError, match="boom in worker"):
        cow.measure(_raise, workers=1)


def _noop() -> None:
    pass


def test_forkserver_runs() -> None:
    report = cow.measure(_noop, workers=1, start_method="forkserver")
    assert report.start_method == "forkserver"
    assert "fork server's" in str(report)


PLUGIN_TESTS = """
import pytest, shmstore

@pytest.fixture(scope="module")
def records():
    return [{"bbox": [float(i), 2.0], "id": i * 1000} for i in range(20_000)]

@pytest.fixture(scope="module")
def shared(records):
    s = shmstore.SharedList(records)
    yield s
    s.unlink()

@pytest.mark.no_cow
def test_plain(records):
    for r in records:
        r["bbox"][0]

@pytest.mark.no_cow(max="1 MiB")
def test_shared(shared):
    for r in shared:
        r["bbox"][0]

@pytest.mark.no_cow(start_method="spawn")
def test_spawn(records):
    pass

@pytest.mark.no_cow
def test_body_fails():
    assert 1 == 2, "wrong in worker"

def test_fixture(cow_measure, records):
    cow_measure(lambda: [r["id"] for r in records], workers=1)
"""


@pytest.fixture
def own_segment_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("SHMSTORE_DIR", str(d))
    return d


@pytest.mark.usefixtures("own_segment_dir")
def test_pytest_marker_and_fixture(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a pytest process of its own, whose memory the earlier tests of this session did not
    # shape: a free-threaded interpreter's allocator gives memory back 10 ms after it is
    # freed, and a worker forked before then un-shares what it reuses of it (the report says
    # so; MIMALLOC_PURGE_DELAY=0 gives it back at once).
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "0")
    pytester.makepyfile(PLUGIN_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=4)
    out = result.stdout.str()
    assert "records[i]['bbox']" in out
    assert "shares no memory with its parent" in out
    assert "wrong in worker" in out
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shmstore-cow=1 GiB")
    result.assert_outcomes(passed=3, failed=2)  # spawn and the failing body still fail


def test_a_sampled_attribution_estimates_every_type(
    records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the sample size the counts are estimates, from a random sample: the records'
    dicts and lists (interleaved in the collector's list) are both found, near their counts."""
    monkeypatch.setattr(_attribution, "_SAMPLE", max(1000, len(gc.get_objects()) // 4))

    def read_all() -> None:
        for r in records:
            r["bbox"][0]
            r["id"]

    report = cow.measure(read_all, workers=1, max="1 MiB")
    a = report.attribution
    assert a is not None and a.sample > 1
    by_type = {r.type: r for r in a.rows}
    dicts, lists = by_type["dict"].count, by_type["list"].count
    # Both found in numbers near each other (each record is one dict holding one list),
    # where a stride through the collector's list, which interleaves them, saw one type only.
    assert dicts >= N // 3 and lists >= N // 3, (dicts, lists, a.sample)
    assert 0.6 <= dicts / lists <= 1.6, (dicts, lists, a.sample)
