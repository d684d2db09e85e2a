"""Round-trips of nested values through SharedList, SharedDict and put (hypothesis), and the
Sequence/Mapping behaviour of the views (docs/api.md)."""

from __future__ import annotations

import collections.abc as abc
import math
import pickle
import random
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import shmstore
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays, from_dtype

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

# --- strategies --------------------------------------------------------------------------

EDGE_INTS = [0, -1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -(2**64)]
INTS = st.integers() | st.integers(-(2**300), 2**300) | st.sampled_from(EDGE_INTS)
FLOATS = st.floats() | st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324])
TEXT = st.text() | st.sampled_from(["", "é", "日本語", "\U0001f600 emoji", "a\x00b", "x" * 200])
SMALL_BYTES = st.binary(max_size=64)
# Longer than 64 KiB: stored out of line (BYTES_OUT_OF_LINE in src/py/encode.rs).
BIG_BYTES = st.builds(
    lambda seed, n: random.Random(seed).randbytes(n),
    st.integers(0, 2**32),
    st.sampled_from([64 * 1024, 64 * 1024 + 1, 100_000, 300_001]),
)

ARRAY_DTYPES = [
    "?", "i1", "u1",
    "<i2", ">i2", "<i4", ">i4", "<i8", ">i8",
    "<u2", ">u2", "<u4", ">u4", "<u8", ">u8",
    "<f2", ">f2", "<f4", ">f4", "<f8", ">f8",
    "<c8", ">c8", "<c16", ">c16",
]  # fmt: skip

NON_CONTIGUOUS = [
    lambda a: a[::2],
    lambda a: a[::-1],
    lambda a: a.T,
    lambda a: a[..., 1::2],
]


def _transform(a: np.ndarray, which: int | None) -> np.ndarray:
    if which is None or a.ndim == 0:
        return a
    return NON_CONTIGUOUS[which](a)


ARRAYS = st.builds(
    _transform,
    arrays(
        dtype=st.sampled_from(ARRAY_DTYPES),
        shape=array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    st.none() | st.integers(0, len(NON_CONTIGUOUS) - 1),
)
NP_SCALARS = st.one_of([from_dtype(np.dtype(d)).map(np.dtype(d).type) for d in ARRAY_DTYPES])

KEY_SCALARS = (
    st.none()
    | st.booleans()
    | INTS
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
KEYS = st.recursive(KEY_SCALARS, lambda k: st.lists(k, max_size=3).map(tuple), max_leaves=5)

COMPLEX = st.complex_numbers() | st.sampled_from([complex(math.nan, -0.0), complex(-0.0, math.inf)])
PLAIN_SCALARS = st.none() | st.booleans() | INTS | FLOATS | COMPLEX | TEXT | SMALL_BYTES
SCALARS = PLAIN_SCALARS | BIG_BYTES | ARRAYS | NP_SCALARS


def containers(children):
    return (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=5).map(tuple)
        | st.dictionaries(KEYS, children, max_size=8)  # small dicts: linear scan
        | st.dictionaries(KEYS, children, min_size=9, max_size=11)  # indexed dicts
    )


VALUES = st.recursive(SCALARS, containers, max_leaves=15)
# Values for which Python's == is meaningful (no NaN, no arrays).
COMPARABLE = st.recursive(
    st.none()
    | st.booleans()
    | INTS
    | st.floats(allow_nan=False)
    | st.complex_numbers(allow_nan=False)
    | TEXT
    | SMALL_BYTES,
    containers,
    max_leaves=15,
)

# --- deep comparison ------------------------------------------------------------------------


def normalise(expected):
    """What shmstore gives back for an input value (numpy scalars become Python scalars,
    bytes-likes become bytes, non-contiguous arrays contiguous copies)."""
    if isinstance(expected, np.generic):
        return expected.item()
    if isinstance(expected, (bytearray, memoryview)):
        return bytes(expected)
    return expected


def assert_same(actual, expected, path="value"):
    """`actual` (plain, from to_python) equals `expected` with exact types: tuples stay
    tuples, bools stay bools, NaN and -0.0 survive, arrays keep dtype and shape."""
    expected = normalise(expected)
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: {type(actual)} is not an ndarray"
        assert actual.dtype == expected.dtype and actual.dtype.str == expected.dtype.str, path
        assert actual.shape == expected.shape, path
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), path
        assert not actual.flags.writeable, f"{path}: array is writeable"
        return
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, complex):
        assert_same(actual.real, expected.real, f"{path}.real")
        assert_same(actual.imag, expected.imag, f"{path}.imag")
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), path
        else:
            assert actual == expected, f"{path}: {actual!r} != {expected!r}"
            assert math.copysign(1, actual) == math.copysign(1, expected), f"{path}: sign"
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: len {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert len(actual) == len(expected), f"{path}: len"
        for (ak, av), (ek, ev) in zip(actual.items(), expected.items()):
            assert_same(ak, ek, f"{path}: key {ek!r}")
            assert_same(av, ev, f"{path}[{ek!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_view_same(view, expected, path="value"):
    """Walk a lazy result through the Sequence/Mapping interface (not to_python)."""
    expected = normalise(expected)
    if isinstance(expected, (list, tuple)):
        assert isinstance(view, shmstore.ListView), f"{path}: {type(view)}"
        assert isinstance(view, abc.Sequence)
        assert len(view) == len(expected)
        for i, e in enumerate(expected):
            assert_view_same(view[i], e, f"{path}[{i}]")
            assert_view_same(view[i - len(expected)], e, f"{path}[{i - len(expected)}]")
        for i, (v, e) in enumerate(zip(view, expected)):
            assert_view_same(v, e, f"{path} iter[{i}]")
        assert_same(view.to_python(), expected, path)
    elif isinstance(expected, dict):
        assert isinstance(view, shmstore.DictView), f"{path}: {type(view)}"
        assert isinstance(view, abc.Mapping)
        assert len(view) == len(expected)
        keys = list(view)
        assert len(keys) == len(expected)
        for k, ek in zip(keys, expected):
            assert_same(k, ek, f"{path} key")
        for ek, ev in expected.items():
            assert ek in view, f"{path}: {ek!r} not in view"
            assert_view_same(view[ek], ev, f"{path}[{ek!r}]")
            assert_view_same(view.get(ek), ev, f"{path}.get({ek!r})")
        assert_same(view.to_python(), expected, path)
    else:
        assert_same(view, expected, path)


def deep(x):
    return x.to_python() if isinstance(x, (shmstore.ListView, shmstore.DictView)) else x


# --- round-trips ----------------------------------------------------------------------------


@given(VALUES)
def test_put_roundtrip(value):
    with shmstore.put(value) as ref:
        got = ref.get()
        assert_same(deep(got), value)
        assert_view_same(got, value)


@given(st.lists(VALUES, max_size=6))
def test_shared_list_roundtrip(values):
    with shmstore.SharedList(values) as lst:
        assert len(lst) == len(values)
        assert_same(lst.to_python(), values)
        for i, v in enumerate(values):
            assert_view_same(lst[i], v, f"lst[{i}]")
            assert_same(deep(lst[i - len(values)]), v, f"lst[{i - len(values)}]")
        for i, (got, v) in enumerate(zip(lst, values)):
            assert_same(deep(got), v, f"iter[{i}]")


@given(st.dictionaries(KEYS, VALUES, max_size=8))
def test_shared_dict_roundtrip(mapping):
    with shmstore.SharedDict(mapping) as d:
        assert len(d) == len(mapping)
        assert_same(d.to_python(), mapping)
        assert_same(list(d), list(mapping))
        for k, v in mapping.items():
            assert k in d
            assert_view_same(d[k], v, f"d[{k!r}]")
            assert_same(deep(d.get(k)), v, f"d.get({k!r})")


@given(st.dictionaries(KEYS, VALUES, max_size=8))
def test_shared_dict_from_pairs(mapping):
    pairs = list(mapping.items())
    with shmstore.SharedDict(iter(pairs)) as d, shmstore.SharedDict(pairs) as d2:
        assert_same(d.to_python(), mapping)
        assert_same(d2.to_python(), mapping)


@given(COMPARABLE)
def test_views_compare_equal_to_plain_objects(value):
    with shmstore.put(value) as ref, shmstore.put(value) as ref2:
        got, got2 = ref.get(), ref2.get()
        assert got == value
        assert value == got
        assert not (got != value)
        assert got == got2  # view == view (different stores)
        assert [got] == [value]


@given(COMPARABLE.filter(lambda v: isinstance(v, (list, tuple, dict)) and len(v) > 0))
def test_views_compare_unequal(value):
    other = value[:-1] if isinstance(value, (list, tuple)) else dict(list(value.items())[:-1])
    with shmstore.put(value) as ref:
        got = ref.get()
        assert got != other
        assert not (got == other)
        assert got != 12345
        if isinstance(value, list):
            assert got != tuple(value)  # a list is not equal to a tuple, as in Python


# Named edge cases so a failure points at the type (hypothesis finds the rest).
EDGE_VALUES = {
    "none": None,
    "bools": [True, False],
    "huge_ints": [2**63, -(2**63) - 1, 10**100, -(10**100), 2**64 - 1],
    "floats": [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-320, 1.7976931348623157e308],
    "complex": [1 + 2j, complex(-0.0, math.nan), complex(math.inf, -math.inf), 0j],
    "unicode": ["", "ünïcødé", "日本語", "\U0001f600", "\x00", "a" * 10_000],
    "big_bytes": b"\x00\xff" * 40_000,
    "bytearray": bytearray(b"abc"),
    "memoryview": memoryview(b"abcdef")[::2],
    "nested_tuples": ((1, (2, (3, [4, (5,)]))), (), ([],)),
    "dict_key_types": {
        "s": 1, 2: 2, b"b": 3, True: 4, None: 5, 2.5: 6, (1, "x", (None, b"y")): 7,
        -(2**70): 8, -0.5: 9,
    },
    "small_dict": {f"k{i}": i for i in range(8)},
    "indexed_dict": {f"k{i}": i for i in range(9)},
    "big_dict": {i: str(i) for i in range(1000)},
    "empty": [[], (), {}, "", b""],
    "array_0d": np.array(3.5),
    "array_empty": np.zeros((0, 3), dtype="<i4"),
    "array_big_endian": np.arange(12, dtype=">f8").reshape(3, 4),
    "array_complex": np.array([1 + 2j, -0.0 - 1j, complex(np.nan, 1)], dtype="<c16"),
    "array_fortran": np.asfortranarray(np.arange(12, dtype="<i2").reshape(3, 4)),
    "array_transposed": np.arange(24, dtype="<u4").reshape(2, 3, 4).transpose(2, 0, 1),
    "array_strided": np.arange(100, dtype="<f4")[::7],
    "array_bool": np.array([[True, False], [False, True]]),
    "array_in_dict": {"mask": np.ones((4, 4), dtype="u1"), "bbox": [1.0, 2.0]},
    "np_scalars": [np.float32(1.5), np.float16(0.1), np.int8(-3), np.uint64(2**64 - 1),
                   np.bool_(True), np.int64(-(2**63)), np.float64(np.nan)],
}  # fmt: skip


@pytest.mark.parametrize("value", EDGE_VALUES.values(), ids=EDGE_VALUES.keys())
def test_edge_values_roundtrip(value):
    with shmstore.put(value) as ref:
        assert_same(deep(ref.get()), value)
        assert_view_same(ref.get(), value)
    with shmstore.SharedList([value, value]) as lst:
        assert_same(lst.to_python(), [value, value])
    with shmstore.SharedDict({"k": value}) as d:
        assert_same(d.to_python(), {"k": value})


@pytest.mark.parametrize("scalar", [np.complex64(1 + 2j), np.complex128(-1.5 - 0j)])
def test_numpy_complex_scalars(scalar):
    """docs/api.md: numpy scalars are stored as their Python value (complex included)."""
    with shmstore.put([scalar]) as ref:
        (got,) = ref.get().to_python()
        assert type(got) is complex and got == scalar


def test_tuples_stay_tuples():
    value = ((1, [2, (3,)]), [(), ((),)], {"t": (4, 5)}, {(1, 2): (3,)})
    with shmstore.put(value) as ref:
        got = ref.get()
        assert type(got.to_python()) is tuple
        assert_same(got.to_python(), value)
        assert type(got[0][1][1].to_python()) is tuple
        assert type(got[2]["t"].to_python()) is tuple
        assert type(got[0][1:]) is tuple  # slicing a stored tuple gives a tuple
        assert type(got[1][:1]) is list  # ... and a stored list a list


def test_dict_keys_compare_like_python():
    """A stored dict finds keys that are equal in Python's sense: True == 1 == 1.0,
    -0.0 == 0, and an int equals the float of the same value (hash(2.0**64) == hash(2**64)),
    also a negative power of two beyond 64 bits (whose shortest form is a byte shorter than
    its magnitude's)."""
    plain = {1: "one", 0: "zero", 2**64: "big", -(2**71): "neg", (1, "a"): "tuple", "s": "str"}
    big = {**plain, **{f"pad{i}": i for i in range(20)}}  # indexed dict
    for value in (plain, big):
        with shmstore.put(value) as ref, shmstore.SharedDict(value) as d:
            for view in (ref.get(), d):
                for probe, want in [
                    (1, "one"), (1.0, "one"), (True, "one"), (np.int64(1), "one"),
                    (0, "zero"), (-0.0, "zero"), (False, "zero"),
                    ((True, "a"), "tuple"), ((1.0, "a"), "tuple"),
                    (2**64, "big"), (float(2**64), "big"),
                    (-(2**71), "neg"), (float(-(2**71)), "neg"), ((-2) ** 71, "neg"),
                    # numbers of types never stored, equal to a stored key
                    (1 + 0j, "one"), (1 - 0j, "one"), (Decimal(1), "one"), (Fraction(1), "one"),
                    (np.complex128(1), "one"), ((Fraction(1), "a"), "tuple"),
                    (complex(2**64), "big"), (Decimal(2**64), "big"), (Decimal(-(2**71)), "neg"),
                ]:  # fmt: skip
                    assert value[probe] == want  # Python's own answer
                    assert probe in view, f"{probe!r} not found in {type(view).__name__}"
                    assert view[probe] == want
                    assert view.get(probe) == want
                assert "1" not in view and b"s" not in view and 2 not in view
                for absent in (Fraction(1, 3), 1j, Decimal("NaN"), Decimal("0.1"), (1j, "a")):
                    assert absent not in value  # Python's own answer
                    assert absent not in view and view.get(absent, "-") == "-"
                with pytest.raises(TypeError):
                    view[Decimal("sNaN")]  # unhashable, as in a dict


# --- Sequence behaviour -------------------------------------------------------------------------


@given(
    st.lists(st.integers(-5, 5), max_size=12),
    st.one_of(st.none(), st.integers(-15, 15)),
    st.one_of(st.none(), st.integers(-15, 15)),
    st.one_of(st.none(), st.integers(-4, 4).filter(bool)),
    st.booleans(),
)
def test_listview_slicing_like_python(items, start, stop, step, as_tuple):
    value = tuple(items) if as_tuple else items
    with shmstore.put(value) as ref:
        view = ref.get()
        s = slice(start, stop, step)
        got = view[s]
        assert type(got) is type(value)
        assert got == value[s]


@given(st.lists(st.integers(-5, 5), max_size=12), st.integers(-5, 5))
def test_listview_sequence_methods(items, x):
    with shmstore.put(items) as ref:
        view = ref.get()
        assert isinstance(view, abc.Sequence) and not isinstance(view, abc.MutableSequence)
        assert len(view) == len(items)
        assert list(view) == items
        assert list(reversed(view)) == list(reversed(items))
        assert (x in view) == (x in items)
        assert view.count(x) == items.count(x)
        if x in items:
            assert view.index(x) == items.index(x)
            i = items.index(x)
            assert view.index(x, i) == i
            with pytest.raises(ValueError):
                view.index(x, 0, i)
        else:
            with pytest.raises(ValueError):
                view.index(x)
        for i in range(-len(items), len(items)):
            assert view[i] == items[i]
        for bad in (len(items), -len(items) - 1):
            with pytest.raises(IndexError):
                view[bad]


def test_huge_index_raises_index_error():
    """Like list: an index too large for a C integer is an IndexError, not a TypeError."""
    with shmstore.put([1, 2]) as ref, shmstore.SharedList([1, 2]) as lst:
        for seq in (ref.get(), lst, [1, 2]):
            for bad in (10**30, -(10**30)):
                with pytest.raises(IndexError):
                    seq[bad]


def test_listview_index_types():
    with shmstore.put([10, 20, 30]) as ref:
        view = ref.get()
        assert view[np.int64(1)] == 20
        assert view[True] == 20  # bool is an int, as for list
        with pytest.raises(TypeError):
            view["1"]
        with pytest.raises(TypeError):
            view[1.0]
        with pytest.raises(TypeError):
            hash(view)  # a stored list is unhashable like a list
    with shmstore.put((1, "a")) as ref:
        assert hash(ref.get()) == hash((1, "a"))  # a stored tuple hashes like the tuple
        assert {ref.get(): 1}[(1, "a")] == 1


def test_shared_list_sequence_methods():
    items = [{"i": i} if i % 3 else i for i in range(10)]
    with shmstore.SharedList(items) as lst:
        assert isinstance(lst, abc.Sequence)
        assert len(lst) == 10
        assert lst[-2].to_python() == {"i": 8}
        assert lst[0] == 0 and lst[-10] == 0
        with pytest.raises(IndexError):
            lst[10]
        with pytest.raises(IndexError):
            lst[-11]
        with pytest.raises(TypeError):
            lst["a"]
        assert [deep(x) for x in lst[2:8:3]] == items[2:8:3]
        assert [deep(x) for x in lst[::-1]] == items[::-1]
        assert lst[5:2] == []
        assert [deep(x) for x in reversed(lst)] == items[::-1]
        assert [deep(x) for x in lst] == items
        assert lst.index({"i": 4}) == 4 and lst.index(3) == 3
        assert lst.count(6) == 1 and lst.count({"i": 100}) == 0
        assert {"i": 5} in lst and {"i": 6} not in lst
        with pytest.raises(ValueError):
            lst.index("absent")
        it = iter(lst)
        assert [deep(x) for x in it] == items
        assert list(it) == []  # an exhausted iterator stays exhausted
    with shmstore.SharedList([]) as empty:
        assert len(empty) == 0 and list(empty) == [] and list(reversed(empty)) == []
        assert empty.to_python() == [] and empty[:] == []
        with pytest.raises(IndexError):
            empty[0]


def test_shared_list_has_the_sequence_mixins():
    """collections.abc.Sequence mixins: index(value, start, stop), count, __contains__,
    __reversed__ (SharedList is registered as a Sequence, so it must provide them)."""
    with shmstore.SharedList([1, 2, 3, 2]) as lst:
        plain = [1, 2, 3, 2]
        assert lst.index(2) == plain.index(2) == 1
        assert lst.index(2, 2) == plain.index(2, 2) == 3
        assert lst.index(2, -2) == plain.index(2, -2) == 3
        with pytest.raises(ValueError):
            lst.index(3, 0, 2)
        assert lst.count(2) == 2 and 3 in lst and list(reversed(lst)) == plain[::-1]


# --- Mapping behaviour --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 8, 9, 100], ids=lambda n: f"{n}_keys")
def test_dictview_mapping_methods(n):
    value = {f"k{i}": i for i in range(n)}
    with shmstore.put(value) as ref:
        view = ref.get()
        assert isinstance(view, abc.Mapping) and not isinstance(view, abc.MutableMapping)
        assert len(view) == n
        assert list(view) == list(value)
        assert list(view.keys()) == list(value.keys())
        assert list(view.values()) == list(value.values())
        assert list(view.items()) == list(value.items())
        assert view.keys() == value.keys()  # set-like, as for dict
        assert view.items() == value.items()
        assert view.keys() & {"k0", "zz"} == ({"k0"} if n else set())
        for k, v in value.items():
            assert view[k] == v and view.get(k) == v and k in view
        assert "missing" not in view and 0 not in view and b"k0" not in view
        assert view.get("missing") is None
        assert view.get("missing", 42) == 42
        with pytest.raises(KeyError) as e:
            view["missing"]
        assert e.value.args == ("missing",)
        with pytest.raises(TypeError):
            view[["unhashable"]]
        assert dict(view) == value
        with pytest.raises(TypeError):
            hash(view)


def test_shared_dict_mapping_methods():
    value = {"a": 1, 2: [2], b"c": {"x": 3}, None: 4, (1, "t"): 5, 1.5: 6, False: 7}
    with shmstore.SharedDict(value) as d:
        assert isinstance(d, abc.Mapping)
        assert len(d) == len(value)
        assert list(d) == list(value)
        assert list(d.keys()) == list(value)
        assert [deep(v) for v in d.values()] == list(value.values())
        assert [(k, deep(v)) for k, v in d.items()] == list(value.items())
        assert d.keys() == value.keys()
        for k, v in value.items():
            assert k in d and deep(d[k]) == v and deep(d.get(k)) == v
        assert d[0] == 7  # False == 0
        assert d.get("nope") is None and d.get("nope", "dflt") == "dflt"
        assert "nope" not in d and ("t", 1) not in d
        with pytest.raises(KeyError):
            d["nope"]
        with pytest.raises(TypeError):
            d[{"unhashable": 1}]
        assert d.to_python() == value


def test_shared_dict_has_the_mapping_mixins():
    """collections.abc.Mapping mixins include __eq__: a Mapping equals a dict with the same
    items (SharedDict is registered as a Mapping, so it must compare like one)."""
    value = {"a": 1, "b": [2]}
    with shmstore.SharedDict(value) as d, shmstore.SharedDict(value) as d2:
        assert d == value and value == d
        assert d == d2
        assert d != {"a": 1} and not (d == {"a": 1, "b": [3]})


# --- repr ---------------------------------------------------------------------------------------

REPR_LIMIT = 400


@pytest.mark.parametrize(
    "value",
    [
        list(range(100_000)),
        tuple(range(1000)),
        {f"key{i}": "v" * 1000 for i in range(1000)},
        ["x" * 1_000_000],
        [[[list(range(1000))] * 10] * 10],
        {"a": b"\x00" * 1_000_000, "b": np.zeros(1_000_000)},
    ],
    ids=["long_list", "long_tuple", "big_dict", "long_str", "nested", "bytes_and_array"],
)
def test_repr_is_short_and_truncated(value):
    with shmstore.put(value) as ref:
        r = repr(ref.get())
        assert len(r) < REPR_LIMIT, r
        assert "..." in r
        assert r.startswith(("ListView(", "DictView("))
        assert len(repr(ref)) < 200 and ref.name in repr(ref)


def test_repr_of_small_values_is_complete():
    with shmstore.put({"a": [1, (2,)], "b": None}) as ref:
        r = repr(ref.get())
        assert "..." not in r
        for part in ("'a'", "1", "2", "'b'", "None"):
            assert part in r
    with shmstore.SharedList([1, 2]) as lst:
        assert "len=2" in repr(lst) and lst.name in repr(lst)


# --- views as input -----------------------------------------------------------------------------


def test_views_can_be_stored_again(records):
    with shmstore.SharedList(records) as lst:
        with shmstore.SharedList(lst) as copy, shmstore.put(lst[3]) as ref:
            assert copy.to_python() == records
            assert ref.get() == records[3]
        with shmstore.SharedDict({"r": lst[0], "anns": lst[1]["annotations"]}) as d:
            assert d["r"] == records[0] and d["anns"] == records[1]["annotations"]


def test_many_distinct_keys_and_long_keys():
    """More distinct dict keys than the symbol table interns (65,536), and keys longer than
    an interned symbol may be (128 bytes): both are stored inline and read back."""
    recs = [{f"key{i}": i, "x" * 200 + str(i % 3): [i]} for i in range(70_000)]
    with shmstore.SharedList(recs) as lst:
        assert lst.to_python() == recs
        for i in (0, 65_535, 65_536, 69_999):
            assert lst[i][f"key{i}"] == i
            assert lst[i]["x" * 200 + str(i % 3)] == [i]
    big = {f"key{i}": i for i in range(70_000)}
    with shmstore.put(big) as r, shmstore.SharedDict(big) as d:
        assert r.get()["key69999"] == 69_999 and d["key69999"] == 69_999
        assert r.get() == big and d.to_python() == big


def test_shared_list_of_records(records):
    with shmstore.SharedList(records) as lst:
        assert lst.to_python() == records
        assert lst[7]["annotations"][0]["bbox"][2] == records[7]["annotations"][0]["bbox"][2]
        assert [r["file_name"] for r in lst] == [r["file_name"] for r in records]
        assert pickle.loads(pickle.dumps(lst[4]["annotations"])) == records[4]["annotations"]


def test_dict_keys_made_and_freed_between_records_are_read_back_as_written():
    """The writer remembers dict key objects it has interned (the same str object is the same
    key). Records made one at a time by a generator free their keys before the next record is
    made, so a new key can get the address of an old one: each must still be stored as itself.
    Also str subclasses and equal keys that are different objects."""

    class Name(str):
        pass

    def records():
        for i in range(2000):
            k1 = "".join(["key", str(i % 7)])  # a new object per record
            k2 = "".join(["other", str(i)])  # a new key every record
            yield {k1: i, k2: -i, Name("sub" + str(i % 3)): [i], "fixed": float(i)}

    expected = [
        {f"key{i % 7}": i, f"other{i}": -i, f"sub{i % 3}": [i], "fixed": float(i)}
        for i in range(2000)
    ]
    with shmstore.SharedList(records()) as lst:
        got = [lst[i].to_python() for i in range(len(lst))]
        lst.unlink()
    assert got == expected
    assert [list(r) for r in got] == [list(r) for r in expected]
