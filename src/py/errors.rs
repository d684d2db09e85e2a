//! The one exception hierarchy, and the one place where Rust errors become Python ones.
//!
//! Every class derives from `ShmStoreError` and from the builtin a caller would already
//! catch (`except FileNotFoundError:` keeps working for a missing store, and so on).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::archive::ArchiveError;
use crate::segment::SegmentError;

/// (name, builtin base, docstring) of each exception class, in creation order.
const CLASSES: &[(&str, &str, &str)] = &[
    (
        "ShmStoreError",
        "Exception",
        "Base class of every error shmstore raises.",
    ),
    (
        "StoreNotFoundError",
        "FileNotFoundError",
        "No store has that name (unlinked, never created, or its creator is gone).",
    ),
    (
        "StoreExistsError",
        "FileExistsError",
        "A store with that name already exists.",
    ),
    (
        "StorePermissionError",
        "PermissionError",
        "The store belongs to another user.",
    ),
    (
        "CorruptStoreError",
        "ValueError",
        "The bytes of a store are not a valid, complete archive.",
    ),
    (
        "UnsupportedTypeError",
        "TypeError",
        "A value of a type shmstore cannot store; the message gives its path.",
    ),
    (
        "InvalidInputError",
        "ValueError",
        "Input that cannot be stored as given (duplicate key, bad name, too large a record).",
    ),
    (
        "StoreClosedError",
        "ValueError",
        "The handle was closed; attach again to keep reading.",
    ),
    (
        "OutOfSharedMemoryError",
        "MemoryError",
        "Not enough room in /dev/shm (or SHMSTORE_DIR) for the store.",
    ),
    (
        "StoreIOError",
        "OSError",
        "An operating-system error while creating, mapping or removing a store.",
    ),
];

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn types(py: Python<'_>) -> &Vec<Py<PyType>> {
    TYPES.get_or_init(py, || {
        let builtins = py.import("builtins").expect("builtins");
        let type_ = builtins.getattr("type").expect("type");
        let mut out: Vec<Py<PyType>> = Vec::new();
        for (i, (name, builtin, doc)) in CLASSES.iter().enumerate() {
            let builtin = builtins.getattr(*builtin).expect("builtin exception");
            let bases = if i == 0 {
                PyTuple::new(py, [builtin]).expect("tuple")
            } else {
                PyTuple::new(py, [out[0].bind(py).clone().into_any(), builtin]).expect("tuple")
            };
            let ns = PyDict::new(py);
            ns.set_item("__module__", "shmstore").expect("ns");
            ns.set_item("__doc__", *doc).expect("ns");
            let cls = type_
                .call1((*name, bases, ns))
                .expect("exception class")
                .cast_into::<PyType>()
                .expect("a type");
            out.push(cls.unbind());
        }
        out
    })
}

/// Exception classes by index in [`CLASSES`].
#[derive(Clone, Copy)]
pub enum Exc {
    Base = 0,
    NotFound = 1,
    Exists = 2,
    Permission = 3,
    Corrupt = 4,
    Unsupported = 5,
    Invalid = 6,
    Closed = 7,
    OutOfMemory = 8,
    Io = 9,
}

impl Exc {
    pub fn err(self, msg: impl Into<String>) -> PyErr {
        let msg: String = msg.into();
        Python::attach(|py| PyErr::from_type(types(py)[self as usize].bind(py).clone(), msg))
    }
}

impl Exc {
    /// An `OSError` subclass with `errno`, `strerror` (here the whole message, which names
    /// the step and the OS reason) and `filename` set, as `OSError(errno, strerror, filename)`.
    pub fn os_err(self, errno: i32, msg: String, filename: String) -> PyErr {
        Python::attach(|py| {
            PyErr::from_type(
                types(py)[self as usize].bind(py).clone(),
                (errno, msg, filename),
            )
        })
    }
}

/// Add the classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (ty, (name, _, _)) in types(m.py()).iter().zip(CLASSES) {
        m.add(*name, ty.bind(m.py()))?;
    }
    Ok(())
}

pub fn segment_err(e: SegmentError) -> PyErr {
    let msg = e.to_string();
    match e {
        SegmentError::NotFound { .. } => Exc::NotFound.err(msg),
        SegmentError::Exists { .. } => Exc::Exists.err(msg),
        SegmentError::WrongOwner { .. } => Exc::Permission.err(msg),
        SegmentError::NameTaken { .. } => Exc::Exists.err(msg),
        SegmentError::NotAFile { .. } => Exc::Io.err(msg),
        SegmentError::Full { .. } => Exc::OutOfMemory.err(msg),
        SegmentError::BadName { .. } => Exc::Invalid.err(msg),
        SegmentError::Empty { .. } => Exc::Corrupt.err(msg),
        SegmentError::Io { ref source, .. } => io_exc(source).err(msg),
    }
}

fn io_exc(e: &std::io::Error) -> Exc {
    match e.kind() {
        std::io::ErrorKind::NotFound => Exc::NotFound,
        std::io::ErrorKind::PermissionDenied => Exc::Permission,
        std::io::ErrorKind::StorageFull => Exc::OutOfMemory,
        _ => Exc::Io,
    }
}

/// `context`: which store, for messages ("store 'shmstore-…'").
pub fn archive_err(e: ArchiveError, context: &str) -> PyErr {
    match e {
        ArchiveError::Corrupt(m) => Exc::Corrupt.err(format!("{context}: corrupt: {m}")),
        ArchiveError::Unsealed => Exc::Corrupt.err(format!(
            "{context}: the store is still being written (or its writer died); attach after it is complete"
        )),
        ArchiveError::Version(_) => Exc::Corrupt.err(format!("{context}: {e}")),
        ArchiveError::Invalid(m) => Exc::Invalid.err(format!("{context}: {m}")),
        ArchiveError::DuplicateKey(first) => {
            Exc::Invalid.err(format!("{context}: duplicate key (first given for entry {first})"))
        }
        ArchiveError::Io(io) => {
            // The segment writer wraps "full" errors with their sizes and a hint.
            let exc = io_exc(&io);
            match io.into_inner() {
                Some(inner) => match inner.downcast::<SegmentError>() {
                    Ok(seg) => segment_err(*seg),
                    Err(other) => exc.err(format!("{context}: {other}")),
                },
                None => exc.err(format!("{context}: I/O error")),
            }
        }
    }
}
