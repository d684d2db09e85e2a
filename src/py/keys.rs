//! Dict keys between Python and the archive (`crate::archive::Key`), the big-int byte form
//! they share with values, and how numpy is detected (its scalars are keys and values too).

use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyComplex, PyDict, PyFloat, PyInt, PyString, PyTuple, PyType};
use pyo3::IntoPyObjectExt;

use crate::archive::Key;

use crate::archive::value::MAX_KEY_DEPTH;

/// numpy's types, if numpy is imported (an ndarray cannot exist otherwise).
pub(crate) struct Numpy {
    pub(crate) ndarray: Py<PyType>,
    pub(crate) generic: Py<PyType>,
}

static NUMPY: PyOnceLock<Numpy> = PyOnceLock::new();

/// numpy's types once numpy has been imported by someone; `None` before (not cached, so a
/// later `import numpy` is seen).
pub(crate) fn numpy(py: Python<'_>) -> Option<&'static Numpy> {
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

/// An int outside i64 as minimal two's-complement little-endian bytes (the `BigInt` form).
pub(crate) fn bigint_bytes(i: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let bits: usize = i.call_method0("bit_length")?.extract()?;
    let n = bits / 8 + 1;
    let kwargs = PyDict::new(i.py());
    kwargs.set_item("signed", true)?;
    let b = i.call_method("to_bytes", (n, "little"), Some(&kwargs))?;
    let mut b = b.cast::<PyBytes>()?.as_bytes().to_vec();
    // `bit_length` is that of |i|: a negative power of two such as -2**71 fits in a byte
    // less than the length it gives.
    b.truncate(crate::archive::key::bigint_min_len(&b));
    Ok(b)
}

/// The Python int of the `BigInt` byte form.
pub(crate) fn bigint<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("signed", true)?;
    py.get_type::<PyInt>().call_method(
        "from_bytes",
        (PyBytes::new(py, bytes), "little"),
        Some(&kwargs),
    )
}

/// A Python object as a dict key; `None` if its type cannot be a stored key.
pub(crate) fn py_key(k: &Bound<'_, PyAny>) -> PyResult<Option<Key<'static>>> {
    key_depth(k, 0, false)
}

/// A lookup's key: as [`py_key`], and besides a number of a type that is never stored
/// (complex, `Decimal`, `Fraction`, ...) as the int or float it equals, the way a Python
/// dict finds the key `1` from `1 + 0j`, `Decimal(1)` or `Fraction(1)`; `None` when it
/// equals none (`Fraction(1, 3)`, `2j`): absent. Only for lookups: a written key keeps its
/// type.
pub(crate) fn probe_key(k: &Bound<'_, PyAny>) -> PyResult<Option<Key<'static>>> {
    key_depth(k, 0, true)
}

static NUMBER: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A number of a type that is never stored, as the int or float it equals ([`probe_key`]).
fn number_probe(k: &Bound<'_, PyAny>, depth: usize) -> PyResult<Option<Key<'static>>> {
    let py = k.py();
    if let Ok(c) = k.cast::<PyComplex>() {
        // 1 + 0j == 1 == 1.0 (and 1 - 0j too: -0.0 == 0.0)
        let (re, im) = (c.real(), c.imag());
        return Ok((im == 0.0).then_some(Key::Float(re)));
    }
    let number = NUMBER.import(py, "numbers", "Number")?;
    if !k.is_instance(number)? {
        return Ok(None);
    }
    // An exception converting or comparing (a NaN has no int, a signalling NaN refuses to
    // compare) means the value equals no stored key.
    let equal = |v: &Bound<'_, PyAny>| v.eq(k).unwrap_or(false);
    if let Ok(i) = py.get_type::<PyInt>().call1((k,)) {
        if equal(&i) {
            return key_depth(&i, depth, false);
        }
    }
    if let Ok(f) = py.get_type::<PyFloat>().call1((k,)) {
        if equal(&f) {
            return key_depth(&f, depth, false);
        }
    }
    Ok(None)
}

fn key_depth(k: &Bound<'_, PyAny>, depth: usize, probe: bool) -> PyResult<Option<Key<'static>>> {
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
            match key_depth(&it, depth + 1, probe)? {
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
                return key_depth(&item, depth, probe);
            }
        }
    }
    if probe {
        return number_probe(k, depth);
    }
    Ok(None)
}

/// A key (from a dict archive's key table) as a Python object.
pub(crate) fn to_python<'py>(py: Python<'py>, k: &Key<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match k {
        Key::None => py.None().into_bound(py),
        Key::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Key::Int(i) => i.into_bound_py_any(py)?,
        Key::BigInt(b) => bigint(py, b)?,
        Key::Float(f) => PyFloat::new(py, *f).into_any(),
        Key::Str(s) => PyString::new(py, s).into_any(),
        Key::Bytes(b) => PyBytes::new(py, b).into_any(),
        Key::Tuple(items) => PyTuple::new(
            py,
            items
                .iter()
                .map(|it| to_python(py, it))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
    })
}
