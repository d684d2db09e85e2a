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
  (:class:`DaskSource`), and/or as a saved file on a shared file system (``path=``); each
  chunk is released as soon as every machine has fetched it (machines that come later read
  it from a machine holding a copy);
- while the share is open, pickling ``lst`` (the handle itself, in ``submit``/``map``
  arguments, inside closures, through joblib's Dask backend) gives its NodeRef, so user code
  passes the handle as usual and the task receives a handle;
- a :class:`KeepOnNanny` plugin makes each Nanny resolve the store (the first Nanny of a machine
  fetches it, the others attach) and hold it: a worker restarted by its Nanny (e.g. after
  going over its memory limit) attaches again, it does not fetch again;
- a :class:`PreAttach` worker plugin resolves it in every worker at start (and in workers that
  join later), so tasks never wait for a fetch.

``close()`` (or the end of the ``with``) unregisters the plugins, drops what is left of the
chunks and stops treating the handle specially; each machine's copy goes once no process
there uses it.

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
import dataclasses
import logging
import os
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union, cast

import shmstore
from shmstore import _versions, cluster
from shmstore._util import HANDLE_CLASSES

_versions.require("dask", "shmstore.dask")
_versions.require("distributed", "shmstore.dask")

from dask.sizeof import sizeof  # noqa: E402
from distributed import Client, Future, NannyPlugin, WorkerPlugin  # noqa: E402

__all__ = ["DaskShare", "DaskSource", "KeepOnNanny", "PreAttach", "held_here", "share"]

log = logging.getLogger("shmstore.dask")

#: Size of the pieces the archive is scattered in. A fetching machine holds its copy plus about
#: one chunk in flight, and a chunk stays on the cluster until every machine has it: small
#: chunks keep a machine's peak near one copy (64 pieces per GiB cost the scheduler little).
CHUNK = 32 << 20


@dataclass(frozen=True)
class DaskSource:
    """The archive as chunks held by Dask workers: a fetching process gathers them one at a
    time through its own client to ``scheduler``.

    ``dataset`` names a published Dask dataset describing the chunks (their keys, the chunk
    size, the store's identity; the chunks themselves are held by the sharing client, not by
    the dataset). After each chunk the fetcher logs an event on the topic ``dataset``; the
    :class:`DaskShare` releases chunk *i* once every machine it expects has it. A chunk that
    is gone (released, or lost with its worker) is read instead from a worker of a machine
    that holds a full copy (one that reported its fetch done, or the sharing machine).
    """

    dataset: str
    scheduler: str

    def chunks(self) -> Iterator[bytes]:
        client: Any = Client(self.scheduler, set_as_default=False, timeout="60s")  # type: ignore[no-untyped-call]
        try:
            try:
                meta = client.get_dataset(self.dataset)
            except KeyError:
                raise shmstore.StoreNotFoundError(
                    f"the chunks {self.dataset} are no longer published on {self.scheduler} "
                    "(the share was closed); share again, or with path= on a shared file system"
                ) from None
            me = cluster.node_id()
            peers: list[str] = []
            for i, key in enumerate(meta["keys"]):
                deadline = time.monotonic() + cluster._timeout(None)  # per chunk
                b = _chunk_held(client, key, deadline)
                if b is None:
                    if not peers:
                        peers = _peer_workers(client, self.dataset, meta)
                    b = _chunk_from_peer(client, meta, i, peers, deadline)
                client.log_event(self.dataset, {"node": me, "chunk": i})
                yield b
                del b
            client.log_event(_done_topic(self.dataset), {"node": me, "done": True})
        finally:
            client.close()


def _done_topic(dataset: str) -> str:
    # "done" events apart from the per-chunk ones: the scheduler keeps a bounded log per
    # topic, and a late fetcher looks the done machines up in it.
    return dataset + "-done"


def _chunk_held(client: Any, key: str, deadline: float) -> Optional[bytes]:
    """Chunk ``key`` from the worker holding it; None if the cluster no longer has it."""
    if not client.sync(client.scheduler.who_has, keys=[key]).get(key):
        return None
    fut: Any = Future(key, client)
    # A Future made from a key does not tell the scheduler that this client wants it (the
    # way a Future taken from a dataset does): tell it, or the result never comes.
    client._inform_scheduler_of_futures()
    try:
        for _ in range(10_000_000):
            try:
                return cast(bytes, fut.result(timeout=2))
            except CancelledError:  # lost with its worker
                return None
            except TimeoutError:
                pass
            if not client.sync(client.scheduler.who_has, keys=[key]).get(key):
                return None  # released meanwhile
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"chunk {key} did not arrive within SHMSTORE_FETCH_TIMEOUT "
                    f"({cluster._timeout(None):g} s)"
                )
        raise AssertionError("unreachable")
    finally:
        fut.release()


def _peer_workers(client: Any, dataset: str, meta: dict[str, Any]) -> list[str]:
    """Workers of the machines that hold a full copy: those that reported their fetch done,
    and the sharing machine."""
    done = {meta["origin"]}
    for _, msg in client.get_events(_done_topic(dataset)):
        if isinstance(msg, dict) and msg.get("done"):
            done.add(msg.get("node"))
    nodes = client.run(cluster.node_id, on_error="ignore")
    peers = sorted(w for w, n in nodes.items() if n in done)
    if not peers:
        raise shmstore.StoreNotFoundError(
            f"the chunks of store {meta['ref'][0]!r} were released (every machine expected "
            "when it was shared has its copy, or the share's keep_chunks time passed) and no "
            "worker runs on a machine holding a copy; share it with path= on a shared file "
            "system, or keep_chunks=None"
        )
    return peers


def _chunk_from_peer(
    client: Any, meta: dict[str, Any], i: int, peers: list[str], deadline: float
) -> bytes:
    size = int(meta["chunk"])
    fut = client.submit(
        _read_range,
        meta["ref"],
        i * size,
        size,
        workers=peers,
        allow_other_workers=False,
        pure=False,
    )
    try:
        return cast(bytes, fut.result(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        fut.release()


def _read_range(state: tuple[Any, ...], offset: int, size: int) -> bytes:
    """On a worker of a machine holding the store: ``size`` bytes of its archive at
    ``offset`` (the NodeRef has no sources: this attaches, it never fetches)."""
    h = cluster.resolve(cluster.NodeRef._from_state(state))
    path = str(h.path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        out = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    return out


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
    if not _by_path:  # no share open: the handle pickles by name, as always
        return h.__reduce__()
    path = None if h.closed else str(h.path)  # a closed handle pickles as it always does
    if path is not None and cluster._is_arena_chunk(h):
        path = h.name  # a chunk of an arena: its own name, not the arena's path
    with _by_path_lock:
        ref = _by_path.get(str(path)) if path is not None else None
    if ref is not None:
        return ref.__reduce__()
    return h.__reduce__()


for _cls in HANDLE_CLASSES.values():
    copyreg.pickle(_cls, _reduce_handle)


def _sizeof_handle(obj: Any) -> int:
    # What a handle or view costs its process: a small object over shared pages (which the
    # scheduler must not count as this worker's data).
    return 256


for _small in (shmstore.StoreHandle, shmstore.ListView, shmstore.DictView):
    sizeof.register(_small)(_sizeof_handle)  # type: ignore[no-untyped-call]


class _Chunks:
    """One store's scattered chunks, held by the sharing client and released chunk by chunk
    as the expected machines report them."""

    def __init__(
        self, dataset: str, futures: list[Any], expected: frozenset[str], origin_peers: bool
    ) -> None:
        self.dataset = dataset
        self.futures: list[Optional[Any]] = list(futures)
        self.expected = expected
        self.origin_peers = origin_peers  # workers run on the sharing machine
        self.got: dict[int, set[str]] = {}
        self.done: set[str] = set()

    def report(self, msg: Any) -> list[Any]:
        """Record a fetcher's event; the futures now held by nobody who needs them."""
        if not isinstance(msg, dict) or not isinstance(msg.get("node"), str):
            return []
        node = msg["node"]
        if msg.get("done"):
            self.done.add(node)
            changed = range(len(self.futures))
        elif isinstance(msg.get("chunk"), int) and 0 <= msg["chunk"] < len(self.futures):
            self.got.setdefault(msg["chunk"], set()).add(node)
            changed = range(msg["chunk"], msg["chunk"] + 1)  # only this chunk can go now
        else:
            return []
        if not self.expected:
            return []
        out = []
        for i in changed:
            fut = self.futures[i]
            if fut is not None and self.expected <= self.got.get(i, set()) | self.done:
                out.append(fut)
                self.futures[i] = None
        return out

    def take_all(self) -> list[Any]:
        out = [f for f in self.futures if f is not None]
        self.futures = [None] * len(self.futures)
        return out

    def held(self) -> int:
        return sum(f is not None for f in self.futures)


class DaskShare:
    """Stores shared with a Dask cluster (made by :func:`share`); a context manager."""

    def __init__(
        self,
        client: Any,
        refs: tuple[cluster.NodeRef, ...],
        chunks: list[_Chunks],
        keep_chunks: Optional[float] = None,
        keys: Optional[list[str]] = None,
    ) -> None:
        self.client = client
        self.refs = refs
        self._chunks = chunks
        self._lock = threading.Lock()
        self.name = f"shmstore-{uuid.uuid4().hex[:12]}"
        self.closed = False
        # What `share` registered for pickling (store paths, arena chunk names).
        self._keys: list[str] = keys if keys is not None else [r.origin_path for r in refs]
        self._timer: Optional[threading.Timer] = None
        for c in chunks:
            client.subscribe_topic(c.dataset, self._handler(c))
            client.subscribe_topic(_done_topic(c.dataset), self._handler(c))
        if keep_chunks is not None and chunks:
            self._timer = threading.Timer(keep_chunks, self._expire)
            self._timer.daemon = True
            self._timer.start()

    @property
    def ref(self) -> cluster.NodeRef:
        """The NodeRef of the (first) store."""
        return self.refs[0]

    @property
    def chunks_held(self) -> int:
        """How many scattered chunks this share still holds on the cluster."""
        with self._lock:
            return sum(c.held() for c in self._chunks)

    def _handler(self, c: _Chunks) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            with self._lock:
                pair = isinstance(event, (tuple, list)) and len(event) == 2
                drop = c.report(event[1] if pair else event)
            for fut in drop:
                fut.release()

        return on_event

    def _expire(self) -> None:
        """``keep_chunks`` passed: release what machines that never fetched would need, if
        a machine holds a full copy they can read instead."""
        with self._lock:
            drop = []
            for c in self._chunks:
                if c.held() and (c.done or c.origin_peers):
                    log.warning(
                        "releasing the chunks of %s (keep_chunks passed): machines %s never "
                        "fetched them; they will read from a machine that has its copy",
                        c.dataset,
                        ", ".join(sorted(c.expected - c.done)) or "(none expected)",
                    )
                    drop += c.take_all()
                elif c.held():
                    log.warning(
                        "keep_chunks passed but no machine has fetched %s yet: its chunks are "
                        "the only copy off this machine, they stay until drop_chunks()/close()",
                        c.dataset,
                    )
        for fut in drop:
            fut.release()

    def drop_chunks(self) -> None:
        """Release every scattered chunk now (they are released on their own as the
        machines fetch them): a machine that fetches later reads the bytes from a worker of a
        machine that holds a copy, or from ``path=``."""
        with self._lock:
            drop = [f for c in self._chunks for f in c.take_all()]
        for fut in drop:
            fut.release()

    def close(self) -> None:
        """Unregister the plugins, drop the chunks, pickle the handles by name again."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        for name, nanny in ((self.name + "-worker", False), (self.name + "-nanny", True)):
            try:
                self.client.unregister_worker_plugin(name, nanny=nanny)
            except (ValueError, KeyError, OSError) as e:
                log.debug("unregistering %s: %s", name, e)
        with _by_path_lock:
            for k in self._keys:
                _by_path.pop(k, None)
        for r in self.refs:
            cluster.release(r)
        self.drop_chunks()
        for c in self._chunks:
            for step, arg in (
                (self.client.unsubscribe_topic, c.dataset),
                (self.client.unsubscribe_topic, _done_topic(c.dataset)),
                (self.client.unpublish_dataset, c.dataset),
            ):
                try:
                    step(arg)
                except (ValueError, KeyError, OSError) as e:
                    log.debug("closing %s: %s", arg, e)

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
    keep_chunks: Optional[float] = 600.0,
) -> DaskShare:
    """Share stores with the workers of ``client``: one copy per machine.

    - ``path``: also save the (single) store there, on a file system every machine mounts,
      as the first source (``mode`` "copy" or "map", see :class:`shmstore.cluster.FileSource`).
    - ``scatter``: send the archive to the cluster as ``chunk``-byte pieces (a
      :class:`DaskSource`); with a ``path`` you may turn it off. Chunk *i* is released as
      soon as every machine that had workers when ``share()`` was called (other than this
      one) has fetched it; after ``keep_chunks`` seconds (None: never) the rest is released
      if some machine holds a full copy (machines that fetch later read from one of them).
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
    if keep_chunks is not None and not keep_chunks >= 0:
        raise ValueError(f"keep_chunks must be >= 0 seconds or None, not {keep_chunks}")
    scheduler = str(client.scheduler.address)
    here = cluster.node_id()
    expected: frozenset[str] = frozenset()
    origin_peers = False
    if scatter:
        nodes = client.run(cluster.node_id, on_error="ignore")
        machines = frozenset(n for n in nodes.values() if isinstance(n, str))
        expected, origin_peers = machines - {here}, here in machines
    refs = []
    chunk_sets: list[_Chunks] = []
    # Handles that pickle as a NodeRef while the share is open: by store path, and a chunk of
    # this process's arena by its name (all chunks of an arena share its path).
    keys: list[tuple[str, cluster.NodeRef]] = []
    for given in handles:
        h = cluster._shareable(given)
        ref = cluster.share(h, path=path, mode=mode)
        if scatter:
            futures = []
            with open(str(h.path), "rb", buffering=0) as f:
                for _ in range(1 << 30):
                    b = f.read(chunk)
                    if not b:
                        break
                    futures.append(client.scatter(b, hash=False))
                    del b
            dataset = f"shmstore-chunks-{uuid.uuid4().hex}"
            meta = {
                "keys": [fut.key for fut in futures],
                "chunk": chunk,
                "origin": here,
                "ref": dataclasses.replace(ref, sources=())._state(),
            }
            client.publish_dataset(meta, name=dataset)
            chunk_sets.append(_Chunks(dataset, futures, expected, origin_peers))
            del futures
            ref = dataclasses.replace(ref, sources=(*ref.sources, DaskSource(dataset, scheduler)))
        refs.append(ref)
        keys.append((ref.origin_path, ref))
        if h is not given:
            keys.append((given.name, ref))
    ds = DaskShare(client, tuple(refs), chunk_sets, keep_chunks, [k for k, _ in keys])
    with _by_path_lock:
        for k, r in keys:
            _by_path[k] = r
    if nanny and _has_nannies(client):
        client.register_plugin(KeepOnNanny(ds.refs, ds.name + "-nanny"))
    if pre_attach:
        client.register_plugin(PreAttach(ds.refs, ds.name + "-worker"))
    if chunk_sets and not expected and origin_peers:
        # Every worker runs on this machine (e.g. a LocalCluster): nobody needs the chunks;
        # a machine that joins later reads from a worker here.
        ds.drop_chunks()
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
