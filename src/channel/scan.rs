//! Reading a channel file from outside (the supervisor's orphan sweep), without mapping it
//! and without trusting a byte: which files are channels whose header was overwritten, and
//! which objects a channel still holds (docs/channel.md, "Lifetime").
//!
//! Everything is read with `pread` through a descriptor opened `O_NOFOLLOW|O_NONBLOCK` and
//! checked with `fstat` (a regular file of this user, mode 0600): a plain copy of the bytes,
//! so another process writing the file meanwhile makes at worst a wrong answer, never a data
//! race. Reads are bounded by the size a channel of at most [`MAX_CAPACITY`] cells has.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::{
    CELL, CELL_WORDS, CHUNK, HEADER, MAGIC, MAX_CAPACITY, MAX_PATH, PATH_AT, SEGMENT, VERSION,
};

/// Open `path` for reading as a channel of ours could be: a regular file of this user of
/// mode 0600 (no symlink followed, never blocking); with its size.
fn open_ours(path: &Path) -> Option<(File, u64)> {
    let file = crate::segment::open_read_nofollow(path).ok()?;
    let meta = file.metadata().ok()?;
    let ours = meta.is_file()
        && meta.uid() == rustix::process::geteuid().as_raw()
        && meta.mode() & 0o7777 == 0o600;
    ours.then_some((file, meta.len()))
}

/// The capacity a channel file of `len` bytes has: `HEADER + capacity * CELL` with a
/// capacity that is a power of two from 2 to [`MAX_CAPACITY`].
fn capacity_for(len: u64) -> Option<u64> {
    let cells = len.checked_sub(HEADER)?;
    let cap = cells / CELL;
    (cells % CELL == 0 && cap.is_power_of_two() && (2..=MAX_CAPACITY).contains(&cap)).then_some(cap)
}

/// Call `f(index, cell bytes)` for every cell of the file (read 1 MiB at a time); false if a
/// read came short.
fn each_cell(file: &File, cap: u64, mut f: impl FnMut(u64, &[u8])) -> bool {
    const BATCH: u64 = 4096; // cells per read: 1 MiB
    let mut buf = vec![0u8; (BATCH * CELL) as usize];
    let mut first = 0u64;
    while first < cap {
        let n = (cap - first).min(BATCH);
        let bytes = &mut buf[..(n * CELL) as usize];
        if file.read_exact_at(bytes, HEADER + first * CELL).is_err() {
            return false;
        }
        for (i, cell) in bytes.chunks_exact(CELL as usize).enumerate() {
            f(first + i as u64, cell);
        }
        first += n;
    }
    true
}

fn word(cell: &[u8], w: usize) -> u64 {
    let at = (w % CELL_WORDS) * 8;
    u64::from_le_bytes(cell[at..at + 8].try_into().unwrap_or_default())
}

/// Whether the file at `path` is a channel of ours whose header was overwritten (by a bug,
/// or by a process of this user): mode 0600, a channel's size, no archive, arena or channel
/// magic at its start, and a ring's shape in its cells — every cell's sequence word is its
/// index or one past it (modulo the capacity: free, or published), and all sequences lie
/// within twice the capacity of each other (they follow the ring's positions). The name
/// (ours, `shmstore-` and 32 hex digits) is the caller's to check; `ident` (device, inode)
/// is the file the caller looked at: another one under the name now is not judged.
pub fn is_headless_channel(path: &Path, ident: (u64, u64)) -> bool {
    let Some((file, len)) = open_ours(path) else {
        return false;
    };
    if file.metadata().map(|m| (m.dev(), m.ino())).ok() != Some(ident) {
        return false;
    }
    let Some(cap) = capacity_for(len) else {
        return false;
    };
    let mut head = [0u8; 8];
    if file.read_exact_at(&mut head, 0).is_err() || magic_kind(&head).is_some() {
        return false;
    }
    let (mut ok, mut lo, mut hi) = (true, u64::MAX, 0u64);
    let read = each_cell(&file, cap, |i, cell| {
        let seq = word(cell, 0);
        let at = seq & (cap - 1);
        ok &= at == i || seq.wrapping_sub(1) & (cap - 1) == i;
        let meta = word(cell, 1);
        ok &= (meta & 0xff) as u8 <= SEGMENT && ((meta >> 8) & 0xffff) as usize <= MAX_PATH;
        lo = lo.min(seq);
        hi = hi.max(seq);
    });
    read && ok && hi - lo <= 2 * cap
}

/// Whether the file at `path` is a channel of ours, from its magic (read without following
/// a link or blocking): `Some(true)` a channel; `Some(false)` an archive (sealed or being
/// written) or an arena, which it stays under this name; `None` not known yet (no magic
/// yet, unreadable, or not ours), to be asked again later.
pub fn channel_magic(path: &Path) -> Option<bool> {
    let (file, _) = open_ours(path)?;
    let mut head = [0u8; 8];
    file.read_exact_at(&mut head, 0).ok()?;
    magic_kind(&head)
}

/// What the first 8 bytes of a file of ours say: `Some(true)` a channel, `Some(false)` an
/// archive (sealed or being written) or an arena, `None` none of our magics.
fn magic_kind(head: &[u8; 8]) -> Option<bool> {
    if head == MAGIC {
        Some(true)
    } else if *head == crate::archive::header::MAGIC
        || *head == crate::archive::header::UNSEALED_MAGIC
        || head == crate::arena::MAGIC
    {
        Some(false)
    } else {
        None
    }
}

/// The paths of the objects the channel at `path` still holds: every cell published and not
/// yet handed back (waiting for a get, or claimed by a getter that has not released it),
/// whose handle is an absolute path. Empty if the file is not a channel of ours with a
/// valid header. What a cell says is only a claim: the caller keeps such files at most as
/// long as the channel is in use, and removes nothing because of it.
pub fn held_paths(path: &Path) -> Vec<PathBuf> {
    let Some((file, len)) = open_ours(path) else {
        return Vec::new();
    };
    let mut head = [0u8; 24];
    if file.read_exact_at(&mut head, 0).is_err() || &head[..8] != MAGIC {
        return Vec::new();
    }
    let cap = u64::from_le_bytes(head[16..24].try_into().unwrap_or_default());
    if capacity_for(len) != Some(cap) {
        return Vec::new();
    }
    // Where a cell's path starts in this file's layout: a channel made by an earlier
    // version (1: no start words, the path at word 7) may still be in use by its processes.
    let path_at = match u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) {
        1 => 7,
        2 | VERSION => PATH_AT,
        _ => return Vec::new(),
    };
    let max_path = (CELL_WORDS - path_at) * 8;
    let mut out = Vec::new();
    each_cell(&file, cap, |i, cell| {
        let seq = word(cell, 0);
        if seq == 0 || seq.wrapping_sub(1) & (cap - 1) != i {
            return; // free (or claimed by a put not yet published)
        }
        let meta = word(cell, 1);
        let (kind, n) = ((meta & 0xff) as u8, ((meta >> 8) & 0xffff) as usize);
        if !(kind == CHUNK || kind == SEGMENT) || n == 0 || n > max_path {
            return;
        }
        let at = path_at * 8;
        match std::str::from_utf8(&cell[at..at + n]) {
            Ok(s) if s.starts_with('/') && !s.contains('\0') => out.push(PathBuf::from(s)),
            _ => {}
        }
    });
    out.sort();
    out.dedup();
    out
}
