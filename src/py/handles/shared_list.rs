//! `SharedList`: a list of records in shared memory.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyList;
#[cfg(not(feature = "abi3"))]
use pyo3::{ffi, Borrowed};

use super::{new_handle, open_of, repr, StoreHandle};
use crate::archive::Kind;
use crate::py::read::protocol::{iterator, next_item, record_item, Seq};
use crate::py::read::slots::{exact_index, original_slot, FastGet};
use crate::py::store;
use crate::py::write::{Encoder, Seg0};
#[cfg(not(feature = "abi3"))]
use crate::{
    archive::reader::Form,
    py::read::protocol::{position, FieldTable},
    py::read::slots::compact_index,
    py::read::{kept_view, kept_view_holding, DictView, StoreRef, FREE_THREADED_BUILD},
};

/// A list of records in shared memory.
///
/// >>> import shmstore
/// >>> with shmstore.SharedList([{"a": 1}, {"a": 2}]) as lst:
/// ...     lst[1]["a"]
/// 2
#[pyclass(name = "SharedList", module = "shmstore", frozen, extends = StoreHandle)]
pub(crate) struct SharedList;

iterator!(RecordIter, "SharedListIterator", next_item);

impl FastGet for SharedList {
    /// `lst[i]` with an exact int in range, on an open store.
    #[inline(always)]
    fn fast_get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let i = exact_index(key)?;
        StoreHandle::with_live(slf.as_super(), |store| record_item(slf.py(), store, i))
    }

    /// `lst[i]` of a checked record whose root is a shaped dict (a COCO record, say), with
    /// an exact int in range, its view made from one the free list (free-threaded: the
    /// thread's own list) kept.
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    fn tiny_get(
        slf: Borrowed<'_, '_, Self>,
        key: Borrowed<'_, '_, PyAny>,
    ) -> Option<*mut ffi::PyObject> {
        let py = slf.py();
        let i = compact_index(&key)?;
        if FREE_THREADED_BUILD {
            // The thread's own reference is borrowed only while its seat's flag is up: the
            // record is found and the view's reference counted then, the view made after.
            let (store, node, fields) = StoreHandle::with_own(slf.as_super(), |store| {
                let (node, fields) = shaped_record(py, store, i)?;
                Some((store.clone_ref(py), node, fields))
            })?;
            return kept_view_holding(py, store, |store| {
                DictView::with_fields(store, node, fields)
            });
        }
        StoreHandle::with_live_gil(slf.as_super(), |store| {
            let (node, fields) = shaped_record(py, store, i)?;
            kept_view(py, || {
                DictView::with_fields(store.clone_ref(py), node, fields)
            })
        })
    }

    original_slot!();
}

/// Record `i` (an index, negative from the end) of `store`, if it is a checked record whose
/// root is a shaped dict with a one-byte shape id whose fields are already made: its node
/// and fields, for a tiny path (`None` for everything else).
#[cfg(not(feature = "abi3"))]
#[inline(always)]
fn shaped_record(
    py: Python<'_>,
    store: &StoreRef,
    i: isize,
) -> Option<(crate::archive::Node, FieldTable)> {
    let j = position(i, store.reader.len() as usize)?;
    let node = store.reader.root_dict_small(j as u64)?;
    let Form::Struct(id) = node.form else {
        return None;
    };
    Some((node, FieldTable::made(py, store, id)?))
}

#[pymethods]
impl SharedList {
    #[new]
    #[pyo3(signature = (iterable, *, name=None, dir=None))]
    fn py_new<'py>(
        py: Python<'py>,
        iterable: &Bound<'py, PyAny>,
        name: Option<&str>,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, SharedList>> {
        let iter = iterable.try_iter()?;
        let store = store::build(py, Kind::List, name, dir, None, |builder| {
            let mut enc = Encoder::new(builder, "records");
            for (i, item) in iter.enumerate() {
                enc.write_record(&item?, Some(Seg0::Index(i)))?;
            }
            Ok(())
        })?;
        // Made here (not by pyo3 from an initializer) so it is created untracked too.
        new_handle(py, store, true, SharedList)
    }

    /// `SharedList[T]` in annotations evaluated at run time: a `types.GenericAlias`, as for the
    /// builtin containers (the class is generic for type checkers, see _native.pyi).
    #[classmethod]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }
    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(Seq::Records(&open_of(slf)?).len())
    }

    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Seq::Records(&open_of(slf)?).getitem(slf.py(), index)
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, RecordIter>> {
        RecordIter::start(slf.py(), &open_of(slf)?, None, false)
    }

    fn __reversed__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, RecordIter>> {
        RecordIter::start(slf.py(), &open_of(slf)?, None, true)
    }

    fn __contains__(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        Seq::Records(&open_of(slf)?).contains(slf.py(), value)
    }

    /// Index of the first record equal to `value` (ValueError if absent).
    #[pyo3(signature = (value, start=0, stop=None))]
    fn index(
        slf: &Bound<'_, Self>,
        value: &Bound<'_, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<usize> {
        Seq::Records(&open_of(slf)?).index(slf.py(), value, start, stop)
    }

    /// Number of records equal to `value`.
    fn count(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        Seq::Records(&open_of(slf)?).count(slf.py(), value)
    }

    /// The records at `indices` (any iterable of ints; negative ones count from the end), as
    /// a list, in order. Faster than one `lst[i]` at a time for scattered indices: the
    /// memory reads of the whole batch are started before the first record is decoded.
    ///
    /// >>> import shmstore
    /// >>> with shmstore.SharedList([{"id": i} for i in range(10)]) as lst:
    /// ...     [r["id"] for r in lst.get_many([7, 2, -1])]
    /// [7, 2, 9]
    fn get_many<'py>(
        slf: &Bound<'py, Self>,
        indices: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        Seq::Records(&open_of(slf)?).get_many(slf.py(), indices)
    }

    /// All records as plain Python objects (a list).
    fn to_python<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Seq::Records(&open_of(slf)?).to_python(slf.py())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> String {
        repr("SharedList", slf.as_super(), true)
    }
}
