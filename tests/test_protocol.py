"""Handles and views share one Sequence/Mapping behaviour: a `SharedList` behaves like the
`ListView` of the same list, a `SharedDict` like the `DictView` of the same dict, method by
method (property tests), including numpy integer indexes, `in` on a closed store and
exceptions raised by the user's `__eq__`."""

from __future__ import annotations

import pickle
import weakref
from typing import Any, Callable

import numpy as np
import pytest
import shmstore
from hypothesis import given
from hypothesis import strategies as st

# Each test has its own segment directory (conftest); it must leave nothing behind there.
pytestmark = pytest.mark.usefixtures("no_leftover_segments")


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
keys = st.one_of(st.text(max_size=6), st.integers(-50, 50), st.binary(max_size=4))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=8,
)


def plain(x: Any) -> Any:
    """Views inside results as plain objects, for comparing."""
    if isinstance(x, (shmstore.ListView, shmstore.DictView)):
        return x.to_python()
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(plain(v) for v in x)
    return x


def outcome(f: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", plain result) or ("raises", exception class): what a call does."""
    try:
        return ("ok", plain(f()))
    except Exception as e:
        return ("raises", type(e))


def same(handle: Any, view: Any, call: Callable[[Any], Any]) -> None:
    assert outcome(lambda: call(handle)) == outcome(lambda: call(view))


indexes = st.one_of(
    st.integers(-12, 12),
    st.integers(-12, 12).map(np.int64),
    st.integers(-12, 12).map(np.int32),
    st.integers(2**63, 2**80),
    st.integers(2**30, 2**62),
    st.integers(-(2**62), -(2**30)),
    st.booleans(),
    st.just(1.0),
    st.just("0"),
    st.builds(
        slice,
        st.none() | st.integers(-12, 12),
        st.none() | st.integers(-12, 12),
        st.sampled_from([None, 1, 2, -1, -3]),
    ),
)


@given(
    records=st.lists(values, max_size=10), probe=values, index=indexes, start=st.integers(-12, 12)
)
def test_shared_list_behaves_like_its_list_view(records, probe, index, start):
    with shmstore.SharedList(records) as lst, shmstore.put(records) as ref:
        view = ref.get()
        assert isinstance(view, shmstore.ListView)
        same(lst, view, len)
        same(lst, view, lambda s: s[index])
        same(lst, view, lambda s: probe in s)
        same(lst, view, lambda s: s.index(probe))
        same(lst, view, lambda s: s.index(probe, start))
        same(lst, view, lambda s: s.count(probe))
        same(lst, view, lambda s: list(s))
        same(lst, view, lambda s: list(reversed(s)))
        same(lst, view, lambda s: s.to_python())
        if records:
            same(lst, view, lambda s: s[len(records) - 1] in s)


@given(
    mapping=st.dictionaries(keys, values, max_size=12),
    probe=st.one_of(keys, st.just([1]), st.just(1.5)),
)
def test_shared_dict_behaves_like_its_dict_view(mapping, probe):
    with shmstore.SharedDict(mapping) as d, shmstore.put(mapping) as ref:
        view = ref.get()
        assert isinstance(view, shmstore.DictView)
        same(d, view, len)
        same(d, view, lambda m: m[probe])
        same(d, view, lambda m: m.get(probe, "default"))
        same(d, view, lambda m: probe in m)
        same(d, view, lambda m: sorted(map(repr, m)))
        same(d, view, lambda m: sorted(map(repr, m.keys())))
        same(d, view, lambda m: sorted(repr(plain(v)) for v in m.values()))
        same(d, view, lambda m: sorted(repr((k, plain(v))) for k, v in m.items()))
        same(d, view, lambda m: m.to_python())
        same(d, view, lambda m: m == mapping)
        for k in mapping:
            same(d, view, lambda m, k=k: m[k])


packed_fields = st.one_of(
    st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=16),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=16),
    st.lists(st.booleans(), min_size=1, max_size=16),
)


@given(field=packed_fields, index=indexes, as_tuple=st.booleans())
def test_a_packed_field_indexes_like_its_list(field, index, as_tuple):
    # Records of one shape whose field is always the same number of ints, floats or bools
    # are stored with the field's elements inline (a packed field), read by a path of its
    # own: every index must give what the plain list gives, value or exception.
    value = tuple(field) if as_tuple else field
    records = [{"v": value, "k": j} for j in range(3)]
    with shmstore.SharedList(records) as lst:
        view = lst[1]["v"]
        assert outcome(lambda: view[index]) == outcome(lambda: value[index])
        for i in range(-len(field), len(field)):
            assert view[i] == value[i] and type(view[i]) is type(value[i])


shaped_dicts = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.integers(-(2**40), 2**40),
            "score": st.floats(allow_nan=False),
            "label": st.text(max_size=12),
            "box": st.lists(st.floats(allow_nan=False), min_size=4, max_size=4),
            "flag": st.booleans(),
        }
    ),
    min_size=1,
    max_size=8,
)


@given(items=shaped_dicts, probe=st.one_of(keys, st.just("missing")))
def test_iterating_a_list_of_shaped_dicts_reads_each_like_its_dict(items, probe):
    # A list of dicts with one set of keys is stored as rows of one shape, and its iterator
    # makes each item's view with the fields it found once for all of them: each view must
    # read as its own plain dict, key by key, forwards and backwards.
    with shmstore.SharedList([{"items": items}]) as lst:
        view = lst[0]["items"]
        for got_list in (list(view), list(reversed(view))[::-1]):
            assert len(got_list) == len(items)
            for got, want in zip(got_list, items):
                assert isinstance(got, shmstore.DictView)
                assert list(got) == list(want)
                for k, v in want.items():
                    assert plain(got[k]) == v and type(plain(got[k])) is type(v)
                assert outcome(lambda g=got: g[probe]) == outcome(lambda w=want: w[probe])
                assert got.get(probe, "default") == want.get(probe, "default")
                assert got.to_python() == want


# Every way a shaped dict's field can be stored: None, a bool, ints of each width, a float,
# strs (ASCII, not, 0-2 characters), bytes, packed lists and tuples of ints, floats and bools,
# and anything else behind a reference.
field_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**7), 2**7),
    st.integers(-(2**15), 2**15),
    st.integers(-(2**31), 2**31),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(2**63, 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.text(st.characters(max_codepoint=127), max_size=20),
    st.text(min_size=4, max_size=20),
    st.binary(max_size=6),
    st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=5),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=5).map(tuple),
    st.lists(st.booleans(), min_size=1, max_size=5),
    values,
)


@given(
    a=field_values,
    b=field_values,
    same_kind=st.booleans(),
    index=indexes,
)
def test_each_kind_of_field_reads_as_stored_by_its_key_and_by_an_equal_key(a, b, same_kind, index):
    # A dict of fixed keys is stored as one shape whose field slots are typed from the values
    # seen (`same_kind`: all records alike, so a field keeps its narrowest slot; else two
    # values). `view["field"]` has a path of its own for the key's own str object (a literal
    # here, interned as the stored key is) and the whole way for an equal str that is another
    # object: both must give what the plain dict gives, value and type, for every slot kind,
    # and so must indexing what they give.
    records = [{"field": a, "n": 1}, {"field": a if same_kind else b, "n": 2}]
    other_key = "".join(["fie", "ld"])  # equal to "field", made at run time: not interned
    assert other_key == "field" and id(other_key) != id("field")
    with shmstore.SharedList(records) as lst:
        for i, rec in enumerate(records):
            view = lst[i]
            for key in ("field", other_key):
                got = view[key]
                want = rec["field"]
                assert plain(got) == want and type(plain(got)) is type(want)
                if isinstance(want, (list, tuple)):
                    assert outcome(lambda g=got: g[index]) == outcome(lambda w=want: w[index])
            assert view["n"] == i + 1


# Records whose root is a dict of fixed keys (one shape), each with a list or tuple of dicts
# of one shape and a packed field: COCO's layout, which `lst[i]` and `rec["items"]` read by
# paths of their own once a record's block is checked.
coco_like = st.builds(
    lambda n, items, box, as_tuple: {
        "n": n,
        "items": tuple(items) if as_tuple else items,
        "box": box,
    },
    st.integers(-(2**40), 2**40),
    shaped_dicts,
    st.lists(st.floats(allow_nan=False), min_size=4, max_size=4),
    st.booleans(),
)


def check_record(got: Any, want: Any) -> None:
    """`got` (a read of a stored record) reads as `want`, its plain record, all the way down."""
    assert plain(got) == want
    if not isinstance(want, dict) or "items" not in want:
        return
    assert isinstance(got, shmstore.DictView)
    items = got["items"]
    assert isinstance(items, shmstore.ListView) and len(items) == len(want["items"])
    assert type(items.to_python()) is type(want["items"])
    for i, (a, b) in enumerate(zip(items, want["items"])):
        assert a.to_python() == b == items[i].to_python() == items[i - len(want["items"])]
    assert list(got["box"]) == want["box"]


@given(records=st.lists(st.one_of(coco_like, values), min_size=1, max_size=8), index=indexes)
def test_a_record_reads_the_same_first_and_every_later_time(records, index):
    # A record's first read checks its block; later reads of a checked record whose root is
    # a dict of one shape take a path of their own, and so do a list of dicts read from such a
    # record, each view made from a dropped one where there is one: every read, first or
    # later, must give what the plain list gives, exception or value, all the way down.
    with shmstore.SharedList(records) as lst:
        for _ in range(3):
            assert outcome(lambda: lst[index]) == outcome(lambda: records[index])
            for i, rec in enumerate(records):
                check_record(lst[i], rec)
                check_record(lst[i - len(records)], rec)


def test_records_of_many_shapes_and_long_lists_of_dicts_read_back():
    # The paths of their own take shape ids and lengths of one byte (below 128); past that,
    # the whole way. Both sides of each limit must read back as stored.
    records: list[Any] = [
        {f"k{i}": i, "items": [{"a": j} for j in range(i % 3)]} for i in range(300)
    ]
    records += [{"items": [{"a": j, "b": [j, j]} for j in range(n)]} for n in (127, 128, 129, 300)]
    with shmstore.SharedList(records) as lst:
        for _ in range(2):
            for i, rec in enumerate(records):
                assert lst[i].to_python() == rec
                assert lst[i]["items"].to_python() == rec["items"]
                assert [a.to_python() for a in lst[i]["items"]] == rec["items"]


def test_views_made_from_dropped_ones_are_whole_objects():
    # A view made from a dropped one's memory must be a complete new object: its own weak
    # references (none of the dropped one's), pickled by name, equal to what it reads.
    records = [{"n": i, "items": [{"a": i}], "box": [float(i)] * 4} for i in range(4)]
    with shmstore.SharedList(records) as lst:
        fired: list[int] = []
        for _ in range(3):
            for i in range(len(records)):
                gets = (
                    lambda i=i: lst[i],
                    lambda i=i: lst[i]["items"],
                    lambda i=i: lst[i]["box"],
                )
                for get in gets:
                    view = get()
                    ref = weakref.ref(view, lambda _, i=i: fired.append(i))
                    assert ref() is view
                    assert pickle.loads(pickle.dumps(view)) == view
                    want = plain(view)
                    del view
                    assert ref() is None
                    assert plain(get()) == want
        assert len(fired) == 3 * 3 * len(records)


@given(text=st.text(max_size=40), ascii_text=st.text(st.characters(max_codepoint=127)))
def test_stored_strs_read_back_equal_and_exactly_str(text, ascii_text):
    # A str of ASCII is made by a path of its own, any other by CPython's decoder: both must
    # give back the very str stored, as an exact str, at every length (0, 1 and 2 chars are
    # where the paths part).
    values = [text, ascii_text, ascii_text[:1], ascii_text[:2], text + ascii_text]
    with shmstore.SharedList([{"s": v, "t": [v]} for v in values]) as lst:
        for i, v in enumerate(values):
            for got in (lst[i]["s"], lst[i]["t"][0], lst[i].to_python()["s"]):
                assert got == v and type(got) is str
                assert hash(got) == hash(v) and len(got) == len(v)


# --- the bugs the shared protocol fixed, one test each ---------------------------------------


@pytest.mark.parametrize("index", [np.int64(1), np.int32(-1), np.uint8(1), np.intp(0)])
def test_numpy_integer_indexes_work_on_handles_and_views(index):
    records = [[10, 20], [30, 40]]
    with shmstore.SharedList(records) as lst:
        assert plain(lst[index]) == records[int(index)]
        assert lst[0][index] == records[0][int(index)]


def test_contains_on_a_closed_list_raises_store_closed():
    lst = shmstore.SharedList([1, 2, 3])
    lst.unlink()
    lst.close()
    with pytest.raises(shmstore.StoreClosedError):
        1 in lst  # noqa: B015
    with pytest.raises(shmstore.StoreClosedError):
        lst.index(1)


def test_contains_on_a_closed_dict_raises_store_closed():
    d = shmstore.SharedDict({"a": 1})
    d.unlink()
    d.close()
    with pytest.raises(shmstore.StoreClosedError):
        "a" in d  # noqa: B015


class Boom(Exception):
    pass


class EqRaises:
    def __eq__(self, other: object) -> bool:
        raise Boom("from __eq__")

    __hash__ = object.__hash__


@pytest.mark.parametrize("op", ["in", "index", "count"])
def test_user_eq_exceptions_propagate(op):
    with shmstore.SharedList([1, 2]) as lst, shmstore.put([1, 2]) as ref:
        for seq in (lst, ref.get()):
            with pytest.raises(Boom):
                if op == "in":
                    EqRaises() in seq  # noqa: B015
                else:
                    getattr(seq, op)(EqRaises())
