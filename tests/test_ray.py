"""shmstore.ray with real Ray (skipped where ray is not installed: `make test-ray` runs it in
its own venv). One small cluster of two nodes for the whole module (each node its own raylet
and object store, on this machine): tasks and actors read a shared list through
``shmstore.ray.share``, lazily and in place, from their node's copy; a handle pickles in a
few hundred bytes; each process opens a store once; nothing is left in the segment
directory."""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import shmstore  # noqa: E402
import shmstore.ray as sray  # noqa: E402
from conftest import make_records  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

# The workers run this module's functions: send them by value (the workers cannot import a
# test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Records enough for an archive past Ray's inline limit (100 KiB): it goes to the object
#: store, as a real data set does.
N = 1500

#: A bound for every wait on the cluster (seconds).
TIMEOUT = 300


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two nodes, one CPU each; the second one also has the resource "second" (to place a
    task there). Every worker keeps an opened store for 600 s (SHMSTORE_RAY_KEEP)."""
    session_dir = os.environ["SHMSTORE_DIR"]
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 100 << 20,
            "include_dashboard": False,
        },
    )
    c.add_node(num_cpus=1, resources={"second": 1}, object_store_memory=100 << 20)
    ray.init(
        address=c.address,
        runtime_env={"env_vars": {"SHMSTORE_RAY_KEEP": "600", "SHMSTORE_DIR": session_dir}},
        log_to_driver=False,
    )
    c.wait_for_nodes(timeout=TIMEOUT)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
    leftovers = sorted(Path(session_dir).glob("shmstore-*"))
    assert not leftovers, f"left in the segment directory: {leftovers}"


@pytest.fixture
def records() -> list[dict[str, Any]]:
    return make_records(N)


@pytest.fixture
def shared(cluster: Cluster, records: list[dict[str, Any]]) -> sray.RayShared:
    with shmstore.SharedList(records) as lst:
        return sray.share(lst)  # the segment goes at the end of the with: Ray has its copy


@ray.remote
def read(lst: Any, i: int) -> dict[str, Any]:
    from shmstore import _native

    return {
        "handle": type(lst).__name__,
        "record_type": type(lst[i]).__name__,
        "annotations_type": type(lst[i]["annotations"]).__name__,
        "record": lst[i].to_python(),
        "in_place": _native._store_info(lst)["private_copy"] is False,
        "node": ray.get_runtime_context().get_node_id(),
    }


@ray.remote
class Reader:
    def read(self, lst: Any, i: int) -> tuple[dict[str, Any], dict[str, int]]:
        return lst[i].to_python(), sray.stats()

    def keep(self, lst: Any) -> int:
        self.lst = lst
        return len(lst)

    def release(self) -> tuple[int, dict[str, int]]:
        return sray.release(), sray.stats()


def test_tasks_read_identical_records_lazily_in_place_on_each_node(
    cluster: Cluster, shared: sray.RayShared, records: list[dict[str, Any]]
) -> None:
    picks = [0, 7, N // 2, N - 1]
    anywhere = [read.remote(shared, i) for i in picks]
    second = [read.options(resources={"second": 1}).remote(shared, i) for i in picks]
    out = ray.get(anywhere + second, timeout=TIMEOUT)
    for i, got in zip(picks + picks, out):
        assert got["record"] == records[i]
        assert got["handle"] == "SharedList"
        assert (got["record_type"], got["annotations_type"]) == ("DictView", "ListView")
        assert got["in_place"], "the worker read a private copy, not Ray's buffer"
    second_node = {got["node"] for got in out[len(picks) :]}
    assert len(second_node) == 1
    # Both nodes hold a copy now (the second fetched it once for all its workers).
    locations = ray.experimental.get_object_locations([shared.ref], timeout_ms=TIMEOUT * 1000)
    assert second_node <= set(locations[shared.ref]["node_ids"])


def test_an_actor_opens_the_store_once(shared: sray.RayShared, records: list[dict]) -> None:
    actor = Reader.remote()  # type: ignore[attr-defined]
    results = ray.get([actor.read.remote(shared, i) for i in range(5)], timeout=TIMEOUT)
    assert [r for r, _ in results] == records[:5]
    # The first call opened it (the worker may have run other tests' tasks before: counts
    # are per process), the four others found it open.
    first, last = results[0][1], results[-1][1]
    assert last["opened"] == first["opened"] and last["reused"] == first["reused"] + 4
    # A handle the actor keeps stays open; release() lets go only of what is merely kept.
    assert ray.get(actor.keep.remote(shared), timeout=TIMEOUT) == N
    released, stats = ray.get(actor.release.remote(), timeout=TIMEOUT)
    assert released >= 1 and stats["held"] == 0 and stats["open"] >= 1
    ray.kill(actor)


def test_a_dict_store_in_a_task(cluster: Cluster) -> None:
    data = {f"doc-{i}": {"text": "x" * 200, "n": i} for i in range(1000)}
    with shmstore.SharedDict(data) as d:
        shared = sray.share(d)

    @ray.remote
    def lookup(d: Any, key: str) -> Any:
        return type(d).__name__, d[key]["n"], len(d)

    assert ray.get(lookup.remote(shared, "doc-42"), timeout=TIMEOUT) == ("SharedDict", 42, 1000)


def test_a_handle_pickles_small(shared: sray.RayShared) -> None:
    payload = ray.cloudpickle.dumps(shared, protocol=5)
    assert len(payload) < 512, len(payload)


def test_in_the_driver_and_keep_zero(
    shared: sray.RayShared, records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sray, "KEEP", 0.0)
    before = sray.stats()["opened"]
    h = shared.get()
    assert h[3].to_python() == records[3]
    assert shared.get() is h  # open: the same handle
    del h
    # KEEP 0: nothing kept once nothing uses it; the next get opens again.
    assert sray.stats()["open"] == 0
    assert shared.get()[0]["image_id"] == 0
    assert sray.stats()["opened"] == before + 2


def test_keep_lets_go_after_the_delay(
    shared: sray.RayShared, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sray, "KEEP", 0.2)
    sray.release()
    shared.get()
    assert sray.stats()["held"] == 1
    deadline = time.monotonic() + 60
    while sray.stats()["held"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sray.stats() | {"opened": 0, "reused": 0} == {
        "opened": 0,
        "reused": 0,
        "held": 0,
        "open": 0,
    }


def test_share_says_what_it_needs(cluster: Cluster) -> None:
    with pytest.raises(TypeError, match="store handle"):
        sray.share([1, 2, 3])  # type: ignore[arg-type]
    lst = shmstore.SharedList([1, 2])
    lst.unlink()
    lst.close()
    with pytest.raises(shmstore.StoreClosedError):
        sray.share(lst)


def test_the_archive_object_needs_protocol_5(shared: sray.RayShared) -> None:
    with shmstore.SharedList([1]) as lst:
        with pytest.raises(TypeError, match="protocol 5"):
            pickle.dumps(sray._Archive("list", lst.archive()), protocol=4)
