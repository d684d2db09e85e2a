"""One benchmark matrix: the acceptance targets of every benchmark, in one run, with the machine's
facts at the top, optionally with busy-loop processes running the whole time.

    python benchmarks/matrix.py [--quick] [--busy N] [--label L] [--out PATH] [--only a,b]

Parts (each the existing benchmark, run in its own process, its markdown kept whole):
- ``format``: bench_format.py, sections coco, first, irregular (views, ``lst[i]``, field touch
  in order and random, ``get_many(64)``);
- ``arrays``: bench_arrays.py, a 1 GiB put vs the plain fallocate + write() fill, and small
  put + pickled Ref vs ``multiprocessing.Queue`` at 1, 8, 64, 256 KiB and 1 MiB (the machine
  as it is: no kernel setting changed);
- ``channel``: a ping-pong between two processes (this file): 1 KiB, 64 KiB and a numpy
  8 MiB array, ``shmstore.Channel`` vs ``multiprocessing.Queue``, round trips;
- ``docstore``: bench_docstore.py (py-lmdb's baseline is skipped when lmdb is not installed).

``--busy N`` starts N busy-loop processes before the first part and stops them after the last
(also on an error or a signal). Progress goes to stderr with timestamps; the markdown to
``--out`` (default ``benchmarks/results/matrix-<label>.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
PARTS = ("format", "arrays", "channel", "docstore")


def log(msg: str) -> None:
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- busy loops ----------------------------------------------------------------------------------


class BusyLoops:
    """N processes each spinning on one core until stopped (and at most `limit_s`)."""

    def __init__(self, n: int, limit_s: float) -> None:
        self.n, self.limit_s = n, limit_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyLoops:
        code = (
            f"import time\nend = time.monotonic() + {self.limit_s}\n"
            "while time.monotonic() < end: pass\n"
        )
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", code]))
        if self.n:
            log(f"started {self.n} busy loops")
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        if self.procs:
            log(f"stopped {len(self.procs)} busy loops")
        self.procs = []


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


# --- machine facts -------------------------------------------------------------------------------


def procs_running() -> str:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                return line.split()[1]
    except OSError:
        pass
    return "?"


def machine_facts(args: argparse.Namespace) -> str:
    la = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        import shmstore
        from shmstore import _native

        version = getattr(shmstore, "__version__", "?")
        off = {k: v for k, v in _native._fast_paths().items() if v is not True}
        fast = "all on" if not off else "; ".join(f"{k}: {v}" for k, v in off.items())
    except Exception as e:  # reported, not fatal
        version, fast = f"not importable ({e})", "?"
    rows = [
        ("label", args.label),
        ("date", dt.datetime.now().isoformat(timespec="seconds")),
        ("CPU", _common._cpu_model()),
        ("cores (os.cpu_count / affinity)", f"{os.cpu_count()} / {len(os.sched_getaffinity(0))}"),
        ("load average before (1/5/15 min)", la),
        ("procs_running before", procs_running()),
        ("busy loops during the run", str(args.busy)),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("platform", platform.platform()),
        ("shmstore", version),
        ("fast paths (`_native._fast_paths()`)", fast),
        ("mode", "quick (small sizes: a smoke test)" if args.quick else "full"),
    ]
    return "| fact | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


# --- parts that run an existing benchmark --------------------------------------------------------


def run_bench(name: str, argv: list[str], timeout: float) -> str:
    """Run benchmarks/<name> with `argv` plus `--out <tmp>`; its markdown, or what failed."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.md"
        cmd = [sys.executable, str(HERE / name), *argv, "--out", str(out)]
        log(f"{name}: {' '.join(argv)}")
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return f"**{name} did not finish within {timeout:.0f} s.**\n"
        log(f"{name}: done in {time.monotonic() - t0:.0f} s (exit {r.returncode})")
        text = out.read_text() if out.exists() else ""
        if r.returncode == 1 and name == "bench_docstore.py" and text:
            # bench_docstore.py exits 1 when one of its targets fails: the table says which.
            text += "\n(bench_docstore.py: a target not met, see its table.)\n"
        elif r.returncode != 0:
            tail = "\n".join((r.stderr or "").splitlines()[-15:])
            text += f"\n**{name} failed (exit {r.returncode}):**\n\n```\n{tail}\n```\n"
        # Sub-benchmark headings one level down.
        return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


def part_format(args: argparse.Namespace) -> str:
    argv = ["--sections", "coco,first,irregular"]
    if args.quick:
        argv += ["--quick"]
    elif args.device:
        argv += [
            "--n",
            "50000",
            "--irregular-n",
            "20000",
            "--repeats",
            "3",
            "--micro-iter",
            "200000",
        ]
        argv += ["--first-repeats", "3"]
    return run_bench("bench_format.py", argv, timeout=args.part_timeout)


def part_arrays(args: argparse.Namespace) -> str:
    argv = ["--skip-held", "--skip-fragmentation", "--small-sizes", "1,8,64,256,1024"]
    if args.quick:
        argv += ["--sizes", "32", "--repeats", "2", "--small-n", "100"]
    elif args.device:
        argv += ["--sizes", "1024", "--repeats", "3", "--small-n", "400"]
    else:
        argv += ["--sizes", "1024"]
    return run_bench("bench_arrays.py", argv, timeout=args.part_timeout)


def part_docstore(args: argparse.Namespace) -> str:
    approaches = ["dict", "indexed", "shmstore", "shmstore-file"]
    if importlib.util.find_spec("lmdb") is not None:
        approaches.insert(2, "lmdb")
    else:
        log("docstore: py-lmdb is not installed: its baseline is skipped")
    argv = ["--approaches", ",".join(approaches)]
    if args.quick:
        argv += ["--docs", "5000", "--procs", "1,2", "--repeat", "1", "--first", "1000"]
    elif args.device:
        argv += ["--docs", "50000", "--procs", "1,4,8", "--repeat", "1", "--first", "10000"]
    text = run_bench("bench_docstore.py", argv, timeout=args.part_timeout)
    if "lmdb" not in approaches:
        text = "py-lmdb is not installed here: its column is missing.\n\n" + text
    return text


# --- the Channel ping-pong -----------------------------------------------------------------------


def _payload(kind: str) -> Any:
    import numpy as np

    if kind == "1 KiB":
        return np.zeros(1024, dtype=np.uint8)
    if kind == "64 KiB":
        return np.zeros(64 * 1024, dtype=np.uint8)
    return np.zeros(8 << 20, dtype=np.uint8)  # numpy 8 MiB


def _echo(inbox: Any, outbox: Any, n: int) -> None:
    for _ in range(n):
        outbox.put(inbox.get(timeout=600))


def ping_pong(how: str, kind: str, rounds: int) -> list[float]:
    """Seconds per round trip (one object there and back), over `rounds` after 3 warm-ups."""
    import multiprocessing as mp

    import shmstore

    ctx = mp.get_context("forkserver")
    if how == "Channel":
        a, b = shmstore.Channel(capacity=4), shmstore.Channel(capacity=4)
    else:
        a, b = ctx.Queue(), ctx.Queue()
    warm = 3
    p = ctx.Process(target=_echo, args=(a, b, rounds + warm))
    p.start()
    obj = _payload(kind)
    times = []
    try:
        for i in range(rounds + warm):
            t0 = time.perf_counter()
            a.put(obj)
            b.get(timeout=600)
            if i >= warm:
                times.append(time.perf_counter() - t0)
    finally:
        p.join(60)
        if p.exitcode is None:
            p.kill()
            p.join()
    return times


def part_channel(args: argparse.Namespace) -> str:
    rounds = {"1 KiB": 2000, "64 KiB": 1000, "numpy 8 MiB": 50}
    if args.quick:
        rounds = {"1 KiB": 100, "64 KiB": 50, "numpy 8 MiB": 5}
    elif args.device:
        rounds = {"1 KiB": 1000, "64 KiB": 500, "numpy 8 MiB": 30}
    rows = []
    for kind, n in rounds.items():
        res = {}
        for how in ("Channel", "Queue"):
            log(f"channel: {kind} {how}, {n} round trips")
            res[how] = statistics.median(ping_pong(how, kind, n))
        ratio = res["Channel"] / res["Queue"]
        rows.append(
            f"| {kind} | {res['Channel'] * 1e6:,.1f} µs | {res['Queue'] * 1e6:,.1f} µs | "
            f"{ratio:.2f}x | {1 / ratio:.2f}x |"
        )
    return (
        "## Channel ping-pong\n\n"
        "Two processes (forkserver) send one object back and forth; median round trip. "
        "Targets: 1 KiB Channel/Queue <= 1.0 with busy loops = 1.5x cores, <= 0.33 idle; "
        "64 KiB and numpy 8 MiB Queue/Channel >= 2 both ways.\n\n"
        "| object | Channel | multiprocessing.Queue | Channel / Queue | Queue / Channel |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test (~2-4 min)")
    ap.add_argument(
        "--device",
        action="store_true",
        help="sizes for a fixed time budget (benchmarks/device/matrix.sh: ~2.5 min per run)",
    )
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes during the run")
    ap.add_argument("--label", default="", help="names the output (default: host-busyN)")
    ap.add_argument("--out", type=Path, help="markdown out (default results/matrix-<label>.md)")
    ap.add_argument(
        "--only", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS)
    )
    ap.add_argument("--part-timeout", type=float, default=1800, help="seconds per part at most")
    args = ap.parse_args(argv)
    args.label = args.label or f"{platform.node()}-busy{args.busy}"
    out = args.out or HERE / "results" / f"matrix-{args.label}.md"
    parts = [p for p in args.only.split(",") if p]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r} (one of {', '.join(PARTS)})")
    runners = {
        "format": part_format,
        "arrays": part_arrays,
        "channel": part_channel,
        "docstore": part_docstore,
    }
    sections = [f"# Benchmark matrix: {args.label}\n", machine_facts(args), ""]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    t0 = time.monotonic()
    limit = args.part_timeout * len(parts) + 120
    with BusyLoops(args.busy, limit):
        for p in parts:
            log(f"part {p}")
            try:
                sections.append(runners[p](args))
            except Exception as e:  # one part failing keeps the others
                sections.append(f"## {p}\n\n**failed: {type(e).__name__}: {e}**\n")
    sections.append(
        "\nLoad average at the end (1/5/15 min): "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"; whole run {time.monotonic() - t0:.0f} s."
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(sections) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
