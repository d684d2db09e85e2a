//! Reading: archive values -> Python, lazily (views over containers, zero-copy arrays) or
//! deeply (`to_python`). Every Python object made here lives in this process's private heap.
//!
//! A view holds an `Arc<Store>` and a validated `Node` — Rust data only, no Python
//! references — so it is untracked by the cyclic GC and can never be part of a cycle.

mod array;
mod dict_view;
mod list_view;
pub(crate) mod protocol;

pub(crate) use array::ArrayOwner;
pub(crate) use dict_view::{DictIter, DictView};
pub(crate) use list_view::{ListIter, ListView};

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyComplex, PyDict, PyFloat, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use pyo3::{ffi, PyClass};

use super::errors::Error;
use super::keys::bigint;
use super::store::{PickleArgs, Store};
use crate::archive::value::MAX_VALUE_DEPTH;
use crate::archive::{ArchiveError, ArchivedValue, Node};

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

/// The value at `v` (inside `parent`'s record). `deep`: containers become plain objects.
pub(crate) fn value<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    parent: Node,
    v: &ArchivedValue,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    value_at(py, store, parent, v, deep, 0)
}

/// `value`, `depth` containers below where the conversion started. Validation already
/// bounds the nesting of every record; this guard keeps the recursion within the format's
/// limit even so (a record can be well-formed for rkyv and still deeper than any writer
/// makes).
fn value_at<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    parent: Node,
    v: &ArchivedValue,
    deep: bool,
    depth: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let corrupt = |what: String| -> PyErr {
        store.archive_err()(ArchiveError::Corrupt(format!(
            "record {}: {what}",
            parent.record()
        )))
        .into()
    };
    if depth > MAX_VALUE_DEPTH {
        return Err(corrupt(format!(
            "values nested deeper than {MAX_VALUE_DEPTH} levels"
        )));
    }
    Ok(match v {
        ArchivedValue::None => py.None().into_bound(py),
        ArchivedValue::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        ArchivedValue::Int(i) => i.to_native().into_bound_py_any(py)?,
        ArchivedValue::BigInt(b) => bigint(py, b.as_slice())?,
        ArchivedValue::Float(f) => PyFloat::new(py, f.to_native()).into_any(),
        ArchivedValue::Complex(c) => {
            PyComplex::from_doubles(py, c[0].to_native(), c[1].to_native()).into_any()
        }
        ArchivedValue::Str(s) => PyString::new(py, s.as_str()).into_any(),
        ArchivedValue::Sym(id) => store.py_symbol(py, id.to_native())?.into_any(),
        ArchivedValue::Bytes(b) => PyBytes::new(py, b.as_slice()).into_any(),
        ArchivedValue::BytesExt(ext) => PyBytes::new(
            py,
            store
                .reader
                .payload(parent, ext)
                .map_err(store.archive_err())?,
        )
        .into_any(),
        ArchivedValue::List(items) | ArchivedValue::Tuple(items) => {
            let node = store.reader.child(parent, v);
            let is_tuple = matches!(v, ArchivedValue::Tuple(_));
            if !deep {
                return Ok(new_untracked(py, ListView::new(store.clone(), node))?.into_any());
            }
            let objs = items
                .iter()
                .map(|it| value_at(py, store, node, it, true, depth + 1))
                .collect::<PyResult<Vec<_>>>()?;
            if is_tuple {
                PyTuple::new(py, objs)?.into_any()
            } else {
                PyList::new(py, objs)?.into_any()
            }
        }
        ArchivedValue::Dict(_) | ArchivedValue::IndexedDict(_) => {
            let node = store.reader.child(parent, v);
            if !deep {
                return Ok(new_untracked(py, DictView::new(store.clone(), node))?.into_any());
            }
            let (items, _) = dict_parts(v);
            if items.len() % 2 != 0 {
                return Err(corrupt("a dict with a key but no value".into()));
            }
            let d = PyDict::new(py);
            for kv in items.chunks_exact(2) {
                // Checked like a view's keys: a list in key position is a corrupt record
                // (CorruptStoreError), not the TypeError `set_item` would raise.
                store
                    .reader
                    .value_key(&kv[0])
                    .map_err(store.archive_err())?;
                d.set_item(
                    value_at(py, store, node, &kv[0], true, depth + 1)?,
                    value_at(py, store, node, &kv[1], true, depth + 1)?,
                )?;
            }
            d.into_any()
        }
        ArchivedValue::Array(meta) => {
            let a = store
                .reader
                .array(parent, meta)
                .map_err(store.archive_err())?;
            let owner = ArrayOwner::new(store.clone(), a.typestr, a.shape, a.offset);
            let owner = new_untracked(py, owner)?;
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
            asarray
                .bind(py)
                .call1((owner,))
                .map_err(|e| corrupt(format!("numpy cannot represent the stored array ({e})")))?
        }
    })
}

/// The value of a node (a record root or a view's position).
pub(crate) fn node_value<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    node: Node,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let v = store.reader.get(node);
    // A node's own value: its "parent" for payload bounds is the same record.
    value(py, store, node, v, deep)
}

/// A key stored inside a record, checked to be of a key type: corrupted bytes can make
/// any value sit in a key position, and that must be CorruptStoreError, not a TypeError.
pub(crate) fn dict_key<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    node: Node,
    k: &ArchivedValue,
) -> PyResult<Bound<'py, PyAny>> {
    store.reader.value_key(k).map_err(store.archive_err())?;
    value(py, store, node, k, true)
}

/// Interleaved items and index of an archived dict (empty for anything else).
pub(crate) fn dict_parts(v: &ArchivedValue) -> (&[ArchivedValue], &[rkyv::Archived<u32>]) {
    match v {
        ArchivedValue::Dict(items) => (items.as_slice(), &[]),
        ArchivedValue::IndexedDict(d) => (d.items.as_slice(), d.index.as_slice()),
        _ => (&[], &[]),
    }
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

/// Pickle a view by (store, record, position); `_rebuild_view` (src/py/pickle.rs) undoes it.
fn reduce_view<'py>(
    py: Python<'py>,
    store: &Store,
    node: Node,
) -> PyResult<(Bound<'py, PyAny>, PickleArgs)> {
    let rebuild = py.import("shmstore._native")?.getattr("_rebuild_view")?;
    Ok((rebuild, store.pickle_args(node.record() as u64, node.pos())))
}
