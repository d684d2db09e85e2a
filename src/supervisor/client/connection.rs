//! A connection to the supervisor and its conversation (requests, replies read later, the
//! deadlines), connecting, and the one-off queries.

use super::*;

/// A connection to the supervisor. The socket stays non-blocking: every wait is a `poll`
/// with a deadline, and a request can be written without waiting for its reply.
pub(super) struct Conn {
    pub(super) sock: UnixStream,
    /// Bytes received and not yet taken as lines.
    pub(super) buf: Vec<u8>,
    pub(super) supervisor: u32,
    /// Requests written whose replies are not read yet, oldest first (see [`Pending`]).
    pub(super) pending: VecDeque<Pending>,
    /// The supervisor closed the connection (after what is in `buf`).
    pub(super) eof: bool,
    /// Opened at import ([`prepare`]) for the supervisor in this state directory with this
    /// name, and not used since (see [`own_conn`]).
    pub(super) prepared: Option<(PathBuf, String)>,
}

/// A request whose reply is read later: the HELLO of a connection opened at import, or a
/// USE written by an attach that did not wait (see [`use_segment_nowait`]).
pub(super) struct Pending {
    /// The segment of a USE (`None`: a HELLO).
    pub(super) path: Option<PathBuf>,
    pub(super) sent: Instant,
}

/// Replies left unread before the next conversation reads them all.
pub(super) const MAX_PENDING: usize = 64;

impl Conn {
    pub(super) fn new(sock: UnixStream, supervisor: u32) -> Self {
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
    pub(super) fn wait(&self, events: PollFlags, until: Instant) -> io::Result<bool> {
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
    pub(super) fn send_all(&mut self, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
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
    pub(super) fn fill(&mut self) -> io::Result<()> {
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
    pub(super) fn take_line(&mut self) -> Option<String> {
        let nl = self.buf.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.buf.drain(..=nl).collect();
        Some(String::from_utf8_lossy(&line[..nl]).trim_end().to_owned())
    }

    /// One line by `until` (`TimedOut` if none).
    pub(super) fn line_by(&mut self, until: Instant) -> io::Result<String> {
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
    pub(super) fn requests(&mut self, reqs: &[Request], deadline: Instant) -> io::Result<()> {
        for reply in self.exchange(reqs, deadline)? {
            if !reply.starts_with("OK") {
                return Err(io::Error::other(format!("the supervisor said {reply:?}")));
            }
        }
        Ok(())
    }

    /// Send `reqs` (at most [`BATCH`] at once) and read one reply each, whatever it says,
    /// by `deadline` (after the replies still pending).
    pub(super) fn exchange(
        &mut self,
        reqs: &[Request],
        deadline: Instant,
    ) -> io::Result<Vec<String>> {
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
    pub(super) fn settle(&mut self, deadline: Instant) -> io::Result<()> {
        while !self.pending.is_empty() {
            let reply = self.reply(deadline)?;
            self.answered(&reply)?;
        }
        Ok(())
    }

    /// Take the pending replies that have arrived, without waiting.
    pub(super) fn poll_pending(&mut self) -> io::Result<()> {
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
    pub(super) fn answered(&mut self, reply: &str) -> io::Result<()> {
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
    pub(super) fn reply(&mut self, deadline: Instant) -> io::Result<String> {
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

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// Open a connection to the supervisor named `name` whose socket is in `dir` and check it
/// is ours (`SO_PEERCRED`), by `deadline`; nothing is said yet.
pub(super) fn open_conn(
    dir: &PrivateDir,
    name: &str,
    deadline: Instant,
) -> Result<Conn, Unavailable> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let path = crate::supervisor::server::socket_path(dir, name)
        .map_err(|e| Unavailable::Other(e.to_string()))?;
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
pub(super) fn connect_in(
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
pub(super) fn lock_holder(dir: &PrivateDir, name: &str) -> Option<u32> {
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

pub(super) fn no_answer(pid: u32) -> Unavailable {
    Unavailable::NoAnswer(format!("the supervisor (pid {pid}) did not answer in time"))
}

pub(super) fn connect(deadline: Instant, first: &[Request]) -> Result<Conn, Unavailable> {
    let dir = crate::supervisor::state_dir().map_err(|e| Unavailable::UnsafeDir(e.to_string()))?;
    connect_in(&dir, &crate::supervisor::socket_name(), deadline, first)
}

/// Open a fresh connection (never starts a supervisor). `Ok(None)`: none is running.
pub(super) fn query(deadline: Instant) -> io::Result<Option<Conn>> {
    match connect(deadline, &[]) {
        Ok(c) => Ok(Some(c)),
        Err(Unavailable::NotRunning(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Deadline of the questions asked by tools (`list`, `supervisor_pid`): not on any hot path,
/// so more generous than [`timeout`], but still bounded.
pub(super) fn query_timeout() -> Duration {
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
    let dir = crate::supervisor::state_dir()
        .map_err(|e| io::Error::from(Unavailable::UnsafeDir(e.to_string())))?;
    list_in(&dir, &crate::supervisor::socket_name())
}

/// [`list`] from the supervisor named `name` whose socket is in `dir`.
pub(crate) fn list_in(dir: &PrivateDir, name: &str) -> io::Result<Option<Vec<SegmentUse>>> {
    match list_once(dir, name) {
        Err(e) if e.kind() == io::ErrorKind::Interrupted => list_once(dir, name),
        r => r,
    }
}

/// One LIST round trip. `ErrorKind::Interrupted`: the connection closed before any answer.
pub(super) fn list_once(dir: &PrivateDir, name: &str) -> io::Result<Option<Vec<SegmentUse>>> {
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
    pub(super) fn deadline() -> Instant {
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
