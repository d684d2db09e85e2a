//! Pure-Rust arena layer (no pyo3): many small objects in one preallocated shared-memory
//! segment per process (docs/arena.md).
//!
//! `alloc.rs`: where chunks go (best fit, coalescing, size bins); `segment.rs`: the arena
//! file, chunk headers with generations, and leases (OFD byte-range locks).

pub mod alloc;
pub mod segment;

pub use crate::process::pid;
pub use segment::{
    survey, ArenaError, ArenaFile, ArenaWriter, Chunk, Lease, PartState, Reservation, MAGIC,
};
