//! Tests of the supervisor (server + client protocol) with real processes and files.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::client::TestConn;
use super::proto::Request;
use super::server::{bind, serve, ServerConfig};
use super::sweep::{holders, seal};
use crate::segment::{private_dir, PrivateDir};

struct World {
    root: tempfile::TempDir,
    name: String,
}

impl World {
    fn new() -> World {
        World {
            root: tempfile::tempdir().unwrap(),
            name: format!("test-{}", &crate::segment::random_name()[9..21]),
        }
    }

    fn dir(&self) -> &Path {
        self.root.path()
    }

    fn state(&self) -> PrivateDir {
        private_dir(&self.root.path().join("state"), true).unwrap()
    }

    fn log(&self) -> String {
        let p = self
            .root
            .path()
            .join("state")
            .join(format!("{}.log", self.name));
        std::fs::read_to_string(p).unwrap_or_default()
    }

    fn start(&self, grace_ms: u64) -> std::thread::JoinHandle<io::Result<()>> {
        let state = self.state();
        let bound = bind(&state, &self.name).unwrap().expect("fresh name");
        let cfg = ServerConfig {
            name: self.name.clone(),
            grace: Duration::from_millis(grace_ms),
            state,
            log: true,
            sweep_dirs: vec![self.dir().to_owned()],
        };
        std::thread::spawn(move || serve(bound, cfg))
    }

    fn conn(&self) -> TestConn {
        TestConn::connect(&self.state(), &self.name).unwrap()
    }
}

/// A file made like a sealed segment (mode 0400).
fn seg(dir: &Path, n: &str) -> PathBuf {
    let p = dir.join(format!("shmstore-{n}"));
    std::fs::write(&p, b"data").unwrap();
    seal(&p);
    p
}

/// A `sh` holding `paths` open until its stdin closes; returns once it does hold them.
fn holder(paths: &[&Path]) -> std::process::Child {
    let redirs: Vec<String> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{}<{}", i + 3, p.display()))
        .collect();
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!("exec {}; read line", redirs.join(" ")))
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let want: HashSet<PathBuf> = paths.iter().map(|p| p.to_path_buf()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while holders(&want).len() < paths.len() {
        assert!(
            Instant::now() < deadline,
            "the holder never opened the files"
        );
        std::thread::yield_now();
    }
    child
}

fn release(mut child: std::process::Child) {
    drop(child.stdin.take());
    child.wait().unwrap();
}

fn wait_gone(p: &Path, poke: &mut TestConn, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.exists() {
        assert!(Instant::now() < deadline, "{what}");
        let _ = poke.request(&Request::Hello(1));
    }
}

#[test]
fn last_client_gone_unlinks_and_shared_use_keeps() {
    let w = World::new();
    // Registered segments are created before the server starts, as a client would
    // (it says NEW before the name exists), so the start-up sweep must leave them.
    let a_only = seg(w.dir(), "a");
    let shared = seg(w.dir(), "shared");
    let h = holder(&[&a_only, &shared]);
    let server = w.start(200);
    let mut a = w.conn();
    let mut b = w.conn();
    assert_eq!(a.request(&Request::New(a_only.clone())).unwrap(), "OK");
    assert_eq!(a.request(&Request::New(shared.clone())).unwrap(), "OK");
    assert_eq!(b.request(&Request::Use(shared.clone())).unwrap(), "OK");
    // The creator's file handles go (it has "mapped" and registered them).
    release(h);
    drop(a); // like a SIGKILL: the connection closes
    let mut c = w.conn();
    wait_gone(&a_only, &mut c, "segment of a dead client not removed");
    assert!(
        shared.exists(),
        "a segment another client uses was removed: {}",
        w.log()
    );
    assert_eq!(b.request(&Request::Drop(shared.clone())).unwrap(), "OK");
    wait_gone(&shared, &mut b, "dropped segment not removed");
    drop((b, c));
    server.join().unwrap().unwrap(); // idle -> exits after the grace
}

#[test]
fn mapped_by_a_non_client_waits_for_it() {
    let w = World::new();
    // File and holder exist before the server starts: its start-up sweep would
    // (rightly) remove a file nobody holds yet.
    let p = seg(w.dir(), "held");
    let child = holder(&[&p]);
    let child_pid = child.id();
    let server = w.start(200);
    let mut a = w.conn();
    a.request(&Request::New(p.clone())).unwrap();
    a.request(&Request::Drop(p.clone())).unwrap();
    assert!(p.exists(), "removed while another process holds it");
    let list = a.list().unwrap();
    assert_eq!(list.len(), 1);
    assert!(list[0].ends_with(&child_pid.to_string()), "{list:?}");
    release(child);
    wait_gone(&p, &mut a, "not removed after the holder exited");
    drop(a);
    server.join().unwrap().unwrap();
}

#[test]
fn takeover_sweeps_orphans_at_start() {
    let w = World::new();
    let orphan = seg(w.dir(), "orphan");
    let part = w.dir().join("shmstore-x.part-123");
    std::fs::write(&part, b"x").unwrap();
    std::fs::set_permissions(&part, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // Not made by shmstore's writer: a saved file (0644), a symlink. Left alone.
    let saved = w.dir().join("shmstore-saved");
    std::fs::write(&saved, b"x").unwrap();
    let link = w.dir().join("shmstore-link");
    std::os::unix::fs::symlink(&saved, &link).unwrap();
    let server = w.start(50);
    server.join().unwrap().unwrap();
    assert!(!orphan.exists() && !part.exists());
    assert!(saved.exists() && link.symlink_metadata().is_ok());
}

#[test]
fn second_supervisor_on_the_same_name_steps_aside() {
    let w = World::new();
    let server = w.start(300);
    assert!(bind(&w.state(), &w.name).unwrap().is_none());
    server.join().unwrap().unwrap();
    // Its socket file is gone with it; a stale one would be replaced anyway.
    assert!(bind(&w.state(), &w.name).unwrap().is_some());
}

#[test]
fn files_outside_segment_dirs_and_saved_files_are_never_unlinked() {
    let w = World::new();
    let elsewhere = tempfile::tempdir().unwrap();
    // A sealed-looking file attached by name (USE) in a directory where no segment was
    // created: never removed, even though nobody uses it any more.
    let attached = seg(elsewhere.path(), "attached");
    // A saved file (not mode 0400) in a segment directory: not ours either.
    let saved = w.dir().join("shmstore-saved");
    std::fs::write(&saved, b"x").unwrap();
    let server = w.start(100);
    let mut a = w.conn();
    for p in [&attached, &saved] {
        assert_eq!(a.request(&Request::Use(p.clone())).unwrap(), "OK");
        assert_eq!(a.request(&Request::Drop(p.clone())).unwrap(), "OK");
    }
    // A client that had registered something dies: the orphan sweep runs too.
    a.request(&Request::Use(attached.clone())).unwrap();
    drop(a);
    let mut b = w.conn();
    for _ in 0..3 {
        b.request(&Request::Hello(1)).unwrap();
    }
    assert!(b.list().unwrap().is_empty());
    assert!(attached.exists() && saved.exists(), "{}", w.log());
    drop(b);
    server.join().unwrap().unwrap();
}

#[test]
fn list_streams_a_hundred_thousand_segments() {
    let w = World::new();
    let n = 100_000;
    // Cheap registrations (no files): the listing is about the reply, not the segments.
    // Made before the server starts: it exits when idle for its grace period.
    let reqs: Vec<Request> = (0..n)
        .map(|i| Request::Use(w.dir().join(format!("shmstore-fake-{i:06}"))))
        .collect();
    let server = w.start(1000);
    let mut a = w.conn();
    for chunk in reqs.chunks(1000) {
        let text: String = chunk.iter().map(Request::encode).collect();
        a.send_raw(text.as_bytes()).unwrap();
        for _ in chunk {
            assert_eq!(a.read_reply().unwrap(), "OK");
        }
    }
    let mut b = w.conn();
    let list = b.list().unwrap();
    assert_eq!(list.len(), n);
    drop((a, b));
    server.join().unwrap().unwrap();
}

#[test]
fn log_rotates_at_its_size_and_never_follows_a_symlink() {
    let w = World::new();
    let state = w.state();
    let log = w.dir().join("state").join(format!("{}.log", w.name));
    // Start with a log just under the limit: the next lines rotate it.
    std::fs::write(&log, vec![b'x'; super::server::LOG_MAX as usize - 10]).unwrap();
    let server = w.start(50);
    server.join().unwrap().unwrap();
    let rotated = w.dir().join("state").join(format!("{}.log.1", w.name));
    assert!(rotated.exists(), "not rotated");
    assert!(log.metadata().unwrap().len() < 1000);
    // A symlink in the log's place is never followed.
    std::fs::remove_file(&log).unwrap();
    let target = w.dir().join("victim");
    std::fs::write(&target, b"").unwrap();
    std::os::unix::fs::symlink(&target, &log).unwrap();
    drop(state);
    let server = w.start(50);
    server.join().unwrap().unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"");
}

/// Per kind: lines written plus lines the "left out" summaries count for that kind.
fn logged_per_kind(text: &str) -> std::collections::HashMap<String, u64> {
    let mut counts = std::collections::HashMap::new();
    for line in text.lines() {
        let (_, msg) = line.split_once(' ').unwrap();
        if let Some(rest) = msg.strip_prefix('(') {
            let (_, kinds) = rest.split_once(" a second: ").expect(line);
            for part in kinds.trim_end_matches(')').split(", ") {
                let (n, kind) = part.split_once(' ').expect(line);
                *counts.entry(kind.to_owned()).or_default() += n.parse::<u64>().expect(line);
            }
        } else {
            let kind = super::server::Kind::ALL
                .iter()
                .map(|k| k.label())
                .find(|label| msg.starts_with(&format!("{label} ")))
                .unwrap_or(msg);
            *counts.entry(kind.to_owned()).or_default() += 1;
        }
    }
    counts
}

#[test]
fn log_is_rate_limited_and_counts_what_it_leaves_out_per_kind() {
    use super::server::Kind;
    let w = World::new();
    let mut log = super::server::Log::new(&w.state(), &w.name, true);
    // Removals interleaved with other lines: a reader totalling removals from the log
    // must not count the others that were left out (it did when the summary was one
    // number).
    for i in 0..5000 {
        let kind = match i % 5 {
            0 => Kind::Waiting,
            1 => Kind::Orphan,
            4 => Kind::Other,
            _ => Kind::Unlinked,
        };
        log.line(kind, &format!("{} {i}", kind.label()), false);
    }
    log.line(Kind::Other, "last", true);
    let text = w.log();
    let written = text
        .lines()
        .filter(|l| !l.contains(" lines left out"))
        .count();
    assert!(written < 1000, "{written} lines written in a burst");
    assert!(
        text.contains(" lines left out, more than 50 a second: "),
        "{text}"
    );
    let counts = logged_per_kind(&text);
    assert_eq!(counts["unlinked"], 2000, "{counts:?}");
    assert_eq!(counts["removed orphan"], 1000, "{counts:?}");
    assert_eq!(counts["waiting"], 1000, "{counts:?}");
    assert_eq!(counts["other"], 1000, "{counts:?}");
    assert_eq!(counts["last"], 1);
    assert!(text.ends_with("last\n"));
}

/// What a stand-in supervisor does with one connection's `LIST`.
enum OnList {
    /// Close the connection without answering (a supervisor exiting while idle).
    Close,
    /// Remove the socket, then close without answering (it exited: none is running now).
    Exit,
    /// Write these lines, then close.
    Answer(&'static str),
}

/// Run `list_in` against a stand-in supervisor on `w`'s socket that answers `HELLO` and
/// treats the `LIST` of its n-th connection as `plan[n]`. Fails if the client connects more
/// often than `plan` says.
fn list_against(w: &World, plan: &[OnList]) -> io::Result<Option<Vec<super::proto::SegmentUse>>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use std::io::{BufReader, Write};
    use std::os::unix::net::UnixListener;
    let state = w.state();
    let listener =
        UnixListener::bind(super::server::socket_path(&state, &w.name).unwrap()).unwrap();
    let socket_file = w.dir().join("state").join(format!("{}.sock", w.name));
    let (dir, name) = (w.state(), w.name.clone());
    let client = std::thread::spawn(move || super::client::list_in(&dir, &name));
    for (n, step) in plan.iter().enumerate() {
        // A failure bound: the client connects at once.
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let bound = Timespec {
            tv_sec: 30,
            tv_nsec: 0,
        };
        poll(&mut fds, Some(&bound)).unwrap();
        assert!(!fds[0].revents().is_empty(), "connection {n} never came");
        let (mut conn, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let hello = super::proto::read_line(&mut reader).unwrap();
        assert!(hello.starts_with("HELLO "), "{hello:?}");
        conn.write_all(format!("OK {}\n", std::process::id()).as_bytes())
            .unwrap();
        assert_eq!(super::proto::read_line(&mut reader).unwrap(), "LIST");
        match step {
            OnList::Close => {}
            OnList::Exit => std::fs::remove_file(&socket_file).unwrap(),
            OnList::Answer(text) => conn.write_all(text.as_bytes()).unwrap(),
        }
        // Dropping `conn` and `reader` closes the connection.
    }
    let got = client.join().unwrap();
    // Every connection the client made was queued before it returned.
    listener.set_nonblocking(true).unwrap();
    match listener.accept() {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        other => panic!("asked more often than {} times: {other:?}", plan.len()),
    }
    got
}

#[test]
fn list_asks_once_more_when_the_connection_closes_before_any_answer() {
    let w = World::new();
    let got = list_against(
        &w,
        &[
            OnList::Close,
            OnList::Answer("SEG /s/shmstore-a 5,6\nEND 1\n"),
        ],
    );
    let segs = got.unwrap().expect("the second answer stands");
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].path, Path::new("/s/shmstore-a"));
    assert_eq!(segs[0].pids, [5, 6]);
}

#[test]
fn list_after_an_exiting_supervisor_says_none_is_running() {
    let w = World::new();
    assert!(list_against(&w, &[OnList::Exit]).unwrap().is_none());
}

#[test]
fn list_asks_only_once_more() {
    let w = World::new();
    let err = list_against(&w, &[OnList::Close, OnList::Close]).unwrap_err();
    assert!(err.to_string().contains("closed the connection"), "{err}");
}

#[test]
fn list_cut_after_an_answer_began_is_an_error_not_asked_again() {
    let w = World::new();
    let err = list_against(&w, &[OnList::Answer("SEG /s/shmstore-a 5\n")]).unwrap_err();
    assert!(err.to_string().contains("cut after 1 segments"), "{err}");
    let err = list_against(
        &World::new(),
        &[OnList::Answer("SEG /s/shmstore-a 5\nEND 2\n")],
    )
    .unwrap_err();
    assert!(err.to_string().contains("incomplete: 1 of 2"), "{err}");
}

#[test]
fn list_answered_at_once_is_asked_once() {
    let w = World::new();
    let segs = list_against(&w, &[OnList::Answer("END 0\n")]).unwrap();
    assert_eq!(segs, Some(vec![]));
}
