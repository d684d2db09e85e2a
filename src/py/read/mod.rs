//! Reading: archive values -> Python, lazily (views over containers, zero-copy arrays) or
//! deeply (`to_python`). Every Python object made here lives in this process's private heap.
//!
//! A view holds a `StoreRef` and a `Node`: its only Python reference is to an object that
//! holds none, so the view is untracked by the cyclic GC and can never be part of a cycle.

mod array;
mod dict_view;
pub(crate) mod fastpaths;
mod freelist;
mod list_view;
mod ndarray;
mod owner;
pub(crate) mod protocol;
pub(crate) mod slots;
#[cfg(not(feature = "abi3"))]
mod thread_lists;

pub(crate) use array::ArrayOwner;
pub(crate) use dict_view::{DictIter, DictView};
pub(crate) use freelist::{install as install_freelists, new_view, recycled, HoldsStore, Recycled};
#[cfg(not(feature = "abi3"))]
pub(crate) use freelist::{
    install_type as install_free_list, kept_view, kept_view_holding, FreeList,
    FT_BUILD as FREE_THREADED_BUILD,
};
pub(crate) use list_view::{ListIter, ListView};
#[cfg(not(feature = "abi3"))]
pub(crate) use owner::per_thread;
#[cfg(not(feature = "abi3"))]
pub(crate) use owner::set_per_thread;
pub(crate) use owner::StoreRef;
#[cfg(not(feature = "abi3"))]
pub(crate) use thread_lists::{me as this_thread, on as thread_lists_on, Me};

use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyComplex, PyDict, PyFloat};
use pyo3::IntoPyObjectExt;
use pyo3::{ffi, PyClass};

use super::errors::Error;
use super::keys::bigint;
use super::store::Store;
use crate::archive::format::{read_elem, Scalar};
use crate::archive::value::MAX_VALUE_DEPTH;
use crate::archive::{ArchiveError, Item, Node};

/// Create a pyclass instance and take it out of the cyclic GC: it holds no Python
/// references, so no cycle can pass through it (what CPython does for atomic tuples).
pub(crate) fn new_untracked<T: PyClass>(
    py: Python<'_>,
    value: impl Into<pyo3::PyClassInitializer<T>>,
) -> PyResult<Bound<'_, T>> {
    let obj = Bound::new(py, value)?;
    // SAFETY: `obj` is a live, freshly created object of a GC type; untracking is always
    // allowed (the collector only skips it) and our types hold no PyObject references that
    // a traversal would need to see. Dealloc untracks again, which is a no-op.
    unsafe { ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) };
    Ok(obj)
}

static NP_ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A value read from `store` as Python. `deep`: containers become plain objects (else views).
#[inline(always)]
pub(crate) fn value<'py>(
    py: Python<'py>,
    store: &StoreRef,
    item: Item<'_>,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    if !deep {
        // The hot path (`view[k]`, `view[i]`, iteration), inlined into each caller so that the
        // item never goes through memory: scalars and views here, the rest the long way.
        match item {
            Item::None => return Ok(py.None().into_bound(py)),
            Item::Bool(b) => return Ok(PyBool::new(py, b).to_owned().into_any()),
            Item::Int(i) => return i.into_bound_py_any(py),
            Item::Float(f) => return Ok(PyFloat::new(py, f).into_any()),
            Item::Sym(id) => return Ok(store.py_symbol(py, id)?.into_any()),
            Item::Str(b) => return py_str(py, store, b),
            Item::List(ref node) | Item::Tuple(ref node) => {
                let node = relay(node);
                return Ok(new_view(py, ListView::new(store.clone_ref(py), node))?.into_any());
            }
            Item::Dict(ref node) => {
                let node = relay(node);
                return Ok(new_view(py, DictView::new(py, store.clone_ref(py), node))?.into_any());
            }
            _ => {}
        }
    }
    value_at(py, store, item, 0)
}

/// A new reference to `s` as a Python object, from CPython's constructors directly: NULL
/// with the exception set if one fails (a slot's way), never a `PyErr` (for the tiny read
/// paths, `read::slots::FastGet::tiny_get`).
#[inline(always)]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub(crate) fn scalar_ptr(_py: Python<'_>, s: Scalar) -> *mut ffi::PyObject {
    // SAFETY: the thread is attached (`_py`); each constructor returns a
    // new reference or NULL with an exception set, and `True`/`False` are given a reference
    // of their own.
    unsafe {
        match s {
            Scalar::Float(f) => ffi::PyFloat_FromDouble(f),
            Scalar::Int(i) => ffi::PyLong_FromLongLong(i),
            Scalar::Bool(b) => {
                let p = if b { ffi::Py_True() } else { ffi::Py_False() };
                ffi::Py_INCREF(p);
                p
            }
        }
    }
}

/// A copy of `v`, read as 8-byte words that stay 8-byte reads.
///
/// A node comes out of the reader inside an item that the compiler builds in memory with
/// 8-byte stores; copied out as one value, it was read back with 16-byte loads, each
/// spanning two of those stores, which the processor cannot forward: a stall of a dozen
/// cycles on every view made (a third of `next(it)` over a list of dicts). Volatile word
/// reads keep the loads the stores' width.
#[inline(always)]
fn relay<T: Copy>(v: &T) -> T {
    const {
        assert!(std::mem::size_of::<T>() % 8 == 0 && std::mem::align_of::<T>() >= 8);
    }
    let mut out = std::mem::MaybeUninit::<T>::uninit();
    let src = (v as *const T).cast::<std::mem::MaybeUninit<u64>>();
    let dst = out.as_mut_ptr().cast::<std::mem::MaybeUninit<u64>>();
    for k in 0..std::mem::size_of::<T>() / 8 {
        // SAFETY: `v` is a valid, aligned `T` (align >= 8, size a multiple of 8, checked
        // above), so each of its 8-byte words is valid to read and `out` to write; a word
        // is read as `MaybeUninit`, so padding bytes are allowed.
        unsafe { dst.add(k).write(src.add(k).read_volatile()) };
    }
    // SAFETY: every byte of `out` is a byte of `v`, a valid `T` (and `T: Copy`).
    unsafe { out.assume_init() }
}

/// `value` for what `value`'s view path does not take (containers converted deeply, and
/// the scalars that need more than a constructor), `depth` containers below where the
/// conversion started. Records are checked to be trees within the format's depth limit when
/// first read; this guard keeps a deep conversion within that limit even for a node rebuilt
/// from a pickle.
fn value_at<'py>(
    py: Python<'py>,
    store: &StoreRef,
    item: Item<'_>,
    depth: usize,
) -> PyResult<Bound<'py, PyAny>> {
    crate::py::stack::check(|| "converting a nested view to Python objects".into())?;
    let err = store.archive_err();
    if depth > MAX_VALUE_DEPTH + 1 {
        return Err(err(ArchiveError::Corrupt(format!(
            "values nested deeper than {MAX_VALUE_DEPTH} levels"
        )))
        .into());
    }
    Ok(match item {
        Item::None => py.None().into_bound(py),
        Item::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Item::Int(i) => i.into_bound_py_any(py)?,
        Item::BigInt(b) => bigint(py, b)?,
        Item::Float(f) => PyFloat::new(py, f).into_any(),
        Item::Complex(re, im) => PyComplex::from_doubles(py, re, im).into_any(),
        Item::Str(b) => py_str(py, store, b)?,
        Item::Sym(id) => store.py_symbol(py, id)?.into_any(),
        Item::Bytes(b) => PyBytes::new(py, b).into_any(),
        Item::BytesExt(ext) => {
            PyBytes::new(py, store.reader.payload_checked(ext).map_err(&err)?).into_any()
        }
        Item::List(node) | Item::Tuple(node) => {
            let r = &store.reader;
            let seq = r.seq(node).map_err(&err)?;
            if let Some((elem, bytes)) = r.packed(seq) {
                // Packed numbers (a bbox, say): each element read straight from its bytes.
                let items = bytes
                    .chunks_exact(elem.size())
                    .map(|b| match read_elem(elem, b) {
                        Some(Scalar::Float(f)) => Ok(PyFloat::new(py, f).into_any()),
                        Some(Scalar::Int(i)) => i.into_bound_py_any(py),
                        Some(Scalar::Bool(b)) => Ok(PyBool::new(py, b).to_owned().into_any()),
                        None => Err(err(ArchiveError::Corrupt(
                            "a packed bool is not 0 or 1".into(),
                        ))
                        .into()),
                    });
                return new_sequence(py, r.is_tuple(node), seq.len, items);
            }
            let items = (0..seq.len).map(|i| {
                let it = r.seq_get(seq, i).map_err(&err)?;
                value_at(py, store, it, depth + 1)
            });
            new_sequence(py, r.is_tuple(node), seq.len, items)?
        }
        Item::Dict(node) => {
            let r = &store.reader;
            if let Some(keys) = r.dict_shape_keys(node) {
                let d = new_dict(py, keys.len())?;
                // A shaped dict: its keys are symbols, made into Python strs once per store
                // (with their hash cached), set straight into the new dict.
                let syms = store.py_symbols(py)?;
                for (i, &k) in keys.iter().enumerate() {
                    let Some(key) = syms.get(k as usize) else {
                        return Err(
                            err(ArchiveError::Corrupt(format!("symbol {k} out of range"))).into(),
                        );
                    };
                    let v = r.dict_value(node, i).map_err(&err)?;
                    let v = value_at(py, store, v, depth + 1)?;
                    // SAFETY: `d` is a new dict of ours, `key` a str, `v` a live object; the
                    // call takes its own references (or fails with an exception set).
                    if unsafe { ffi::PyDict_SetItem(d.as_ptr(), key.as_ptr(), v.as_ptr()) } < 0 {
                        return Err(PyErr::fetch(py));
                    }
                }
                return Ok(d.into_any());
            }
            let d = PyDict::new(py);
            let n = r.dict_len(node).map_err(&err)?;
            for i in 0..n {
                let k = dict_key(py, store, node, i)?;
                let v = r.dict_value(node, i).map_err(&err)?;
                d.set_item(k, value_at(py, store, v, depth + 1)?)?;
            }
            // Two equal keys (a writer never stores them: they come from a Python dict)
            // would make a dict shorter than the stored one says (`len(view)`): refused, as
            // `verify()` refuses it (`check_item`).
            if d.len() != n {
                return Err(err(ArchiveError::Corrupt(format!(
                    "a dict of {n} entries holds a key twice"
                )))
                .into());
            }
            d.into_any()
        }
        Item::Array(a) => {
            let a = store.reader.array(a).map_err(&err)?;
            let owner = ArrayOwner::new(store.arc().clone(), a.typestr, a.shape, a.offset);
            let owner = new_untracked(py, owner)?;
            let cannot = |e: PyErr| {
                PyErr::from(err(ArchiveError::Corrupt(format!(
                    "numpy cannot represent the stored array ({e})"
                ))))
            };
            if let Some(arr) = ndarray::make(owner.clone()) {
                return arr.map_err(cannot);
            }
            let asarray = NP_ASARRAY.get_or_try_init(py, || {
                let np = py.import("numpy").map_err(|e| {
                    Error::Missing(format!(
                        "numpy is needed to read the arrays of this store: {e}"
                    ))
                })?;
                Ok::<_, PyErr>(np.getattr("asarray")?.unbind())
            })?;
            // The metadata passed the reader's checks (dtype allowlist, numpy's size and
            // dimension limits), so numpy should accept it; if a numpy still refuses, the
            // array is unreadable here, which is reported as such.
            asarray.bind(py).call1((owner,)).map_err(cannot)?
        }
    })
}

#[cfg(not(feature = "abi3"))]
extern "C" {
    // Exported by every CPython this module builds for without the stable ABI (declared in
    // cpython/dictobject.h), not by pyo3-ffi.
    fn _PyDict_NewPresized(minused: ffi::Py_ssize_t) -> *mut ffi::PyObject;
}

/// A new dict with room for `n` entries: filling it never resizes its table.
#[inline]
fn new_dict(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyDict>> {
    #[cfg(not(feature = "abi3"))]
    // SAFETY: the GIL is held; the call returns a new dict or NULL with an exception set,
    // which `from_owned_ptr_or_err` takes over. `n` is a shape's key count (small).
    return unsafe {
        Ok(
            Bound::from_owned_ptr_or_err(py, _PyDict_NewPresized(n as ffi::Py_ssize_t))?
                .cast_into_unchecked(),
        )
    };
    #[cfg(feature = "abi3")]
    {
        let _ = n;
        Ok(PyDict::new(py))
    }
}

/// A new list (or tuple) of `len` items, each set in place as it is made: no intermediate
/// vector. If an item fails, the container is dropped with the slots not yet set still
/// empty, which the list and tuple deallocators allow.
#[inline]
fn new_sequence<'py>(
    py: Python<'py>,
    tuple: bool,
    len: usize,
    items: impl Iterator<Item = PyResult<Bound<'py, PyAny>>>,
) -> PyResult<Bound<'py, PyAny>> {
    let n = len as ffi::Py_ssize_t; // a stored count is bounded by the archive's size
                                    // SAFETY: the constructors return a new reference or NULL with an exception set, which
                                    // `from_owned_ptr_or_err` takes over.
    let seq = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            if tuple {
                ffi::PyTuple_New(n)
            } else {
                ffi::PyList_New(n)
            },
        )?
    };
    let mut set = 0;
    for (i, item) in items.take(len).enumerate() {
        set = i + 1;
        let item = item?.into_ptr();
        // SAFETY: `seq` is a new list/tuple of exactly `len` slots, nobody else sees it yet,
        // `i < len`, and the slot is empty; the setter steals the reference `into_ptr` gave
        // up. (The stable ABI has only the checked setters, which cannot fail here.)
        unsafe {
            #[cfg(not(feature = "abi3"))]
            if tuple {
                ffi::PyTuple_SET_ITEM(seq.as_ptr(), i as ffi::Py_ssize_t, item);
            } else {
                ffi::PyList_SET_ITEM(seq.as_ptr(), i as ffi::Py_ssize_t, item);
            }
            #[cfg(feature = "abi3")]
            if tuple {
                ffi::PyTuple_SetItem(seq.as_ptr(), i as ffi::Py_ssize_t, item);
            } else {
                ffi::PyList_SetItem(seq.as_ptr(), i as ffi::Py_ssize_t, item);
            }
        }
    }
    if set != len {
        // Never hand out a container with empty slots (the callers give exactly `len`).
        return Err(Error::Corrupt {
            at: "a stored list or tuple".into(),
            what: format!("{set} of its {len} items could be read"),
        }
        .into());
    }
    Ok(seq)
}

/// A stored str, UTF-8 checked once, by CPython's decoder: invalid bytes are corrupt data.
///
/// An ASCII str of two or more bytes (most keys, names, paths and much text) is made
/// directly: a new ASCII str object, the bytes copied into it and checked to be ASCII in
/// the same pass (`archive::ascii::copy_ascii`: each byte is tested as it was written, from the register
/// it was stored from). The check that decides is thus of the copy, which no other process
/// can change: a byte changed in the segment between a check and a copy could otherwise put
/// a byte over 127 into an ASCII str. If it is not ASCII, the object is dropped and the
/// decoder makes the str; bytes whose first eight are not ASCII go to the decoder at once.
/// CPython's decoder does the same for ASCII bytes after working out which kind of str they
/// make: this saves ~120 of the ~630 instructions of reading a 30-byte file name, and the
/// one pass ~700 of reading a 1 KB document (callgrind, 3.11). Shorter strs go to the
/// decoder, which returns its cached one-character strs.
#[inline]
fn py_str<'py>(py: Python<'py>, store: &Store, b: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    #[cfg(not(feature = "abi3"))]
    if let Some(obj) = ascii_str(py, b) {
        // SAFETY: a new reference or NULL with an exception set (`ascii_str`).
        return unsafe { Bound::from_owned_ptr_or_err(py, obj) };
    }
    // SAFETY: `b` is a valid slice for the call (it borrows the store's mapping, which the
    // caller's `store` keeps alive), its length fits an isize (a slice's always does), and
    // "strict" is a NUL-terminated C string. The decoder copies the bytes and checks them;
    // it returns a new reference or NULL with an exception set, which `from_owned_ptr_or_err`
    // takes over.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyUnicode_DecodeUTF8(
                b.as_ptr().cast(),
                b.len() as ffi::Py_ssize_t,
                c"strict".as_ptr(),
            ),
        )
    };
    obj.map_err(|_| {
        store.archive_err()(ArchiveError::Corrupt(
            "a stored str is not valid UTF-8".into(),
        ))
        .into()
    })
}

/// `b` as a new ASCII str made directly (see [`py_str`]): `Some` new reference (NULL with
/// an exception set if CPython could not allocate it), or `None` if `b` is shorter than
/// two bytes or not ASCII, for the decoder to make. Makes no `PyErr` and cannot panic, so
/// the tiny read paths use it too (`slots::str_ptr`).
#[cfg(not(feature = "abi3"))]
#[inline(always)]
pub(crate) fn ascii_str(_py: Python<'_>, b: &[u8]) -> Option<*mut ffi::PyObject> {
    if b.len() < 2 {
        return None;
    }
    if let Some(head) = b.first_chunk::<8>() {
        if u64::from_ne_bytes(*head) & crate::archive::ascii::HIGH_BITS != 0 {
            return None;
        }
    }
    // SAFETY: the thread is attached (`_py`); `PyUnicode_New` with a
    // maximum character of 127 makes a compact ASCII str of `b.len()` characters (a slice's
    // length fits an isize) whose data, `PyUnicode_DATA`, has room for exactly that many
    // bytes (plus the terminating NUL it writes itself), not overlapping `b`. It is new and
    // unshared, so filling it is allowed (CPython's documented way of making a str); it is
    // handed out only if the bytes written into it are ASCII (`copy_ascii`), all such a str
    // may hold, and dropped otherwise (its deallocation reads no character). NULL means an
    // exception set.
    unsafe {
        let obj = ffi::PyUnicode_New(b.len() as ffi::Py_ssize_t, 127);
        if obj.is_null() {
            return Some(obj);
        }
        if crate::archive::ascii::copy_ascii(b, ffi::PyUnicode_DATA(obj).cast::<u8>()) {
            return Some(obj);
        }
        ffi::Py_DECREF(obj);
    }
    None
}

/// The value of a node (a record root or a view's position).
#[inline(always)]
pub(crate) fn node_value<'py>(
    py: Python<'py>,
    store: &StoreRef,
    node: Node,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let item = store.reader.item(node).map_err(store.archive_err())?;
    value(py, store, item, deep)
}

/// Key `i` of a stored dict, checked to be of a key type: corrupted bytes can make any
/// value sit in a key position, and that must be CorruptStoreError, not a TypeError.
pub(crate) fn dict_key<'py>(
    py: Python<'py>,
    store: &StoreRef,
    node: Node,
    i: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let r = &store.reader;
    let k = r.dict_key(node, i).map_err(store.archive_err())?;
    if let Item::Sym(id) = k {
        return Ok(store.py_symbol(py, id)?.into_any());
    }
    r.item_key(k).map_err(store.archive_err())?;
    value(py, store, k, true)
}

pub(crate) fn is_view(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<ListView>() || obj.is_instance_of::<DictView>()
}

/// Views compare as the plain objects they hold (and a view on the other side too).
fn compare_plain<'py>(
    mine: Bound<'py, PyAny>,
    other: &Bound<'py, PyAny>,
    op: CompareOp,
) -> PyResult<Py<PyAny>> {
    let theirs = if is_view(other) {
        other.call_method0("to_python")?
    } else {
        other.clone()
    };
    Ok(mine.rich_compare(theirs, op)?.unbind())
}

/// What a pickled view carries: the store's (path, flag), record, position, and form.
pub(crate) type ViewPickleArgs = (String, String, u64, u64, u8, u32);

/// Pickle a view by (store, record, position, form); `_rebuild_view` (src/py/pickle.rs)
/// undoes it.
fn reduce_view<'py>(
    py: Python<'py>,
    store: &Store,
    node: Node,
) -> PyResult<(Bound<'py, PyAny>, ViewPickleArgs)> {
    let rebuild = super::store::Rebuild::View.function(py)?;
    let (path, flag, rec, pos) = store.pickle_args(node.record() as u64, node.pos())?;
    let (form, aux) = node.form_code();
    Ok((rebuild, (path, flag, rec, pos, form, aux)))
}
