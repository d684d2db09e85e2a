"""The pytest guide's example (docs/guides/pytest.md): run it with

    pytest examples/pytest_guide_test.py

The first test shares a SharedList with worker processes and checks that it leaves no cycle and
no segment behind; the second is a leak (an object that references itself), kept as an
expected failure.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import shmstore


def _area(args):
    lst, i = args
    return sum(a["area"] for a in lst[i]["annotations"])


@pytest.mark.no_leaks(segments=True)  # no cycle, no leftover segment
def test_workers_read_one_copy():
    records = [{"annotations": [{"area": float(i)}]} for i in range(1000)]
    with shmstore.SharedList(records) as lst, mp.get_context("spawn").Pool(2) as pool:
        areas = pool.map(_area, [(lst, i) for i in range(len(lst))], chunksize=100)
    assert sum(areas) == sum(range(1000))


class Circular:
    def __init__(self, data):
        self.me = self
        self.data = data


@pytest.mark.xfail(strict=True, reason="a self-referencing object: the plugin reports it")
@pytest.mark.no_leaks
def test_a_cycle_pinning_an_array_is_reported():
    Circular(np.ones(1 << 18))
