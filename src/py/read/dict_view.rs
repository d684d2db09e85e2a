//! `DictView`: a stored dict as a read-only `collections.abc.Mapping`.

use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
#[cfg(not(feature = "abi3"))]
use pyo3::{ffi, Borrowed};

use super::protocol::{abc_view, field_value, iterator, next_key, AbcView, FieldTable, Map};
#[cfg(not(feature = "abi3"))]
use super::scalar_ptr;
use super::{compare_plain, reduce_view, ViewPickleArgs};
use crate::archive::Node;
#[cfg(not(feature = "abi3"))]
use crate::archive::{
    format::{Enc, Scalar},
    reader::Form,
    Item,
};
use crate::py::read::StoreRef;

/// A stored dict: a read-only `collections.abc.Mapping`.
#[pyclass(name = "DictView", module = "shmstore", frozen, weakref, mapping)]
pub(crate) struct DictView {
    store: StoreRef,
    node: Node,
    /// A shaped dict's fields, found when the view is made (empty otherwise).
    fields: FieldTable,
}

iterator!(DictIter, "DictViewIterator", next_key);

impl super::freelist::HoldsStore for DictView {
    fn into_store(self) -> StoreRef {
        self.store
    }
}

impl super::slots::FastGet for DictView {
    /// `view[key]` with an exact str that is present: first by the key's identity in the
    /// view's own field table, else as any mapping does.
    #[inline(always)]
    fn fast_get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let v = slf.get();
        if let Some(f) = v.fields.find(key) {
            return Some(field_value(slf.py(), &v.store, v.node, f));
        }
        v.map().get_str_fast(slf.py(), key)
    }

    /// `view["field"]` of a shaped dict, the key the field's own str object (a literal in
    /// user code): a slot that holds None, a bool, an int, a float, a str, a packed list or
    /// a list of shaped dicts made at once (a str out of line; a list view from a kept one,
    /// else out of line), any other read out of line.
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    fn tiny_get(
        slf: Borrowed<'_, '_, Self>,
        key: Borrowed<'_, '_, PyAny>,
    ) -> Option<*mut ffi::PyObject> {
        let (v, py) = (slf.get(), slf.py());
        let f = v.fields.find(&key)?;
        let store = &v.store;
        let Some(item) = store.reader.struct_slot_small(v.node, f.enc, f.off) else {
            // A list of shaped dicts (COCO's annotations): its view made at once from a kept
            // object where there is one.
            if f.enc == Enc::Ref {
                if let Some((node, seq)) = store.reader.struct_slot_seq_small(v.node, f.off) {
                    let view = || super::ListView::with_seq(store.clone_ref(py), node, seq);
                    if let Some(p) = super::kept_view(py, view) {
                        return Some(p);
                    }
                }
            }
            // Another kind of slot (a reference, bytes), or an error: read (or raised) out of
            // line, the field already found.
            return Some(super::slots::field_ptr(py, v, f));
        };
        Some(match item {
            Item::None => {
                // SAFETY: the thread is attached (`py`); `None` gets a reference of its own.
                unsafe {
                    let p = ffi::Py_None();
                    ffi::Py_INCREF(p);
                    p
                }
            }
            Item::Bool(b) => scalar_ptr(py, Scalar::Bool(b)),
            Item::Int(i) => scalar_ptr(py, Scalar::Int(i)),
            Item::Float(x) => scalar_ptr(py, Scalar::Float(x)),
            Item::Str(b) => super::slots::str_ptr(py, store, b),
            Item::List(node) | Item::Tuple(node) => {
                // A packed field's view holds no layout (`ListView::packed`): made at
                // once from a kept object where there is one.
                if let Form::Pack { .. } = node.form {
                    let view = || super::ListView::packed(store.clone_ref(py), node);
                    if let Some(p) = super::kept_view(py, view) {
                        return Some(p);
                    }
                }
                let (rec, form, pos) = node.into_parts();
                super::slots::list_view_ptr(py, store, rec, form, pos)
            }
            // Not made by `struct_slot_small`.
            _ => return None,
        })
    }

    super::slots::original_slot!();
}

impl super::slots::FastLen for DictView {
    #[inline(always)]
    fn fast_len(slf: &Bound<'_, Self>) -> usize {
        slf.get().map().len()
    }
}

impl super::slots::FastIter for DictView {
    #[inline(always)]
    fn fast_iter<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let v = slf.get();
        Ok(DictIter::start(slf.py(), &v.store, Some(v.node), false)?.into_any())
    }
}

impl DictView {
    #[inline(always)]
    pub(crate) fn new(py: Python<'_>, store: StoreRef, node: Node) -> Self {
        let fields = FieldTable::of(py, &store, node);
        Self::with_fields(store, node, fields)
    }

    /// The store and the node this view shows.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(super) fn shows(&self) -> (&StoreRef, Node) {
        (&self.store, self.node)
    }

    /// A view of the dict at `node`, whose fields (those of its shape in `store`, or empty)
    /// the caller already found.
    #[inline(always)]
    pub(crate) fn with_fields(store: StoreRef, node: Node, fields: FieldTable) -> Self {
        DictView {
            store,
            node,
            fields,
        }
    }

    fn map(&self) -> Map<'_> {
        Map::Dict(&self.store, self.node)
    }
}

#[pymethods]
impl DictView {
    fn __len__(&self) -> usize {
        self.map().len()
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.map().getitem(py, key)
    }

    /// `view[key]` if present, else `default`.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.map().get(py, key, default)
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.map().find(key)?.is_some())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, DictIter>> {
        DictIter::start(py, &self.store, Some(self.node), false)
    }

    fn keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_view(slf.as_any(), AbcView::Keys)
    }

    fn values<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_view(slf.as_any(), AbcView::Values)
    }

    fn items<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        abc_view(slf.as_any(), AbcView::Items)
    }

    /// A plain dict equal to the stored one (nested values converted too).
    fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.map().to_python(py)
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
        Ok(format!("DictView({{{}}})", self.map().repr_items(py)?))
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, ViewPickleArgs)> {
        reduce_view(py, &self.store, self.node)
    }

    /// `__reduce__`, whatever the protocol (skips `object.__reduce_ex__`'s lookups).
    fn __reduce_ex__<'py>(
        &self,
        py: Python<'py>,
        _protocol: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, ViewPickleArgs)> {
        reduce_view(py, &self.store, self.node)
    }
}
