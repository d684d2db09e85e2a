//! Lazy read-only views over archived containers, their iterators, and the owner object
//! behind zero-copy numpy arrays.
//!
//! A view holds an `Arc<Store>` and a validated `Node` — Rust data only, no Python
//! references — so it is untracked by the cyclic GC and can never be part of a cycle.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyList, PySlice, PyString, PyTuple};
use pyo3::PyClass;

use super::decode;
use super::encode::py_key;
use super::errors::archive_err;
use super::store::{Source, Store};
use crate::archive::{ArchivedValue, Node};

/// Create a pyclass instance and take it out of the cyclic GC: it holds no Python
/// references, so no cycle can pass through it (what CPython does for atomic tuples).
pub fn new_untracked<T: PyClass>(
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

pub fn is_view(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<ListView>() || obj.is_instance_of::<DictView>()
}

/// Normalise a Python index against `len` (negative indexes count from the end).
pub fn norm_index(i: isize, len: usize, what: &str) -> PyResult<usize> {
    let j = if i < 0 { i + len as isize } else { i };
    if j < 0 || j as usize >= len {
        return Err(PyIndexError::new_err(format!(
            "{what} index {i} out of range (len {len})"
        )));
    }
    Ok(j as usize)
}

/// (path, "s" for a segment or "" for a saved file, record, position): what a pickle
/// carries. A segment's name is its file name, so it is not repeated.
pub type ReduceArgs = (String, String, u64, u64);
type Reduced<'py> = (Bound<'py, PyAny>, ReduceArgs);

/// The pickle payload of anything that lives in a store: its source and position.
pub fn reduce_args(store: &Store, rec: u64, pos: u64) -> ReduceArgs {
    match &store.source {
        Source::Segment { path, .. } => (path.display().to_string(), "s".into(), rec, pos),
        Source::File { path } => (path.display().to_string(), String::new(), rec, pos),
    }
}

fn truncated_repr(
    py: Python<'_>,
    items: impl Iterator<Item = PyResult<String>>,
) -> PyResult<String> {
    let _ = py;
    let mut out = String::new();
    for (n, item) in items.enumerate() {
        if n > 0 {
            out.push_str(", ");
        }
        if n >= 6 || out.len() > 120 {
            out.push_str("...");
            return Ok(out);
        }
        let mut r = item?;
        if r.len() > 60 {
            r.truncate(r.char_indices().nth(57).map(|(i, _)| i).unwrap_or(r.len()));
            r.push_str("...");
        }
        out.push_str(&r);
    }
    Ok(out)
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

/// Pickle a view by (store, record, position).
fn reduce_view<'py>(py: Python<'py>, store: &Store, node: Node) -> PyResult<Reduced<'py>> {
    let rebuild = py.import("shmstore._native")?.getattr("_rebuild_view")?;
    Ok((
        rebuild,
        reduce_args(store, node.record() as u64, node.pos()),
    ))
}

// ---------------------------------------------------------------------------------------

/// A stored list or tuple: a read-only `collections.abc.Sequence`.
#[pyclass(name = "ListView", module = "shmstore", frozen, weakref, sequence)]
pub struct ListView {
    store: Arc<Store>,
    node: Node,
}

impl ListView {
    pub fn new(store: Arc<Store>, node: Node) -> Self {
        ListView { store, node }
    }

    fn items(&self) -> (&[ArchivedValue], bool) {
        match self.store.reader.get(self.node) {
            ArchivedValue::List(items) => (items.as_slice(), false),
            ArchivedValue::Tuple(items) => (items.as_slice(), true),
            _ => (&[], false),
        }
    }

    fn item<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (items, _) = self.items();
        decode::value(py, &self.store, self.node, &items[i], false)
    }
}

#[pymethods]
impl ListView {
    fn __len__(&self) -> usize {
        self.items().0.len()
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (items, is_tuple) = self.items();
        if let Ok(i) = index.cast::<PyInt>() {
            let i: isize = i
                .extract()
                .map_err(|_| PyIndexError::new_err("ListView index out of range"))?;
            let v = &items[norm_index(i, items.len(), "ListView")?];
            return decode::value(py, &self.store, self.node, v, false);
        }
        if let Ok(slice) = index.cast::<PySlice>() {
            let ind = slice.indices(items.len() as isize)?;
            let mut out = Vec::with_capacity(ind.slicelength);
            let mut i = ind.start;
            for _ in 0..ind.slicelength {
                out.push(self.item(py, i as usize)?);
                i += ind.step;
            }
            return Ok(if is_tuple {
                PyTuple::new(py, out)?.into_any()
            } else {
                PyList::new(py, out)?.into_any()
            });
        }
        let i: isize = index.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "ListView indices must be integers or slices, not {}",
                index
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        self.item(py, norm_index(i, items.len(), "ListView")?)
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, ListIter>> {
        let me = slf.get();
        new_untracked(
            slf.py(),
            ListIter {
                store: me.store.clone(),
                node: me.node,
                next: AtomicUsize::new(0),
                reverse: false,
            },
        )
    }

    fn __reversed__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, ListIter>> {
        let me = slf.get();
        new_untracked(
            slf.py(),
            ListIter {
                store: me.store.clone(),
                node: me.node,
                next: AtomicUsize::new(0),
                reverse: true,
            },
        )
    }

    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        for i in 0..self.items().0.len() {
            if self.item(py, i)?.eq(value)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Index of the first item equal to `value` (ValueError if absent).
    #[pyo3(signature = (value, start=0, stop=None))]
    fn index(
        &self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<usize> {
        let len = self.items().0.len() as isize;
        let clamp = |i: isize| if i < 0 { (i + len).max(0) } else { i.min(len) } as usize;
        let (s, e) = (clamp(start), clamp(stop.unwrap_or(len)));
        for i in s..e {
            if self.item(py, i)?.eq(value)? {
                return Ok(i);
            }
        }
        Err(PyValueError::new_err("value is not in ListView"))
    }

    /// Number of items equal to `value`.
    fn count(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut n = 0;
        for i in 0..self.items().0.len() {
            if self.item(py, i)?.eq(value)? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Plain Python objects equal to the stored value (a list, or a tuple for a tuple).
    /// Arrays inside stay read-only zero-copy numpy arrays.
    fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        decode::node_value(py, &self.store, self.node, true)
    }

    fn __richcmp__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        compare_plain(self.to_python(py)?, other, op)
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        if self.items().1 {
            return self.to_python(py)?.hash();
        }
        Err(PyTypeError::new_err(
            "unhashable type: 'ListView' (a stored list)",
        ))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (items, is_tuple) = self.items();
        let inner = truncated_repr(
            py,
            (0..items.len()).map(|i| Ok(self.item(py, i)?.repr()?.to_string())),
        )?;
        Ok(if is_tuple {
            format!(
                "ListView(({inner}{}))",
                if items.len() == 1 { "," } else { "" }
            )
        } else {
            format!("ListView([{inner}])")
        })
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Reduced<'py>> {
        reduce_view(py, &self.store, self.node)
    }
}

#[pyclass(name = "ListViewIterator", module = "shmstore", frozen)]
pub struct ListIter {
    store: Arc<Store>,
    node: Node,
    next: AtomicUsize,
    reverse: bool,
}

#[pymethods]
impl ListIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let items = match self.store.reader.get(self.node) {
            ArchivedValue::List(items) | ArchivedValue::Tuple(items) => items.as_slice(),
            _ => &[],
        };
        // A plain load/store, not an atomic read-modify-write (a locked instruction on
        // every item): iterators are not meant to be shared between threads, and if one
        // is, the worst case is an item seen twice, never a bad read.
        let k = self.next.load(Ordering::Relaxed);
        self.next.store(k + 1, Ordering::Relaxed);
        if k >= items.len() {
            self.next.store(items.len(), Ordering::Relaxed);
            return Ok(None);
        }
        let i = if self.reverse { items.len() - 1 - k } else { k };
        decode::value(py, &self.store, self.node, &items[i], false).map(Some)
    }
}

// ---------------------------------------------------------------------------------------

/// A stored dict: a read-only `collections.abc.Mapping`.
#[pyclass(name = "DictView", module = "shmstore", frozen, weakref, mapping)]
pub struct DictView {
    store: Arc<Store>,
    node: Node,
}

impl DictView {
    pub fn new(store: Arc<Store>, node: Node) -> Self {
        DictView { store, node }
    }

    /// Interleaved `k0, v0, k1, v1, ...` and the hash index (empty for small dicts).
    fn parts(&self) -> (&[ArchivedValue], &[rkyv::Archived<u32>]) {
        decode::dict_parts(self.store.reader.get(self.node))
    }

    fn len(&self) -> usize {
        self.parts().0.len() / 2
    }

    /// Entry number of `key`, or None (unhashable/unsupported key types are simply absent).
    fn find(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let (items, index) = self.parts();
        let err = |e| archive_err(e, &self.store.describe());
        if let Ok(s) = key.cast::<PyString>() {
            // Identity first: key literals in user code are interned, and so are the
            // symbols, so the common case compares pointers, not bytes.
            if index.is_empty() {
                let syms = self.store.py_symbols(key.py())?;
                let kp = key.as_ptr();
                for (i, k) in items.iter().step_by(2).enumerate() {
                    if let ArchivedValue::Sym(id) = k {
                        if syms.get(id.to_native() as usize).map(|p| p.as_ptr()) == Some(kp) {
                            return Ok(Some(i));
                        }
                    }
                }
            }
            if let Ok(s) = s.to_str() {
                return self
                    .store
                    .reader
                    .dict_find_str(items, index, s)
                    .map_err(err);
            }
        }
        match py_key(key)? {
            Some(k) => self.store.reader.dict_find(items, index, &k).map_err(err),
            None => {
                // Same contract as dict: an unhashable key is a TypeError.
                key.hash()?;
                Ok(None)
            }
        }
    }

    fn entry_value<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (items, _) = self.parts();
        decode::value(py, &self.store, self.node, &items[2 * i + 1], false)
    }

    fn entry_key<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (items, _) = self.parts();
        decode::dict_key(py, &self.store, self.node, &items[2 * i])
    }
}

static ABC: PyOnceLock<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// `collections.abc.KeysView/ValuesView/ItemsView`: set-like, live views over any Mapping.
pub fn abc_views(py: Python<'_>) -> PyResult<&(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    ABC.get_or_try_init(py, || {
        let abc = py.import("collections.abc")?;
        Ok((
            abc.getattr("KeysView")?.unbind(),
            abc.getattr("ValuesView")?.unbind(),
            abc.getattr("ItemsView")?.unbind(),
        ))
    })
}

#[pymethods]
impl DictView {
    fn __len__(&self) -> usize {
        self.len()
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key)? {
            Some(i) => self.entry_value(py, i),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    /// `view[key]` if present, else `default`.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key)? {
            Some(i) => self.entry_value(py, i),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.find(key)?.is_some())
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, DictIter>> {
        let me = slf.get();
        new_untracked(
            slf.py(),
            DictIter {
                store: me.store.clone(),
                node: me.node,
                next: AtomicUsize::new(0),
            },
        )
    }

    fn keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_views(slf.py())?.0.bind(slf.py()).call1((slf,))
    }

    fn values<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_views(slf.py())?.1.bind(slf.py()).call1((slf,))
    }

    fn items<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_views(slf.py())?.2.bind(slf.py()).call1((slf,))
    }

    /// A plain dict equal to the stored one (nested values converted too).
    fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        decode::node_value(py, &self.store, self.node, true)
    }

    fn __richcmp__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        compare_plain(self.to_python(py)?, other, op)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let n = self.len();
        let inner = truncated_repr(
            py,
            (0..n).map(|i| {
                Ok(format!(
                    "{}: {}",
                    self.entry_key(py, i)?.repr()?,
                    self.entry_value(py, i)?.repr()?
                ))
            }),
        )?;
        Ok(format!("DictView({{{inner}}})"))
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Reduced<'py>> {
        reduce_view(py, &self.store, self.node)
    }
}

#[pyclass(name = "DictViewIterator", module = "shmstore", frozen)]
pub struct DictIter {
    store: Arc<Store>,
    node: Node,
    next: AtomicUsize,
}

#[pymethods]
impl DictIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let (items, _) = decode::dict_parts(self.store.reader.get(self.node));
        let n = items.len() / 2;
        // A plain load/store, not an atomic read-modify-write (a locked instruction on
        // every item): iterators are not meant to be shared between threads, and if one
        // is, the worst case is an item seen twice, never a bad read.
        let i = self.next.load(Ordering::Relaxed);
        self.next.store(i + 1, Ordering::Relaxed);
        if i >= n {
            self.next.store(n, Ordering::Relaxed);
            return Ok(None);
        }
        decode::dict_key(py, &self.store, self.node, &items[2 * i]).map(Some)
    }
}

// ---------------------------------------------------------------------------------------

/// Owns the mapping behind a numpy array (the array's `.base`): numpy reads the data
/// address from `__array_interface__`, marked read-only.
#[pyclass(name = "ArrayOwner", module = "shmstore", frozen, weakref)]
pub struct ArrayOwner {
    store: Arc<Store>,
    typestr: String,
    shape: Vec<usize>,
    offset: usize,
}

impl ArrayOwner {
    pub fn new(store: Arc<Store>, typestr: &str, shape: Vec<usize>, offset: usize) -> Self {
        ArrayOwner {
            store,
            typestr: typestr.to_owned(),
            shape,
            offset,
        }
    }
}

#[pymethods]
impl ArrayOwner {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let addr = self.store.reader.bytes().as_ptr() as usize + self.offset;
        d.set_item("version", 3)?;
        d.set_item("typestr", &self.typestr)?;
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        // (address, read_only=True): numpy marks the array non-writeable, and the pages
        // are mapped PROT_READ anyway.
        d.set_item("data", (addr, true))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmstore.ArrayOwner {} of {}>",
            self.typestr,
            self.store.describe()
        )
    }
}
