//! The numpy array of a stored array, made straight through numpy's C API.
//!
//! `numpy.asarray(owner)` reads the owner's `__array_interface__` (a dict built for the call,
//! whose type string numpy parses each time): about 0.7 µs per array. numpy publishes its C
//! API as a table of function pointers (the `_ARRAY_API` capsule); with it an array over the
//! stored bytes is one `PyArray_NewFromDescr` call plus `PyArray_SetBaseObject` (the owner
//! keeps the mapping alive, as `.base`), with the dtype made once per type string.
//!
//! The table's layout is numpy's ABI: the entries used here (0, 2, 94, 282) are the same in
//! numpy 1.x (ABI 0x01000009) and 2.x (0x02000000). Any other ABI version, or a numpy whose
//! table cannot be found, keeps the `asarray` path, which gives the same array.

use std::os::raw::{c_int, c_uint, c_void};
use std::sync::Mutex;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::ArrayOwner;

/// numpy's flags for data we provide: C order, aligned, and not writeable (the pages are
/// mapped read-only; numpy then refuses writes with its usual error).
const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;
const NPY_ARRAY_ALIGNED: c_int = 0x0100;

type NewFromDescr = unsafe extern "C" fn(
    *mut ffi::PyTypeObject,
    *mut ffi::PyObject,
    c_int,
    *const ffi::Py_intptr_t,
    *const ffi::Py_intptr_t,
    *mut c_void,
    c_int,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;
type SetBaseObject = unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyObject) -> c_int;

/// The entries of numpy's table this module calls.
struct Api {
    array_type: usize,
    new_from_descr: NewFromDescr,
    set_base: SetBaseObject,
}

/// Loaded on the first array read: `None` when the table is not one this code knows.
static API: PyOnceLock<Option<Api>> = PyOnceLock::new();

/// dtype objects by type string (the few a process meets; looked up linearly).
static DTYPES: Mutex<Vec<(String, Py<PyAny>)>> = Mutex::new(Vec::new());

fn load(py: Python<'_>) -> Option<Api> {
    let module = py
        .import("numpy._core._multiarray_umath")
        .or_else(|_| py.import("numpy.core.multiarray"))
        .ok()?;
    let capsule = module.getattr("_ARRAY_API").ok()?;
    // SAFETY: the GIL is held; `capsule` is a live object. numpy's capsule has no name (NULL)
    // and points to its table of API pointers, which lives as long as numpy (never
    // unloaded). A wrong object type makes the call fail (NULL, exception cleared here).
    unsafe {
        let table = ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null())
            .cast::<*const c_void>()
            .cast_const();
        if table.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        let version: unsafe extern "C" fn() -> c_uint = std::mem::transmute(*table);
        let abi = version();
        if abi != 0x0100_0009 && abi >> 24 != 2 {
            return None;
        }
        let (ty, new, base) = (*table.add(2), *table.add(94), *table.add(282));
        if ty.is_null() || new.is_null() || base.is_null() {
            return None;
        }
        Some(Api {
            array_type: ty as usize,
            new_from_descr: std::mem::transmute::<*const c_void, NewFromDescr>(new),
            set_base: std::mem::transmute::<*const c_void, SetBaseObject>(base),
        })
    }
}

/// The dtype for `typestr` (made once, by `numpy.dtype`).
fn dtype<'py>(py: Python<'py>, typestr: &str) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(cache) = DTYPES.lock() {
        if let Some((_, d)) = cache.iter().find(|(t, _)| t == typestr) {
            return Ok(d.bind(py).clone());
        }
    }
    let d = py.import("numpy")?.getattr("dtype")?.call1((typestr,))?;
    if let Ok(mut cache) = DTYPES.lock() {
        if cache.len() < 64 {
            cache.push((typestr.to_owned(), d.clone().unbind()));
        }
    }
    Ok(d)
}

/// The array over `owner`'s bytes (`typestr`, C-order `shape`), or `None` when numpy's C API
/// is not usable here (the caller takes the `asarray` path).
pub(super) fn make(owner: Bound<'_, ArrayOwner>) -> Option<PyResult<Bound<'_, PyAny>>> {
    let py = owner.py();
    let api = API.get_or_init(py, || load(py)).as_ref()?;
    let (typestr, shape) = owner.get().spec();
    // The sizes as numpy takes them: on the stack for the usual few dimensions (no
    // allocation per array read), else in a vector.
    let mut few = [0 as ffi::Py_intptr_t; 8];
    let many: Vec<ffi::Py_intptr_t>;
    let dims: &[ffi::Py_intptr_t] = if shape.len() <= few.len() {
        for (d, &n) in few.iter_mut().zip(shape) {
            *d = ffi::Py_intptr_t::try_from(n).ok()?;
        }
        &few[..shape.len()]
    } else {
        many = shape
            .iter()
            .map(|&n| ffi::Py_intptr_t::try_from(n).ok())
            .collect::<Option<_>>()?;
        &many
    };
    let nd = c_int::try_from(dims.len()).ok()?;
    let descr = match dtype(py, typestr) {
        Ok(d) => d,
        Err(e) => return Some(Err(e)),
    };
    let data = owner.get().data_ptr();
    Some((|| {
        // SAFETY: the GIL is held. `descr` is a dtype, whose reference the call steals (so
        // one is handed over); `dims` holds `nd` sizes that passed the reader's checks (numpy
        // checks their product again); `data` points at the stored array's bytes, which the
        // owner keeps mapped for as long as the array lives (it becomes the array's base
        // below); no strides: C order, as stored. The flags leave the array read-only.
        let arr = unsafe {
            (api.new_from_descr)(
                api.array_type as *mut ffi::PyTypeObject,
                descr.into_ptr(),
                nd,
                dims.as_ptr(),
                std::ptr::null(),
                data,
                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: a new reference or NULL with an exception set.
        let arr = unsafe { Bound::from_owned_ptr_or_err(py, arr)? };
        // SAFETY: `arr` is the new array, `owner` a live object whose reference the call
        // steals (handed over with `into_ptr`), on success and on failure alike.
        if unsafe { (api.set_base)(arr.as_ptr(), owner.into_ptr()) } < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    })())
}
