//! `_native.gc_unreachable`: the snapshot half of `shmstore.leaks` analysis in Rust.
//!
//! Python hands over the candidate objects (plus a calibration probe); this reads each
//! object's refcount and walks its `tp_traverse` to record the edges between candidates,
//! then `crate::graph::unreachable` decides. Nothing is collected and no reference count is
//! changed: the objects are only read, so no finalizer or weakref callback can run.

use std::ffi::{c_int, c_void};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::errors::Error;
use crate::graph::{unreachable, AddrIndex};

/// `visitproc` for `tp_traverse`: remember each referent's address.
unsafe extern "C" fn push_referent(obj: *mut ffi::PyObject, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `&mut Vec<usize>` that `gc_unreachable` passes to `tp_traverse`,
    // alive and not otherwise borrowed for the duration of that call.
    let out = unsafe { &mut *(arg as *mut Vec<usize>) };
    out.push(obj as usize);
    0
}

/// A type's `tp_traverse` and `tp_is_gc`.
struct GcSlots {
    traverse: Option<ffi::traverseproc>,
    is_gc: Option<ffi::inquiry>,
}

/// Read through `PyType_GetSlot`, not the `PyTypeObject` fields: the stable ABI (abi3) hides
/// the struct, and since 3.10 `PyType_GetSlot` also answers for static (non-heap) types.
///
/// # Safety
/// `tp` must be a live type object and the caller must hold the GIL.
unsafe fn gc_slots(tp: *mut ffi::PyTypeObject) -> GcSlots {
    // SAFETY: the caller guarantees `tp` is live and the GIL is held; both slot ids are
    // valid, so PyType_GetSlot returns the slot's function pointer or NULL (never an error).
    let (traverse, is_gc) = unsafe {
        (
            ffi::PyType_GetSlot(tp, ffi::Py_tp_traverse),
            ffi::PyType_GetSlot(tp, ffi::Py_tp_is_gc),
        )
    };
    // SAFETY: a non-NULL `Py_tp_traverse` slot holds a `traverseproc` and a non-NULL
    // `Py_tp_is_gc` slot an `inquiry` (CPython's slot table); `Option<fn>` has the same
    // layout as a nullable pointer, so NULL becomes `None`.
    unsafe {
        GcSlots {
            traverse: std::mem::transmute::<*mut c_void, Option<ffi::traverseproc>>(traverse),
            is_gc: std::mem::transmute::<*mut c_void, Option<ffi::inquiry>>(is_gc),
        }
    }
}

/// gc_unreachable(objects, /)
/// --
///
/// Indices of the objects in `objects[:-1]` that nothing outside the list keeps alive
/// (cyclic garbage and what hangs off it). `objects[-1]` must be a fresh object referenced
/// by the list only (e.g. `[]`): its refcount calibrates the references the list adds.
/// Each object must appear once and be tracked by the gc. Needs the GIL (refused on a
/// free-threaded interpreter running without it, where objects may change under the walk).
#[pyfunction]
fn gc_unreachable(objects: &Bound<'_, PyList>) -> PyResult<Vec<usize>> {
    let py = objects.py();
    let gil_enabled = py
        .import("sys")?
        .getattr("_is_gil_enabled")
        .and_then(|f| f.call0()?.extract::<bool>())
        .unwrap_or(true);
    if !gil_enabled {
        return Err(Error::Usage(
            "gc_unreachable needs the GIL: on a free-threaded interpreter use the pure-Python \
             analysis (shmstore.leaks falls back to it automatically)"
                .into(),
        )
        .into());
    }
    let total = objects.len();
    if total == 0 {
        return Err(Error::Usage(
            "gc_unreachable expects the candidates followed by a calibration probe; got an \
             empty list"
                .into(),
        )
        .into());
    }
    // Why no `py.detach()` here: the refcounts and the edges must be one consistent snapshot,
    // and the caller relies on no other thread running between them: the whole call holds
    // the GIL and never calls back into Python, so no other thread runs until it returns.
    let list = objects.as_ptr();
    let mut ptrs: Vec<*mut ffi::PyObject> = Vec::with_capacity(total);
    for i in 0..total {
        // SAFETY: `list` is a live list we hold a reference to, `i` is in range, and the list
        // is not mutated during this call (we hold the GIL and run no Python code).
        let p = unsafe { ffi::PyList_GetItem(list, i as ffi::Py_ssize_t) };
        if p.is_null() {
            return Err(PyErr::fetch(py));
        }
        ptrs.push(p);
    }
    let probe = ptrs.pop().expect("checked non-empty above");
    // SAFETY: `probe` is a live object (borrowed from the list).
    let base = unsafe { ffi::Py_REFCNT(probe) };

    let n = ptrs.len();
    let addrs: Vec<usize> = ptrs.iter().map(|p| *p as usize).collect();
    let index = AddrIndex::new(&addrs);
    let mut refcounts: Vec<isize> = Vec::with_capacity(n);
    let mut offsets: Vec<usize> = Vec::with_capacity(n + 1);
    let mut targets: Vec<u32> = Vec::with_capacity(n * 2);
    let mut scratch: Vec<usize> = Vec::with_capacity(64);
    offsets.push(0);
    for &p in &ptrs {
        scratch.clear();
        // SAFETY: `p` is a live object borrowed from the list; we hold the GIL, so no other
        // thread mutates it while its type's tp_traverse (which only reads) reports its
        // referents to `push_referent`. `tp_is_gc` guards objects whose type is GC-capable
        // but which are not GC objects themselves (static type objects).
        unsafe {
            refcounts.push(ffi::Py_REFCNT(p) - base);
            let tp = ffi::Py_TYPE(p);
            if ffi::PyType_IS_GC(tp) != 0 {
                let slots = gc_slots(tp);
                if slots.is_gc.is_none_or(|is_gc| is_gc(p) != 0) {
                    if let Some(traverse) = slots.traverse {
                        traverse(
                            p,
                            push_referent,
                            &mut scratch as *mut Vec<usize> as *mut c_void,
                        );
                    }
                }
            }
        }
        targets.extend(scratch.iter().filter_map(|&r| index.get(r)));
        offsets.push(targets.len());
    }
    Ok(unreachable(&refcounts, &offsets, &targets))
}

/// Add this file's functions to `shmstore._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gc_unreachable, m)?)?;
    Ok(())
}
