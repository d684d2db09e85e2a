"""pytest plugin: run joblib's own tests with shmstore.joblib's backends in place of joblib's.

Loaded with ``-p shmstore_backends`` by ``tests/test_joblib_suite.py``. joblib's backend
names ("loky", "multiprocessing", "threading") are re-registered to
:class:`~shmstore.joblib.ShmLokyBackend`, :class:`~shmstore.joblib.ShmMultiprocessingBackend`
and :class:`~shmstore.joblib.GuardedThreadingBackend`, so every ``Parallel`` of joblib's tests
(named or default backend) runs through ours. The tests whose failure is an expected
difference are marked xfail with the reason, from :data:`EXPECTED` (one place).
"""

from __future__ import annotations

import fnmatch

import pytest
import shmstore.joblib as sj
from joblib import parallel

_CLASS = (
    "checks the backend's exact class (type(...) is LokyBackend/ThreadingBackend/...): ours "
    "are subclasses that change submit() only"
)
_MEMMAP = (
    "checks joblib's memmapping (np.memmap arguments, joblib's temp folder and its files): "
    "shmstore.joblib sends large arrays as read-only views of shmstore segments instead, so "
    "joblib's memmapping never sees them (the point of the integration)"
)

#: "module::test id" pattern (fnmatch; a bare function name covers all its parameters) -> why
#: it fails under shmstore's backends. Nothing else in joblib's test_parallel and
#: test_memmapping may fail, and each of these must fail (strict xfail: the list cannot rot).
EXPECTED: dict[str, str] = {
    "test_parallel::test_overwrite_default_backend": _CLASS,
    # the parameters naming joblib's backends; those naming test-registered ones pass
    "test_parallel::test_backend_context_manager[[]*-loky]": _CLASS,
    "test_parallel::test_backend_context_manager[[]*-multiprocessing]": _CLASS,
    "test_parallel::test_backend_context_manager[[]*-threading]": _CLASS,
    "test_parallel::test_backend_hinting_and_constraints": _CLASS,
    "test_parallel::test_backend_hinting_and_constraints_with_custom_backends": _CLASS,
    "test_parallel::test_nested_parallelism_limit": _CLASS + " (by class name)",
    "test_parallel::test_auto_memmap_on_arrays_from_generator": _MEMMAP,
    "test_parallel::test_memmapping_leaks": _MEMMAP,
    "test_memmapping::test_memmap_returned_as_regular_array": _MEMMAP,
    "test_memmapping::test_memmapping_temp_folder_thread_safety": _MEMMAP,
    "test_memmapping::test_managed_backend_reuse_temp_folder": _MEMMAP,
    "test_memmapping::test_parallel_isolated_temp_folders": _MEMMAP,
}


def pytest_configure(config: pytest.Config) -> None:
    # joblib's tests build their parameter lists from the registered names and know only
    # their own (e.g. "multiprocessing" is left out of the generator tests): our aliases
    # "shmstore-*" would be tested as if they were other backends. joblib's names run ours.
    for alias in [name for name in parallel.BACKENDS if name.startswith("shmstore-")]:
        del parallel.BACKENDS[alias]
    for name, cls in (
        ("loky", sj.ShmLokyBackend),
        ("multiprocessing", sj.ShmMultiprocessingBackend),
        ("threading", sj.GuardedThreadingBackend),
    ):
        parallel.register_parallel_backend(name, cls)


def _expected(module: str, test_id: str) -> str | None:
    function = test_id.split("[", 1)[0]
    for pattern, reason in EXPECTED.items():
        if pattern == f"{module}::{function}" or fnmatch.fnmatchcase(
            f"{module}::{test_id}", pattern
        ):
            return reason
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]  # type: ignore[attr-defined]
        reason = _expected(module, item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
