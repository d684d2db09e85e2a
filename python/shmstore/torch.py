"""Map-style datasets over a SharedList, and one copy of a dataset per machine under DDP.

Nothing here imports torch: :class:`SharedListDataset` is a plain object with ``__len__`` and
``__getitem__``, which is all ``torch.utils.data.DataLoader`` asks of a map-style dataset. When
DataLoader workers start (fork, spawn or forkserver), the dataset travels by name (a pickle of
about 200 bytes) and every worker reads the same pages: no copy-on-read
(pytorch/pytorch#13246), whatever the start method.

One copy per machine under DistributedDataParallel::

    import shmstore.torch as st

    def build():
        return shmstore.SharedList(load_records())      # runs on local rank 0 only

    lst = st.shared_per_machine(build)                   # every local rank: the same store
    ds = st.SharedListDataset(lst, transform=to_tensor)

Local rank 0 builds the store (or opens a saved archive), and only its *name* is broadcast; the
other local ranks attach to it. The broadcast is a callable you may pass; by default it uses
``torch.distributed`` when torch is importable and the process group is initialised (an
``all_gather_object`` of (machine, local rank, name), so that each machine's ranks take their
own machine's copy), and :func:`file_broadcast` gives a file-based rendezvous for tests and
launchers without torch.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import shmstore

__all__ = [
    "SharedListDataset",
    "file_broadcast",
    "shared_per_machine",
    "torch_broadcast",
]

#: What is broadcast: (kind, name, directory or saved-archive path, "segment" or "file")
Payload = tuple[str, str, str, str]
Broadcast = Callable[[Optional[Payload]], Payload]


def _open_list(data: Union[str, os.PathLike[str]]) -> shmstore.SharedList:
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


class SharedListDataset:
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
    """

    def __init__(
        self,
        data: Union[shmstore.SharedList, str, os.PathLike[str]],
        transform: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        if isinstance(data, (str, os.PathLike)):
            data = _open_list(data)
        self.data = data
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        record = self.data[index]
        return record if self.transform is None else self.transform(record)

    def __repr__(self) -> str:
        return f"SharedListDataset({self.data.name!r}, {len(self)} records)"


# ---------------------------------------------------------------------------------------------
# One copy per machine


def _local_rank() -> int:
    for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _machine_id() -> str:
    """Processes that see the same /dev/shm: same host name and same boot."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def torch_broadcast(group: Any = None) -> Optional[Broadcast]:
    """A broadcast over ``torch.distributed``, or None if torch is absent or not initialised.

    Every rank contributes (machine, local rank, payload) with ``all_gather_object``; each takes
    the payload of local rank 0 *on its own machine*, so a multi-machine job gets one copy per
    machine. A collective: every rank of ``group`` must call :func:`shared_per_machine`.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def broadcast(payload: Optional[Payload]) -> Payload:
        me = (_machine_id(), _local_rank(), payload)
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


_KINDS: dict[str, Any] = {
    "list": shmstore.SharedList,
    "dict": shmstore.SharedDict,
    "object": shmstore.Ref,
}


def _payload(handle: Any) -> Payload:
    info = shmstore._native._store_info(handle)
    path = str(info["path"])
    if info["name"] == path:  # opened from a saved archive: share the file path
        return (str(info["kind"]), "", path, "file")
    return (str(info["kind"]), str(info["name"]), os.path.dirname(path), "segment")


def _from_payload(payload: Payload) -> Any:
    kind, name, where, how = payload
    cls = _KINDS[kind]
    return cls.open(where) if how == "file" else cls.attach(name, dir=where)


def shared_per_machine(
    build: Callable[[], Union[shmstore.StoreHandle, Iterable[Any]]],
    *,
    archive: Union[str, os.PathLike[str], None] = None,
    local_rank: Optional[int] = None,
    broadcast: Optional[Broadcast] = None,
) -> Any:
    """One store per machine: local rank 0 makes it, the other local ranks attach by name.

    - ``build()`` runs on local rank 0 only; it returns a SharedList, SharedDict or Ref, or an
      iterable of records (made into a SharedList).
    - ``archive``: a saved archive (``store.save(path)``). If the file exists, local rank 0
      opens it instead of building, and every rank maps the same file (shared through the page
      cache); if it does not, local rank 0 builds the store and saves it there for next time.
    - ``local_rank``: defaults to ``$LOCAL_RANK`` (torchrun), or the MPI/Slurm equivalents, or 0.
    - ``broadcast``: how the name travels (see :func:`torch_broadcast`, :func:`file_broadcast`);
      by default ``torch.distributed`` when it is initialised. Only the name is broadcast.

    Returns the handle (SharedList, SharedDict or Ref). Keep it for as long as the ranks read:
    on local rank 0 it is the creating handle, and the segment is removed when the last process
    using it is gone (``docs/lifecycle.md``).
    """
    rank = _local_rank() if local_rank is None else local_rank
    if broadcast is None:
        broadcast = torch_broadcast()
    if broadcast is None:
        raise RuntimeError(
            "shared_per_machine needs a broadcast: initialise torch.distributed, or pass "
            "broadcast=shmstore.torch.file_broadcast(path) (or your own callable)"
        )
    if rank != 0:
        return _from_payload(broadcast(None))
    handle: Any
    if archive is not None and os.path.exists(archive):
        kind = shmstore._native._store_info(os.fspath(archive))["kind"]
        handle = _KINDS[str(kind)].open(archive)
    else:
        made = build()
        handle = made if isinstance(made, tuple(_KINDS.values())) else shmstore.SharedList(made)
        if archive is not None:
            handle.save(archive)
    broadcast(_payload(handle))
    return handle
