//! The store handles users create and attach: `SharedList`, `SharedDict`, `Ref` (made by
//! `put`), one file each. They share [`StoreHandle`], the base class for what every store
//! has (name, path, kind, nbytes, close, unlink, save, verify, context manager, pickling by
//! name). Their Sequence/Mapping methods forward to `protocol` over the store's records.

mod object_ref;
mod shared_dict;
mod shared_list;
mod slot;

pub(crate) use object_ref::{put, put_object, Ref};
pub(crate) use shared_dict::{KeyIter, SharedDict};
pub(crate) use shared_list::{RecordIter, SharedList};

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::impl_::pyclass::PyClassBaseType;
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyType};
use pyo3::PyClass;
use pyo3::PyClassInitializer;

use super::errors::Error;
use super::read::{new_untracked, ArrayOwner, StoreRef};
use super::store::{self, Rebuild, Source, Store};
use crate::archive::value::TypeStr;
use crate::archive::Kind;
use slot::Slot;

super::read::recycled! {
    RECORD_ITERS: RecordIter;
    KEY_ITERS: KeyIter;
}

/// The handles' part of `read::install_freelists`: the free lists of their iterators, and
/// the fast slots of the handle types.
///
/// # Safety
/// As `read::install_free_list`: the thread is attached, the read layer has set whether
/// objects are recycled, and no instance of these types exists yet (module init).
pub(crate) unsafe fn install_freelists(py: Python<'_>) {
    #[cfg(not(feature = "abi3"))]
    // SAFETY: the caller's contract. None of these types is subclassable.
    unsafe {
        use super::read::fastpaths::report;
        use super::read::{install_free_list, slots};
        install_free_list::<RecordIter>(py);
        install_free_list::<KeyIter>(py);
        report(
            "slots.SharedList.subscript",
            slots::install::<SharedList>(py),
        );
        report(
            "slots.SharedDict.subscript",
            slots::install::<SharedDict>(py),
        );
        report(
            "slots.RecordIter.next",
            slots::install_next::<RecordIter>(py),
        );
        report("slots.KeyIter.next", slots::install_next::<KeyIter>(py));
    }
    #[cfg(feature = "abi3")]
    let _ = py;
}

/// What every store handle has. Holds only a `StoreRef` (a Python reference to an object
/// that holds none, so no cycle can pass through a handle).
#[pyclass(name = "StoreHandle", module = "shmstore", frozen, weakref, subclass)]
pub(crate) struct StoreHandle {
    inner: Slot,
    /// Where the store came from, kept for `name`, `path` and messages after close (the
    /// name is made when asked for: a chunk's is formatted).
    source: Source,
    kind: Kind,
    /// This handle created the store (its `with` block unlinks it at exit).
    created: bool,
}

impl StoreHandle {
    fn new(py: Python<'_>, store: Arc<Store>, created: bool) -> PyResult<Self> {
        Ok(StoreHandle {
            source: store.source.clone(),
            kind: store.kind(),
            inner: Slot::new(StoreRef::new(py, store)?),
            created,
        })
    }

    /// A reference to the store, or StoreClosedError.
    pub(crate) fn live(slf: &Bound<'_, Self>) -> PyResult<StoreRef> {
        let h = slf.get();
        h.inner.get(slf.as_any()).ok_or_else(|| {
            Error::Closed {
                name: h.source.name(),
            }
            .into()
        })
    }

    /// `f` of the store, or None once closed (for a read slot's fast path, which leaves the
    /// error to the long way). The reference taken for the call is given back by a plain
    /// decrement: a fast path must not drop a `Py` (see `read::slots`).
    #[inline(always)]
    pub(crate) fn with_live<R>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        let store = slf.get().inner.get(slf.as_any())?;
        let out = f(&store);
        // SAFETY: the GIL is held (`slf` is bound to it).
        unsafe { store.release() };
        out
    }

    /// `f` of the store, borrowed for a tiny read path (see `Slot::with_main_gil`); None
    /// once closed or on a free-threaded interpreter.
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    pub(crate) fn with_live_gil<R>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        slf.get().inner.with_main_gil(slf.as_any(), f)
    }

    /// `f` of this thread's own reference to the store, borrowed for a tiny read path on a
    /// free-threaded interpreter (see `Slot::with_own`: `f` may only read and count
    /// references); None where that is not at hand (the whole way then reads).
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    pub(crate) fn with_own<R>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        slf.get().inner.with_own(slf.as_any(), f)
    }

    /// The store itself, for work done without the GIL, or StoreClosedError.
    pub(crate) fn store(slf: &Bound<'_, Self>) -> PyResult<Arc<Store>> {
        Ok(Arc::clone(Self::live(slf)?.arc()))
    }
}

/// A new, untracked handle of class `T` over `store`.
fn new_handle<T>(
    py: Python<'_>,
    store: Arc<Store>,
    created: bool,
    value: T,
) -> PyResult<Bound<'_, T>>
where
    T: PyClass<BaseType = StoreHandle>,
    StoreHandle: PyClassBaseType<Initializer = PyClassInitializer<StoreHandle>>,
{
    new_untracked(
        py,
        PyClassInitializer::from(StoreHandle::new(py, store, created)?).add_subclass(value),
    )
}

/// The store of a subclass instance's base handle, or StoreClosedError.
fn open_of<T: PyClass<BaseType = StoreHandle>>(slf: &Bound<'_, T>) -> PyResult<StoreRef> {
    StoreHandle::live(slf.as_super())
}

/// The kind of store a handle class holds; None for `StoreHandle` itself (any kind).
fn kind_of_class(cls: &Bound<'_, PyType>) -> PyResult<Option<Kind>> {
    Ok(if cls.is_subclass_of::<SharedList>()? {
        Some(Kind::List)
    } else if cls.is_subclass_of::<SharedDict>()? {
        Some(Kind::Dict)
    } else if cls.is_subclass_of::<Ref>()? {
        Some(Kind::Object)
    } else {
        None
    })
}

/// A handle for `store` as class `cls` asks: a store of another kind is a clear error
/// naming the right class; `StoreHandle` itself takes any kind.
pub(crate) fn handle_as<'py>(
    cls: &Bound<'py, PyType>,
    store: Arc<Store>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(kind) = kind_of_class(cls)? {
        store::expect_kind(&store, kind)?;
    }
    handle_for(cls.py(), store)
}

/// `Name(name='…', len=…, nbytes=…)`, or `Name(name='…', closed)`.
fn repr(class: &str, slf: &Bound<'_, StoreHandle>, len: bool) -> String {
    let h = slf.get();
    match StoreHandle::live(slf) {
        Ok(s) if len => format!(
            "{class}(name='{}', len={}, nbytes={})",
            h.source.name(),
            s.reader.len(),
            s.nbytes()
        ),
        Ok(s) => format!("{class}(name='{}', nbytes={})", h.source.name(), s.nbytes()),
        Err(_) => format!("{class}(name='{}', closed)", h.source.name()),
    }
}

#[pymethods]
impl StoreHandle {
    /// Attach to an existing store by name (any process of the same user). On
    /// `StoreHandle` itself, the handle's class is the one the store's kind needs.
    #[classmethod]
    #[pyo3(signature = (name, *, dir=None))]
    fn attach<'py>(
        cls: &Bound<'py, PyType>,
        name: &str,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, PyAny>> {
        handle_as(cls, store::attach(cls.py(), name, dir.as_deref())?)
    }

    /// Map a store saved with `save(path)` (read-only; processes share it through the page
    /// cache).
    #[classmethod]
    fn open<'py>(cls: &Bound<'py, PyType>, path: PathBuf) -> PyResult<Bound<'py, PyAny>> {
        handle_as(cls, store::open_file(cls.py(), &path)?)
    }

    /// Read the archive in `buffer` (any object with the buffer protocol: `bytes`, a
    /// `memoryview`, a `pickle.PickleBuffer`, a numpy uint8 array; e.g. `archive()` of
    /// another handle, or Ray's copy of one) with the same checks as a segment. The store
    /// holds the buffer (and so its object) as long as any handle, view or array of it
    /// lives. `copy`: None reads a read-only, 64-byte-aligned buffer in place and copies a
    /// read-only unaligned one (logged), True always reads a private copy (writable buffers
    /// too: a snapshot), False never copies (refuses what cannot be read in place). A
    /// writable buffer is refused unless copied: the bytes must not change under readers.
    #[classmethod]
    #[pyo3(signature = (buffer, *, copy=None))]
    fn from_buffer<'py>(
        cls: &Bound<'py, PyType>,
        buffer: &Bound<'py, PyAny>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let policy = match copy {
            None => store::CopyPolicy::Auto,
            Some(true) => store::CopyPolicy::Always,
            Some(false) => store::CopyPolicy::Never,
        };
        handle_as(cls, store::open_buffer(cls.py(), buffer, policy)?)
    }

    /// The whole archive as a read-only `memoryview` of the store's own pages (no copy):
    /// for a segment, the segment file's bytes. `from_buffer` of it (here or in a process
    /// it was sent to) reads the same store. The memoryview keeps the mapping alive.
    fn archive<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let store = Self::store(slf)?;
        let nbytes = store.nbytes();
        let owner = new_untracked(
            slf.py(),
            ArrayOwner::new(store, TypeStr::BYTES, vec![nbytes], 0),
        )?;
        Ok(pyo3::types::PyMemoryView::from(owner.as_any())?.into_any())
    }

    /// The store's name (`shmstore-…`), or the file path for a store opened from a file.
    #[getter]
    fn name(&self) -> String {
        self.source.name()
    }

    /// The file behind the store: the segment in /dev/shm (or `SHMSTORE_DIR`, or the disk
    /// fallback), or the saved archive file. A store read from a buffer has none
    /// (InvalidInputError).
    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        if let Source::Buffer { label } = &self.source {
            return Err(Error::Invalid {
                at: label.display().to_string(),
                what: "a store read from a buffer has no file".into(),
            }
            .into());
        }
        Ok(self.source.path().to_owned())
    }

    /// What the store holds: `"list"`, `"dict"` or `"object"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind.name()
    }

    /// Size of the archive in bytes.
    #[getter]
    fn nbytes(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(Self::live(slf)?.nbytes())
    }

    /// Whether `close()` was called on this handle.
    #[getter]
    fn closed(slf: &Bound<'_, Self>) -> bool {
        slf.get().inner.is_none(slf.as_any())
    }

    /// Drop this handle's reference to the mapping. Views and arrays already handed out
    /// keep working; calling methods on this handle raises StoreClosedError.
    fn close(slf: &Bound<'_, Self>) {
        // Given back after the critical section: the last reference unmaps.
        slf.get().inner.take(slf.as_any());
    }

    /// Remove the store's name now: nobody can attach any more; every existing mapping,
    /// here or in other processes, keeps working until dropped.
    fn unlink(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let store = Self::store(slf)?;
        if let Source::File { path } = &store.source {
            return Err(Error::Invalid {
                at: path.display().to_string(),
                what: "was opened from a file; delete the file instead".into(),
            }
            .into());
        }
        if let Source::Buffer { label } = &store.source {
            return Err(Error::Invalid {
                at: label.display().to_string(),
                what: "was read from a buffer, which has no name to remove; its owner \
                       decides when it goes (close() lets go of it here)"
                    .into(),
            }
            .into());
        }
        let removed = py
            .detach(|| store.mapping().unlink())
            .map_err(Error::from)?;
        // One line per event: a second unlink (e.g. `with` exiting after an explicit
        // unlink()) or a name the supervisor already removed logs nothing.
        if removed {
            log::debug!("unlinked {}", slf.get().source.name());
        }
        Ok(())
    }

    /// Write the archive to a regular file; `open(path)` maps it read-only later (processes
    /// share it through the page cache). The file gets `mode` (default 0o600: only you).
    #[pyo3(signature = (path, *, mode=0o600))]
    fn save(slf: &Bound<'_, Self>, path: PathBuf, mode: u32) -> PyResult<()> {
        store::save(slf.py(), &*Self::store(slf)?, &path, mode)
    }

    /// (address, length, keeper) of the whole mapping the store lies in: the keeper (an
    /// `ArrayOwner` of the archive's bytes) keeps it mapped, whatever happens to this
    /// handle. What `shmstore.torch.pin` registers with CUDA.
    fn _mapping_extent<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(usize, usize, Bound<'py, ArrayOwner>)> {
        let store = Self::store(slf)?;
        let (addr, len) = store.mapping().extent();
        let nbytes = store.nbytes();
        let keeper = new_untracked(
            slf.py(),
            ArrayOwner::new(store, TypeStr::BYTES, vec![nbytes], 0),
        )?;
        Ok((addr, len, keeper))
    }

    /// Check every record now (checksums and structure). Reading checks each record on
    /// first access anyway; this is for verifying a file end to end.
    fn verify(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let store = Self::store(slf)?;
        py.detach(|| store.reader.validate_all())
            .map_err(store.archive_err())?;
        Ok(())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Close; a handle that created the store also unlinks it.
    fn __exit__(
        slf: &Bound<'_, Self>,
        _exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if slf.get().created && !Self::closed(slf) {
            Self::unlink(slf)?;
        }
        Self::close(slf);
        Ok(false)
    }

    /// Pickled by name: `_rebuild` (src/py/pickle.rs) attaches in the other process; a
    /// chunk of an arena (always a `Ref`) as `_rebuild_chunk(path, offset, size,
    /// generation)`, shorter to pickle and to unpickle.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let store = Self::live(slf)?;
        if let (Source::Arena { chunk, .. }, Some(path)) =
            (&store.source, store.source.path().to_str())
        {
            let args = (path, chunk.offset, chunk.size, chunk.generation);
            return (Rebuild::Chunk.function(py)?, args).into_pyobject(py);
        }
        let (path, flag, _, _) = store.pickle_args(0, 0)?;
        let cls: String = slf.get_type().name()?.to_string();
        (Rebuild::Handle.function(py)?, (cls, path, flag)).into_pyobject(py)
    }

    /// `__reduce__`, whatever the protocol: pickling calls this directly instead of
    /// `object.__reduce_ex__`, which looks `__reduce__` up again on the object and its type.
    fn __reduce_ex__<'py>(
        slf: &Bound<'py, Self>,
        _protocol: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        Self::__reduce__(slf)
    }
}

/// A handle of the class that fits `store`'s kind (unpickling).
pub(crate) fn handle_for(py: Python<'_>, store: Arc<Store>) -> PyResult<Bound<'_, PyAny>> {
    Ok(match store.kind() {
        Kind::List => new_handle(py, store, false, SharedList)?.into_any(),
        Kind::Dict => new_handle(py, store, false, SharedDict)?.into_any(),
        Kind::Object => new_handle(py, store, false, Ref)?.into_any(),
    })
}

/// `types.GenericAlias(cls, item)`: what `list[int]` is.
fn generic_alias<'py>(
    cls: &Bound<'py, pyo3::types::PyType>,
    item: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    cls.py()
        .import("types")?
        .getattr("GenericAlias")?
        .call1((cls, item))
}
