//! Archive values -> Python: lazy (views for containers) or deep (`to_python`).
//! Every Python object made here lives in this process's private heap.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyComplex, PyDict, PyFloat, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use super::errors::{archive_err, Exc};
use super::store::Store;
use super::views::{new_untracked, ArrayOwner, DictView, ListView};
use crate::archive::value::MAX_VALUE_DEPTH;
use crate::archive::{ArchiveError, ArchivedValue, Key, Node};

static NP_ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn bigint<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("signed", true)?;
    py.get_type::<pyo3::types::PyInt>().call_method(
        "from_bytes",
        (PyBytes::new(py, bytes), "little"),
        Some(&kwargs),
    )
}

/// The value at `v` (inside `parent`'s record). `deep`: containers become plain objects.
pub fn value<'py>(
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
    let err = |e| archive_err(e, &store.describe());
    if depth > MAX_VALUE_DEPTH {
        return Err(err(ArchiveError::Corrupt(format!(
            "record {}: values nested deeper than {MAX_VALUE_DEPTH} levels",
            parent.record()
        ))));
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
        ArchivedValue::BytesExt(ext) => {
            PyBytes::new(py, store.reader.payload(parent, ext).map_err(err)?).into_any()
        }
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
                return Err(err(ArchiveError::Corrupt(format!(
                    "record {}: a dict with a key but no value",
                    parent.record()
                ))));
            }
            let d = PyDict::new(py);
            for kv in items.chunks_exact(2) {
                // Checked like a view's keys: a list in key position is a corrupt record
                // (CorruptStoreError), not the TypeError `set_item` would raise.
                store.reader.value_key(&kv[0]).map_err(err)?;
                d.set_item(
                    value_at(py, store, node, &kv[0], true, depth + 1)?,
                    value_at(py, store, node, &kv[1], true, depth + 1)?,
                )?;
            }
            d.into_any()
        }
        ArchivedValue::Array(meta) => {
            let a = store.reader.array(parent, meta).map_err(err)?;
            let owner = ArrayOwner::new(store.clone(), a.typestr, a.shape, a.offset);
            let owner = new_untracked(py, owner)?;
            let asarray = NP_ASARRAY.get_or_try_init(py, || {
                let np = py.import("numpy").map_err(|e| {
                    Exc::Base.err(format!(
                        "numpy is needed to read the arrays of this store: {e}"
                    ))
                })?;
                Ok::<_, PyErr>(np.getattr("asarray")?.unbind())
            })?;
            // The metadata passed the reader's checks (dtype allowlist, numpy's size and
            // dimension limits), so numpy should accept it; if a numpy still refuses, the
            // array is unreadable here, which is reported as such.
            asarray.bind(py).call1((owner,)).map_err(|e| {
                err(ArchiveError::Corrupt(format!(
                    "record {}: numpy cannot represent the stored array ({e})",
                    parent.record()
                )))
            })?
        }
    })
}

/// A key stored inside a record, checked to be of a key type: corrupted bytes can make
/// any value sit in a key position, and that must be CorruptStoreError, not a TypeError.
pub fn dict_key<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    node: Node,
    k: &ArchivedValue,
) -> PyResult<Bound<'py, PyAny>> {
    store
        .reader
        .value_key(k)
        .map_err(|e| archive_err(e, &store.describe()))?;
    value(py, store, node, k, true)
}

/// Interleaved items and index of an archived dict (empty for anything else).
pub fn dict_parts(v: &ArchivedValue) -> (&[ArchivedValue], &[rkyv::Archived<u32>]) {
    match v {
        ArchivedValue::Dict(items) => (items.as_slice(), &[]),
        ArchivedValue::IndexedDict(d) => (d.items.as_slice(), d.index.as_slice()),
        _ => (&[], &[]),
    }
}

/// The value of a node (a record root or a view's position).
pub fn node_value<'py>(
    py: Python<'py>,
    store: &Arc<Store>,
    node: Node,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let v = store.reader.get(node);
    // A node's own value: its "parent" for payload bounds is the same record.
    value(py, store, node, v, deep)
}

/// A dict key (from a dict archive's key table) as a Python object.
pub fn key<'py>(py: Python<'py>, k: &Key<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match k {
        Key::None => py.None().into_bound(py),
        Key::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Key::Int(i) => i.into_bound_py_any(py)?,
        Key::BigInt(b) => bigint(py, b)?,
        Key::Float(f) => PyFloat::new(py, *f).into_any(),
        Key::Str(s) => PyString::new(py, s).into_any(),
        Key::Bytes(b) => PyBytes::new(py, b).into_any(),
        Key::Tuple(items) => PyTuple::new(
            py,
            items
                .iter()
                .map(|it| key(py, it))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
    })
}
