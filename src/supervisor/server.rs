//! The supervisor's event loop: one thread, `poll(2)` over the listening socket, the client
//! connections and the pidfds of adopted processes.
//!
//! Decisions are batched: requests and deaths seen in one poll round only mark segments as
//! "to settle"; at the end of the round one /proc scan covers all of them (and the orphan
//! sweep), so a thousand clients dying at once cost one scan, not a thousand.

use std::collections::{HashMap, HashSet};
use std::io::{self, BufRead, Read, Write};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use super::proto::{encode_seg, Request};
use super::sweep::{file_id, holders, holders_among, remove_if_same, segment_files, FileId};

pub struct ServerConfig {
    /// Abstract socket name (see `super::socket_name`).
    pub name: String,
    /// Exit after this long with no registered segment and no adopted process.
    pub grace: Duration,
    /// Append a line per action here (None: no log).
    pub log: Option<PathBuf>,
    /// Directories swept for orphans at start and after a client dies.
    pub sweep_dirs: Vec<PathBuf>,
}

struct Client {
    stream: UnixStream,
    pid: u32,
    buf: Vec<u8>,
    uses: HashSet<PathBuf>,
}

#[derive(Default)]
struct Segment {
    clients: HashSet<u64>,
    adopted: HashSet<u32>,
}

struct State {
    cfg: ServerConfig,
    log: Option<std::fs::File>,
    clients: HashMap<u64, Client>,
    next_id: u64,
    segments: HashMap<PathBuf, Segment>,
    pidfds: HashMap<u32, OwnedFd>,
    dirs: HashSet<PathBuf>,
    /// Segments whose users changed this round.
    pending: HashSet<PathBuf>,
    /// A client that had registered segments died: look for orphans this round.
    sweep_needed: bool,
    /// accept() hit the descriptor limit: stop polling the listener until a client leaves.
    accept_paused: bool,
}

/// Bind the socket. `Ok(None)` when another supervisor already listens on it.
pub fn bind(name: &str) -> io::Result<Option<UnixListener>> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    match UnixListener::bind_addr(&addr) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(e),
    }
}

/// Run until idle for `grace`. Returns at once if another supervisor owns the socket.
pub fn run(cfg: ServerConfig) -> io::Result<()> {
    raise_fd_limit();
    let Some(listener) = bind(&cfg.name)? else {
        return Ok(());
    };
    serve(listener, cfg)
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

/// Serve on an already bound listener.
pub fn serve(listener: UnixListener, cfg: ServerConfig) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let log = cfg.log.as_ref().and_then(|p| open_log(p).ok());
    let mut st = State {
        dirs: cfg.sweep_dirs.iter().cloned().collect(),
        cfg,
        log,
        clients: HashMap::new(),
        next_id: 0,
        segments: HashMap::new(),
        pidfds: HashMap::new(),
        pending: HashSet::new(),
        sweep_needed: true, // start-up: take over what a previous supervisor left
        accept_paused: false,
    };
    st.note(&format!(
        "supervisor {} started on @{}",
        std::process::id(),
        st.cfg.name
    ));
    st.flush();
    let mut idle_since = Some(Instant::now());
    loop {
        // Idle: nothing registered and nobody adopted. Clients that only asked questions
        // (ls, info) do not keep us alive; they reconnect (and restart us) if they need to.
        let idle = st.segments.is_empty() && st.clients.values().all(|c| c.uses.is_empty());
        if idle {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= st.cfg.grace {
                st.note("no segments left: exiting");
                return Ok(());
            }
        } else {
            idle_since = None;
        }
        let timeout = idle_since.map(|s| {
            let left = st.cfg.grace.saturating_sub(s.elapsed());
            Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as _,
            }
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
                fds.push(PollFd::new(&st.clients[id].stream, PollFlags::IN));
            }
            for pid in &pids {
                fds.push(PollFd::new(&st.pidfds[pid], PollFlags::IN));
            }
            match poll(&mut fds, timeout.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let fired = |f: &PollFd<'_>| !f.revents().is_empty();
            let rc: Vec<u64> = client_ids
                .iter()
                .zip(&fds[1..])
                .filter(|(_, f)| fired(f))
                .map(|(id, _)| *id)
                .collect();
            let rp: Vec<u32> = pids
                .iter()
                .zip(&fds[1 + client_ids.len()..])
                .filter(|(_, f)| fired(f))
                .map(|(p, _)| *p)
                .collect();
            (fired(&fds[0]), rc, rp)
        };
        if ready_listener {
            st.accept(&listener);
        }
        for id in ready_clients {
            st.read_client(id);
        }
        if !ready_pids.is_empty() {
            st.adopted_exited(&ready_pids);
        }
        st.flush();
    }
}

fn open_log(path: &Path) -> io::Result<std::fs::File> {
    if let Some(dir) = path.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
    }
    // Keep the log small: start over past 1 MiB.
    if path.metadata().map(|m| m.len() > 1 << 20).unwrap_or(false) {
        let _ = std::fs::remove_file(path);
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

impl State {
    fn note(&mut self, msg: &str) {
        if let Some(f) = self.log.as_mut() {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            let _ = writeln!(f, "{t:.3} {msg}");
        }
    }

    fn accept(&mut self, listener: &UnixListener) {
        loop {
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
                    self.note(&format!(
                        "accept paused: {e} ({} clients)",
                        self.clients.len()
                    ));
                    return;
                }
                Err(e) => {
                    self.note(&format!("accept failed: {e}"));
                    return;
                }
            };
            let cred = match rustix::net::sockopt::socket_peercred(&stream) {
                Ok(c) => c,
                Err(_) => continue,
            };
            // Only this user's processes may talk to this user's supervisor.
            if cred.uid != rustix::process::geteuid() {
                self.note(&format!(
                    "refused a connection from uid {}",
                    cred.uid.as_raw()
                ));
                continue;
            }
            let _ = stream.set_nonblocking(true);
            let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
            let id = self.next_id;
            self.next_id += 1;
            self.clients.insert(
                id,
                Client {
                    stream,
                    pid: cred.pid.as_raw_nonzero().get() as u32,
                    buf: Vec::new(),
                    uses: HashSet::new(),
                },
            );
        }
    }

    fn read_client(&mut self, id: u64) {
        let mut chunk = [0u8; 4096];
        let mut closed = false;
        if let Some(c) = self.clients.get_mut(&id) {
            loop {
                match c.stream.read(&mut chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
        }
        // Handle every complete line, even from a client that has just closed.
        loop {
            let line = {
                let Some(c) = self.clients.get_mut(&id) else {
                    return;
                };
                let Some(nl) = c.buf.iter().position(|&b| b == b'\n') else {
                    break;
                };
                let line: Vec<u8> = c.buf.drain(..=nl).collect();
                line
            };
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let reply = self.handle(id, &text);
            if let Some(c) = self.clients.get_mut(&id) {
                if c.stream.write_all(reply.as_bytes()).is_err() {
                    closed = true;
                }
            }
        }
        if closed {
            self.client_gone(id);
        }
    }

    fn handle(&mut self, id: u64, line: &str) -> String {
        match Request::parse(line) {
            Some(Request::Hello(_)) => format!("OK {}\n", std::process::id()),
            Some(Request::Use(path)) => {
                if let Some(dir) = path.parent() {
                    self.dirs.insert(dir.to_owned());
                }
                let c = self.clients.get_mut(&id).expect("live client");
                c.uses.insert(path.clone());
                self.segments.entry(path).or_default().clients.insert(id);
                "OK\n".into()
            }
            Some(Request::Drop(path)) => {
                let c = self.clients.get_mut(&id).expect("live client");
                if c.uses.remove(&path) {
                    if let Some(seg) = self.segments.get_mut(&path) {
                        seg.clients.remove(&id);
                    }
                    self.pending.insert(path);
                }
                "OK\n".into()
            }
            Some(Request::List) => {
                let mut out = String::new();
                let mut paths: Vec<&PathBuf> = self.segments.keys().collect();
                paths.sort();
                for p in paths {
                    let seg = &self.segments[p];
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
                out.push_str("END\n");
                out
            }
            None => "ERR unknown request\n".into(),
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
    fn flush(&mut self) {
        let mut idle: HashSet<PathBuf> = HashSet::new();
        for p in std::mem::take(&mut self.pending) {
            let Some(seg) = self.segments.get(&p) else {
                continue;
            };
            if !(seg.clients.is_empty() && seg.adopted.is_empty()) {
                continue;
            }
            if p.exists() {
                idle.insert(p);
            } else {
                self.segments.remove(&p); // already unlinked (e.g. by `unlink()`)
            }
        }
        let orphans: HashSet<PathBuf> = if std::mem::take(&mut self.sweep_needed) {
            self.dirs
                .iter()
                .flat_map(|d| segment_files(d))
                .filter(|p| !self.segments.contains_key(p))
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
            match file_id(p) {
                Some(id) => {
                    ids.insert(p.clone(), id);
                }
                None => {
                    self.segments.remove(p); // gone already
                }
            }
        }
        let all: HashSet<PathBuf> = ids.keys().cloned().collect();
        let users = holders(&all);
        for path in all {
            let pids = users.get(&path).map(Vec::as_slice).unwrap_or(&[]);
            let adopted = pids.iter().filter(|&&pid| self.adopt(&path, pid)).count();
            if adopted > 0 {
                let msg = format!(
                    "{} is mapped by {pids:?} (not clients): waiting",
                    path.display()
                );
                self.note(&msg);
            } else {
                self.remove(&path, ids[&path]);
            }
        }
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
        let tracked = self.segments.remove(path).is_some();
        match remove_if_same(path, id) {
            Ok(true) if tracked => {
                self.note(&format!("unlinked {} (no user left)", path.display()))
            }
            Ok(true) => self.note(&format!("sweep: removed orphan {}", path.display())),
            Ok(false) => {}
            Err(e) => self.note(&format!("could not unlink {}: {e}", path.display())),
        }
    }
}

/// Read one reply line (used by the client).
pub(crate) fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut s = String::new();
    if r.read_line(&mut s)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "supervisor closed the connection",
        ));
    }
    Ok(s.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::client::TestConn;
    use std::process::{Command, Stdio};

    fn start(grace_ms: u64, dir: &Path) -> (String, std::thread::JoinHandle<io::Result<()>>) {
        let name = format!(
            "shmstore-test-{}-{}",
            std::process::id(),
            crate::segment::random_name()
        );
        let listener = bind(&name).unwrap().expect("fresh name");
        let cfg = ServerConfig {
            name: name.clone(),
            grace: Duration::from_millis(grace_ms),
            log: Some(dir.join("supervisor.log")),
            sweep_dirs: vec![dir.to_owned()],
        };
        (name, std::thread::spawn(move || serve(listener, cfg)))
    }

    fn seg(dir: &Path, n: &str) -> PathBuf {
        let p = dir.join(format!("shmstore-{n}"));
        std::fs::write(&p, b"data").unwrap();
        p
    }

    #[test]
    fn last_client_gone_unlinks_and_shared_use_keeps() {
        let dir = tempfile::tempdir().unwrap();
        // Registered segments are created before the server starts, as a client would
        // (it says USE before the name exists), so the start-up sweep must leave them.
        let a_only = seg(dir.path(), "a");
        let shared = seg(dir.path(), "shared");
        let mut holder = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3<{} 4<{}; read line",
                a_only.display(),
                shared.display()
            ))
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let want: HashSet<PathBuf> = [a_only.clone(), shared.clone()].into();
        let deadline = Instant::now() + Duration::from_secs(10);
        while holders(&want).len() < 2 {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
        let (name, server) = start(200, dir.path());
        let mut a = TestConn::connect(&name).unwrap();
        let mut b = TestConn::connect(&name).unwrap();
        assert_eq!(a.request(&Request::Use(a_only.clone())).unwrap(), "OK");
        assert_eq!(a.request(&Request::Use(shared.clone())).unwrap(), "OK");
        assert_eq!(b.request(&Request::Use(shared.clone())).unwrap(), "OK");
        // The creator's file handles go (it has "mapped" and registered them).
        drop(holder.stdin.take());
        holder.wait().unwrap();
        drop(a); // like a SIGKILL: the connection closes
                 // The next request is answered after the server handled the close (one thread,
                 // and the kernel reports the EOF before our later request).
        let mut c = TestConn::connect(&name).unwrap();
        let _ = c.request(&Request::Hello(1)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while a_only.exists() {
            assert!(
                Instant::now() < deadline,
                "segment of a dead client not removed"
            );
            let _ = c.request(&Request::Hello(1));
        }
        assert!(
            shared.exists(),
            "a segment another client uses was removed: {}",
            std::fs::read_to_string(dir.path().join("supervisor.log")).unwrap_or_default()
        );
        assert_eq!(b.request(&Request::Drop(shared.clone())).unwrap(), "OK");
        // Settled at the end of the poll round that answered the DROP.
        let deadline = Instant::now() + Duration::from_secs(5);
        while shared.exists() {
            assert!(Instant::now() < deadline, "dropped segment not removed");
            let _ = b.request(&Request::Hello(1));
        }
        drop((b, c));
        server.join().unwrap().unwrap(); // idle -> exits after the grace
    }

    #[test]
    fn mapped_by_a_non_client_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        // File and holder exist before the server starts: its start-up sweep would
        // (rightly) remove a file nobody holds yet.
        let p = seg(dir.path(), "held");
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<{}; read line", p.display()))
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let want: HashSet<PathBuf> = [p.clone()].into();
        let deadline = Instant::now() + Duration::from_secs(10);
        while holders(&want).is_empty() {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
        let (name, server) = start(200, dir.path());
        let mut a = TestConn::connect(&name).unwrap();
        a.request(&Request::Use(p.clone())).unwrap();
        a.request(&Request::Drop(p.clone())).unwrap();
        assert!(p.exists(), "removed while another process holds it");
        let list = a.list().unwrap();
        assert_eq!(list.len(), 1);
        assert!(list[0].ends_with(&child.id().to_string()), "{list:?}");
        drop(child.stdin.take());
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while p.exists() {
            assert!(
                Instant::now() < deadline,
                "not removed after the holder exited"
            );
            let _ = a.request(&Request::Hello(1));
        }
        drop(a);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn takeover_sweeps_orphans_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let orphan = seg(dir.path(), "orphan");
        let part = seg(dir.path(), "x.part-123");
        let (_name, server) = start(50, dir.path());
        server.join().unwrap().unwrap();
        assert!(!orphan.exists() && !part.exists());
    }

    #[test]
    fn second_supervisor_on_the_same_name_steps_aside() {
        let dir = tempfile::tempdir().unwrap();
        let (name, server) = start(300, dir.path());
        assert!(bind(&name).unwrap().is_none());
        server.join().unwrap().unwrap();
    }
}
