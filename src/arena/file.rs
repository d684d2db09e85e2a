//! Every user's side: an arena file opened read-only ([`ArenaFile`], once per process),
//! its leases, and [`survey`] (what `shmstore inspect` shows of an arena).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::alloc::ALIGN;
use super::format::*;
use super::lease::*;
use super::writer::*;
use super::{OffsetMap, Offsets};
use crate::process::{self, pid, ForkHooks, ForkLock};
use crate::segment::SegmentError;

// --- every user's side ------------------------------------------------------------------------

/// An arena file opened read-only by a process that uses chunks of it, with this process's
/// lease counts (one OFD lock per leased chunk, however many handles share it).
pub struct ArenaFile {
    pub(super) file: File,
    /// The whole file mapped read-only, once per process: every chunk read here is a window
    /// of it (`Mapping::window`). Only leased windows are ever read through it.
    pub(super) map: Arc<memmap2::Mmap>,
    pub(super) path: PathBuf,
    pub(super) ident: (u64, u64),
    pub(super) len: u64,
    pub(super) pid: u32,
    /// offset -> (size, handles here, whether this process holds an OFD lock on it).
    pub(super) leases: Mutex<OffsetMap<(u64, usize, bool)>>,
    /// In the creator only: chunks whose last lease in this process ended (reuse
    /// candidates). Other processes record nothing.
    pub(super) released: Mutex<Option<Offsets>>,
}

pub(super) type OpenFiles = HashMap<PathBuf, Weak<ArenaFile>>;

/// The arenas opened in this process, with their fork hooks registered: the first lock
/// of `crate::process`'s order ([`ForkLock::ArenaFiles`]), so a child never inherits it
/// locked by a thread that does not exist in it.
pub(super) fn open_files() -> &'static Mutex<OpenFiles> {
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

pub(super) fn files() -> &'static Mutex<OpenFiles> {
    static FILES: OnceLock<Mutex<OpenFiles>> = OnceLock::new();
    FILES.get_or_init(Default::default)
}

thread_local! {
    /// [`open_files`], held by the forking thread from before the fork to after it.
    static HELD_FILES: std::cell::RefCell<Option<std::sync::MutexGuard<'static, OpenFiles>>> =
        const { std::cell::RefCell::new(None) };
}

pub(super) fn release_open_files() {
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
        let file = crate::segment::open_read_nofollow(path).map_err(|e| match e.kind() {
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
            leases: Mutex::new(OffsetMap::default()),
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
        r.get_or_insert_with(Offsets::default);
    }

    /// Move the chunks released here since the last call (the creator's reuse candidates)
    /// into `into`. The set here keeps its room: a stream of small objects releases about
    /// as many between two calls as the last time, with no allocation.
    pub fn move_released_into(&self, into: &mut Offsets) {
        let mut r = self.released.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = r.as_mut() {
            into.extend(r.drain());
        }
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
pub(super) fn ofd_probe(fd: &impl AsFd, off: u64, len: u64) -> io::Result<Option<PartState>> {
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
