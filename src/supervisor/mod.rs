//! The supervising cleanup process, its client, and the orphan sweep (pure Rust, no pyo3).
//!
//! One supervisor per user listens on a Unix socket in this user's private state directory
//! (created 0700 and verified, see [`state_dir`]): other users cannot bind it first
//! (squat), connect to it, or plant anything there; both ends check the peer's uid with
//! `SO_PEERCRED`. A `flock` on a lock file next to it elects the one supervisor. Every
//! process that creates a segment says `NEW <path>`, every one that attaches says
//! `USE <path>`; the supervisor notices a client's death by its connection closing
//! (SIGKILL and the OOM killer included), and unlinks a segment once no client uses it and
//! `/proc` shows that no live process maps it or holds it open. Processes that map a segment
//! without being clients are "adopted": watched through pidfds, which pid reuse cannot fool.
//! If the supervisor itself dies, the next one sweeps orphans at start (see `sweep`). Only
//! files shmstore's writer made, in segment directories, are ever removed
//! ([`sweep::is_segment`]).

pub mod client;
pub mod proto;
pub mod server;
pub mod sweep;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use crate::segment::{private_dir, PrivateDir, SegmentError};

/// Name of this user's supervisor (`SHMSTORE_SUPERVISOR_NAME` overrides it, for isolated
/// tests): its socket is `<name>.sock`, its lock `<name>.lock` and its log `<name>.log` in
/// the state directory.
pub fn socket_name() -> String {
    match std::env::var("SHMSTORE_SUPERVISOR_NAME") {
        Ok(n) if !n.is_empty() => n,
        _ => format!(
            "shmstore-supervisor-{}",
            rustix::process::geteuid().as_raw()
        ),
    }
}

/// Where this user's supervisor keeps its socket, lock and log:
/// `$XDG_RUNTIME_DIR/shmstore`, else `$TMPDIR/shmstore-<uid>` (`/tmp/shmstore-<uid>`).
pub fn state_dir_path() -> PathBuf {
    let uid = rustix::process::geteuid().as_raw();
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("shmstore"),
        _ => std::env::temp_dir().join(format!("shmstore-{uid}")),
    }
}

/// The state directory, created (0700) if missing, opened and verified: owned by this
/// user, not writable by anyone else, not a symlink. A directory another user made first
/// is refused (with the reason), never trusted.
pub fn state_dir() -> Result<PrivateDir, SegmentError> {
    private_dir(&state_dir_path(), true)
}

/// The supervisor's log file (rotated to `<name>.log.1` past [`server::LOG_MAX`] bytes).
pub fn log_path() -> PathBuf {
    state_dir_path().join(format!("{}.log", socket_name()))
}

/// Detach from the caller: fork once (the parent returns `false` and should exit at once),
/// and in the child start a new session (no controlling terminal: Ctrl-C in the terminal
/// that started us never reaches us) and return `true`. Call only while single-threaded.
pub fn daemonize() -> std::io::Result<bool> {
    // SAFETY: called by the supervisor process right after start-up, before it creates any
    // thread, so the child is a complete copy of a single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid > 0 {
        return Ok(false);
    }
    // SAFETY: setsid has no memory-safety preconditions; it fails only if we already lead
    // a process group, which a freshly forked child never does.
    unsafe { libc::setsid() };
    let _ = std::env::set_current_dir("/");
    Ok(true)
}
