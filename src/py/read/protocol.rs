//! The Sequence and Mapping behaviour, once, for handles and views alike.
//!
//! A `SharedList` is the sequence of its store's records and a `ListView` the sequence of a
//! stored list's items; a `SharedDict` maps its store's keys and a `DictView` a stored
//! dict's. [`Seq`] and [`Map`] name such a sequence or mapping (borrowed, so the hot paths
//! `lst[i]` and `d[key]` take no reference count), and the functions below implement the
//! Python protocol on top of them: indexing (ints, numpy integers, anything with
//! `__index__`, slices), `in`, `index`, `count`, `get`, iteration, `repr`. The pyclasses in
//! `handles/` and `read/` only forward to them.
//!
//! (Over 800 lines: the Sequence and Mapping protocols are one piece of behaviour, written once.)

use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::exceptions::PyOverflowError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyList, PySlice, PyString, PyTuple};

use crate::archive::format::Elem;
use crate::archive::reader::SeqAt;
use crate::archive::{ArchiveError, Item, Key, Node};
use crate::py::errors::Error;
use crate::py::keys::{self, probe_key};
use crate::py::read;
use crate::py::read::{DictView, StoreRef};
use crate::py::store::PyField;

/// A sequence: the records of a list store, or the items of a stored list or tuple.
#[derive(Clone, Copy)]
pub(crate) enum Seq<'a> {
    Records(&'a StoreRef),
    Items(&'a StoreRef, Node),
}

impl<'a> Seq<'a> {
    /// The Python class name, for messages.
    fn what(self) -> &'static str {
        match self {
            Seq::Records(_) => "SharedList",
            Seq::Items(..) => "ListView",
        }
    }

    pub(crate) fn len(self) -> usize {
        match self {
            Seq::Records(store) => store.reader.len() as usize,
            // A corrupt container reads as empty here; its items' reads raise.
            Seq::Items(store, node) => store.reader.seq_len(node).unwrap_or(0),
        }
    }

    /// Item `i` (< len): a scalar, or a view of a container. `deep`: containers as plain
    /// Python objects.
    pub(crate) fn item<'py>(
        self,
        py: Python<'py>,
        i: usize,
        deep: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Seq::Records(store) => record(py, store, i, deep),
            Seq::Items(store, node) => {
                let it = store
                    .reader
                    .seq_item(node, i)
                    .map_err(store.archive_err())?;
                read::value(py, store, it, deep)
            }
        }
    }

    /// `seq.get_many(indices)`: the items at `indices`, as a list. For the records of a
    /// store, the index entries of the whole batch are prefetched, then the records' first
    /// bytes, then each is decoded: the cache misses overlap instead of following one
    /// another.
    pub(crate) fn get_many<'py>(
        self,
        py: Python<'py>,
        indices: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let len = self.len();
        let mut at = Vec::new();
        for index in indices.try_iter()? {
            let index = index?;
            let i = match index.extract::<isize>() {
                Ok(i) => i,
                Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
                    return Err(self.out_of_range(&index, None))
                }
                Err(_) => {
                    return Err(Error::IndexType {
                        what: self.what(),
                        got: type_name(&index),
                    }
                    .into())
                }
            };
            match position(i, len) {
                Some(j) => at.push(j),
                None => return Err(self.out_of_range(&index, Some(len))),
            }
        }
        if let Seq::Records(store) = self {
            for &i in &at {
                store.reader.prefetch_record(i as u64);
            }
            for &i in &at {
                store.reader.prefetch_body(i as u64);
            }
        }
        let out = at
            .into_iter()
            .map(|i| self.item(py, i, false))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, out)
    }

    /// A slice comes back as a list (a tuple for a stored tuple).
    fn collect<'py>(
        self,
        py: Python<'py>,
        items: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let is_tuple = match self {
            Seq::Records(_) => false,
            Seq::Items(store, node) => store.reader.is_tuple(node),
        };
        Ok(if is_tuple {
            PyTuple::new(py, items)?.into_any()
        } else {
            PyList::new(py, items)?.into_any()
        })
    }

    /// `seq[index]`: an int (or anything with `__index__`, e.g. numpy integers; negative
    /// counts from the end) or a slice.
    pub(crate) fn getitem<'py>(
        self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // The hot paths, `seq[i]` with an int: for a view the layout is read once.
        if index.is_exact_instance_of::<PyInt>() {
            if let Ok(i) = index.extract::<isize>() {
                match self {
                    Seq::Items(store, node) => {
                        let seq = store.reader.seq(node).map_err(store.archive_err())?;
                        return index_item(py, store, seq, i)
                            .unwrap_or_else(|| Err(self.out_of_range(index, Some(seq.len))));
                    }
                    Seq::Records(store) => {
                        let len = store.reader.len() as usize;
                        return match position(i, len) {
                            Some(j) => record(py, store, j, false),
                            None => Err(self.out_of_range(index, Some(len))),
                        };
                    }
                }
            }
        }
        let len = self.len();
        if index.is_instance_of::<PyInt>() || !index.is_instance_of::<PySlice>() {
            let i = match index.extract::<isize>() {
                Ok(i) => i,
                Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
                    return Err(self.out_of_range(index, None))
                }
                Err(_) => {
                    return Err(Error::IndexType {
                        what: self.what(),
                        got: type_name(index),
                    }
                    .into())
                }
            };
            return match position(i, len) {
                Some(j) => self.item(py, j, false),
                None => Err(self.out_of_range(index, Some(len))),
            };
        }
        let slice = index.cast::<PySlice>()?;
        let ind = slice.indices(len as isize)?;
        let mut out = Vec::with_capacity(ind.slicelength);
        let mut i = ind.start;
        for _ in 0..ind.slicelength {
            out.push(self.item(py, i as usize, false)?);
            i += ind.step;
        }
        self.collect(py, out)
    }

    fn out_of_range(self, index: &Bound<'_, PyAny>, len: Option<usize>) -> PyErr {
        Error::IndexRange {
            what: self.what(),
            index: index.str().map(|s| s.to_string()).unwrap_or_default(),
            len,
        }
        .into()
    }

    /// `value in seq`: exceptions raised by `__eq__` propagate, as for a list.
    pub(crate) fn contains(self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.position(py, value, 0, None)?.is_some())
    }

    /// The first `i` in `start..stop` (clamped like `list.index`) with `seq[i] == value`.
    fn position(
        self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<Option<usize>> {
        let len = self.len() as isize;
        let clamp = |i: isize| if i < 0 { (i + len).max(0) } else { i.min(len) } as usize;
        for i in clamp(start)..clamp(stop.unwrap_or(len)) {
            if self.item(py, i, false)?.eq(value)? {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// `seq.index(value, start, stop)`: ValueError when absent.
    pub(crate) fn index(
        self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<usize> {
        self.position(py, value, start, stop)?
            .ok_or_else(|| Error::NotInSequence { what: self.what() }.into())
    }

    /// `seq.count(value)`.
    pub(crate) fn count(self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut n = 0;
        for i in 0..self.len() {
            n += self.item(py, i, false)?.eq(value)? as usize;
        }
        Ok(n)
    }

    /// Plain Python objects: a list (a tuple for a stored tuple); arrays inside stay
    /// read-only zero-copy numpy arrays.
    pub(crate) fn to_python<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Seq::Items(store, node) => read::node_value(py, store, node, true),
            Seq::Records(_) => {
                let out = (0..self.len())
                    .map(|i| self.item(py, i, true))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(PyList::new(py, out)?.into_any())
            }
        }
    }

    /// The items' reprs, shortened (`[1, 2, ...]`).
    pub(crate) fn repr_items(self, py: Python<'_>) -> PyResult<String> {
        truncated_repr((0..self.len()).map(|i| Ok(self.item(py, i, false)?.repr()?.to_string())))
    }
}

/// The position index `i` names in a sequence of `len` items (negative counts from the
/// end), or None when it is out of range.
#[inline(always)]
pub(crate) fn position(i: isize, len: usize) -> Option<usize> {
    let j = if i < 0 {
        i.checked_add(len as isize)?
    } else {
        i
    };
    usize::try_from(j).ok().filter(|&j| j < len)
}

/// What the reader gave for an item, as the read paths return it: the scalar or view
/// (`read::value`), or the reader's error raised as the store's exception. A `match` inlined
/// into each caller, never a closure: an outlined closure took the item through memory, in
/// pieces then read whole, which stalled the processor on every read.
#[inline(always)]
fn item_value<'py>(
    py: Python<'py>,
    store: &StoreRef,
    item: Result<Item<'_>, ArchiveError>,
) -> PyResult<Bound<'py, PyAny>> {
    match item {
        Ok(it) => read::value(py, store, it, false),
        Err(e) => Err(store.archive_err()(e).into()),
    }
}

/// Item `i` (an int; negative counts from the end) of a sequence whose layout is known, as
/// a scalar or a view; `None` when `i` is out of range.
#[inline(always)]
pub(crate) fn index_item<'py>(
    py: Python<'py>,
    store: &StoreRef,
    seq: SeqAt,
    i: isize,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    let j = position(i, seq.len)?;
    Some(item_value(py, store, store.reader.seq_get(seq, j)))
}

/// Item `i` (an int; negative counts from the end) of the packed field at `node`, `count`
/// elements of `elem`: a scalar; `None` when `i` is out of range.
#[inline(always)]
pub(crate) fn packed_item<'py>(
    py: Python<'py>,
    store: &StoreRef,
    node: Node,
    elem: Elem,
    count: u8,
    i: isize,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    let j = position(i, count as usize)?;
    Some(item_value(
        py,
        store,
        store.reader.packed_get(node.pos(), elem, j),
    ))
}

/// Record `i` (an int; negative counts from the end) of a store, as `lst[i]` gives it;
/// `None` when `i` is out of range.
#[inline(always)]
pub(crate) fn record_item<'py>(
    py: Python<'py>,
    store: &StoreRef,
    i: isize,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    let j = position(i, store.reader.len() as usize)?;
    Some(record(py, store, j, false))
}

/// The value of field `f` of the shaped dict at `node`, its slot read directly.
#[inline(always)]
pub(crate) fn field_value<'py>(
    py: Python<'py>,
    store: &StoreRef,
    node: Node,
    f: PyField,
) -> PyResult<Bound<'py, PyAny>> {
    item_value(py, store, store.reader.struct_slot(node, f.enc, f.off))
}

/// A shaped dict's fields (its shape's row of the store's field table,
/// [`crate::py::store::Store::py_fields`]), kept by its view: `view["field"]` then compares
/// the key with them at once instead of first reaching the table through the store, a chain
/// of five dependent loads on every lookup. Empty for a general dict (or if the store's
/// symbols could not be made), which then takes the long way.
#[derive(Clone, Copy)]
pub(crate) struct FieldTable {
    ptr: *const PyField,
    len: usize,
}

// SAFETY: the table is immutable once made and lives in the store (`Store::py_fields`: made
// once, never moved or freed before the store), and a `FieldTable` is only read through a
// view that holds a reference to that store; sharing or sending it is sharing a `&[PyField]`
// that outlives it.
unsafe impl Send for FieldTable {}
// SAFETY: as above.
unsafe impl Sync for FieldTable {}

impl FieldTable {
    /// The fields of the dict at `node` of `store`.
    #[inline(always)]
    pub(crate) fn of(py: Python<'_>, store: &StoreRef, node: Node) -> Self {
        Self::of_shape(py, store, store.reader.dict_shape(node))
    }

    /// The fields of shape `id` of `store` (empty for `None`).
    #[inline(always)]
    pub(crate) fn of_shape(py: Python<'_>, store: &StoreRef, id: Option<u32>) -> Self {
        match id.and_then(|id| store.py_fields(py, id)) {
            Some(f) => Self::from_slice(f),
            None => FieldTable {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            },
        }
    }

    /// The fields of shape `id` of `store` if its symbols are made (`of_shape` makes them on
    /// first use), for the tiny paths, which call nothing that may fail.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) fn made(py: Python<'_>, store: &StoreRef, id: u32) -> Option<Self> {
        store.py_fields_made(py, id).map(Self::from_slice)
    }

    #[inline(always)]
    fn from_slice(f: &[PyField]) -> Self {
        FieldTable {
            ptr: f.as_ptr(),
            len: f.len(),
        }
    }

    /// The field whose key is the very object `key` (see [`Map::field_by_identity`]).
    /// Only to be called by the holder of a reference to the store the table came from.
    #[inline(always)]
    pub(crate) fn find(&self, key: &Bound<'_, PyAny>) -> Option<PyField> {
        let kp = key.as_ptr() as usize;
        // SAFETY: `ptr`/`len` are a live slice of the store's field table (or dangling with
        // `len` 0, an empty slice), and the caller holds the store (see the `Sync` impl).
        let fields = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        fields.iter().find(|f| f.key == kp).copied()
    }
}

/// A mapping: the entries of a dict store, or of a stored dict.
#[derive(Clone, Copy)]
pub(crate) enum Map<'a> {
    Entries(&'a StoreRef),
    Dict(&'a StoreRef, Node),
}

impl<'a> Map<'a> {
    pub(crate) fn len(self) -> usize {
        match self {
            Map::Entries(store) => store.reader.len() as usize,
            Map::Dict(store, node) => store.reader.dict_len(node).unwrap_or(0),
        }
    }

    /// Entry number of `key`, or None (keys of types that cannot be stored are simply
    /// absent; an unhashable key is a TypeError, as for dict). A miss in a stored dict with
    /// a hash index is confirmed against a forged index (`Reader::confirm_miss`).
    pub(crate) fn find(self, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let found = self.find_unconfirmed(key)?;
        if let (None, Map::Dict(store, node)) = (found, self) {
            if store.reader.dict_indexed(node) {
                store
                    .reader
                    .confirm_miss(node.record() as u64)
                    .map_err(store.archive_err())?;
            }
        }
        Ok(found)
    }

    /// The hot path of `view["field"]`: a shaped dict, and a key that is the very object of
    /// the symbol (key literals in user code are interned, and so are the symbols), so it
    /// is a pointer compare per field, no string compare and no hashing. The entry number
    /// and the field (where its slot is).
    #[inline(always)]
    fn field_by_identity(self, py: Python<'_>, key: &Bound<'_, PyAny>) -> Option<(usize, PyField)> {
        let Map::Dict(store, node) = self else {
            return None;
        };
        let kp = key.as_ptr() as usize;
        let fields = store.py_fields(py, store.reader.dict_shape(node)?)?;
        fields
            .iter()
            .enumerate()
            .find(|(_, f)| f.key == kp)
            .map(|(i, f)| (i, *f))
    }

    /// `self[key]` for a key found by [`Self::field_by_identity`], its slot read directly.
    #[inline(always)]
    fn get_by_identity<'py>(
        self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let Map::Dict(store, node) = self else {
            return None;
        };
        let (_, f) = self.field_by_identity(py, key)?;
        Some(field_value(py, store, node, f))
    }

    /// `self[key]` for an exact `str` key that is present, for the fast paths of
    /// `view["field"]` and `d["key"]` (`read::slots`): `None` when absent, or when anything
    /// needs the long way (another key type, a key that is not valid UTF-8, a corrupt dict),
    /// which then decides.
    #[inline(always)]
    pub(crate) fn get_str_fast<'py>(
        self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        if !key.is_exact_instance_of::<PyString>() {
            return None;
        }
        if let Some(value) = self.get_by_identity(py, key) {
            return Some(value);
        }
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: `key` is a live exact `str` and the GIL is held; the UTF-8 buffer lives as
        // long as the string, which outlives this call. A failure (a lone surrogate) is
        // cleared here rather than made into a `PyErr`.
        let s = unsafe {
            let p = ffi::PyUnicode_AsUTF8AndSize(key.as_ptr(), &mut len);
            if p.is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            std::slice::from_raw_parts(p.cast::<u8>(), usize::try_from(len).ok()?)
        };
        // SAFETY: CPython's UTF-8 form of a str is valid UTF-8.
        let s = unsafe { std::str::from_utf8_unchecked(s) };
        let i = match self {
            Map::Dict(store, node) => store.reader.dict_find_str(node, s).ok().flatten(),
            Map::Entries(store) => {
                let key = Key::Str(std::borrow::Cow::Borrowed(s));
                store.reader.lookup(&key).ok().flatten().map(|e| e as usize)
            }
        }?;
        Some(self.value(py, i, false))
    }

    fn find_unconfirmed(self, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        match self {
            Map::Entries(store) => {
                let k = match key.cast::<PyString>() {
                    Ok(s) => s
                        .to_str()
                        .ok()
                        .map(|s| Key::Str(std::borrow::Cow::Borrowed(s))),
                    Err(_) => probe_key(key)?,
                };
                match k {
                    Some(k) => Ok(store
                        .reader
                        .lookup(&k)
                        .map_err(store.archive_err())?
                        .map(|e| e as usize)),
                    None => unhashable_is_absent(key),
                }
            }
            Map::Dict(store, node) => {
                let r = &store.reader;
                if let Ok(s) = key.cast::<PyString>() {
                    if let Some((i, _)) = self.field_by_identity(key.py(), key) {
                        return Ok(Some(i));
                    }
                    if let Ok(s) = s.to_str() {
                        return r
                            .dict_find_str(node, s)
                            .map_err(|e| store.archive_err()(e).into());
                    }
                }
                match probe_key(key)? {
                    Some(k) => r
                        .dict_find(node, &k)
                        .map_err(|e| store.archive_err()(e).into()),
                    None => unhashable_is_absent(key),
                }
            }
        }
    }

    /// The value of entry `i` (< len); `deep`: containers as plain Python objects.
    pub(crate) fn value<'py>(
        self,
        py: Python<'py>,
        i: usize,
        deep: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Map::Entries(store) => record(py, store, i, deep),
            Map::Dict(store, node) => {
                let it = store
                    .reader
                    .dict_value(node, i)
                    .map_err(store.archive_err())?;
                read::value(py, store, it, deep)
            }
        }
    }

    /// The key of entry `i` (< len).
    pub(crate) fn key<'py>(self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Map::Entries(store) => {
                let k = store.reader.key(i as u64).map_err(store.archive_err())?;
                keys::to_python(py, &k)
            }
            Map::Dict(store, node) => read::dict_key(py, store, node, i),
        }
    }

    /// `mapping[key]`: KeyError when absent.
    pub(crate) fn getitem<'py>(
        self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(value) = self.get_by_identity(py, key) {
            return value;
        }
        match self.find(key)? {
            Some(i) => self.value(py, i, false),
            None => Err(Error::MissingKey(key.clone().unbind()).into()),
        }
    }

    /// `mapping.get(key, default)`.
    pub(crate) fn get<'py>(
        self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.find(key)? {
            Some(i) => self.value(py, i, false),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    /// A plain dict (nested values converted too; arrays stay zero-copy).
    pub(crate) fn to_python<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Map::Dict(store, node) => read::node_value(py, store, node, true),
            Map::Entries(_) => {
                let out = PyDict::new(py);
                for i in 0..self.len() {
                    out.set_item(self.key(py, i)?, self.value(py, i, true)?)?;
                }
                Ok(out.into_any())
            }
        }
    }

    /// The entries' reprs, shortened (`'a': 1, ...`).
    pub(crate) fn repr_items(self, py: Python<'_>) -> PyResult<String> {
        truncated_repr((0..self.len()).map(|i| {
            Ok(format!(
                "{}: {}",
                self.key(py, i)?.repr()?,
                self.value(py, i, false)?.repr()?
            ))
        }))
    }
}

/// Record `i` (< len) of a store: its root value (checked on first access).
#[inline(always)]
fn record<'py>(
    py: Python<'py>,
    store: &StoreRef,
    i: usize,
    deep: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let node = store.reader.root(i as u64).map_err(store.archive_err())?;
    read::node_value(py, store, node, deep)
}

/// A key that cannot be stored is absent, unless it is unhashable: then TypeError, as dict.
fn unhashable_is_absent(key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    key.hash()?;
    Ok(None)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// Join item reprs with ", ", stopping after 6 items or 120 characters.
fn truncated_repr(items: impl Iterator<Item = PyResult<String>>) -> PyResult<String> {
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

static ABC: PyOnceLock<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// `mapping.keys()`, `.values()`, `.items()`: `collections.abc.KeysView/ValuesView/
/// ItemsView` over the mapping object (set-like and live, as for any Mapping).
pub(crate) fn abc_view<'py>(
    mapping: &Bound<'py, PyAny>,
    which: AbcView,
) -> PyResult<Bound<'py, PyAny>> {
    let py = mapping.py();
    let views = ABC.get_or_try_init(py, || {
        let abc = py.import("collections.abc")?;
        Ok::<_, PyErr>((
            abc.getattr("KeysView")?.unbind(),
            abc.getattr("ValuesView")?.unbind(),
            abc.getattr("ItemsView")?.unbind(),
        ))
    })?;
    let cls = match which {
        AbcView::Keys => &views.0,
        AbcView::Values => &views.1,
        AbcView::Items => &views.2,
    };
    cls.bind(py).call1((mapping,))
}

pub(crate) enum AbcView {
    Keys,
    Values,
    Items,
}

/// Where an iterator is: the next position to yield. A plain load/store, not an atomic
/// read-modify-write (a locked instruction on every item): iterators are not meant to be
/// shared between threads, and if one is, the worst case is an item seen twice, never a
/// bad read.
pub(crate) struct Cursor {
    next: AtomicUsize,
    pub(crate) reverse: bool,
}

impl Cursor {
    pub(crate) fn new(reverse: bool) -> Self {
        Cursor {
            next: AtomicUsize::new(0),
            reverse,
        }
    }

    /// The position to yield next in a sequence of `len`, or None at the end.
    pub(crate) fn advance(&self, len: usize) -> Option<usize> {
        let k = self.next.load(Ordering::Relaxed);
        if k >= len {
            self.next.store(len, Ordering::Relaxed);
            return None;
        }
        self.next.store(k + 1, Ordering::Relaxed);
        Some(if self.reverse { len - 1 - k } else { k })
    }
}

/// The next item of a list of shaped dicts (COCO's annotations) as `next_item` makes it,
/// its view made from a dropped one the free list kept, for the tiny path of `next(it)`
/// (`slots::FastNext::tiny_next`); `None`, with the cursor unchanged, for any other
/// sequence, at the end, or with no kept view to take.
#[cfg(not(feature = "abi3"))]
#[inline(always)]
pub(crate) fn tiny_next_struct(
    py: Python<'_>,
    src: &Owned,
    cur: &Cursor,
) -> Option<*mut pyo3::ffi::PyObject> {
    let seq = src.seq?;
    // `Cursor::advance`'s position, without moving yet (the end is left to it).
    let k = cur.next.load(Ordering::Relaxed);
    let i = if cur.reverse {
        seq.len.checked_sub(k)?.checked_sub(1)?
    } else {
        k
    };
    let node = seq.struct_item(i)?;
    let view = || DictView::with_fields(src.store.clone_ref(py), node, src.fields);
    let obj = read::kept_view(py, view)?;
    // Only now, with the item made. With a GIL nothing moved the cursor meanwhile; on a
    // free-threaded interpreter, where threads may share the iterator, this store is
    // `Cursor::advance`'s: an item may be seen twice, none skipped, nothing out of range.
    cur.next.store(k + 1, Ordering::Relaxed);
    Some(obj)
}

/// What an iterator walks: its own reference to the store, plus the node for a view.
pub(crate) struct Owned {
    pub(crate) store: StoreRef,
    pub(crate) node: Option<Node>,
    /// A sequence node's layout, read once (None: records, a dict, or corrupt).
    pub(crate) seq: Option<SeqAt>,
    /// For a sequence of shaped dicts: their shape's fields, found once for every item's
    /// view (empty otherwise).
    pub(crate) fields: FieldTable,
}

impl Owned {
    pub(crate) fn seq(&self) -> Seq<'_> {
        match self.node {
            Some(node) => Seq::Items(&self.store, node),
            None => Seq::Records(&self.store),
        }
    }

    pub(crate) fn map(&self) -> Map<'_> {
        match self.node {
            Some(node) => Map::Dict(&self.store, node),
            None => Map::Entries(&self.store),
        }
    }
}

/// The next item of a sequence iterator.
#[inline(always)]
pub(crate) fn next_item<'py>(
    src: &Owned,
    py: Python<'py>,
    cur: &Cursor,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if let Some(at) = src.seq {
        let Some(i) = cur.advance(at.len) else {
            return Ok(None);
        };
        let store = &src.store;
        // A list of shaped dicts: each item's view gets the fields found at the start.
        if let Some(node) = at.struct_item(i) {
            let view = DictView::with_fields(store.clone_ref(py), node, src.fields);
            return Ok(Some(read::new_view(py, view)?.into_any()));
        }
        return item_value(py, store, store.reader.seq_get(at, i)).map(Some);
    }
    let seq = src.seq();
    let i = cur.advance(seq.len());
    if let (Some(i), Seq::Records(store)) = (i, seq) {
        // Records in order: start loading the next ones while this one is decoded.
        let r = &store.reader;
        let ahead = if cur.reverse {
            i.checked_sub(2)
        } else {
            Some(i + 2)
        };
        if let Some(a) = ahead {
            r.prefetch_record(a as u64);
        }
        let next = if cur.reverse {
            i.checked_sub(1)
        } else {
            Some(i + 1)
        };
        if let Some(n) = next {
            r.prefetch_body(n as u64);
        }
    }
    i.map(|i| seq.item(py, i, false)).transpose()
}

/// The next key of a mapping iterator.
pub(crate) fn next_key<'py>(
    src: &Owned,
    py: Python<'py>,
    cur: &Cursor,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let map = src.map();
    cur.advance(map.len()).map(|i| map.key(py, i)).transpose()
}

/// Define an iterator pyclass named `$pyname` yielding `$next` ([`next_item`] of a [`Seq`]
/// or [`next_key`] of a [`Map`]). One macro, so every iterator behaves the same.
macro_rules! iterator {
    ($ty:ident, $pyname:literal, $next:path) => {
        #[pyo3::pyclass(name = $pyname, module = "shmstore", frozen)]
        pub(crate) struct $ty {
            src: $crate::py::read::protocol::Owned,
            cur: $crate::py::read::protocol::Cursor,
        }

        impl $crate::py::read::HoldsStore for $ty {
            fn into_store(self) -> $crate::py::read::StoreRef {
                self.src.store
            }
        }

        impl $ty {
            /// A new untracked iterator over `store` (a view's `node`), from the end if
            /// `reverse`.
            pub(crate) fn start<'py>(
                py: pyo3::Python<'py>,
                store: &$crate::py::read::StoreRef,
                node: Option<$crate::archive::Node>,
                reverse: bool,
            ) -> pyo3::PyResult<pyo3::Bound<'py, Self>> {
                let seq = node.and_then(|n| store.reader.seq(n).ok());
                Self::start_seq(py, store, node, seq, reverse)
            }

            /// `start` with the node's sequence layout already read (by its view).
            #[inline(always)]
            #[allow(dead_code)]
            pub(crate) fn start_seq<'py>(
                py: pyo3::Python<'py>,
                store: &$crate::py::read::StoreRef,
                node: Option<$crate::archive::Node>,
                seq: Option<$crate::archive::reader::SeqAt>,
                reverse: bool,
            ) -> pyo3::PyResult<pyo3::Bound<'py, Self>> {
                $crate::py::read::new_view(
                    py,
                    $ty {
                        src: $crate::py::read::protocol::Owned {
                            store: store.clone_ref(py),
                            node,
                            seq,
                            fields: $crate::py::read::protocol::FieldTable::of_shape(
                                py,
                                store,
                                seq.and_then(|s| s.struct_shape()),
                            ),
                        },
                        cur: $crate::py::read::protocol::Cursor::new(reverse),
                    },
                )
            }
        }

        impl $crate::py::read::slots::FastNext for $ty {
            #[inline(always)]
            fn fast_next<'py>(
                slf: &pyo3::Bound<'py, Self>,
            ) -> pyo3::PyResult<Option<pyo3::Bound<'py, pyo3::PyAny>>> {
                let it = slf.get();
                $next(&it.src, slf.py(), &it.cur)
            }

            /// Only a list of shaped dicts has one (the others have no layout: `src.seq`).
            #[cfg(not(feature = "abi3"))]
            #[inline(always)]
            fn tiny_next(slf: pyo3::Borrowed<'_, '_, Self>) -> Option<*mut pyo3::ffi::PyObject> {
                let it = slf.get();
                $crate::py::read::protocol::tiny_next_struct(slf.py(), &it.src, &it.cur)
            }
        }

        #[pyo3::pymethods]
        impl $ty {
            fn __iter__(slf: pyo3::Bound<'_, Self>) -> pyo3::Bound<'_, Self> {
                slf
            }

            fn __next__<'py>(
                &self,
                py: pyo3::Python<'py>,
            ) -> pyo3::PyResult<Option<pyo3::Bound<'py, pyo3::PyAny>>> {
                $next(&self.src, py, &self.cur)
            }
        }
    };
}
pub(crate) use iterator;
