"""The joblib slices scenario (docs/guides/joblib.md), small: one array, 8 slices x 20 tasks,
2 workers.

    python examples/joblib_slices.py [--mib 64]

With joblib's default memmapping every task writes its slice to /dev/shm again (20x the array);
with shmstore.joblib the array is written once and every slice is a view of it.
"""

from __future__ import annotations

import argparse

import joblib
import numpy as np
import shmstore
import shmstore.joblib
from joblib import delayed


def parallel_f(data_slice, i, j):
    return float(data_slice[::512].sum())


class Engine:
    """The instance-method pitfall, done right: ``self`` holds only things that pickle small."""

    def __init__(self, weights: np.ndarray, records: shmstore.SharedList) -> None:
        self.weights = weights  # a numpy array: sent by name by shmstore.joblib
        self.records = records  # a SharedList: pickles by name anyway

    def score(self, i: int) -> float:
        return float(self.weights[i]) * self.records[i]["scale"]

    def run(self, n: int) -> list[float]:
        return shmstore.joblib.Parallel(n_jobs=2)(delayed(self.score)(i) for i in range(n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()

    data = np.random.default_rng(0).random(args.mib * 2**20 // 8)
    step = len(data) // 8
    for backend in ("loky", "multiprocessing"):
        par = shmstore.joblib.Parallel(n_jobs=2, backend=backend)
        out = par(
            delayed(parallel_f)(data[i * step : (i + 1) * step], i, j)
            for i in range(8)
            for j in range(20)
        )
        assert out[0] == parallel_f(data[:step], 0, 0)
        s = par.stats
        print(
            f"{backend}: {len(out)} tasks, {s.segments} segment of {s.copied_bytes >> 20} MiB, "
            f"{s.sent_by_name} arrays sent by name"
        )

    # one context, several unchanged joblib.Parallel calls: the array is copied once for all
    with shmstore.joblib.sharing("loky", n_jobs=2) as stats:
        first = joblib.Parallel()(delayed(np.sum)(data[:step]) for _ in range(4))
        doubled = joblib.Parallel()(delayed(np.multiply)(data[:step], 2) for _ in range(2))
    print(f"context: {stats.segments} segment; results came back as {type(doubled[0]).__name__}")
    assert first[0] == data[:step].sum() and np.array_equal(doubled[1], data[:step] * 2)

    with shmstore.SharedList([{"scale": 2.0}] * 100) as records:
        print("bound method:", sum(Engine(data, records).run(100)))


if __name__ == "__main__":
    main()
