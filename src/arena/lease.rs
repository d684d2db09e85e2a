//! Leases: OFD byte-range locks on a chunk's range of the file (see `format.rs`), and
//! [`Lease`], one chunk held by this process.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use super::file::*;
use crate::process::pid;

// --- OFD byte-range locks -------------------------------------------------------------------

#[derive(Clone, Copy)]
pub(super) enum Lock {
    Shared,
    Exclusive,
    Unlock,
}

/// Set an OFD lock on `[off, off + len)` of `fd` without waiting; `Ok(false)` when another
/// open file description holds a conflicting lock.
pub(super) fn ofd_lock(fd: &impl AsFd, kind: Lock, off: u64, len: u64) -> io::Result<bool> {
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

/// This process uses a chunk: a shared OFD lock on its range, released with the last
/// lease of the chunk in this process (or by the kernel when the process dies).
pub struct Lease {
    pub(super) arena: Arc<ArenaFile>,
    pub(super) offset: u64,
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
