//! Unpickling: a handle pickles as (class, path, flag) and a view as (path, flag, record,
//! position, form) (`Store::pickle_args`); these functions attach again in the receiving process.
//!
//! A pickle may come from anywhere (docs/security.md): every argument is taken as any
//! object and checked here, so a forged one (a negative size, a str where an int belongs, a
//! number past 2^64) is `CorruptStoreError` naming the argument, never `OverflowError` or
//! `TypeError` from the conversion.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::errors::Error;
use super::handles::handle_for;
use super::read::new_untracked;
use super::read::{DictView, ListView, StoreRef};
use super::store::{self, Source};
use crate::archive::{Item, Kind};

/// What an unpickling function was given that no pickle of ours holds.
fn forged(func: &str, what: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let got = got
        .repr()
        .map(|r| r.to_string_lossy().chars().take(80).collect::<String>())
        .unwrap_or_else(|_| "?".into());
    Error::Corrupt {
        at: format!("unpickling ({func})"),
        what: format!("{what} {got}: a forged or corrupt pickle (no shmstore pickle holds this)"),
    }
    .into()
}

/// An integer argument in `0..=max` (`what` names it in the error).
fn int_arg(func: &str, what: &str, v: &Bound<'_, PyAny>, max: u64) -> PyResult<u64> {
    match v.extract::<u64>() {
        Ok(n) if n <= max && !v.is_instance_of::<pyo3::types::PyBool>() => Ok(n),
        _ => Err(forged(
            func,
            &format!("{what} is not an integer from 0 to {max}:"),
            v,
        )),
    }
}

/// A str argument (a path, a class name, a flag).
fn str_arg(func: &str, what: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    match v.cast::<PyString>() {
        Ok(s) => match s.to_str() {
            Ok(s) if !s.contains('\0') => Ok(s.to_owned()),
            _ => Err(forged(func, &format!("{what} is not a valid str:"), v)),
        },
        Err(_) => Err(forged(func, &format!("{what} is not a str:"), v)),
    }
}

/// A path argument: a str (what pickles of ours carry) or a path-like object (`Path`), and
/// absolute, as every path a pickle of ours carries (a relative one would name another file
/// in a process with another working directory, and the supervisor refuses it).
fn path_arg(func: &str, v: &Bound<'_, PyAny>) -> PyResult<PathBuf> {
    let path = if v.is_instance_of::<PyString>() {
        PathBuf::from(str_arg(func, "the path", v)?)
    } else {
        match v.extract::<PathBuf>() {
            Ok(p) if !p.as_os_str().as_encoded_bytes().contains(&0) => p,
            _ => return Err(forged(func, "the path is not a str or path:", v)),
        }
    };
    if !path.is_absolute() {
        return Err(forged(func, "the path is not absolute:", v));
    }
    Ok(path)
}

/// Unpickle a handle: attach by path (segment or file).
#[pyfunction]
pub(crate) fn _rebuild<'py>(
    py: Python<'py>,
    cls: &Bound<'py, PyAny>,
    path: &Bound<'py, PyAny>,
    kind_flag: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    const F: &str = "_rebuild";
    let (cls, path, kind_flag) = (
        str_arg(F, "the class name", cls)?,
        path_arg(F, path)?,
        str_arg(F, "the kind flag", kind_flag)?,
    );
    rebuild(py, &cls, path, &kind_flag)
}

/// [`_rebuild`] with checked arguments.
pub(crate) fn rebuild<'py>(
    py: Python<'py>,
    cls: &str,
    path: PathBuf,
    kind_flag: &str,
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
    let store = store::attach_source(py, Source::from_pickle(path, kind_flag))?;
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
    path: &Bound<'py, PyAny>,
    offset: &Bound<'py, PyAny>,
    size: &Bound<'py, PyAny>,
    generation: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    const F: &str = "_rebuild_chunk";
    let path = path_arg(F, path)?;
    let offset = int_arg(F, "the chunk offset", offset, u64::MAX)?;
    let size = int_arg(F, "the chunk size", size, u64::MAX)?;
    let generation = int_arg(F, "the chunk generation", generation, u64::MAX)?;
    // As for a segment attached by name, an arena in a directory where someone else can
    // rename our files is refused (docs/security.md): checked where the arena is opened for
    // the first time in this process (`open_chunk`); one it maps already (its own, or
    // checked then) is not looked at again, and a stat of its directory per unpickled
    // object was a third of the unpickling.
    let chunk = crate::arena::Chunk {
        offset,
        size,
        generation,
    };
    let store = store::open_chunk(py, path, chunk)?;
    store::expect_kind(&store, Kind::Object)?;
    handle_for(py, store)
}

/// Unpickle a view: attach, then rebuild the node (every read through a node is checked,
/// so a forged one can at worst raise CorruptStoreError).
#[pyfunction]
#[pyo3(signature = (path, kind_flag, rec, pos, form=None, aux=None))]
pub(crate) fn _rebuild_view<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
    kind_flag: &Bound<'py, PyAny>,
    rec: &Bound<'py, PyAny>,
    pos: &Bound<'py, PyAny>,
    form: Option<&Bound<'py, PyAny>>,
    aux: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const F: &str = "_rebuild_view";
    let path = path_arg(F, path)?;
    let kind_flag = str_arg(F, "the kind flag", kind_flag)?;
    let rec = int_arg(F, "the record", rec, u64::MAX)?;
    let pos = int_arg(F, "the position", pos, u64::MAX)?;
    let form = match form {
        Some(v) => int_arg(F, "the form", v, u8::MAX.into())? as u8,
        None => 0,
    };
    let aux = match aux {
        Some(v) => int_arg(F, "the form's argument", v, u32::MAX.into())? as u32,
        None => 0,
    };
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
