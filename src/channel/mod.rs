//! Pure-Rust channel layer (no pyo3): a bounded queue of object handles in a shared-memory
//! file that every process using it maps writable (docs/channel.md).
//!
//! The file is a header and a ring of fixed-size cells. Any number of processes put and
//! get: each cell carries a sequence number that says whose turn it is (the classic
//! bounded multi-producer multi-consumer ring: a put claims position `p` by advancing the
//! tail when cell `p % capacity` has sequence `p`, writes the cell, and publishes it with
//! sequence `p + 1`; a get claims it by advancing the head, reads it, and hands the cell
//! back with sequence `p + capacity`). A put therefore also learns when its handle has
//! been taken: its cell's sequence has moved to `p + capacity` or beyond.
//!
//! Every byte of the file may be written by another process at any moment, by a bug or on
//! purpose: all of it is read and written through atomics (no data race, whatever the
//! other side does), every value read is checked before use, and every wait is bounded by a
//! deadline, so a corrupt or hostile ring gives an error or a timeout, never a crash or an
//! endless loop. Waiting sleeps on a futex in the shared mapping: no system call is made
//! while both sides keep up, and one wake-up only when the other side sleeps.

use std::fs::File;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::segment::{self, SegmentError};

pub mod scan;

/// The first bytes of a channel file.
pub const MAGIC: &[u8; 8] = b"SHMCHANL";
/// 2: each claim also carries its process's start (`PUTTER_START`, `GETTER_START`), so a
/// claim of a process whose pid now names another is recognised; a cell's path starts at
/// word 9 (at most 184 bytes). 3: a process names itself in the cell (`PUTTER`, `GETTER`)
/// before it moves the tail or the head, not after (see [`Ring::claim`]); the layout is
/// version 2's.
const VERSION: u32 = 3;
/// Bytes before the first cell.
const HEADER: u64 = 512;
/// Bytes of a cell: 32 words.
const CELL: u64 = 256;
const CELL_WORDS: usize = (CELL / 8) as usize;
/// The cell word holding who claimed it to put (see [`me`]), written first after the claim.
const PUTTER: usize = 5;
/// The cell word holding who claimed it to get, written first after the claim.
const GETTER: usize = 6;
/// The cell words holding when the process that claimed it to put (to get) started (see
/// [`my_start`]), written just before `PUTTER` (`GETTER`).
const PUTTER_START: usize = 7;
const GETTER_START: usize = 8;
/// Words of a cell before its path.
const PATH_AT: usize = 9;
/// The longest path a cell carries.
pub const MAX_PATH: usize = (CELL_WORDS - PATH_AT) * 8;
/// The most cells a channel may have.
pub const MAX_CAPACITY: u64 = 1 << 20;

// Header offsets (bytes). Each hot word has a cache line of its own.
const AT_CAPACITY: usize = 16;
const AT_CREATOR: usize = segment::CREATOR_PID_AT;
const AT_TAIL: usize = 64;
const AT_HEAD: usize = 128;
const AT_RECV_EPOCH: usize = 192;
const AT_RECV_WAITERS: usize = 196;
const AT_SEND_EPOCH: usize = 256;
const AT_SEND_WAITERS: usize = 260;
/// The CPU (plus one; 0: none yet) the last put ran on, and the last get: a hint for a
/// waiter, which does not spin for a process that runs on its own CPU ([`Ring::wait`]).
/// Hints only: a wrong value (another version's process writes none; a hostile one anything)
/// makes a wait spin or sleep when the other would have been quicker, nothing else.
const AT_PUT_CPU: usize = 320;
const AT_GET_CPU: usize = 384;

/// Errors of the channel layer.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Bytes of the channel that make no sense.
    #[error("channel {channel}: corrupt: {what}")]
    Corrupt { channel: String, what: String },
    #[error(transparent)]
    Segment(#[from] SegmentError),
}

fn io_err(path: &Path, e: impl Into<io::Error>) -> ChannelError {
    ChannelError::Segment(SegmentError::io(path, e.into()))
}

fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// What a cell carries: where an object is. A putter's handle may borrow its path
/// (`Handle<&Path>`: no copy per object); a getter's owns the path read from the cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle<P = PathBuf> {
    /// 1: a chunk of the arena at `path` (`offset`, `size`, `generation`); 2: the segment at
    /// `path`.
    pub kind: u8,
    pub path: P,
    pub offset: u64,
    pub size: u64,
    pub generation: u64,
}

pub const CHUNK: u8 = 1;
pub const SEGMENT: u8 = 2;

/// A claimed cell: its position, and its handle or what is wrong with the cell.
pub type Claimed = (u64, Result<Handle, String>);

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Something changed (or may have): look again.
    Again,
    /// The deadline passed.
    TimedOut,
}

/// One process's mapping of a channel file.
pub struct Ring {
    map: memmap2::MmapRaw,
    _file: File,
    path: PathBuf,
    capacity: u64,
    /// This process's spin budget before a wait sleeps, in nanoseconds ([`Ring::adapt`]).
    spin_ns: AtomicU32,
    /// Tests: how many waits spun (those that did not skip the spin, see [`Ring::wait`]).
    #[cfg(test)]
    spun: AtomicU32,
}

impl Ring {
    /// Create the channel `dir/name` with `capacity` cells (a power of two, 2 to
    /// [`MAX_CAPACITY`]): written as `<name>.part-<random>` and linked under its name when
    /// complete, so no process ever opens a half-made channel.
    pub fn create(dir: &Path, name: &str, capacity: u64) -> Result<Ring, ChannelError> {
        if !capacity.is_power_of_two() || !(2..=MAX_CAPACITY).contains(&capacity) {
            return Err(io_err(
                dir,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("a channel's capacity is a power of two from 2 to {MAX_CAPACITY}, not {capacity}"),
                ),
            ));
        }
        let total = HEADER + capacity * CELL;
        let made = segment::create_preallocated(dir, name, total, |file, tmp| {
            // Exactly 0600 whatever the umask: both sides write it, nobody else may.
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io_err(tmp, e))?;
            let ring = Ring::map(file, tmp.to_owned(), capacity, total)?;
            for (i, b) in MAGIC.iter().enumerate() {
                ring.byte(i).store(*b, Ordering::Relaxed);
            }
            ring.u32_at(8).store(VERSION, Ordering::Relaxed);
            ring.u32_at(12).store(CELL as u32, Ordering::Relaxed);
            ring.u64_at(AT_CAPACITY).store(capacity, Ordering::Relaxed);
            ring.u32_at(AT_CREATOR)
                .store(crate::arena::pid(), Ordering::Relaxed);
            for i in 0..capacity {
                ring.word(i, 0).store(i, Ordering::Relaxed);
            }
            std::sync::atomic::fence(Ordering::SeqCst);
            Ok::<_, ChannelError>(ring)
        });
        let path = dir.join(name);
        let mut ring = made?;
        ring.path = path;
        Ok(ring)
    }

    /// Open the channel at `path`: ours, a regular file of mode 0600 (no symlink followed),
    /// a channel header, and exactly the size its capacity says.
    pub fn open(path: &Path) -> Result<Ring, ChannelError> {
        let name = name_of(path);
        let (file, meta) = segment::open_owned_rw(path, &name)?;
        let corrupt = |what: String| ChannelError::Corrupt {
            channel: name.clone(),
            what,
        };
        if meta.mode() & 0o7777 != 0o600 {
            return Err(corrupt(format!(
                "not a channel file (mode {:o})",
                meta.mode() & 0o7777
            )));
        }
        let mut head = [0u8; 32];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0)
            .map_err(|_| corrupt("shorter than its header".into()))?;
        let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap_or_default());
        let capacity = word(AT_CAPACITY);
        let version = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default());
        let cell = u32::from_le_bytes(head[12..16].try_into().unwrap_or_default());
        let size = capacity
            .checked_mul(CELL)
            .and_then(|n| n.checked_add(HEADER));
        if &head[..8] != MAGIC
            || version != VERSION
            || u64::from(cell) != CELL
            || !capacity.is_power_of_two()
            || !(2..=MAX_CAPACITY).contains(&capacity)
            || size != Some(meta.len())
        {
            return Err(corrupt(format!(
                "bad header (magic, version {version}, cell size {cell}, capacity {capacity} \
                 or size {})",
                meta.len()
            )));
        }
        Ring::map(file, path.to_owned(), capacity, meta.len())
    }

    fn map(file: File, path: PathBuf, capacity: u64, len: u64) -> Result<Ring, ChannelError> {
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(|e| io_err(&path, e))?;
        Ok(Ring {
            map,
            _file: file,
            path,
            capacity,
            spin_ns: AtomicU32::new(SPIN_START.as_nanos() as u32),
            #[cfg(test)]
            spun: AtomicU32::new(0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    // --- the shared words -------------------------------------------------------------------

    fn byte(&self, at: usize) -> &std::sync::atomic::AtomicU8 {
        assert!(at < HEADER as usize);
        // SAFETY: `at` is inside the mapping (checked, and the mapping is at least HEADER
        // bytes), which lives as long as `self`. Every access to the shared bytes is atomic,
        // so writes by other processes are never a data race.
        unsafe { &*(self.map.as_ptr().add(at) as *const std::sync::atomic::AtomicU8) }
    }

    fn u32_at(&self, at: usize) -> &AtomicU32 {
        assert!(at % 4 == 0 && at + 4 <= HEADER as usize);
        // SAFETY: as in `byte`; 4-byte aligned (the mapping is page aligned, `at` a multiple
        // of 4).
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU32) }
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        assert!(at % 8 == 0 && at + 8 <= HEADER as usize);
        // SAFETY: as in `u32_at`, 8-byte aligned.
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU64) }
    }

    /// Word `w` of the cell for position `pos`.
    fn word(&self, pos: u64, w: usize) -> &AtomicU64 {
        let cell = pos & (self.capacity - 1);
        let at = HEADER as usize + cell as usize * CELL as usize + (w % CELL_WORDS) * 8;
        // SAFETY: `cell < capacity` and `w % CELL_WORDS < CELL_WORDS`, so the word lies inside
        // the mapping, whose length is HEADER + capacity * CELL (checked at open); 8-byte
        // aligned. Atomic, as every access to the shared bytes.
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU64) }
    }

    fn tail(&self) -> &AtomicU64 {
        self.u64_at(AT_TAIL)
    }

    fn head(&self) -> &AtomicU64 {
        self.u64_at(AT_HEAD)
    }

    /// How many handles wait in the channel (approximate while others put and get).
    pub fn len(&self) -> u64 {
        let (t, h) = (
            self.tail().load(Ordering::Acquire),
            self.head().load(Ordering::Acquire),
        );
        t.wrapping_sub(h).min(self.capacity)
    }

    // --- put --------------------------------------------------------------------------------

    /// Put `h` into the next free cell; `Ok(None)` when the channel is full (nothing was
    /// written), else the position it took. The caller keeps the object alive until
    /// [`Ring::taken`] says so.
    pub fn try_push<P: AsRef<Path>>(&self, h: &Handle<P>) -> Result<Option<u64>, ChannelError> {
        let path = h.path.as_ref().as_os_str().as_encoded_bytes();
        if path.len() > MAX_PATH || h.kind == 0 {
            return Err(ChannelError::Corrupt {
                channel: name_of(&self.path),
                what: format!("a path of {} bytes does not fit a cell", path.len()),
            });
        }
        let Some(pos) = self.claim(self.tail(), 0, PUTTER, PUTTER_START, "put")? else {
            return Ok(None);
        };
        self.write_cell(pos, h, path);
        self.word(pos, 0)
            .store(pos.wrapping_add(1), Ordering::Release);
        self.wake(AT_RECV_EPOCH, AT_RECV_WAITERS);
        self.note_cpu(AT_PUT_CPU);
        Ok(Some(pos))
    }

    /// Claim the position `at` holds (the tail for a put, the head for a get) when its
    /// cell's sequence is the position plus `ahead` (0: free for a put; 1: published for a
    /// get), by moving `at` on; `None` when it is less (full, or empty), or while another
    /// process is claiming it. A sequence beyond means another process claimed it first and
    /// moved on: look again.
    ///
    /// The claimer names itself in the cell's word `who` (compare-and-swap from 0) before it
    /// moves `at`, and takes its name back if another process moved `at` first. So a cell
    /// whose position `at` has passed always names its claimer, and a claimer killed at any
    /// point is found dead by the other side ([`Ring::recover_get`], [`Ring::recover_put`]);
    /// had it named itself only after moving `at`, a claimer killed between the two left a
    /// cell that nobody could judge, and every put and get of the channel waited on it for
    /// good (found by the fault campaign). A name in a cell whose position `at` has not
    /// passed is a claim in progress: a live process's is waited for (it moves `at` within
    /// moments, unless it is stopped), a dead one's is taken over. `start` (the claimer's
    /// start time) is written after the name, so a name may be read without it: judged by
    /// the pid alone then ([`dead`]).
    fn claim(
        &self,
        at: &AtomicU64,
        ahead: u64,
        who: usize,
        start: usize,
        what: &str,
    ) -> Result<Option<u64>, ChannelError> {
        let mine = me();
        let mut blocked = 0u32;
        for _ in 0..SPIN_LIMIT {
            let pos = at.load(Ordering::SeqCst);
            let seq = self.word(pos, 0).load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos.wrapping_add(ahead)) as i64;
            if diff < 0 {
                return Ok(None);
            }
            if diff > 0 {
                std::hint::spin_loop();
                continue;
            }
            let name = self.word(pos, who);
            let held = name.load(Ordering::SeqCst);
            if held != 0 {
                if at.load(Ordering::SeqCst) != pos {
                    continue; // claimed meanwhile: the next position
                }
                // Another process between naming itself and moving `at`: a few
                // instructions, so look again a while before asking whether it lives (a
                // read of /proc); a live one stopped there is waited for as for a change.
                blocked += 1;
                if blocked < CLAIM_WAIT_LOOKS {
                    std::hint::spin_loop();
                    continue;
                }
                if !self.claimer_dead(pos, who, start) {
                    return Ok(None);
                }
                // Its claimer died before it moved `at`: take the claim over.
                if name
                    .compare_exchange(held, mine, Ordering::SeqCst, Ordering::SeqCst)
                    .is_err()
                {
                    continue;
                }
            } else if name
                .compare_exchange(0, mine, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            if at
                .compare_exchange(pos, pos.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                self.word(pos, start).store(my_start(), Ordering::SeqCst);
                return Ok(Some(pos));
            }
            // Another process moved `at` first (this cell is then a later position's, or
            // already claimed): the name goes, unless it is no longer ours to take back.
            let _ = name.compare_exchange(mine, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        // A racing process moves the position within a few tries; only a corrupt ring keeps
        // it behind cells that are already past it.
        Err(self.stuck(what))
    }

    fn write_cell<P>(&self, pos: u64, h: &Handle<P>, path: &[u8]) {
        // Who claimed it is named already (`claim`): a process that dies from here on is
        // found dead by a getter (`recover_get`).
        let meta = u64::from(h.kind) | (path.len() as u64) << 8;
        self.word(pos, 1).store(meta, Ordering::Relaxed);
        self.word(pos, 2).store(h.offset, Ordering::Relaxed);
        self.word(pos, 3).store(h.size, Ordering::Relaxed);
        self.word(pos, 4).store(h.generation, Ordering::Relaxed);
        for (i, part) in path.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..part.len()].copy_from_slice(part);
            self.word(pos, PATH_AT + i)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
    }

    /// Whether the handle put at `pos` has been taken by a get (its cell handed back).
    pub fn taken(&self, pos: u64) -> bool {
        let seq = self.word(pos, 0).load(Ordering::Acquire);
        seq.wrapping_sub(pos.wrapping_add(self.capacity)) as i64 >= 0
    }

    // --- get --------------------------------------------------------------------------------

    /// Claim the oldest handle; `Ok(None)` when the channel is empty. The cell stays claimed
    /// until [`Ring::release`] (the caller first takes its own hold on the object, so the
    /// putter never lets go of an object nobody holds).
    pub fn try_pop(&self) -> Result<Option<Claimed>, ChannelError> {
        let Some(pos) = self.claim(self.head(), 1, GETTER, GETTER_START, "get")? else {
            return Ok(None);
        };
        Ok(Some((pos, self.read_cell(pos))))
    }

    /// The handle in the cell at `pos`, checked; what is wrong with it otherwise.
    fn read_cell(&self, pos: u64) -> Result<Handle, String> {
        let meta = self.word(pos, 1).load(Ordering::Relaxed);
        let kind = (meta & 0xff) as u8;
        let len = ((meta >> 8) & 0xffff) as usize;
        if kind != CHUNK && kind != SEGMENT {
            return Err(format!("cell {pos}: unknown kind {kind}"));
        }
        if len == 0 || len > MAX_PATH {
            return Err(format!("cell {pos}: path of {len} bytes"));
        }
        let mut bytes = Vec::with_capacity(len.next_multiple_of(8));
        for i in 0..len.div_ceil(8) {
            bytes.extend_from_slice(
                &self
                    .word(pos, PATH_AT + i)
                    .load(Ordering::Relaxed)
                    .to_le_bytes(),
            );
        }
        bytes.truncate(len);
        let path = match String::from_utf8(bytes) {
            Ok(s) if s.starts_with('/') && !s.contains('\0') => PathBuf::from(s),
            _ => return Err(format!("cell {pos}: not an absolute path")),
        };
        Ok(Handle {
            kind,
            path,
            offset: self.word(pos, 2).load(Ordering::Relaxed),
            size: self.word(pos, 3).load(Ordering::Relaxed),
            generation: self.word(pos, 4).load(Ordering::Relaxed),
        })
    }

    /// Hand the cell at `pos` (claimed by [`Ring::try_pop`]) back to the putters.
    pub fn release(&self, pos: u64) {
        self.clear_claims(pos);
        self.word(pos, 0)
            .store(pos.wrapping_add(self.capacity), Ordering::Release);
        self.wake(AT_SEND_EPOCH, AT_SEND_WAITERS);
        self.note_cpu(AT_GET_CPU);
    }

    /// Say in the hint word at `at` which CPU this process runs on (written only when it
    /// changed: a word every put would write bounces between the cores' caches).
    fn note_cpu(&self, at: usize) {
        let word = self.u32_at(at);
        let cpu = this_cpu();
        if word.load(Ordering::Relaxed) != cpu {
            word.store(cpu, Ordering::Relaxed);
        }
    }

    /// Forget who claimed the cell at `pos` (both sides, and when they started).
    fn clear_claims(&self, pos: u64) {
        for w in [PUTTER, GETTER, PUTTER_START, GETTER_START] {
            self.word(pos, w).store(0, Ordering::SeqCst);
        }
    }

    /// Whether the claim of the cell at `pos` in words `who` and `start` is a dead
    /// process's (see [`dead`]). The claimer's name is read first: its start, stored before
    /// it, is then at least as new; and the name once more after the start, so that a start
    /// of a newer claim is never judged with an older name (a name that changed meanwhile
    /// is judged at the next look).
    fn claimer_dead(&self, pos: u64, who: usize, start: usize) -> bool {
        let name = self.word(pos, who).load(Ordering::SeqCst);
        let started = self.word(pos, start).load(Ordering::SeqCst);
        self.word(pos, who).load(Ordering::SeqCst) == name && dead(name, started)
    }

    // --- claims of dead processes -----------------------------------------------------------

    /// A getter that waited a while finds the oldest cell claimed by a put that never
    /// published it, by a process now dead (SIGKILLed between its claim and its publish):
    /// the cell is skipped (claimed and handed back empty), so the gets behind it go on.
    /// Whether it skipped one.
    pub fn recover_get(&self) -> bool {
        let pos = self.head().load(Ordering::SeqCst);
        let claimed = self.tail().load(Ordering::SeqCst).wrapping_sub(pos) as i64 > 0;
        let unpublished = self.word(pos, 0).load(Ordering::SeqCst) == pos;
        if !(claimed && unpublished && self.claimer_dead(pos, PUTTER, PUTTER_START)) {
            return false;
        }
        if self
            .head()
            .compare_exchange(pos, pos.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        log::warn!(
            "channel {}: skipped position {pos}, claimed by a put whose process died before \
             it wrote the object's handle",
            self.path.display()
        );
        self.release(pos);
        true
    }

    /// A putter that waited a while on a full channel finds the cell it needs claimed by a
    /// get of a process now dead (SIGKILLed between its claim and handing the cell back):
    /// the cell is handed back. The dead getter's hold on the object died with it; the
    /// putter's ends as for any object taken. Whether it handed one back.
    pub fn recover_put(&self) -> bool {
        let pos = self.tail().load(Ordering::SeqCst);
        let old = pos.wrapping_sub(self.capacity);
        let claimed = self.head().load(Ordering::SeqCst).wrapping_sub(old) as i64 > 0;
        let cell = self.word(old, 0);
        let published = cell.load(Ordering::SeqCst) == old.wrapping_add(1);
        if !(claimed && published && self.claimer_dead(old, GETTER, GETTER_START)) {
            return false;
        }
        self.clear_claims(old);
        if cell
            .compare_exchange(old.wrapping_add(1), pos, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        log::warn!(
            "channel {}: handed back position {old}, claimed by a get whose process died \
             before it was done",
            self.path.display()
        );
        self.wake(AT_SEND_EPOCH, AT_SEND_WAITERS);
        true
    }

    // --- waiting ----------------------------------------------------------------------------

    /// Wait until a handle may be there to get, at most one slice ([`MAX_SLEEP`]) and not
    /// past `deadline`. A whole slice with nothing: maybe a putter died before publishing
    /// ([`Ring::recover_get`]). `TimedOut` only once `deadline` has passed.
    pub fn wait_to_get(&self, deadline: Instant) -> Waited {
        let slice = deadline.min(Instant::now() + MAX_SLEEP);
        let waited = self.wait(AT_RECV_EPOCH, AT_RECV_WAITERS, AT_PUT_CPU, slice, || {
            self.may_claim(self.head(), 1, GETTER)
        });
        self.after_slice(waited, deadline, || self.recover_get())
    }

    /// Wait until a cell may be free to put into, as [`Ring::wait_to_get`]; a whole slice
    /// without room: maybe a getter died holding a cell ([`Ring::recover_put`]).
    pub fn wait_to_put(&self, deadline: Instant) -> Waited {
        let slice = deadline.min(Instant::now() + MAX_SLEEP);
        let waited = self.wait(AT_SEND_EPOCH, AT_SEND_WAITERS, AT_GET_CPU, slice, || {
            self.may_claim(self.tail(), 0, PUTTER)
        });
        self.after_slice(waited, deadline, || self.recover_put())
    }

    /// Whether a claim of the position `at` holds may succeed now ([`Ring::claim`]): its
    /// cell is ready and nobody is naming itself in it, or the cell is past it already
    /// (look again).
    fn may_claim(&self, at: &AtomicU64, ahead: u64, who: usize) -> bool {
        let pos = at.load(Ordering::SeqCst);
        let seq = self.word(pos, 0).load(Ordering::Acquire);
        match seq.wrapping_sub(pos.wrapping_add(ahead)) as i64 {
            d if d < 0 => false,
            0 => {
                self.word(pos, who).load(Ordering::SeqCst) == 0 || at.load(Ordering::SeqCst) != pos
            }
            _ => true,
        }
    }

    /// A slice that ended with nothing: `recover` a dead process's claim. `TimedOut` once
    /// `deadline` has passed and nothing was recovered, however the slice ended: a slice
    /// that keeps seeing the word move, or the cell look ready, while the caller still
    /// cannot take it must not hold a wait past its deadline.
    fn after_slice(&self, waited: Waited, deadline: Instant, recover: impl Fn() -> bool) -> Waited {
        let recovered = waited == Waited::TimedOut && recover();
        if !recovered && Instant::now() >= deadline {
            Waited::TimedOut
        } else {
            Waited::Again
        }
    }

    /// Look again in a short busy loop (pause instructions, for at most this process's
    /// current spin budget: the other side is usually a few microseconds away), then sleep
    /// on the futex word at `epoch`, having said so in `waiters`: the other side bumps the
    /// word after each change and makes the wake-up system call only when `waiters` says
    /// somebody sleeps. The word is read before `ready` is looked at the last time, so a
    /// change after that look makes the futex wait return at once: no wake-up is lost.
    ///
    /// The loop never yields the CPU (`sched_yield`): on a machine with more runnable
    /// threads than cores each yield hands a whole time slice to another thread, which
    /// made a round trip cost milliseconds; a sleeper on the futex, by contrast, is woken
    /// with the scheduler's preference for tasks that slept. The budget adapts
    /// ([`Ring::adapt`]): it grows while the other side answers just after the spin gave
    /// up, and shrinks while it answers much later (its process not running: spinning only
    /// takes a core it may need).
    ///
    /// No spin at all when the other side's last put or get (the hint word at `peer_cpu`)
    /// ran on the CPU this process runs on: the scheduler put both on one core, where the
    /// spin only keeps the answer from being made until it gives up, and the budget would
    /// grow on that (the answer comes just after every spin). Measured on 2 cores: a
    /// ping-pong whose processes the scheduler had placed on one core took 35-90 µs a round
    /// trip, against 12 µs on two.
    fn wait(
        &self,
        epoch: usize,
        waiters: usize,
        peer_cpu: usize,
        deadline: Instant,
        ready: impl Fn() -> bool,
    ) -> Waited {
        let start = Instant::now();
        let budget = Duration::from_nanos(u64::from(self.spin_ns.load(Ordering::Relaxed)));
        let cpu = this_cpu();
        let shared_core = cpu != 0 && self.u32_at(peer_cpu).load(Ordering::Relaxed) == cpu;
        if !shared_core && self.spin(start, budget, deadline, &ready) {
            return Waited::Again;
        }
        let word = self.u32_at(epoch);
        let count = self.u32_at(waiters);
        let seen = word.load(Ordering::SeqCst);
        count.fetch_add(1, Ordering::SeqCst);
        let outcome = if ready() {
            Waited::Again
        } else {
            let now = Instant::now();
            if now >= deadline {
                Waited::TimedOut
            } else {
                futex_wait(word, seen, (deadline - now).min(MAX_SLEEP));
                if Instant::now() >= deadline && !ready() {
                    Waited::TimedOut
                } else {
                    Waited::Again
                }
            }
        };
        count.fetch_sub(1, Ordering::SeqCst);
        if !shared_core {
            self.adapt(start.elapsed(), budget);
        }
        outcome
    }

    /// Look at `ready` in a busy loop of pause instructions until it holds (true), or until
    /// `budget` has passed since `start` or `deadline` has come (false).
    fn spin(
        &self,
        start: Instant,
        budget: Duration,
        deadline: Instant,
        ready: &impl Fn() -> bool,
    ) -> bool {
        #[cfg(test)]
        self.spun.fetch_add(1, Ordering::Relaxed);
        let mut looks = 0u32;
        loop {
            if ready() {
                return true;
            }
            looks = looks.wrapping_add(1);
            // The clock is read every few looks only (it costs more than a look).
            if looks % SPIN_CHECK == 0 {
                let spent = start.elapsed();
                if spent >= budget || looks >= SPIN_LOOKS_MAX || Instant::now() >= deadline {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// After a wait that had to sleep and took `waited` in all: a longer spin would have
    /// caught an answer that came within [`SPIN_MAX`], so the budget doubles; an answer
    /// that came later means the other side was not running, so it halves (within
    /// [`SPIN_MIN`]..=[`SPIN_MAX`]). The budget is this process's (not shared): a hostile
    /// peer can only make it spin less.
    fn adapt(&self, waited: Duration, budget: Duration) {
        let next = if waited <= SPIN_MAX {
            (budget * 2).min(SPIN_MAX)
        } else {
            (budget / 2).max(SPIN_MIN)
        };
        self.spin_ns
            .store(next.as_nanos() as u32, Ordering::Relaxed);
    }

    fn wake(&self, epoch: usize, waiters: usize) {
        let word = self.u32_at(epoch);
        word.fetch_add(1, Ordering::SeqCst);
        if self.u32_at(waiters).load(Ordering::SeqCst) != 0 {
            futex_wake(word);
        }
    }

    fn stuck(&self, what: &str) -> ChannelError {
        ChannelError::Corrupt {
            channel: name_of(&self.path),
            what: format!(
                "a {what} found the ring's positions inconsistent {SPIN_LIMIT} times in a row"
            ),
        }
    }
}

/// Looks of one put or get at a cell another process is naming itself in (between its name
/// and moving the position: a few instructions) before it asks whether that process lives
/// (and waits as for a change if so).
const CLAIM_WAIT_LOOKS: u32 = 256;
/// Tries of one put or get before the ring is called corrupt: a racing process moves the
/// position it contends for within a few tries; only a corrupt ring keeps a position behind
/// cells that are already past it.
const SPIN_LIMIT: u32 = 1 << 16;
/// The shortest and longest busy spin of a wait before it sleeps (see [`Ring::wait`]). The
/// longest covers the other side's usual answer on an idle machine (a Python round trip
/// of a few microseconds); a sleeper instead costs the other side a wake-up system call
/// and itself a scheduler round trip (together ~5-10 µs on the machines measured).
const SPIN_MIN: Duration = Duration::from_micros(1);
const SPIN_MAX: Duration = Duration::from_micros(50);
/// Where the spin budget starts.
const SPIN_START: Duration = Duration::from_micros(20);
/// Looks between two reads of the clock in a spin.
const SPIN_CHECK: u32 = 32;
/// Looks of one spin at most, whatever the clock says (a clock that stalls cannot make a
/// wait spin for ever).
const SPIN_LOOKS_MAX: u32 = 1 << 20;
/// The longest sleep of one wait: a caller waiting longer waits again (and meanwhile
/// notices a signal, or a peer that went away).
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Who this process is in a cell's claim words: its pid, and the low 32 bits of its pid
/// namespace's inode (pids of another namespace mean nothing here, see [`dead`]).
fn me() -> u64 {
    static NS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let ns =
        *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino() as u32));
    u64::from(crate::arena::pid()) | u64::from(ns) << 32
}

/// Bits of a start word ([`my_start`]) that hold the start time; the bits above hold the
/// time namespace.
const START_BITS: u32 = 40;
const START_MASK: u64 = (1 << START_BITS) - 1;

/// When this process started, as a claim's second word: its start time in clock ticks
/// after boot (`/proc/self/stat` field 22, which the kernel never gives two processes of
/// one pid at once: a pid used again names a process that started later) in the low 40
/// bits (at 100 ticks a second, 348 years), and the low 24 bits of its time namespace's
/// inode above them (a start time is given in the reading process's time namespace: read
/// from another, it cannot be compared). 0 if unknown (no /proc): the claim is then judged
/// by its pid alone. Cached per process (a put must not cost a file read); a forked child,
/// whose pid differs, reads its own.
fn my_start() -> u64 {
    static FOR_PID: AtomicU32 = AtomicU32::new(0);
    static START: AtomicU64 = AtomicU64::new(0);
    let pid = crate::arena::pid();
    if FOR_PID.load(Ordering::Acquire) == pid {
        return START.load(Ordering::Relaxed);
    }
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| start_time(&stat))
        .map_or(0, |t| (t & START_MASK) | time_ns() << START_BITS);
    START.store(start, Ordering::Relaxed);
    FOR_PID.store(pid, Ordering::Release);
    start
}

/// The low 24 bits of this process's time namespace's inode (0 without time namespaces).
fn time_ns() -> u64 {
    static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/time").map_or(0, |m| m.ino() & 0xff_ffff))
}

/// The start time (field 22) of a `/proc/<pid>/stat` line: "pid (comm) S ...", where the
/// fields from the state (field 3) on follow the last ')' (comm may hold any bytes).
fn start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether the process a claim names (`who`, see [`me`]; `start`, see [`my_start`]) is
/// certainly dead: a pid of this pid namespace that no process has any more, or a zombie,
/// or a process that started at another time than the claimer (its pid was used again, as
/// after the claimer was SIGKILLed and the system ran through its pids). A claim too young
/// to carry a name (0), another namespace's pid, or anything unsure (no start recorded, a
/// start read in another time namespace) counts as alive: a live claim must never be taken
/// over; at worst a dead one waits.
fn dead(who: u64, start: u64) -> bool {
    let (pid, ns) = (who as u32, (who >> 32) as u32);
    if pid == 0 || ns == 0 || ns != (me() >> 32) as u32 {
        return false;
    }
    let comparable = start != 0 && start >> START_BITS == time_ns();
    if pid == crate::arena::pid() {
        // This process's pid: its own claim, unless the claim started at another time (its
        // claimer died and the system gave its pid to this process).
        let mine = my_start();
        return comparable && mine != 0 && start != mine;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(e) => e.kind() == io::ErrorKind::NotFound,
        Ok(stat) => {
            let zombie = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|state| matches!(state, 'Z' | 'X'));
            let other = comparable
                && start_time(&stat).is_some_and(|t| t & START_MASK != start & START_MASK);
            zombie || other
        }
    }
}

/// The CPU this thread runs on, plus one (0 where the system cannot say): the value of the
/// hint words [`AT_PUT_CPU`] and [`AT_GET_CPU`].
fn this_cpu() -> u32 {
    // SAFETY: no arguments, no memory; -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).map_or(0, |c| c.wrapping_add(1))
}

/// Sleep until `word` is woken or no longer holds `seen`, at most `timeout`.
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT (shared: the word is in a file mapping other processes use) reads
    // the aligned 4-byte word, which lives as long as the borrow, and the timespec on our
    // stack. Its result needs no handling: every outcome (woken, changed, timed out,
    // interrupted) makes the caller look again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wake every process sleeping on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the word's address as a key; it is aligned and mapped.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests;
