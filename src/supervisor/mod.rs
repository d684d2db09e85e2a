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

/// Where this user's supervisor keeps its socket, lock and log: `$XDG_RUNTIME_DIR/shmstore`,
/// else `$TMPDIR/shmstore-<uid>` (`/tmp/shmstore-<uid>`) unless another user owns that path
/// (planted before this user's first run: in a sticky `/tmp` this user can neither use nor
/// remove it), then `$HOME/.cache/shmstore/run-<host>`, which no one else can create. Once
/// that one exists it is kept (the planter may remove its directory later: this user's
/// processes must not split between two supervisors). Every user of the state directory
/// (supervisor, its clients, `Channel`, `shmstore gc`) asks this function, so all agree.
pub fn state_dir_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("shmstore"),
        _ => {
            let uid = rustix::process::geteuid().as_raw();
            let tmp = std::env::temp_dir().join(format!("shmstore-{uid}"));
            let Some(home) = home_state_dir(uid) else {
                return tmp;
            };
            if rustix::fs::lstat(&home).is_ok_and(|st| st.st_uid == uid) {
                return home;
            }
            match rustix::fs::lstat(&tmp) {
                Ok(st) if st.st_uid != uid => home,
                _ => tmp,
            }
        }
    }
}

/// `$HOME/.cache/shmstore/run-<host>` (the host name keeps machines that share a network home
/// apart), if `$HOME` (else the password database's home) is a directory this user owns.
fn home_state_dir(uid: u32) -> Option<PathBuf> {
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| passwd_home(uid))?;
    if !home.is_absolute() || !rustix::fs::stat(&home).is_ok_and(|st| st.st_uid == uid) {
        return None;
    }
    let mut host = [0u8; 256];
    // SAFETY: gethostname writes at most `host.len()` bytes into the buffer we own.
    let r = unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len() - 1) };
    let host = if r == 0 {
        let n = host.iter().position(|&b| b == 0).unwrap_or(0);
        String::from_utf8_lossy(&host[..n]).replace('/', "_")
    } else {
        "localhost".to_owned()
    };
    Some(home.join(".cache/shmstore").join(format!("run-{host}")))
}

/// The home directory of `uid` in the password database.
fn passwd_home(uid: u32) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0u8; 16384];
    // SAFETY: an all-zero passwd is a valid value of this plain C struct.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is to memory we own, of the sizes given; getpwuid_r fills `pw`
    // with pointers into `buf`, which outlives their use below.
    let r = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out) };
    if r != 0 || out.is_null() || pw.pw_dir.is_null() {
        return None;
    }
    // SAFETY: pw_dir points to a NUL-terminated string inside `buf`.
    let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())))
}

/// The state directory, created (0700) if missing, opened and verified: owned by this
/// user, not writable by anyone else, not a symlink. A directory another user made first
/// is refused (with the reason), never trusted; in `/tmp` it sends this user to the
/// directory under `$HOME` instead (see [`state_dir_path`]), said once per process.
pub fn state_dir() -> Result<PrivateDir, SegmentError> {
    let path = state_dir_path();
    if std::env::var_os("XDG_RUNTIME_DIR").is_none_or(|d| d.is_empty())
        && !path.starts_with(std::env::temp_dir())
    {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::warn!(
                "XDG_RUNTIME_DIR is not set and {} is (or was) another user's: this user's \
                 supervisor keeps its state in {} instead",
                std::env::temp_dir()
                    .join(format!("shmstore-{}", rustix::process::geteuid().as_raw()))
                    .display(),
                path.display()
            )
        });
    }
    private_dir(&path, true)
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
