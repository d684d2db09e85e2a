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
//! the parent and the child, so a fork in the middle of another thread's round trip waits for it to finish (at most the deadline) instead of
//! leaving the child a lock that no thread will ever release. A forked child notices the
//! pid change and opens its own connection (keeping the inherited one open, so its
//! parent's segments stay registered while the child, which maps them too, is alive).

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

use super::proto::{parse_end, parse_seg, Request, SegmentUse};
use crate::process::{self, ForkHooks, ForkLock};
use crate::segment::PrivateDir;

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

/// A connection to the supervisor. The socket stays non-blocking: every wait is a `poll`
/// with a deadline, and a request can be written without waiting for its reply.
struct Conn {
    sock: UnixStream,
    /// Bytes received and not yet taken as lines.
    buf: Vec<u8>,
    supervisor: u32,
    /// Requests written whose replies are not read yet, oldest first (see [`Pending`]).
    pending: VecDeque<Pending>,
    /// The supervisor closed the connection (after what is in `buf`).
    eof: bool,
    /// Opened at import ([`prepare`]) for the supervisor in this state directory with this
    /// name, and not used since (see [`own_conn`]).
    prepared: Option<(PathBuf, String)>,
}

/// A request whose reply is read later: the HELLO of a connection opened at import, or a
/// USE written by an attach that did not wait (see [`use_segment_nowait`]).
struct Pending {
    /// The segment of a USE (`None`: a HELLO).
    path: Option<PathBuf>,
    sent: Instant,
}

/// Replies left unread before the next conversation reads them all.
const MAX_PENDING: usize = 64;

impl Conn {
    fn new(sock: UnixStream, supervisor: u32) -> Self {
        Conn {
            sock,
            buf: Vec::new(),
            supervisor,
            pending: VecDeque::new(),
            eof: false,
            prepared: None,
        }
    }

    /// Wait until the socket is ready for `events`, at most until `until`: false if it is
    /// not by then.
    fn wait(&self, events: PollFlags, until: Instant) -> io::Result<bool> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let ts = Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as _,
            };
            let mut fds = [PollFd::new(&self.sock, events)];
            match rustix::event::poll(&mut fds, Some(&ts)) {
                Ok(0) => continue, // re-check the clock
                Ok(_) => return Ok(true),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Write all of `bytes` by `deadline`.
    fn send_all(&mut self, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
        while !bytes.is_empty() {
            match self.sock.write(bytes) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.wait(PollFlags::OUT, deadline)? {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Read what has arrived, without waiting. An error if the supervisor closed the
    /// connection and nothing came before.
    fn fill(&mut self) -> io::Result<()> {
        let closed = || {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the supervisor closed the connection",
            )
        };
        if self.eof {
            return Err(closed());
        }
        let mut chunk = [0u8; 4096];
        let mut got = false;
        // Bounded: what a supervisor sends is never more than the replies asked for.
        for _ in 0..1024 {
            match self.sock.read(&mut chunk) {
                Ok(0) if got => {
                    self.eof = true; // said by the next call, after these lines are taken
                    return Ok(());
                }
                Ok(0) => return Err(closed()),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    got = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A complete line received already, without its newline.
    fn take_line(&mut self) -> Option<String> {
        let nl = self.buf.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.buf.drain(..=nl).collect();
        Some(String::from_utf8_lossy(&line[..nl]).trim_end().to_owned())
    }

    /// One line by `until` (`TimedOut` if none).
    fn line_by(&mut self, until: Instant) -> io::Result<String> {
        loop {
            if let Some(line) = self.take_line() {
                return Ok(line);
            }
            if !self.wait(PollFlags::IN, until)? {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
            }
            self.fill()?;
        }
    }

    /// Send `reqs` (at most [`BATCH`] at once), then read one `OK` each, by `deadline`
    /// (after the replies still pending).
    fn requests(&mut self, reqs: &[Request], deadline: Instant) -> io::Result<()> {
        for reply in self.exchange(reqs, deadline)? {
            if !reply.starts_with("OK") {
                return Err(io::Error::other(format!("the supervisor said {reply:?}")));
            }
        }
        Ok(())
    }

    /// Send `reqs` (at most [`BATCH`] at once) and read one reply each, whatever it says,
    /// by `deadline` (after the replies still pending).
    fn exchange(&mut self, reqs: &[Request], deadline: Instant) -> io::Result<Vec<String>> {
        self.settle(deadline)?;
        let mut replies = Vec::with_capacity(reqs.len());
        for chunk in reqs.chunks(BATCH) {
            let text: String = chunk.iter().map(Request::encode).collect();
            self.send_all(text.as_bytes(), deadline)?;
            for _ in chunk {
                replies.push(self.reply(deadline)?);
            }
        }
        Ok(replies)
    }

    /// Read every pending reply (waiting as [`Conn::reply`] does).
    fn settle(&mut self, deadline: Instant) -> io::Result<()> {
        while !self.pending.is_empty() {
            let reply = self.reply(deadline)?;
            self.answered(&reply)?;
        }
        Ok(())
    }

    /// Take the pending replies that have arrived, without waiting.
    fn poll_pending(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.fill()?;
        while !self.pending.is_empty() {
            let Some(reply) = self.take_line() else {
                break;
            };
            self.answered(&reply)?;
        }
        Ok(())
    }

    /// The oldest pending request is answered with `reply`. A refused HELLO is an error (the
    /// connection is not usable); a refused USE leaves that segment unregistered
    /// ([`refused`]).
    fn answered(&mut self, reply: &str) -> io::Result<()> {
        let Some(p) = self.pending.pop_front() else {
            return Ok(());
        };
        match p.path {
            Some(_) if reply.starts_with("OK") => Ok(()),
            Some(path) => {
                refused(path, reply);
                Ok(())
            }
            None if reply.starts_with("OK") => Ok(()),
            None => Err(io::Error::other(format!("the supervisor said {reply:?}"))),
        }
    }

    /// Read one reply line by `deadline`; past it, wait on (up to [`BUSY_FACTOR`] times as
    /// long) only if the supervisor is running but busy, never if it is stopped.
    fn reply(&mut self, deadline: Instant) -> io::Result<String> {
        // A first short wait: a stopped supervisor is recognised then, without waiting for
        // the whole deadline.
        let mut until = deadline.min(Instant::now() + STOPPED_CHECK);
        let hard = deadline + timeout() * (BUSY_FACTOR - 1);
        loop {
            match self.line_by(until) {
                Err(e) if is_timeout(&e) && until < hard && !stopped(self.supervisor) => {
                    until = if until < deadline { deadline } else { hard };
                }
                r => return r,
            }
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// Open a connection to the supervisor named `name` whose socket is in `dir` and check it
/// is ours (`SO_PEERCRED`), by `deadline`; nothing is said yet.
fn open_conn(dir: &PrivateDir, name: &str, deadline: Instant) -> Result<Conn, Unavailable> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let path =
        super::server::socket_path(dir, name).map_err(|e| Unavailable::Other(e.to_string()))?;
    let addr = SocketAddrUnix::new(&path).map_err(|e| Unavailable::Other(e.to_string()))?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Unavailable::Other(format!("socket: {e}")))?;
    loop {
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => break,
            Err(rustix::io::Errno::INTR) => continue,
            // The listen backlog is full: it is running but not accepting.
            Err(rustix::io::Errno::AGAIN) => {
                let holder = lock_holder(dir, name);
                if Instant::now() >= deadline || holder.is_some_and(stopped) {
                    return Err(Unavailable::NoAnswer(format!(
                        "the supervisor at {} does not accept connections (backlog full)",
                        dir.path.join(format!("{name}.sock")).display()
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e @ (rustix::io::Errno::NOENT | rustix::io::Errno::CONNREFUSED)) => {
                return Err(Unavailable::NotRunning(e.into()))
            }
            Err(e) => return Err(Unavailable::Other(format!("connect: {e}"))),
        }
    }
    let stream = UnixStream::from(fd);
    let cred = rustix::net::sockopt::socket_peercred(&stream)
        .map_err(|e| Unavailable::Other(e.to_string()))?;
    if cred.uid != rustix::process::geteuid() {
        return Err(Unavailable::Other(format!(
            "the supervisor socket belongs to uid {}",
            cred.uid.as_raw()
        )));
    }
    Ok(Conn::new(stream, cred.pid.as_raw_nonzero().get() as u32))
}

/// Connect to the supervisor named `name` whose socket is in `dir`, check it is ours
/// (`SO_PEERCRED`), and say HELLO, all by `deadline`. `first`: requests sent in the same
/// write as the HELLO (at most [`BATCH`]), each answered OK before this returns: one round
/// trip for a process's first registration, not two.
fn connect_in(
    dir: &PrivateDir,
    name: &str,
    deadline: Instant,
    first: &[Request],
) -> Result<Conn, Unavailable> {
    let mut conn = open_conn(dir, name, deadline)?;
    let first = &first[..first.len().min(BATCH)];
    let hello = (|| {
        let mut text = Request::Hello(std::process::id()).encode();
        text.extend(first.iter().map(Request::encode));
        conn.send_all(text.as_bytes(), deadline)?;
        conn.reply(deadline)
    })();
    match hello {
        Ok(r) if r.starts_with("OK") => {}
        Ok(r) => return Err(Unavailable::Other(format!("the supervisor said {r:?}"))),
        Err(e) if is_timeout(&e) => return Err(no_answer(conn.supervisor)),
        Err(e) => return Err(Unavailable::NotRunning(e)),
    }
    for _ in first {
        match conn.reply(deadline) {
            Ok(r) if r.starts_with("OK") => {}
            Ok(r) => return Err(Unavailable::Other(format!("the supervisor said {r:?}"))),
            Err(e) if is_timeout(&e) => return Err(no_answer(conn.supervisor)),
            Err(e) => return Err(Unavailable::NotRunning(e)),
        }
    }
    Ok(conn)
}

/// The pid the supervisor wrote into its lock file (see `server::bind`).
fn lock_holder(dir: &PrivateDir, name: &str) -> Option<u32> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::openat(
        &dir.fd,
        format!("{name}.lock"),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let mut buf = [0u8; 16];
    let n = rustix::io::read(&fd, &mut buf).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

fn no_answer(pid: u32) -> Unavailable {
    Unavailable::NoAnswer(format!("the supervisor (pid {pid}) did not answer in time"))
}

fn connect(deadline: Instant, first: &[Request]) -> Result<Conn, Unavailable> {
    let dir = super::state_dir().map_err(|e| Unavailable::UnsafeDir(e.to_string()))?;
    connect_in(&dir, &super::socket_name(), deadline, first)
}

/// Mark every descriptor above stderr close-on-exec, so that the supervisor (which outlives
/// the process that starts it) holds none of its starter's files, pipes or sockets. Without
/// this it kept, for example, the write end of multiprocessing's forkserver "alive" pipe
/// that a forkserver child receives without close-on-exec: the forkserver never saw EOF and
/// never exited while the supervisor ran.
fn inherit_no_descriptors() -> io::Result<()> {
    // SAFETY: close_range only changes descriptor flags; CLOSE_RANGE_CLOEXEC (Linux >= 5.11)
    // marks instead of closing, so the pipe Command uses to report exec errors still works.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return Ok(());
    }
    // Older kernels: every descriptor number below the soft limit (bounded).
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let max = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(1 << 20) as libc::c_int
    } else {
        1024
    };
    for fd in 3..max {
        // SAFETY: fcntl on a number that may not be an open descriptor just fails (EBADF).
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

fn spawn_supervisor() -> Result<(), Unavailable> {
    let cmd = SPAWN
        .get()
        .ok_or_else(|| Unavailable::Other("no way to start a supervisor was configured".into()))?;
    // The started process forks once and exits (the real supervisor is its child, in its
    // own session): waiting for it leaves no zombie behind.
    let mut command = Command::new(&cmd.program);
    command
        .args(&cmd.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the hook runs in the forked child between fork and exec; it only makes
    // syscalls (close_range, getrlimit, fcntl), which are async-signal-safe, and allocates
    // nothing.
    unsafe { command.pre_exec(inherit_no_descriptors) };
    let status = command
        .status()
        .map_err(|e| Unavailable::Other(format!("starting the supervisor: {e}")))?;
    if !status.success() {
        return Err(Unavailable::Other(format!(
            "the supervisor failed to start ({status})"
        )));
    }
    Ok(())
}

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

type IoGuard = MutexGuard<'static, Io>;

/// Make sure this process has a live connection, connecting (and starting a supervisor
/// when `may_spawn`) if needed; a fresh connection re-registers every segment in use, and
/// `Ok(true)` says so. Called with `IO` held; releases it only while starting a supervisor
/// (which may fork: never with our locks held, see the module docs).
fn ensure(mut io: IoGuard, may_spawn: bool) -> (IoGuard, Result<bool, Unavailable>) {
    own_conn(&mut io);
    if io.conn.is_some() {
        return (io, Ok(false));
    }
    if let Some((until, why)) = &lock(state()).backoff {
        if Instant::now() < *until {
            return (io, Err(Unavailable::NoAnswer(why.clone())));
        }
    }
    // Every segment in use is registered on a new connection, the first batch in the same
    // write as the HELLO.
    let mut uses = registrations();
    let mut c = match connect(Instant::now() + timeout(), &uses) {
        Ok(c) => c,
        Err(Unavailable::NotRunning(_)) if may_spawn => {
            let start = Instant::now();
            drop(io);
            let spawned = spawn_supervisor();
            io = lock(&IO);
            if let Err(e) = spawned {
                return (io, Err(e));
            }
            if io.conn.is_some() {
                // Another thread connected meanwhile and registered everything in `uses`.
                return (io, Ok(true));
            }
            uses = registrations();
            loop {
                match connect(Instant::now() + timeout(), &uses) {
                    Ok(c) => break c,
                    Err(Unavailable::NotRunning(e)) if start.elapsed() >= SPAWN_WAIT => {
                        return (io, Err(Unavailable::NotRunning(e)))
                    }
                    Err(Unavailable::NotRunning(_)) => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => return (io, Err(e)),
                }
            }
        }
        Err(e) => return (io, Err(e)),
    };
    // Re-registering many stores may take several deadlines' worth: one per batch.
    for chunk in uses[uses.len().min(BATCH)..].chunks(BATCH) {
        if let Err(e) = c.requests(chunk, Instant::now() + timeout()) {
            return (io, Err(fail(&c, e)));
        }
    }
    // Then every pin, after the registrations (a supervisor that started since knows none).
    // One it refuses (say its directory is not a segment directory to this supervisor yet)
    // is forgotten, not a reason to give up the connection.
    let pins: Vec<(PathBuf, PathBuf)> = lock(state()).pins.iter().cloned().collect();
    for chunk in pins.chunks(BATCH) {
        let reqs: Vec<Request> = chunk
            .iter()
            .map(|(holder, path)| Request::Pin {
                holder: holder.clone(),
                path: path.clone(),
            })
            .collect();
        match c.exchange(&reqs, Instant::now() + timeout()) {
            Ok(replies) => {
                let mut st = lock(state());
                for (pin, reply) in chunk.iter().zip(replies) {
                    if !reply.starts_with("OK") {
                        st.pins.remove(pin);
                    }
                }
            }
            Err(e) => return (io, Err(fail(&c, e))),
        }
    }
    io.conn = Some(c);
    (io, Ok(true))
}

/// Make `io.conn` this process's own: a forked child's inherited connection is its
/// parent's (forgotten: see `after_fork_child`; never read the parent's pending replies,
/// and its locks on pending segments stay open here too, harmless since this process maps
/// those segments as well). A connection opened at import ([`prepare`]) that has not been
/// used yet is closed if the supervisor it reaches is no longer the one the environment
/// names (`SHMSTORE_SUPERVISOR_NAME` or the state directory changed since): it registered
/// nothing, and registering with the one named at the first use is what a process did
/// before connections were opened at import.
fn own_conn(io: &mut Io) {
    let me = std::process::id();
    if io.pid != me {
        if let Some(c) = io.conn.take() {
            std::mem::forget(c);
        }
        io.pid = me;
    }
    let stale = io
        .conn
        .as_ref()
        .and_then(|c| c.prepared.as_ref())
        .is_some_and(|target| *target != (super::state_dir_path(), super::socket_name()));
    if stale {
        io.conn = None;
    }
}

/// What a new connection registers: every segment in use here. A new connection knows
/// nothing of earlier DROPs: they are forgotten.
fn registrations() -> Vec<Request> {
    let mut st = lock(state());
    st.drops.clear();
    st.uses
        .iter()
        .filter(|(_, u)| !u.refused)
        .map(|(p, u)| {
            if u.created {
                Request::New(p.clone())
            } else {
                Request::Use(p.clone())
            }
        })
        .collect()
}

/// The supervisor answered a USE written without waiting with `reply`, not OK: the segment
/// is not registered (it stays locked while this process maps it, see
/// [`use_segment_nowait`]).
fn refused(path: PathBuf, reply: &str) {
    let mut st = lock_state();
    let why = format!(
        "the supervisor refused to register {} (it said {reply:?})",
        path.display()
    );
    if let Some(u) = st.uses.get_mut(&path) {
        u.refused = true;
    }
    st.late.get_or_insert(why);
}

/// Close this process's connection (it failed, or missed a deadline). The next
/// conversation reconnects and registers every segment in use again, including those whose
/// USE was still waiting for its answer.
fn lose(io: &mut Io) {
    io.conn = None;
}

fn lock_state() -> MutexGuard<'static, State> {
    lock(state())
}

fn fail(c: &Conn, e: io::Error) -> Unavailable {
    if is_timeout(&e) {
        no_answer(c.supervisor)
    } else {
        Unavailable::NotRunning(e)
    }
}

/// Send `req` on this process's connection (reconnecting once if the supervisor went
/// away). On a missed deadline the connection is closed (the caller gives the supervisor
/// up for [`BACKOFF`]).
fn send(mut io: IoGuard, req: Request, may_spawn: bool) -> Result<(), Unavailable> {
    for attempt in 0..2 {
        let (back, fresh) = ensure(io, may_spawn);
        io = back;
        let fresh = fresh?;
        if fresh && matches!(req, Request::Use(_) | Request::New(_)) {
            return Ok(()); // `ensure` registered everything in `uses`, this path included
        }
        let c = io.conn.as_mut().expect("ensured");
        c.prepared = None;
        match c.requests(std::slice::from_ref(&req), Instant::now() + timeout()) {
            Ok(()) => return Ok(()),
            Err(e) => {
                let err = fail(c, e);
                lose(&mut io);
                if matches!(err, Unavailable::NoAnswer(_)) || attempt == 1 {
                    return Err(err);
                }
                // It died (e.g. was killed): reconnect and re-register once.
            }
        }
    }
    unreachable!("the loop returns")
}

fn give_up(err: &Unavailable) {
    if let Unavailable::NoAnswer(why) = err {
        lock(state()).backoff = Some((Instant::now() + BACKOFF, why.clone()));
    }
}

/// This process uses the segment at `path` (call before creating or mapping it; `created`:
/// this process creates it). An error means the supervisor is unavailable (it says why and
/// what to do); the segment is then only covered by the orphan sweep.
pub fn use_segment(path: &Path, created: bool) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    {
        let mut st = lock(state());
        if let Some(u) = st.uses.get_mut(path) {
            if u.count > 0 {
                u.count += 1;
                return Ok(());
            }
        }
    }
    // Hold the conversation from here: a DROP of this path can only be sent after our
    // registration, never before it.
    let io = lock(&IO);
    {
        let mut st = lock(state());
        let u = st.uses.entry(path.to_owned()).or_default();
        u.count += 1;
        u.created |= created;
        if u.count > 1 {
            return Ok(());
        }
        if st.drops.remove(path) {
            return Ok(()); // its DROP was never sent: still registered
        }
    }
    let req = if created {
        Request::New(path.to_owned())
    } else {
        Request::Use(path.to_owned())
    };
    let res = send(io, req, true);
    if let Err(e) = &res {
        give_up(e);
        let mut st = lock(state());
        if let Some(u) = st.uses.get_mut(path) {
            u.count -= 1;
            if u.count == 0 {
                st.uses.remove(path);
            }
        }
    }
    res
}

/// Keep the segment at `path` while the segment `holder` is in use (`PIN`, see
/// docs/lifecycle.md, "Pins"): e.g. an arena holding objects whose handles wait in a
/// channel, kept after this process exits until the channel itself is removed. Both must
/// be in the same segment directory. Sent once per (holder, path) in this process (later
/// calls return at once) and again on every new connection, so a supervisor started since
/// learns it too. A round trip with the usual deadline; `Unavailable::Other` if the
/// supervisor refuses the pin (it says why), the other errors as [`use_segment`].
pub fn pin_segment(holder: &Path, path: &Path) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    let pin = (holder.to_owned(), path.to_owned());
    if lock(state()).pins.contains(&pin) {
        return Ok(());
    }
    let mut io = lock(&IO);
    if lock(state()).pins.contains(&pin) {
        return Ok(()); // another thread pinned it meanwhile
    }
    let req = Request::Pin {
        holder: pin.0.clone(),
        path: pin.1.clone(),
    };
    let mut res = Err(Unavailable::Other("not sent".into()));
    for attempt in 0..2 {
        let (back, fresh) = ensure(io, true);
        io = back;
        if let Err(e) = fresh {
            res = Err(e);
            break;
        }
        let c = io.conn.as_mut().expect("ensured");
        c.prepared = None;
        let sent = c.exchange(std::slice::from_ref(&req), Instant::now() + timeout());
        match sent.map(|replies| replies.into_iter().next().unwrap_or_default()) {
            Ok(reply) if reply.starts_with("OK") => {
                // Recorded with `IO` still held: a reconnection by another thread after this
                // point sends it again.
                lock(state()).pins.insert(pin);
                return Ok(());
            }
            Ok(reply) => {
                return Err(Unavailable::Other(format!(
                    "the supervisor refused to keep {} while {} is in use (it said {reply:?})",
                    path.display(),
                    holder.display(),
                )));
            }
            Err(e) => {
                let err = fail(c, e);
                lose(&mut io);
                let last = matches!(err, Unavailable::NoAnswer(_)) || attempt == 1;
                res = Err(err);
                if last {
                    break;
                }
                // It died (e.g. was killed): reconnect, re-register, and pin, once.
            }
        }
    }
    drop(io);
    if let Err(e) = &res {
        give_up(e);
    }
    res
}

/// This process attached the segment at `path`, holding a shared `flock` on it for as long
/// as it maps it (`segment::Mapping::open_locked`): tell the supervisor without waiting for
/// its answer when that is possible, else as [`use_segment`] does.
///
/// Why not waiting is safe (docs/lifecycle.md, "Attaching without waiting"): the supervisor
/// and `shmstore gc` remove a segment only under an exclusive `flock` taken without
/// waiting, which is refused while any process maps the segment through a locked
/// descriptor. The USE is written now on this process's connection (opened at import,
/// [`prepare`], or now if a supervisor is listening), and its answer read by a later
/// conversation ([`Conn::poll_pending`], [`Conn::settle`]). An answer other than OK leaves
/// the segment unregistered, said by the next attach ([`take_late`]); a connection that
/// fails first is opened again by the next conversation, which registers every segment in
/// use. Nothing the supervisor says is needed to read the segment safely: it was checked
/// before it was mapped.
pub fn use_segment_nowait(path: &Path) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    {
        let mut st = lock_state();
        if let Some(u) = st.uses.get_mut(path) {
            if u.count > 0 {
                u.count += 1;
                return Ok(());
            }
        }
    }
    let mut io = lock(&IO);
    {
        let mut st = lock_state();
        let u = st.uses.entry(path.to_owned()).or_default();
        u.count += 1;
        if u.count > 1 {
            return Ok(());
        }
        if st.drops.remove(path) {
            return Ok(()); // its DROP was never sent: still registered
        }
    }
    if use_without_waiting(&mut io, path) {
        return Ok(());
    }
    // The usual round trip (it may start a supervisor, or reconnect and register every
    // segment in use again).
    let res = send(io, Request::Use(path.to_owned()), true);
    if let Err(e) = &res {
        give_up(e);
        let mut st = lock_state();
        if let Some(u) = st.uses.get_mut(path) {
            u.count -= 1;
            if u.count == 0 {
                st.uses.remove(path);
            }
        }
    }
    res
}

/// Open this process's connection now, if a supervisor is listening: called when shmstore
/// is imported, so that the first attach writes one line instead of connecting (a connect
/// wakes the supervisor, which on a busy machine costs about as much as the rest of an
/// attach). Never starts a supervisor, never waits: the HELLO's answer is read by the
/// next conversation. Nothing is registered. Any failure is silent (the first real
/// conversation meets it again and says so).
pub fn prepare() {
    if !enabled() {
        return;
    }
    install_fork_handlers();
    let mut io = lock(&IO);
    own_conn(&mut io);
    if io.conn.is_some() {
        return;
    }
    let me = std::process::id();
    {
        let st = lock_state();
        let backoff = st
            .backoff
            .as_ref()
            .is_some_and(|(until, _)| Instant::now() < *until);
        if backoff || !st.uses.is_empty() {
            return;
        }
    }
    let Ok(dir) = super::state_dir() else {
        return;
    };
    let name = super::socket_name();
    // A deadline of now: a full listen backlog is not waited on.
    let Ok(mut c) = open_conn(&dir, &name, Instant::now()) else {
        return;
    };
    c.prepared = Some((super::state_dir_path(), name));
    let hello = Request::Hello(me).encode();
    if c.send_all(hello.as_bytes(), Instant::now() + timeout())
        .is_err()
    {
        return;
    }
    c.pending.push_back(Pending {
        path: None,
        sent: Instant::now(),
    });
    io.conn = Some(c);
}

/// Close this process's connection without a word (the supervisor process itself, which
/// imported shmstore, must not be another supervisor's client).
pub fn disconnect() {
    let mut io = lock(&IO);
    if io.pid == std::process::id() {
        io.conn = None;
    }
}

/// Write `USE path` on this process's connection (opening it if a supervisor is listening
/// and nothing else needs registering), its answer to be read later. False when that is
/// not possible now: the caller then does the round trip.
fn use_without_waiting(io: &mut Io, path: &Path) -> bool {
    let me = std::process::id();
    own_conn(io);
    if io.conn.is_none() {
        {
            let st = lock_state();
            if st
                .backoff
                .as_ref()
                .is_some_and(|(until, _)| Instant::now() < *until)
            {
                return false;
            }
            // Only this segment to register: a reconnection that registers more is a
            // round trip (`ensure`).
            if st.uses.len() != 1 {
                return false;
            }
        }
        let Ok(dir) = super::state_dir() else {
            return false;
        };
        let Ok(mut c) = open_conn(&dir, &super::socket_name(), Instant::now() + timeout()) else {
            return false; // none running (then one is started), or another failure
        };
        let hello = Request::Hello(me).encode();
        if c.send_all(hello.as_bytes(), Instant::now() + timeout())
            .is_err()
        {
            return false;
        }
        c.pending.push_back(Pending {
            path: None,
            sent: Instant::now(),
        });
        registrations(); // forgets queued DROPs: none was sent on this connection
        io.conn = Some(c);
    }
    let c = io.conn.as_mut().expect("connected above");
    c.prepared = None;
    // Take the replies that came meanwhile; a reply overdue (or many unread) is waited for
    // by the round trip instead, which tells a stopped or gone supervisor.
    if c.poll_pending().is_err() {
        lose(io);
        return false;
    }
    let overdue = c
        .pending
        .front()
        .is_some_and(|p| p.sent.elapsed() >= timeout());
    // A HELLO not answered yet: a supervisor that is stopped would not answer this USE
    // either; the round trip says so at once.
    let unanswered = c.pending.front().is_some_and(|p| p.path.is_none());
    if overdue || c.pending.len() >= MAX_PENDING || (unanswered && stopped(c.supervisor)) {
        return false;
    }
    let text = Request::Use(path.to_owned()).encode();
    // (No logging here: never while holding `IO`, see the module docs.)
    if c.send_all(text.as_bytes(), Instant::now() + timeout())
        .is_err()
    {
        lose(io);
        return false;
    }
    c.pending.push_back(Pending {
        path: Some(path.to_owned()),
        sent: Instant::now(),
    });
    true
}

/// Why a segment this process attached without waiting is not covered by the supervisor
/// (learnt after the attach returned), once.
pub fn take_late() -> Option<String> {
    lock_state().late.take()
}

/// Whether this process told the supervisor that it uses `path` (its answer may not be
/// read yet) and the supervisor did not refuse it.
pub fn registered(path: &Path) -> bool {
    lock_state()
        .uses
        .get(path)
        .is_some_and(|u| u.count > 0 && !u.refused)
}

/// Read the replies to this process's requests that are still pending (called before
/// questions about what the supervisor tracks, so that the answer includes every segment
/// this process attached before asking).
pub fn settle() {
    let mut io = lock(&IO);
    if io.pid != std::process::id() {
        return;
    }
    let Some(c) = io.conn.as_mut() else {
        return;
    };
    if let Err(e) = c.settle(Instant::now() + timeout()) {
        let err = fail(c, e);
        lose(&mut io);
        drop(io);
        give_up(&err);
    }
}

/// This process no longer uses the segment at `path` (its last mapping here is gone).
/// Never blocks on the supervisor: the DROP is queued for the sender thread.
pub fn drop_segment(path: &Path) {
    let mut st = lock(state());
    let Some(u) = st.uses.get_mut(path) else {
        return;
    };
    u.count -= 1;
    if u.count > 0 {
        return;
    }
    let refused = u.refused;
    st.uses.remove(path);
    if refused {
        return; // never registered
    }
    st.drops.insert(path.to_owned());
    let me = std::process::id();
    if st.sender != me {
        let started = spawn_without_signals("shmstore-drops", send_drops);
        if started.is_ok() {
            st.sender = me;
        }
    }
    WAKE.notify_one();
}

/// Start a background thread that blocks every signal, from its first instruction (it
/// inherits the mask set around the spawn). A signal sent to the process (Ctrl-C's SIGINT,
/// SIGTERM) then always goes to a thread that can handle it: if the kernel picked our
/// thread instead, CPython would only set a flag there, and a main thread blocked in a read
/// would never be interrupted (the program would ignore Ctrl-C).
fn spawn_without_signals(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    // SAFETY: plain libc calls on local, initialised sigset_t values; the calling thread's
    // mask is restored right after the spawn, whatever the spawn's outcome.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let started = std::thread::Builder::new().name(name.into()).spawn(f);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        started
    }
}

/// The sender thread: waits for queued DROPs and sends them in batches.
fn send_drops() {
    loop {
        {
            let mut st = lock(state());
            while st.drops.is_empty() {
                st = WAKE.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
        flush_drops();
    }
}

/// Send every queued DROP now (what the sender thread does; tests call it to wait).
pub fn flush_drops() {
    let mut io = lock(&IO);
    let paths: Vec<PathBuf> = lock(state()).drops.drain().collect();
    // Many DROPs per line (up to ~1 MiB): the supervisor settles a line with one /proc scan.
    let mut batch: Vec<Request> = Vec::new();
    let mut line: Vec<PathBuf> = Vec::new();
    let mut bytes = 0;
    for p in paths {
        bytes += p.as_os_str().len() + 1;
        line.push(p);
        if bytes >= DROP_LINE_BYTES {
            batch.push(Request::DropMany(std::mem::take(&mut line)));
            bytes = 0;
        }
    }
    match line.len() {
        0 => {}
        1 => batch.push(Request::Drop(line.remove(0))),
        _ => batch.push(Request::DropMany(line)),
    }
    if batch.is_empty() || io.pid != std::process::id() {
        return;
    }
    let Some(c) = io.conn.as_mut() else {
        return; // not connected: the supervisor has none of them registered
    };
    let mut res = Ok(());
    for chunk in batch.chunks(BATCH) {
        res = c.requests(chunk, Instant::now() + timeout());
        if res.is_err() {
            break;
        }
    }
    if let Err(e) = res {
        // Closing the connection drops all our registrations at once; the supervisor's
        // /proc check still sees what we map. The next call reconnects and re-registers.
        let err = fail(c, e);
        lose(&mut io);
        drop(io);
        give_up(&err);
    }
}

/// Open a fresh connection (never starts a supervisor). `Ok(None)`: none is running.
fn query(deadline: Instant) -> io::Result<Option<Conn>> {
    match connect(deadline, &[]) {
        Ok(c) => Ok(Some(c)),
        Err(Unavailable::NotRunning(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Deadline of the questions asked by tools (`list`, `supervisor_pid`): not on any hot path,
/// so more generous than [`timeout`], but still bounded.
fn query_timeout() -> Duration {
    timeout().max(Duration::from_secs(5))
}

/// What the running supervisor tracks; `Ok(None)` if none is running (never starts one).
/// An error if one is running but its answer is missing or incomplete: a caller deciding
/// what to delete must not mistake that for "nothing is in use".
///
/// A supervisor that closes the connection before answering anything is one that was
/// exiting (it exits only when it tracks nothing): the question is asked once more, and
/// the second answer (or "none is running") stands.
pub fn list() -> io::Result<Option<Vec<SegmentUse>>> {
    settle();
    let dir =
        super::state_dir().map_err(|e| io::Error::from(Unavailable::UnsafeDir(e.to_string())))?;
    list_in(&dir, &super::socket_name())
}

/// [`list`] from the supervisor named `name` whose socket is in `dir`.
pub(crate) fn list_in(dir: &PrivateDir, name: &str) -> io::Result<Option<Vec<SegmentUse>>> {
    match list_once(dir, name) {
        Err(e) if e.kind() == io::ErrorKind::Interrupted => list_once(dir, name),
        r => r,
    }
}

/// One LIST round trip. `ErrorKind::Interrupted`: the connection closed before any answer.
fn list_once(dir: &PrivateDir, name: &str) -> io::Result<Option<Vec<SegmentUse>>> {
    let mut c = match connect_in(dir, name, Instant::now() + query_timeout(), &[]) {
        Ok(c) => c,
        Err(Unavailable::NotRunning(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let closed_early = |e: io::Error| match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::UnexpectedEof => io::Error::new(io::ErrorKind::Interrupted, e),
        _ => e,
    };
    c.send_all(
        Request::List.encode().as_bytes(),
        Instant::now() + query_timeout(),
    )
    .map_err(closed_early)?;
    let mut out = Vec::new();
    loop {
        // A long listing streams: the deadline is per line, not for the whole.
        let line = match c.line_by(Instant::now() + query_timeout()) {
            Ok(line) => line,
            Err(e) if out.is_empty() => return Err(closed_early(e)),
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "the supervisor's list was cut after {} segments: {e}",
                        out.len()
                    ),
                ))
            }
        };
        if let Some(n) = parse_end(&line) {
            if n != out.len() {
                return Err(io::Error::other(format!(
                    "the supervisor's list is incomplete: {} of {n} segments",
                    out.len()
                )));
            }
            return Ok(Some(out));
        }
        match parse_seg(&line) {
            Some(s) => out.push(s),
            None => return Err(io::Error::other(format!("the supervisor said {line:?}"))),
        }
    }
}

/// The pid of the running supervisor; `Ok(None)` if none is running.
pub fn supervisor_pid() -> io::Result<Option<u32>> {
    Ok(query(Instant::now() + query_timeout())?.map(|c| c.supervisor))
}

/// A raw connection, for tests of the server.
#[cfg(test)]
pub(crate) struct TestConn(Conn);

#[cfg(test)]
impl TestConn {
    pub(crate) fn connect(dir: &PrivateDir, name: &str) -> io::Result<Self> {
        let deadline = Instant::now() + Duration::from_secs(30);
        connect_in(dir, name, deadline, &[])
            .map(TestConn)
            .map_err(io::Error::from)
    }
    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }
    pub(crate) fn request(&mut self, req: &Request) -> io::Result<String> {
        self.0.send_all(req.encode().as_bytes(), Self::deadline())?;
        self.0.line_by(Self::deadline())
    }
    pub(crate) fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.send_all(bytes, Self::deadline())
    }
    pub(crate) fn read_reply(&mut self) -> io::Result<String> {
        self.0.line_by(Self::deadline())
    }
    pub(crate) fn list(&mut self) -> io::Result<Vec<String>> {
        self.0
            .send_all(Request::List.encode().as_bytes(), Self::deadline())?;
        let mut lines = Vec::new();
        loop {
            let l = self.0.line_by(Self::deadline())?;
            if parse_end(&l).is_some() {
                return Ok(lines);
            }
            lines.push(l);
        }
    }
}
