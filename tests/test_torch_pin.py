"""Pinning shared pages for the GPU (shmstore.torch.pin): the bookkeeping runs everywhere with
a fake registrar (numpy only); the real CUDA path runs where torch sees a CUDA device."""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import shmstore
import shmstore.torch as st
from shmstore import _procmaps

PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeRegistrar:
    """Records the calls; refuses overlapping registrations as CUDA does."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, nbytes: int) -> None:
        self.calls.append(("register", address))
        assert address % PAGE == 0 and nbytes % PAGE == 0 and nbytes > 0
        for a, n in self.live.items():
            assert address + nbytes <= a or a + n <= address, "overlapping registration"
        if self.fail:
            raise st.PinError("refused by the fake")
        self.live[address] = nbytes

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        del self.live[address]

    def covers(self, arr: np.ndarray) -> bool:
        addr = arr.__array_interface__["data"][0]
        return any(a <= addr and addr + arr.nbytes <= a + n for a, n in self.live.items())


@pytest.fixture
def fake() -> Iterator[FakeRegistrar]:
    reg = FakeRegistrar()
    old = st.set_registrar(reg)
    try:
        yield reg
    finally:
        st.set_registrar(old)
        gc.collect()
        assert not st._entries, "a test left a registration behind"


def big(n: int = 300_000) -> Any:
    return shmstore.put(np.arange(n, dtype=np.float32), arena=False)


def test_pin_array_registers_its_whole_mapping_once(fake: FakeRegistrar) -> None:
    ref = big()
    a = ref.get()
    with st.pin(a) as p:
        assert fake.covers(a) and len(fake.live) == 1
        ((start, n),) = p.ranges
        assert n >= a.nbytes and start % PAGE == 0
        # the same array, a slice of it and the store itself: counted, not registered again
        with st.pin(a[10:20]), st.pin(ref), st.pin(ref.get()):
            assert [c for c, _ in fake.calls] == ["register"]
        assert not any(c == "unregister" for c, _ in fake.calls)
    assert [c for c, _ in fake.calls] == ["register", "unregister"]
    assert not fake.live
    ref.unlink()


def test_pin_store_covers_every_array_and_record(fake: FakeRegistrar) -> None:
    recs = [{"x": np.full((64, 64), i, np.float32), "y": i} for i in range(20)]
    lst = shmstore.SharedList(recs)
    with st.pin(lst):
        assert all(fake.covers(r["x"]) for r in lst)
        with st.pin(lst[3]) as p:  # a record: its arrays' mapping, the same one
            assert len(p.ranges) == 1 and len(fake.live) == 1
    assert not fake.live
    lst.unlink()


def test_arena_chunks_share_one_registration(fake: FakeRegistrar) -> None:
    refs = [shmstore.put(np.arange(100) + i) for i in range(3)]  # small: arena chunks
    arrays = [r.get() for r in refs]
    pins = [st.pin(a) for a in arrays]
    assert sum(c == "register" for c, _ in fake.calls) == 1
    assert all(fake.covers(a) for a in arrays)
    for p in pins:
        p.close()
    assert not fake.live


def test_bad_input_is_refused_clearly(fake: FakeRegistrar) -> None:
    with pytest.raises(ValueError, match="not in a shmstore store"):
        st.pin(np.zeros(10))
    with pytest.raises(TypeError, match="not str"):
        st.pin("name")  # type: ignore[arg-type]
    lst = shmstore.SharedList([{"a": 1}])
    with pytest.raises(ValueError, match="holds no shmstore array"):
        st.pin(lst[0])
    lst.unlink()
    assert not fake.calls


def test_closed_and_idempotent_close(fake: FakeRegistrar) -> None:
    ref = big()
    p = st.pin(ref)
    p.close()
    p.close()
    assert p.closed and "closed" in repr(p)
    with pytest.raises(st.PinError, match="closed"):
        _ = p.ranges
    assert [c for c, _ in fake.calls] == ["register", "unregister"]
    ref.unlink()


def test_garbage_collection_unpins(fake: FakeRegistrar) -> None:
    ref = big()
    st.pin(ref)  # dropped at once
    gc.collect()
    assert [c for c, _ in fake.calls] == ["register", "unregister"]
    ref.unlink()


def test_a_refused_registration_leaves_nothing(fake: FakeRegistrar) -> None:
    ref = big()
    fake.fail = True
    with pytest.raises(st.PinError, match="refused"):
        st.pin(ref)
    assert not st._entries
    fake.fail = False
    with st.pin(ref):
        assert len(fake.live) == 1
    ref.unlink()


def test_the_mapping_stays_while_pinned(fake: FakeRegistrar) -> None:
    """Closing the handle and dropping every array must not unmap registered pages."""
    ref = big()
    p = st.pin(ref)
    ((start, _),) = p.ranges
    ref.unlink()
    ref.close()
    del ref
    gc.collect()
    assert _procmaps.entry_at(start) is not None
    p.close()
    del p
    gc.collect()
    assert _procmaps.entry_at(start) is None


def test_fork_child_does_not_inherit_registrations(fake: FakeRegistrar) -> None:
    ref = big()
    p = st.pin(ref)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it saw, never return into pytest
        code = 1
        try:
            fake.calls.clear()
            fake.live.clear()  # as CUDA: the child holds none of the parent's registrations
            ok = not st._entries
            p.close()  # the parent's handle: nothing to undo here
            ok = ok and fake.calls == []
            with st.pin(ref):  # registers anew in the child
                ok = ok and [c for c, _ in fake.calls] == ["register"]
            code = 0 if ok else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"\x00"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert len(fake.live) == 1  # the parent's registration is untouched
    p.close()
    ref.unlink()


def test_without_torch_or_cuda_a_specific_error() -> None:
    old = st.set_registrar(None)
    ref = big(10)
    try:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if cuda:
            pytest.skip("this process has CUDA")
        with pytest.raises(st.CudaUnavailableError, match="torch") as info:
            st.pin(ref)
        assert isinstance(info.value, shmstore.ShmStoreError)
        assert not st._entries
    finally:
        st.set_registrar(old)
        ref.unlink()


class FakeCudart:
    def __init__(self, code: int) -> None:
        self.code = code

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert flags == st.HOST_REGISTER_FLAGS
        return self.code


def test_cuda_errors_say_what_to_do() -> None:
    reg = object.__new__(st.CudaRegistrar)
    reg._cudart = FakeCudart(801)
    with pytest.raises(st.CudaUnavailableError, match="PROT_READ"):
        reg.register(0x10000, PAGE)
    reg._cudart = FakeCudart(2)
    with pytest.raises(st.PinError, match="cudaErrorMemoryAllocation") as info:
        reg.register(0x10000, PAGE)
    assert not isinstance(info.value, st.CudaUnavailableError)
    reg._cudart = FakeCudart(0)
    reg.register(0x10000, PAGE)


def test_record_refs_batches_travel_by_name() -> None:
    lst = shmstore.SharedList([{"x": np.full(1000, i, np.float32), "y": i} for i in range(50)])
    ds = st.RecordRefs(lst)
    assert len(ds) == 50 and ds[-1][1] == 49
    with pytest.raises(IndexError):
        ds[50]
    batch = st.collate_refs(ds.__getitems__([3, 7, 9]))
    data = pickle.dumps(batch)
    assert len(data) < 1024  # the records' 12 KB are not in it
    back = pickle.loads(data)
    assert [r["y"] for r in back.records()] == [3, 7, 9]
    assert len(back) == 3
    with pytest.raises(ValueError):
        st.collate_refs([])
    lst.unlink()


# --- the real thing -------------------------------------------------------------------------


def _cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def test_cuda_pin_and_copy() -> None:
    torch = _cuda()
    old = st.set_registrar(None)
    ref = shmstore.put(np.arange(16 << 20, dtype=np.float32), arena=False)
    try:
        a = ref.get()
        with st.pin(ref) as p:
            host = p._host_tensor(a)
            assert host.is_pinned()
            out = p.to_device(a, "cuda")
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), torch.arange(16 << 20, dtype=torch.float32))
            stacked = p.to_device([a[:1000], a[1000:2000]])
            assert stacked.shape == (2, 1000) and stacked[1, 0].item() == 1000.0
    finally:
        st.set_registrar(old)
        ref.unlink()


def test_cuda_records_through_a_dataloader() -> None:
    torch = _cuda()
    from torch.utils.data import DataLoader

    lst = shmstore.SharedList([{"x": np.full(256, i, np.float32), "y": i} for i in range(64)])
    try:
        with st.pin(lst) as p:
            loader = DataLoader(
                st.RecordRefs(lst), batch_size=16, num_workers=2, collate_fn=st.collate_refs
            )
            seen = 0
            for refs in loader:
                batch = p.to_device(refs.records(), "cuda")
                assert torch.equal(batch["x"][:, 0].long(), batch["y"])
                seen += len(refs)
            assert seen == 64
    finally:
        lst.unlink()


def test_file_broadcast_waits_past_a_stale_path(tmp_path: Any) -> None:
    """A rendezvous file left by an earlier run names a store that is gone: the waiting ranks
    do not read it, and take the one this run's rank 0 writes over it."""
    import threading

    path = tmp_path / "rendezvous"
    earlier = shmstore.SharedList([0])
    st.file_broadcast(path)(st._payload(earlier))  # an earlier run's rank 0
    gone = earlier.path
    earlier.close()
    # What the supervisor does once that run ended (it may already have: close() told it
    # the last user went).
    Path(gone).unlink(missing_ok=True)
    assert not Path(gone).exists()
    with pytest.raises(TimeoutError, match="no longer exists"):
        st.file_broadcast(path, timeout=0.05, poll=0.01)(None)

    current = shmstore.SharedList([1, 2, 3])
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(st.file_broadcast(path)(None)))
    waiter.start()
    st.file_broadcast(path)(st._payload(current))  # this run's rank 0
    waiter.join(timeout=60)
    assert got == [st._payload(current)]
    assert list(st._from_payload(got[0])) == [1, 2, 3]
