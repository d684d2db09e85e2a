"""pytest plugin: run joblib's own tests with shmstore.joblib's backends in place of joblib's.

Loaded with ``-p shmstore_backends`` by ``tests/test_joblib_suite.py``. joblib's backend
names ("loky", "multiprocessing", "threading") are re-registered to
:class:`~shmstore.joblib.ShmLokyBackend`, :class:`~shmstore.joblib.ShmMultiprocessingBackend`
and :class:`~shmstore.joblib.GuardedThreadingBackend`, so every ``Parallel`` of joblib's tests
(named or default backend) runs through ours.

Two lists, each entry with its reason:

- :data:`EXPECTED`: the tests whose failure is an expected difference (strict xfail: each must
  fail, nothing else may).
- which tests run, for time (``make test`` must stay fast on 2 busy cores): every test of
  ``test_memmapping`` but :data:`MEMMAPPING_LEFT_OUT`, and of ``test_parallel`` the functions in
  :data:`PARALLEL_SUBSET` — those that exercise what our backends change (how task batches,
  their arrays and their results are pickled; generators; errors; nesting; backend choice).
  ``SHMSTORE_JOBLIB_SUITE=all`` runs both modules whole (about 6 minutes on 2 busy cores).
"""

from __future__ import annotations

import fnmatch
import os

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


@pytest.fixture(autouse=True)
def _private_shared_memory_folder(request: pytest.FixtureRequest) -> object:
    """joblib's ``test_pool_get_temp_dir`` makes a folder ``test.tmpdir`` in joblib's default
    shared-memory folder (/dev/shm) and leaves it there. For that test, joblib's default is this
    run's private segment directory instead (on the same tmpfs, so the test still takes the
    shared-memory branch it checks), which the harness removes."""
    private = os.environ.get("SHMSTORE_DIR")
    if not (private and request.node.name.startswith("test_pool_get_temp_dir")):
        yield None
        return
    import joblib._memmapping_reducer as jmr

    saved = jmr.SYSTEM_SHARED_MEM_FS
    jmr.SYSTEM_SHARED_MEM_FS = private
    try:
        yield None
    finally:
        jmr.SYSTEM_SHARED_MEM_FS = saved


#: test_parallel functions that run (the rest start pools to test joblib's own machinery: BLAS
#: thread limits, initializers, worker re-use, dispatch races, effective n_jobs, dask, ...)
PARALLEL_SUBSET = frozenset(
    {
        "test_simple_parallel",
        "test_main_thread_renamed_no_warning",
        "test_nested_loop",
        "test_nested_loop_with_exception_with_loky",
        "test_mutate_input_with_threads",
        "test_parallel_kwargs",
        "test_parallel_as_context_manager",
        "test_parallel_pickling",
        "test_parallel_byteorder_corruption",
        "test_parallel_timeout_success",
        "test_parallel_timeout_fail",
        "test_error_in_task_iterator",
        "test_exception_dispatch",
        "test_nested_exception_dispatch",
        "test_dispatch_one_job",
        "test_batching_auto_subprocesses",
        "test_overwrite_default_backend",
        "test_backend_context_manager",
        "test_nested_backend_context_manager",
        "test_backend_nesting_level",
        "test_parallel_with_interactively_defined_functions",
        "test_parallel_with_interactively_defined_functions_loky",
        "test_parallel_with_interactively_defined_bound_method_loky",
        "test_parallel_with_exhausted_iterator",
        "test_auto_memmap_on_arrays_from_generator",
        "test_memmap_with_big_offset",
        "test_parallel_return_order_with_return_as_generator_parameter",
        "test_deadlock_with_generator",
        "test_multiple_generator_call",
        "test_multiple_generator_call_separated_gc",
        "test_memmapping_leaks",
        "test_lambda_expression",
        "test_backend_hinting_and_constraints",
        "test_backend_hinting_and_constraints_with_custom_backends",
        "test_nested_parallelism_limit",
        "test_globals_update_at_each_parallel_call",
    }
)

#: test_memmapping functions left out: joblib's MemmappingPool used directly (no backend
#: involved), Windows file-permission errors, and a test that runs plain joblib in a child
#: interpreter (our backends are not registered there) and gives loky 10 s to remove its
#: temporary folder: it tests joblib alone, and fails on a loaded machine
MEMMAPPING_LEFT_OUT = frozenset(
    {
        "test_child_raises_parent_exits_cleanly",
        "test_pool_with_memmap",
        "test_pool_with_memmap_array_view",
        "test_permission_error_windows_memmap_sent_to_parent",
        "test_permission_error_windows_reference_cycle",
    }
)


def _runs(module: str, function: str) -> bool:
    if os.environ.get("SHMSTORE_JOBLIB_SUITE") == "all":
        return True
    if module == "test_parallel":
        return function in PARALLEL_SUBSET
    return function not in MEMMAPPING_LEFT_OUT


def _expected(module: str, test_id: str) -> str | None:
    function = test_id.split("[", 1)[0]
    for pattern, reason in EXPECTED.items():
        if pattern == f"{module}::{function}" or fnmatch.fnmatchcase(
            f"{module}::{test_id}", pattern
        ):
            return reason
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, left_out = [], []
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]  # type: ignore[attr-defined]
        if not _runs(module, item.name.split("[", 1)[0]):
            left_out.append(item)
            continue
        kept.append(item)
        reason = _expected(module, item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
