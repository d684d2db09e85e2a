//! The client side: every process that creates or attaches a segment tells the supervisor,
//! starting it if none is running.
//!
//! Never a stall: every conversation has a short deadline ([`timeout`], 0.5 s by default;
//! the connect is non-blocking too, so a full listen backlog cannot block it). A supervisor
//! that is stopped (SIGSTOP, a debugger: `/proc/PID/stat`, looked at after [`STOPPED_CHECK`]
//! without an answer, or through the pid in its lock file while the backlog is full) is
//! given up on at once, one that is running but busy gets [`BUSY_FACTOR`] times the
//! deadline in all; given up, it is
//! not tried again for [`BACKOFF`] (the caller goes on unsupervised and says so once).
//! Callers wait with the GIL released. Dropping a registration does no
//! I/O at all: the `DROP` is queued and a background thread sends queued DROPs in batches
//! (ten thousand handles released at once are one batch and one /proc scan in the
//! supervisor).
//!
//! Fork safety: the two locks (`IO`: the conversation, `STATE`: the bookkeeping, taken in
//! that order, never while logging or calling Python) are taken by a fork hook
//! (`crate::process`: after the arenas' locks, before the owned names') and released in
//! the parent and the child, so a fork in the middle of another thread's round trip
//! waits for it to finish (at most the deadline) instead of leaving the child a lock that
//! no thread will ever release. A forked child notices the pid change and opens its own
//! connection (keeping the inherited one open, so its parent's segments stay registered
//! while the child, which maps them too, is alive).
//!
//! The files: this one has the settings, [`Unavailable`] and the process's registrations
//! and locks (with their fork hooks); `connection.rs` a connection and its conversation,
//! connecting, and the one-off queries (`list`, `supervisor_pid`); `spawn.rs` starting a
//! supervisor and the signal-free background threads; `registration.rs` the API the
//! stores use (`use_segment`, `pin_segment`, `drop_segment`, `prepare`, ...) and the DROP
//! sender.

mod connection;
mod registration;
mod spawn;

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use crate::process::{self, ForkHooks, ForkLock};
use crate::segment::PrivateDir;
use crate::supervisor::proto::{parse_end, parse_seg, Request, SegmentUse};

/// How to start a supervisor process (set by the Python layer: the interpreter and the
/// code that calls `_supervisor_main`).
#[derive(Debug, Clone)]
pub struct SpawnCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

static SPAWN: OnceLock<SpawnCommand> = OnceLock::new();

pub fn set_spawn_command(cmd: SpawnCommand) {
    let _ = SPAWN.set(cmd);
}

/// `SHMSTORE_SUPERVISOR=0` turns the supervisor off (the creator then unlinks its own
/// segments when it stops using them, and at exit).
pub fn enabled() -> bool {
    !matches!(
        std::env::var("SHMSTORE_SUPERVISOR").as_deref(),
        Ok("0") | Ok("off")
    )
}

/// Deadline of one conversation with a running supervisor (connect + round trip):
/// `SHMSTORE_SUPERVISOR_TIMEOUT` seconds, default 0.5.
pub fn timeout() -> Duration {
    std::env::var("SHMSTORE_SUPERVISOR_TIMEOUT")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(|s| Duration::from_secs_f64(s.min(3600.0)))
        .unwrap_or(Duration::from_millis(500))
}

/// A supervisor that misses the deadline but is running (not stopped: busy, on a loaded
/// machine) gets this many times the deadline in all before it is given up on.
const BUSY_FACTOR: u32 = 10;

/// How long a reply is awaited before checking whether the supervisor is stopped.
const STOPPED_CHECK: Duration = Duration::from_millis(50);

/// Whether process `pid` is stopped (SIGSTOP, a debugger): its answer will not come.
fn stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) state ...": comm may contain spaces and parentheses; the state follows
    // the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some("T" | "t"))
}

/// How long a supervisor that just started may take to answer (a fresh interpreter).
const SPAWN_WAIT: Duration = Duration::from_secs(10);
/// After a supervisor missed a deadline, don't try again for this long.
pub const BACKOFF: Duration = Duration::from_secs(5);
/// Requests written before their replies are read.
const BATCH: usize = 512;
/// Bytes of paths per `DROP` line (under the server's line limit, 4 MiB, with room for one
/// more path of at most 4 KiB).
const DROP_LINE_BYTES: usize = 1 << 20;

/// Why there is no supervisor to talk to.
#[derive(Debug)]
pub enum Unavailable {
    Disabled,
    /// None is running (nothing listens on the socket).
    NotRunning(io::Error),
    /// One may be running but did not answer in time (stopped, overloaded): given up.
    NoAnswer(String),
    /// The state directory is not safe to use (see `segment::private_dir`).
    UnsafeDir(String),
    Other(String),
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::Disabled => {
                write!(f, "the supervisor is disabled (SHMSTORE_SUPERVISOR=0)")
            }
            Unavailable::NotRunning(e) => write!(
                f,
                "no supervisor is running and none could be started ({e})"
            ),
            Unavailable::NoAnswer(m) => write!(
                f,
                "{m}; if it is stopped (SIGSTOP, a debugger) resume it, or kill it and the next \
                 shmstore call starts a new one (SHMSTORE_SUPERVISOR_TIMEOUT sets the deadline)"
            ),
            Unavailable::UnsafeDir(m) => write!(f, "{m}"),
            Unavailable::Other(m) => write!(f, "{m}"),
        }
    }
}

impl From<Unavailable> for io::Error {
    fn from(u: Unavailable) -> io::Error {
        let kind = match &u {
            Unavailable::NoAnswer(_) => io::ErrorKind::TimedOut,
            Unavailable::UnsafeDir(_) => io::ErrorKind::PermissionDenied,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, u.to_string())
    }
}

pub(crate) use connection::*;
pub use registration::*;
use spawn::*;

/// One registration in this process.
#[derive(Default, Clone, Copy)]
struct Use {
    /// Live stores using it.
    count: usize,
    /// This process creates the segment (registered with `NEW`).
    created: bool,
    /// The supervisor refused its USE (answered after the attach returned, see
    /// [`use_segment_nowait`]): not registered, never registered again, no DROP.
    refused: bool,
}

/// The conversation (lock order: `IO` before `STATE`).
struct Io {
    conn: Option<Conn>,
    /// The process the connection belongs to (a forked child inherits it, never uses it).
    pid: u32,
}

#[derive(Default)]
struct State {
    uses: HashMap<PathBuf, Use>,
    /// DROPs not sent yet.
    drops: HashSet<PathBuf>,
    /// The process whose thread sends DROPs (0: none; a forked child has no such thread).
    sender: u32,
    /// No conversation is tried before this (a supervisor missed a deadline), and why.
    backoff: Option<(Instant, String)>,
    /// Why the supervisor is not covering a segment this process attached without waiting,
    /// learnt after the attach returned: said once by the next attach (see [`take_late`]).
    late: Option<String>,
    /// (holder, path) pins the supervisor accepted ([`pin_segment`]): each sent once, and
    /// again on every new connection. Never forgotten (a pin outlives this process's use of
    /// its holder: another process may still use it).
    pins: HashSet<(PathBuf, PathBuf)>,
}

static IO: Mutex<Io> = Mutex::new(Io { conn: None, pid: 0 });
static WAKE: Condvar = Condvar::new();

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(Default::default)
}

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// Both locks, held by the forking thread from `prepare` to `parent`/`child`.
    static HELD: RefCell<Option<(MutexGuard<'static, Io>, MutexGuard<'static, State>)>> =
        const { RefCell::new(None) };
}

fn before_fork() {
    let io = lock(&IO);
    let st = lock(state());
    HELD.with(|h| *h.borrow_mut() = Some((io, st)));
}

fn after_fork_parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

fn after_fork_child() {
    HELD.with(|h| {
        if let Some((mut io, mut st)) = h.borrow_mut().take() {
            // The parent owns that conversation: keep the socket open, never use it.
            std::mem::forget(io.conn.take());
            io.pid = 0;
            st.drops.clear(); // never registered by this process
            st.late = None;
            st.sender = 0;
        }
    });
}

/// Register the fork hooks of `IO` and `STATE` ([`ForkLock::SupervisorClient`], see
/// `crate::process`).
fn install_fork_handlers() {
    // The hooks are plain functions that lock and unlock process-global mutexes (no
    // allocation in `before_fork` besides what `Mutex::lock` does, no Python, no I/O) and
    // never unwind: `lock` recovers from poisoning.
    process::on_fork(
        ForkLock::SupervisorClient,
        ForkHooks {
            before: before_fork,
            after_parent: after_fork_parent,
            after_child: after_fork_child,
        },
    );
}
