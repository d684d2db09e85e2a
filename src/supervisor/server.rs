//! The supervisor's event loop: one thread, `poll(2)` over the listening socket, the client
//! connections and the pidfds of adopted processes.
//!
//! Decisions are batched: requests and deaths seen in one poll round only mark segments as
//! "to settle"; at the end of the round one /proc scan covers all of them (and the orphan
//! sweep), so a thousand clients dying at once, or a batch of ten thousand DROPs, cost one
//! scan, not a thousand.
//!
//! No client can stall the loop: every socket is non-blocking, replies wait in a per-client
//! buffer that is written as the client reads (a `LIST` of 100k segments streams), a client
//! whose replies pile up is not read until it catches up, and each round accepts and reads
//! a bounded amount, so a flood of connections or requests cannot starve the others.
//!
//! (Over 800 lines: one event loop and the state it alone touches; splitting it would
//! widen that state's visibility.)

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use super::proto::{encode_seg, Request};
use super::sweep::{file_id_nofollow, holders, holders_among, remove_if_ours, segment_files};
use super::sweep::{FileId, Removal};
use crate::segment::PrivateDir;

/// The log is rotated (to `<name>.log.1`, replacing the previous one) past this size, so
/// it never takes more than twice this.
pub const LOG_MAX: u64 = 1 << 20;
/// Log lines: a burst of this many, then at most [`LOG_RATE`] per second (the number of
/// lines left out is logged when lines are allowed again).
const LOG_BURST: f64 = 200.0;
const LOG_RATE: f64 = 50.0;

/// Tests: what to do (once) between a settling round's read of the processes and its read
/// of the channels, for a supervisor of the given segment directory.
#[cfg(test)]
pub(crate) type BetweenReads = Box<dyn FnOnce() + Send>;
#[cfg(test)]
pub(crate) static BETWEEN_READS: std::sync::Mutex<Vec<(PathBuf, BetweenReads)>> =
    std::sync::Mutex::new(Vec::new());

/// Per poll round: connections accepted, bytes read from one client.
const ACCEPT_PER_ROUND: usize = 64;
const READ_PER_ROUND: usize = 64 << 10;
/// A client whose unread replies exceed this is not read from until it catches up.
const OUT_HIGH: usize = 256 << 10;
/// Longest request line (a `DROP` of many paths; one path is at most 4096 bytes).
const LINE_MAX: usize = 4 << 20;
/// How often a segment kept because a reader holds a lock on it is looked at again.
const LOCKED_RETRY: Duration = Duration::from_secs(1);
/// Segments whose users changed are settled (one /proc scan for all, [`State::flush`])
/// once no client has said anything for [`SETTLE_QUIET`], or [`SETTLE_DELAY`] after the
/// first change at the latest: requests that arrive meanwhile are answered at once.
/// Settling at every change made the next request wait for the scan (~1 ms on a quiet
/// 2-core VM, more with more processes): a process that puts and closes segments in a loop
/// waited that long for each `NEW`. A client that dies is settled after the quiet time.
const SETTLE_QUIET: Duration = Duration::from_millis(1);
const SETTLE_DELAY: Duration = Duration::from_millis(20);
/// Longest supervisor name: `/proc/self/fd/NNNN/<name>.sock` must fit a socket address.
pub const NAME_MAX: usize = 80;

pub struct ServerConfig {
    /// The supervisor's name (see `super::socket_name`).
    pub name: String,
    /// Exit after this long with no registered segment and no adopted process.
    pub grace: Duration,
    /// The verified state directory: socket, lock and log live here.
    pub state: PrivateDir,
    /// Append a line per action to `<name>.log` in the state directory.
    pub log: bool,
    /// Segment directories: swept for orphans at start and after a client dies. Directories
    /// where clients create segments (`NEW`) are added.
    pub sweep_dirs: Vec<PathBuf>,
}

/// A bound listener and the lock that makes it this user's one supervisor.
pub struct Bound {
    listener: UnixListener,
    _lock: OwnedFd,
}

fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name.len() > NAME_MAX || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("supervisor name {name:?}: use 1 to {NAME_MAX} characters, no '/'"),
        ));
    }
    Ok(())
}

/// The socket's address: reached through the verified directory's descriptor.
pub fn socket_path(state: &PrivateDir, name: &str) -> io::Result<PathBuf> {
    check_name(name)?;
    Ok(state.fd_path(&format!("{name}.sock")))
}

/// Take the supervisor lock and bind the socket. `Ok(None)` when another supervisor holds
/// the lock (it is running). A socket file left by a supervisor that was killed is replaced.
pub fn bind(state: &PrivateDir, name: &str) -> io::Result<Option<Bound>> {
    let path = socket_path(state, name)?;
    let lock = rustix::fs::openat(
        &state.fd,
        format!("{name}.lock"),
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )?;
    match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    // Our pid, for clients that cannot get an answer (is the supervisor stopped?).
    rustix::fs::ftruncate(&lock, 0)?;
    rustix::io::pwrite(&lock, format!("{}\n", std::process::id()).as_bytes(), 0)?;
    match rustix::fs::unlinkat(&state.fd, format!("{name}.sock"), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    let listener = UnixListener::bind(path)?;
    Ok(Some(Bound {
        listener,
        _lock: lock,
    }))
}

/// Run until idle for `grace`. Returns at once if another supervisor is running.
pub fn run(cfg: ServerConfig) -> io::Result<()> {
    raise_fd_limit();
    let Some(bound) = bind(&cfg.state, &cfg.name)? else {
        return Ok(());
    };
    serve(bound, cfg)
}

/// One descriptor per client: use the hard limit, not a soft one inherited from whoever
/// happened to start us.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        let _ = setrlimit(Resource::Nofile, lim);
    }
}

/// The supervisor's log: opened inside the state directory (never through a symlink, only
/// a regular file of ours), rotated at [`LOG_MAX`], rate-limited.
pub(crate) struct Log {
    dir: Option<OwnedFd>,
    name: String,
    file: Option<File>,
    written: u64,
    tokens: f64,
    refilled: Instant,
    /// Lines left out by the rate limit since the last line written, per [`Kind`].
    suppressed: [u64; Kind::ALL.len()],
}

/// What a log line reports. Lines left out by the rate limit are counted per kind, so that
/// whoever reads the log can still total the removals exactly (a line saying that a segment
/// is still mapped is not a removal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A tracked segment removed: `unlinked <path> (no user left)`.
    Unlinked,
    /// An orphan removed by the sweep: `sweep: removed orphan <path>`.
    Orphan,
    /// A segment kept for a process that still maps it or a reader holding its lock.
    Waiting,
    /// Everything else (start, refused connections, errors).
    Other,
}

impl Kind {
    pub(crate) const ALL: [Kind; 4] = [Kind::Unlinked, Kind::Orphan, Kind::Waiting, Kind::Other];

    /// How the kind is named in a "lines left out" summary.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Unlinked => "unlinked",
            Kind::Orphan => "removed orphan",
            Kind::Waiting => "waiting",
            Kind::Other => "other",
        }
    }
}

impl Log {
    pub(crate) fn new(state: &PrivateDir, name: &str, enabled: bool) -> Log {
        let mut log = Log {
            dir: enabled
                .then(|| rustix::io::fcntl_dupfd_cloexec(&state.fd, 3).ok())
                .flatten(),
            name: format!("{name}.log"),
            file: None,
            written: 0,
            tokens: LOG_BURST,
            refilled: Instant::now(),
            suppressed: [0; Kind::ALL.len()],
        };
        log.reopen();
        log
    }

    fn reopen(&mut self) {
        self.file = None;
        let Some(dir) = &self.dir else { return };
        let Ok(fd) = rustix::fs::openat(
            dir,
            &self.name,
            OFlags::WRONLY
                | OFlags::APPEND
                | OFlags::CREATE
                | OFlags::NOFOLLOW
                | OFlags::NONBLOCK
                | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        ) else {
            return;
        };
        let Ok(st) = rustix::fs::fstat(&fd) else {
            return;
        };
        let regular =
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
        if !regular || st.st_uid != rustix::process::geteuid().as_raw() {
            return; // never write to anything but our own regular file
        }
        self.written = st.st_size as u64;
        self.file = Some(File::from(fd));
        if self.written >= LOG_MAX {
            self.rotate();
        }
    }

    fn rotate(&mut self) {
        let Some(dir) = &self.dir else { return };
        let old = format!("{}.1", self.name);
        if rustix::fs::renameat(dir, &self.name, dir, &old).is_ok() {
            self.reopen();
        } else {
            self.file = None; // cannot keep it bounded: stop writing
        }
    }

    /// Write `msg` (a line of kind `kind`) unless over the rate (`always`: the last line,
    /// written regardless). The first line written after some were left out is preceded by
    /// `(N lines left out, more than 50 a second: 37 unlinked, 2 removed orphan, 1 waiting)`
    /// (the kinds with a count above zero, in [`Kind::ALL`] order).
    pub(crate) fn line(&mut self, kind: Kind, msg: &str, always: bool) {
        if self.file.is_none() {
            return;
        }
        let now = Instant::now();
        let dt = now.duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        self.tokens = (self.tokens + dt * LOG_RATE).min(LOG_BURST);
        if self.tokens < 1.0 && !always {
            self.suppressed[kind as usize] += 1;
            return;
        }
        self.tokens = (self.tokens - 1.0).max(0.0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let mut text = String::new();
        let left_out = std::mem::take(&mut self.suppressed);
        let total: u64 = left_out.iter().sum();
        if total > 0 {
            let kinds: Vec<String> = Kind::ALL
                .iter()
                .zip(left_out)
                .filter(|(_, n)| *n > 0)
                .map(|(k, n)| format!("{n} {}", k.label()))
                .collect();
            text.push_str(&format!(
                "{t:.3} ({total} lines left out, more than {LOG_RATE} a second: {})\n",
                kinds.join(", ")
            ));
        }
        text.push_str(&format!("{t:.3} {msg}\n"));
        if let Some(f) = self.file.as_mut() {
            if f.write_all(text.as_bytes()).is_ok() {
                self.written += text.len() as u64;
            }
        }
        if self.written >= LOG_MAX {
            self.rotate();
        }
    }
}

struct Client {
    stream: UnixStream,
    pid: u32,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    /// Bytes of `out` already written.
    sent: usize,
    uses: HashSet<PathBuf>,
}

impl Client {
    fn unsent(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Write what the socket takes. False if the client is gone.
    fn write_out(&mut self) -> bool {
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(0) => return false,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        true
    }
}

#[derive(Default)]
struct Segment {
    clients: HashSet<u64>,
    adopted: HashSet<u32>,
    /// Segments that keep this one while they have users of their own (`PIN`, see
    /// [`State::pinned`]). Each is tracked; `State::pins` is the reverse index.
    pinned_by: HashSet<PathBuf>,
    /// Whether the file is a channel, once its magic says (`channel::scan::channel_magic`).
    is_channel: Option<bool>,
}

impl Segment {
    /// A client registered it, or a process that maps or holds it was adopted.
    fn has_users(&self) -> bool {
        !self.clients.is_empty() || !self.adopted.is_empty()
    }
}

struct State {
    cfg: ServerConfig,
    log: Log,
    clients: HashMap<u64, Client>,
    next_id: u64,
    segments: HashMap<PathBuf, Segment>,
    /// Holder -> the segments it pins (the reverse of `Segment::pinned_by`; both ends
    /// tracked, see [`State::forget`]).
    pins: HashMap<PathBuf, HashSet<PathBuf>>,
    pidfds: HashMap<u32, OwnedFd>,
    /// Segment directories: only segments in these are ever removed.
    dirs: HashSet<PathBuf>,
    /// Segments whose users changed this round.
    pending: HashSet<PathBuf>,
    /// A client that had registered segments died: look for orphans this round.
    sweep_needed: bool,
    /// accept() hit the descriptor limit: stop polling the listener until a client leaves.
    accept_paused: bool,
    /// Unused segments kept because a reader holds a lock on them: looked at again every
    /// [`LOCKED_RETRY`].
    locked: HashSet<PathBuf>,
    locked_checked: Instant,
    /// Since when something waits to be settled (`pending`, `sweep_needed`): the scan runs
    /// [`SETTLE_DELAY`] after it at the latest.
    unsettled_since: Option<Instant>,
    /// When a client last connected or was read from (see [`SETTLE_QUIET`]).
    heard_at: Instant,
}

/// Serve on an already bound listener.
pub fn serve(bound: Bound, cfg: ServerConfig) -> io::Result<()> {
    let listener = bound.listener;
    listener.set_nonblocking(true)?;
    let log = Log::new(&cfg.state, &cfg.name, cfg.log);
    let mut st = State {
        dirs: cfg.sweep_dirs.iter().cloned().collect(),
        cfg,
        log,
        clients: HashMap::new(),
        next_id: 0,
        segments: HashMap::new(),
        pins: HashMap::new(),
        pidfds: HashMap::new(),
        pending: HashSet::new(),
        sweep_needed: true, // start-up: take over what a previous supervisor left
        accept_paused: false,
        locked: HashSet::new(),
        locked_checked: Instant::now(),
        unsettled_since: None,
        heard_at: Instant::now(),
    };
    st.note(
        Kind::Other,
        &format!(
            "supervisor {} started ({})",
            std::process::id(),
            st.cfg.name
        ),
    );
    st.flush();
    let mut idle_since = Some(Instant::now());
    loop {
        // Idle: nothing registered and nobody adopted. Clients that only asked questions
        // (ls, info) do not keep us alive; they reconnect (and restart us) if they need to.
        let idle = st.segments.is_empty()
            && st.locked.is_empty()
            && st.clients.values().all(|c| c.uses.is_empty());
        if idle {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= st.cfg.grace {
                st.log.line(Kind::Other, "no segments left: exiting", true);
                // Still holding the lock: no other supervisor has bound a socket there.
                let _ = rustix::fs::unlinkat(
                    &st.cfg.state.fd,
                    format!("{}.sock", st.cfg.name),
                    AtFlags::empty(),
                );
                return Ok(());
            }
        } else {
            idle_since = None;
        }
        let mut wait = idle_since.map(|s| st.cfg.grace.saturating_sub(s.elapsed()));
        if !st.locked.is_empty() {
            let left = LOCKED_RETRY.saturating_sub(st.locked_checked.elapsed());
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        if let Some(since) = st.unsettled_since {
            let left = SETTLE_DELAY
                .saturating_sub(since.elapsed())
                .min(SETTLE_QUIET.saturating_sub(st.heard_at.elapsed()));
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        let timeout = wait.map(|left| Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: left.subsec_nanos() as _,
        });
        let client_ids: Vec<u64> = st.clients.keys().copied().collect();
        let pids: Vec<u32> = st.pidfds.keys().copied().collect();
        let (ready_listener, ready_clients, ready_pids) = {
            let mut fds = Vec::with_capacity(1 + client_ids.len() + pids.len());
            // While paused, poll a descriptor that never fires in its place.
            let listen_flags = if st.accept_paused {
                PollFlags::empty()
            } else {
                PollFlags::IN
            };
            fds.push(PollFd::new(&listener, listen_flags));
            for id in &client_ids {
                let c = &st.clients[id];
                let mut flags = PollFlags::empty();
                if c.unsent() < OUT_HIGH {
                    flags |= PollFlags::IN;
                }
                if c.unsent() > 0 {
                    flags |= PollFlags::OUT;
                }
                fds.push(PollFd::new(&c.stream, flags));
            }
            for pid in &pids {
                fds.push(PollFd::new(&st.pidfds[pid], PollFlags::IN));
            }
            match poll(&mut fds, timeout.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            // Oldest connection first: a request written before another process connected
            // (an attach that does not wait for its answer, then a `list` prompted by it)
            // is answered first.
            let mut rc: Vec<(u64, PollFlags)> = client_ids
                .iter()
                .zip(&fds[1..])
                .filter(|(_, f)| !f.revents().is_empty())
                .map(|(id, f)| (*id, f.revents()))
                .collect();
            rc.sort_unstable_by_key(|(id, _)| *id);
            let rp: Vec<u32> = pids
                .iter()
                .zip(&fds[1 + client_ids.len()..])
                .filter(|(_, f)| !f.revents().is_empty())
                .map(|(p, _)| *p)
                .collect();
            (!fds[0].revents().is_empty(), rc, rp)
        };
        if ready_listener || !ready_clients.is_empty() {
            st.heard_at = Instant::now();
        }
        if ready_listener {
            st.accept(&listener);
        }
        for (id, ev) in ready_clients {
            st.service(
                id,
                ev.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR),
            );
        }
        if !ready_pids.is_empty() {
            st.adopted_exited(&ready_pids);
        }
        if !st.locked.is_empty() && st.locked_checked.elapsed() >= LOCKED_RETRY {
            st.locked_checked = Instant::now();
            let again: Vec<PathBuf> = st.locked.drain().collect();
            for p in again {
                st.segments.entry(p.clone()).or_default();
                st.pending.insert(p);
            }
        }
        if st.pending.is_empty() && !st.sweep_needed {
            st.unsettled_since = None;
        } else if st.heard_at.elapsed() >= SETTLE_QUIET
            || st
                .unsettled_since
                .get_or_insert_with(Instant::now)
                .elapsed()
                >= SETTLE_DELAY
        {
            st.flush();
            st.unsettled_since = None;
        }
    }
}

impl State {
    fn note(&mut self, kind: Kind, msg: &str) {
        self.log.line(kind, msg, false);
    }

    fn accept(&mut self, listener: &UnixListener) {
        for _ in 0..ACCEPT_PER_ROUND {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if e.raw_os_error() == Some(libc::EMFILE)
                        || e.raw_os_error() == Some(libc::ENFILE) =>
                {
                    // Out of descriptors: waiting clients stay queued in the backlog until
                    // one leaves; don't spin on a listener we cannot drain.
                    self.accept_paused = true;
                    self.note(
                        Kind::Other,
                        &format!("accept paused: {e} ({} clients)", self.clients.len()),
                    );
                    return;
                }
                Err(e) => {
                    self.note(Kind::Other, &format!("accept failed: {e}"));
                    return;
                }
            };
            let cred = match rustix::net::sockopt::socket_peercred(&stream) {
                Ok(c) => c,
                Err(_) => continue,
            };
            // Only this user's processes may talk to this user's supervisor (the socket's
            // directory already keeps others out; this holds even if it did not).
            if cred.uid != rustix::process::geteuid() {
                self.note(
                    Kind::Other,
                    &format!("refused a connection from uid {}", cred.uid.as_raw()),
                );
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.clients.insert(
                id,
                Client {
                    stream,
                    pid: cred.pid.as_raw_nonzero().get() as u32,
                    inbuf: Vec::new(),
                    out: Vec::new(),
                    sent: 0,
                    uses: HashSet::new(),
                },
            );
        }
    }

    /// Read what the client sent (bounded per round), answer complete lines while its
    /// unread replies are few, write what it takes.
    fn service(&mut self, id: u64, readable: bool) {
        let mut closed = false;
        if readable {
            let Some(c) = self.clients.get_mut(&id) else {
                return;
            };
            let mut chunk = [0u8; 16 << 10];
            let mut got = 0;
            while got < READ_PER_ROUND {
                match c.stream.read(&mut chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => {
                        c.inbuf.extend_from_slice(&chunk[..n]);
                        got += n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
        }
        loop {
            // Answer every complete line, even from a client that has just closed (its
            // last DROPs count); a live one only while its replies are being read.
            let line = {
                let Some(c) = self.clients.get_mut(&id) else {
                    return;
                };
                if !closed && c.unsent() >= OUT_HIGH {
                    break;
                }
                let Some(nl) = c.inbuf.iter().position(|&b| b == b'\n') else {
                    if c.inbuf.len() > LINE_MAX {
                        closed = true; // not our protocol
                    }
                    break;
                };
                let line: Vec<u8> = c.inbuf.drain(..=nl).collect();
                line
            };
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let reply = self.handle(id, &text);
            if let Some(c) = self.clients.get_mut(&id) {
                if !closed {
                    c.out.extend_from_slice(reply.as_bytes());
                    if c.unsent() >= OUT_HIGH && !c.write_out() {
                        closed = true;
                    }
                }
            }
        }
        if let Some(c) = self.clients.get_mut(&id) {
            if !closed && !c.write_out() {
                closed = true;
            }
        }
        if closed {
            self.client_gone(id);
        }
    }

    fn register(&mut self, id: u64, path: PathBuf) {
        let c = self.clients.get_mut(&id).expect("live client");
        c.uses.insert(path.clone());
        self.locked.remove(&path);
        self.segments.entry(path).or_default().clients.insert(id);
    }

    fn handle(&mut self, id: u64, line: &str) -> String {
        match Request::parse(line) {
            Some(Request::Hello(_)) => format!("OK {}\n", std::process::id()),
            Some(Request::New(path)) => {
                if let Some(dir) = path.parent() {
                    if !self.dirs.contains(dir) {
                        self.dirs.insert(dir.to_owned());
                    }
                }
                self.register(id, path);
                "OK\n".into()
            }
            Some(Request::Use(path)) => {
                self.register(id, path);
                "OK\n".into()
            }
            Some(Request::Drop(path)) => {
                self.drop_use(id, path);
                "OK\n".into()
            }
            Some(Request::DropMany(paths)) => {
                for path in paths {
                    self.drop_use(id, path);
                }
                "OK\n".into()
            }
            Some(Request::Pin { holder, path }) => match self.pin(holder, path) {
                Ok(()) => "OK\n".into(),
                Err(why) => {
                    self.note(Kind::Other, &format!("refused a PIN: {why}"));
                    format!("ERR {why}\n")
                }
            },
            Some(Request::List) => {
                // A question about the state: answered from the settled state (the scan
                // that may wait for [`SETTLE_DELAY`] runs now).
                self.flush();
                let mut out = String::new();
                let mut paths: Vec<&PathBuf> = self.segments.keys().collect();
                paths.sort();
                for p in &paths {
                    let seg = &self.segments[*p];
                    let mut pids: Vec<u32> = seg
                        .clients
                        .iter()
                        .filter_map(|c| self.clients.get(c).map(|c| c.pid))
                        .chain(seg.adopted.iter().copied())
                        .collect();
                    pids.sort_unstable();
                    pids.dedup();
                    out.push_str(&encode_seg(p, &pids));
                }
                out.push_str(&format!("END {}\n", paths.len()));
                out
            }
            None => "ERR unknown request\n".into(),
        }
    }

    /// `PIN holder path`: keep `path` while `holder` has users of its own. Both must be
    /// `shmstore-…` names (no `..`) in one segment directory, so that a client cannot make
    /// the supervisor keep, or later remove, a file anywhere else (what it removes is further
    /// checked by `sweep::remove_if_ours`). A path not tracked yet (either one) is tracked
    /// from now on, without a client (a PIN makes nobody a user), and settled this round
    /// like any segment.
    fn pin(&mut self, holder: PathBuf, path: PathBuf) -> Result<(), String> {
        use std::path::Component;
        for p in [&holder, &path] {
            let named = p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(crate::segment::PREFIX));
            let plain = p
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
            if !named || !plain {
                return Err(format!("{} is not a segment's name", p.display()));
            }
        }
        if holder == path {
            return Err(format!("{} cannot pin itself", path.display()));
        }
        if holder.parent() != path.parent() {
            return Err(format!(
                "{} and {} are not in the same directory",
                holder.display(),
                path.display()
            ));
        }
        if !self.in_segment_dir(&path) {
            return Err(format!("{} is not in a segment directory", path.display()));
        }
        for p in [&holder, &path] {
            if !self.segments.contains_key(p) {
                self.locked.remove(p);
                self.segments.insert(p.clone(), Segment::default());
                self.pending.insert(p.clone());
            }
        }
        let seg = self.segments.get_mut(&path).expect("tracked above");
        if seg.pinned_by.insert(holder.clone()) {
            self.pins.entry(holder).or_default().insert(path.clone());
            // Settled again: it may have no user of its own (and its holder none either).
            self.pending.insert(path);
        }
        Ok(())
    }

    /// Whether `path` is kept by a pin: one of its holders has users of its own (clients or
    /// adopted processes). Chains are not followed: a holder that is itself only pinned
    /// keeps nothing, so a cycle of pins keeps nothing once none of them has a user.
    fn pinned(&self, path: &Path) -> bool {
        self.segments.get(path).is_some_and(|seg| {
            seg.pinned_by
                .iter()
                .any(|h| self.segments.get(h).is_some_and(Segment::has_users))
        })
    }

    /// Stop tracking `path` (every way a segment leaves `segments` goes through here): what
    /// it pinned loses it as a holder and is settled again (this round: see [`State::flush`]),
    /// and its own holders forget it.
    fn forget(&mut self, path: &Path) -> Option<Segment> {
        let seg = self.segments.remove(path)?;
        for p in self.pins.remove(path).unwrap_or_default() {
            if let Some(s) = self.segments.get_mut(&p) {
                s.pinned_by.remove(path);
            }
            self.pending.insert(p);
        }
        for h in &seg.pinned_by {
            if let Some(pinned) = self.pins.get_mut(h) {
                pinned.remove(path);
                if pinned.is_empty() {
                    self.pins.remove(h);
                }
            }
        }
        Some(seg)
    }

    fn drop_use(&mut self, id: u64, path: PathBuf) {
        let c = self.clients.get_mut(&id).expect("live client");
        if c.uses.remove(&path) {
            if let Some(seg) = self.segments.get_mut(&path) {
                seg.clients.remove(&id);
            }
            self.pending.insert(path);
        }
    }

    fn client_gone(&mut self, id: u64) {
        let Some(c) = self.clients.remove(&id) else {
            return;
        };
        self.accept_paused = false;
        if c.uses.is_empty() {
            return; // it only asked questions
        }
        for p in &c.uses {
            if let Some(seg) = self.segments.get_mut(p) {
                seg.clients.remove(&id);
            }
        }
        self.pending.extend(c.uses);
        // A dead client may have left half-built (`.part-`) files behind.
        self.sweep_needed = true;
    }

    fn adopted_exited(&mut self, pids: &[u32]) {
        for pid in pids {
            self.pidfds.remove(pid);
            for (path, seg) in self.segments.iter_mut() {
                if seg.adopted.remove(pid) {
                    self.pending.insert(path.clone());
                }
            }
        }
    }

    /// Settle everything that changed this round with one /proc scan: unlink segments that
    /// no client uses and no live process maps or holds open; adopt the processes that
    /// still do (not clients: e.g. forked children, or processes with the supervisor off);
    /// remove orphaned files (including `.part-` files of dead writers).
    ///
    /// A segment kept only by a pin ([`State::pinned`]) is not removed; when its holder is
    /// removed (or loses its last user) it is settled again, in the same call: removing a
    /// holder puts what it pinned back into `pending`, and this goes on until nothing is
    /// pending. That ends: each further pass follows the removal of a holder, and nothing
    /// removed here is tracked again before this returns (only paths of the pass's own scan
    /// can be adopted).
    ///
    /// What uses a file is read in one order, each read after the one before: a process's
    /// descriptors, then its mappings (`sweep::holders`), then the cells of the channels.
    /// Users move only forward along it (a reader opens, maps, closes; a putter maps its
    /// object, gives it to a channel, may die), so a user that moves between two reads is
    /// seen by the later one.
    fn flush(&mut self) {
        loop {
            self.flush_once();
            if self.pending.is_empty() {
                break;
            }
        }
    }

    fn flush_once(&mut self) {
        let mut settle = std::mem::take(&mut self.pending);
        // A holder that lost its last user no longer keeps what it pins: look at those too.
        let released: Vec<PathBuf> = settle
            .iter()
            .filter(|p| self.segments.get(*p).is_some_and(|s| !s.has_users()))
            .filter_map(|p| self.pins.get(p))
            .flatten()
            .cloned()
            .collect();
        settle.extend(released);
        let mut idle: HashSet<PathBuf> = HashSet::new();
        for p in settle {
            let Some(seg) = self.segments.get(&p) else {
                continue;
            };
            if seg.has_users() {
                continue;
            }
            if !(self.in_segment_dir(&p) && p.symlink_metadata().is_ok()) {
                // Already unlinked (e.g. by `unlink()`), or a file that is not ours to
                // remove (a saved file attached by name, a file of another user).
                self.forget(&p);
            } else if !self.pinned(&p) {
                idle.insert(p);
            }
        }
        let orphans: HashSet<PathBuf> = if std::mem::take(&mut self.sweep_needed) {
            self.dirs
                .iter()
                .flat_map(|d| segment_files(d))
                .filter(|p| !self.segments.contains_key(p) && !self.locked.contains(p))
                .collect()
        } else {
            HashSet::new()
        };
        if idle.is_empty() && orphans.is_empty() {
            return;
        }
        // Identify each file before the scan: the decision is about that file, even if the
        // name is removed and created again meanwhile.
        let mut ids: HashMap<PathBuf, FileId> = HashMap::new();
        for p in idle.union(&orphans) {
            match file_id_nofollow(p) {
                Some(id) => {
                    ids.insert(p.clone(), id);
                }
                None => {
                    self.forget(p); // gone already
                }
            }
        }
        let all: HashSet<PathBuf> = ids.keys().cloned().collect();
        let users = holders(&all);
        let mut paths: Vec<PathBuf> = all.into_iter().collect();
        paths.sort();
        let mut unused = Vec::new();
        for path in paths {
            let pids = users.get(&path).map(Vec::as_slice).unwrap_or(&[]);
            let adopted = pids.iter().filter(|&&pid| self.adopt(&path, pid)).count();
            if adopted > 0 {
                let msg = format!(
                    "{} is mapped by {pids:?} (not clients): waiting",
                    path.display()
                );
                self.note(Kind::Waiting, &msg);
            } else {
                unused.push(path);
            }
        }
        #[cfg(test)]
        self.between_reads();
        // Then what the channels hold, read after the processes were: a putter that gives
        // an object to a channel and dies is seen by one of the two reads (in this order:
        // holding it, or the channel holding it; the other order can miss both).
        //
        // An idle one: a pin may live in another supervisor of this user (its processes
        // found another state directory): an arena taken from a channel here, whose
        // putter and its pin are another supervisor's, lost its last user here while the
        // channel still holds its other objects. What a channel tracked here holds is
        // pinned to it.
        let (unused_orphans, unused_idle): (HashSet<PathBuf>, HashSet<PathBuf>) =
            unused.iter().cloned().partition(|p| orphans.contains(p));
        self.pin_held_by_tracked_channels(&unused_idle);
        // An orphan: after the putter and the supervisor that knew its pin were both
        // killed, nothing else says that it is still wanted. Every channel file of the
        // directories is read.
        self.pin_held_by_channels(&unused_orphans);
        // Every adoption and pin first: a holder adopted by this scan keeps what it pins.
        for path in unused {
            if self.pinned(&path) {
                continue;
            }
            // Pinned just now to a channel this scan did not look at (tracked by that pin,
            // its users unknown yet): the next pass settles both.
            let holder_unsettled = self
                .segments
                .get(&path)
                .is_some_and(|s| s.pinned_by.iter().any(|h| self.pending.contains(h)));
            if !holder_unsettled {
                self.remove(&path, ids[&path]);
            }
        }
    }

    /// Pin each of `orphans` that a channel in a segment directory still holds (a cell
    /// published and not handed back names it) to that channel, as its putter did (`PIN`):
    /// after the putter and the supervisor that knew its pin were both killed, nothing else
    /// says that the object is still wanted, and no live process maps it. A cell's claim
    /// only keeps a file while the channel has users; it never removes anything.
    fn pin_held_by_channels(&mut self, orphans: &HashSet<PathBuf>) {
        if orphans.is_empty() {
            return;
        }
        // Listed again, not taken from the round's list of orphans: what the channels hold is
        // read after the processes were, and a channel made since then counts too.
        let files: Vec<PathBuf> = self.dirs.iter().flat_map(|d| segment_files(d)).collect();
        self.pin_what_channels_hold(files, orphans);
    }

    /// Pin each of `among` that one of `channels` (files that may be channels: others hold
    /// nothing) still holds in a cell to that channel.
    fn pin_what_channels_hold(&mut self, channels: Vec<PathBuf>, among: &HashSet<PathBuf>) {
        for chan in channels {
            for held in crate::channel::scan::held_paths(&chan) {
                if among.contains(&held) && held.parent() == chan.parent() {
                    match self.pin(chan.clone(), held.clone()) {
                        Ok(()) => self.note(
                            Kind::Waiting,
                            &format!(
                                "{} is held by channel {}: kept while the channel is in use",
                                held.display(),
                                chan.display()
                            ),
                        ),
                        Err(why) => self.note(Kind::Other, &format!("not pinned: {why}")),
                    }
                }
            }
        }
    }

    /// Pin each of `idle` that a channel this supervisor tracks still holds to that channel
    /// (whether a tracked file is a channel is read from its magic once that says, and
    /// remembered with it). The pin keeps it while the channel has users: clients, or
    /// processes that map it, adopted by the scan that follows (a channel that lost its
    /// last client here is settled in the same round).
    fn pin_held_by_tracked_channels(&mut self, idle: &HashSet<PathBuf>) {
        if idle.is_empty() {
            return;
        }
        let dirs: HashSet<&Path> = idle.iter().filter_map(|p| p.parent()).collect();
        let mut channels = Vec::new();
        for (path, seg) in self.segments.iter_mut() {
            if !path.parent().is_some_and(|d| dirs.contains(d)) {
                continue;
            }
            if seg.is_channel.is_none() {
                seg.is_channel = crate::channel::scan::channel_magic(path);
            }
            if seg.is_channel == Some(true) {
                channels.push(path.clone());
            }
        }
        self.pin_what_channels_hold(channels, idle);
    }

    /// Run the test hooks set for one of this supervisor's directories ([`BETWEEN_READS`]).
    #[cfg(test)]
    fn between_reads(&self) {
        let mine: Vec<BetweenReads> = {
            let mut hooks = BETWEEN_READS.lock().unwrap_or_else(|p| p.into_inner());
            let (mine, others) = std::mem::take(&mut *hooks)
                .into_iter()
                .partition(|(dir, _)| self.dirs.contains(dir));
            *hooks = others;
            mine.into_iter().map(|(_, hook)| hook).collect()
        };
        for hook in mine {
            hook();
        }
    }

    fn in_segment_dir(&self, path: &Path) -> bool {
        path.parent().is_some_and(|d| self.dirs.contains(d))
    }

    /// Watch `pid` (which maps or holds `path`) until it exits. False if it is already gone
    /// or (pid reused between the scan and the pidfd) no longer uses the segment.
    fn adopt(&mut self, path: &Path, pid: u32) -> bool {
        if let std::collections::hash_map::Entry::Vacant(slot) = self.pidfds.entry(pid) {
            let Some(p) = Pid::from_raw(pid as i32) else {
                return false;
            };
            let Ok(fd) = pidfd_open(p, PidfdFlags::empty()) else {
                return false; // already gone
            };
            // The pidfd names one process for good; make sure it is the one we saw.
            let one: HashSet<PathBuf> = [path.to_owned()].into();
            if holders_among(&one, [pid]).is_empty() {
                return false;
            }
            slot.insert(fd);
        }
        self.segments
            .entry(path.to_owned())
            .or_default()
            .adopted
            .insert(pid);
        true
    }

    fn remove(&mut self, path: &Path, id: FileId) {
        // A name that is registered again (a new store under the same name) stays tracked.
        let reused = self
            .segments
            .get(path)
            .is_some_and(|s| !s.clients.is_empty() || !s.adopted.is_empty());
        if reused {
            return;
        }
        let tracked = self.forget(path).is_some();
        match remove_if_ours(path, id) {
            Ok(Removal::Removed) if tracked => self.note(
                Kind::Unlinked,
                &format!("unlinked {} (no user left)", path.display()),
            ),
            Ok(Removal::Removed) => self.note(
                Kind::Orphan,
                &format!("sweep: removed orphan {}", path.display()),
            ),
            Ok(Removal::Gone) => {}
            Ok(Removal::NotOurs) => self.note(
                Kind::Other,
                &format!(
                    "left {} in place: not a segment shmstore made (a saved file, or not ours)",
                    path.display()
                ),
            ),
            Ok(Removal::Locked) => {
                if self.locked.insert(path.to_owned()) {
                    self.note(
                        Kind::Waiting,
                        &format!(
                            "{} is locked by a reader that is not a client: waiting",
                            path.display()
                        ),
                    );
                }
            }
            Err(e) => self.note(
                Kind::Other,
                &format!("could not unlink {}: {e}", path.display()),
            ),
        }
    }
}
