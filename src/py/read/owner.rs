//! `StoreRef`: how views, iterators and handles hold their store.
//!
//! A view is made for every container a read passes through, so taking a reference to the
//! store is on the hot path. An `Arc` costs two atomic (locked) instructions per view, one
//! to clone and one to drop. `StoreRef` puts the `Arc` in a small Python object and counts
//! references to that object instead: with the GIL, CPython's reference count is a plain
//! increment; on a free-threaded interpreter it is biased towards the owning thread, which
//! is also cheap there — for the owning thread. Other threads count in a shared atomic
//! word, and threads that all count references to one object take turns at its cache line:
//! on a free-threaded interpreter two threads reading through one handle ran slower than
//! one (benchmarks/bench_threads.py). So there a handle gives each thread a `StoreRef` of
//! its own ([`per_thread`]; `handles` keeps them), which every view that thread makes
//! from it, and every view made from those, shares: each thread counts on an object it
//! owns. The object holds no Python references, so it is kept out of the
//! cyclic GC, and views holding it still cannot be part of a cycle.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::prelude::*;

use super::new_untracked;
use crate::py::store::Store;

/// The Python object behind a `StoreRef` (never handed to Python code).
#[pyclass(name = "_StoreRef", module = "shmstore._native", frozen)]
pub(crate) struct StoreCell(Arc<Store>);

/// A counted reference to a store; dereferences to the `Store`.
pub(crate) struct StoreRef(Py<StoreCell>);

impl StoreRef {
    pub(crate) fn new(py: Python<'_>, store: Arc<Store>) -> PyResult<Self> {
        Ok(StoreRef(new_untracked(py, StoreCell(store))?.unbind()))
    }

    /// Another reference to the same store (a plain reference-count increment).
    #[inline]
    pub(crate) fn clone_ref(&self, py: Python<'_>) -> Self {
        StoreRef(self.0.clone_ref(py))
    }

    /// Give the reference back by a plain decrement, for a dealloc that runs outside pyo3
    /// (where dropping a `Py` would be deferred instead).
    ///
    /// # Safety
    /// The GIL is held.
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) unsafe fn release(self) {
        // SAFETY: `into_raw` hands over our reference without dropping it; the GIL is held
        // (the caller's contract), so decrementing it directly is allowed.
        unsafe { Self::release_raw(self.into_raw()) }
    }

    /// The reference as a raw pointer to its object, for a table that keeps it
    /// (`handles::slot`); given back with [`Self::release_raw`].
    pub(crate) fn into_raw(self) -> *mut pyo3::ffi::PyObject {
        self.0.into_ptr()
    }

    /// The reference kept raw at `obj` ([`Self::into_raw`]), borrowed: not counted, and
    /// never given back by the value returned.
    ///
    /// # Safety
    /// `obj` is the object of a `StoreRef` made raw whose reference is not given back while
    /// the value returned is alive; the thread is attached.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) unsafe fn borrow_raw(
        py: Python<'_>,
        obj: *mut pyo3::ffi::PyObject,
    ) -> std::mem::ManuallyDrop<Self> {
        // SAFETY: the caller's contract: `obj` is a live `StoreCell`; the reference this
        // claims is never given back (`ManuallyDrop`), so nothing is counted either way.
        std::mem::ManuallyDrop::new(StoreRef(unsafe {
            Bound::from_owned_ptr(py, obj)
                .cast_into_unchecked()
                .unbind()
        }))
    }

    /// Give back a reference kept raw, by a plain decrement (as [`Self::release`]).
    ///
    /// # Safety
    /// `obj` came from [`Self::into_raw`] and its reference is not used after this; the
    /// thread is attached.
    pub(crate) unsafe fn release_raw(obj: *mut pyo3::ffi::PyObject) {
        // SAFETY: the caller's contract.
        unsafe { pyo3::ffi::Py_DECREF(obj) }
    }

    /// The shared `Arc`, for what outlives the Python side (arrays' owners, saving).
    pub(crate) fn arc(&self) -> &Arc<Store> {
        &self.0.get().0
    }
}

impl Deref for StoreRef {
    type Target = Store;

    #[inline]
    fn deref(&self) -> &Store {
        &self.0.get().0
    }
}

/// Whether handles give each thread its own `StoreRef` (set once at module init: on a
/// free-threaded interpreter).
static PER_THREAD: AtomicBool = AtomicBool::new(false);

/// Give each thread its own reference from now on (module init, free-threaded interpreter;
/// the stable ABI build, which no free-threaded interpreter loads, never calls it).
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) fn set_per_thread() {
    PER_THREAD.store(true, Ordering::Relaxed);
}

/// Whether each thread gets its own reference (see the module's documentation).
#[inline]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) fn per_thread() -> bool {
    PER_THREAD.load(Ordering::Relaxed)
}
