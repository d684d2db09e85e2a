//! A store read from a foreign buffer: any object with the buffer protocol (a `memoryview`,
//! a `pickle.PickleBuffer`, a numpy array, `bytes`, Ray's object-store buffers) holding a
//! whole archive. A source beside segments and files, with the same checks (the header and
//! metadata at open, each block on its first access, payloads by `verify()`); the exported
//! buffer, which keeps its object alive and its memory where it is, is held by the mapping,
//! so by every handle, view and array of the store (docs/api.md, "Stores from buffers").

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::buffer::PyUntypedBuffer;

use super::*;
use crate::archive::header::PAYLOAD_ALIGN;

/// Whether to read a buffer in place or from a private copy (`from_buffer(copy=...)`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum CopyPolicy {
    /// In place when the buffer allows it (read-only, 64-byte aligned); a read-only buffer
    /// that is not aligned is copied (logged); a writable one is refused.
    Auto,
    /// Always a private copy (any buffer, writable ones included: a snapshot).
    Always,
    /// Never a copy: a buffer that cannot be read in place is refused.
    Never,
}

/// Over this many bytes a copy is made with the GIL released.
const COPY_DETACHED: usize = 1 << 20;

/// "<buffer N of memoryview>": unique in this process, so that two buffers never share a
/// key of a per-store cache (digests are cached by source path).
fn label(type_name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed) + 1;
    PathBuf::from(format!("<buffer {n} of {type_name}>"))
}

/// Open the archive in `obj`'s buffer (see the module docs).
pub(crate) fn open_buffer(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    copy: CopyPolicy,
) -> PyResult<Arc<Store>> {
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let at = format!("from_buffer({type_name})");
    let buf = PyUntypedBuffer::get(obj).map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
            Error::Type(format!(
                "{at}: needs an object with the buffer protocol (bytes, memoryview, \
                 pickle.PickleBuffer, a numpy array), not {type_name}"
            ))
            .into()
        } else {
            e
        }
    })?;
    if !buf.is_c_contiguous() {
        return Err(Error::Usage(format!(
            "{at}: the buffer is not contiguous (strided or a slice with a step); \
             pass a contiguous one (e.g. bytes(buf))"
        ))
        .into());
    }
    let len = buf.len_bytes();
    let start = buf.buf_ptr() as *const u8;
    let aligned = (start as usize) % PAYLOAD_ALIGN as usize == 0;
    let label = label(&type_name);
    let in_place = match (copy, buf.readonly(), aligned) {
        (CopyPolicy::Always, _, _) => false,
        (_, true, true) => true,
        (_, false, _) => {
            return Err(Error::Usage(format!(
                "{at}: the buffer is writable, and a store read in place must not change \
                 under its readers; pass a read-only buffer (bytes, memoryview(...) of one, \
                 a numpy array with flags.writeable False), or copy=True to read a private \
                 snapshot of it"
            ))
            .into())
        }
        (CopyPolicy::Never, true, false) => {
            return Err(Error::Usage(format!(
                "{at}: the buffer starts at {start:p}, not on a {PAYLOAD_ALIGN}-byte \
                 boundary, so its arrays could not be read in place; pass copy=None (the \
                 default: a private copy) or an aligned buffer"
            ))
            .into())
        }
        (CopyPolicy::Auto, true, false) => {
            log::info!(
                "{at}: the buffer starts at {start:p}, not on a {PAYLOAD_ALIGN}-byte \
                 boundary: reading a private copy ({len} bytes of this process's memory)"
            );
            false
        }
    };
    let mapping = if in_place {
        // SAFETY: the buffer is read-only (checked above: its exporter promises that
        // nobody writes it through this or any other export), contiguous, `len` bytes
        // at `start`; the exported buffer is held by the mapping, which keeps the
        // exporting object alive and its memory in place (an exporter may not move or free
        // a buffer while an export of it is held) until the mapping is dropped.
        unsafe { Mapping::foreign(Box::new(buf), start, len, &label) }
    } else {
        let bytes: &[u8] = if len == 0 || start.is_null() {
            &[]
        } else {
            // SAFETY: `len` bytes at `start` are readable while `buf` is held (the export);
            // it is held until the end of this block. A writable buffer's bytes may change
            // while they are copied: the copy is checked afterwards like any archive.
            unsafe { std::slice::from_raw_parts(start, len) }
        };
        let mapping = if len > COPY_DETACHED {
            py.detach(|| Mapping::copy_of(bytes, &label))
        } else {
            Mapping::copy_of(bytes, &label)
        }
        .map_err(Error::from)?;
        drop(buf);
        mapping
    };
    let reader = py
        .detach(|| Reader::open(mapping))
        .map_err(|err| Error::Archive {
            at: format!("{at} ({len} bytes)"),
            err,
        })?;
    let store = Arc::new(Store {
        reader,
        source: Source::Buffer {
            label: label.clone(),
        },
        ident: (0, 0),
        py_symbols: PyOnceLock::new(),
        _lease: None,
        arena: None,
        registration: Registration::none(label),
    });
    log::debug!(
        "opened {} ({} bytes, {})",
        store.source.name(),
        store.nbytes(),
        if in_place { "in place" } else { "a copy" }
    );
    Ok(store)
}
