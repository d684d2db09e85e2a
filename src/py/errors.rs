//! The one exception hierarchy, and the one place where errors become Python exceptions.
//!
//! Every class derives from `ShmStoreError` and from the builtin a caller would already
//! catch (`except FileNotFoundError:` keeps working for a missing store, and so on).
//!
//! The binding layer reports failures as an [`Error`] (or lets a Python exception it got
//! from user code pass through as [`Error::Python`]); `impl From<Error> for PyErr` below is
//! the only code that picks an exception class, with one exhaustive match per error type of
//! the layers underneath (`ArchiveError`, `SegmentError`, `std::io::Error`). Context (which
//! store, the path of the value being stored) is added as text around the typed error, so
//! it never changes the class. `make lint` checks that no other file builds an exception.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::archive::ArchiveError;
use crate::arena::ArenaError;
use crate::segment::{SaveError, SegmentError};

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

fn types(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    TYPES.get_or_try_init(py, || {
        let builtins = py.import("builtins")?;
        let type_ = builtins.getattr("type")?;
        let mut out: Vec<Py<PyType>> = Vec::new();
        for (i, (name, builtin, doc)) in CLASSES.iter().enumerate() {
            let builtin = builtins.getattr(*builtin)?;
            let bases = match out.first() {
                Some(base) if i > 0 => {
                    PyTuple::new(py, [base.bind(py).clone().into_any(), builtin])?
                }
                _ => PyTuple::new(py, [builtin])?,
            };
            let ns = PyDict::new(py);
            ns.set_item("__module__", "shmstore")?;
            ns.set_item("__doc__", *doc)?;
            let cls = type_.call1((*name, bases, ns))?.cast_into::<PyType>()?;
            out.push(cls.unbind());
        }
        Ok(out)
    })
}

/// Add the classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (ty, (name, _, _)) in types(m.py())?.iter().zip(CLASSES) {
        m.add(*name, ty.bind(m.py()))?;
    }
    Ok(())
}

/// Our exception classes, by index in [`CLASSES`]. Private: only this module picks one.
#[derive(Clone, Copy)]
enum Exc {
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

/// The builtin classes we raise as Python itself would (`lst[99]`, `d["missing"]`, ...).
enum Builtin {
    Index,
    Type,
    Value,
}

/// Which class.
enum Class {
    Ours(Exc),
    Builtin(Builtin),
}

/// What the exception is constructed with: a message, or `OSError`'s
/// `(errno, strerror, filename)` (then `errno`, `strerror` and `filename` are set).
enum Args {
    Msg(String),
    Os(i32, String, String),
}

/// Everything the binding layer can fail with, typed until it becomes a Python exception.
pub(crate) enum Error {
    /// From the archive layer; `at` says where: `store 'shmstore-…'`, or the path of the
    /// value being stored (`records[12]['mask']`).
    Archive {
        at: String,
        err: ArchiveError,
    },
    /// From the segment layer (names, files, capacity); its message names the file.
    Segment(SegmentError),
    /// Saving an archive to a file failed (which step, which path, the OS error).
    Save(SaveError),
    /// An operating-system error outside the segment layer (resolving a path, ...).
    Io {
        at: String,
        err: std::io::Error,
    },
    /// A value or key of a type shmstore cannot store; `at` is its path.
    Unsupported {
        at: String,
        what: String,
    },
    /// Input that cannot be stored as given (too deep, a cycle, a malformed pair, ...).
    Invalid {
        at: String,
        what: String,
    },
    /// A handle that was closed.
    Closed {
        name: String,
    },
    /// An arena or one of its chunks (`at`: which store).
    Arena {
        at: String,
        err: crate::arena::ArenaError,
    },
    /// A handle of one kind attached to a store of another.
    WrongKind {
        store: String,
        have: &'static str,
        class: &'static str,
        want: &'static str,
    },
    /// Bytes the reader accepted that still do not make sense here (a pickled view that
    /// points at a scalar, a symbol id out of range).
    Corrupt {
        at: String,
        what: String,
    },
    /// `seq[i]` with `i` out of range (`len` when known).
    IndexRange {
        what: &'static str,
        index: String,
        len: Option<usize>,
    },
    /// `seq[x]` with `x` neither an integer nor a slice.
    IndexType {
        what: &'static str,
        got: String,
    },
    /// `seq.index(x)` when `x` is absent.
    NotInSequence {
        what: &'static str,
    },
    /// `mapping[key]` when `key` is absent: a KeyError carrying the key object.
    MissingKey(Py<PyAny>),
    /// `hash(view)` of a stored list.
    Unhashable {
        what: &'static str,
    },
    /// A call that cannot work as given (an argument error of ours).
    Usage(String),
    /// `TypeError`: an argument of a type the call cannot take (not a buffer), or pickling
    /// something that has no name to pickle by (a store read from a buffer), as pickle
    /// raises for objects it cannot take.
    Type(String),
    /// Something needed that is not there: a module (numpy to read arrays), the supervisor
    /// (a channel).
    Missing(String),
    /// `SHMSTORE_REQUIRE_FAST_PATHS=1` and a fast path is off (src/py/read/fastpaths.rs):
    /// `ImportError`, raised by the module's init.
    FastPathsOff(String),
    /// A channel's put found no room (`queue.Full`) or its get nothing (`queue.Empty`)
    /// within its timeout: the standard library's classes, as `multiprocessing.Queue`
    /// raises them.
    QueueFull,
    QueueEmpty,
    /// A Python exception raised by user code (an iterator, `__eq__`, `__hash__`):
    /// passed through unchanged.
    Python(PyErr),
}

impl From<PyErr> for Error {
    fn from(e: PyErr) -> Self {
        Error::Python(e)
    }
}

impl From<SegmentError> for Error {
    fn from(e: SegmentError) -> Self {
        Error::Segment(e)
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let (class, msg) = match e {
            Error::Python(e) => return e,
            Error::MissingKey(key) => return pyo3::exceptions::PyKeyError::new_err(key),
            Error::FastPathsOff(msg) => return pyo3::exceptions::PyImportError::new_err(msg),
            Error::Save(err) => return save(err),
            Error::QueueFull => return queue_error("Full"),
            Error::QueueEmpty => return queue_error("Empty"),
            Error::Archive { at, err } => archive(&at, err),
            Error::Arena { at, err } => match err {
                ArenaError::Stale { .. } => (Class::Ours(Exc::Closed), format!("{at}: {err}")),
                ArenaError::Corrupt { .. } => (Class::Ours(Exc::Corrupt), format!("{at}: {err}")),
                ArenaError::Segment(err) => segment(err),
            },
            Error::Segment(err) => segment(err),
            Error::Io { at, err } => (Class::Ours(io_class(&err)), format!("{at}: {err}")),
            Error::Unsupported { at, what } => {
                (Class::Ours(Exc::Unsupported), format!("{at}: {what}"))
            }
            Error::Invalid { at, what } => (Class::Ours(Exc::Invalid), format!("{at}: {what}")),
            Error::Closed { name } => (
                Class::Ours(Exc::Closed),
                format!(
                    "store {name:?} is closed; attach again (e.g. SharedList.attach(name)) to \
                     keep reading"
                ),
            ),
            Error::WrongKind {
                store,
                have,
                class,
                want,
            } => (
                Class::Ours(Exc::Invalid),
                format!(
                    "{store} holds {} {have} (use {class}), not {} {want}",
                    article(have),
                    article(want)
                ),
            ),
            Error::Corrupt { at, what } => (Class::Ours(Exc::Corrupt), format!("{at}: {what}")),
            Error::IndexRange { what, index, len } => (
                Class::Builtin(Builtin::Index),
                match len {
                    Some(len) => format!("{what} index {index} out of range (len {len})"),
                    None => format!("{what} index {index} out of range"),
                },
            ),
            Error::IndexType { what, got } => (
                Class::Builtin(Builtin::Type),
                format!("{what} indices must be integers or slices, not {got}"),
            ),
            Error::NotInSequence { what } => (
                Class::Builtin(Builtin::Value),
                format!("value is not in {what}"),
            ),
            Error::Unhashable { what } => (
                Class::Builtin(Builtin::Type),
                format!("unhashable type: {what}"),
            ),
            Error::Usage(msg) => (Class::Builtin(Builtin::Value), msg),
            Error::Type(msg) => (Class::Builtin(Builtin::Type), msg),
            Error::Missing(msg) => (Class::Ours(Exc::Base), msg),
        };
        new(class, Args::Msg(msg))
    }
}

/// `queue.Full()` or `queue.Empty()` (no message, as the standard library raises them).
fn queue_error(which: &'static str) -> PyErr {
    static FULL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    static EMPTY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let cell = if which == "Full" { &FULL } else { &EMPTY };
    Python::attach(|py| match cell.import(py, "queue", which) {
        Ok(t) => PyErr::from_type(t.clone(), ()),
        Err(e) => e,
    })
}

fn new(class: Class, args: Args) -> PyErr {
    let msg = match args {
        Args::Msg(msg) => msg,
        Args::Os(errno, msg, filename) => {
            let Class::Ours(exc) = class else {
                return pyo3::exceptions::PyOSError::new_err((errno, msg, filename));
            };
            return Python::attach(|py| match types(py) {
                Ok(types) => {
                    PyErr::from_type(types[exc as usize].bind(py).clone(), (errno, msg, filename))
                }
                Err(e) => e,
            });
        }
    };
    match class {
        Class::Builtin(Builtin::Index) => pyo3::exceptions::PyIndexError::new_err(msg),
        Class::Builtin(Builtin::Type) => pyo3::exceptions::PyTypeError::new_err(msg),
        Class::Builtin(Builtin::Value) => pyo3::exceptions::PyValueError::new_err(msg),
        Class::Ours(exc) => Python::attach(|py| match types(py) {
            Ok(types) => PyErr::from_type(types[exc as usize].bind(py).clone(), msg),
            Err(e) => e,
        }),
    }
}

/// A failed save as the exception of its OS error, with `errno`, `strerror` (the whole
/// message, which names the step and the OS reason) and `filename` set: `except
/// PermissionError` / `FileNotFoundError` work; a full directory is OutOfSharedMemoryError
/// with the sizes.
fn save(e: SaveError) -> PyErr {
    let msg = e.to_string();
    let errno = e.source.raw_os_error();
    let filename = e.path.display().to_string();
    let exc = match e.source.kind() {
        std::io::ErrorKind::NotFound => Exc::NotFound,
        std::io::ErrorKind::PermissionDenied => Exc::Permission,
        std::io::ErrorKind::StorageFull => {
            let (class, msg) = match e.source.into_inner().map(|i| i.downcast::<SegmentError>()) {
                Some(Ok(seg)) => segment(*seg),
                _ => (Class::Ours(Exc::OutOfMemory), msg),
            };
            return new(class, Args::Msg(msg));
        }
        _ => Exc::Io,
    };
    match errno {
        Some(n) => new(Class::Ours(exc), Args::Os(n, msg, filename)),
        None => new(Class::Ours(exc), Args::Msg(msg)),
    }
}

fn segment(e: SegmentError) -> (Class, String) {
    let exc = match &e {
        SegmentError::NotFound { .. } => Exc::NotFound,
        SegmentError::Exists { .. } => Exc::Exists,
        SegmentError::WrongOwner { .. }
        | SegmentError::UnsafeDir { .. }
        | SegmentError::SwappableDir { .. } => Exc::Permission,
        SegmentError::NameTaken { .. } => Exc::Exists,
        SegmentError::NotAFile { .. } => Exc::Io,
        SegmentError::Full { .. } => Exc::OutOfMemory,
        SegmentError::BadName { .. } => Exc::Invalid,
        SegmentError::Empty { .. } => Exc::Corrupt,
        SegmentError::Io { source, .. } => io_class(source),
    };
    (Class::Ours(exc), e.to_string())
}

fn io_class(e: &std::io::Error) -> Exc {
    match e.kind() {
        std::io::ErrorKind::NotFound => Exc::NotFound,
        std::io::ErrorKind::PermissionDenied => Exc::Permission,
        std::io::ErrorKind::StorageFull => Exc::OutOfMemory,
        _ => Exc::Io,
    }
}

fn archive(at: &str, e: ArchiveError) -> (Class, String) {
    match e {
        ArchiveError::Corrupt(m) => (Class::Ours(Exc::Corrupt), format!("{at}: corrupt: {m}")),
        ArchiveError::Unsealed => (
            Class::Ours(Exc::Corrupt),
            format!(
                "{at}: the store is still being written (or its writer died); attach after it \
                 is complete"
            ),
        ),
        ArchiveError::Version(_) => (Class::Ours(Exc::Corrupt), format!("{at}: {e}")),
        ArchiveError::Invalid(m) => (Class::Ours(Exc::Invalid), format!("{at}: {m}")),
        ArchiveError::DuplicateKey(first) => (
            Class::Ours(Exc::Invalid),
            format!(
                "{at}: duplicate key (first given at position {first}); pass a dict to keep \
                 only the last value"
            ),
        ),
        ArchiveError::Io(io) => {
            // The segment writer wraps its errors (a full directory, with the sizes and a
            // hint) in io::Error: unwrap them so they keep their class and message.
            let class = io_class(&io);
            let msg = format!("{at}: {io}");
            match io
                .into_inner()
                .map(|inner| inner.downcast::<SegmentError>())
            {
                Some(Ok(seg)) => segment(*seg),
                _ => (Class::Ours(class), msg),
            }
        }
    }
}

/// `RecursionError` for a deep conversion that would overflow this thread's stack
/// (src/py/stack.rs): the same class Python raises for too deep a recursion.
pub(crate) fn stack_exhausted(msg: String) -> PyErr {
    pyo3::exceptions::PyRecursionError::new_err(msg)
}

/// "a" or "an" before a kind's name ("an object", "a list").
fn article(word: &str) -> &'static str {
    match word.as_bytes().first() {
        Some(b'a' | b'e' | b'i' | b'o' | b'u') => "an",
        _ => "a",
    }
}
