//! Pure-Rust archive layer (no pyo3): the value model, the record encoder, the streaming
//! builder, the header and the checked reader. See docs/format.md for the byte layout.

pub mod ascii;
// `Builder::finish_raw_record` is the fuzzer's (records the encoder never writes): without
// the fuzzer (`fuzzing` off, as in wheels) it has no caller.
#[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
pub mod builder;
pub mod encode;
pub mod format;
#[doc(hidden)]
// Its drivers (`run`, `read_everything`, `CRAFTED`) have callers in tests only: outside
// `cargo test` builds they are not dead code to remove. Built for tests and with the
// `fuzzing` feature (the Python testing hooks), never into a wheel.
#[cfg(any(test, feature = "fuzzing"))]
#[cfg_attr(not(test), allow(dead_code))]
pub mod fuzz;
pub mod hash;
pub mod header;
pub mod key;
pub mod reader;
pub mod table;
pub mod value;

#[cfg(test)]
mod tests;

pub use builder::Builder;
pub use header::Kind;
pub use key::Key;
pub use reader::{Item, Node, Reader};
pub use value::{ArrayMeta, Value};

/// Everything that can go wrong building or reading an archive.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// The bytes are not a well-formed archive (truncated, corrupted, wrong checksum).
    #[error("{0}")]
    Corrupt(String),
    /// The archive is still being written; readers must not use it yet.
    #[error("the archive is still being written (not sealed yet)")]
    Unsealed,
    #[error(
        "archive format version {0} is not supported (this shmstore reads version {v}): \
         rebuild the store with this shmstore, or read it with the one that wrote it",
        v = header::VERSION
    )]
    Version(u16),
    /// The input cannot be archived (a record too large for its in-record offsets, ...).
    #[error("{0}")]
    Invalid(String),
    /// A dict key given twice; carries the entry number of the first occurrence.
    #[error("duplicate key (first given for entry {0})")]
    DuplicateKey(u32),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The hasher state of the maps an encoder keeps while it writes (dict keys, shapes, key
/// objects): one random state per process, copied into each (making a new one per encoder,
/// that is per small object put, was a hundred instructions a map).
pub(crate) fn map_hasher() -> ahash::RandomState {
    static STATE: std::sync::OnceLock<ahash::RandomState> = std::sync::OnceLock::new();
    STATE.get_or_init(ahash::RandomState::new).clone()
}

/// The little-endian u64 at `bytes[at..at + 8]` (panics out of bounds: callers check first).
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// The little-endian u32 at `bytes[at..at + 4]`.
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}
