//! `Ref` and `put`: one object shared by name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{new_handle, open_of, repr, StoreHandle};
use crate::archive::Kind;
use crate::py::read::protocol::Seq;
use crate::py::store::Store;
use crate::py::write::Encoder;
use crate::py::{arena, store};

/// One object (e.g. a numpy array) shared by name; made by `shmstore.put`.
///
/// >>> import numpy as np, shmstore
/// >>> with shmstore.put(np.arange(3)) as ref:
/// ...     ref.get().tolist()
/// [0, 1, 2]
#[pyclass(name = "Ref", module = "shmstore", frozen, extends = StoreHandle)]
pub(crate) struct Ref;

#[pymethods]
impl Ref {
    /// The shared object: a read-only view, a read-only numpy array, or a scalar.
    fn get<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        // An object store is a store of one record.
        Seq::Records(&open_of(slf)?).item(slf.py(), 0, false)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> String {
        repr("Ref", slf.as_super(), false)
    }
}

/// Share one object by name.
#[pyfunction]
#[pyo3(signature = (obj, *, name=None, dir=None, arena=true))]
pub(crate) fn put<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    name: Option<&str>,
    dir: Option<PathBuf>,
    arena: bool,
) -> PyResult<Bound<'py, Ref>> {
    let store: Arc<Store> = put_object(py, obj, name, dir.as_deref(), arena)?;
    new_handle(py, store, true, Ref)
}

/// Put `obj` into a chunk of an arena of this process (a small object, unless `arena` is
/// false or it is named) or a segment of its own, in `dir` (the default directory if
/// `None`), and keep it (`K`: its store, mapped, for `put`'s handle; or, for a channel, a
/// small object's chunk only held, not opened: its getter opens it).
pub(crate) fn put_object<K: arena::Keep>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: Option<&str>,
    dir: Option<&Path>,
    arena: bool,
) -> PyResult<K> {
    // Known-size input (an array, bytes): check the room before writing anything.
    // An object without `nbytes` (a dict, a list) is told so without an exception being
    // made (`getattr_opt`); any failure of the attribute means "size unknown", as before.
    let size_hint = match obj.cast::<PyBytes>() {
        Ok(b) => Some(b.as_bytes().len() as u64),
        Err(_) => obj
            .getattr_opt(pyo3::intern!(py, "nbytes"))
            .ok()
            .flatten()
            .and_then(|n| n.extract::<u64>().ok()),
    };
    // A small object into this process's arena (docs/arena.md), unless `arena=False` or
    // named; too large, or no supervisor: a segment of its own.
    if arena && name.is_none() && arena::may_fit(obj, size_hint) {
        // Known size: the archive is built straight into a chunk reserved for it.
        let in_place = match size_hint {
            Some(n) => arena::put_in_place(py, obj, n, dir)?,
            None => arena::InPlace::DidNotFit,
        };
        match in_place {
            arena::InPlace::Put(put) => return Ok(put),
            arena::InPlace::NoArena => {}
            arena::InPlace::DidNotFit => {
                if let Some(archive) = arena::encode_small(obj, size_hint)? {
                    if let Some(n) = size_hint {
                        arena::learn_overhead(obj, archive.len() as u64, n);
                    }
                    if let Some(put) = arena::put_archive(py, &archive, dir)? {
                        return Ok(put);
                    }
                }
            }
        }
    }
    let dir = dir.map(Path::to_path_buf);
    store::build(py, Kind::Object, name, dir, size_hint, |builder| {
        Encoder::new(builder, "obj").write_record(obj, None)
    })
    .map(K::segment)
}
