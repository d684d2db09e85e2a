//! The supervising cleanup process, its client, and the orphan sweep (pure Rust, no pyo3).
//!
//! One supervisor per user listens on an abstract Unix socket (no file to leak; peers are
//! checked with SO_PEERCRED). Every process that creates or attaches a segment connects and
//! says `USE <path>`; the supervisor notices a client's death by its connection closing
//! (SIGKILL and the OOM killer included), and unlinks a segment once no client uses it and
//! `/proc` shows that no live process maps it or holds it open. Processes that map a segment
//! without being clients are "adopted": watched through pidfds, which pid reuse cannot fool.
//! If the supervisor itself dies, the next one sweeps orphans at start (see `sweep`).

pub mod client;
pub mod proto;
pub mod server;
pub mod sweep;

use std::path::PathBuf;

/// Abstract socket name of this user's supervisor (`SHMSTORE_SUPERVISOR_NAME` overrides it,
/// for isolated tests).
pub fn socket_name() -> String {
    match std::env::var("SHMSTORE_SUPERVISOR_NAME") {
        Ok(n) if !n.is_empty() => n,
        _ => format!(
            "shmstore-supervisor-{}",
            rustix::process::geteuid().as_raw()
        ),
    }
}

/// Private directory of this user's supervisor: its log lives here.
pub fn state_dir() -> PathBuf {
    let uid = rustix::process::geteuid().as_raw();
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("shmstore"),
        _ => std::env::temp_dir().join(format!("shmstore-{uid}")),
    }
}

/// The supervisor's log file.
pub fn log_path() -> PathBuf {
    state_dir().join(format!("{}.log", socket_name()))
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
