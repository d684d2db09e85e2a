"""Dask distributed: one copy of a store per machine, read in place by every worker there.

``client.scatter(data, broadcast=True)`` puts a copy in every worker *process*. Here a store
travels as a :class:`shmstore.cluster.NodeRef` (a few hundred bytes): the first process on
each machine fetches the archive once into that machine's shared memory, every other worker
there attaches to the same pages::

    import shmstore, shmstore.dask
    from distributed import Client

    client = Client("tcp://scheduler:8786")
    lst = shmstore.SharedList(records)
    with shmstore.dask.share(client, lst) as shared:      # sources + plugins, see below
        futures = client.map(score, [lst] * 1000, range(1000))  # lst travels as a NodeRef

What :func:`share` does:

- the archive's bytes go to the cluster once, as chunks scattered to the workers
  (:class:`DaskSource`), and/or as a saved file on a shared file system (``path=``);
- while the share is open, pickling ``lst`` (the handle itself, in ``submit``/``map``
  arguments, inside closures, through joblib's Dask backend) gives its NodeRef, so user code
  passes the handle as usual and the task receives a handle;
- a :class:`KeepOnNanny` plugin makes each Nanny resolve the store (the first Nanny of a machine
  fetches it, the others attach) and hold it: a worker restarted by its Nanny (e.g. after
  going over its memory limit) attaches again, it does not fetch again;
- a :class:`PreAttach` worker plugin resolves it in every worker at start (and in workers that
  join later), so tasks never wait for a fetch.

``close()`` (or the end of the ``with``) unregisters the plugins, drops the chunks and stops
treating the handle specially; each machine's copy goes once no process there uses it.

Memory limits: the pages of a store count in each worker's RSS once touched, although they
exist once per machine. Dask's spill, pause and terminate thresholds
(``distributed.worker.memory.*``) act on RSS, so 4 workers reading a 10 GiB store each *look*
10 GiB heavy. Give each worker
``memory_limit`` = its own working memory + the store's size, or measure with PSS
(``shmstore.memory``): docs/guides/dask.md.
"""

from __future__ import annotations

import asyncio
import copyreg
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Union

import shmstore
from shmstore import _versions, cluster

_versions.require("dask", "shmstore.dask")
_versions.require("distributed", "shmstore.dask")

from dask.sizeof import sizeof  # noqa: E402
from distributed import Client, NannyPlugin, WorkerPlugin  # noqa: E402

__all__ = ["DaskShare", "DaskSource", "KeepOnNanny", "PreAttach", "held_here", "share"]

log = logging.getLogger("shmstore.dask")

#: Size of the pieces the archive is scattered in.
CHUNK = 64 << 20


@dataclass(frozen=True)
class DaskSource:
    """The archive as chunks held by Dask workers (a published dataset of scattered
    futures): a fetching process gathers them one at a time through its own client to
    ``scheduler``."""

    dataset: str
    scheduler: str

    def chunks(self) -> Iterator[bytes]:
        client: Any = Client(self.scheduler, set_as_default=False, timeout="60s")  # type: ignore[no-untyped-call]
        try:
            for fut in client.get_dataset(self.dataset):
                yield fut.result()
        finally:
            client.close()


def _resolve_states(states: tuple[tuple[Any, ...], ...]) -> None:
    for state in states:
        cluster.resolve(cluster.NodeRef._from_state(state))


def _release_states(states: tuple[tuple[Any, ...], ...]) -> None:
    for state in states:
        cluster.release(cluster.NodeRef._from_state(state))


class PreAttach(WorkerPlugin):
    """Resolve stores when a worker starts (or when registered): tasks find them attached."""

    def __init__(self, refs: tuple[cluster.NodeRef, ...], name: str) -> None:
        # States, not NodeRefs: unpickling a NodeRef resolves it, which must not happen on
        # the worker's event loop.
        self.states = tuple(r._state() for r in refs)
        self.name = name

    async def setup(self, worker: Any) -> None:
        await asyncio.to_thread(_resolve_states, self.states)

    def teardown(self, worker: Any) -> None:
        _release_states(self.states)


class KeepOnNanny(NannyPlugin):
    """Resolve stores in each Nanny and hold them, so the machine's copy outlives a worker
    restart (no second fetch)."""

    restart = False

    def __init__(self, refs: tuple[cluster.NodeRef, ...], name: str) -> None:
        self.states = tuple(r._state() for r in refs)
        self.name = name

    async def setup(self, nanny: Any) -> None:
        await asyncio.to_thread(_resolve_states, self.states)

    def teardown(self, nanny: Any) -> None:
        _release_states(self.states)


# Handles shared through a DaskShare pickle as their NodeRef (by path of the store).
_by_path: dict[str, cluster.NodeRef] = {}
_by_path_lock = threading.Lock()


def _reduce_handle(h: Any) -> Any:
    try:
        path = shmstore._native._store_info(h)["path"]
    except shmstore.ShmStoreError:
        path = None
    with _by_path_lock:
        ref = _by_path.get(str(path)) if path is not None else None
    if ref is not None:
        return ref.__reduce__()
    return h.__reduce__()


for _cls in (shmstore.SharedList, shmstore.SharedDict, shmstore.Ref):
    copyreg.pickle(_cls, _reduce_handle)


def _sizeof_handle(obj: Any) -> int:
    # What a handle or view costs its process: a small object over shared pages (which the
    # scheduler must not count as this worker's data).
    return 256


for _small in (shmstore.StoreHandle, shmstore.ListView, shmstore.DictView):
    sizeof.register(_small)(_sizeof_handle)  # type: ignore[no-untyped-call]


class DaskShare:
    """Stores shared with a Dask cluster (made by :func:`share`); a context manager."""

    def __init__(
        self,
        client: Any,
        refs: tuple[cluster.NodeRef, ...],
        futures: list[Any],
        datasets: list[str],
    ) -> None:
        self.client = client
        self.refs = refs
        self._futures = futures
        self._datasets = datasets
        self.name = f"shmstore-{uuid.uuid4().hex[:12]}"
        self.closed = False

    @property
    def ref(self) -> cluster.NodeRef:
        """The NodeRef of the (first) store."""
        return self.refs[0]

    def drop_chunks(self) -> None:
        """Release the scattered chunks (e.g. once every machine holds its copy): machines
        that join later can then only fetch from the other sources."""
        for name in self._datasets:
            try:
                self.client.unpublish_dataset(name)
            except (KeyError, OSError) as e:
                log.debug("unpublishing %s: %s", name, e)
        self._datasets.clear()
        self._futures.clear()

    def close(self) -> None:
        """Unregister the plugins, drop the chunks, pickle the handles by name again."""
        if self.closed:
            return
        self.closed = True
        for name, nanny in ((self.name + "-worker", False), (self.name + "-nanny", True)):
            try:
                self.client.unregister_worker_plugin(name, nanny=nanny)
            except (ValueError, KeyError, OSError) as e:
                log.debug("unregistering %s: %s", name, e)
        with _by_path_lock:
            for r in self.refs:
                _by_path.pop(r.origin_path, None)
        for r in self.refs:
            cluster.release(r)
        self.drop_chunks()

    def __enter__(self) -> DaskShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share(
    client: Any,
    *handles: Any,
    path: Union[str, os.PathLike[str], None] = None,
    mode: str = "copy",
    scatter: bool = True,
    nanny: bool = True,
    pre_attach: bool = True,
    chunk: int = CHUNK,
) -> DaskShare:
    """Share stores with the workers of ``client``: one copy per machine.

    - ``path``: also save the (single) store there, on a file system every machine mounts,
      as the first source (``mode`` "copy" or "map", see :class:`shmstore.cluster.FileSource`).
    - ``scatter``: send the archive to the cluster as ``chunk``-byte pieces (a
      :class:`DaskSource`); with a ``path`` you may turn it off.
    - ``nanny``: register :class:`KeepOnNanny` (needs workers started by Nannies; skipped
      otherwise). ``pre_attach``: register :class:`PreAttach`.

    Returns a :class:`DaskShare`; while it is open, the handles pickle as NodeRefs.
    """
    if not handles:
        raise TypeError("share() needs at least one SharedList, SharedDict or Ref")
    if path is not None and len(handles) != 1:
        raise ValueError("path= saves one store: share the stores one at a time")
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0 bytes, not {chunk}")
    scheduler = str(client.scheduler.address)
    refs = []
    futures: list[Any] = []
    datasets: list[str] = []
    for h in handles:
        sources: list[Any] = []
        if scatter:
            chunk_futures = []
            info = shmstore._native._store_info(h)
            with open(str(info["path"]), "rb", buffering=0) as f:
                for _ in range(1 << 30):
                    b = f.read(chunk)
                    if not b:
                        break
                    chunk_futures.append(client.scatter(b, hash=False))
                    del b
            dataset = f"shmstore-chunks-{uuid.uuid4().hex}"
            client.publish_dataset(chunk_futures, name=dataset)
            datasets.append(dataset)
            futures.extend(chunk_futures)
            sources.append(DaskSource(dataset, scheduler))
        refs.append(cluster.share(h, sources=sources, path=path, mode=mode))
    ds = DaskShare(client, tuple(refs), futures, datasets)
    with _by_path_lock:
        for r in refs:
            _by_path[r.origin_path] = r
    if nanny and _has_nannies(client):
        client.register_plugin(KeepOnNanny(ds.refs, ds.name + "-nanny"))
    if pre_attach:
        client.register_plugin(PreAttach(ds.refs, ds.name + "-worker"))
    return ds


def _has_nannies(client: Any) -> bool:
    info = (
        client.scheduler_info(n_workers=-1) if _takes_n_workers(client) else client.scheduler_info()
    )
    return any(w.get("nanny") for w in info.get("workers", {}).values())


def _takes_n_workers(client: Any) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):
        return False


def held_here() -> dict[str, int]:
    """This process's :func:`shmstore.cluster.stats` (run it on workers with
    ``client.run(shmstore.dask.held_here)``, on Nannies with ``nanny=True``)."""
    return cluster.stats()
