//! `ListView`: a stored list or tuple as a read-only `collections.abc.Sequence`.

use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::PyInt;
use pyo3::{ffi, Borrowed};

use super::protocol::{index_item, iterator, next_item, packed_item, position, Seq};
use super::{compare_plain, reduce_view, ViewPickleArgs};
use crate::archive::reader::{Form, SeqAt};
use crate::archive::Node;
use crate::py::errors::Error;
use crate::py::read::StoreRef;

/// A stored list or tuple: a read-only `collections.abc.Sequence`.
#[pyclass(name = "ListView", module = "shmstore", frozen, weakref, sequence)]
pub(crate) struct ListView {
    store: StoreRef,
    node: Node,
    /// The layout, read once when the view is made; None for a packed field (whose layout
    /// is in its node: worked out per access, cheaper than storing it) or if it is corrupt
    /// (then every access goes the long way and raises).
    seq: Option<SeqAt>,
}

iterator!(ListIter, "ListViewIterator", next_item);

impl super::freelist::HoldsStore for ListView {
    fn into_store(self) -> StoreRef {
        self.store
    }
}

impl super::slots::FastGet for ListView {
    /// `view[i]` with an exact int in range, on the layout read at creation.
    #[inline(always)]
    fn fast_get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let v = slf.get();
        let i = super::slots::exact_index(key)?;
        match (v.seq, v.node.form) {
            (Some(seq), _) => index_item(slf.py(), &v.store, seq, i),
            // A packed field: its element read straight from the node's form.
            (None, Form::Pack { elem, count, .. }) => {
                packed_item(slf.py(), &v.store, v.node, elem, count, i)
            }
            // A layout that could not be read: pyo3's slot raises the error.
            (None, _) => None,
        }
    }

    /// `view[i]` of a packed field (a bbox, say) with an exact int in range: the element
    /// read straight from the node's form and made into a float or int.
    #[inline(always)]
    fn tiny_get(
        slf: Borrowed<'_, '_, Self>,
        key: Borrowed<'_, '_, PyAny>,
    ) -> Option<*mut ffi::PyObject> {
        let v = slf.get();
        let Form::Pack { elem, count, .. } = v.node.form else {
            return None;
        };
        let j = position(super::slots::compact_index(&key)?, count as usize)?;
        let s = v.store.reader.packed_scalar(v.node.pos(), elem, j)?;
        Some(super::scalar_ptr(slf.py(), s))
    }

    super::slots::original_slot!();
}

impl super::slots::FastLen for ListView {
    #[inline(always)]
    fn fast_len(slf: &Bound<'_, Self>) -> usize {
        slf.get().len()
    }
}

impl super::slots::FastIter for ListView {
    #[inline(always)]
    fn fast_iter<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let v = slf.get();
        let seq = match v.seq {
            Some(seq) => Some(seq),
            None => v.store.reader.seq(v.node).ok(),
        };
        Ok(ListIter::start_seq(slf.py(), &v.store, Some(v.node), seq, false)?.into_any())
    }
}

impl ListView {
    #[inline(always)]
    pub(crate) fn new(store: StoreRef, node: Node) -> Self {
        // A packed field's layout is its node's form: not stored (building it in the view
        // went through memory in pieces that were read back whole, a stall per view).
        let seq = match node.form {
            Form::Pack { .. } => None,
            _ => store.reader.seq(node).ok(),
        };
        ListView { store, node, seq }
    }

    /// A view of the list or tuple at `node` whose layout the caller read.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) fn with_seq(store: StoreRef, node: Node, seq: SeqAt) -> Self {
        ListView {
            store,
            node,
            seq: Some(seq),
        }
    }

    /// A view of a packed field (`node` of a `Form::Pack`), which holds no layout.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) fn packed(store: StoreRef, node: Node) -> Self {
        ListView {
            store,
            node,
            seq: None,
        }
    }

    fn seq(&self) -> Seq<'_> {
        Seq::Items(&self.store, self.node)
    }

    #[inline(always)]
    fn len(&self) -> usize {
        match self.seq {
            Some(seq) => seq.len,
            None => self.seq().len(),
        }
    }
}

#[pymethods]
impl ListView {
    fn __len__(&self) -> usize {
        self.len()
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // The hot path: `view[i]` with an int, on the layout read at creation.
        if let (Some(seq), true) = (self.seq, index.is_exact_instance_of::<PyInt>()) {
            if let Some(item) = index
                .extract::<isize>()
                .ok()
                .and_then(|i| index_item(py, &self.store, seq, i))
            {
                return item;
            }
        }
        self.seq().getitem(py, index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, ListIter>> {
        ListIter::start(py, &self.store, Some(self.node), false)
    }

    fn __reversed__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, ListIter>> {
        ListIter::start(py, &self.store, Some(self.node), true)
    }

    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.seq().contains(py, value)
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
        self.seq().index(py, value, start, stop)
    }

    /// Number of items equal to `value`.
    fn count(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.seq().count(py, value)
    }

    /// Plain Python objects equal to the stored value (a list, or a tuple for a tuple).
    /// Arrays inside stay read-only zero-copy numpy arrays.
    fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.seq().to_python(py)
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
        if self.store.reader.is_tuple(self.node) {
            return self.to_python(py)?.hash();
        }
        Err(Error::Unhashable {
            what: "'ListView' (a stored list)",
        }
        .into())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let inner = self.seq().repr_items(py)?;
        Ok(if self.store.reader.is_tuple(self.node) {
            let one = self.seq().len() == 1;
            format!("ListView(({inner}{}))", if one { "," } else { "" })
        } else {
            format!("ListView([{inner}])")
        })
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
