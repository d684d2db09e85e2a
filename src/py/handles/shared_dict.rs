//! `SharedDict`: a dict of records in shared memory, with a hash table in the archive.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::{new_handle, open_of, repr, StoreHandle};
use crate::archive::Kind;
use crate::py::errors::Error;
use crate::py::keys::py_key;
use crate::py::read::protocol::{abc_view, iterator, next_key, AbcView, Map};
use crate::py::read::slots::{original_slot, FastGet};
use crate::py::read::DictView;
use crate::py::store;
use crate::py::write::{Encoder, Seg0};

/// A dict of records in shared memory, with a hash index stored in the archive.
///
/// >>> import shmstore
/// >>> with shmstore.SharedDict({"doc-1": "text"}) as d:
/// ...     d["doc-1"]
/// 'text'
#[pyclass(name = "SharedDict", module = "shmstore", frozen, extends = StoreHandle)]
pub(crate) struct SharedDict;

iterator!(KeyIter, "SharedDictIterator", next_key);

impl FastGet for SharedDict {
    /// `d[key]` with an exact str that is present, on an open store.
    #[inline(always)]
    fn fast_get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        StoreHandle::with_live(slf.as_super(), |store| {
            Map::Entries(store).get_str_fast(slf.py(), key)
        })
    }

    original_slot!();
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// Item `i` of the input as a (key, value) pair.
fn pair<'py>(
    item: &Bound<'py, PyAny>,
    i: usize,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    if let Some(t) = item.cast::<PyTuple>().ok().filter(|t| t.len() == 2) {
        return Ok((t.get_item(0)?, t.get_item(1)?));
    }
    let invalid = |what: String| Error::Invalid {
        at: format!("pairs[{i}]"),
        what,
    };
    let seq: Vec<Bound<'_, PyAny>> = item.extract().map_err(|_| {
        invalid(format!(
            "expected a (key, value) pair, got {}",
            type_name(item)
        ))
    })?;
    match <[_; 2]>::try_from(seq) {
        Ok([k, v]) => Ok((k, v)),
        Err(seq) => Err(invalid(format!(
            "expected a (key, value) pair of length 2, got length {}",
            seq.len()
        ))
        .into()),
    }
}

#[pymethods]
impl SharedDict {
    #[new]
    #[pyo3(signature = (mapping_or_pairs, *, name=None, dir=None))]
    fn py_new<'py>(
        py: Python<'py>,
        mapping_or_pairs: &Bound<'py, PyAny>,
        name: Option<&str>,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, SharedDict>> {
        let (items, pairs) =
            if mapping_or_pairs.is_instance_of::<PyDict>() || mapping_or_pairs.hasattr("keys")? {
                (mapping_or_pairs.call_method0("items")?.try_iter()?, false)
            } else {
                (mapping_or_pairs.try_iter()?, true)
            };
        let input = if pairs { "pairs" } else { "mapping keys" };
        let store =
            store::build(py, Kind::Dict, name, dir, None, |builder| {
                let mut enc = Encoder::new(builder, "mapping");
                for (i, item) in items.enumerate() {
                    let (k, v) = pair(&item?, i)?;
                    let key_repr = || k.repr().map(|r| r.to_string()).unwrap_or_default();
                    let key =
                        py_key(&k)?.ok_or_else(|| Error::Unsupported {
                            at: format!("{input}[{i}]"),
                            what: format!(
                        "cannot use {} as a key (keys may be str, int, bytes, float, bool, \
                         None or tuples of these)",
                        k.get_type().repr().map(|r| r.to_string()).unwrap_or_default()
                    ),
                        })?;
                    enc.add_key(&key, format!("{input}[{i}] (key {})", key_repr()))?;
                    enc.write_record(&v, Some(Seg0::Key(&k)))?;
                }
                Ok(())
            })?;
        new_handle(py, store, true, SharedDict)
    }

    /// `SharedDict[T]` in annotations evaluated at run time: a `types.GenericAlias`, as for the
    /// builtin containers (the class is generic for type checkers, see _native.pyi).
    #[classmethod]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }
    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(Map::Entries(&open_of(slf)?).len())
    }

    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Map::Entries(&open_of(slf)?).getitem(slf.py(), key)
    }

    /// `d[key]` if present, else `default`.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Map::Entries(&open_of(slf)?).get(slf.py(), key, default)
    }

    fn __contains__(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(Map::Entries(&open_of(slf)?).find(key)?.is_some())
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, KeyIter>> {
        KeyIter::start(slf.py(), &open_of(slf)?, None, false)
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

    /// Equal to any mapping with the same items (what `collections.abc.Mapping` gives).
    fn __eq__(slf: &Bound<'_, Self>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if other.is(slf) {
            return Ok(true);
        }
        let mapping = slf.py().import("collections.abc")?.getattr("Mapping")?;
        if !other.is_instance(&mapping)? {
            return Ok(false);
        }
        let plain = if other.is_instance_of::<SharedDict>() || other.is_instance_of::<DictView>() {
            other.call_method0("to_python")?
        } else {
            other.clone()
        };
        Self::to_python(slf)?.eq(plain)
    }

    /// All entries as a plain dict.
    fn to_python<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Map::Entries(&open_of(slf)?).to_python(slf.py())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> String {
        repr("SharedDict", slf.as_super(), true)
    }
}
