"""XGBoost models trained in a joblib workload on data shared by name, cycles kept in check.

    python examples/xgboost_joblib.py [--rows 40000]

1. Processes (loky): the training data is one Ref; every task gets it by name and slices it.
2. Threads: xgboost releases the GIL, so threads are attractive, but thread pools never run the
   gc, and a reference cycle around a big array (xgboost 2.x's QuantileDMatrix had one) keeps
   it alive until memory runs out. shmstore.joblib's threading backend wraps every task with
   shmstore.leaks.gc_guard; shmstore.leaks.detect() shows that no cycle is left.
"""

from __future__ import annotations

import argparse

import numpy as np
import shmstore
import shmstore.joblib
import xgboost as xgb
from joblib import delayed
from shmstore import leaks


def train(data: shmstore.Ref, rows: slice, seed: int) -> float:
    view = data.get()  # {"X": read-only array, "y": read-only array}, no copy
    X, y = view["X"][rows], view["y"][rows]
    dtrain = xgb.QuantileDMatrix(X, y, nthread=1)
    booster = xgb.train({"nthread": 1, "max_depth": 4, "seed": seed}, dtrain, num_boost_round=10)
    return float(booster.predict(xgb.DMatrix(X[:100], nthread=1)).mean())


class Holder:
    """The xgboost 2.x cycle, rebuilt: an object that refers to itself through a bound method,
    holding a private copy of the data (``new_data = data * i``)."""

    def __init__(self, X: np.ndarray) -> None:
        self.X = X * 1.0
        self._callback = self.reset

    def reset(self) -> None:
        pass


def train_with_cycle(data: shmstore.Ref, rows: slice, seed: int) -> float:
    Holder(data.get()["X"][rows])
    return train(data, rows, seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    X = rng.random((args.rows, 8))
    y = X @ rng.random(8) + rng.normal(0, 0.1, args.rows)
    chunks = [slice(i, i + args.rows // 4) for i in range(0, args.rows, args.rows // 4)]

    with shmstore.put({"X": X, "y": y}) as data:
        scores = shmstore.joblib.Parallel(n_jobs=2)(
            delayed(train)(data, rows, seed) for rows in chunks for seed in range(2)
        )
        print(f"loky: {len(scores)} models, mean prediction {np.mean(scores):.3f}")

        # Collect after every task, whatever it costs (a demo; the default guard collects when
        # RSS grew by 64 MiB, within 5% of the run time).
        guard = leaks.GcGuard(min_growth=0, max_gc_fraction=1.0)
        # Made before the block: joblib links a Parallel and its backend both ways, a cycle
        # of joblib's own that lives as long as the Parallel (not the tasks' garbage).
        parallel = shmstore.joblib.Parallel(n_jobs=2, backend="threading", guard=guard)
        with leaks.detect() as report:
            scores = parallel(
                delayed(train_with_cycle)(data, rows, seed) for rows in chunks for seed in range(2)
            )
        st = guard.stats
        print(f"threads + gc_guard: {len(scores)} models, {st.collections} collections")
        print(f"time spent collecting: {st.gc_seconds * 1000:.1f} ms")
        print(f"cycles left: {len(report.cycles)} ({report.retained_bytes} bytes)")
        assert report.cycles == [], str(report)


if __name__ == "__main__":
    main()
