"""Structure-aware fuzzing of every Python read path (docs/security.md, "Fuzzing").

The cases come from the Rust generator (src/archive/fuzz.rs) through the testing hook
`_native._fuzz_case(seed)`: archives whose checksums are right but whose structure is
arbitrary (nesting far beyond the format's limit, anything in a key position, array shapes,
typestrs and extents, span ends near 2**64, symbols, keys, tables). Each is saved as a file
and read through everything a user can call; the only exception allowed is
CorruptStoreError. The cases run in a child process, so a crash (SIGSEGV, SIGBUS, a stack
overflow) fails the test and names the seed instead of killing pytest.

`SHMSTORE_FUZZ_CASES` / `SHMSTORE_FUZZ_SEED` change the run (`make fuzz` runs longer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shmstore import _native

pytestmark = pytest.mark.skipif(
    not hasattr(_native, "_fuzz_case"),
    reason="the fuzzer's testing hooks are not in this build of shmstore._native "
    "(cargo feature 'fuzzing': `make build` has it, wheels do not)",
)

CASES = int(os.environ.get("SHMSTORE_FUZZ_CASES", "20000"))
SEED = int(os.environ.get("SHMSTORE_FUZZ_SEED", "0"))

SCRIPT = r"""
import json, os, pickle, sys, threading
import numpy as np
import shmstore
from shmstore import _native

workdir, start, n, stack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# In a thread with a small stack, a deep value may raise RecursionError (never crash).
Corrupt = shmstore.CorruptStoreError
if stack < 1 << 20:
    Corrupt = (shmstore.CorruptStoreError, RecursionError)
classes = {"list": shmstore.SharedList, "dict": shmstore.SharedDict, "object": shmstore.Ref}
counts = {"cases": 0, "open_corrupt": 0, "read_corrupt": 0, "intact": 0, "reput": 0}

def eq(a, b):
    numpy_ok(lambda: (a == b, a != b))

# What numpy itself raises comparing containers that hold arrays (as with plain lists), or
# comparing an empty array with a dimension near 2**63, which numpy makes too
# (np.empty((0, 2**63 - 1), bool) == None).
NUMPY_ERRORS = ("truth value of an", "inconsistent axis mapping")

def numpy_ok(f):
    try:
        f()
    except ValueError as e:
        if not isinstance(e, Corrupt) and any(m in str(e) for m in NUMPY_ERRORS):
            return
        raise

def each(v):
    # Every read path of a value: iteration, lookups, slices, repr, ==, pickling, arrays.
    if isinstance(v, shmstore.DictView):
        for k in v:
            _ = k in v
            v.get(k)
            try:
                each(v[k])
            except KeyError:
                if "nan" not in repr(k):  # a NaN key is never equal to a fresh NaN
                    raise
        try:
            list(v.items()); list(v.values())
        except KeyError as e:
            if "nan" not in repr(e.args):
                raise
        len(v)
        repr(v); eq(v, v.to_python())
        pickle.loads(pickle.dumps(v))
    elif isinstance(v, shmstore.ListView):
        for x in v:
            each(x)
        list(reversed(v)); v[::-2]; v[-1:]
        numpy_ok(lambda: (v.count(None), None in v))
        repr(v); eq(v, v.to_python())
        pickle.loads(pickle.dumps(v))
    elif isinstance(v, np.ndarray):
        v.tobytes()[:16]; repr(v); v.shape; v.dtype

def read_all(h, kind, reput):
    if kind == "object":
        v = h.get()
        each(v)
        tops = [v]
    else:
        keys = list(h) if kind == "dict" else range(len(h))
        tops = []
        for k in keys:
            try:
                v = h[k]
            except KeyError:
                # Only a forged top-level table can hide a key (docs/security.md); inside
                # records a miss is confirmed against the index, so there it must not happen.
                assert kind == "dict", f"record {k} vanished"
                continue
            each(v)
            tops.append(v)
        repr(h); list(h)
        try:
            h.to_python()
            if kind == "dict":
                list(h.items()); eq(h, h.to_python())
        except KeyError:
            assert kind == "dict"  # as above: a forged top-level table
    h.verify()
    if reput:
        # Whatever reads back can be put again: the reader refuses what a writer cannot
        # make (docs/format.md, "Depth").
        for v in tops[:2]:
            with shmstore.put(v) as r:
                r.get()

def run():
    for seed in range(start, start + n):
        sys.stderr.write(f"case {seed}\n")  # the last line names the seed after a crash
        kind, data = _native._fuzz_case(seed)
        path = os.path.join(workdir, f"case-{seed % 2}")
        with open(path, "wb") as f:
            f.write(data)
        counts["cases"] += 1
        try:
            h = classes[kind].open(path)
        except Corrupt:
            counts["open_corrupt"] += 1
            continue
        except BaseException as e:
            print(f"FAIL seed {seed}: open raised {type(e).__name__}: {e}", flush=True)
            raise SystemExit(1)
        reput = seed % 25 == 0
        try:
            read_all(h, kind, reput)
            counts["intact"] += 1
            counts["reput"] += reput
        except Corrupt:
            counts["read_corrupt"] += 1
        except BaseException as e:
            print(f"FAIL seed {seed}: {type(e).__name__}: {e}", flush=True)
            raise SystemExit(1)
        finally:
            h.close()

# A worker thread with a small stack: depth limits must hold where recursion hurts first.
threading.stack_size(stack)
failed = []

def guarded():
    try:
        run()
    except BaseException as e:
        failed.append(e)

t = threading.Thread(target=guarded)
t.start()
t.join()
print(json.dumps(counts), flush=True)
sys.exit(1 if failed else 0)
"""


def _fuzz(tmp_path: Path, cases: int, stack: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["SHMSTORE_DIR"] = str(tmp_path)  # re-put stores: private, removed with tmp_path
    env["SHMSTORE_FALLBACK"] = "0"
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(SEED), str(cases), str(stack)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )


# The smallest thread stack the interpreter itself works in. CPython 3.14 keeps the last
# 32 KiB of a thread's stack for its own error handling, and in the 64 KiB above that it
# puts every object it frees on a list that is emptied only further up: a thread of 64 KiB
# frees nothing (every mapping of a store it closes stays), so there the test uses 128 KiB.
SMALL_STACK = (128 if sys.version_info >= (3, 14) else 64) * 1024


def test_fuzzed_archives_in_a_small_thread_stack_never_crash(tmp_path: Path) -> None:
    """The same cases in a thread of 64 KiB of stack (128 KiB on 3.14+, see SMALL_STACK;
    where plain Python's repr, == and pickle of a 100-deep list still work): deep values
    raise RecursionError or CorruptStoreError, never SIGSEGV."""
    proc = _fuzz(tmp_path, min(CASES, 2000), SMALL_STACK)
    assert proc.returncode == 0, (
        f"fuzzing died with return code {proc.returncode}\n"
        f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
    )


def test_fuzzed_archives_raise_only_corrupt_store_error(tmp_path: Path) -> None:
    """Zero crashes and zero exceptions but CorruptStoreError over `CASES` fuzz cases."""
    proc = _fuzz(tmp_path, CASES, 1 << 20)
    assert proc.returncode == 0, (
        f"fuzzing died with return code {proc.returncode}"
        f"{' (signal ' + str(-proc.returncode) + ')' if proc.returncode < 0 else ''}\n"
        f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
    )
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["cases"] == CASES
    assert counts["open_corrupt"] + counts["read_corrupt"] + counts["intact"] == CASES
    # Every outcome is reached, or the generator tests less than it claims.
    if CASES >= 1000:
        assert min(counts["open_corrupt"], counts["read_corrupt"], counts["intact"]) > CASES // 50
        assert counts["reput"] > 0
    print(f"fuzz: {counts}")
