"""Map-style datasets over a SharedList, and one copy of a dataset per machine under DDP.

Nothing here imports torch: :class:`SharedListDataset` is a plain object with ``__len__`` and
``__getitem__``, which is all ``torch.utils.data.DataLoader`` asks of a map-style dataset. When
DataLoader workers start (fork, spawn or forkserver), the dataset travels by name (a pickle of
about 200 bytes) and every worker reads the same pages: no copy-on-read
(pytorch/pytorch#13246), whatever the start method.

One copy per machine under DistributedDataParallel, on one machine or many::

    import shmstore.torch as st

    def build():
        return shmstore.SharedList(load_records())      # runs on global rank 0 only

    lst = st.shared_per_machine(build)                   # every rank: its machine's copy
    ds = st.SharedListDataset(lst, transform=to_tensor)

With ``torch.distributed`` initialised, the ranks are grouped by machine identity (the ranks
that see the same segment directory, :func:`shmstore.cluster.node_id`), not by ``LOCAL_RANK``:
global rank 0 builds the store (or opens a saved archive), each other machine's lowest rank
receives the archive through the process group (chunked broadcasts among the machines'
leaders, verified against its digest) into that machine's shared memory, and every other rank
attaches. Without torch, a ``broadcast`` callable (e.g. :func:`file_broadcast`) passes the
name between the local ranks of one machine.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Generic,
    Iterable,
    Iterator,
    Optional,
    Protocol,
    TypeVar,
    Union,
    cast,
    overload,
)

import shmstore
from shmstore._util import HANDLE_CLASSES

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)

if TYPE_CHECKING:
    from torch.utils.data import Dataset as _Dataset
else:
    _Dataset = Generic  # at run time a plain generic class: torch is not imported

__all__ = [
    "Collective",
    "SharedListDataset",
    "TorchCollective",
    "file_broadcast",
    "shared_per_machine",
    "torch_broadcast",
]

#: What is broadcast: (kind, name, directory or saved-archive path, "segment" or "file")
Payload = tuple[str, str, str, str]
Broadcast = Callable[[Optional[Payload]], Payload]


def _open_list(data: Union[str, os.PathLike[str]]) -> shmstore.SharedList[Any]:
    """A path-like, or a string with a ``/``, is a saved archive; a bare string is a store
    name, or a file in the current directory when no store has that name (both: ValueError,
    since either reading would be a guess)."""
    path = os.fspath(data)
    if not isinstance(data, str) or os.sep in path:
        return shmstore.SharedList.open(path)
    try:
        attached = shmstore.SharedList.attach(path)
    except shmstore.StoreNotFoundError:
        if os.path.isfile(path):
            return shmstore.SharedList.open(path)
        raise
    if os.path.isfile(path):
        attached.close()
        raise ValueError(
            f"{path!r} names both a store and a file in the current directory: pass "
            f"'./{path}' for the file or shmstore.SharedList.attach({path!r}) for the store"
        )
    return attached


class SharedListDataset(_Dataset[_T_co]):
    """A map-style dataset over a :class:`shmstore.SharedList`.

    ``data`` is a SharedList, the name of one (attached), or the path of a saved archive
    (opened): a ``PathLike`` or a string containing ``/`` is a path; a bare string like
    ``"coco.shm"`` is a store name, or the file of that name in the current directory when no
    store has that name (ValueError when both exist).

    ``transform`` (optional) is applied to each record, a lazy read-only view; make it return
    what your collate function wants. Numpy arrays stay zero-copy *read-only* views, also
    inside ``rec.to_python()``, and the default collate's ``torch.as_tensor`` warns on them:
    make tensors with ``torch.tensor(x)`` (a copy) or copy with ``np.array(x)``.

    Pickles by name: DataLoader workers attach to the same pages under every start method.

    For type checkers it is a ``torch.utils.data.Dataset[T]``, ``T`` being what ``transform``
    returns (``Any`` without one), so ``DataLoader(SharedListDataset(...))`` type-checks; at
    run time it is a plain generic class (torch is not imported).
    """

    @overload
    def __init__(
        self: SharedListDataset[Any],
        data: Union[shmstore.SharedList[Any], str, os.PathLike[str]],
        transform: None = None,
    ) -> None: ...
    @overload
    def __init__(
        self: SharedListDataset[_T],
        data: Union[shmstore.SharedList[Any], str, os.PathLike[str]],
        transform: Callable[[Any], _T],
    ) -> None: ...
    def __init__(
        self,
        data: Union[shmstore.SharedList[Any], str, os.PathLike[str]],
        transform: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        if isinstance(data, (str, os.PathLike)):
            data = _open_list(data)
        self.data = data
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> _T_co:
        record = self.data[index]
        return cast("_T_co", record if self.transform is None else self.transform(record))

    def __getitems__(self, indices: list[int]) -> list[_T_co]:
        """A whole batch at once (what ``DataLoader`` calls when the dataset has it): the
        memory reads of the batch overlap (``SharedList.get_many``)."""
        records = self.data.get_many(indices)
        if self.transform is not None:
            records = [self.transform(r) for r in records]
        return cast("list[_T_co]", records)

    def __repr__(self) -> str:
        return f"SharedListDataset({self.data.name!r}, {len(self)} records)"


# ---------------------------------------------------------------------------------------------
# One copy per machine


def _local_rank() -> int:
    for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def torch_broadcast(group: Any = None) -> Optional[Broadcast]:
    """A broadcast over ``torch.distributed``, or None if torch is absent or not initialised.

    Every rank contributes (machine, local rank, payload) with ``all_gather_object``; each takes
    the payload of local rank 0 *on its own machine*, so a multi-machine job gets one copy per
    machine (each machine's local rank 0 builds its own). The machine is
    :func:`shmstore.cluster.node_id` (the ranks that see the same segment directory), not the
    host name: containers or namespaces on one kernel can share a host name and boot id and
    still have separate /dev/shm. A collective: every rank of ``group`` must call
    :func:`shared_per_machine`.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def broadcast(payload: Optional[Payload]) -> Payload:
        from shmstore import cluster

        me = (cluster.node_id(), _local_rank(), payload)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, me, group=group)
        for machine, local_rank, value in gathered:
            if machine == me[0] and local_rank == 0 and value is not None:
                return tuple(value)  # type: ignore[return-value]
        raise RuntimeError(f"no local rank 0 on machine {me[0]} published a store")

    return broadcast


def file_broadcast(
    path: Union[str, os.PathLike[str]], *, timeout: float = 600.0, poll: float = 0.01
) -> Broadcast:
    """A rendezvous through a file: local rank 0 writes it (atomically), the others wait for it.

    ``path`` must be on a file system every local rank sees, and fresh for each job (e.g. in a
    directory named after the job id). The waiting ranks check every ``poll`` seconds, for at
    most ``timeout`` seconds (then ``TimeoutError``).
    """
    target = Path(path)

    def broadcast(payload: Optional[Payload]) -> Payload:
        if payload is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".")
            with os.fdopen(fd, "w") as f:
                f.write("\0".join(payload))
            os.replace(tmp, target)
            return payload
        deadline = time.monotonic() + timeout
        while not target.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"local rank 0 did not publish a store in {target}")
            time.sleep(poll)
        parts = target.read_text().split("\0")
        return (parts[0], parts[1], parts[2], parts[3])

    return broadcast


def _payload(handle: shmstore.StoreHandle) -> Payload:
    path = str(handle.path)
    if handle.name == path:  # opened from a saved archive: share the file path
        return (handle.kind, "", path, "file")
    return (handle.kind, handle.name, os.path.dirname(path), "segment")


def _from_payload(payload: Payload) -> Any:
    kind, name, where, how = payload
    cls = HANDLE_CLASSES[kind]
    return cls.open(where) if how == "file" else cls.attach(name, dir=where)


class Collective(Protocol):
    """What :func:`shared_per_machine` needs of a process group (``torch.distributed`` by
    default: :class:`TorchCollective`); tests and other launchers may pass their own."""

    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""

    def leaders(self, ranks: list[int]) -> None:
        """Make the sub-group of ``ranks`` (called by every rank, as a collective)."""

    def broadcast_bytes(self, data: Optional[bytes], nbytes: int) -> bytes:
        """In the leaders' sub-group: global rank 0 sends ``data``; the others get ``nbytes``."""

    def barrier(self) -> None:
        """Wait for every rank."""


class TorchCollective:
    """:class:`Collective` over ``torch.distributed`` (any backend; gloo moves the bytes)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._sub: Any = None
        self._root = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def leaders(self, ranks: list[int]) -> None:
        if self.world_size != self._dist.get_world_size():
            # new_group() needs every rank of the job, and ranks outside ``group`` never get
            # here: refuse (on every rank of the group alike) rather than hang.
            raise ValueError(
                "shared_per_machine(group=...) across machines needs a group of every rank "
                f"of the job ({self.world_size} of {self._dist.get_world_size()} here): pass "
                "the default group (group=None), or a Collective of your own"
            )
        self._sub = self._dist.new_group(ranks)
        self._root = ranks[0]

    def broadcast_bytes(self, data: Optional[bytes], nbytes: int) -> bytes:
        import torch

        if data is not None:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            t = torch.empty(nbytes, dtype=torch.uint8)
        self._dist.broadcast(t, src=self._root, group=self._sub)
        return data if data is not None else t.numpy().tobytes()

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


#: Bytes per broadcast when a machine's leader receives its copy through the process group.
GROUP_CHUNK = 64 << 20


class _GroupSource:
    """The archive's bytes as broadcasts in the leaders' group (the receiving side)."""

    def __init__(self, coll: Collective, nbytes: int) -> None:
        self.coll = coll
        self.nbytes = nbytes
        self.left = nbytes

    def chunks(self) -> Iterator[bytes]:
        while self.left > 0:
            n = min(GROUP_CHUNK, self.left)
            self.left -= n
            yield self.coll.broadcast_bytes(None, n)

    def drain(self) -> None:
        """Take the broadcasts not consumed (the copy was already there): the sender's
        collectives must all be matched."""
        for _ in self.chunks():
            pass


def _torch_collective() -> Optional[Collective]:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return TorchCollective()


def _make(
    build: Callable[[], Union[shmstore.StoreHandle, Iterable[Any]]],
    archive: Union[str, os.PathLike[str], None],
) -> Any:
    if archive is not None and os.path.exists(archive):
        return shmstore.StoreHandle.open(archive)  # the class fits the stored kind
    made: Any = build()
    handle = made if isinstance(made, shmstore.StoreHandle) else shmstore.SharedList(made)
    if archive is not None:
        handle.save(archive)
    return handle


def _per_machine(
    build: Callable[[], Union[shmstore.StoreHandle, Iterable[Any]]],
    archive: Union[str, os.PathLike[str], None],
    coll: Collective,
) -> Any:
    """Group the ranks by machine identity (:func:`shmstore.cluster.node_id`), build on global
    rank 0, send one copy to each other machine's leader (its lowest rank) through the group,
    let every other rank attach."""
    from shmstore import cluster

    me = coll.rank
    nodes = coll.all_gather_object(cluster.node_id())
    machines: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        machines.setdefault(node, []).append(r)
    leaders = sorted(min(rs) for rs in machines.values())
    handle: Any = None
    state: Any = None
    if me == 0:
        handle = _make(build, archive)
        state = cluster.share(handle)._state()
    state = coll.all_gather_object(state)[0]
    ref = cluster.NodeRef._from_state(state)
    if len(leaders) > 1:
        coll.leaders(leaders)
        if me == 0:
            with open(ref.origin_path, "rb", buffering=0) as f:
                for _ in range(ref.nbytes // GROUP_CHUNK + 1):
                    b = f.read(GROUP_CHUNK)
                    if not b:
                        break
                    coll.broadcast_bytes(b, len(b))
        elif me in leaders:
            src = _GroupSource(coll, ref.nbytes)
            try:
                handle = cluster.resolve(dataclasses.replace(ref, sources=(src,)))
            finally:
                src.drain()
    coll.barrier()  # every machine's copy exists
    if handle is None:
        handle = cluster.resolve(ref)
    return handle


def shared_per_machine(
    build: Callable[[], Union[shmstore.StoreHandle, Iterable[Any]]],
    *,
    archive: Union[str, os.PathLike[str], None] = None,
    local_rank: Optional[int] = None,
    broadcast: Optional[Broadcast] = None,
    group: Any = None,
) -> Any:
    """One store per machine, for every rank of a job (one machine or many).

    With ``torch.distributed`` initialised (or a :class:`Collective` passed as ``group``):

    - ranks are grouped by machine identity (:func:`shmstore.cluster.node_id`: the ranks that
      see the same segment directory), never by ``$LOCAL_RANK`` or rank blocks, so
      ``torch.multiprocessing.spawn`` (which sets no LOCAL_RANK) and uneven placements work;
    - ``build()`` runs on global rank 0 only; it returns a SharedList, SharedDict or Ref, or an
      iterable of records (made into a SharedList);
    - each other machine's lowest rank receives the archive through the process group
      (broadcasts of ``GROUP_CHUNK`` bytes among the machines' leaders; gloo carries CPU
      tensors) into its machine's shared memory, verified against the digest; every other rank
      attaches. One build, one copy per machine.

    ``archive``: a saved archive (``store.save(path)``). If the file exists, rank 0 opens it
    instead of building; if it does not, rank 0 builds and saves it there for next time.

    ``group``: a torch ProcessGroup to use instead of the default one, or a
    :class:`Collective`. It is a collective: every rank of the group must call this. Across
    machines a torch group must hold every rank of the job (the machines' leaders get a
    sub-group of their own, which ``torch.distributed.new_group`` makes with every rank);
    a smaller one raises ValueError on each of its ranks.

    Without torch.distributed, pass ``broadcast`` (e.g. :func:`file_broadcast`) and
    ``local_rank`` (default ``$LOCAL_RANK``, or the MPI/Slurm equivalents, or 0): local rank 0
    makes the store and only its name is broadcast; one machine only.

    Returns the handle (SharedList, SharedDict or Ref). Keep it for as long as the ranks read:
    a machine's copy is removed when the last process using it there is gone
    (``docs/lifecycle.md``).
    """
    if broadcast is None:
        coll: Optional[Collective]
        if group is not None and hasattr(group, "all_gather_object"):
            coll = group
        elif group is not None:
            coll = TorchCollective(group)
        else:
            coll = _torch_collective()
        if coll is not None:
            return _per_machine(build, archive, coll)
        raise RuntimeError(
            "shared_per_machine needs a broadcast: initialise torch.distributed, or pass "
            "broadcast=shmstore.torch.file_broadcast(path) (or your own callable)"
        )
    rank = _local_rank() if local_rank is None else local_rank
    if rank != 0:
        return _from_payload(broadcast(None))
    handle = _make(build, archive)
    broadcast(_payload(handle))
    return handle
