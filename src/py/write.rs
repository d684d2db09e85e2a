//! Writing: Python objects -> archive values (GIL held), record by record into a
//! `Builder`. Errors carry the path of the offending value, e.g.
//! `records[12]['annotations'][3]['mask']: cannot store <class 'Foo'>`, and keep their type
//! (a full /dev/shm is OutOfSharedMemoryError whatever the value being written).

use std::borrow::Cow;
use std::mem::MaybeUninit;

use pyo3::exceptions::PyUnicodeEncodeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyComplex, PyDict, PyFloat, PyInt, PyList, PyMemoryView,
    PyString, PyTuple,
};

use super::errors::Error;
use super::keys::{bigint_bytes, numpy, py_key};
use super::read::is_view;
use crate::archive::builder::Sink;
use crate::archive::{ArchiveError, ArrayMeta, Builder, Key, Value};

/// Containers nested deeper than this are refused: readers enforce the same limit.
use crate::archive::value::MAX_DEPTH;
/// `bytes` longer than this are stored out of line (no temporary copy, 64-bit length).
const BYTES_OUT_OF_LINE: usize = 64 * 1024;
/// Array payloads larger than this are copied with the GIL released.
const DETACH_COPY: usize = 1 << 20;

const SUPPORTED: &str = "supported: None, bool, int, float, complex, str, bytes, bytearray, memoryview, \
                         list, tuple, dict, numpy arrays of bool/int/uint/float/complex and numpy scalars";

/// One step of the path to the value being encoded. Keys are kept as objects (a refcount,
/// not a repr): the path is only formatted when an error is reported.
#[derive(Clone)]
enum Seg<'py> {
    Index(usize),
    Key(Bound<'py, PyAny>),
}

/// Encodes the records of one store.
pub(crate) struct Encoder<'b, 'py, W: Sink> {
    builder: &'b mut Builder<W>,
    root: &'static str,
    path: Vec<Seg<'py>>,
    /// Containers on the current path, to refuse self-referencing input.
    active: Vec<usize>,
    /// Dict keys already interned, by object address (most dicts of a data set share their
    /// key objects): the symbol without reading or hashing the str again. Each key object is
    /// held here while the store is written, so its address cannot be reused by another.
    key_ids: ahash::AHashMap<usize, (u32, Bound<'py, PyString>)>,
}

/// Most key objects remembered by one writer.
const KEY_CACHE: usize = 4096;

fn key_repr(key: &Bound<'_, PyAny>) -> String {
    key.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<key>".into())
}

impl<'b, 'py, W: Sink + Send> Encoder<'b, 'py, W> {
    /// `root` names the input in error paths (`records`, `mapping`, `obj`).
    pub(crate) fn new(builder: &'b mut Builder<W>, root: &'static str) -> Self {
        Encoder {
            builder,
            root,
            path: Vec::new(),
            active: Vec::new(),
            key_ids: ahash::AHashMap::with_hasher(crate::archive::map_hasher()),
        }
    }

    /// The path to the value being encoded, e.g. `records[12]['annotations'][3]`.
    fn where_(&self) -> String {
        let mut s = self.root.to_owned();
        for seg in &self.path {
            match seg {
                Seg::Index(i) => s.push_str(&format!("[{i}]")),
                Seg::Key(k) => s.push_str(&format!("[{}]", key_repr(k))),
            }
        }
        s
    }

    fn unsupported(&self, obj: &Bound<'_, PyAny>, what: &str) -> PyErr {
        let ty = obj.get_type();
        let tname = ty.repr().map(|r| r.to_string()).unwrap_or_default();
        Error::Unsupported {
            at: self.where_(),
            what: format!("cannot store {tname}{what}; {SUPPORTED}"),
        }
        .into()
    }

    /// An archive error while writing the value at the current path: the path is added
    /// to the message, the error keeps its class.
    fn archive_err(&self, err: ArchiveError) -> PyErr {
        Error::Archive {
            at: self.where_(),
            err,
        }
        .into()
    }

    /// Encode `obj` and write it as the next record; `label` is its position (index or key).
    pub(crate) fn write_record(
        &mut self,
        obj: &Bound<'py, PyAny>,
        label: Option<Seg0<'_, 'py>>,
    ) -> PyResult<()> {
        let v = self.record(obj, label)?;
        self.builder
            .finish_record(&v)
            .map_err(|e| self.archive_err(e))
    }

    /// Dict stores: register the key of the next record (fails on a duplicate key, with the
    /// path of the key, `at`).
    pub(crate) fn add_key(&mut self, key: &Key<'_>, at: String) -> PyResult<()> {
        self.builder
            .add_key(key)
            .map_err(|err| Error::Archive { at, err }.into())
    }

    /// Encode one top-level record; `label` is its position (index or key repr).
    fn record(&mut self, obj: &Bound<'py, PyAny>, label: Option<Seg0<'_, 'py>>) -> PyResult<Value> {
        self.path.clear();
        self.active.clear();
        match label {
            Some(Seg0::Index(i)) => self.path.push(Seg::Index(i)),
            Some(Seg0::Key(k)) => self.path.push(Seg::Key(k.clone())),
            None => {}
        }
        self.value(obj, 0)
    }

    fn error_at(&self, msg: &str) -> PyErr {
        Error::Invalid {
            at: self.where_(),
            what: msg.to_owned(),
        }
        .into()
    }

    fn enter(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
        crate::py::stack::check(|| format!("storing the value at {}", self.where_()))?;
        if depth >= MAX_DEPTH {
            return Err(self.error_at(&format!(
                "nested deeper than {MAX_DEPTH} levels; flatten the data"
            )));
        }
        let id = obj.as_ptr() as usize;
        if self.active.contains(&id) {
            return Err(self.error_at(
                "the value contains itself (a reference cycle); shmstore stores trees, not graphs",
            ));
        }
        self.active.push(id);
        Ok(())
    }

    fn value(&mut self, obj: &Bound<'py, PyAny>, depth: usize) -> PyResult<Value> {
        let py = obj.py();
        if obj.is_none() {
            return Ok(Value::None);
        }
        if let Ok(b) = obj.cast_exact::<PyBool>() {
            return Ok(Value::Bool(b.is_true()));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(Value::Str(self.str_of(s)?.into_owned()));
        }
        if let Ok(i) = obj.cast::<PyInt>() {
            return int_value(i);
        }
        if let Ok(f) = obj.cast::<PyFloat>() {
            return Ok(Value::Float(f.value()));
        }
        if let Ok(d) = obj.cast::<PyDict>() {
            self.enter(obj, depth)?;
            let v = self.dict(d, depth)?;
            self.active.pop();
            return Ok(v);
        }
        if let Ok(l) = obj.cast::<PyList>() {
            self.enter(obj, depth)?;
            let mut items = Vec::with_capacity(l.len());
            // Index access (not an iterator): a list mutated while we read it cannot
            // make us read past its end.
            let mut i = 0;
            while i < l.len() {
                let item = l.get_item(i)?;
                self.path.push(Seg::Index(i));
                items.push(self.value(&item, depth + 1)?);
                self.path.pop();
                i += 1;
            }
            self.active.pop();
            return Ok(Value::List(items));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            self.enter(obj, depth)?;
            let mut items = Vec::with_capacity(t.len());
            for (i, item) in t.iter().enumerate() {
                self.path.push(Seg::Index(i));
                items.push(self.value(&item, depth + 1)?);
                self.path.pop();
            }
            self.active.pop();
            return Ok(Value::Tuple(items));
        }
        if let Ok(b) = obj.cast::<PyBytes>() {
            return self.bytes(b.as_bytes());
        }
        if let Ok(b) = obj.cast::<PyByteArray>() {
            return self.bytes(&b.to_vec());
        }
        if let Ok(c) = obj.cast::<PyComplex>() {
            return Ok(Value::Complex([c.real(), c.imag()]));
        }
        if obj.cast::<PyMemoryView>().is_ok() {
            let b = obj.call_method0("tobytes")?;
            return self.bytes(b.cast::<PyBytes>()?.as_bytes());
        }
        if let Some(np) = numpy(py) {
            if obj.is_instance(np.ndarray.bind(py))? {
                // A plain ndarray has no mask: only subclasses are asked (a failed attribute
                // lookup raises and clears an AttributeError, ~0.4 µs per small put).
                let subclass = !obj.get_type().is(np.ndarray.bind(py));
                if subclass
                    && obj.hasattr(intern!(py, "mask"))?
                    && obj.hasattr(intern!(py, "_mask"))?
                {
                    return Err(self.unsupported(
                        obj,
                        " (its mask would be lost; store .data and .mask as two arrays)",
                    ));
                }
                return self.array(obj);
            }
            if obj.is_instance(np.generic.bind(py))? {
                let item = obj.call_method0("item")?;
                if item.is_instance(np.generic.bind(py))? || item.is(obj) {
                    return Err(self.unsupported(obj, ""));
                }
                return self.value(&item, depth);
            }
        }
        if is_view(obj) {
            let plain = obj.call_method0("to_python")?;
            return self.value(&plain, depth);
        }
        Err(self.unsupported(obj, ""))
    }

    fn str_of<'a>(&self, s: &'a Bound<'_, PyString>) -> PyResult<Cow<'a, str>> {
        s.to_str().map(Cow::Borrowed).map_err(|e| {
            if e.is_instance_of::<PyUnicodeEncodeError>(s.py()) {
                Error::Unsupported {
                    at: self.where_(),
                    what: "cannot store a str with lone surrogates (not valid UTF-8)".into(),
                }
                .into()
            } else {
                e
            }
        })
    }

    fn bytes(&mut self, b: &[u8]) -> PyResult<Value> {
        if b.len() > BYTES_OUT_OF_LINE {
            let ext = self
                .builder
                .write_payload(b)
                .map_err(|e| self.archive_err(e))?;
            return Ok(Value::BytesExt(ext));
        }
        Ok(Value::Bytes(b.to_vec()))
    }

    fn dict(&mut self, d: &Bound<'py, PyDict>, depth: usize) -> PyResult<Value> {
        let n = d.len();
        let mut pairs = Vec::with_capacity(n);
        for (k, v) in d.iter() {
            self.path.push(Seg::Key(k.clone()));
            let kv = self.key(&k)?;
            pairs.push((kv, self.value(&v, depth + 1)?));
            self.path.pop();
        }
        if pairs.len() != n {
            return Err(self.error_at("dict changed size while it was being stored"));
        }
        Ok(Value::Dict(pairs))
    }

    /// A dict key as a stored value.
    fn key(&mut self, k: &Bound<'py, PyAny>) -> PyResult<Value> {
        if let Ok(s) = k.cast::<PyString>() {
            // An exact str cannot change: the same object is the same key.
            let exact = k.is_exact_instance_of::<PyString>();
            if exact {
                if let Some((id, _)) = self.key_ids.get(&(s.as_ptr() as usize)) {
                    return Ok(Value::Sym(*id));
                }
            }
            let text = self.str_of(s)?;
            return Ok(match self.builder.intern(&text) {
                Some(id) => {
                    if exact && self.key_ids.len() < KEY_CACHE {
                        self.key_ids.insert(s.as_ptr() as usize, (id, s.clone()));
                    }
                    Value::Sym(id)
                }
                None => Value::Str(text.into_owned()),
            });
        }
        match py_key(k)? {
            Some(key) => Ok(key_value(&key)),
            None => Err(self.unsupported(
                k,
                " as a dict key (keys may be str, int, float, bool, None, bytes or tuples of these)",
            )),
        }
    }

    fn array(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        let py = obj.py();
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let typestr = match known_dtype(&dtype) {
            Some(typestr) => typestr,
            None => {
                let kind: String = dtype.getattr(intern!(py, "kind"))?.extract()?;
                if !matches!(kind.as_str(), "b" | "i" | "u" | "f" | "c") {
                    return Err(self.unsupported(
                        obj,
                        &format!(
                            " with dtype {} (only bool/int/uint/float/complex arrays can be \
                             shared; convert object/str arrays to lists)",
                            dtype.repr()?
                        ),
                    ));
                }
                let typestr: String = dtype.getattr(intern!(py, "str"))?.extract()?;
                if crate::archive::value::typestr_itemsize(&typestr).is_none() {
                    return Err(self.unsupported(obj, &format!(" with dtype {typestr}")));
                }
                remember_dtype(&dtype, &typestr);
                typestr
            }
        };
        // The bytes, through a C-contiguous buffer export of the array itself (no flattened
        // uint8 view made first: two temporary arrays per put of a small array), which also
        // gives the shape. Refused for non-contiguous input (slices, transposes): copied to
        // C order once, here (`copy`, not `ascontiguousarray`, which would turn a 0-d array
        // into 1-d; the copy keeps the dtype, so the typestr is the input's).
        let (mut view, mut copy_view) = (MaybeUninit::zeroed(), MaybeUninit::zeroed());
        let (arr, buf) = match ContiguousBytes::get(obj, &mut view) {
            Ok(buf) => (obj.clone(), buf),
            Err(_) => {
                let arr = obj.call_method1(intern!(py, "copy"), ("C",))?;
                let buf = ContiguousBytes::get(&arr, &mut copy_view)?;
                (arr, buf)
            }
        };
        let shape = match buf.shape() {
            Some(shape) => shape,
            None => arr.getattr(intern!(py, "shape"))?.extract()?,
        };
        let len = buf.len;
        let ptr = buf.ptr as usize;
        let builder = &mut *self.builder;
        let mut write = move || {
            // SAFETY: `buf` holds a buffer export of a C-contiguous uint8 array of `len`
            // bytes for the whole call, so the memory stays valid and unmoved; we only read.
            let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            builder.write_payload(data)
        };
        let ext = if len > DETACH_COPY {
            py.detach(write)
        } else {
            write()
        }
        .map_err(|e| self.archive_err(e))?;
        drop(buf);
        Ok(Value::Array(Box::new(ArrayMeta {
            typestr,
            shape,
            data: ext,
        })))
    }
}

/// Supported dtypes seen lately, with their typestr: a dtype object met again (most arrays
/// put share a handful) costs no attribute lookups. Each is held here, so its address cannot
/// be reused by another object while it is remembered.
static DTYPES: std::sync::Mutex<Vec<(Py<PyAny>, String)>> = std::sync::Mutex::new(Vec::new());
/// Most dtypes remembered.
const DTYPE_CACHE: usize = 16;

fn known_dtype(dtype: &Bound<'_, PyAny>) -> Option<String> {
    let known = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
    known
        .iter()
        .find(|(d, _)| d.as_ptr() == dtype.as_ptr())
        .map(|(_, t)| t.clone())
}

fn remember_dtype(dtype: &Bound<'_, PyAny>, typestr: &str) {
    let entry = (dtype.clone().unbind(), typestr.to_owned());
    let old = {
        let mut known = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
        let old = (known.len() >= DTYPE_CACHE).then(|| known.remove(0));
        known.push(entry);
        old
    };
    // Dropped outside the lock (a decref may run arbitrary code).
    drop(old);
}

/// A C-contiguous buffer export of an object (`PyObject_GetBuffer` with
/// `PyBUF_C_CONTIGUOUS`: refused unless the exporter's memory is one C-ordered run), released
/// when dropped. Its bytes: `ptr .. ptr + len`. The `Py_buffer` is the caller's (on its
/// stack: no allocation per array put), borrowed for as long as the export lives, so its
/// address stays fixed until `PyBuffer_Release` (exporters may keep pointers into it).
struct ContiguousBytes<'v> {
    view: &'v mut pyo3::ffi::Py_buffer,
    ptr: *const u8,
    len: usize,
}

impl<'v> ContiguousBytes<'v> {
    fn get(
        obj: &Bound<'_, PyAny>,
        view: &'v mut MaybeUninit<pyo3::ffi::Py_buffer>,
    ) -> PyResult<Self> {
        // SAFETY: `obj` is a live object (the GIL is held: it is bound) and `view` a
        // writable Py_buffer; on success the export is released exactly once, in Drop.
        let rc = unsafe {
            pyo3::ffi::PyObject_GetBuffer(
                obj.as_ptr(),
                view.as_mut_ptr(),
                pyo3::ffi::PyBUF_C_CONTIGUOUS,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: PyObject_GetBuffer succeeded, so it filled the struct in.
        let view = unsafe { view.assume_init_mut() };
        let len = usize::try_from(view.len).unwrap_or(0);
        let ptr = view.buf as *const u8;
        Ok(ContiguousBytes { view, ptr, len })
    }

    /// The exported shape (`PyBUF_C_CONTIGUOUS` asks for it), `None` if the exporter gave
    /// none for a non-scalar.
    fn shape(&self) -> Option<Vec<u64>> {
        let ndim = usize::try_from(self.view.ndim).ok()?;
        if ndim == 0 {
            return Some(Vec::new());
        }
        if self.view.shape.is_null() {
            return None;
        }
        // SAFETY: an exporter that fills `shape` gives `ndim` entries, valid until the
        // export is released (in Drop, after this borrow of `self`).
        let dims = unsafe { std::slice::from_raw_parts(self.view.shape, ndim) };
        dims.iter().map(|&d| u64::try_from(d).ok()).collect()
    }
}

impl Drop for ContiguousBytes<'_> {
    fn drop(&mut self) {
        // SAFETY: the export was made by PyObject_GetBuffer in `get` and not released since.
        // Called with the GIL held: the value never leaves the `array` call that made it.
        unsafe { pyo3::ffi::PyBuffer_Release(self.view) };
    }
}

/// A top-level record label.
pub(crate) enum Seg0<'a, 'py> {
    Index(usize),
    Key(&'a Bound<'py, PyAny>),
}

fn int_value(i: &Bound<'_, PyInt>) -> PyResult<Value> {
    if let Ok(v) = i.extract::<i64>() {
        return Ok(Value::Int(v));
    }
    Ok(Value::BigInt(bigint_bytes(i)?))
}

fn key_value(k: &Key<'_>) -> Value {
    match k {
        Key::None => Value::None,
        Key::Bool(b) => Value::Bool(*b),
        Key::Int(i) => Value::Int(*i),
        Key::BigInt(b) => Value::BigInt(b.to_vec()),
        Key::Float(f) => Value::Float(*f),
        Key::Str(s) => Value::Str(s.to_string()),
        Key::Bytes(b) => Value::Bytes(b.to_vec()),
        Key::Tuple(t) => Value::Tuple(t.iter().map(key_value).collect()),
    }
}
