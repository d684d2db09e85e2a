//! The creator's side: making an arena file ([`ArenaWriter`]), reserving and writing
//! chunks ([`Reservation`], [`ChunkSink`]) and reusing the ones no process holds.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::alloc::{Bfc, ALIGN};
use super::format::*;
use super::lease::*;
use super::Offsets;
use crate::archive::hash;
use crate::process::pid;
use crate::segment;

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
    pub(super) file: File,
    /// The whole file mapped shared and writable (through `file`), every page faulted in at
    /// creation: chunks are copied in here. Only free chunks (locked by `file`) are written.
    /// Shared with the [`Reservation`]s made from it (written without this writer at hand).
    pub(super) map: Arc<memmap2::MmapRaw>,
    /// When the seal mark was last checked (see [`ArenaWriter::put`]).
    pub(super) mark_checked: Instant,
    pub(super) path: PathBuf,
    pub(super) bfc: Bfc,
    pub(super) next_generation: u64,
    /// Chunks written but not yet leased by the handle being made for them: never
    /// reclaimed, whatever releases of their offset arrive (a stale handle's, say).
    pub(super) fresh: Offsets,
    /// Chunks this process let go of that another process still held (a lease) when last
    /// tried, in offset order, and where the next retry starts: retried a few at a time
    /// ([`ArenaWriter::reclaim_some`]), so that a process holding thousands of this
    /// process's objects does not cost every `put` a lock attempt on each of them.
    pub(super) refused: BTreeSet<u64>,
    pub(super) retry_at: u64,
    /// The process that made it: a forked child must make its own.
    pub(super) pid: u32,
}

impl ArenaWriter {
    /// Create `dir/name` with room for `capacity` bytes of chunks: written as
    /// `<name>.part-<random>`, reserved (`fallocate`), sealed and linked under its name.
    pub fn create(dir: &Path, name: &str, capacity: u64) -> Result<Self, ArenaError> {
        let capacity = capacity & !(ALIGN - 1);
        let total = HEADER
            .checked_add(capacity)
            .ok_or_else(|| io_err(dir, io::Error::from(io::ErrorKind::InvalidInput)))?;
        let path = dir.join(name);
        let res = segment::create_preallocated(dir, name, total, |file, tmp| {
            let mut head = [0u8; 32];
            head[..8].copy_from_slice(MAGIC);
            head[8..12].copy_from_slice(&VERSION.to_le_bytes());
            head[16..24].copy_from_slice(&capacity.to_le_bytes());
            head[segment::CREATOR_PID_AT..][..4].copy_from_slice(&pid().to_le_bytes());
            file.write_all_at(&head, 0).map_err(|e| io_err(tmp, e))?;
            file.set_permissions(std::fs::Permissions::from_mode(0o400))
                .map_err(|e| io_err(tmp, e))?;
            let map = map_for_writing(&file, total).map_err(|e| io_err(tmp, e))?;
            // After the pages are in: their write faults moved the modification time.
            segment::mark_sealed(&file).map_err(|e| io_err(tmp, e))?;
            // All of the chunk region is free: locked by the creator until it is written.
            if !ofd_lock(&file, Lock::Exclusive, HEADER, capacity).map_err(|e| io_err(tmp, e))? {
                return Err(io_err(tmp, io::Error::from(io::ErrorKind::WouldBlock)));
            }
            Ok::<_, ArenaError>((file, map))
        });
        let (file, map) = res?;
        Ok(ArenaWriter {
            file,
            map: Arc::new(map),
            mark_checked: Instant::now(),
            path,
            bfc: Bfc::new(capacity),
            next_generation: 1,
            fresh: Offsets::default(),
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
    pub fn reclaim(&mut self, pending: &mut Offsets) -> Result<(), ArenaError> {
        self.reclaim_some(pending, usize::MAX)
    }

    /// As [`Self::reclaim`], but of the chunks found leased before only up to `retries`
    /// are tried again, round robin in offset order: the cost of a call is bounded by what
    /// was released since the last one, plus `retries` lock attempts, whatever other
    /// processes hold.
    pub fn reclaim_some(
        &mut self,
        pending: &mut Offsets,
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
    pub(super) fn keep_seal_mark(&mut self) {
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
pub(super) fn map_for_writing(file: &File, len: u64) -> io::Result<memmap2::MmapRaw> {
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
    pub(super) map: Arc<memmap2::MmapRaw>,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) generation: u64,
    /// A write past the room was refused.
    pub(super) over: bool,
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
    pub(super) fn inside(&mut self, at: u64, len: usize) -> io::Result<u64> {
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
    pub(super) fn ptr(&self, at: u64) -> *mut u8 {
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
pub(super) const STREAM_COPY: usize = 16 << 10;

/// Writes an archive straight into a [`Reservation`]: writing past its room is an error
/// (`ErrorKind::WriteZero`), nothing is written there.
pub struct ChunkSink<'a> {
    pub(super) r: &'a mut Reservation,
    pub(super) pos: u64,
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
