"""benchmarks/irregular.py, the second data set of the format benchmark: deterministic, a prefix of
a larger set is the smaller set, as irregular as its docstring says, and stored exactly (types
included) by a SharedList, so that the benchmark compares equal work."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import shmstore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import irregular

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (1 == 1.0 == True for ``==``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and (
            a == b or (math.isnan(a) and math.isnan(b))
        )
    return bool(a == b)


def test_deterministic_and_prefix() -> None:
    small = irregular.make_records(300)
    large = irregular.make_records(1000)
    assert all(same(a, b) for a, b in zip(small, large))
    assert all(same(a, b) for a, b in zip(irregular.iter_records(1000), large))
    assert not same(irregular.make_records(50, seed=1), large[:50])


def test_as_irregular_as_documented() -> None:
    n = 20_000
    records = irregular.make_records(n)
    absent = Counter()
    for r in records:
        for key in ("session", "ok", "tags", "ref", "geo", "props"):
            absent[key] += key not in r
    expected = {"session": 0.05, "ok": 0.10, "tags": 0.15, "ref": 0.20, "geo": 0.25, "props": 0.30}
    for key, share in expected.items():
        assert abs(absent[key] / n - share) < 0.02, (key, absent[key] / n)
    score_types = {type(r["score"]) for r in records}
    value_types = {type(r["value"]) for r in records}
    assert score_types == {float, int, type(None)}
    assert value_types == {float, int, str, type(None)}
    assert any(r["ts"] >= 2**32 for r in records)
    assert len({tuple(r) for r in records}) >= 32


def test_stored_exactly_and_touch_agrees() -> None:
    records = irregular.make_records(3000)
    with shmstore.SharedList(records) as lst:
        assert all(same(lst[i].to_python(), records[i]) for i in range(len(records)))
        assert irregular.touch(lst) == irregular.touch(records)
