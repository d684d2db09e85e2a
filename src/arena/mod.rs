//! Pure-Rust arena layer (no pyo3): many small objects in one preallocated shared-memory
//! segment per process (docs/arena.md).
//!
//! `alloc.rs`: where chunks go (best fit, coalescing, size bins); `format.rs`: the arena
//! file's layout (header, chunk headers with generations) and `ArenaError`; `writer.rs`: the
//! creator's side (making the file, reserving, writing and reusing chunks); `file.rs`: every
//! user's side (the file opened once per process, its leases, `survey`); `lease.rs`: leases
//! (OFD byte-range locks) and `Lease`; `owned.rs`: this process's own arenas, the policy of
//! a small `put` (which arena a chunk goes to, growth, idle release, after a fork).

pub mod alloc;
mod file;
mod format;
mod lease;
pub mod owned;
mod writer;

#[cfg(test)]
mod tests;

pub use crate::process::pid;
pub use file::{survey, ArenaFile, PartState};
pub use format::{ArenaError, MAGIC};
pub use lease::Lease;
pub use writer::{Chunk, Reservation};

/// Sets and maps keyed by a chunk's offset, on every small `put` and every lease. Hashed
/// with ahash (keyed at random per map, as std's): std's SipHash took about a tenth of a
/// small object's `Channel` put and get (callgrind), for keys that are 8 bytes.
pub type Offsets = std::collections::HashSet<u64, ahash::RandomState>;
/// A map keyed by a chunk's offset (see [`Offsets`]).
pub type OffsetMap<V> = std::collections::HashMap<u64, V, ahash::RandomState>;
