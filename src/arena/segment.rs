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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::alloc::{Bfc, ALIGN};
use crate::archive::hash;
use crate::process::{self, pid, ForkHooks, ForkLock};
use crate::segment::{self, SegmentError};

/// Bytes before the chunk region.
pub const HEADER: u64 = 4096;
/// Bytes before a chunk's archive.
pub const CHUNK_HEADER: u64 = 64;
/// The first bytes of an arena file.
pub const MAGIC: &[u8; 8] = b"SHMARENA";
const VERSION: u32 = 1;
const CHUNK_MAGIC: u32 = 0x4b4e_4843; // "CHNK"

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

fn io_err(path: &Path, e: impl Into<io::Error>) -> ArenaError {
    ArenaError::Segment(SegmentError::io(path, e.into()))
}

fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

// --- OFD byte-range locks -------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Lock {
    Shared,
    Exclusive,
    Unlock,
}

/// Set an OFD lock on `[off, off + len)` of `fd` without waiting; `Ok(false)` when another
/// open file description holds a conflicting lock.
fn ofd_lock(fd: &impl AsFd, kind: Lock, off: u64, len: u64) -> io::Result<bool> {
    let (Ok(start), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "range too large",
        ));
    };
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value of it.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match kind {
        Lock::Shared => libc::F_RDLCK,
        Lock::Exclusive => libc::F_WRLCK,
        Lock::Unlock => libc::F_UNLCK,
    } as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: the descriptor is open for the duration of the call (borrowed), `fl` is a valid
    // `flock` that outlives it, and F_OFD_SETLK only reads and writes that struct. l_pid
    // must be 0 for OFD locks (it is).
    let r = unsafe { libc::fcntl(fd.as_fd().as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

// --- the creator's side -----------------------------------------------------------------------

/// Where a chunk is and which generation of it: what a handle carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// File offset of the chunk (its header).
    pub offset: u64,
    /// Bytes of the chunk, header included.
    pub size: u64,
    pub generation: u64,
}

/// The creating process's arena: the read-write descriptor, the allocator and the chunks
/// waiting to be reused.
pub struct ArenaWriter {
    file: File,
    /// The whole file mapped shared and writable (through `file`), every page faulted in at
    /// creation: chunks are copied in here. Only free chunks (locked by `file`) are written.
    /// Shared with the [`Reservation`]s made from it (written without this writer at hand).
    map: Arc<memmap2::MmapRaw>,
    /// When the seal mark was last checked (see [`ArenaWriter::put`]).
    mark_checked: Instant,
    path: PathBuf,
    bfc: Bfc,
    next_generation: u64,
    /// Chunks written but not yet leased by the handle being made for them: never
    /// reclaimed, whatever releases of their offset arrive (a stale handle's, say).
    fresh: HashSet<u64>,
    /// Chunks this process let go of that another process still held (a lease) when last
    /// tried, in offset order, and where the next retry starts: retried a few at a time
    /// ([`ArenaWriter::reclaim_some`]), so that a process holding thousands of this
    /// process's objects does not cost every `put` a lock attempt on each of them.
    refused: BTreeSet<u64>,
    retry_at: u64,
    /// The process that made it: a forked child must make its own.
    pid: u32,
}

impl ArenaWriter {
    /// Create `dir/name` with room for `capacity` bytes of chunks: written as
    /// `<name>.part-<random>`, reserved (`fallocate`), sealed and linked under its name.
    pub fn create(dir: &Path, name: &str, capacity: u64) -> Result<Self, ArenaError> {
        let capacity = capacity & !(ALIGN - 1);
        let total = Self::preflight(dir, capacity)?;
        let suffix = &segment::random_name()[segment::PREFIX.len()..][..12];
        let tmp = dir.join(format!("{name}.part-{suffix}"));
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(
                (rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW).bits() as i32,
            )
            .open(&tmp)
            .map_err(|e| io_err(&tmp, e))?;
        let res = (|| {
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, total).map_err(
                |e| {
                    if e == rustix::io::Errno::NOSPC {
                        // Say how much and what to do, as for any segment.
                        match segment::preflight(dir, u64::MAX / 2) {
                            Err(full) => ArenaError::Segment(full),
                            Ok(()) => io_err(&tmp, e),
                        }
                    } else {
                        io_err(&tmp, e)
                    }
                },
            )?;
            let mut head = [0u8; 32];
            head[..8].copy_from_slice(MAGIC);
            head[8..12].copy_from_slice(&VERSION.to_le_bytes());
            head[16..24].copy_from_slice(&capacity.to_le_bytes());
            head[24..28].copy_from_slice(&pid().to_le_bytes());
            file.write_all_at(&head, 0).map_err(|e| io_err(&tmp, e))?;
            file.set_permissions(std::fs::Permissions::from_mode(0o400))
                .map_err(|e| io_err(&tmp, e))?;
            let map = map_for_writing(&file, total).map_err(|e| io_err(&tmp, e))?;
            // After the pages are in: their write faults moved the modification time.
            segment::mark_sealed(&file).map_err(|e| io_err(&tmp, e))?;
            // All of the chunk region is free: locked by the creator until it is written.
            if !ofd_lock(&file, Lock::Exclusive, HEADER, capacity).map_err(|e| io_err(&tmp, e))? {
                return Err(io_err(&tmp, io::Error::from(io::ErrorKind::WouldBlock)));
            }
            std::fs::hard_link(&tmp, &path).map_err(|e| io_err(&path, e))?;
            Ok::<_, ArenaError>(map)
        })();
        let _ = std::fs::remove_file(&tmp);
        let map = res?;
        Ok(ArenaWriter {
            file,
            map: Arc::new(map),
            mark_checked: Instant::now(),
            path,
            bfc: Bfc::new(capacity),
            next_generation: 1,
            fresh: HashSet::new(),
            refused: BTreeSet::new(),
            retry_at: 0,
            pid: pid(),
        })
    }

    /// Whether `dir` has room for an arena of `capacity` bytes of chunks (the check
    /// `create` makes first); the arena file's size.
    pub fn preflight(dir: &Path, capacity: u64) -> Result<u64, ArenaError> {
        let total = HEADER
            .checked_add(capacity & !(ALIGN - 1))
            .ok_or_else(|| io_err(dir, io::Error::from(io::ErrorKind::InvalidInput)))?;
        segment::preflight(dir, total)?;
        Ok(total)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this process made the arena (false in a forked child).
    pub fn is_ours(&self) -> bool {
        self.pid == pid()
    }

    /// Reuse every chunk this process let go of that no process holds a lease on: the ones
    /// of `pending` (released since the last call) and every one found leased before. A
    /// chunk still leased is kept for later (the writer's `refused`); `pending` keeps only chunks
    /// that may not be tried yet (written, not yet held by their handle).
    pub fn reclaim(&mut self, pending: &mut HashSet<u64>) -> Result<(), ArenaError> {
        self.reclaim_some(pending, usize::MAX)
    }

    /// As [`Self::reclaim`], but of the chunks found leased before only up to `retries`
    /// are tried again, round robin in offset order: the cost of a call is bounded by what
    /// was released since the last one, plus `retries` lock attempts, whatever other
    /// processes hold.
    pub fn reclaim_some(
        &mut self,
        pending: &mut HashSet<u64>,
        retries: usize,
    ) -> Result<(), ArenaError> {
        let mut freed = Vec::new();
        // In offset order: each lock taken then merges with its locked neighbour, so the
        // kernel's lock list (walked by every fcntl on the file) stays short. In hash order,
        // thousands of reclaimed chunks left as many separate locks for a while.
        let mut candidates: Vec<(u64, u64)> = Vec::with_capacity(pending.len());
        let mut tried: Vec<u64> = pending
            .iter()
            .copied()
            .filter(|off| !self.fresh.contains(off))
            .collect();
        let retry: Vec<u64> = self
            .refused
            .range(self.retry_at..)
            .chain(self.refused.range(..self.retry_at))
            .take(retries)
            .copied()
            .collect();
        if let Some(&last) = retry.last() {
            self.retry_at = last.saturating_add(1);
        }
        tried.extend(retry);
        for off in tried {
            pending.remove(&off);
            match self.bfc.size_at(off - HEADER) {
                Some(size) => candidates.push((off, size)),
                None => freed.push(off),
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        // Runs of adjacent chunks: one lock over a whole run, granted only if no process
        // holds a lease on any byte of it (the kernel checks the range at once); a run
        // refused is tried chunk by chunk. Chunks freed together (a batch of results let go
        // of) are mostly adjacent, so this is one system call instead of one per chunk.
        let mut i = 0;
        while i < candidates.len() {
            let (start, mut end) = (candidates[i].0, candidates[i].0 + candidates[i].1);
            let mut j = i + 1;
            while j < candidates.len() && candidates[j].0 == end {
                end += candidates[j].1;
                j += 1;
            }
            let lock = |off, len| {
                ofd_lock(&self.file, Lock::Exclusive, off, len).map_err(|e| io_err(&self.path, e))
            };
            let whole = j - i > 1 && lock(start, end - start)?;
            for &(off, size) in &candidates[i..j] {
                if whole || lock(off, size)? {
                    // Nobody holds it: free, and locked (like all free space) until
                    // rewritten.
                    self.bfc.free(off - HEADER);
                    freed.push(off);
                } else {
                    self.refused.insert(off);
                }
            }
            i = j;
        }
        for off in freed {
            self.refused.remove(&off);
        }
        Ok(())
    }

    /// Whether the chunk at `offset` was let go of by this process and found leased by
    /// another at its last try (it is tried again by later reclaims).
    #[cfg(test)]
    pub fn is_refused(&self, offset: u64) -> bool {
        self.refused.contains(&offset)
    }

    /// How many chunks were found leased by other processes at their last try.
    pub fn refused_count(&self) -> usize {
        self.refused.len()
    }

    /// Write `archive` into a new chunk; `None` when the arena has no room for it.
    #[cfg(test)]
    pub fn put(&mut self, archive: &[u8]) -> Result<Option<Chunk>, ArenaError> {
        let Some(mut r) = self.reserve(archive.len() as u64)? else {
            return Ok(None);
        };
        if let Err(e) = r.write_at(0, archive) {
            self.cancel(&r);
            return Err(io_err(&self.path, e));
        }
        self.commit(&r, archive.len() as u64).map(Some)
    }

    /// A new chunk with room for an archive of up to `max_len` bytes, to be written in place
    /// ([`Reservation`], [`ChunkSink`]) and then given out with [`Self::commit`] (or back
    /// with [`Self::cancel`]); `None` when the arena has no room. Allocating takes no system
    /// call: free space is locked by this writer's descriptor already (see the module docs),
    /// so no reader holds a lease on any of it, and none can take one until `commit`
    /// unlocks the chunk. Until then the chunk is never reclaimed (it is `fresh`), so the
    /// reservation may be written without this writer, while no lock of this process is
    /// held (encoding an object runs Python code).
    pub fn reserve(&mut self, max_len: u64) -> Result<Option<Reservation>, ArenaError> {
        let need = CHUNK_HEADER
            .checked_add(max_len)
            .ok_or_else(|| io_err(&self.path, io::Error::from(io::ErrorKind::InvalidInput)))?;
        let Some((rel, size)) = self.bfc.alloc(need) else {
            return Ok(None);
        };
        let offset = HEADER + rel;
        // The allocator never hands out space past its capacity (the mapping's length less
        // the header); checked anyway, as a bug here would write outside the mapping.
        if offset
            .checked_add(size)
            .is_none_or(|e| e > self.map.len() as u64)
        {
            self.bfc.free(rel);
            return Err(io_err(
                &self.path,
                io::Error::other(format!(
                    "chunk ({offset}, {size}) outside the arena mapping"
                )),
            ));
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.fresh.insert(offset);
        Ok(Some(Reservation {
            map: self.map.clone(),
            offset,
            size,
            generation,
            over: false,
        }))
    }

    /// Give out the chunk of `r`, an archive of `len` bytes written into it: the chunk
    /// shrinks to what the archive needs (the rest is free space again, still locked), gets
    /// its header (the generation), and is unlocked: leases may be taken from now on (the
    /// unlock is a system call, which orders the writes before any lease another process
    /// takes after it). On an error the chunk is free again.
    pub fn commit(&mut self, r: &Reservation, len: u64) -> Result<Chunk, ArenaError> {
        let fail = |w: &mut Self, e: io::Error| {
            w.cancel(r);
            Err(io_err(&w.path, e))
        };
        if !Arc::ptr_eq(&r.map, &self.map) {
            return Err(io_err(
                &self.path,
                io::Error::other("a reservation of another arena"),
            ));
        }
        let rel = r.offset - HEADER;
        let size = match CHUNK_HEADER
            .checked_add(len)
            .filter(|&n| n <= r.size)
            .and_then(|n| self.bfc.shrink(rel, n))
        {
            Some(size) => size,
            None => {
                return fail(
                    self,
                    io::Error::other(format!("{len} bytes do not fit a chunk of {}", r.size)),
                )
            }
        };
        let mut head = [0u8; CHUNK_HEADER as usize];
        head[..4].copy_from_slice(&CHUNK_MAGIC.to_le_bytes());
        head[8..16].copy_from_slice(&r.generation.to_le_bytes());
        head[16..24].copy_from_slice(&len.to_le_bytes());
        // SAFETY: the header's 64 bytes lie inside the chunk (`size >= CHUNK_HEADER`).
        unsafe { r.write_raw(0, &head) };
        // The tail given back by `shrink` stays locked, like all free space.
        if let Err(e) = ofd_lock(&self.file, Lock::Unlock, r.offset, size) {
            // Still locked (an unlock that failed left it so): free space again.
            return fail(self, e);
        }
        self.keep_seal_mark();
        Ok(Chunk {
            offset: r.offset,
            size,
            generation: r.generation,
        })
    }

    /// Give the chunk of `r` back (nothing was given out from it): free space again.
    pub fn cancel(&mut self, r: &Reservation) {
        if Arc::ptr_eq(&r.map, &self.map) && self.fresh.remove(&r.offset) {
            self.bfc.free(r.offset - HEADER);
        }
    }

    /// Put the seal mark back if the modification time moved (a page of the mapping was
    /// faulted in again for a write, e.g. after the kernel swapped it out): checked at most
    /// once a second (one `fstat`). Sweeps recognise an arena by its header meanwhile
    /// (`supervisor::sweep::is_segment`), so a mark missing for a second loses nothing.
    fn keep_seal_mark(&mut self) {
        if self.mark_checked.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.mark_checked = Instant::now();
        let moved = rustix::fs::fstat(&self.file)
            .is_ok_and(|st| st.st_mtime_nsec as i64 != i64::from(segment::SEALED_MTIME_NSEC));
        if moved {
            // A failure leaves the arena to be recognised by its header (see above).
            let _ = segment::mark_sealed(&self.file);
        }
    }

    /// The handle for the chunk at `offset` holds its lease now (or was never made): from
    /// here on the chunk is free once its leases are gone.
    pub fn settled(&mut self, offset: u64) {
        self.fresh.remove(&offset);
    }

    /// Bytes in used chunks, and the arena's capacity.
    pub fn usage(&self) -> (u64, u64) {
        (self.bfc.used(), self.bfc.capacity())
    }
}

/// `file` (`len` bytes) mapped shared and writable, every page faulted in for writing
/// (`MADV_POPULATE_WRITE`; on a kernel without it, by reading a byte of each page, which
/// maps a page of a shared writable tmpfs mapping writable). Afterwards writes through the
/// mapping take no fault, and so do not move the file's modification time (the seal mark).
fn map_for_writing(file: &File, len: u64) -> io::Result<memmap2::MmapRaw> {
    let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let map = memmap2::MmapOptions::new().len(len).map_raw(file)?;
    if map.advise(memmap2::Advice::PopulateWrite).is_err() {
        let page = rustix::param::page_size();
        for at in (0..len).step_by(page) {
            // SAFETY: `at < len`, inside the mapping; a volatile read of one byte through a
            // raw pointer makes no reference to shared memory (nobody else writes this new,
            // unlinked file yet anyway).
            unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) };
        }
    }
    Ok(map)
}

/// A chunk of an arena reserved for an archive written in place ([`ArenaWriter::reserve`]):
/// free space of its writer's, allocated and still locked by the writer's descriptor, so
/// nobody else reads or writes it until [`ArenaWriter::commit`] gives it out (or
/// [`ArenaWriter::cancel`] frees it). Holds the writer's mapping: it stays valid even if the
/// writer goes meanwhile (the commit then fails, the chunk was never given out).
pub struct Reservation {
    map: Arc<memmap2::MmapRaw>,
    offset: u64,
    size: u64,
    generation: u64,
    /// A write past the room was refused.
    over: bool,
}

impl Reservation {
    /// Bytes an archive may have in this chunk.
    pub fn room(&self) -> u64 {
        self.size - CHUNK_HEADER
    }

    /// The writer's mapping of the whole arena (for the creator's handle of the chunk once
    /// committed: `Mapping::written_window`).
    pub fn map(&self) -> &Arc<memmap2::MmapRaw> {
        &self.map
    }

    /// Whether a write past [`Self::room`] was refused (the archive did not fit).
    pub fn overflowed(&self) -> bool {
        self.over
    }

    /// Copy `bytes` to the archive's position `at` (after the chunk header); an error
    /// past [`Self::room`].
    pub fn write_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<()> {
        let at = self.inside(at, bytes.len())?;
        // SAFETY: `at + bytes.len() <= size` (`inside`).
        unsafe { self.write_raw(at, bytes) };
        Ok(())
    }

    /// [`Self::write_at`], returning the checksum of `bytes` (`hash::xxh3_64`): a large
    /// payload is hashed as it is copied, reading the source once.
    pub fn write_hashed_at(&mut self, at: u64, bytes: &[u8]) -> io::Result<u64> {
        if bytes.len() < STREAM_COPY {
            self.write_at(at, bytes)?;
            return Ok(hash::xxh3_64(bytes));
        }
        let at = self.inside(at, bytes.len())?;
        // SAFETY: `at + bytes.len() <= size` (`inside`), so `ptr(at)` is writable for the
        // bytes (see `ptr`), and they are not part of the mapping.
        Ok(unsafe { hash::copy_hashed(bytes, self.ptr(at)) })
    }

    /// The chunk offset of the archive's position `at` if `len` bytes from there fit the
    /// chunk; else an error, and the reservation is marked over.
    fn inside(&mut self, at: u64, len: usize) -> io::Result<u64> {
        match at.checked_add(len as u64) {
            Some(end) if end <= self.room() => Ok(CHUNK_HEADER + at),
            _ => {
                self.over = true;
                Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "larger than the chunk reserved for it",
                ))
            }
        }
    }

    /// Where offset `at` of the chunk is in the writer's mapping. Writing `n` bytes there
    /// with `at + n <= size` is sound: the chunk `[offset, offset + size)` lies inside the
    /// mapping (checked by `reserve`), which `self.map` keeps alive. The chunk is free
    /// space: locked exclusively through the writer's descriptor since it was freed (or
    /// since creation), so no other process holds a lease on it and none reads it (a lease
    /// is taken before any read, and refused here); in this process it is allocated to this
    /// reservation alone and never reclaimed before it is given out (`fresh`), and no
    /// reference to its bytes exists (the creator's own handles read only their chunks,
    /// through another mapping). Only raw copies of bytes that are never part of the
    /// mapping (from the encoder or the caller's memory) go there.
    fn ptr(&self, at: u64) -> *mut u8 {
        self.map
            .as_mut_ptr()
            .wrapping_add((self.offset + at) as usize)
    }

    /// Copy `bytes` to offset `at` of the chunk.
    ///
    /// # Safety
    /// `at + bytes.len() <= self.size`.
    unsafe fn write_raw(&self, at: u64, bytes: &[u8]) {
        // SAFETY: `ptr(at)` is writable for `bytes.len()` bytes (the caller's promise, see
        // `ptr`), and `bytes` does not overlap it.
        unsafe {
            let dst = self.ptr(at);
            if bytes.len() >= STREAM_COPY {
                hash::stream_copy(bytes.as_ptr(), dst, bytes.len());
            } else {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
            }
        }
    }

    /// A `Write + Seek` sink over the archive's bytes of the chunk (for the archive builder).
    pub fn sink(&mut self) -> ChunkSink<'_> {
        ChunkSink { r: self, pos: 0 }
    }
}

/// Writes of at least this many bytes into a chunk (an array's payload, say) bypass the
/// creator's caches (non-temporal stores): the bytes are for other processes, and filling the
/// cache with them first costs a read of every line written (measured: a 64 KiB object put
/// in one process and attached in another 15.7-16.7 -> 14.0-14.5 µs; with a reader that
/// sums the whole array, 35 µs both ways; docs/arena.md, "Costs per object").
const STREAM_COPY: usize = 16 << 10;

/// Writes an archive straight into a [`Reservation`]: writing past its room is an error
/// (`ErrorKind::WriteZero`), nothing is written there.
pub struct ChunkSink<'a> {
    r: &'a mut Reservation,
    pos: u64,
}

impl io::Write for ChunkSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.r.write_at(self.pos, buf)?;
        self.pos += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl crate::archive::builder::Sink for ChunkSink<'_> {
    fn write_hashed(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let sum = self.r.write_hashed_at(self.pos, bytes)?;
        self.pos += bytes.len() as u64;
        Ok(sum)
    }
}

impl io::Seek for ChunkSink<'_> {
    fn seek(&mut self, pos: io::SeekFrom) -> io::Result<u64> {
        let to = match pos {
            io::SeekFrom::Start(n) => Some(n),
            io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            io::SeekFrom::End(d) => self.r.room().checked_add_signed(d),
        };
        self.pos = to.ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        Ok(self.pos)
    }
}

// --- every user's side ------------------------------------------------------------------------

/// An arena file opened read-only by a process that uses chunks of it, with this process's
/// lease counts (one OFD lock per leased chunk, however many handles share it).
pub struct ArenaFile {
    file: File,
    /// The whole file mapped read-only, once per process: every chunk read here is a window
    /// of it (`Mapping::window`). Only leased windows are ever read through it.
    map: Arc<memmap2::Mmap>,
    path: PathBuf,
    ident: (u64, u64),
    len: u64,
    pid: u32,
    /// offset -> (size, handles here, whether this process holds an OFD lock on it).
    leases: Mutex<HashMap<u64, (u64, usize, bool)>>,
    /// In the creator only: chunks whose last lease in this process ended (reuse
    /// candidates). Other processes record nothing.
    released: Mutex<Option<HashSet<u64>>>,
}

type OpenFiles = HashMap<PathBuf, Weak<ArenaFile>>;

/// The arenas opened in this process, with their fork hooks registered: the first lock
/// of `crate::process`'s order ([`ForkLock::ArenaFiles`]), so a child never inherits it
/// locked by a thread that does not exist in it.
fn open_files() -> &'static Mutex<OpenFiles> {
    // The hooks only lock and unlock this mutex (held for short stretches by threads that
    // never wait for a lock ordered before it), never touch Python and never unwind.
    process::on_fork(
        ForkLock::ArenaFiles,
        ForkHooks {
            before: || {
                let guard = files().lock().unwrap_or_else(|p| p.into_inner());
                HELD_FILES.with(|h| *h.borrow_mut() = Some(guard));
            },
            after_parent: release_open_files,
            after_child: release_open_files,
        },
    );
    files()
}

fn files() -> &'static Mutex<OpenFiles> {
    static FILES: OnceLock<Mutex<OpenFiles>> = OnceLock::new();
    FILES.get_or_init(Default::default)
}

thread_local! {
    /// [`open_files`], held by the forking thread from before the fork to after it.
    static HELD_FILES: std::cell::RefCell<Option<std::sync::MutexGuard<'static, OpenFiles>>> =
        const { std::cell::RefCell::new(None) };
}

fn release_open_files() {
    HELD_FILES.with(|h| drop(h.borrow_mut().take()));
}

impl ArenaFile {
    /// The arena at `path`, opened once per process (and again in a forked child, whose
    /// locks must be its own).
    pub fn open(path: &Path) -> Result<Arc<ArenaFile>, ArenaError> {
        let mut files = open_files().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(path).and_then(Weak::upgrade) {
            let same = std::fs::symlink_metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == f.ident);
            if f.pid == pid() && same {
                return Ok(f);
            }
        }
        files.retain(|_, w| w.strong_count() > 0);
        let name = name_of(path);
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(
                (rustix::fs::OFlags::CLOEXEC
                    | rustix::fs::OFlags::NOFOLLOW
                    | rustix::fs::OFlags::NONBLOCK)
                    .bits() as i32,
            )
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => ArenaError::Segment(SegmentError::NotFound {
                    name: name.clone(),
                    path: path.to_owned(),
                }),
                _ => io_err(path, e),
            })?;
        let meta = file.metadata().map_err(|e| io_err(path, e))?;
        let me = rustix::process::geteuid().as_raw();
        if meta.uid() != me {
            return Err(SegmentError::WrongOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                me,
            }
            .into());
        }
        // Ours, a regular file, writable by nobody (the creator writes through the
        // descriptor it opened before sealing).
        if !meta.is_file() || meta.mode() & 0o7777 != 0o400 {
            return Err(ArenaError::Corrupt {
                arena: name,
                what: format!("not a sealed arena file (mode {:o})", meta.mode() & 0o7777),
            });
        }
        let mut head = [0u8; 32];
        file.read_exact_at(&mut head, 0)
            .map_err(|_| ArenaError::Corrupt {
                arena: name.clone(),
                what: "shorter than its header".into(),
            })?;
        let capacity = u64::from_le_bytes(head[16..24].try_into().unwrap_or_default());
        if &head[..8] != MAGIC
            || u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) != VERSION
            || HEADER.checked_add(capacity) != Some(meta.len())
        {
            return Err(ArenaError::Corrupt {
                arena: name,
                what: "bad header (magic, version or size)".into(),
            });
        }
        // SAFETY: memmap2 requires that the mapped bytes do not change while mapped. Here
        // they do, outside the chunks leased in this process: the creator rewrites chunks
        // nobody leases. So no reference to these bytes is ever made except to a window of
        // a chunk this process holds a lease on (whose bytes the creator never writes while
        // the lease lasts, and nobody else can write: the file is ours and mode 0400, checked
        // above): `ArenaFile::lease` reads a chunk's header by copy after taking its lease,
        // `Mapping::window` makes a slice of the leased archive only. PROT_READ; the length
        // is the file's, which never changes (reserved with fallocate at creation, sealed).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .len(meta.len() as usize)
                .map(&file)
        }
        .map_err(|e| io_err(path, e))?;
        let f = Arc::new(ArenaFile {
            file,
            map: Arc::new(map),
            path: path.to_owned(),
            ident: (meta.dev(), meta.ino()),
            len: meta.len(),
            pid: pid(),
            leases: Mutex::new(HashMap::new()),
            released: Mutex::new(None),
        });
        files.insert(path.to_owned(), Arc::downgrade(&f));
        Ok(f)
    }

    #[cfg(test)]
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The arena mapped in this process (read only leased windows of it).
    pub fn map(&self) -> &Arc<memmap2::Mmap> {
        &self.map
    }

    /// (device, inode) of the file.
    pub fn ident(&self) -> (u64, u64) {
        self.ident
    }

    /// The process that opened it (a forked child opens its own).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// This process made the arena: record chunks whose last lease here ends, for reuse.
    pub fn mark_owned(&self) {
        let mut r = self.released.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(HashSet::new);
    }

    /// The chunks released here since the last call (the creator's reuse candidates).
    pub fn take_released(&self) -> HashSet<u64> {
        let mut r = self.released.lock().unwrap_or_else(|p| p.into_inner());
        r.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Take a lease on `chunk` and check its generation. Returns the lease and the
    /// archive's (offset, length) in the file.
    pub fn lease(self: &Arc<Self>, chunk: Chunk) -> Result<(Lease, u64, u64), ArenaError> {
        // The arena's name is made only for an error (not on every lease).
        let arena = || name_of(&self.path);
        let corrupt = |what: String| ArenaError::Corrupt {
            arena: arena(),
            what,
        };
        let end = chunk.offset.checked_add(chunk.size);
        if chunk.offset < HEADER
            || chunk.offset % ALIGN != 0
            || chunk.size < CHUNK_HEADER
            || end.is_none_or(|e| e > self.len)
        {
            return Err(corrupt(format!(
                "chunk ({}, {}) outside the arena ({} bytes)",
                chunk.offset, chunk.size, self.len
            )));
        }
        let stale = |have| ArenaError::Stale {
            arena: arena(),
            offset: chunk.offset,
            want: chunk.generation,
            have,
        };
        {
            let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            match leases.get_mut(&chunk.offset) {
                Some((size, n, _)) if *size == chunk.size => *n += 1,
                Some(_) => return Err(stale(0)),
                None => {
                    // Refused: the chunk is free (or being rewritten) in the creator.
                    if !ofd_lock(&self.file, Lock::Shared, chunk.offset, chunk.size)
                        .map_err(|e| io_err(&self.path, e))?
                    {
                        return Err(stale(0));
                    }
                    leases.insert(chunk.offset, (chunk.size, 1, true));
                }
            }
        }
        let lease = Lease {
            arena: self.clone(),
            offset: chunk.offset,
        };
        let mut head = [0u8; 24];
        // The chunk's header, copied out of the mapping: leased now, so the creator does not
        // write it (it writes a chunk only under an exclusive lock of its range).
        // `chunk.offset + 24 <= chunk.offset + chunk.size <= len` (checked above).
        // SAFETY: the 24 bytes at `chunk.offset` lie inside the mapping (its length is `len`)
        // and do not change while the lease is held; a copy makes no reference to them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(chunk.offset as usize),
                head.as_mut_ptr(),
                head.len(),
            )
        };
        let magic = u32::from_le_bytes(head[..4].try_into().unwrap_or_default());
        let generation = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(head[16..24].try_into().unwrap_or_default());
        if magic != CHUNK_MAGIC {
            return Err(corrupt(format!("no chunk at offset {}", chunk.offset)));
        }
        if generation != chunk.generation {
            return Err(stale(generation));
        }
        if CHUNK_HEADER.checked_add(len).is_none_or(|n| n > chunk.size) {
            return Err(corrupt(format!(
                "chunk at offset {} says {len} bytes, holds {}",
                chunk.offset, chunk.size
            )));
        }
        Ok((lease, chunk.offset + CHUNK_HEADER, len))
    }
}

impl ArenaFile {
    /// The creator's lease on `chunk`, which its writer just wrote with an archive of `len`
    /// bytes (not settled yet, so not reclaimed meanwhile): counted here, without a lock. The
    /// creator reuses only chunks released here (whose last handle in this process is gone),
    /// so its own handles need no lock; other processes' leases are their locks.
    pub fn lease_own(self: &Arc<Self>, chunk: Chunk, len: u64) -> (Lease, u64, u64) {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases
            .entry(chunk.offset)
            .and_modify(|(_, n, _)| *n += 1)
            .or_insert((chunk.size, 1, false));
        let lease = Lease {
            arena: self.clone(),
            offset: chunk.offset,
        };
        (lease, chunk.offset + CHUNK_HEADER, len)
    }
}

/// What `shmstore inspect` shows of an arena: its header and its chunks.
#[derive(Debug)]
pub struct Survey {
    pub capacity: u64,
    pub creator_pid: u32,
    pub parts: Vec<Part>,
}

/// A stretch of an arena's chunk region, as seen from outside the creator.
#[derive(Debug, PartialEq, Eq)]
pub struct Part {
    pub offset: u64,
    pub size: u64,
    /// The chunk's generation; `None` for a stretch holding no chunk header.
    pub generation: Option<u64>,
    pub state: PartState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartState {
    /// Locked by the creator: free space (or a chunk being written at this moment).
    Free,
    /// Some process holds a lease on it (a shared lock).
    Leased,
    /// Written and not locked: held by its creator's handles only, or released and
    /// waiting for the creator's next put to reuse it.
    Unleased,
    /// No chunk header here and no lock: never written (beyond the arena's high-water
    /// mark) or the rest of a freed chunk.
    Unused,
}

/// The first lock on `[off, off + len)` of the file that would conflict with an exclusive
/// one (any lock of another open file description): its type, or `None`.
fn ofd_probe(fd: &impl AsFd, off: u64, len: u64) -> io::Result<Option<PartState>> {
    let (Ok(start), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: as in `ofd_lock`: a zeroed `flock` is valid, and F_OFD_GETLK reads and writes
    // only that struct, which outlives the call.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: see above; the descriptor is borrowed for the call.
    let r = unsafe { libc::fcntl(fd.as_fd().as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(match i32::from(fl.l_type) {
        libc::F_WRLCK => Some(PartState::Free),
        libc::F_RDLCK => Some(PartState::Leased),
        _ => None,
    })
}

/// Look at the arena at `path` from outside (any process of its user): its header, and its
/// chunk region from start to end: each chunk header found (magic, a length that fits) is a
/// chunk, with its state from the locks on its range; stretches without one are free space.
/// Reads the file with `pread` (no mapping), never trusts a length it did not check.
pub fn survey(path: &Path) -> Result<Survey, ArenaError> {
    let f = ArenaFile::open(path)?;
    let mut head = [0u8; 32];
    f.file
        .read_exact_at(&mut head, 0)
        .map_err(|e| io_err(path, e))?;
    let capacity = f.len - HEADER;
    let creator_pid = u32::from_le_bytes(head[24..28].try_into().unwrap_or_default());
    let mut parts: Vec<Part> = Vec::new();
    let gap = |parts: &mut Vec<Part>, off: u64, size: u64, state: PartState| match parts.last_mut()
    {
        Some(p) if p.generation.is_none() && p.state == state && p.offset + p.size == off => {
            p.size += size
        }
        _ => parts.push(Part {
            offset: off,
            size,
            generation: None,
            state,
        }),
    };
    // Read a MiB at a time; chunk headers are 64-byte aligned.
    let mut buf = vec![0u8; 1 << 20];
    let mut buf_at = u64::MAX;
    let mut off = HEADER;
    while off + CHUNK_HEADER <= f.len {
        if buf_at == u64::MAX || off < buf_at || off + CHUNK_HEADER > buf_at + buf.len() as u64 {
            let n = (buf.len() as u64).min(f.len - off) as usize;
            f.file
                .read_exact_at(&mut buf[..n], off)
                .map_err(|e| io_err(path, e))?;
            buf.truncate(n.max(CHUNK_HEADER as usize));
            buf.resize(1 << 20, 0);
            buf_at = off;
        }
        let h = &buf[(off - buf_at) as usize..][..CHUNK_HEADER as usize];
        let magic = u32::from_le_bytes(h[..4].try_into().unwrap_or_default());
        let generation = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default());
        let size = CHUNK_HEADER
            .checked_add(len)
            .and_then(|n| n.checked_add(ALIGN - 1))
            .map(|n| n & !(ALIGN - 1));
        match size {
            Some(size)
                if magic == CHUNK_MAGIC
                    && generation > 0
                    && off.checked_add(size).is_some_and(|end| end <= f.len) =>
            {
                let state = ofd_probe(&f.file, off, size)
                    .map_err(|e| io_err(path, e))?
                    .unwrap_or(PartState::Unleased);
                if state == PartState::Free {
                    // A freed chunk's old header: free space.
                    gap(&mut parts, off, size, state);
                } else {
                    parts.push(Part {
                        offset: off,
                        size,
                        generation: Some(generation),
                        state,
                    });
                }
                off += size;
            }
            _ => {
                gap(&mut parts, off, ALIGN, PartState::Unused);
                off += ALIGN;
            }
        }
    }
    // Stretches without a header: free if the creator holds them (it is alive), else unused.
    for p in parts.iter_mut().filter(|p| p.generation.is_none()) {
        if p.state == PartState::Unused
            && ofd_probe(&f.file, p.offset, p.size).map_err(|e| io_err(path, e))?
                == Some(PartState::Free)
        {
            p.state = PartState::Free;
        }
    }
    Ok(Survey {
        capacity,
        creator_pid,
        parts,
    })
}

/// This process uses a chunk: a shared OFD lock on its range, released with the last
/// lease of the chunk in this process (or by the kernel when the process dies).
pub struct Lease {
    arena: Arc<ArenaFile>,
    offset: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A forked child's copy of its parent's handle: the lock is the parent's (an OFD
        // lock belongs to the open file description both share), and so is the count.
        if self.arena.pid != pid() {
            return;
        }
        let mut leases = self.arena.leases.lock().unwrap_or_else(|p| p.into_inner());
        let Some((size, n, locked)) = leases.get_mut(&self.offset) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        let (size, locked) = (*size, *locked);
        leases.remove(&self.offset);
        drop(leases);
        // Unlocking never blocks; a failure (it cannot fail for a valid range) would only
        // keep the chunk from reuse until this process exits.
        if locked {
            let _ = ofd_lock(&self.arena.file, Lock::Unlock, self.offset, size);
        }
        if let Some(r) = self
            .arena
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            r.insert(self.offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(dir: &Path) -> ArenaWriter {
        ArenaWriter::create(dir, "shmstore-arena-test", 1 << 20).unwrap()
    }

    /// `n` chunks of `len` bytes each (the i-th filled with i), put and settled.
    fn settled_chunks(w: &mut ArenaWriter, n: u8, len: usize) -> Vec<Chunk> {
        let cs: Vec<Chunk> = (0..n)
            .map(|i| w.put(&vec![i; len]).unwrap().unwrap())
            .collect();
        for c in &cs {
            w.settled(c.offset);
        }
        cs
    }

    #[test]
    fn put_lease_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let meta = std::fs::metadata(w.path()).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o400);
        let c = w.put(b"hello arena").unwrap().unwrap();
        let f = ArenaFile::open(w.path()).unwrap();
        f.mark_owned();
        let (lease, at, len) = f.lease(c).unwrap();
        let mut got = vec![0u8; len as usize];
        f.file().read_exact_at(&mut got, at).unwrap();
        assert_eq!(got, b"hello arena");
        // Still sealed after the write (mode and the mtime mark).
        let meta = std::fs::metadata(w.path()).unwrap();
        assert_eq!(meta.mtime_nsec(), i64::from(segment::SEALED_MTIME_NSEC));
        drop(lease);
        assert_eq!(f.take_released(), HashSet::from([c.offset]));
        assert!(f.take_released().is_empty());
    }

    #[test]
    fn a_leased_chunk_is_not_reused_and_a_stale_handle_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let c = w.put(&[1u8; 1000]).unwrap().unwrap();
        w.settled(c.offset);
        let f = ArenaFile::open(w.path()).unwrap();
        let (lease, _, _) = f.lease(c).unwrap();
        // The creator gave it up, but a lease holds it: not reused.
        let mut pending = HashSet::from([c.offset]);
        w.reclaim(&mut pending).unwrap();
        assert!(w.is_refused(c.offset));
        let d = w.put(&[2u8; 1000]).unwrap().unwrap();
        assert_ne!(d.offset, c.offset);
        drop(lease);
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
        assert_eq!(w.refused_count(), 0);
        // Reused: same place, new generation; the old handle is stale.
        let e = w.put(&[3u8; 1000]).unwrap().unwrap();
        w.settled(e.offset);
        assert_eq!(e.offset, c.offset);
        assert_ne!(e.generation, c.generation);
        match f.lease(c) {
            Err(ArenaError::Stale { want, have, .. }) => {
                assert_eq!((want, have), (c.generation, e.generation))
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        // The refused lease left no lock behind: the new chunk can be freed and reused.
        let mut pending = HashSet::from([e.offset]);
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
    }

    /// Adjacent chunks are reclaimed with one lock over the run when nobody holds any of
    /// them; a lease on one of them keeps that one (only) from reuse.
    #[test]
    fn a_run_of_freed_chunks_is_reclaimed_around_a_leased_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let cs = settled_chunks(&mut w, 5, 300);
        assert!(cs
            .windows(2)
            .all(|p| p[0].offset + p[0].size == p[1].offset));
        let f = ArenaFile::open(w.path()).unwrap();
        let (lease, _, _) = f.lease(cs[2]).unwrap();
        let mut pending: HashSet<u64> = cs.iter().map(|c| c.offset).collect();
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
        assert!(w.is_refused(cs[2].offset) && w.refused_count() == 1);
        // The freed ones are locked again (free space): a lease on one is refused.
        assert!(matches!(f.lease(cs[0]), Err(ArenaError::Stale { .. })));
        assert!(matches!(f.lease(cs[4]), Err(ArenaError::Stale { .. })));
        // ...and reused, best fit from the lowest offset.
        let again = w.put(&[9u8; 300]).unwrap().unwrap();
        assert_eq!(again.offset, cs[0].offset);
        drop(lease);
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
        assert_eq!(w.refused_count(), 0);
        // A run nobody holds: reclaimed at once, every chunk of it refused to a lease.
        let run: Vec<Chunk> = (0..3u8)
            .map(|i| w.put(&[i; 2000]).unwrap().unwrap())
            .collect();
        let mut pending = HashSet::new();
        for c in &run {
            w.settled(c.offset);
            pending.insert(c.offset);
        }
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
        for c in &run {
            assert!(matches!(f.lease(*c), Err(ArenaError::Stale { .. })));
        }
    }

    /// Chunks found leased are tried again a few at a time, in offset order from where the
    /// last call stopped; `reclaim` tries them all.
    #[test]
    fn chunks_held_elsewhere_are_retried_a_few_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let cs = settled_chunks(&mut w, 10, 500);
        let f = ArenaFile::open(w.path()).unwrap();
        let leases: Vec<_> = cs.iter().map(|c| f.lease(*c).unwrap().0).collect();
        // Released since the last call: every one is tried, however few retries are asked.
        let mut pending: HashSet<u64> = cs.iter().map(|c| c.offset).collect();
        w.reclaim_some(&mut pending, 0).unwrap();
        assert!(pending.is_empty());
        assert_eq!(w.refused_count(), 10);
        drop(leases);
        // No retries asked: nothing tried again.
        w.reclaim_some(&mut pending, 0).unwrap();
        assert_eq!(w.refused_count(), 10);
        let held =
            |w: &ArenaWriter| -> Vec<bool> { cs.iter().map(|c| w.is_refused(c.offset)).collect() };
        w.reclaim_some(&mut pending, 3).unwrap();
        assert_eq!(
            held(&w),
            [false, false, false, true, true, true, true, true, true, true]
        );
        w.reclaim_some(&mut pending, 3).unwrap();
        assert_eq!(
            held(&w),
            [false, false, false, false, false, false, true, true, true, true]
        );
        // Everything, and the freed chunks are reused.
        w.reclaim(&mut pending).unwrap();
        assert_eq!(w.refused_count(), 0);
        assert_eq!(w.put(&[1u8; 500]).unwrap().unwrap().offset, cs[0].offset);
    }

    /// A release of a chunk's offset that arrives between the write and the creator's own
    /// lease (a stale handle of the same place let go meanwhile) does not free the chunk.
    #[test]
    fn a_fresh_chunk_is_not_reclaimed_before_it_is_settled() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let c = w.put(&[1u8; 100]).unwrap().unwrap();
        let mut pending = HashSet::from([c.offset]);
        w.reclaim(&mut pending).unwrap();
        assert!(
            pending.contains(&c.offset),
            "freed before its handle held it"
        );
        assert_ne!(w.put(&[2u8; 100]).unwrap().unwrap().offset, c.offset);
        w.settled(c.offset);
        w.reclaim(&mut pending).unwrap();
        assert!(pending.is_empty());
    }

    #[test]
    fn hostile_handles_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let c = w.put(b"x").unwrap().unwrap();
        let f = ArenaFile::open(w.path()).unwrap();
        for bad in [
            Chunk { offset: 0, ..c },
            Chunk {
                offset: c.offset + 1,
                ..c
            },
            Chunk {
                size: u64::MAX,
                ..c
            },
            Chunk {
                offset: u64::MAX - 63,
                ..c
            },
            Chunk {
                offset: c.offset + c.size,
                ..c
            },
        ] {
            assert!(f.lease(bad).is_err(), "{bad:?}");
        }
        // Not an arena at all.
        let other = dir.path().join("shmstore-not-arena");
        std::fs::write(&other, [0u8; 5000]).unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(matches!(
            ArenaFile::open(&other),
            Err(ArenaError::Corrupt { .. })
        ));
    }

    #[test]
    fn survey_shows_chunks_and_free_space() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let a = w.put(&[1u8; 100]).unwrap().unwrap();
        let b = w.put(&[2u8; 1000]).unwrap().unwrap();
        let s = survey(w.path()).unwrap();
        assert_eq!(s.capacity, 1 << 20);
        assert_eq!(s.creator_pid, std::process::id());
        let chunks: Vec<_> = s.parts.iter().filter(|p| p.generation.is_some()).collect();
        assert_eq!(chunks.len(), 2);
        assert_eq!(
            (chunks[0].offset, chunks[0].generation),
            (a.offset, Some(1))
        );
        assert_eq!(
            (chunks[1].offset, chunks[1].generation),
            (b.offset, Some(2))
        );
        assert!(chunks.iter().all(|p| p.state == PartState::Unleased));
        let rest = s.parts.last().unwrap();
        assert_eq!((rest.generation, rest.state), (None, PartState::Free));
        assert_eq!(s.parts.iter().map(|p| p.size).sum::<u64>(), s.capacity);
    }

    /// A payload written through a chunk's sink comes back with the xxh3 of its bytes,
    /// whether the copy streams and hashes on the way or not, aligned or not; past the room
    /// it is refused.
    #[test]
    fn a_payload_is_hashed_as_it_is_written_into_a_chunk() {
        use crate::archive::builder::Sink;
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let f = ArenaFile::open(w.path()).unwrap();
        // Below and above the size from which the copy streams (and hashes on the way),
        // after an odd-sized write so that the payload starts unaligned too.
        for (n, pad) in [(1000, 0), (STREAM_COPY, 0), (65_536 + 7, 0), (65_536, 3)] {
            let payload: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut r = w.reserve(n as u64 + 64).unwrap().unwrap();
            let sum = {
                let mut sink = r.sink();
                sink.write_all(&[9u8; 3][..pad]).unwrap();
                sink.write_hashed(&payload).unwrap()
            };
            assert_eq!(sum, xxhash_rust::xxh3::xxh3_64(&payload), "{n} bytes");
            let c = w.commit(&r, (pad + n) as u64).unwrap();
            w.settled(c.offset);
            let (lease, at, len) = f.lease(c).unwrap();
            let mut got = vec![0u8; len as usize];
            f.file().read_exact_at(&mut got, at).unwrap();
            assert_eq!(&got[pad..], &payload[..], "{n} bytes");
            drop(lease);
            // Past the room: refused, nothing written.
            let mut r = w.reserve(100).unwrap().unwrap();
            let big = vec![1u8; r.room() as usize + 1];
            assert!(r.sink().write_hashed(&big).is_err());
            assert!(r.overflowed());
            w.cancel(&r);
        }
    }

    /// An archive written in place: the chunk is reserved larger, shrunk to what was
    /// written at the commit; the tail is free space again (locked: no lease on it); a
    /// write past the room is refused and a cancelled chunk is free (and locked) again.
    #[test]
    fn a_reserved_chunk_is_written_in_place_then_shrunk_or_cancelled() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let mut w = arena(dir.path());
        let f = ArenaFile::open(w.path()).unwrap();
        let mut r = w.reserve(10_000).unwrap().unwrap();
        assert!(r.room() >= 10_000);
        {
            let mut sink = r.sink();
            sink.write_all(&[0u8; 8]).unwrap();
            sink.write_all(b" in place").unwrap();
            sink.seek(SeekFrom::Start(0)).unwrap();
            sink.write_all(b"written!").unwrap();
        }
        let c = w.commit(&r, 17).unwrap();
        w.settled(c.offset);
        assert_eq!(
            c.size, 128,
            "shrunk to the chunk header and 17 bytes, 64-aligned"
        );
        let (lease, at, len) = f.lease(c).unwrap();
        let mut got = vec![0u8; len as usize];
        f.file().read_exact_at(&mut got, at).unwrap();
        assert_eq!(got, b"written! in place");
        // The tail is free space: locked by the creator, so no lease is taken on it.
        let tail = Chunk {
            offset: c.offset + c.size,
            size: 128,
            generation: 0,
        };
        assert!(matches!(f.lease(tail), Err(ArenaError::Stale { .. })));
        // ...and the next chunk is placed there.
        let mut r2 = w.reserve(100).unwrap().unwrap();
        assert_eq!(r2.offset, tail.offset);
        // Writing past the room is refused, nothing is given out; cancelled, the chunk is
        // free again and its range still refuses leases.
        assert!(r2.write_at(r2.room() - 1, b"ab").is_err());
        assert!(r2.overflowed());
        w.cancel(&r2);
        assert!(matches!(
            f.lease(Chunk {
                offset: r2.offset,
                size: r2.size,
                generation: r2.generation,
            }),
            Err(ArenaError::Stale { .. })
        ));
        assert_eq!(w.reserve(100).unwrap().unwrap().offset, tail.offset);
        // A commit longer than the reservation is refused (and frees it).
        let r3 = w.reserve(100).unwrap().unwrap();
        assert!(w.commit(&r3, r3.room() + 1).is_err());
        assert_eq!(w.reserve(100).unwrap().unwrap().offset, r3.offset);
        drop(lease);
    }

    #[test]
    fn full_arena_says_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ArenaWriter::create(dir.path(), "shmstore-arena-small", 4096).unwrap();
        assert!(w.put(&[0u8; 3000]).unwrap().is_some());
        assert!(w.put(&[0u8; 3000]).unwrap().is_none());
    }
}
