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
//! that order, never while logging or calling Python) are taken by a `pthread_atfork`
//! prepare handler and released in the parent and the child, so a fork in the middle of
//! another thread's round trip waits for it to finish (at most the deadline) instead of
//! leaving the child a lock that no thread will ever release. A forked child notices the
//! pid change and opens its own connection (keeping the inherited one open, so its
//! parent's segments stay registered while the child, which maps them too, is alive).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use super::proto::{parse_end, parse_seg, read_line, Request, SegmentUse};
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

struct Conn {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    supervisor: u32,
}

impl Conn {
    /// Send `reqs` (at most [`BATCH`] at once), then read one `OK` each, by `deadline`.
    fn requests(&mut self, reqs: &[Request], deadline: Instant) -> io::Result<()> {
        for chunk in reqs.chunks(BATCH) {
            let text: String = chunk.iter().map(Request::encode).collect();
            self.arm(deadline)?;
            self.writer.write_all(text.as_bytes())?;
            for _ in chunk {
                let reply = self.reply(deadline)?;
                if !reply.starts_with("OK") {
                    return Err(io::Error::other(format!("the supervisor said {reply:?}")));
                }
            }
        }
        Ok(())
    }

    /// Read one reply line by `deadline`; past it, wait on (up to [`BUSY_FACTOR`] times as
    /// long) only if the supervisor is running but busy, never if it is stopped.
    fn reply(&mut self, deadline: Instant) -> io::Result<String> {
        let mut line = String::new();
        // A first short wait: a stopped supervisor is recognised then, without waiting for
        // the whole deadline.
        let mut until = deadline.min(Instant::now() + STOPPED_CHECK);
        let hard = deadline + timeout() * (BUSY_FACTOR - 1);
        loop {
            self.arm(until)?;
            match self.reader.read_line(&mut line) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the supervisor closed the connection",
                    ))
                }
                Ok(_) => return Ok(line.trim_end().to_owned()),
                Err(e) if is_timeout(&e) && until < hard && !stopped(self.supervisor) => {
                    until = if until < deadline { deadline } else { hard };
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Socket timeouts set to what is left until `deadline`.
    fn arm(&self, deadline: Instant) -> io::Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.writer.set_read_timeout(Some(left))?;
        self.writer.set_write_timeout(Some(left))
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// Connect to the supervisor named `name` whose socket is in `dir`, check it is ours
/// (`SO_PEERCRED`), and say HELLO, all by `deadline`. `first`: requests sent in the same
/// write as the HELLO (at most [`BATCH`]), each answered OK before this returns: one round
/// trip for a process's first registration, not two. Nothing is used before its OK arrives,
/// so this changes no ordering the guarantees rest on (docs/lifecycle.md).
fn connect_in(
    dir: &PrivateDir,
    name: &str,
    deadline: Instant,
    first: &[Request],
) -> Result<Conn, Unavailable> {
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
    let other = |e: io::Error| Unavailable::Other(e.to_string());
    stream.set_nonblocking(false).map_err(other)?;
    let cred = rustix::net::sockopt::socket_peercred(&stream).map_err(|e| other(e.into()))?;
    if cred.uid != rustix::process::geteuid() {
        return Err(Unavailable::Other(format!(
            "the supervisor socket belongs to uid {}",
            cred.uid.as_raw()
        )));
    }
    let mut conn = Conn {
        reader: BufReader::new(stream.try_clone().map_err(other)?),
        writer: stream,
        supervisor: cred.pid.as_raw_nonzero().get() as u32,
    };
    let first = &first[..first.len().min(BATCH)];
    let hello = (|| {
        conn.arm(deadline)?;
        let mut text = Request::Hello(std::process::id()).encode();
        text.extend(first.iter().map(Request::encode));
        conn.writer.write_all(text.as_bytes())?;
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
    /// This process created the segment (registered with `NEW`).
    created: bool,
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

extern "C" fn before_fork() {
    let io = lock(&IO);
    let st = lock(state());
    HELD.with(|h| *h.borrow_mut() = Some((io, st)));
}

extern "C" fn after_fork_parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn after_fork_child() {
    HELD.with(|h| {
        if let Some((mut io, mut st)) = h.borrow_mut().take() {
            // The parent owns that conversation: keep the socket open, never use it.
            std::mem::forget(io.conn.take());
            io.pid = 0;
            st.drops.clear(); // never registered by this process
            st.sender = 0;
        }
    });
}

fn install_fork_handlers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain functions that lock and unlock process-global
        // mutexes (no allocation in `before_fork` besides what `Mutex::lock` does, no
        // Python, no I/O) and never unwind: `lock` recovers from poisoning.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_parent),
                Some(after_fork_child),
            );
        }
    });
}

type IoGuard = MutexGuard<'static, Io>;

/// Make sure this process has a live connection, connecting (and starting a supervisor
/// when `may_spawn`) if needed; a fresh connection re-registers every segment in use, and
/// `Ok(true)` says so. Called with `IO` held; releases it only while starting a supervisor
/// (which may fork: never with our locks held, see the module docs).
fn ensure(mut io: IoGuard, may_spawn: bool) -> (IoGuard, Result<bool, Unavailable>) {
    let me = std::process::id();
    if io.pid != me {
        if let Some(c) = io.conn.take() {
            std::mem::forget(c); // inherited: see after_fork_child
        }
        io.pid = me;
    }
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
    io.conn = Some(c);
    (io, Ok(true))
}

/// What a new connection registers: every segment in use here. A new connection knows
/// nothing of earlier DROPs: they are forgotten.
fn registrations() -> Vec<Request> {
    let mut st = lock(state());
    st.drops.clear();
    st.uses
        .iter()
        .map(|(p, u)| {
            if u.created {
                Request::New(p.clone())
            } else {
                Request::Use(p.clone())
            }
        })
        .collect()
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
        match c.requests(std::slice::from_ref(&req), Instant::now() + timeout()) {
            Ok(()) => return Ok(()),
            Err(e) => {
                let err = fail(c, e);
                io.conn = None;
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
    st.uses.remove(path);
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
        io.conn = None;
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
    c.arm(Instant::now() + query_timeout())?;
    c.writer
        .write_all(Request::List.encode().as_bytes())
        .map_err(closed_early)?;
    let mut out = Vec::new();
    loop {
        // A long listing streams: the deadline is per line, not for the whole.
        c.arm(Instant::now() + query_timeout())?;
        let line = match read_line(&mut c.reader) {
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
    pub(crate) fn request(&mut self, req: &Request) -> io::Result<String> {
        self.0.arm(Instant::now() + Duration::from_secs(30))?;
        self.0.writer.write_all(req.encode().as_bytes())?;
        read_line(&mut self.0.reader)
    }
    pub(crate) fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.arm(Instant::now() + Duration::from_secs(30))?;
        self.0.writer.write_all(bytes)
    }
    pub(crate) fn read_reply(&mut self) -> io::Result<String> {
        self.0.arm(Instant::now() + Duration::from_secs(30))?;
        read_line(&mut self.0.reader)
    }
    pub(crate) fn list(&mut self) -> io::Result<Vec<String>> {
        self.0.arm(Instant::now() + Duration::from_secs(30))?;
        self.0.writer.write_all(Request::List.encode().as_bytes())?;
        let mut lines = Vec::new();
        loop {
            let l = read_line(&mut self.0.reader)?;
            if parse_end(&l).is_some() {
                return Ok(lines);
            }
            lines.push(l);
        }
    }
}
