"""Task batches and their results between the parent and the workers: a batch is pickled by
our pickler (large arrays by name) into bytes joblib ships unchanged; large results come back
by name, in segments the worker holds until the parent has attached them."""

from __future__ import annotations

import pickle
from typing import Any, Callable

from ._cache import CACHE, LOADING
from ._reduce import ResultSender, Sharer, dumps

__all__ = ["Task"]


def _load_task(payload: bytes, threshold: int) -> _LoadedTask:
    return _LoadedTask(pickle.loads(payload), threshold)


class _LoadedTask:
    """A task batch in the worker; its result goes back through :class:`_Outbox`."""

    def __init__(self, batch: Callable[[], Any], threshold: int) -> None:
        self.batch = batch
        self.threshold = threshold

    def __call__(self) -> _Outbox:
        CACHE.sweep()  # backs up the watcher: what ended is dropped before the next task
        return _Outbox(self.batch(), self.threshold)


def _load_results(payload: bytes) -> Any:
    """Unpickle a result payload; result segments are unlinked once all of it is loaded."""
    LOADING.pending = {}
    LOADING.refs = []
    try:
        return pickle.loads(payload)
    finally:
        refs = LOADING.refs
        del LOADING.pending, LOADING.refs
        for ref in refs:
            ref.unlink()  # we have it mapped: this tells the worker to let go
            ref.close()


class _Outbox:
    """A batch's results, pickled with large arrays by name."""

    def __init__(self, results: Any, threshold: int) -> None:
        self.results = results
        self.threshold = threshold

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_results, (dumps(self.results, ResultSender(self.threshold)),))


class Task:
    """What our backends submit instead of joblib's batch: pickled by our pickler."""

    def __init__(self, batch: Any, sharer: Sharer) -> None:
        self.batch = batch
        self.sharer = sharer

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_task, (self.sharer.dumps(self.batch), self.sharer.threshold))

    def __call__(self) -> Any:  # only if a backend runs it without pickling
        return self.batch()

    def __len__(self) -> int:
        return len(self.batch)
