"""Where a read's time goes on this machine: each read of the view benchmarks timed alone,
next to reads of the interpreter's own types that do the same kind of work, so that two
machines (or two interpreters on one machine) can be compared part by part.

    python benchmarks/probe_reads.py [--n 200000] [--repeat 9] [--out FILE.md]

Rows (ns per operation, the empty loop subtracted; median of `--repeat` runs of `--n`):

- the interpreter alone: `d["bbox"]` on a dict, `l[k]` on a list, `(k, k)` (a tuple made and
  freed: the allocator), `len(d)`;
- the extension's cheapest call: `len(view)` (through pyo3's trampoline);
- shmstore's fast paths: `ann["iscrowd"]` (a scalar: no object made), `ann["bbox"]` (a new
  view from the free list), `lst[k]`;
- the same two reads of a store held in private heap memory (`from_buffer(copy=True)`) rather
  than in a shared segment: if those are faster, the cost is in the segment's pages (page
  size, the virtual machine's page tables), not in the code.

Also prints the machine facts that bear on these costs: CPU, kernel, speculative-execution
mitigations, transparent huge pages, the interpreter's build (shared libpython or not, PGO).
Changes nothing on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import coco
import shmstore


def loop(src: str, env: dict[str, object], n: int) -> Callable[[], float]:
    code = (
        f"def run():\n    t0 = perf()\n    for _ in rng:\n        {src}\n    return perf() - t0\n"
    )
    ns: dict[str, object] = {"perf": time.perf_counter, "rng": range(n), **env}
    exec(code, ns)
    return ns["run"]  # type: ignore[return-value]


def libpython() -> str:
    """The libpython this process maps, or that the interpreter is one static executable."""
    with open("/proc/self/maps") as f:
        for ln in f:
            if "libpython" in ln:
                return ln.split()[-1]
    return "none mapped (a static interpreter)"


def speculation() -> list[str]:
    """This process's seccomp mode and speculation controls (a task that runs under seccomp,
    or asked for it, may have speculative store bypass disabled: every load that follows a
    store to the same place then waits for it)."""
    out = []
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("Seccomp:", "Speculation")):
                out.append("  " + " ".join(ln.split()))
    return out


def fast_paths_off() -> dict[str, object]:
    """The extension's fast paths that are off in this build and interpreter (and why)."""
    from shmstore import _native

    return {k: v for k, v in _native._fast_paths().items() if v is not True}


def machine() -> list[str]:
    facts = [
        f"python: {sys.version.split()[0]} ({sys.executable})",
        f"  libpython: {libpython()}",
        f"kernel: {platform.release()}; libc: {' '.join(platform.libc_ver())}",
        f"load: {' '.join(open('/proc/loadavg').read().split()[:3])}; cores: {os.cpu_count()}",
        "this process:",
        *speculation(),
        f"shmstore: {shmstore.__version__} from {os.path.dirname(shmstore.__file__)}, "
        f"fast paths off: {fast_paths_off() or 'none'}",
    ]
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
        facts.append(f"cpu: {model}")
    except (OSError, StopIteration):
        pass
    for p in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{p}") as f:
                facts.append(f"thp {p}: {f.read().strip()}")
        except OSError:
            pass
    vdir = "/sys/devices/system/cpu/vulnerabilities"
    try:
        for name in sorted(os.listdir(vdir)):
            with open(os.path.join(vdir, name)) as f:
                v = f.read().strip()
            if v != "Not affected":
                facts.append(f"vuln {name}: {v}")
    except OSError:
        pass
    return facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args()

    records = coco.make_records(200)
    k = 7
    lst = shmstore.SharedList(records)
    heap = shmstore.SharedList.from_buffer(bytes(lst.archive()), copy=True)
    ann = lst[k]["annotations"][0]
    hann = heap[k]["annotations"][0]
    d = records[k]["annotations"][0]
    plain = records
    env: dict[str, object] = {
        "lst": lst,
        "heap": heap,
        "ann": ann,
        "hann": hann,
        "d": d,
        "plain": plain,
        "k": k,
    }
    rows = [
        ("empty loop", "pass"),
        ('dict: d["bbox"]', 'd["bbox"]'),
        ("list: l[k]", "plain[k]"),
        ("tuple made and freed: (k, k)", "(k, k)"),
        ("len(dict)", "len(d)"),
        ("len(view) (pyo3 trampoline)", "len(ann)"),
        ('view scalar: ann["iscrowd"]', 'ann["iscrowd"]'),
        ('view: ann["bbox"]', 'ann["bbox"]'),
        ("lst[k]", "lst[k]"),
        ('heap store, view: ann["bbox"]', 'hann["bbox"]'),
        ("heap store, lst[k]", "heap[k]"),
    ]
    runs = {name: loop(src, env, a.n) for name, src in rows}
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(a.repeat):  # interleaved, so that a slow moment touches every row alike
        for name, _ in rows:
            times[name].append(runs[name]() / a.n * 1e9)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["empty loop"]
    lines = ["# Reads, part by part", "", "```", *machine(), "```", ""]
    lines += [f"n = {a.n:,}, median of {a.repeat}; ns per operation, the empty loop subtracted", ""]
    lines += ["| read | ns | spread (min-max) |", "|---|---|---|"]
    for name, _ in rows:
        lo, hi = min(times[name]), max(times[name])
        if name == "empty loop":
            lines.append(f"| {name} (not subtracted) | {base:.1f} | {lo:.1f}-{hi:.1f} |")
        else:
            lines.append(f"| {name} | {med[name] - base:.1f} | {lo - base:.1f}-{hi - base:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
