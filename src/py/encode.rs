//! Python objects -> archive values (GIL held). Errors carry the path of the offending
//! value, e.g. `records[12]['annotations'][3]['mask']: cannot store <class 'Foo'>`.

use std::borrow::Cow;
use std::io::{Seek, Write};

use pyo3::exceptions::PyUnicodeEncodeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyComplex, PyDict, PyFloat, PyInt, PyList, PyMemoryView,
    PyString, PyTuple, PyType,
};

use super::errors::{archive_err, Exc};
use crate::archive::value::IndexedDict;
use crate::archive::value::DICT_INDEX_MIN;
use crate::archive::{ArrayMeta, Builder, Key, Value};

/// Containers nested deeper than this are refused: readers enforce the same limit.
pub use crate::archive::value::MAX_DEPTH;
use crate::archive::value::MAX_KEY_DEPTH;
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

/// numpy's types, if numpy is imported (an ndarray cannot exist otherwise).
struct Numpy {
    ndarray: Py<PyType>,
    generic: Py<PyType>,
}

static NUMPY: PyOnceLock<Numpy> = PyOnceLock::new();

/// numpy's types once numpy has been imported by someone; `None` before (not cached, so a
/// later `import numpy` is seen).
fn numpy(py: Python<'_>) -> Option<&'static Numpy> {
    NUMPY
        .get_or_try_init(py, || {
            let modules = py
                .import("sys")
                .and_then(|s| s.getattr("modules"))
                .map_err(drop)?;
            let module = modules.get_item("numpy").map_err(drop)?;
            let ty = |n: &str| -> Result<Py<PyType>, ()> {
                Ok(module
                    .getattr(n)
                    .map_err(drop)?
                    .cast_into::<PyType>()
                    .map_err(drop)?
                    .unbind())
            };
            Ok::<_, ()>(Numpy {
                ndarray: ty("ndarray")?,
                generic: ty("generic")?,
            })
        })
        .ok()
}

/// Encodes the records of one store.
pub struct Encoder<'b, 'py, W: Write + Seek> {
    pub builder: &'b mut Builder<W>,
    root: String,
    path: Vec<Seg<'py>>,
    /// Containers on the current path, to refuse self-referencing input.
    active: Vec<usize>,
    context: String,
}

fn key_repr(key: &Bound<'_, PyAny>) -> String {
    key.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<key>".into())
}

impl<'b, 'py, W: Write + Seek + Send> Encoder<'b, 'py, W> {
    pub fn new(builder: &'b mut Builder<W>, root: &str, context: String) -> Self {
        Encoder {
            builder,
            root: root.to_owned(),
            path: Vec::new(),
            active: Vec::new(),
            context,
        }
    }

    /// The path to the value being encoded, e.g. `records[12]['annotations'][3]`.
    fn where_(&self) -> String {
        let mut s = self.root.clone();
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
        Exc::Unsupported.err(format!(
            "{}: cannot store {tname}{what}; {SUPPORTED}",
            self.where_()
        ))
    }

    /// Encode one top-level record; `label` is its position (index or key repr).
    pub fn record(
        &mut self,
        obj: &Bound<'py, PyAny>,
        label: Option<Seg0<'_, 'py>>,
    ) -> PyResult<Value> {
        self.path.clear();
        self.active.clear();
        match label {
            Some(Seg0::Index(i)) => self.path.push(Seg::Index(i)),
            Some(Seg0::Key(k)) => self.path.push(Seg::Key(k.clone())),
            None => {}
        }
        self.value(obj, 0)
    }

    pub fn error_at(&self, msg: &str) -> PyErr {
        Exc::Invalid.err(format!("{}: {msg}", self.where_()))
    }

    fn enter(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
        if depth >= MAX_DEPTH {
            return Err(Exc::Invalid.err(format!(
                "{}: nested deeper than {MAX_DEPTH} levels; flatten the data",
                self.where_()
            )));
        }
        let id = obj.as_ptr() as usize;
        if self.active.contains(&id) {
            return Err(Exc::Invalid.err(format!(
                "{}: the value contains itself (a reference cycle); shmstore stores trees, not graphs",
                self.where_()
            )));
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
            return Ok(Value::Complex(Box::new([c.real(), c.imag()])));
        }
        if obj.cast::<PyMemoryView>().is_ok() {
            let b = obj.call_method0("tobytes")?;
            return self.bytes(b.cast::<PyBytes>()?.as_bytes());
        }
        if let Some(np) = numpy(py) {
            if obj.is_instance(np.ndarray.bind(py))? {
                if obj.hasattr("mask")? && obj.hasattr("_mask")? {
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
        if super::views::is_view(obj) {
            let plain = obj.call_method0("to_python")?;
            return self.value(&plain, depth);
        }
        Err(self.unsupported(obj, ""))
    }

    fn str_of<'a>(&self, s: &'a Bound<'_, PyString>) -> PyResult<Cow<'a, str>> {
        s.to_str().map(Cow::Borrowed).map_err(|e| {
            if e.is_instance_of::<PyUnicodeEncodeError>(s.py()) {
                Exc::Unsupported.err(format!(
                    "{}: cannot store a str with lone surrogates (not valid UTF-8)",
                    self.where_()
                ))
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
                .map_err(|e| archive_err(e, &self.context))?;
            return Ok(Value::BytesExt(Box::new(ext)));
        }
        Ok(Value::Bytes(b.to_vec()))
    }

    fn dict(&mut self, d: &Bound<'py, PyDict>, depth: usize) -> PyResult<Value> {
        let n = d.len();
        let indexed = n > DICT_INDEX_MIN;
        let mut items = Vec::with_capacity(2 * n);
        let mut hashes = Vec::with_capacity(if indexed { n } else { 0 });
        for (k, v) in d.iter() {
            self.path.push(Seg::Key(k.clone()));
            let (kv, h) = self.key(&k, indexed)?;
            if indexed {
                hashes.push(h);
            }
            items.push(kv);
            items.push(self.value(&v, depth + 1)?);
            self.path.pop();
        }
        if items.len() != 2 * n {
            return Err(self.error_at("dict changed size while it was being stored"));
        }
        Ok(if indexed {
            Value::IndexedDict(Box::new(IndexedDict {
                items,
                index: build_index(&hashes),
            }))
        } else {
            Value::Dict(items)
        })
    }

    /// A dict key as a stored value (str keys interned), and its stable hash if `hash`.
    fn key(&mut self, k: &Bound<'_, PyAny>, hash: bool) -> PyResult<(Value, u64)> {
        if let Ok(s) = k.cast::<PyString>() {
            let s = self.str_of(s)?;
            let h = if hash {
                crate::archive::key::hash_str(&s)
            } else {
                0
            };
            let v = match self.builder.intern(&s) {
                Some(id) => Value::Sym(id),
                None => Value::Str(s.into_owned()),
            };
            return Ok((v, h));
        }
        match py_key(k)? {
            Some(key) => Ok((key_value(&key), key.stable_hash())),
            None => Err(self.unsupported(
                k,
                " as a dict key (keys may be str, int, float, bool, None, bytes or tuples of these)",
            )),
        }
    }

    fn array(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        let py = obj.py();
        let dtype = obj.getattr("dtype")?;
        let kind: String = dtype.getattr("kind")?.extract()?;
        if !matches!(kind.as_str(), "b" | "i" | "u" | "f" | "c") {
            return Err(self.unsupported(
                obj,
                &format!(
                    " with dtype {} (only bool/int/uint/float/complex arrays can be shared; \
                     convert object/str arrays to lists)",
                    dtype.repr()?
                ),
            ));
        }
        // Non-contiguous input (slices, transposes) is copied to C order once, here
        // (`copy`, not `ascontiguousarray`, which would turn a 0-d array into 1-d).
        let contiguous: bool = obj.getattr("flags")?.getattr("c_contiguous")?.extract()?;
        let arr = if contiguous {
            obj.clone()
        } else {
            obj.call_method1("copy", ("C",))?
        };
        let typestr: String = arr.getattr("dtype")?.getattr("str")?.extract()?;
        if crate::archive::value::typestr_itemsize(&typestr).is_none() {
            return Err(self.unsupported(obj, &format!(" with dtype {typestr}")));
        }
        let shape: Vec<u64> = arr.getattr("shape")?.extract()?;
        let flat = arr
            .call_method1("reshape", (-1,))?
            .call_method1("view", ("u1",))?;
        let buf = pyo3::buffer::PyBuffer::<u8>::get(&flat)?;
        if !buf.is_c_contiguous() {
            return Err(self.error_at("numpy gave a non-contiguous buffer"));
        }
        let len = buf.len_bytes();
        let ptr = buf.buf_ptr() as usize;
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
        .map_err(|e| archive_err(e, &self.context))?;
        drop(buf);
        Ok(Value::Array(Box::new(ArrayMeta {
            typestr,
            shape,
            data: ext,
        })))
    }
}

/// A top-level record label.
pub enum Seg0<'a, 'py> {
    Index(usize),
    Key(&'a Bound<'py, PyAny>),
}

fn int_value(i: &Bound<'_, PyInt>) -> PyResult<Value> {
    if let Ok(v) = i.extract::<i64>() {
        return Ok(Value::Int(v));
    }
    Ok(Value::BigInt(bigint_bytes(i)?))
}

fn bigint_bytes(i: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let bits: usize = i.call_method0("bit_length")?.extract()?;
    let n = bits / 8 + 1;
    let kwargs = pyo3::types::PyDict::new(i.py());
    kwargs.set_item("signed", true)?;
    let b = i.call_method("to_bytes", (n, "little"), Some(&kwargs))?;
    Ok(b.cast::<PyBytes>()?.as_bytes().to_vec())
}

/// A Python object as a dict key; `None` if its type cannot be a stored key.
pub fn py_key(k: &Bound<'_, PyAny>) -> PyResult<Option<Key<'static>>> {
    py_key_depth(k, 0)
}

fn py_key_depth(k: &Bound<'_, PyAny>, depth: usize) -> PyResult<Option<Key<'static>>> {
    if k.is_none() {
        return Ok(Some(Key::None));
    }
    if let Ok(b) = k.cast_exact::<PyBool>() {
        return Ok(Some(Key::Bool(b.is_true())));
    }
    if let Ok(s) = k.cast::<PyString>() {
        return Ok(s.to_str().ok().map(|s| Key::Str(Cow::Owned(s.to_owned()))));
    }
    if let Ok(i) = k.cast::<PyInt>() {
        return Ok(Some(match i.extract::<i64>() {
            Ok(v) => Key::Int(v),
            Err(_) => Key::BigInt(Cow::Owned(bigint_bytes(i)?)),
        }));
    }
    if let Ok(f) = k.cast::<PyFloat>() {
        return Ok(Some(Key::Float(f.value())));
    }
    if let Ok(b) = k.cast::<PyBytes>() {
        return Ok(Some(Key::Bytes(Cow::Owned(b.as_bytes().to_vec()))));
    }
    if let Ok(t) = k.cast::<PyTuple>() {
        if depth >= MAX_KEY_DEPTH {
            return Ok(None);
        }
        let mut items = Vec::with_capacity(t.len());
        for it in t.iter() {
            match py_key_depth(&it, depth + 1)? {
                Some(key) => items.push(key),
                None => return Ok(None),
            }
        }
        return Ok(Some(Key::Tuple(items)));
    }
    // numpy integer/float scalars used as keys: via their Python value.
    if let Some(np) = numpy(k.py()) {
        if k.is_instance(np.generic.bind(k.py()))? {
            let item = k.call_method0("item")?;
            if !item.is_instance(np.generic.bind(k.py()))? {
                return py_key_depth(&item, depth);
            }
        }
    }
    Ok(None)
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

/// Open-addressing table of `entry + 1` (0 = empty), capacity a power of two >= 2n.
fn build_index(hashes: &[u64]) -> Vec<u32> {
    let cap = (hashes.len() * 2).next_power_of_two();
    let mut slots = vec![0u32; cap];
    for (e, &h) in hashes.iter().enumerate() {
        let mut i = h as usize & (cap - 1);
        while slots[i] != 0 {
            i = (i + 1) & (cap - 1);
        }
        slots[i] = e as u32 + 1;
    }
    slots
}
