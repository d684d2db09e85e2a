//! The store handles users create and attach: `SharedList`, `SharedDict`, `Ref` (made by
//! `put`). They share one base class for what every store has (name, nbytes, close,
//! unlink, save, context manager, pickling by name).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PySlice, PyString, PyTuple, PyType};
use pyo3::PyClassInitializer;

use super::decode;
use super::encode::{py_key, Encoder, Seg0};
use super::errors::{archive_err, Exc};
use super::store::{self, Source, Store};
use super::views::{abc_views, new_untracked, norm_index, reduce_args, DictView, ListView};
use crate::archive::{ArchiveError, ArchivedValue, Key, Kind};

/// What every store handle has. Holds only `Arc<Store>` (no Python references).
#[pyclass(name = "StoreHandle", module = "shmstore", frozen, weakref, subclass)]
pub struct StoreHandle {
    inner: RwLock<Option<Arc<Store>>>,
    /// Cached for messages after close.
    name: String,
    /// This handle created the store (its `with` block unlinks it at exit).
    created: bool,
}

impl StoreHandle {
    fn new(store: Arc<Store>, created: bool) -> Self {
        StoreHandle {
            name: store.source.name(),
            inner: RwLock::new(Some(store)),
            created,
        }
    }

    /// The store, borrowed under the lock (no reference-count traffic on hot paths).
    pub fn read(&self) -> PyResult<std::sync::RwLockReadGuard<'_, Option<Arc<Store>>>> {
        let guard = self.inner.read().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            return Err(self.closed_error());
        }
        Ok(guard)
    }

    fn closed_error(&self) -> PyErr {
        Exc::Closed.err(format!(
            "store {:?} is closed; attach again (e.g. SharedList.attach(name)) to keep reading",
            self.name
        ))
    }

    pub fn store(&self) -> PyResult<Arc<Store>> {
        Ok(self.read()?.clone().expect("read() checked it is open"))
    }
}

#[pymethods]
impl StoreHandle {
    /// The store's name (`shmstore-…`), or the file path for a store opened from a file.
    #[getter]
    fn name(&self) -> String {
        self.name.clone()
    }

    /// Size of the archive in bytes.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.store()?.nbytes())
    }

    /// Whether `close()` was called on this handle.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Drop this handle's reference to the mapping. Views and arrays already handed out
    /// keep working; calling methods on this handle raises StoreClosedError.
    fn close(&self) {
        self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Remove the store's name now: nobody can attach any more; every existing mapping,
    /// here or in other processes, keeps working until dropped.
    fn unlink(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store()?;
        if let Source::File { path } = &store.source {
            return Err(Exc::Invalid.err(format!(
                "{} was opened from a file; delete the file instead",
                path.display()
            )));
        }
        let removed = py
            .detach(|| store.mapping().unlink())
            .map_err(super::errors::segment_err)?;
        // One line per event: a second unlink (e.g. `with` exiting after an explicit
        // unlink()) or a name the supervisor already removed logs nothing.
        if removed {
            log::debug!("unlinked {}", self.name);
        }
        Ok(())
    }

    /// Write the archive to a regular file; `open(path)` maps it read-only later (processes
    /// share it through the page cache). The file gets `mode` (default 0o600: only you).
    #[pyo3(signature = (path, *, mode=0o600))]
    fn save(&self, py: Python<'_>, path: PathBuf, mode: u32) -> PyResult<()> {
        store::save(py, &*self.store()?, &path, mode)
    }

    /// Check every record now (checksums and structure). Reading checks each record on
    /// first access anyway; this is for verifying a file end to end.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store()?;
        py.detach(|| store.reader.validate_all())
            .map_err(|e| archive_err(e, &store.describe()))
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Close; a handle that created the store also unlinks it.
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.created && !self.closed() {
            self.unlink(py)?;
        }
        self.close();
        Ok(false)
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (String, String, String))> {
        let py = slf.py();
        let store = slf.get().store()?;
        let (path, name, _, _) = reduce_args(&store, 0, 0);
        let cls: String = slf.get_type().name()?.to_string();
        let rebuild = py.import("shmstore._native")?.getattr("_rebuild")?;
        Ok((rebuild, (cls, path, name)))
    }
}

fn err(store: &Store) -> impl Fn(ArchiveError) -> PyErr + '_ {
    move |e| archive_err(e, &store.describe())
}

fn open_as(py: Python<'_>, kind: Kind, how: Open) -> PyResult<Arc<Store>> {
    let store = match how {
        Open::Attach(name, dir) => store::attach(py, &name, dir.as_deref())?,
        Open::File(path) => store::open_file(py, &path)?,
    };
    store::expect_kind(&store, kind)?;
    Ok(store)
}

enum Open {
    Attach(String, Option<PathBuf>),
    File(PathBuf),
}

// ---------------------------------------------------------------------------------------

/// A list of records in shared memory.
///
/// >>> lst = shmstore.SharedList([{"a": 1}, {"a": 2}])
/// >>> lst[1]["a"]
/// 2
#[pyclass(name = "SharedList", module = "shmstore", frozen, extends = StoreHandle)]
pub struct SharedList;

fn list_new(py: Python<'_>, store: Arc<Store>, created: bool) -> PyResult<Bound<'_, SharedList>> {
    new_untracked(
        py,
        PyClassInitializer::from(StoreHandle::new(store, created)).add_subclass(SharedList),
    )
}

fn record<'py>(py: Python<'py>, store: &Arc<Store>, i: u64) -> PyResult<Bound<'py, PyAny>> {
    let node = store.reader.root(i).map_err(err(store))?;
    decode::node_value(py, store, node, false)
}

fn base(slf: &Bound<'_, impl PyClass<BaseType = StoreHandle>>) -> PyResult<Arc<Store>> {
    slf.as_super().get().store()
}

use pyo3::PyClass;

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
            let context = "records".to_string();
            let mut enc = Encoder::new(builder, "records", context);
            for (i, item) in iter.enumerate() {
                let item = item?;
                let v = enc.record(&item, Some(Seg0::Index(i)))?;
                enc.builder
                    .finish_record(&v)
                    .map_err(|e| enc.error_at(&e.to_string()))?;
            }
            Ok(())
        })?;
        // Made here (not by pyo3 from an initializer) so it is created untracked too.
        list_new(py, store, true)
    }

    /// Attach to an existing SharedList by name (any process of the same user).
    #[classmethod]
    #[pyo3(signature = (name, *, dir=None))]
    fn attach<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        name: &str,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, SharedList>> {
        list_new(
            py,
            open_as(py, Kind::List, Open::Attach(name.into(), dir))?,
            false,
        )
    }

    /// Map a SharedList saved with `save(path)`.
    #[classmethod]
    fn open<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        path: PathBuf,
    ) -> PyResult<Bound<'py, SharedList>> {
        list_new(py, open_as(py, Kind::List, Open::File(path))?, false)
    }

    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(base(slf)?.reader.len() as usize)
    }

    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let guard = slf.as_super().get().read()?;
        let store = guard.as_ref().expect("read() checked it is open");
        let len = store.reader.len() as usize;
        if let Ok(i) = index.cast::<PyInt>() {
            let i: isize = i
                .extract()
                .map_err(|_| PyIndexError::new_err("SharedList index out of range"))?;
            return record(py, store, norm_index(i, len, "SharedList")? as u64);
        }
        if let Ok(slice) = index.cast::<PySlice>() {
            let ind = slice.indices(len as isize)?;
            let mut out = Vec::with_capacity(ind.slicelength);
            let mut i = ind.start;
            for _ in 0..ind.slicelength {
                out.push(record(py, store, i as u64)?);
                i += ind.step;
            }
            return Ok(PyList::new(py, out)?.into_any());
        }
        Err(PyTypeError::new_err(format!(
            "SharedList indices must be integers or slices, not {}",
            index
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )))
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, RecordIter>> {
        new_untracked(
            slf.py(),
            RecordIter {
                store: base(slf)?,
                next: AtomicU64::new(0),
            },
        )
    }

    fn __contains__(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(Self::index(slf, value, 0, None).is_ok())
    }

    /// Index of the first record equal to `value` (ValueError if absent).
    #[pyo3(signature = (value, start=0, stop=None))]
    fn index(
        slf: &Bound<'_, Self>,
        value: &Bound<'_, PyAny>,
        start: isize,
        stop: Option<isize>,
    ) -> PyResult<usize> {
        let store = base(slf)?;
        let len = store.reader.len() as isize;
        let clamp = |i: isize| if i < 0 { (i + len).max(0) } else { i.min(len) } as u64;
        for i in clamp(start)..clamp(stop.unwrap_or(len)) {
            if record(slf.py(), &store, i)?.eq(value)? {
                return Ok(i as usize);
            }
        }
        Err(PyValueError::new_err("value is not in SharedList"))
    }

    /// Number of records equal to `value`.
    fn count(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<usize> {
        let store = base(slf)?;
        let mut n = 0;
        for i in 0..store.reader.len() {
            n += record(slf.py(), &store, i)?.eq(value)? as usize;
        }
        Ok(n)
    }

    fn __reversed__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let len = Self::__len__(slf)?;
        let idx = PySlice::new(slf.py(), len as isize - 1, -(len as isize) - 1, -1);
        let items = Self::__getitem__(slf, idx.as_any())?;
        items.try_iter().map(|it| it.into_any())
    }

    /// All records as plain Python objects (a list).
    fn to_python<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let store = base(slf)?;
        let out = PyList::empty(py);
        for i in 0..store.reader.len() {
            let node = store.reader.root(i).map_err(err(&store))?;
            out.append(decode::node_value(py, &store, node, true)?)?;
        }
        Ok(out)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let h = slf.as_super().get();
        Ok(match h.store() {
            Ok(s) => format!(
                "SharedList(name='{}', len={}, nbytes={})",
                h.name,
                s.reader.len(),
                s.nbytes()
            ),
            Err(_) => format!("SharedList(name='{}', closed)", h.name),
        })
    }
}

#[pyclass(name = "SharedListIterator", module = "shmstore", frozen)]
pub struct RecordIter {
    store: Arc<Store>,
    next: AtomicU64,
}

#[pymethods]
impl RecordIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        // A plain load/store, not an atomic read-modify-write (a locked instruction on
        // every item): iterators are not meant to be shared between threads, and if one
        // is, the worst case is an item seen twice, never a bad read.
        let i = self.next.load(Ordering::Relaxed);
        self.next.store(i + 1, Ordering::Relaxed);
        if i >= self.store.reader.len() {
            self.next.store(self.store.reader.len(), Ordering::Relaxed);
            return Ok(None);
        }
        record(py, &self.store, i).map(Some)
    }
}

// ---------------------------------------------------------------------------------------

/// A dict of records in shared memory, with a hash index stored in the archive.
///
/// >>> d = shmstore.SharedDict({"doc-1": "text"})
/// >>> d["doc-1"]
/// 'text'
#[pyclass(name = "SharedDict", module = "shmstore", frozen, extends = StoreHandle)]
pub struct SharedDict;

fn dict_new(py: Python<'_>, store: Arc<Store>, created: bool) -> PyResult<Bound<'_, SharedDict>> {
    new_untracked(
        py,
        PyClassInitializer::from(StoreHandle::new(store, created)).add_subclass(SharedDict),
    )
}

fn dict_find(store: &Store, key: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    let k = if let Ok(s) = key.cast::<PyString>() {
        match s.to_str() {
            Ok(s) => Some(Key::Str(std::borrow::Cow::Borrowed(s))),
            Err(_) => None,
        }
    } else {
        py_key(key)?
    };
    match k {
        Some(k) => store.reader.lookup(&k).map_err(err(store)),
        None => {
            key.hash()?;
            Ok(None)
        }
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
        let store = store::build(py, Kind::Dict, name, dir, None, |builder| {
            let mut enc = Encoder::new(builder, "mapping", "mapping".into());
            for (i, item) in items.enumerate() {
                let item = item?;
                let pair = item.cast::<PyTuple>().ok().filter(|t| t.len() == 2);
                let (k, v) = match pair {
                    Some(t) => (t.get_item(0)?, t.get_item(1)?),
                    None => {
                        let seq: Vec<Bound<'_, PyAny>> = item.extract().map_err(|_| {
                            Exc::Invalid.err(format!(
                                "pairs[{i}]: expected a (key, value) pair, got {}",
                                item.get_type()
                                    .name()
                                    .map(|n| n.to_string())
                                    .unwrap_or_default()
                            ))
                        })?;
                        if seq.len() != 2 {
                            return Err(Exc::Invalid.err(format!("pairs[{i}]: expected a (key, value) pair of length 2, got length {}", seq.len())));
                        }
                        (seq[0].clone(), seq[1].clone())
                    }
                };
                let key = py_key(&k)?.ok_or_else(|| {
                    Exc::Unsupported.err(format!(
                        "{}[{i}]: cannot use {} as a key (keys may be str, int, bytes, float, bool, None or tuples of these)",
                        if pairs { "pairs" } else { "mapping keys" },
                        k.get_type().repr().map(|r| r.to_string()).unwrap_or_default()
                    ))
                })?;
                enc.builder.add_key(&key).map_err(|e| match e {
                    ArchiveError::DuplicateKey(first) => Exc::Invalid.err(format!(
                        "pairs[{i}]: duplicate key {} (first given at position {first}); pass a dict to keep only the last value",
                        k.repr().map(|r| r.to_string()).unwrap_or_default()
                    )),
                    e => archive_err(e, "mapping"),
                })?;
                let v = enc.record(&v, Some(Seg0::Key(&k)))?;
                enc.builder
                    .finish_record(&v)
                    .map_err(|e| enc.error_at(&e.to_string()))?;
            }
            Ok(())
        })?;
        dict_new(py, store, true)
    }

    /// Attach to an existing SharedDict by name.
    #[classmethod]
    #[pyo3(signature = (name, *, dir=None))]
    fn attach<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        name: &str,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, SharedDict>> {
        dict_new(
            py,
            open_as(py, Kind::Dict, Open::Attach(name.into(), dir))?,
            false,
        )
    }

    /// Map a SharedDict saved with `save(path)`.
    #[classmethod]
    fn open<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        path: PathBuf,
    ) -> PyResult<Bound<'py, SharedDict>> {
        dict_new(py, open_as(py, Kind::Dict, Open::File(path))?, false)
    }

    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(base(slf)?.reader.len() as usize)
    }

    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let guard = slf.as_super().get().read()?;
        let store = guard.as_ref().expect("read() checked it is open");
        match dict_find(store, key)? {
            Some(i) => record(slf.py(), store, i),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    /// `d[key]` if present, else `default`.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let store = base(slf)?;
        match dict_find(&store, key)? {
            Some(i) => record(slf.py(), &store, i),
            None => Ok(default.unwrap_or_else(|| slf.py().None().into_bound(slf.py()))),
        }
    }

    fn __contains__(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(dict_find(&*base(slf)?, key)?.is_some())
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, KeyIter>> {
        new_untracked(
            slf.py(),
            KeyIter {
                store: base(slf)?,
                next: AtomicU64::new(0),
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
        Self::to_python(slf)?.as_any().eq(plain)
    }

    /// All entries as a plain dict.
    fn to_python<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        let store = base(slf)?;
        let out = PyDict::new(py);
        for i in 0..store.reader.len() {
            let k = store.reader.key(i).map_err(err(&store))?;
            let node = store.reader.root(i).map_err(err(&store))?;
            out.set_item(
                decode::key(py, &k)?,
                decode::node_value(py, &store, node, true)?,
            )?;
        }
        Ok(out)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let h = slf.as_super().get();
        Ok(match h.store() {
            Ok(s) => format!(
                "SharedDict(name='{}', len={}, nbytes={})",
                h.name,
                s.reader.len(),
                s.nbytes()
            ),
            Err(_) => format!("SharedDict(name='{}', closed)", h.name),
        })
    }
}

#[pyclass(name = "SharedDictIterator", module = "shmstore", frozen)]
pub struct KeyIter {
    store: Arc<Store>,
    next: AtomicU64,
}

#[pymethods]
impl KeyIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        // A plain load/store, not an atomic read-modify-write (a locked instruction on
        // every item): iterators are not meant to be shared between threads, and if one
        // is, the worst case is an item seen twice, never a bad read.
        let i = self.next.load(Ordering::Relaxed);
        self.next.store(i + 1, Ordering::Relaxed);
        if i >= self.store.reader.len() {
            self.next.store(self.store.reader.len(), Ordering::Relaxed);
            return Ok(None);
        }
        let k = self.store.reader.key(i).map_err(err(&self.store))?;
        decode::key(py, &k).map(Some)
    }
}

// ---------------------------------------------------------------------------------------

/// One object (e.g. a numpy array) shared by name; made by `shmstore.put`.
///
/// >>> ref = shmstore.put(np.arange(3))
/// >>> ref.get()
/// array([0, 1, 2])
#[pyclass(name = "Ref", module = "shmstore", frozen, extends = StoreHandle)]
pub struct Ref;

fn ref_new(py: Python<'_>, store: Arc<Store>, created: bool) -> PyResult<Bound<'_, Ref>> {
    new_untracked(
        py,
        PyClassInitializer::from(StoreHandle::new(store, created)).add_subclass(Ref),
    )
}

#[pymethods]
impl Ref {
    /// Attach to an object shared with `put(obj, name=...)`.
    #[classmethod]
    #[pyo3(signature = (name, *, dir=None))]
    fn attach<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        name: &str,
        dir: Option<PathBuf>,
    ) -> PyResult<Bound<'py, Ref>> {
        ref_new(
            py,
            open_as(py, Kind::Object, Open::Attach(name.into(), dir))?,
            false,
        )
    }

    /// Map an object saved with `save(path)`.
    #[classmethod]
    fn open<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        path: PathBuf,
    ) -> PyResult<Bound<'py, Ref>> {
        ref_new(py, open_as(py, Kind::Object, Open::File(path))?, false)
    }

    /// The shared object: a read-only view, a read-only numpy array, or a scalar.
    fn get<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        record(slf.py(), &base(slf)?, 0)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let h = slf.as_super().get();
        Ok(match h.store() {
            Ok(s) => format!("Ref(name='{}', nbytes={})", h.name, s.nbytes()),
            Err(_) => format!("Ref(name='{}', closed)", h.name),
        })
    }
}

/// Share one object by name.
#[pyfunction]
#[pyo3(signature = (obj, *, name=None, dir=None))]
pub fn put<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    name: Option<&str>,
    dir: Option<PathBuf>,
) -> PyResult<Bound<'py, Ref>> {
    // Known-size input (an array, bytes): check the room before writing anything.
    let size_hint = obj
        .getattr("nbytes")
        .and_then(|n| n.extract::<u64>())
        .ok()
        .or_else(|| {
            obj.cast::<pyo3::types::PyBytes>()
                .ok()
                .map(|b| b.as_bytes().len() as u64)
        });
    let store = store::build(py, Kind::Object, name, dir, size_hint, |builder| {
        let mut enc = Encoder::new(builder, "obj", "obj".into());
        let v = enc.record(obj, None)?;
        enc.builder
            .finish_record(&v)
            .map_err(|e| enc.error_at(&e.to_string()))
    })?;
    ref_new(py, store, true)
}

/// What a pickle's (path, flag) names: a segment ("s"; its name is the file name) or a
/// saved archive file ("").
fn source_of(path: PathBuf, flag: &str) -> Source {
    match (
        flag,
        path.file_name().and_then(|n| n.to_str()).map(str::to_owned),
    ) {
        ("s", Some(name)) => Source::Segment { name, path },
        _ => Source::File { path },
    }
}

/// Unpickle a handle: attach by path (segment or file).
#[pyfunction]
pub fn _rebuild<'py>(
    py: Python<'py>,
    cls: &str,
    path: PathBuf,
    kind_flag: String,
) -> PyResult<Bound<'py, PyAny>> {
    let source = source_of(path, &kind_flag);
    let store = store::attach_source(py, source)?;
    let kind = match cls {
        "SharedList" => Kind::List,
        "SharedDict" => Kind::Dict,
        "Ref" => Kind::Object,
        other => return Err(Exc::Invalid.err(format!("unknown store class {other:?}"))),
    };
    store::expect_kind(&store, kind)?;
    Ok(match kind {
        Kind::List => list_new(py, store, false)?.into_any(),
        Kind::Dict => dict_new(py, store, false)?.into_any(),
        Kind::Object => ref_new(py, store, false)?.into_any(),
    })
}

/// Unpickle a view: attach, then validate the position as a subtree of its record.
#[pyfunction]
pub fn _rebuild_view<'py>(
    py: Python<'py>,
    path: PathBuf,
    kind_flag: String,
    rec: u64,
    pos: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let source = source_of(path, &kind_flag);
    let store = store::attach_source(py, source)?;
    let node = store.reader.node_checked(rec, pos).map_err(err(&store))?;
    Ok(match store.reader.get(node) {
        ArchivedValue::List(_) | ArchivedValue::Tuple(_) => {
            new_untracked(py, ListView::new(store, node))?.into_any()
        }
        ArchivedValue::Dict(_) | ArchivedValue::IndexedDict(_) => {
            new_untracked(py, DictView::new(store, node))?.into_any()
        }
        _ => return Err(Exc::Corrupt.err("pickled view does not point at a list or dict")),
    })
}

/// Unlink every store this process created and still owns (run at interpreter exit).
#[pyfunction]
pub fn _cleanup_at_exit() -> usize {
    crate::segment::cleanup_owned()
}

/// Header facts of a store: by handle, or by segment name / file path (for the CLI).
#[pyfunction]
pub fn _store_info<'py>(
    py: Python<'py>,
    target: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let store = if let Ok(h) = target.cast::<StoreHandle>() {
        h.get().store()?
    } else {
        let s: PathBuf = target.extract()?;
        let text = s.to_string_lossy().to_string();
        if text.contains('/') {
            store::open_file(py, &s)?
        } else {
            store::attach(py, &text, None)?
        }
    };
    let h = store.reader.header();
    let d = PyDict::new(py);
    d.set_item("name", store.source.name())?;
    d.set_item("path", store.source.path().display().to_string())?;
    d.set_item("kind", h.kind.name())?;
    d.set_item("count", h.count)?;
    d.set_item("nbytes", h.total_len)?;
    d.set_item("records_nbytes", h.index_off - 128)?;
    d.set_item("metadata_nbytes", h.total_len - h.index_off)?;
    d.set_item("symbols", store.reader.symbol_count())?;
    d.set_item("created_unix_ms", h.created_unix_ms)?;
    d.set_item("creator_pid", h.creator_pid)?;
    d.set_item("owned_here", store.mapping().is_owner())?;
    d.set_item("private_copy", store.mapping().is_private_copy())?;
    d.set_item("registered", store.registered())?;
    Ok(d)
}

/// Testing hook: fuzz case `seed` (src/archive/fuzz.rs) as (kind, archive bytes): an
/// archive with valid checksums and arbitrary structure, for tests/test_fuzz.py.
#[pyfunction]
pub fn _fuzz_case(py: Python<'_>, seed: u64) -> (&'static str, Bound<'_, pyo3::types::PyBytes>) {
    let bytes = py.detach(|| crate::archive::fuzz::case(seed));
    (
        crate::archive::fuzz::kind_of(seed).name(),
        pyo3::types::PyBytes::new(py, &bytes),
    )
}

/// Testing hook: the hostile archive `name` (src/archive/fuzz.rs, `CRAFTED`), as bytes.
#[pyfunction]
pub fn _crafted_archive<'py>(
    py: Python<'py>,
    name: &str,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let (_, bytes) = crate::archive::fuzz::crafted(name)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("no archive {name:?}")))?;
    Ok(pyo3::types::PyBytes::new(py, &bytes))
}
