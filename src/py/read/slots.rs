//! `obj[key]` without pyo3's call trampoline, for the reads every loop makes: `lst[i]`,
//! `view[i]` and `view["field"]`.
//!
//! pyo3 reaches a `__getitem__` through a trampoline that counts the thread's attachment in
//! thread-local state, drops deferred references, guards against panics and converts the
//! arguments; for a read that otherwise costs 10-15 ns that is a fifth of it. Here the
//! types' `mp_subscript` slot is replaced by [`subscript`], which tries the type's tiny path
//! first ([`FastGet::tiny_get`]: its commonest case, in an entry small enough to need no
//! stack frame), then its fast path ([`FastGet`]: an exact `int` index, an exact `str` key)
//! under the panic guard ([`subscript_whole`]), and hands everything else — slices,
//! other index types, misses, errors it did not raise itself — to the slot pyo3 made, which
//! then does the whole work with its usual checks and messages. The iterators' `tp_iternext`
//! is split the same way ([`FastNext::tiny_next`], else [`iternext_whole`]). A tiny path
//! that makes a view takes it from the type's free list with no call (free-threaded: from
//! the thread's own list, `PyObject_Init` its one call; `read::kept_view`), or leaves it to
//! the whole way when none is kept.
//!
//! What the fast paths may do without the trampoline, and what they must not:
//! - they run with the GIL held (CPython calls the slot with it), so the `Python` token is
//!   real; pyo3 only does not know it, so dropping a `Py` there would be deferred to its
//!   pool. The fast paths therefore drop none: a store reference taken for the call is
//!   given back with `StoreRef::release` (a plain decrement), and an `int` that does not fit
//!   is cleared with `PyErr_Clear`, never wrapped in a `PyErr`;
//! - a panic is caught here and raised as `SystemError`: nothing unwinds into CPython;
//! - an error they return (a corrupt record) is raised as pyo3 would raise it.
//!
//! On a free-threaded interpreter the same holds with "the thread is attached" for "the GIL
//! is held": CPython calls every slot on an attached thread, and what the fast paths read
//! is immutable (views, ints) or taken under the handle's critical section (its store).
//! The slots are replaced where the views' allocation is installed (not the stable ABI,
//! which hides them), checked in the same place. Each
//! `install*` says whether it replaced the slot or why not, which init reports
//! (src/py/read/fastpaths.rs): a slot left as pyo3 made it is never silent.

#[cfg(not(feature = "abi3"))]
use std::panic::{catch_unwind, AssertUnwindSafe};
#[cfg(not(feature = "abi3"))]
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::Borrowed;
use pyo3::{ffi, PyClass, PyTypeInfo};

/// A type whose `obj[key]` has a fast path.
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) trait FastGet: PyClass + PyTypeInfo {
    /// `slf[key]` if this is a case the fast path takes (`None`: let pyo3's slot do it).
    /// Must not drop a `Py` (see the module's text).
    fn fast_get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>>;

    /// The slot pyo3 made, kept when it is replaced.
    fn original() -> &'static OnceLock<ffi::binaryfunc>;

    /// The smallest fast path, tried before [`Self::fast_get`] in a slot entry of its own
    /// (see [`subscript`]): the new reference `slf[key]` for the one commonest case of the
    /// type, or `None` for everything else, which then takes the whole way. It runs outside
    /// the panic guard, so it must not be able to panic (checked arithmetic, `get` for
    /// indexing, no `unwrap`), and it makes no `PyErr` (a constructor of CPython's that fails
    /// returns its NULL with the exception set, as a slot does).
    #[inline(always)]
    fn tiny_get(
        _slf: Borrowed<'_, '_, Self>,
        _key: Borrowed<'_, '_, PyAny>,
    ) -> Option<*mut ffi::PyObject> {
        None
    }
}

/// How the fast paths read an exact `int`'s value: from the object itself when it has at
/// most one digit (CPython's "compact" ints, every index below 2**30), else through
/// `PyLong_AsSsize_t`, a call that costs about as much as the rest of the index's handling.
/// The layout is CPython's, not part of its stable API, so it is switched on only after the
/// check at import ([`install_int_index`]) read a set of ints both ways and found them equal;
/// otherwise every index takes the call, and `_fast_paths()` says why.
#[cfg(not(feature = "abi3"))]
static INT_LAYOUT: AtomicU8 = AtomicU8::new(INT_CALL);
/// Ask `PyLong_AsSsize_t` for every value.
#[cfg(not(feature = "abi3"))]
const INT_CALL: u8 = 0;
/// CPython 3.11: `ob_size` holds the sign and the number of digits.
#[cfg(not(feature = "abi3"))]
const INT_SIZE: u8 = 1;
/// CPython 3.12 and later: `lv_tag` holds the number of digits (shifted by 3) and the sign
/// in its two low bits (0 positive, 1 zero, 2 negative).
#[cfg(not(feature = "abi3"))]
const INT_TAG: u8 = 2;

/// The value of the exact int at `p` if it is compact and this process has the layout on.
///
/// # Safety
/// `p` is a live exact `int` and the GIL is held.
#[cfg(not(feature = "abi3"))]
#[inline(always)]
unsafe fn compact_value(p: *mut ffi::PyObject) -> Option<isize> {
    let layout = INT_LAYOUT.load(Ordering::Relaxed);
    if layout == INT_CALL {
        return None;
    }
    // Both layouts: the object header (16 bytes with a GIL, 32 on a free-threaded
    // interpreter, as this build's `PyObject`), one word (`ob_size` or `lv_tag`), then the
    // 30-bit digits as `u32`. An int object always has room for one digit, and its value
    // never changes, so the reads need no lock.
    const HEADER: usize = std::mem::size_of::<ffi::PyObject>();
    // SAFETY: the caller's contract; the layout is not `INT_CALL` only where the check at
    // import found it (`install_int_index`), so both reads are inside the object.
    let (word, digit) = unsafe {
        let base = p.cast::<u8>();
        (
            *base.add(HEADER).cast::<usize>(),
            *base
                .add(HEADER + std::mem::size_of::<usize>())
                .cast::<u32>(),
        )
    };
    // The sign (-1, 0 or 1) of a one-digit int; a longer one takes the call.
    let sign = match layout {
        INT_SIZE if (word as isize).unsigned_abs() <= 1 => word as isize,
        INT_TAG if word < 2 << 3 => 1 - (word & 3) as isize,
        _ => return None,
    };
    Some(sign * digit as isize)
}

/// Switch the compact-int read on for this interpreter if its layout is the one expected:
/// the version says which, and ints from 0 to past 2**62 of both signs must read the same
/// as through `PyLong_AsSsize_t` (and those of two digits or more must not be taken).
///
/// # Safety
/// The thread is attached and no fast path runs yet (module init).
#[cfg(not(feature = "abi3"))]
pub(crate) unsafe fn install_int_index(py: Python<'_>) -> Result<(), String> {
    let v = py.version_info();
    let layout = match (v.major, v.minor) {
        (3, 11) => INT_SIZE,
        (3, 12..=14) => INT_TAG,
        _ => {
            return Err(format!(
                "off: the int layout of CPython {}.{} is not known to this build",
                v.major, v.minor
            ))
        }
    };
    INT_LAYOUT.store(layout, Ordering::Relaxed);
    let probes: [isize; 16] = [
        0,
        1,
        -1,
        2,
        -2,
        7,
        255,
        -256,
        1 << 29,
        (1 << 30) - 1,
        -((1 << 30) - 1),
        1 << 30,
        -(1 << 30),
        1 << 40,
        isize::MAX,
        isize::MIN,
    ];
    for n in probes {
        // SAFETY: the GIL is held; the new reference is released below.
        let obj = unsafe { ffi::PyLong_FromSsize_t(n) };
        if obj.is_null() {
            INT_LAYOUT.store(INT_CALL, Ordering::Relaxed);
            // SAFETY: the GIL is held.
            unsafe { ffi::PyErr_Clear() };
            return Err("off: could not make an int to check the layout".to_owned());
        }
        // SAFETY: `obj` is a live exact int (made just now), the GIL is held.
        let (read, exact) = unsafe { (compact_value(obj), ffi::PyLong_CheckExact(obj) != 0) };
        // SAFETY: the GIL is held; `obj` is our reference.
        unsafe { ffi::Py_DECREF(obj) };
        let expected = (n.unsigned_abs() < 1 << 30).then_some(n);
        if !exact || read != expected {
            INT_LAYOUT.store(INT_CALL, Ordering::Relaxed);
            return Err(format!(
                "off: {n} read as {read:?} from the object, expected {expected:?} (the int layout differs)"
            ));
        }
    }
    Ok(())
}

/// An exact `int` whose value [`compact_value`] reads from the object itself, for the tiny
/// paths (which call nothing); `None` for anything else, including an int of two digits
/// or more, which the whole way then reads with `PyLong_AsSsize_t`.
#[inline(always)]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) fn compact_index(key: &Bound<'_, PyAny>) -> Option<isize> {
    let p = key.as_ptr();
    // SAFETY: `p` is a live object (borrowed for the call) and the GIL is held.
    unsafe {
        if ffi::PyLong_CheckExact(p) == 0 {
            return None;
        }
        #[cfg(not(feature = "abi3"))]
        return compact_value(p);
        #[cfg(feature = "abi3")]
        return None;
    }
}

/// An exact `int` that fits an `isize`, read without making a `PyErr` (which the fast paths
/// must not drop); `None` for anything else.
#[inline(always)]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) fn exact_index(key: &Bound<'_, PyAny>) -> Option<isize> {
    if let Some(i) = compact_index(key) {
        return Some(i);
    }
    let p = key.as_ptr();
    // SAFETY: `p` is a live object (borrowed for the call) and the GIL is held.
    unsafe {
        if ffi::PyLong_CheckExact(p) == 0 {
            return None;
        }
        let i = ffi::PyLong_AsSsize_t(p);
        if i == -1 && !ffi::PyErr_Occurred().is_null() {
            // Too large for an isize: pyo3's slot raises the IndexError.
            ffi::PyErr_Clear();
            return None;
        }
        Some(i)
    }
}

/// The tails of the tiny paths that make an object more than a constructor call: out of
/// line, so that the tiny path stays small and reaches them by a tail call, and each under
/// the panic guard, as the whole way is.
///
/// They, [`subscript_whole`] and `iternext_whole` are `extern "C"`, though only Rust calls
/// them: such a function cannot unwind (a panic escaping one aborts, as it would one frame
/// up, in the slot), and the compiler knows it. A slot that calls a Rust function that might unwind
/// needs a landing pad that aborts, and with it a frame: the call is not a tail call, and
/// `ann["bbox"]` cost 5 instructions more (callgrind, 3.12). Likewise the tiny paths read a
/// str's length with `get_varint_small`, which has no error value to drop.
///
/// A new str of the stored bytes `b` of `store` (NULL with the exception set on failure):
/// an ASCII one at once, any other by the decoder under the guard.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
#[allow(improper_ctypes_definitions)] // called from Rust only: `extern "C"` for `nounwind`
pub(crate) extern "C" fn str_ptr(
    py: Python<'_>,
    store: &super::StoreRef,
    b: &[u8],
) -> *mut ffi::PyObject {
    match super::ascii_str(py, b) {
        Some(obj) => obj,
        None => decoded_str_ptr(py, store, b),
    }
}

/// `str_ptr` for bytes that are not ASCII (or shorter than two): CPython's decoder.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
fn decoded_str_ptr(py: Python<'_>, store: &super::StoreRef, b: &[u8]) -> *mut ffi::PyObject {
    guarded(py, std::ptr::null_mut(), || {
        Ok(super::py_str(py, store, b)?.into_ptr())
    })
}

/// A new view of the list or tuple at the node of `store` whose parts these are
/// (`Node::into_parts`, which pass in registers), NULL with the exception set.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
#[allow(improper_ctypes_definitions)] // called from Rust only: `extern "C"` for `nounwind`
pub(crate) extern "C" fn list_view_ptr(
    py: Python<'_>,
    store: &super::StoreRef,
    rec: u32,
    form: crate::archive::reader::Form,
    pos: u64,
) -> *mut ffi::PyObject {
    guarded(py, std::ptr::null_mut(), || {
        let node = crate::archive::Node::from_parts((rec, form, pos));
        let view = super::ListView::new(store.clone_ref(py), node);
        Ok(super::new_view(py, view)?.into_any().into_ptr())
    })
}

/// The value of field `f` of the dict that view `v` shows, as the whole way reads it (NULL
/// with the exception set, a corrupt slot's included). Three words of arguments, so that the
/// tiny path reaches it by a jump rather than a call with a frame of its own.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
#[allow(improper_ctypes_definitions)] // called from Rust only: `extern "C"` for `nounwind`
pub(crate) extern "C" fn field_ptr(
    py: Python<'_>,
    v: &super::DictView,
    f: crate::py::store::PyField,
) -> *mut ffi::PyObject {
    guarded(py, std::ptr::null_mut(), || {
        let (store, node) = v.shows();
        Ok(super::protocol::field_value(py, store, node, f)?.into_ptr())
    })
}

/// Run a slot's body as pyo3's trampoline would for it, without the trampoline: an error
/// is raised (restored) and a panic becomes `SystemError`; either returns `failed`.
///
/// The body's result leaves the unwinding guard through `out`, a plain word, rather than as
/// the guard's return value: that comes back through a two-word slot in memory (the size of
/// a panic's payload), written in one width and read in another, which stalled the
/// processor on every call (about 3 ns on `next(it)`).
#[cfg(not(feature = "abi3"))]
#[inline(always)]
fn guarded<R: Copy>(py: Python<'_>, failed: R, body: impl FnOnce() -> PyResult<R>) -> R {
    let mut out = failed;
    let caught = catch_unwind(AssertUnwindSafe(|| match body() {
        Ok(value) => out = value,
        Err(err) => err.restore(py),
    }));
    if caught.is_err() {
        // SAFETY: the GIL is held (slots run with it); the message is a NUL-terminated
        // literal.
        unsafe {
            ffi::PyErr_SetString(
                ffi::PyExc_SystemError,
                c"shmstore: internal error (panic) in a read; please report it".as_ptr(),
            )
        };
        return failed;
    }
    out
}

/// `slf`, an instance of `T` that CPython passed to one of `T`'s slots, borrowed for the call.
///
/// # Safety
/// The GIL is held and `slf` is a live instance of `T` (the types are not subclassable, so
/// a slot of `T` only ever sees instances of `T`).
#[cfg(not(feature = "abi3"))]
#[inline(always)]
unsafe fn instance<'a, 'py, T: PyClass>(
    py: Python<'py>,
    slf: *mut ffi::PyObject,
) -> Borrowed<'a, 'py, T> {
    // SAFETY: the caller's contract.
    unsafe { Borrowed::from_ptr(py, slf).cast_unchecked::<T>() }
}

/// The `mp_subscript` slot of a `FastGet` type: [`FastGet::tiny_get`], else the whole way
/// ([`subscript_whole`]).
///
/// Two functions, because a function's entry and exit are as large as its largest path: the
/// whole way (errors, views, strs, the panic guard) saves six registers and reserves half a
/// kilobyte of stack on every call, a sixth of a packed element's read. The tiny path needs
/// few registers and no frame, and reaches the whole way by a tail call.
#[cfg(not(feature = "abi3"))]
unsafe extern "C" fn subscript<T: FastGet>(
    slf: *mut ffi::PyObject,
    key: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls mp_subscript with the GIL held, `slf` an instance of the type
    // whose slot this is and `key` a live object (never NULL), both borrowed for the call.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above; telling the compiler so drops `from_ptr`'s NULL checks.
    let (slf_b, key_b) = unsafe {
        std::hint::assert_unchecked(!slf.is_null() && !key.is_null());
        (instance::<T>(py, slf), Borrowed::from_ptr(py, key))
    };
    if let Some(out) = T::tiny_get(slf_b, key_b) {
        return out;
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { subscript_whole::<T>(slf, key) }
}

/// The whole of `mp_subscript` for a `FastGet` type: [`FastGet::fast_get`] under the panic
/// guard, else the slot pyo3 made.
///
/// # Safety
/// As a `mp_subscript` slot of `T`: the GIL is held, `slf` is a live instance of `T` and
/// `key` a live object.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
unsafe extern "C" fn subscript_whole<T: FastGet>(
    slf: *mut ffi::PyObject,
    key: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: the caller's contract.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let (slf_b, key_b) = unsafe { (instance::<T>(py, slf), Borrowed::from_ptr(py, key)) };
    let fast = guarded(py, Some(std::ptr::null_mut()), || {
        T::fast_get(&slf_b, &key_b)
            .map(|value| value.map(Bound::into_ptr))
            .transpose()
    });
    if let Some(out) = fast {
        return out;
    }
    match T::original().get() {
        // SAFETY: pyo3's own slot for this type, called as CPython would.
        Some(original) => unsafe { original(slf, key) },
        None => {
            // Unreachable: the slot is replaced only after the original is kept.
            // SAFETY: the GIL is held; the message is a NUL-terminated literal.
            unsafe {
                ffi::PyErr_SetString(
                    ffi::PyExc_SystemError,
                    c"shmstore: subscript slot without its original".as_ptr(),
                )
            };
            std::ptr::null_mut()
        }
    }
}

/// Replace `T`'s `mp_subscript` with [`subscript`], keeping pyo3's.
///
/// # Safety
/// The thread is attached and no instance of `T` exists yet (this runs in the module's
/// init, before any other thread can reach the type).
#[cfg(not(feature = "abi3"))]
pub(crate) unsafe fn install<T: FastGet>(py: Python<'_>) -> Result<(), String> {
    let ty = T::type_object_raw(py);
    // SAFETY: `ty` is the live heap type pyo3 made for `T` (its mapping methods live in the
    // heap type object and are writable); the GIL is held and nothing indexes an instance
    // yet (the caller's contract). `PyType_Modified` drops any cached lookups of the type.
    unsafe {
        let mapping = (*ty).tp_as_mapping;
        if mapping.is_null() {
            return Err("the type has no mapping methods".into());
        }
        let Some(original) = (*mapping).mp_subscript else {
            return Err("the type has no mp_subscript".into());
        };
        if T::original().set(original).is_err() {
            return Err("installed twice".into());
        }
        (*mapping).mp_subscript = Some(subscript::<T>);
        ffi::PyType_Modified(ty);
    }
    Ok(())
}

/// An iterator whose `__next__` runs without the trampoline: it is all Rust, so the whole
/// of it is the fast path. A `Py` it drops (none on the paths that yield an item) is
/// released at pyo3's next call instead of at once.
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) trait FastNext: PyClass + PyTypeInfo {
    /// The next item, `None` at the end.
    fn fast_next<'py>(slf: &Bound<'py, Self>) -> PyResult<Option<Bound<'py, PyAny>>>;

    /// The next item's new reference for the commonest case, in a slot entry of its own
    /// (as [`FastGet::tiny_get`], under the same rules: it must not be able to panic and
    /// makes no `PyErr`); `None`, with the iterator unchanged, for everything else.
    #[inline(always)]
    fn tiny_next(_slf: Borrowed<'_, '_, Self>) -> Option<*mut ffi::PyObject> {
        None
    }
}

/// The `tp_iternext` slot of a `FastNext` type: [`FastNext::tiny_next`], else the whole
/// way ([`iternext_whole`]), split as [`subscript`] is.
#[cfg(not(feature = "abi3"))]
unsafe extern "C" fn iternext<T: FastNext>(slf: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: CPython calls tp_iternext with the GIL held on a live instance of the type
    // whose slot this is, borrowed for the call.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above; telling the compiler so drops `from_ptr`'s NULL check.
    let slf_b = unsafe {
        std::hint::assert_unchecked(!slf.is_null());
        instance::<T>(py, slf)
    };
    if let Some(out) = T::tiny_next(slf_b) {
        return out;
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { iternext_whole::<T>(slf) }
}

/// The whole of `tp_iternext` for a `FastNext` type: the next item, or NULL with no
/// exception at the end (as CPython's own iterators do), or NULL with the exception.
///
/// # Safety
/// As a `tp_iternext` slot of `T`: the GIL is held and `slf` is a live instance of `T`.
#[cfg(not(feature = "abi3"))]
#[inline(never)]
unsafe extern "C" fn iternext_whole<T: FastNext>(slf: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: the caller's contract.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let slf_b = unsafe { instance::<T>(py, slf) };
    guarded(py, std::ptr::null_mut(), || {
        Ok(T::fast_next(&slf_b)?.map_or(std::ptr::null_mut(), Bound::into_ptr))
    })
}

/// Replace `T`'s `tp_iternext` with [`iternext`].
///
/// # Safety
/// As [`install`].
#[cfg(not(feature = "abi3"))]
pub(crate) unsafe fn install_next<T: FastNext>(py: Python<'_>) -> Result<(), String> {
    let ty = T::type_object_raw(py);
    // SAFETY: as in `install`: `ty` is `T`'s live heap type, nothing iterates an instance
    // yet, and the GIL is held.
    unsafe {
        if (*ty).tp_iternext.is_none() {
            return Err("the type has no tp_iternext".into());
        }
        (*ty).tp_iternext = Some(iternext::<T>);
        ffi::PyType_Modified(ty);
    }
    Ok(())
}

/// A type whose `iter(obj)` runs without the trampoline (making the iterator is all Rust).
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) trait FastIter: PyClass + PyTypeInfo {
    /// A new iterator over `slf`.
    fn fast_iter<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>>;
}

/// The `tp_iter` slot of a `FastIter` type.
#[cfg(not(feature = "abi3"))]
unsafe extern "C" fn iter<T: FastIter>(slf: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: as in `iternext`: the GIL is held and `slf` is a live instance of `T`.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let slf_b = unsafe { instance::<T>(py, slf) };
    guarded(py, std::ptr::null_mut(), || {
        Ok(T::fast_iter(&slf_b)?.into_ptr())
    })
}

/// Replace `T`'s `tp_iter` with [`iter`].
///
/// # Safety
/// As [`install`].
#[cfg(not(feature = "abi3"))]
pub(crate) unsafe fn install_iter<T: FastIter>(py: Python<'_>) -> Result<(), String> {
    let ty = T::type_object_raw(py);
    // SAFETY: as in `install`.
    unsafe {
        if (*ty).tp_iter.is_none() {
            return Err("the type has no tp_iter".into());
        }
        (*ty).tp_iter = Some(iter::<T>);
        ffi::PyType_Modified(ty);
    }
    Ok(())
}

/// A type whose `len(obj)` runs without the trampoline (it cannot fail).
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) trait FastLen: PyClass + PyTypeInfo {
    fn fast_len(slf: &Bound<'_, Self>) -> usize;
}

/// The `sq_length` / `mp_length` slot of a `FastLen` type.
#[cfg(not(feature = "abi3"))]
unsafe extern "C" fn length<T: FastLen>(slf: *mut ffi::PyObject) -> ffi::Py_ssize_t {
    // SAFETY: as in `iternext`: the GIL is held and `slf` is a live instance of `T`.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: as above.
    let slf_b = unsafe { instance::<T>(py, slf) };
    // A length beyond isize cannot come from a mapping; saturate rather than wrap.
    guarded(py, -1, || {
        Ok(ffi::Py_ssize_t::try_from(T::fast_len(&slf_b)).unwrap_or(ffi::Py_ssize_t::MAX))
    })
}

/// Replace `T`'s `sq_length` and `mp_length` (those pyo3 set) with [`length`].
///
/// # Safety
/// As [`install`].
#[cfg(not(feature = "abi3"))]
pub(crate) unsafe fn install_len<T: FastLen>(py: Python<'_>) -> Result<(), String> {
    let ty = T::type_object_raw(py);
    let mut replaced = false;
    // SAFETY: as in `install`.
    unsafe {
        let seq = (*ty).tp_as_sequence;
        if !seq.is_null() && (*seq).sq_length.is_some() {
            (*seq).sq_length = Some(length::<T>);
            replaced = true;
        }
        let map = (*ty).tp_as_mapping;
        if !map.is_null() && (*map).mp_length.is_some() {
            (*map).mp_length = Some(length::<T>);
            replaced = true;
        }
        ffi::PyType_Modified(ty);
    }
    if replaced {
        Ok(())
    } else {
        Err("the type has neither sq_length nor mp_length".into())
    }
}

/// `impl FastGet`'s `original` for a type.
macro_rules! original_slot {
    () => {
        fn original() -> &'static std::sync::OnceLock<pyo3::ffi::binaryfunc> {
            static ORIGINAL: std::sync::OnceLock<pyo3::ffi::binaryfunc> =
                std::sync::OnceLock::new();
            &ORIGINAL
        }
    };
}
pub(crate) use original_slot;
