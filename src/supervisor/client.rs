//! The client side: every process that creates or attaches a segment tells the supervisor,
//! starting it if none is running. A forked child notices the pid change and opens its own
//! connection (keeping the inherited one open, so its parent's segments stay registered
//! while the child, which maps them too, is alive).

use std::collections::HashMap;
use std::io::{self, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::proto::{parse_seg, Request, SegmentUse};
use super::server::read_line;

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

struct Conn {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    pid: u32,
}

#[derive(Default)]
struct State {
    conn: Option<Conn>,
    /// Segment path -> number of live stores using it in this process.
    uses: HashMap<PathBuf, usize>,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(Default::default)
}

fn connect() -> io::Result<Conn> {
    connect_to(&super::socket_name())
}

fn connect_to(name: &str) -> io::Result<Conn> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let stream = UnixStream::connect_addr(&addr)?;
    let cred = rustix::net::sockopt::socket_peercred(&stream)?;
    if cred.uid != rustix::process::geteuid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the supervisor socket belongs to uid {}", cred.uid.as_raw()),
        ));
    }
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut conn = Conn {
        reader: BufReader::new(stream.try_clone()?),
        writer: stream,
        pid: std::process::id(),
    };
    let reply = conn.request(&Request::Hello(conn.pid))?;
    if !reply.starts_with("OK") {
        return Err(io::Error::other(format!("supervisor said {reply:?}")));
    }
    Ok(conn)
}

impl Conn {
    fn request(&mut self, req: &Request) -> io::Result<String> {
        self.writer.write_all(req.encode().as_bytes())?;
        read_line(&mut self.reader)
    }
}

fn spawn_supervisor() -> io::Result<()> {
    let cmd = SPAWN
        .get()
        .ok_or_else(|| io::Error::other("no way to start a supervisor was configured"))?;
    // The started process forks once and exits (the real supervisor is its child, in its
    // own session): waiting for it leaves no zombie behind.
    let status = Command::new(&cmd.program)
        .args(&cmd.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "the supervisor failed to start ({status})"
        )));
    }
    Ok(())
}

/// Connect, starting a supervisor if none answers; then tell it every segment in use.
fn ensure(st: &mut State, may_spawn: bool) -> io::Result<bool> {
    if let Some(c) = &st.conn {
        if c.pid == std::process::id() {
            return Ok(false);
        }
        // Forked child: keep the inherited socket open (see the module docs), but never
        // talk on it: the parent owns that conversation.
        std::mem::forget(st.conn.take());
    }
    let conn = match connect() {
        Ok(c) => c,
        Err(_) if may_spawn => {
            spawn_supervisor()?;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match connect() {
                    Ok(c) => break c,
                    Err(e) if Instant::now() >= deadline => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        Err(e) => return Err(e),
    };
    st.conn = Some(conn);
    let paths: Vec<PathBuf> = st.uses.keys().cloned().collect();
    let conn = st.conn.as_mut().expect("just connected");
    for p in paths {
        conn.request(&Request::Use(p))?;
    }
    Ok(true)
}

fn send(st: &mut State, req: &Request, may_spawn: bool) -> io::Result<()> {
    for attempt in 0..2 {
        let fresh = ensure(st, may_spawn)?;
        if fresh && matches!(req, Request::Use(_)) {
            return Ok(()); // `ensure` registered everything in `uses`, this path included
        }
        let conn = st.conn.as_mut().expect("connected");
        match conn.request(req) {
            Ok(r) if r == "OK" => return Ok(()),
            Ok(r) => return Err(io::Error::other(format!("supervisor said {r:?}"))),
            Err(e) if attempt == 1 => return Err(e),
            Err(_) => st.conn = None, // it died: reconnect (and re-register) once
        }
    }
    unreachable!()
}

/// This process uses the segment at `path` (call before mapping it). An error means the
/// supervisor is unavailable; the segment is then only covered by the orphan sweep.
pub fn use_segment(path: &Path) -> io::Result<()> {
    if !enabled() {
        return Err(io::Error::other(
            "the supervisor is disabled (SHMSTORE_SUPERVISOR=0)",
        ));
    }
    let mut st = state().lock().unwrap_or_else(|p| p.into_inner());
    let n = st.uses.entry(path.to_owned()).or_default();
    *n += 1;
    if *n > 1 {
        return Ok(());
    }
    let res = send(&mut st, &Request::Use(path.to_owned()), true);
    if res.is_err() {
        st.uses.remove(path);
    }
    res
}

/// This process no longer uses the segment at `path` (its last mapping here is gone).
pub fn drop_segment(path: &Path) {
    let mut st = state().lock().unwrap_or_else(|p| p.into_inner());
    let Some(n) = st.uses.get_mut(path) else {
        return;
    };
    *n -= 1;
    if *n > 0 {
        return;
    }
    st.uses.remove(path);
    let _ = send(&mut st, &Request::Drop(path.to_owned()), false);
}

/// What the running supervisor tracks (None if no supervisor is running: never starts one).
pub fn list() -> Option<Vec<SegmentUse>> {
    let mut conn = connect().ok()?;
    conn.writer
        .write_all(Request::List.encode().as_bytes())
        .ok()?;
    let mut out = Vec::new();
    loop {
        let line = read_line(&mut conn.reader).ok()?;
        if line == "END" {
            return Some(out);
        }
        out.extend(parse_seg(&line));
    }
}

/// The pid of the running supervisor, if any.
pub fn supervisor_pid() -> Option<u32> {
    let mut conn = connect().ok()?;
    let reply = conn.request(&Request::Hello(std::process::id())).ok()?;
    reply.strip_prefix("OK ")?.parse().ok()
}

/// A raw connection, for tests of the server.
#[cfg(test)]
pub(crate) struct TestConn(Conn);

#[cfg(test)]
impl TestConn {
    pub(crate) fn connect(name: &str) -> io::Result<Self> {
        connect_to(name).map(TestConn)
    }
    pub(crate) fn request(&mut self, req: &Request) -> io::Result<String> {
        self.0.request(req)
    }
    pub(crate) fn list(&mut self) -> io::Result<Vec<String>> {
        self.0.writer.write_all(Request::List.encode().as_bytes())?;
        let mut lines = Vec::new();
        loop {
            let l = read_line(&mut self.0.reader)?;
            if l == "END" {
                return Ok(lines);
            }
            lines.push(l);
        }
    }
}
