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
import threading
import time
import weakref
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

    ``path`` must be on a file system every local rank sees. It may be reused from an earlier
    run: a file naming a store that no longer exists (its run ended, so the supervisor removed
    it) is taken for stale, and the waiting ranks go on waiting for this run's local rank 0 to
    replace it. (A path still naming a live store of another job that is running now is read
    as this job's: give concurrent jobs different paths.) The waiting ranks check every
    ``poll`` seconds, for at most ``timeout`` seconds (then ``TimeoutError``, saying what the
    file held).
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
        stale: Optional[Payload] = None
        while True:
            found = _read_payload(target)
            if found is not None and _payload_exists(found):
                return found
            stale = found or stale
            if time.monotonic() > deadline:
                if stale is not None:
                    raise TimeoutError(
                        f"{target} names a store that no longer exists ({stale[1] or stale[2]}): "
                        f"left by an earlier run, and local rank 0 did not replace it in "
                        f"{timeout:g} s"
                    )
                raise TimeoutError(f"local rank 0 did not publish a store in {target}")
            time.sleep(poll)

    return broadcast


def _read_payload(target: Path) -> Optional[Payload]:
    """The payload in ``target``, or None while it is missing or not one (rank 0 replaces the
    file atomically, so a partial file is never seen; anything else is a foreign file)."""
    try:
        parts = target.read_text().split("\0")
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    if len(parts) != 4:
        return None
    return (parts[0], parts[1], parts[2], parts[3])


def _payload_exists(payload: Payload) -> bool:
    """Whether the store a payload names is still there (a stale file from an earlier run
    names one the supervisor has removed)."""
    _kind, name, where, how = payload
    return os.path.exists(where if how == "file" else os.path.join(where, name))


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


# ---------------------------------------------------------------------------------------------
# Pinning shared pages for the GPU


class PinError(shmstore.ShmStoreError, RuntimeError):
    """Pages of a store could not be registered with CUDA, or a pinned handle was used where
    it cannot be (closed, or inherited through ``fork`` by a process that did not pin it)."""


class CudaUnavailableError(PinError):
    """Pinning needs what this process lacks: torch, a CUDA device, or a device and driver
    that can pin read-only pages (``cudaHostRegisterReadOnly``). Catch it to run without
    pinning; nothing falls back to pageable copies silently."""


#: ``cudaHostRegisterPortable | cudaHostRegisterReadOnly``: the pages count as pinned for
#: every device of the process, and the GPU only reads them (the mapping is ``PROT_READ``).
HOST_REGISTER_FLAGS = 0x01 | 0x08

_CUDA_ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    4: "cudaErrorCudartUnloading",
    100: "cudaErrorNoDevice",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
}


class Registrar(Protocol):
    """What pins pages: :class:`CudaRegistrar` by default; tests pass a fake one to
    :func:`set_registrar`. ``register`` raises :class:`PinError` when it fails."""

    def register(self, address: int, nbytes: int) -> None:
        """Pin ``nbytes`` bytes at ``address`` (page-aligned, whole pages)."""

    def unregister(self, address: int) -> None:
        """Unpin the range registered at ``address``, after the copies from it are done."""


class CudaRegistrar:
    """``cudaHostRegister(address, nbytes, HOST_REGISTER_FLAGS)`` through the installed
    torch (``torch.cuda.cudart()``): no CUDA build dependency of shmstore's own."""

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise CudaUnavailableError(
                "pinning shared arrays for the GPU needs torch with CUDA: pip install torch"
            ) from e
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                "pinning shared arrays for the GPU needs a CUDA device, and "
                "torch.cuda.is_available() is False in this process"
            )
        self._torch = torch
        self._cudart = torch.cuda.cudart()

    def _error(self, code: int) -> str:
        name = _CUDA_ERRORS.get(code, "cudaError")
        try:
            text = str(self._cudart.cudaGetErrorString(self._cudart.cudaError(code)))
        except Exception:  # older torch: the bindings lack it; the code and name suffice
            text = ""
        return f"{name} ({code}{': ' + text if text else ''})"

    def register(self, address: int, nbytes: int) -> None:
        code = int(self._cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_FLAGS))
        if code == 0:
            return
        if code in (1, 801):
            raise CudaUnavailableError(
                f"cudaHostRegister of {nbytes} bytes of a shared mapping failed with "
                f"{self._error(code)}: the device or driver does not support "
                "cudaHostRegisterReadOnly (device attribute "
                "cudaDevAttrHostRegisterReadOnlySupported), and a store's pages are mapped "
                "read-only (PROT_READ), which CUDA cannot pin without that flag. Copy into "
                "pinned memory instead: torch.from_numpy(np.array(x)).pin_memory()"
            )
        raise PinError(
            f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with "
            f"{self._error(code)}"
            + (": something else in this process registered these pages" if code == 712 else "")
        )

    def unregister(self, address: int) -> None:
        code = int(self._cudart.cudaHostUnregister(address))
        if code not in (0, 4):  # 4: CUDA is unloading at exit, the pages go with it
            raise PinError(f"cudaHostUnregister({address:#x}) failed with {self._error(code)}")


@dataclasses.dataclass
class _Entry:
    """One registered mapping of this process."""

    start: int
    nbytes: int
    keeper: Any  #: keeps the mapping mapped while registered (an ArrayOwner)
    registrar: Registrar
    pid: int
    users: int = 0
    host: Any = None  #: a torch uint8 tensor over the range, made on first use
    devices: set[Any] = dataclasses.field(default_factory=set)  #: copied to (to_device)


_registrar: Optional[Registrar] = None
_entries: dict[int, _Entry] = {}  # mapping start -> entry, this process's registrations only
_lock = threading.RLock()
_hooks_installed = False


def set_registrar(registrar: Optional[Registrar]) -> Optional[Registrar]:
    """Use ``registrar`` for new pins (``None``: the CUDA one, made on the next pin); returns
    the previous one. For tests and for other accelerators' pinning calls."""
    global _registrar
    with _lock:
        previous, _registrar = _registrar, registrar
    return previous


def _forget_after_fork() -> None:
    # A child inherits the parent's table but none of its CUDA registrations: forget them
    # (without unregistering) so that a pin in the child registers anew.
    global _lock
    _lock = threading.RLock()
    _entries.clear()


def _unpin_all_at_exit() -> None:
    with _lock:
        entries = [e for e in _entries.values() if e.pid == os.getpid()]
        _entries.clear()
    for e in entries:
        e.host = None
        try:
            _sync(e)
            e.registrar.unregister(e.start)
        except Exception:  # at exit CUDA may be gone already; the pages go with the process
            pass


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        os.register_at_fork(after_in_child=_forget_after_fork)
        import atexit

        atexit.register(_unpin_all_at_exit)
        _hooks_installed = True


def _page_range(start: int, nbytes: int) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    first = start - start % page
    end = start + nbytes
    end += -end % page
    return first, end - first


def _array_owner(arr: Any) -> Any:
    """The ArrayOwner behind a shmstore array (or a view of one), or None."""
    base = arr
    for _ in range(64):  # views of views: a short chain in practice
        base = getattr(base, "base", None)
        if base is None:
            return None
        if isinstance(base, shmstore._native.ArrayOwner):
            return base
    return None


def _targets(obj: Any) -> list[tuple[int, int, Any]]:
    """(mapping start, length, keeper) of every mapping ``obj`` lies in."""
    if isinstance(obj, shmstore.StoreHandle):
        return [obj._mapping_extent()]
    if isinstance(obj, shmstore._native.ArrayOwner):
        return [(*obj._mapping_extent(), obj)]
    if hasattr(obj, "__array_interface__") and hasattr(obj, "base"):
        owner = _array_owner(obj)
        if owner is None:
            raise ValueError(
                "this array is not in a shmstore store (its memory is not a store's shared "
                "mapping): pin it with torch.from_numpy(x).pin_memory(), or pin the array "
                "shmstore returned"
            )
        return [(*owner._mapping_extent(), owner)]
    if isinstance(obj, (shmstore.ListView, shmstore.DictView, list, tuple, dict)):
        found: dict[int, tuple[int, int, Any]] = {}
        stack = [obj]
        seen = 0
        while stack:
            item = stack.pop()
            seen += 1
            if seen > 1_000_000:
                raise ValueError("pin() of a record with more than a million items: pin its store")
            if isinstance(item, (shmstore.DictView, dict)):
                stack.extend(item.values())
            elif isinstance(item, (shmstore.ListView, list, tuple)):
                stack.extend(item)
            elif hasattr(item, "__array_interface__") and _array_owner(item) is not None:
                for t in _targets(item):
                    found.setdefault(t[0], t)
        if not found:
            raise ValueError("this record holds no shmstore array: nothing to pin")
        return list(found.values())
    raise TypeError(
        f"pin() takes a shmstore array, record or store handle, not {type(obj).__name__}"
    )


class Pinned:
    """Shared pages of this process registered with CUDA (``pin()``'s result).

    A context manager; :meth:`close` (or leaving the ``with``, or garbage collection) lets go,
    and the pages are unregistered when the last ``Pinned`` of a mapping in this process goes.
    While registered, the mapping stays mapped (the handle holds its owner), even if the
    store handle is closed.
    """

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries: Optional[list[_Entry]] = entries
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, entries, self._pid)
        self._finalizer.atexit = False  # _unpin_all_at_exit does it, errors silenced

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._entries is None

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(address, length) of each registered range (whole pages of whole mappings)."""
        return [(e.start, e.nbytes) for e in self._live()]

    def _live(self) -> list[_Entry]:
        if self._entries is None:
            raise PinError("this Pinned was closed: pin() again")
        if self._pid != os.getpid():
            raise PinError(
                f"these pages were pinned by process {self._pid}, and registrations are not "
                "inherited through fork: pin() again in this process"
            )
        return self._entries

    def close(self) -> None:
        """Let go (idempotent). In a forked child it does nothing: the child never held it."""
        if self._entries is not None:
            self._entries = None
            self._finalizer()

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._entries is None:
            return "<shmstore.torch.Pinned closed>"
        total = sum(e.nbytes for e in self._entries)
        return f"<shmstore.torch.Pinned {len(self._entries)} mapping(s), {total} bytes>"

    def _used(self, device: Any) -> None:
        if device.type == "cuda":
            for e in self._live():
                e.devices.add(device)

    def _host_tensor(self, arr: Any) -> Any:
        """A CPU tensor over ``arr``'s bytes in the registered pages (no copy)."""
        import numpy as np
        import torch

        arr = np.asarray(arr)
        addr = arr.__array_interface__["data"][0]
        for e in self._live():
            if e.start <= addr and addr + arr.nbytes <= e.start + e.nbytes:
                break
        else:
            raise PinError(
                "this array is not in the pages pinned by this handle (a copy of a shmstore "
                "array, e.g. one that came through a DataLoader worker by value, is new "
                "pageable memory): pin its store, or send records by name (RecordRefs)"
            )
        if not arr.flags.c_contiguous:
            raise ValueError(
                "only C-contiguous arrays are copied straight from pinned pages; a slice "
                "along the first axis (x[a:b]) is contiguous, x[:, a:b] or x[::2] is not"
            )
        if e.host is None:
            import ctypes

            raw = (ctypes.c_ubyte * e.nbytes).from_address(e.start)
            e.host = torch.frombuffer(raw, dtype=torch.uint8)  # type: ignore[arg-type]
        off = addr - e.start
        return e.host[off : off + arr.nbytes].view(_torch_dtype(arr.dtype)).view(arr.shape)

    def to_device(self, data: Any, device: Any = "cuda", *, non_blocking: bool = True) -> Any:
        """Copy ``data`` from the pinned pages to ``device`` (direct DMA, no host copy).

        ``data``: an array in the pinned pages (a tensor of the same shape comes back); a
        list of arrays of one shape (each copied, then stacked on the device); or a list of
        records (dicts of arrays and numbers, as :class:`RecordRefs` batches give): a dict of
        stacked tensors, numbers made into a tensor. With ``non_blocking`` (the default) the
        copies are asynchronous on the current stream; the pages never change, so no host
        buffer needs to outlive them.
        """
        import torch

        if hasattr(data, "__array_interface__"):
            out = self._host_tensor(data).to(device, non_blocking=non_blocking)
            self._used(out.device)
            return out
        items = list(data)
        if not items:
            raise ValueError("to_device() of an empty batch")
        first = items[0]
        if isinstance(first, (shmstore.DictView, dict)):
            return {k: self.to_device([it[k] for it in items], device) for k in first.keys()}
        if hasattr(first, "__array_interface__"):
            parts = [self._host_tensor(x).to(device, non_blocking=non_blocking) for x in items]
            self._used(parts[0].device)
            return torch.stack(parts)
        return torch.as_tensor(items).to(device, non_blocking=non_blocking)


_DTYPES: dict[Any, Any] = {}


def _torch_dtype(dtype: Any) -> Any:
    t = _DTYPES.get(dtype)
    if t is None:
        import numpy as np
        import torch

        t = _DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return t


def _release(entries: list[_Entry], pid: int) -> None:
    if pid != os.getpid():
        return  # a forked child's copy of a parent's handle: nothing of its own to undo
    gone: list[_Entry] = []
    with _lock:
        for e in entries:
            e.users -= 1
            if e.users == 0 and _entries.get(e.start) is e:
                del _entries[e.start]
                gone.append(e)
    for e in gone:
        _sync(e)
        e.host = None
        e.registrar.unregister(e.start)


def _sync(e: _Entry) -> None:
    """Wait for the copies from ``e`` still in flight (``non_blocking``) before unpinning."""
    if e.devices:
        import torch

        for d in e.devices:
            torch.cuda.synchronize(d)
        e.devices.clear()


def pin(obj: Any) -> Pinned:
    """Register the shared pages behind ``obj`` with CUDA, read-only, in this process.

    ``obj``: a numpy array shmstore returned (or a slice of one), a record holding arrays, or
    a store handle (``SharedList``, ``SharedDict``, ``Ref``). What is registered is the whole
    mapping the data lies in, in whole pages, once per process: pinning several arrays of one
    store, or the store and then its arrays, registers it once and counts the users. Other
    processes pin the same physical pages for themselves (no copy in any of them).

    Raises :class:`CudaUnavailableError` without torch, without a CUDA device, or where the
    device cannot pin read-only pages; :class:`PinError` when CUDA refuses otherwise.

    >>> import numpy as np, shmstore, shmstore.torch as st
    >>> class Fake:
    ...     def register(self, address, nbytes): print("register", nbytes % 4096 == 0)
    ...     def unregister(self, address): print("unregister")
    >>> old = st.set_registrar(Fake())
    >>> ref = shmstore.put(np.zeros(1000, np.float32), arena=False)
    >>> with st.pin(ref) as p, st.pin(ref.get()):
    ...     len(p.ranges)
    register True
    1
    unregister
    >>> _ = st.set_registrar(old)
    """
    global _registrar
    _install_hooks()
    targets = _targets(obj)
    pid = os.getpid()
    taken: list[_Entry] = []
    try:
        for start, length, keeper in targets:
            start, length = _page_range(start, length)
            with _lock:
                e = _entries.get(start)
                if e is not None and e.pid == pid:
                    e.users += 1
                    taken.append(e)
                    continue
                registrar = _registrar
                if registrar is None:
                    registrar = _registrar = CudaRegistrar()
                registrar.register(start, length)
                e = _Entry(start, length, keeper, registrar, pid, users=1)
                _entries[start] = e
                taken.append(e)
    except BaseException:
        _release(taken, pid)
        raise
    return Pinned(taken)


# ---------------------------------------------------------------------------------------------
# DataLoader batches sent by name


@dataclasses.dataclass
class BatchRefs:
    """A batch as a DataLoader worker sends it by :func:`collate_refs`: the SharedList (pickled
    by name) and the record indices, a few hundred bytes whatever the records hold. The
    process that iterates the loader reads the records from its own mapping
    (:meth:`records`), where :func:`pin` registered them."""

    data: shmstore.SharedList[Any]
    indices: list[int]

    def __len__(self) -> int:
        return len(self.indices)

    def records(self) -> list[Any]:
        """The batch's records, read here (lazy views and zero-copy arrays)."""
        return self.data.get_many(self.indices)


if TYPE_CHECKING:

    class _RefsBase(_Dataset[tuple[Any, int]]): ...

else:

    class _RefsBase:  # torch is not imported
        pass


class RecordRefs(_RefsBase):
    """A map-style dataset whose items are (SharedList, index) references, for
    ``DataLoader(RecordRefs(lst), collate_fn=collate_refs, ...)``: workers read nothing and
    send :class:`BatchRefs`; the loop copies ``pinned.to_device(refs.records())`` straight
    from pinned shared pages (docs/guides/gpu.md)."""

    def __init__(self, data: Union[shmstore.SharedList[Any], str, os.PathLike[str]]) -> None:
        if isinstance(data, (str, os.PathLike)):
            data = _open_list(data)
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        n = len(self.data)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} records")
        return (self.data, index % n)

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, int]]:
        return [self[i] for i in indices]


def collate_refs(batch: list[tuple[Any, int]]) -> BatchRefs:
    """The ``collate_fn`` for :class:`RecordRefs`: one :class:`BatchRefs` per batch."""
    if not batch:
        raise ValueError("collate_refs() of an empty batch")
    data = batch[0][0]
    if any(d is not data for d, _ in batch):
        raise ValueError("collate_refs(): a batch mixes records of several SharedLists")
    return BatchRefs(data, [int(i) for _, i in batch])
