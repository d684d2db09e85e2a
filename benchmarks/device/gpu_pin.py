"""Shared arrays straight into VRAM: pageable vs ``pin_memory()`` vs ``shmstore.torch.pin``.

One short run on a CUDA machine (Python 3.12 with torch, numpy, psutil and the shmstore wheel;
no network), about a minute at the default sizes; prints a markdown report and writes it to
``--out``::

    python benchmarks/device/gpu_pin.py --out gpu-pin.md

Parts (medians of ``--reps`` runs after one warm-up, ``torch.cuda.synchronize()`` around each):

a. host->device copy of the pageable shared array (shmstore's array as a CPU tensor);
b. ``pin_memory()`` then the copy: time to pin, GB/s, the process's RSS/PSS and anonymous
   memory growth, and the machine's used memory growth;
c. ``shmstore.torch.pin`` of the store, then the copy: the same figures;
d. ``--procs`` processes (spawned) pin the same shared pages at once: each one's time;
e. a DataLoader epoch over a SharedList of arrays, ``--workers`` workers, the copy to the GPU
   in the loop: ``pin_memory=True`` vs ``RecordRefs`` + ``pin``; samples/s and the summed PSS
   of the process tree.

``--dry-run`` runs every part without CUDA (device "cpu", a fake registrar that pins
nothing) at whatever sizes are given: for checking the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np
import psutil
import shmstore
import shmstore.torch as st

GIB = 1 << 30


class FakeRegistrar:
    """--dry-run: touches the range like a registration would, pins nothing."""

    def register(self, address: int, nbytes: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass


def rollup(pid: int | str = "self") -> dict[str, int]:
    """Pss, Rss and Anonymous (bytes) of one process, from smaps_rollup."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Anonymous"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def tree_pss() -> int:
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    return sum(rollup(p.pid).get("Pss", 0) for p in procs)


def used() -> int:
    return psutil.virtual_memory().used


def sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], torch: Any, device: str) -> float:
    sync(torch, device)
    t = time.perf_counter()
    fn()
    sync(torch, device)
    return time.perf_counter() - t


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f}" if seconds > 0 else "-"


def mib(n: int) -> str:
    return f"{n / (1 << 20):+.0f} MiB"


def pageable_tensor(torch: Any, arr: np.ndarray) -> Any:
    with warnings.catch_warnings():  # read-only numpy array: torch warns, we only read it
        warnings.simplefilter("ignore")
        return torch.from_numpy(arr)


def pin_then_copy(
    label: str,
    pin: Callable[[], Any],
    copy: Callable[[Any], Any],
    release: Callable[[Any], None],
    reps: int,
    nbytes: int,
    torch: Any,
    device: str,
) -> tuple[float, float, tuple[str, str, str, str, str, str]]:
    """Median seconds to pin and to copy over `reps` rounds after a warm-up, and the table
    row: the process's RSS/PSS/anonymous and the machine's used memory grown by the pin."""
    pin_t, copy_t, mem = [], [], []
    for i in range(reps + 1):
        gc.collect()
        before, u0 = rollup(), used()
        t = time.perf_counter()
        box = [pin()]  # the only reference: `release` gets it, and may drop it first
        dt = time.perf_counter() - t
        after, u1 = rollup(), used()
        ct = timed(lambda b=box: copy(b[0]), torch, device)
        if i:
            pin_t.append(dt)
            copy_t.append(ct)
            grown = [after.get(k, 0) - before.get(k, 0) for k in ("Rss", "Pss", "Anonymous")]
            mem.append((*grown, u1 - u0))
        release(box.pop())
    tp, tc = median(pin_t), median(copy_t)
    m = mem[len(mem) // 2]
    row = (label, f"{tp:.3f}", gbs(nbytes, tc), f"{mib(m[0])} / {mib(m[1])}", mib(m[2]), mib(m[3]))
    return tp, tc, row


# --- d: several processes pin the same pages ---------------------------------------------


def _pin_child(name: str, dry: bool, barrier: Any, out: Any) -> None:
    import torch

    if dry:
        st.set_registrar(FakeRegistrar())
    else:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context, outside the timing
    ref = shmstore.Ref.attach(name)
    arr = ref.get()
    barrier.wait(timeout=120)
    t = time.perf_counter()
    try:
        p = st.pin(arr)
        dt = time.perf_counter() - t
        ok = True
        if not dry:
            tt = timed(lambda: p.to_device(arr, "cuda"), torch, "cuda")
            extra = f"{gbs(arr.nbytes, tt)} GB/s"
        else:
            extra = "-"
        p.close()
        out.put((os.getpid(), ok, dt, extra))
    except Exception as e:  # reported in the table
        out.put((os.getpid(), False, time.perf_counter() - t, repr(e)[:200]))


# --- e: DataLoader --------------------------------------------------------------------------


def _quiet_worker(_: int) -> None:
    warnings.simplefilter("ignore")


class TensorDataset:
    """The usual path: each record as a CPU tensor over the shared pages (zero-copy), stacked
    by the default collate into shared memory, copied by the pin thread into pinned memory."""

    def __init__(self, lst: Any) -> None:
        self.ds = st.SharedListDataset(lst)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(self.ds[i])


def epoch_rate(
    loader: Any, step: Callable[[Any], Any], n: int, torch: Any, device: str
) -> tuple[float, int]:
    """(samples/s, max tree PSS sampled during the epoch)."""
    peak = 0
    sync(torch, device)
    t = time.perf_counter()
    for i, batch in enumerate(loader):
        step(batch)
        if i % 8 == 4 or peak == 0:  # a short epoch still gets one sample
            peak = max(peak, tree_pss())
    sync(torch, device)
    dt = time.perf_counter() - t
    return n / dt, peak


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gib", type=float, default=2.0, help="the shared array (a-d)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4, help="processes pinning at once (d)")
    ap.add_argument("--dl-gib", type=float, default=1.0, help="DataLoader data set size (e)")
    ap.add_argument("--sample-kib", type=int, default=588, help="one sample (3x224x224 f32)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: check the script only")
    args = ap.parse_args()

    import torch

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script", file=sys.stderr)
        return 2
    if dry:
        st.set_registrar(FakeRegistrar())
    else:
        torch.empty(1, device="cuda")  # CUDA context before any measurement
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    n = int(args.size_gib * GIB) // 4
    nbytes = n * 4
    say("# Shared arrays straight into VRAM")
    say()
    gpu = "dry run (cpu, fake registrar)" if dry else torch.cuda.get_device_name()
    say(
        f"- device: {gpu}; torch {torch.__version__}; shmstore {shmstore.__version__}; "
        f"{os.cpu_count()} CPUs; Python {sys.version.split()[0]}"
    )
    say(
        f"- array: {nbytes / GIB:.2f} GiB float32 (`shmstore.put`); medians of {args.reps} "
        "runs after a warm-up"
    )
    say()

    t0 = time.perf_counter()
    src = np.arange(n, dtype=np.float32)
    ref = shmstore.put(src, arena=False)
    del src
    gc.collect()
    arr = ref.get()
    say(f"- store built in {time.perf_counter() - t0:.1f} s: `{ref.name}`")
    say()
    rows: list[tuple[str, str, str, str, str, str]] = []

    # a. pageable
    host = pageable_tensor(torch, arr)
    host.to(device)
    ts = [timed(lambda: host.to(device), torch, device) for _ in range(args.reps)]
    page_gbs = nbytes / median(ts)
    rows.append(("a. pageable shared array", "-", gbs(nbytes, median(ts)), "-", "-", "-"))

    # b. pin_memory()
    def pin_memory() -> Any:
        return host.pin_memory() if not dry else host.clone()

    def after_pin_memory(pinned: Any) -> None:
        del pinned
        # torch keeps freed pinned blocks for reuse (its caching host allocator): without
        # this, every pin_memory() after the first is a plain copy into the block the last
        # one left, not what a process or a DataLoader pays to pin its data.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None and not dry:
            empty_host_cache()

    tb_pin, tb_copy, row = pin_then_copy(
        "b. `pin_memory()` then copy",
        pin_memory,
        lambda pinned: pinned.to(device, non_blocking=True),
        after_pin_memory,
        args.reps,
        nbytes,
        torch,
        device,
    )
    rows.append(row)

    # c. shmstore pin
    tc_pin, tc_copy, row = pin_then_copy(
        "c. `shmstore.torch.pin` then copy",
        lambda: st.pin(ref),
        lambda p: p.to_device(arr, device),
        lambda p: p.close(),
        args.reps,
        nbytes,
        torch,
        device,
    )
    rows.append(row)
    say("## a-c. One array, host to device")
    say()
    say("| path | pin s | copy GB/s | RSS / PSS growth | anonymous growth | machine used growth |")
    say("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        say("| " + " | ".join(r) + " |")
    say()
    say(
        "Growth: while the pinned memory exists (RSS/PSS/anonymous of this process from "
        "smaps_rollup; machine: `psutil.virtual_memory().used`, which leaves out the shared "
        "pages themselves). shmstore's pin maps the whole store in (RSS and PSS grow by the "
        "shared pages, counted once per machine), and allocates nothing."
    )
    say()
    say(f"- pinned shared / `pin_memory()` copy speed: {tb_copy / tc_copy:.2f}x (target >= 0.9)")
    say(
        f"- pinned shared / pageable copy speed: {(nbytes / tc_copy) / page_gbs:.1f}x (target >= 5)"
    )
    say(f"- pin time, shmstore / `pin_memory()`: {tc_pin / tb_pin:.2f} (target <= 0.25)")
    say()

    # d. several processes
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs)
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_pin_child, args=(ref.name, dry, barrier, q)) for _ in range(args.procs)
    ]
    for pr in procs:
        pr.start()
    results = []
    for _ in procs:
        try:
            results.append(q.get(timeout=180))
        except Exception as e:
            results.append((0, False, 0.0, f"no answer: {e!r}"))
    for pr in procs:
        pr.join(30)
    say(f"## d. {args.procs} processes pin the same pages at once")
    say()
    say("| process | pinned | pin s | copy |")
    say("|---|---|---:|---:|")
    for pid, ok, dt, extra in results:
        say(f"| {pid} | {'yes' if ok else 'NO'} | {dt:.3f} | {extra} |")
    say()

    # e. DataLoader
    from torch.utils.data import DataLoader

    per = args.sample_kib * 1024 // 4
    count = max(args.batch, int(args.dl_gib * GIB) // (per * 4))
    t0 = time.perf_counter()
    lst = shmstore.SharedList(np.full(per, i % 251, np.float32) for i in range(count))
    build_s = time.perf_counter() - t0
    base_pss = tree_pss()
    common = dict(
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        worker_init_fn=_quiet_worker,
    )
    results_e = []
    torch.manual_seed(0)
    plain = DataLoader(TensorDataset(lst), pin_memory=not dry, **common)

    def plain_step(batch: Any) -> Any:
        return batch.to(device, non_blocking=True)

    ep = [epoch_rate(plain, plain_step, count, torch, device) for _ in range(args.reps + 1)][1:]
    results_e.append(
        ("`pin_memory=True`, default collate", median([r for r, _ in ep]), max(p for _, p in ep))
    )
    del plain
    gc.collect()
    with st.pin(lst) as p:
        refs = DataLoader(st.RecordRefs(lst), collate_fn=st.collate_refs, **common)

        def refs_step(batch: Any) -> Any:
            return p.to_device(batch.records(), device)

        ep = [epoch_rate(refs, refs_step, count, torch, device) for _ in range(args.reps + 1)][1:]
        results_e.append(
            (
                "`RecordRefs` + `shmstore.torch.pin`",
                median([r for r, _ in ep]),
                max(p_ for _, p_ in ep),
            )
        )
        del refs
    say(f"## e. DataLoader epoch, {args.workers} workers, copy to the GPU in the loop")
    say()
    say(
        f"{count} samples of {args.sample_kib} KiB float32 ({count * per * 4 / GIB:.2f} GiB, "
        f"SharedList built in {build_s:.1f} s), batch {args.batch}, shuffled; "
        f"process tree PSS before the loaders: {base_pss / GIB:.2f} GiB."
    )
    say()
    say("| loader | samples/s | peak tree PSS GiB |")
    say("|---|---:|---:|")
    for name, rate, peak in results_e:
        say(f"| {name} | {rate:,.0f} | {peak / GIB:.2f} |")
    say()
    (_, r0, p0), (_, r1, p1) = results_e
    say(f"- samples/s, shmstore / pin_memory=True: {r1 / r0:.2f}x (target >= 1.2)")
    say(f"- peak host memory, shmstore / pin_memory=True: {p1 / max(p0, 1):.2f} (target <= 1.05)")
    say()
    lst.unlink()
    ref.unlink()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
