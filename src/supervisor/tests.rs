//! Tests of the supervisor (server + client protocol) with real processes and files.
//!
//! (Over 800 lines: tests only, one per behaviour of the server and client.)

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

/// Wait until everything the supervisor received before this call is settled: the first
/// round trip is answered in the round that reads it (with anything that came before it,
/// e.g. a closed connection or an exited process), the second only after that round's
/// settling (`flush`) is done.
fn settled(conn: &mut TestConn) {
    for _ in 0..2 {
        let reply = conn.request(&Request::Hello(1)).unwrap();
        assert!(reply.starts_with("OK "), "{reply}");
    }
}

fn ok(reply: io::Result<String>) {
    assert_eq!(reply.unwrap(), "OK");
}

fn pin(holder: &Path, path: &Path) -> Request {
    Request::Pin {
        holder: holder.to_owned(),
        path: path.to_owned(),
    }
}

/// Segments `names` registered (`NEW`) by `conn`, then made (as a creator does).
fn made(w: &World, conn: &mut TestConn, names: &[&str]) -> Vec<PathBuf> {
    names
        .iter()
        .map(|n| {
            ok(conn.request(&Request::New(w.dir().join(format!("shmstore-{n}")))));
            seg(w.dir(), n)
        })
        .collect()
}

#[test]
fn pin_keeps_a_file_while_its_holder_is_used() {
    let w = World::new();
    let server = w.start(300);
    let mut a = w.conn(); // the sender
    let mut b = w.conn(); // the receiver
    let [chan, arena] = &made(&w, &mut a, &["chan", "arena"])[..] else {
        unreachable!()
    };
    ok(b.request(&Request::Use(chan.clone())));
    ok(a.request(&pin(chan, arena)));
    ok(a.request(&pin(chan, arena))); // again: nothing changes
    drop(a); // the sender exits: the arena's only user is gone
    settled(&mut b);
    assert!(arena.exists(), "a pinned arena was removed: {}", w.log());
    // Tracked, with no user of its own.
    let list = b.list().unwrap();
    assert!(
        list.contains(&format!("SEG {} -", arena.display())),
        "{list:?}"
    );
    ok(b.request(&Request::Drop(chan.clone())));
    wait_gone(chan, &mut b, "the holder was not removed");
    wait_gone(arena, &mut b, "the pinned file outlived its holder");
    assert!(b.list().unwrap().is_empty());
    drop(b);
    server.join().unwrap().unwrap();
}

#[test]
fn pin_ends_when_the_holders_user_dies() {
    let w = World::new();
    let server = w.start(300);
    let mut a = w.conn();
    let mut b = w.conn();
    let [chan, arena] = &made(&w, &mut a, &["chan", "arena"])[..] else {
        unreachable!()
    };
    ok(b.request(&Request::Use(chan.clone())));
    ok(a.request(&pin(chan, arena)));
    ok(a.request(&Request::Drop(arena.clone())));
    settled(&mut a);
    assert!(arena.exists(), "a pinned arena was removed: {}", w.log());
    drop(a);
    drop(b); // the holder's last user dies: its connection closes without a DROP
    let mut c = w.conn();
    wait_gone(chan, &mut c, "the holder of a dead client was not removed");
    wait_gone(arena, &mut c, "the pinned file outlived its holder");
    drop(c);
    server.join().unwrap().unwrap();
}

#[test]
fn pin_by_a_holder_mapped_by_a_non_client_lasts_until_that_process_exits() {
    let w = World::new();
    let server = w.start(300);
    let mut a = w.conn();
    let [chan, arena] = &made(&w, &mut a, &["chan", "arena"])[..] else {
        unreachable!()
    };
    let reader = holder(&[chan]);
    ok(a.request(&pin(chan, arena)));
    // Both lose their client in one round: the holder is adopted by that round's scan,
    // which must then keep the arena.
    drop(a);
    let mut c = w.conn();
    settled(&mut c);
    assert!(chan.exists() && arena.exists(), "{}", w.log());
    release(reader);
    wait_gone(
        chan,
        &mut c,
        "the holder was not removed after its reader exited",
    );
    wait_gone(arena, &mut c, "the pinned file outlived its holder");
    drop(c);
    server.join().unwrap().unwrap();
}

#[test]
fn pin_cycle_keeps_nothing_once_unused_and_chains_are_not_followed() {
    let w = World::new();
    let server = w.start(300);
    let mut a = w.conn();
    let mut b = w.conn();
    let [x, y, p, q, h, z] = &made(&w, &mut a, &["x", "y", "p", "q", "h", "z"])[..] else {
        unreachable!()
    };
    // x <-> y, with a user of x left; p <-> q with no user left; x -> h -> z.
    ok(b.request(&Request::Use(x.clone())));
    for (from, to) in [(x, y), (y, x), (p, q), (q, p), (x, h), (h, z)] {
        ok(a.request(&pin(from, to)));
    }
    drop(a);
    wait_gone(p, &mut b, "a cycle of pins kept a file with no user");
    wait_gone(q, &mut b, "a cycle of pins kept a file with no user");
    // z's holder h has no user of its own: kept only by x's pin, it keeps nothing.
    wait_gone(z, &mut b, "a pin of a holder with no user kept a file");
    settled(&mut b);
    assert!(x.exists() && y.exists() && h.exists(), "{}", w.log());
    ok(b.request(&Request::Drop(x.clone())));
    for f in [x, y, h] {
        wait_gone(f, &mut b, "a cycle of pins kept a file with no user");
    }
    assert!(b.list().unwrap().is_empty());
    drop(b);
    server.join().unwrap().unwrap();
}

#[test]
fn pin_outside_a_segment_directory_or_across_directories_is_refused() {
    let w = World::new();
    let elsewhere = tempfile::tempdir().unwrap();
    let server = w.start(300);
    let mut a = w.conn();
    let [chan, arena] = &made(&w, &mut a, &["chan", "arena"])[..] else {
        unreachable!()
    };
    // Attached by name in a directory that is not a segment directory.
    let out_holder = seg(elsewhere.path(), "holder");
    let outside = seg(elsewhere.path(), "outside");
    ok(a.request(&Request::Use(out_holder.clone())));
    let never = elsewhere.path().join("shmstore-never"); // not even a file
    let dotdot = w
        .dir()
        .join("sub/../../")
        .join(elsewhere.path().file_name().unwrap())
        .join("shmstore-outside");
    let not_a_segment_name = w.dir().join("notes.txt");
    std::fs::write(&not_a_segment_name, b"x").unwrap();
    for (holder, path) in [
        (chan, &outside),            // across directories, the pinned one outside
        (&out_holder, arena),        // across directories, the holder outside
        (&out_holder, &outside),     // one directory, not a segment directory
        (&out_holder, &never),       // same
        (chan, &dotdot),             // `..`
        (chan, &not_a_segment_name), // not a segment's name
        (chan, chan),                // itself
    ] {
        let reply = a.request(&pin(holder, path)).unwrap();
        assert!(reply.starts_with("ERR "), "{holder:?} {path:?}: {reply}");
    }
    // Malformed: not two absolute paths.
    for bad in ["PIN /a\n", "PIN rel\0/b\n", "PIN /a\0/b\0/c\n"] {
        a.send_raw(bad.as_bytes()).unwrap();
        assert_eq!(a.read_reply().unwrap(), "ERR unknown request", "{bad:?}");
    }
    // Nothing refused is tracked, kept or removed: the arena goes with its last user (the
    // refused pin by a used holder does not keep it), the files elsewhere stay.
    let list = a.list().unwrap();
    assert!(
        list.iter()
            .all(|l| !l.contains(elsewhere.path().to_str().unwrap())
                || l.contains("shmstore-holder")),
        "{list:?}"
    );
    ok(a.request(&Request::Drop(arena.clone())));
    wait_gone(arena, &mut a, "a refused pin kept a file");
    ok(a.request(&Request::Drop(out_holder.clone())));
    ok(a.request(&Request::Drop(chan.clone())));
    wait_gone(chan, &mut a, "not removed");
    assert!(a.list().unwrap().is_empty());
    drop(a);
    server.join().unwrap().unwrap();
    assert!(out_holder.exists() && outside.exists() && not_a_segment_name.exists());
    assert!(!never.exists());
}

/// Runs only as a child of [`client_pins_once_and_again_on_a_new_connection`] (which sets
/// `SHMSTORE_TEST_PIN_CLIENT`): a process using the client's globals, whose environment
/// names a private supervisor.
#[test]
#[ignore = "a helper process of client_pins_once_and_again_on_a_new_connection"]
fn child_pin_client() {
    use std::io::BufRead;
    let Some(dir) = std::env::var_os("SHMSTORE_TEST_PIN_CLIENT") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let (chan, arena) = (dir.join("shmstore-chan"), dir.join("shmstore-arena"));
    let elsewhere = PathBuf::from(std::env::var_os("SHMSTORE_TEST_ELSEWHERE").unwrap());
    let client = super::client::use_segment;
    let pin = super::client::pin_segment;
    let mut stdin = io::stdin().lock();
    let mut wait_for = |what: &str| {
        let mut line = String::new();
        stdin.read_line(&mut line).unwrap();
        assert_eq!(line.trim_end(), what);
    };
    client(&chan, true).unwrap();
    pin(&chan, &arena).unwrap();
    let refused = pin(&chan, &elsewhere.join("shmstore-outside")).unwrap_err();
    assert!(
        matches!(refused, super::client::Unavailable::Other(ref m) if m.contains("refused")),
        "{refused}"
    );
    println!("@pinned");
    wait_for("dead");
    // Sent already: no conversation (none could be had: the supervisor is dead and this
    // process has no way to start one).
    pin(&chan, &arena).unwrap();
    println!("@cached");
    wait_for("go");
    // Any conversation now reconnects: registrations, then pins.
    client(&dir.join("shmstore-other"), true).unwrap();
    println!("@again");
    wait_for("exit");
}

/// Runs only as a child of [`client_pins_once_and_again_on_a_new_connection`]: a
/// supervisor in its own process (so that it can be killed).
#[test]
#[ignore = "a helper process of client_pins_once_and_again_on_a_new_connection"]
fn child_pin_supervisor() {
    let Some(dir) = std::env::var_os("SHMSTORE_TEST_PIN_SUPERVISOR") else {
        return;
    };
    let state = private_dir(&super::state_dir_path(), true).unwrap();
    let name = super::socket_name();
    let bound = bind(&state, &name).unwrap().expect("fresh name");
    let cfg = ServerConfig {
        name,
        grace: Duration::from_secs(60),
        state,
        log: true,
        sweep_dirs: vec![PathBuf::from(dir)],
    };
    serve(bound, cfg).unwrap();
}

/// A child process of this test binary running one ignored test; killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn child_test(test: &str, env: &[(&str, &Path)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env_remove("SHMSTORE_SUPERVISOR")
    .env("SHMSTORE_SUPERVISOR_TIMEOUT", "5")
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Child(cmd.spawn().unwrap())
}

#[test]
fn client_pins_once_and_again_on_a_new_connection() {
    use std::io::{BufRead, BufReader, Write};
    let w = World::new();
    let elsewhere = tempfile::tempdir().unwrap();
    let seg_dir = w.dir().join("seg");
    std::fs::create_dir(&seg_dir).unwrap();
    let xdg = w.dir().join("xdg");
    let state = private_dir(&xdg.join("shmstore"), true).unwrap();
    let name = PathBuf::from(&w.name);
    let env = [
        ("XDG_RUNTIME_DIR", xdg.as_path()),
        ("SHMSTORE_SUPERVISOR_NAME", name.as_path()),
    ];
    let supervisor = || {
        let mut env = env.to_vec();
        env.push(("SHMSTORE_TEST_PIN_SUPERVISOR", &seg_dir));
        let child = child_test("supervisor::tests::child_pin_supervisor", &env);
        // Listening (and done with its start-up sweep) once it answers.
        let deadline = Instant::now() + Duration::from_secs(30);
        let conn = loop {
            match TestConn::connect(&state, &w.name) {
                Ok(c) => break c,
                Err(e) => assert!(Instant::now() < deadline, "no supervisor: {e}"),
            }
            std::thread::yield_now();
        };
        (child, conn)
    };
    let (first, _) = supervisor();
    let (chan, arena) = (
        seg_dir.join("shmstore-chan"),
        seg_dir.join("shmstore-arena"),
    );
    seg(&seg_dir, "chan");
    seg(&seg_dir, "arena");
    let outside = seg(elsewhere.path(), "outside");
    let mut env_client = env.to_vec();
    env_client.push(("SHMSTORE_TEST_PIN_CLIENT", &seg_dir));
    env_client.push(("SHMSTORE_TEST_ELSEWHERE", elsewhere.path()));
    let mut client = child_test("supervisor::tests::child_pin_client", &env_client);
    let mut to_client = client.0.stdin.take().unwrap();
    // The client's lines, read by a thread so that every wait is bounded. Its markers end
    // lines that libtest may have begun ("test ... ").
    let (lines, from_client) = std::sync::mpsc::channel();
    let out = BufReader::new(client.0.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in out.lines() {
            if lines.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let expect = |what: &str| {
        let mut seen = String::new();
        loop {
            match from_client.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line.trim_end().ends_with(what) => return,
                Ok(line) => seen.push_str(&(line + "\n")),
                Err(e) => panic!("no {what:?} from the client ({e}): {seen}"),
            }
        }
    };
    expect("@pinned");
    // Both files held open across the restart: the next supervisor's start-up sweep keeps
    // them (and adopts this holder).
    let reader = holder(&[&chan, &arena]);
    drop(first); // killed: the client's connection is dead
    writeln!(to_client, "dead").unwrap();
    expect("@cached");
    let (_second, mut conn) = supervisor();
    writeln!(to_client, "go").unwrap();
    expect("@again");
    // The arena's only user goes; the holder is registered (NEW, again) by the client.
    release(reader);
    settled(&mut conn);
    assert!(
        arena.exists(),
        "the pin was not sent again on the new connection"
    );
    writeln!(to_client, "exit").unwrap();
    let status = client.0.wait().unwrap();
    assert!(status.success(), "the client failed: {status}");
    wait_gone(&chan, &mut conn, "the holder was not removed");
    wait_gone(&arena, &mut conn, "the pinned file outlived its holder");
    assert!(outside.exists());
}

/// A putter gives its object to a channel and is killed while a supervisor that does not
/// know the object (another supervisor's client made it) settles it: the object moves from
/// "held by a process" to "held by the channel" between the supervisor's two reads (made to
/// happen there, on cue). It is kept, pinned to the channel, and goes with the channel.
#[test]
fn an_object_given_to_a_channel_by_a_dying_putter_is_kept() {
    let w = World::new();
    let chan_name = &crate::segment::random_name();
    let ring = crate::channel::Ring::create(w.dir(), chan_name, 4).unwrap();
    let chan = w.dir().join(chan_name);
    let obj = seg(w.dir(), "given");
    let keeper = holder(&[&chan]); // a process using the channel
    let putter = holder(&[&obj]); // the putter, holding its object
    let (to_channel, dir) = (obj.clone(), w.dir().to_owned());
    super::server::BETWEEN_READS.lock().unwrap().push((
        dir,
        Box::new(move || {
            let h = crate::channel::Handle {
                kind: crate::channel::SEGMENT,
                path: to_channel,
                offset: 0,
                size: 0,
                generation: 0,
            };
            assert!(ring.try_push(&h).unwrap().is_some());
            release(putter);
        }),
    ));
    // Its start-up sweep settles both files, neither of which it knows.
    let server = w.start(200);
    let mut a = w.conn();
    let deadline = Instant::now() + Duration::from_secs(10);
    let kept = format!("{} is held by channel {}", obj.display(), chan.display());
    while !w.log().contains(&kept) {
        assert!(
            obj.exists(),
            "the object the channel holds was removed: {}",
            w.log()
        );
        assert!(Instant::now() < deadline, "never pinned: {}", w.log());
        a.request(&Request::Hello(1)).unwrap();
    }
    assert!(obj.exists());
    // The channel's last user goes: the channel and what it holds go too.
    release(keeper);
    wait_gone(&chan, &mut a, "the channel was not removed");
    wait_gone(&obj, &mut a, "what the channel held was not removed");
    drop(a);
    server.join().unwrap().unwrap();
}
