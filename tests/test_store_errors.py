"""Errors: unsupported values (with their path), cycles, depth, failing input, duplicate keys,
missing and corrupt stores (fuzzed in a subprocess), full /dev/shm. Nothing may be left
behind in /dev/shm after any error."""

from __future__ import annotations

import datetime
import decimal
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import shmstore
from conftest import make_records, mounted_tmpfs, segment_dir

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


class Foo:
    pass


def shm_files() -> set[str]:
    """Segment files in this test's own segment directory."""
    return {p.name for p in segment_dir().iterdir() if p.name.startswith("shmstore-")}


@pytest.fixture
def private_shm(monkeypatch):
    """This test's own segment directory (every test has one, see conftest.py), with the
    disk fallback off: before/after comparisons of its files see only what the test made."""
    monkeypatch.setenv("SHMSTORE_FALLBACK", "0")
    return segment_dir()


# --- unsupported values ----------------------------------------------------------------------


def test_unsupported_type_message_has_the_documented_path(records):
    records[12]["annotations"][3:] = [{"id": 1}] * 3
    records[12]["annotations"][3]["mask"] = Foo()
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.SharedList(records)
    assert isinstance(e.value, TypeError) and isinstance(e.value, shmstore.ShmStoreError)
    assert str(e.value).startswith(f"records[12]['annotations'][3]['mask']: cannot store {Foo}")


def test_unsupported_type_paths_in_dicts_tuples_and_put():
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.SharedDict({"img-7": {"anns": ({"a": 1}, {"b": [0, Foo()]})}})
    assert "['img-7']['anns'][1]['b'][1]" in str(e.value)
    assert str(Foo) in str(e.value)
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.put({"x": [1, {2: {b"k": Foo()}}]})
    assert "['x'][1][2][b'k']" in str(e.value)
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.SharedDict([("a", 1), (7, [Foo()])])
    assert "[7][0]" in str(e.value)


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {1, 2},
        frozenset([1]),
        len,
        Foo,
        decimal.Decimal("1.5"),
        datetime.date(2024, 1, 1),
        "lone \ud800 surrogate",
        np.array([1, None], dtype=object),
        np.array(["a", "b"]),
        np.array([b"a"]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8")]),
        np.datetime64("2024-01-01"),
        range(3),
    ],
    ids=lambda v: type(v).__name__ + (f"[{v.dtype}]" if isinstance(v, np.ndarray) else ""),
)
def test_unsupported_values_are_rejected(value):
    for build in (
        lambda: shmstore.SharedList([0, {"deep": [value]}]),
        lambda: shmstore.SharedDict({"k": value}),
        lambda: shmstore.put(value),
    ):
        with pytest.raises(shmstore.UnsupportedTypeError) as e:
            build()
        assert "cannot store" in str(e.value)


def test_object_array_message_names_dtype_and_path():
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.SharedList([{"m": np.array([{}, []], dtype=object)}])
    msg = str(e.value)
    assert msg.startswith("records[0]['m']: cannot store <class 'numpy.ndarray'>")
    assert "dtype('O')" in msg or "object" in msg


def test_masked_array_is_rejected_with_its_path():
    """A masked array cannot be stored faithfully (the mask would be lost): a clear
    UnsupportedTypeError with the path, not numpy's internal error."""
    masked = np.ma.array([1, 2, 3], mask=[0, 1, 0])
    with pytest.raises(shmstore.UnsupportedTypeError) as e:
        shmstore.SharedList([{"m": masked}])
    assert str(e.value).startswith("records[0]['m']: cannot store")
    assert "MaskedArray" in str(e.value)


@pytest.mark.parametrize(
    "key",
    [[1], {"a": 1}, Foo(), (1, [2]), frozenset([1]), 1 + 2j],
    ids=lambda k: type(k).__name__,
)
def test_unsupported_dict_keys(key):
    with pytest.raises((shmstore.UnsupportedTypeError, TypeError)):
        shmstore.SharedDict([(key, 1)])
    if isinstance(key, (Foo, frozenset, complex)):  # hashable, so it can be a key of a dict value
        with pytest.raises(shmstore.UnsupportedTypeError) as e:
            shmstore.put({"ok": 1, key: 2})
        assert "key" in str(e.value)


# --- cycles and depth ----------------------------------------------------------------------------


def _cycles():
    a: list = []
    a.append(a)
    d: dict = {}
    d["self"] = d
    b: list = [1]
    t = (b,)
    b.append(t)  # list -> tuple -> list
    x: dict = {"l": []}
    x["l"].append({"up": x})  # dict -> list -> dict -> dict
    return {"list": a, "dict": d, "via_tuple": b, "deep": x}


@pytest.mark.parametrize("which", list(_cycles()))
def test_self_referencing_input_is_a_clear_error(which):
    value = _cycles()[which]
    for build in (
        lambda: shmstore.SharedList([1, value]),
        lambda: shmstore.SharedDict({"k": value}),
        lambda: shmstore.put(value),
    ):
        with pytest.raises(shmstore.ShmStoreError) as e:
            build()
        assert isinstance(e.value, ValueError)
        assert re.search(r"contains itself|cycle", str(e.value)), str(e.value)


def test_shared_subobjects_are_not_cycles():
    shared = [1, {"a": 2}]
    value = [shared, shared, {"x": shared, "y": (shared, shared)}]
    with shmstore.put(value) as r:
        assert r.get() == value
    with shmstore.SharedList([shared] * 100) as lst:
        assert lst.to_python() == [shared] * 100


def _nest(depth: int, kind: str):
    v: object = 0
    for i in range(depth):
        v = {"list": lambda v: [v], "dict": lambda v: {"k": v}, "tuple": lambda v: (v,)}[
            kind if kind != "mixed" else ("list", "dict", "tuple")[i % 3]
        ](v)
    return v


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
def test_nesting_up_to_100_levels_works(kind):
    value = _nest(100, kind)
    with shmstore.put(value) as r, shmstore.SharedList([value]) as lst:
        assert r.get().to_python() == value
        assert lst[0] == value
        assert repr(r.get())
        v = r.get()  # walk down lazily to the leaf
        for _ in range(100):
            v = v["k"] if isinstance(v, shmstore.DictView) else v[0]
        assert v == 0


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
@pytest.mark.parametrize("depth", [101, 102, 10_000])
def test_nesting_deeper_than_100_is_a_clear_error(kind, depth):
    value = _nest(depth, kind)
    for build in (lambda: shmstore.put(value), lambda: shmstore.SharedList([value])):
        with pytest.raises(shmstore.ShmStoreError) as e:
            build()
        assert isinstance(e.value, ValueError)
        assert "100" in str(e.value) and "deep" in str(e.value)


# --- failing input ----------------------------------------------------------------------------


class Boom(Exception):
    pass


def test_generator_raising_mid_build_propagates_and_leaves_nothing(private_shm):
    seen_partial = []

    def gen():
        yield {"a": 1}
        yield np.ones(4 << 20, dtype=np.uint8)  # 4 MiB written before the failure
        seen_partial.append(sorted(n for n in shm_files() if ".part-" in n))
        yield {"b": 2}
        raise Boom("from the generator")

    before = shm_files()
    with pytest.raises(Boom, match="from the generator"):
        shmstore.SharedList(gen())
    assert seen_partial and seen_partial[0], "the store is not streamed into /dev/shm"
    assert shm_files() == before  # no sealed or *.part-* file left


def test_pairs_generator_raising_mid_build(private_shm):
    err = Boom("pairs")

    def pairs():
        yield "a", b"x" * 200_000
        raise err

    before = shm_files()
    with pytest.raises(Boom) as e:
        shmstore.SharedDict(pairs())
    assert e.value is err
    assert shm_files() == before


def test_mapping_whose_items_fail(private_shm):
    class BadMapping(dict):
        def items(self):
            yield "a", 1
            raise Boom("items")

    before = shm_files()
    with pytest.raises(Boom):
        shmstore.SharedDict(BadMapping(a=1))
    assert shm_files() == before


@pytest.mark.parametrize(
    "build",
    [
        lambda: shmstore.SharedList([np.ones(1 << 20), {"x": Foo()}]),
        lambda: shmstore.SharedDict({"a": np.ones(1 << 20), "b": [Foo()]}),
        lambda: shmstore.put([np.ones(1 << 20), b"y" * 100_000, Foo()]),
        lambda: shmstore.SharedDict([("a", 1), ("a", 2)]),
        lambda: shmstore.SharedList([[1], _cycles()["list"]]),
    ],
    ids=["list", "dict", "put", "duplicate_key", "cycle"],
)
def test_failed_builds_leave_nothing(build, private_shm):
    before = shm_files()
    with pytest.raises(shmstore.ShmStoreError):
        build()
    assert shm_files() == before


def test_user_named_store_failing_leaves_the_name_free():
    name = f"test-failing-{os.getpid()}"
    with pytest.raises(shmstore.UnsupportedTypeError):
        shmstore.SharedList([Foo()], name=name)
    assert not (segment_dir() / f"shmstore-{name}").exists()
    with shmstore.SharedList([1], name=name) as s:  # the name can be used now
        assert s[0] == 1


# --- duplicate keys and bad pairs ---------------------------------------------------------


@pytest.mark.parametrize(
    "pairs",
    [
        [("k", 1), ("k", 2)],
        [("a", 0), (1, 1), ("b", 2), (True, 3)],
        [(2, 1), (2.0, 2)],
        [((1, "x"), 1), ((1.0, "x"), 2)],
        [(b"b", 1), (b"b", 2)],
        [(None, 1), (None, 2)],
        [(2**80, 1), (2**80, 2)],
    ],
    ids=["str", "int_bool", "int_float", "tuple", "bytes", "none", "bigint"],
)
def test_duplicate_keys_in_pairs(pairs):
    with pytest.raises(shmstore.InvalidInputError) as e:
        shmstore.SharedDict(pairs)
    assert isinstance(e.value, ValueError)
    assert "duplicate key" in str(e.value)
    with pytest.raises(shmstore.InvalidInputError):
        shmstore.SharedDict(iter(pairs))


def test_dict_input_keeps_the_last_value():
    with shmstore.SharedDict({"k": 1, **{"k": 2}}) as d:
        assert d.to_python() == {"k": 2}


@pytest.mark.parametrize("bad", [[("a",)], [("a", 1, 2)], [5], ["ab"]], ids=repr)
def test_malformed_pairs(bad):
    with pytest.raises((shmstore.InvalidInputError, TypeError, ValueError)):
        shmstore.SharedDict(bad)


def test_non_iterable_input():
    with pytest.raises(TypeError):
        shmstore.SharedList(5)
    with pytest.raises(TypeError):
        shmstore.SharedDict(5)


# --- missing stores -------------------------------------------------------------------------------


def test_store_not_found_names_the_store():
    for cls in (shmstore.SharedList, shmstore.SharedDict, shmstore.Ref):
        with pytest.raises(shmstore.StoreNotFoundError) as e:
            cls.attach("definitely-missing-store")
        assert isinstance(e.value, FileNotFoundError)
        assert isinstance(e.value, shmstore.ShmStoreError)
        assert "shmstore-definitely-missing-store" in str(e.value)


def test_unlinked_store_is_not_found():
    s = shmstore.SharedList([1])
    name = s.name
    s.unlink()
    with pytest.raises(shmstore.StoreNotFoundError, match=name):
        shmstore.SharedList.attach(name)


# --- corruption ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, records):
    """A saved SharedList archive (path, bytes)."""
    path = tmp_path / "orig.shmstore"
    with shmstore.SharedList(records) as s:
        s.save(path)
    return path, path.read_bytes()


def _write(tmp_path: Path, data: bytes, name="corrupt.shmstore") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("cut", [0, 1, 8, 64, 127, 128, 129, -1, -8, "half"])
def test_truncated_archives_are_corrupt(saved, tmp_path, cut):
    _, data = saved
    n = len(data) // 2 if cut == "half" else cut if cut >= 0 else len(data) + cut
    p = _write(tmp_path, data[:n])
    with pytest.raises(shmstore.CorruptStoreError) as e:
        shmstore.SharedList.open(p)
    assert isinstance(e.value, ValueError)
    assert str(p) in str(e.value)


def test_extended_archive_is_corrupt(saved, tmp_path):
    _, data = saved
    with pytest.raises(shmstore.CorruptStoreError):
        shmstore.SharedList.open(_write(tmp_path, data + b"\0" * 8))


@pytest.mark.parametrize(
    ("offset", "value"),
    [
        (0, b"X"),  # magic
        (7, b"\x01"),  # magic of a store still being written
        (8, b"\x02"),  # version
        (10, b"\x09"),  # kind
        (12, b"\x40"),  # header length
        (16, b"\x01"),  # total length
        (24, b"\x07"),  # count
        (32, b"\x00"),  # index offset
        (40, b"\x00"),  # symbols offset
        (104, b"\x01"),  # reserved
        (120, b"\x00"),  # checksum
    ],
)
def test_corrupt_header_fields(saved, tmp_path, offset, value):
    _, data = saved
    b = bytearray(data)
    if b[offset : offset + 1] == value:
        value = bytes([value[0] ^ 0xFF])
    b[offset : offset + 1] = value
    with pytest.raises(shmstore.CorruptStoreError):
        s = shmstore.SharedList.open(_write(tmp_path, bytes(b)))
        s.verify()


def test_all_zero_and_random_files_are_corrupt(saved, tmp_path):
    _, data = saved
    for content in (b"\0" * len(data), os.urandom(len(data)), b"SHMSTOR\0" + b"\xff" * 500):
        with pytest.raises(shmstore.CorruptStoreError):
            shmstore.SharedList.open(_write(tmp_path, content))


def test_corrupt_record_fails_on_access_not_before(tmp_path):
    """Records are checked lazily, a block of records at a time (docs/format.md,
    "Integrity"): a corrupt record raises when it or a record of its block is read; the
    records of other blocks read fine."""
    records = make_records(400)
    path = tmp_path / "orig.shmstore"
    with shmstore.SharedList(records) as s:
        s.save(path)
    data = path.read_bytes()
    # The bytes of record 10's file_name string are inside its span.
    needle = records[10]["file_name"].encode()
    assert data.count(needle) == 1
    pos = data.index(needle)
    b = bytearray(data)
    b[pos] ^= 0x01
    s = shmstore.SharedList.open(_write(tmp_path, bytes(b)))
    assert s[399] == records[399] and s[200] == records[200]
    for _ in range(2):  # and stays corrupt
        with pytest.raises(shmstore.CorruptStoreError) as e:
            s[10]
        assert "10" in str(e.value)
    with pytest.raises(shmstore.CorruptStoreError):
        s[11]
    with pytest.raises(shmstore.CorruptStoreError):
        s.verify()
    with pytest.raises(shmstore.CorruptStoreError):
        s.to_python()
    with pytest.raises(shmstore.CorruptStoreError):
        list(s)


def test_corrupt_segment_in_shared_memory(saved):
    """The same checks apply to a segment attached by name."""
    _, data = saved
    name = f"shmstore-test-corrupt-{os.getpid()}"
    path = segment_dir() / name
    try:
        for mutate in (
            lambda b: b[: len(b) // 2],
            lambda b: b[:60],
            lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:],
            lambda b: b[:-40] + bytes([b[-40] ^ 0x10]) + b[-39:],
        ):
            # Held open from creation until checked, as a writer would: an unregistered file
            # that nobody holds is an orphan, and a supervisor's sweep may remove it any time.
            with open(path, "wb") as held:
                held.write(mutate(data))
                held.flush()
                os.chmod(path, 0o400)
                with pytest.raises(shmstore.CorruptStoreError) as e:
                    s = shmstore.SharedList.attach(name)
                    s.verify()
            assert name in str(e.value)
            path.unlink(missing_ok=True)  # the supervisor may have removed the orphan
    finally:
        path.unlink(missing_ok=True)


FUZZ_SCRIPT = r"""
import json, os, random, sys
import numpy as np
import shmstore

workdir, seed, rounds, checksums = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)

def record(i):
    return {
        "file_name": f"{i:012d}.jpg", "height": 400 + i, "id": i, "big": -(2**70) - i,
        "t": (i, "x", None, True, 1.5, b"by"), "f": -0.0 if i % 2 else float("inf"),
        "anns": [{"bbox": [1.0, 2.0, 3.0, float(i)], "category_id": i % 7,
                  "mask": np.arange(i % 5 + 1, dtype=">i2").reshape(-1, 1)}
                 for _ in range(i % 3 + 1)],
        "indexed": {j: [j] for j in range(10)}, (1, 2.5): {None: i},
        "blob": b"z" * (70_000 if i == 3 else 5),
    }

def plain(v):
    if isinstance(v, (shmstore.ListView, shmstore.DictView)):
        v = v.to_python()
    return repr(v)  # arrays, nested containers: compare by repr

def walk(v, depth=0):
    # Read through the lazy interface too (not only to_python).
    if isinstance(v, shmstore.DictView):
        for k in v:
            _ = k in v
            walk(v[k], depth + 1)
        repr(v)
    elif isinstance(v, shmstore.ListView):
        for x in v:
            walk(x, depth + 1)
        repr(v)
    elif isinstance(v, np.ndarray):
        v.tobytes()

def build(kind, path):
    recs = [record(i) for i in range(12)]
    if kind == "list":
        store, keys = shmstore.SharedList(recs), list(range(12))
    elif kind == "dict":
        keys = [f"key-{i}" for i in range(12)]
        store = shmstore.SharedDict(dict(zip(keys, recs)))
    else:
        store, keys = shmstore.put(recs), [None]
    with store:
        store.save(path)
        expected = {k: plain(store[k] if k is not None else store.get()) for k in keys}
    return keys, expected

cls = {"list": shmstore.SharedList, "dict": shmstore.SharedDict, "ref": shmstore.Ref}
counts = {"open_corrupt": 0, "record_corrupt": 0, "intact": 0, "cases": 0}
for kind in ("list", "dict", "ref"):
    path = os.path.join(workdir, f"orig-{kind}")
    keys, expected = build(kind, path)
    orig = open(path, "rb").read()
    for r in range(rounds):
        b = bytearray(orig)
        how = rng.random()
        if how < 0.15:
            b = b[: rng.randrange(0, len(b))]
        elif how < 0.2:
            start, n = rng.randrange(len(b)), rng.randrange(1, 64)
            b[start:start + n] = bytes(len(b[start:start + n]))
        else:
            # Half the hits in the first 4 KiB (header, records), the rest anywhere.
            hi = len(b) if rng.random() < 0.5 else min(len(b), 4096)
            for _ in range(rng.choice([1, 1, 1, 2, 3, 8, 32])):
                i = rng.randrange(hi)
                if rng.random() < 0.5:
                    b[i] ^= 1 << rng.randrange(8)
                else:
                    b[i] = rng.randrange(256)
        case = f"{kind} round {r} (seed {seed})"
        p = os.path.join(workdir, "case")
        with open(p, "wb") as f:
            f.write(b)
        counts["cases"] += 1
        try:
            s = cls[kind].open(p)
        except shmstore.CorruptStoreError:
            counts["open_corrupt"] += 1
            os.unlink(p)
            continue
        except Exception as e:
            print(f"FAIL {case}: open raised {type(e).__name__}: {e}"); sys.exit(1)
        for k in keys:
            try:
                if kind == "dict":
                    if k not in s:
                        print(f"FAIL {case}: key {k!r} vanished without CorruptStoreError")
                        sys.exit(1)
                v = s.get() if kind == "ref" else s[k]
                walk(v)
                got = plain(v)
            except shmstore.CorruptStoreError:
                counts["record_corrupt"] += 1
                continue
            except Exception as e:
                print(f"FAIL {case}: record {k!r} raised {type(e).__name__}: {e}"); sys.exit(1)
            if got != expected[k]:
                # Only array data may differ unnoticed by reads (it is mapped, not copied or
                # hashed, on the read path: docs/format.md, "Integrity"); verify() finds it.
                try:
                    s.verify()
                except shmstore.CorruptStoreError:
                    counts["record_corrupt"] += 1
                    continue
                print(f"FAIL {case}: record {k!r} read back wrong and verify() passed")
                sys.exit(1)
            counts["intact"] += 1
        try:
            s.verify()
        except shmstore.CorruptStoreError:
            pass
        s.close()
        os.unlink(p)
print(json.dumps(counts))
"""


def _run_fuzz(tmp_path: Path, seed: int, rounds: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ_SCRIPT, str(tmp_path), str(seed), str(rounds), "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"fuzzer died with return code {proc.returncode} "
        f"({'signal ' + str(-proc.returncode) if proc.returncode < 0 else 'error'})\n"
        f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [1, 2])
def test_random_corruptions_and_truncations_never_crash(tmp_path, seed):
    """Thousands of random byte changes and truncations of saved archives (list, dict and
    object kinds): every access raises CorruptStoreError or returns the right value."""
    counts = _run_fuzz(tmp_path, seed, rounds=700)
    assert counts["cases"] == 3 * 700
    assert counts["open_corrupt"] > 100 and counts["record_corrupt"] > 100, counts
    assert counts["intact"] > 0, counts


BYPASS_SCRIPT = r"""
import os, random, re, struct, sys
import numpy as np
import shmstore, xxhash

failures = {}  # (what, exception type, message without numbers) -> first case

def fail(case, what, e):
    key = (what, type(e).__name__, re.sub(r"[0-9]+", "N", str(e).split(": ", 1)[-1])[:80])
    failures.setdefault(key, f"{case}: {what} raised {type(e).__name__}: {e}")

workdir, seed, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)

recs = {f"key{i}": {"file_name": f"img{i}.jpg", "h": 480 + i, "big": -(2**70) - i,
        "t": (i, "x", None, True, 1.5, b"by"),
        "anns": [{"bbox": [1.0, 2.0, 3.0, float(i)], "mask": np.arange(i + 3, dtype=">i2"),
                  "cat": i % 5} for _ in range(i % 3 + 1)],
        "many": {j: [j] for j in range(12)}, (1, 2.5): {None: 1},
        "blob": b"z" * (70000 if i == 2 else 3)} for i in range(6)}
recs[7] = "seven"

def reseal(b, index_off, count):
    # Recompute every record checksum and the header checksum: the corruption then gets
    # past the checksums, and the structural validation must catch it.
    for r in range(count):
        s, e = struct.unpack_from("<QQ", b, index_off + 24 * r)
        if s <= e <= len(b):
            h = xxhash.xxh3_64_intdigest(bytes(b[s:e]))
            struct.pack_into("<Q", b, index_off + 24 * r + 16, h)
    (io,) = struct.unpack_from("<Q", b, 32)
    if io <= len(b):
        struct.pack_into("<Q", b, 120, xxhash.xxh3_64_intdigest(bytes(b[:120]) + bytes(b[io:])))

def walk(v):
    if isinstance(v, shmstore.DictView):
        for k in list(v):
            _ = k in v
            v.get(k)
            walk(v[k])
        v.to_python(); repr(v)
    elif isinstance(v, shmstore.ListView):
        for x in v:
            walk(x)
        v.to_python(); repr(v)
    elif isinstance(v, np.ndarray):
        v.tobytes()

def access_all(s, kind, case, keys):
    for k in keys:
        try:
            if kind == "dict":
                _ = k in s
                if s.get(k) is None:
                    continue
            walk(s.get() if kind == "ref" else s[k])
        except (shmstore.CorruptStoreError, KeyError):
            pass
        except Exception as e:
            fail(case, "reading a record", e)
    checks = [("verify()", s.verify)]
    if kind != "ref":
        checks += [("to_python()", s.to_python), ("iteration", lambda: list(s))]
    for what, f in checks:
        try:
            f()
        except shmstore.CorruptStoreError:
            pass
        except Exception as e:
            fail(case, what, e)

# 1. Every single-byte substitution (tag values and neighbours) in the records of a small
#    object: e.g. a list tag turned into a tuple tag (same layout, another type).
small = {"k": [1, (2, "s")], (1, 2.5): {None: b"b"}, "n": -(2**70), "f": 1.5,
         "arr": np.arange(3, dtype=">i2"), "d": {i: i for i in range(9)}}
p = os.path.join(workdir, "small")
with shmstore.put(small) as s:
    s.save(p)
orig = open(p, "rb").read()
index_off, count = struct.unpack_from("<QQ", orig, 32)[0], struct.unpack_from("<Q", orig, 24)[0]
for i in range(128, index_off):
    # Other tag values where the byte may be a tag (< 14 variants), else a few flips.
    small_values = set(range(14)) if orig[i] < 14 else {0}
    for v in sorted(small_values | {orig[i] ^ 1, orig[i] ^ 0x80, 0xFF}):
        if v == orig[i]:
            continue
        b = bytearray(orig)
        b[i] = v
        reseal(b, index_off, count)
        q = os.path.join(workdir, "case")
        open(q, "wb").write(b)
        try:
            s = shmstore.Ref.open(q)
        except shmstore.CorruptStoreError:
            continue
        access_all(s, "ref", f"byte {i} set to {v}", [None])
        s.close()

# 2. Random multi-byte changes in list and dict archives.
for kind in ("dict", "list"):
    p = os.path.join(workdir, "orig")
    cls = shmstore.SharedDict if kind == "dict" else shmstore.SharedList
    with cls(recs if kind == "dict" else list(recs.values())) as s:
        s.save(p)
    orig = open(p, "rb").read()
    index_off, count = struct.unpack_from("<QQ", orig, 32)[0], struct.unpack_from("<Q", orig, 24)[0]
    for r in range(rounds):
        b = bytearray(orig)
        lo, hi = (128, index_off) if rng.random() < 0.7 else (index_off, len(b))
        for _ in range(rng.choice([1, 1, 2, 3, 8])):
            i = rng.randrange(lo, hi)
            b[i] = rng.randrange(256) if rng.random() < 0.5 else b[i] ^ (1 << rng.randrange(8))
        reseal(b, index_off, count)
        q = os.path.join(workdir, "case")
        open(q, "wb").write(b)
        case = f"{kind} round {r} (seed {seed})"
        try:
            s = cls.open(q)
        except shmstore.CorruptStoreError:
            continue
        keys = list(recs) if kind == "dict" else range(len(recs))
        access_all(s, kind, case, keys)
        s.close()
for msg in failures.values():
    print("FAIL", msg)
print("ok" if not failures else f"{len(failures)} kinds of failure")
sys.exit(1 if failures else 0)
"""


def test_corruptions_past_the_checksums_never_crash(tmp_path):
    """Corruptions with recomputed checksums (what a checksum collision or a crafted file
    looks like): structural validation must turn them into CorruptStoreError, never a
    crash or another exception. Needs `xxhash` to recompute the checksums."""
    pytest.importorskip("xxhash", reason="xxhash recomputes the archive checksums")
    proc = subprocess.run(
        [sys.executable, "-c", BYPASS_SCRIPT, str(tmp_path), "7", "800"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"return code {proc.returncode}\nstdout: {proc.stdout[-3000:]}\n"
        f"stderr: {proc.stderr[-3000:]}"
    )


# --- out of shared memory -----------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """SHMSTORE_DIR on a fresh 4 MiB tmpfs (needs root to mount)."""
    with mounted_tmpfs(tmp_path, "4m", mode="1777") as mnt:
        monkeypatch.setenv("SHMSTORE_DIR", str(mnt))
        monkeypatch.setenv("SHMSTORE_FALLBACK", "0")  # no disk fallback (docs/lifecycle.md)
        yield mnt


def _sizes(msg: str) -> tuple[int, int]:
    """(needed, free) bytes from the message."""
    m = re.search(r"needs (?:at least )?(\d+) bytes.*?only (\d+) (?:are|is) ", msg)
    assert m, msg
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize(
    "build",
    [
        lambda: shmstore.put(np.zeros(8 << 20, dtype=np.uint8)),
        lambda: shmstore.put(b"x" * (8 << 20)),
        lambda: shmstore.SharedList(np.zeros(1 << 20, dtype=np.uint8) for _ in range(8)),
        lambda: shmstore.SharedList(b"x" * 100_000 for _ in range(80)),
        lambda: shmstore.SharedDict((str(i), np.ones(1 << 20)) for i in range(8)),
        lambda: shmstore.put([b"y" * 200_000 for _ in range(40)]),
        # Small values: written with the record's bytes, not as out-of-line payloads.
        lambda: shmstore.SharedList({"a": i, "b": "x" * 40} for i in range(100_000)),
        lambda: shmstore.SharedDict((str(i), {"v": i, "w": "y" * 40}) for i in range(100_000)),
        lambda: shmstore.SharedDict({str(i): i for i in range(200_000)}),
        lambda: shmstore.put([{"a": i, "b": "x" * 20} for i in range(300_000)]),
        lambda: shmstore.put(list(range(2**40, 2**40 + 1_000_000))),
    ],
    ids=[
        "put_array",
        "put_bytes",
        "list_arrays",
        "list_bytes",
        "dict_arrays",
        "put_list",
        "list_small_dicts",
        "dict_small_dicts",
        "dict_small_ints",
        "put_list_small_dicts",
        "put_list_small_ints",
    ],
)
def test_out_of_shared_memory(small_tmpfs, build):
    with pytest.raises(shmstore.OutOfSharedMemoryError) as e:
        build()
    assert isinstance(e.value, MemoryError) and isinstance(e.value, shmstore.ShmStoreError)
    msg = str(e.value)
    assert str(small_tmpfs) in msg
    needed, free = _sizes(msg)
    assert needed > free, f"message contradicts itself: {msg}"
    assert "SHMSTORE_DIR" in msg  # a hint
    assert list(small_tmpfs.iterdir()) == []  # nothing left behind
    # The space is free again: a small store fits.
    with shmstore.put(np.zeros(1000)) as r:
        assert (small_tmpfs / r.name).exists()
    assert list(small_tmpfs.iterdir()) == []


def test_save_to_a_full_filesystem_leaves_nothing(
    small_tmpfs, tmp_path, monkeypatch, _private_segment_dir
):
    monkeypatch.setenv("SHMSTORE_DIR", str(_private_segment_dir))  # the store fits there
    with shmstore.put(np.zeros(6 << 20, dtype=np.uint8)) as r:
        with pytest.raises((shmstore.ShmStoreError, OSError, MemoryError)):
            r.save(small_tmpfs / "big.shmstore")
    assert list(small_tmpfs.iterdir()) == []
