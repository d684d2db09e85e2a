//! Unpickling: a handle pickles as (class, path, flag) and a view as (path, flag, record,
//! position, form) (`Store::pickle_args`); these functions attach again in the receiving process.

use std::path::PathBuf;

use pyo3::prelude::*;

use super::errors::Error;
use super::handles::handle_for;
use super::read::new_untracked;
use super::read::{DictView, ListView, StoreRef};
use super::store::{self, Source};
use crate::archive::{Item, Kind};

/// Unpickle a handle: attach by path (segment or file).
#[pyfunction]
pub(crate) fn _rebuild<'py>(
    py: Python<'py>,
    cls: &str,
    path: PathBuf,
    kind_flag: String,
) -> PyResult<Bound<'py, PyAny>> {
    let kind = match cls {
        "SharedList" => Kind::List,
        "SharedDict" => Kind::Dict,
        "Ref" => Kind::Object,
        other => {
            return Err(Error::Invalid {
                at: "unpickling".into(),
                what: format!("unknown store class {other:?}"),
            }
            .into())
        }
    };
    let store = store::attach_source(py, Source::from_pickle(path, &kind_flag))?;
    store::expect_kind(&store, kind)?;
    handle_for(py, store)
}

/// Unpickle a chunk of an arena (`Ref.__reduce__`): the arena's path, then where the
/// chunk is. Whatever the values, the worst is a clear error: the arena is opened and checked
/// like any (owner, mode, header), the chunk's range and generation are checked under its
/// lease, and its archive like any archive.
#[pyfunction]
pub(crate) fn _rebuild_chunk<'py>(
    py: Python<'py>,
    path: &str,
    offset: u64,
    size: u64,
    generation: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let chunk = crate::arena::Chunk {
        offset,
        size,
        generation,
    };
    let store = store::open_chunk(py, PathBuf::from(path), chunk, None)?;
    store::expect_kind(&store, Kind::Object)?;
    handle_for(py, store)
}

/// Unpickle a view: attach, then rebuild the node (every read through a node is checked,
/// so a forged one can at worst raise CorruptStoreError).
#[pyfunction]
#[pyo3(signature = (path, kind_flag, rec, pos, form=0, aux=0))]
pub(crate) fn _rebuild_view<'py>(
    py: Python<'py>,
    path: PathBuf,
    kind_flag: String,
    rec: u64,
    pos: u64,
    form: u8,
    aux: u32,
) -> PyResult<Bound<'py, PyAny>> {
    let store = store::attach_source(py, Source::from_pickle(path, &kind_flag))?;
    let node = store
        .reader
        .node_from(rec, pos, (form, aux))
        .map_err(store.archive_err())?;
    Ok(
        match store.reader.item(node).map_err(store.archive_err())? {
            Item::List(node) | Item::Tuple(node) => {
                new_untracked(py, ListView::new(StoreRef::new(py, store)?, node))?.into_any()
            }
            Item::Dict(node) => {
                new_untracked(py, DictView::new(py, StoreRef::new(py, store)?, node))?.into_any()
            }
            _ => {
                return Err(Error::Corrupt {
                    at: store.describe(),
                    what: "pickled view does not point at a list or dict".into(),
                }
                .into())
            }
        },
    )
}
