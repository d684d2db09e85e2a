//! An arena segment: one preallocated file per creating process, holding many small object
//! archives in chunks (docs/arena.md).
//!
//! File layout: a [`HEADER`]-byte header (magic, version, capacity, creator pid), then the
//! chunk region. A chunk is a [`CHUNK_HEADER`]-byte header (magic, generation, length of
//! the archive) followed by the archive bytes, 64-byte aligned.
//!
//! Leases are open-file-description (OFD) byte-range locks on the chunk's range of the file:
//! a process using a chunk holds a shared (read) lock on it, which the kernel drops when the
//! process dies, however it dies. The creator holds an exclusive (write) lock on all free
//! space, through its read-write descriptor: it takes one on a chunk it wants to reuse, which
//! it gets only when nobody holds a lease, and keeps it while the chunk is free; it writes a
//! chunk with a new generation and only then unlocks its range, so a handle made before
//! sees a generation that is not its own and never reads the new bytes. The creator's own
//! handles need no lock: it reuses only chunks whose last handle in its process is gone
//! (`ArenaFile::lease_own`).
//!
//! The file is sealed like every segment (mode 0400, the seal mark in its mtime), so the
//! supervisor and `shmstore gc` treat it as one: removed once no process maps or holds it.
//! The creator writes through a shared writable mapping of the read-write descriptor it
//! opened before sealing (a copy, no system call), into space reserved with `fallocate` at
//! creation, so a full /dev/shm fails at creation with a clear error and never later. Every
//! page of that mapping is faulted in writable at creation, before the seal mark is set:
//! tmpfs moves the modification time on a write *fault* (a page written for the first
//! time through a mapping), never on a write through a page already mapped writable, so
//! writing chunks leaves the mark alone (checked at most once a second, see
//! [`ArenaWriter::put`]).
//!
//! This file: the file layout's constants and the arena's error type.

use std::io;
use std::path::Path;

use crate::segment::SegmentError;

/// Bytes before the chunk region.
pub const HEADER: u64 = 4096;
/// Bytes before a chunk's archive.
pub const CHUNK_HEADER: u64 = 64;
/// The first bytes of an arena file.
pub const MAGIC: &[u8; 8] = b"SHMARENA";
pub(super) const VERSION: u32 = 1;
pub(super) const CHUNK_MAGIC: u32 = 0x4b4e_4843; // "CHNK"

/// Errors of the arena layer.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The handle's chunk was freed (and maybe reused) since the handle was made.
    #[error("the chunk at offset {offset} of arena {arena} was freed: its creator closed it and no process held it (generation {want}, now {have}); keep the creator's handle alive until every receiver has attached")]
    Stale {
        arena: String,
        offset: u64,
        want: u64,
        have: u64,
    },
    /// Bytes of the arena that make no sense (header, chunk header, ranges).
    #[error("arena {arena}: corrupt: {what}")]
    Corrupt { arena: String, what: String },
    #[error(transparent)]
    Segment(#[from] SegmentError),
}

pub(super) fn io_err(path: &Path, e: impl Into<io::Error>) -> ArenaError {
    ArenaError::Segment(SegmentError::io(path, e.into()))
}

pub(super) fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
