use super::*;

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn chunk(i: u64) -> Handle {
    Handle {
        kind: CHUNK,
        path: PathBuf::from(format!("/dev/shm/shmstore-arena-{i}")),
        offset: 4096 + i * 64,
        size: 64 * (i + 1),
        generation: i + 7,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_millis(20)
}

#[test]
fn handles_come_out_in_order_and_a_put_learns_when_its_handle_is_taken() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 4).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    assert_eq!(b.capacity(), 4);
    let mut at = vec![];
    for i in 0..4 {
        at.push(a.try_push(&chunk(i)).unwrap().unwrap());
    }
    assert_eq!(a.try_push(&chunk(9)).unwrap(), None, "full");
    assert_eq!(a.wait_to_put(soon()), Waited::TimedOut);
    assert_eq!(b.len(), 4);
    for (i, &pos) in at.iter().enumerate() {
        assert!(!a.taken(pos));
        let (p, h) = b.try_pop().unwrap().unwrap();
        assert_eq!(p, pos);
        assert_eq!(h.unwrap(), chunk(i as u64));
        assert!(!a.taken(pos), "claimed, not yet released");
        b.release(p);
        assert!(a.taken(pos));
    }
    assert!(b.try_pop().unwrap().is_none());
    assert_eq!(b.wait_to_get(soon()), Waited::TimedOut);
    // Around the ring several times: positions keep counting, `taken` stays true.
    for i in 0..10 {
        let pos = a.try_push(&chunk(i)).unwrap().unwrap();
        let (p, h) = b.try_pop().unwrap().unwrap();
        assert_eq!((p, h.unwrap()), (pos, chunk(i)));
        b.release(p);
    }
    assert!(at.iter().all(|&p| a.taken(p)));
}

#[test]
fn many_putters_and_getters_on_threads_lose_and_repeat_nothing() {
    let d = dir();
    let path = d.path().join("shmstore-ch");
    drop(Ring::create(d.path(), "shmstore-ch", 8).unwrap());
    let per = 2000u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    let push = |r: &Ring, h: &Handle| loop {
        if r.try_push(h).unwrap().is_some() {
            return;
        }
        assert_eq!(r.wait_to_put(deadline), Waited::Again, "bounded");
    };
    let mut all: Vec<u64> = std::thread::scope(|s| {
        let getters: Vec<_> = (0..2)
            .map(|_| {
                let path = path.clone();
                s.spawn(move || {
                    let r = Ring::open(&path).unwrap();
                    let mut got = vec![];
                    loop {
                        match r.try_pop().unwrap() {
                            Some((p, h)) => {
                                let h = h.unwrap();
                                r.release(p);
                                if h.generation == u64::MAX {
                                    return got; // the end marker
                                }
                                got.push(h.offset);
                            }
                            None => {
                                assert_eq!(r.wait_to_get(deadline), Waited::Again, "bounded");
                            }
                        }
                    }
                })
            })
            .collect();
        let putters: Vec<_> = (0..3u64)
            .map(|t| {
                let path = path.clone();
                s.spawn(move || {
                    let r = Ring::open(&path).unwrap();
                    for i in 0..per {
                        push(&r, &chunk(t * per + i));
                    }
                })
            })
            .collect();
        for p in putters {
            p.join().unwrap();
        }
        let r = Ring::open(&path).unwrap();
        for _ in 0..2 {
            push(
                &r,
                &Handle {
                    generation: u64::MAX,
                    ..chunk(0)
                },
            );
        }
        getters
            .into_iter()
            .flat_map(|g| g.join().unwrap())
            .collect()
    });
    all.sort_unstable();
    let want: Vec<u64> = (0..3 * per).map(|i| chunk(i).offset).collect();
    assert_eq!(all, want);
}

#[test]
fn a_ring_that_is_not_a_channel_is_refused() {
    let d = dir();
    drop(Ring::create(d.path(), "shmstore-ch", 4).unwrap());
    let path = d.path().join("shmstore-ch");
    let good = std::fs::read(&path).unwrap();
    type Spoil = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Spoil)> = vec![
        ("magic", Box::new(|b| b[0] ^= 1)),
        ("version", Box::new(|b| b[8] = 9)),
        ("cell size", Box::new(|b| b[12] = 8)),
        ("capacity not a power of two", Box::new(|b| b[16] = 3)),
        (
            "capacity larger than the file",
            Box::new(|b| b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes())),
        ),
        ("shorter", Box::new(|b| b.truncate(600))),
        ("header only", Box::new(|b| b.truncate(20))),
    ];
    for (what, spoil) in cases {
        let mut bytes = good.clone();
        spoil(&mut bytes);
        let p = d.path().join("shmstore-bad");
        let _ = std::fs::remove_file(&p);
        std::fs::write(&p, &bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(
            matches!(Ring::open(&p), Err(ChannelError::Corrupt { .. })),
            "{what}"
        );
    }
    // Readable by others, or a symlink to a channel: refused.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(Ring::open(&path).is_err());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = d.path().join("shmstore-link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert!(Ring::open(&link).is_err());
    assert!(Ring::open(&path).is_ok());
    // Bad capacities are refused at creation.
    for cap in [0, 1, 3, MAX_CAPACITY * 2] {
        assert!(Ring::create(d.path(), &format!("shmstore-c{cap}"), cap).is_err());
    }
}

#[test]
fn hostile_cells_and_positions_give_errors_or_timeouts_never_a_hang() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 4).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    // A published cell whose contents are garbage: an error for that cell, the ring goes on.
    let pos = a.try_push(&chunk(1)).unwrap().unwrap();
    a.word(pos, 1).store(0xff, Ordering::Relaxed); // unknown kind
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert!(h.is_err());
    b.release(p);
    let pos = a.try_push(&chunk(2)).unwrap().unwrap();
    a.word(pos, 1)
        .store(u64::from(CHUNK) | 4000 << 8, Ordering::Relaxed); // path too long
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert!(h.is_err());
    b.release(p);
    let pos = a.try_push(&chunk(3)).unwrap().unwrap();
    a.word(pos, PATH_AT)
        .store(u64::from_le_bytes(*b"relative"), Ordering::Relaxed);
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert!(h.is_err());
    b.release(p);
    // Positions moved to nonsense: every call returns (an error, "empty" or "full").
    for (tail, head) in [(u64::MAX, 0), (5, 1 << 60), (1 << 63, 1 << 63), (0, 3)] {
        a.tail().store(tail, Ordering::Relaxed);
        a.head().store(head, Ordering::Relaxed);
        let _ = a.try_push(&chunk(0));
        let _ = b.try_pop();
        let _ = b.wait_to_get(soon());
        let _ = a.wait_to_put(soon());
        let _ = b.len();
    }
    // Sequence words of every cell set to garbage too.
    for i in 0..4 {
        a.word(i, 0)
            .store(0xdead_beef_0000 + i * 977, Ordering::Relaxed);
    }
    let _ = a.try_push(&chunk(0));
    let _ = b.try_pop();
    assert!(b.len() <= 4);
}

#[test]
fn a_waiting_getter_is_woken_by_a_put_from_another_mapping() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 4).unwrap();
    let path = d.path().join("shmstore-ch");
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        let getter = s.spawn(|| {
            let b = Ring::open(&path).unwrap();
            loop {
                if let Some((p, h)) = b.try_pop().unwrap() {
                    b.release(p);
                    return h.unwrap();
                }
                assert_eq!(b.wait_to_get(deadline), Waited::Again);
            }
        });
        a.try_push(&chunk(5)).unwrap().unwrap();
        assert_eq!(getter.join().unwrap(), chunk(5));
    });
}

/// A claim word naming a process that has exited (and was reaped).
fn dead_claim() -> u64 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    u64::from(pid) | (me() >> 32) << 32
}

#[test]
fn a_cell_claimed_by_a_dead_putter_is_skipped_and_one_held_by_a_dead_getter_handed_back() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 2).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    // A putter claimed position 0 and died before publishing it: gets see "empty".
    a.tail().store(1, Ordering::SeqCst);
    a.word(0, PUTTER).store(dead_claim(), Ordering::SeqCst);
    let p1 = a.try_push(&chunk(1)).unwrap().unwrap();
    assert!(b.try_pop().unwrap().is_none());
    assert!(b.recover_get());
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert_eq!((p, h.unwrap()), (p1, chunk(1)));
    b.release(p);
    // A getter claimed a published handle and died before handing its cell back: after
    // one more put the channel is full at that cell.
    let p2 = a.try_push(&chunk(2)).unwrap().unwrap();
    let p3 = a.try_push(&chunk(3)).unwrap().unwrap();
    assert_eq!(a.try_push(&chunk(4)).unwrap(), None);
    b.head().store(p2 + 1, Ordering::SeqCst);
    b.word(p2, GETTER).store(dead_claim(), Ordering::SeqCst);
    assert!(!a.taken(p2));
    assert!(a.recover_put());
    assert!(a.taken(p2), "handed back: the putter lets go of the object");
    let p4 = a.try_push(&chunk(4)).unwrap().unwrap();
    for (want_pos, want) in [(p3, chunk(3)), (p4, chunk(4))] {
        let (p, h) = b.try_pop().unwrap().unwrap();
        assert_eq!((p, h.unwrap()), (want_pos, want));
        b.release(p);
    }
}

#[test]
fn a_claimer_names_itself_before_it_moves_the_position_and_a_dead_ones_name_is_taken_over() {
    // Every claim names its claimer in the cell before the position moves (ring version
    // 3), so no cell past the head or tail is ever nameless: version 2 named it just after,
    // and a process SIGKILLed in between left a cell that no put or get could judge, which
    // stopped the whole channel for good (the fault campaign found it).
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 2).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    let p0 = a.try_push(&chunk(0)).unwrap().unwrap();
    assert_eq!(a.word(p0, PUTTER).load(Ordering::SeqCst), me());
    assert_ne!(a.word(p0, PUTTER_START).load(Ordering::SeqCst), 0);
    // A getter named itself in the cell at the head and died before moving the head: the
    // next get takes its claim over (and gets the handle) instead of waiting for it.
    a.word(p0, GETTER).store(dead_claim(), Ordering::SeqCst);
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert_eq!((p, h.unwrap()), (p0, chunk(0)));
    assert_eq!(b.word(p0, GETTER).load(Ordering::SeqCst), me());
    b.release(p);
    // The same for a putter that named itself at the tail and died.
    let t = a.tail().load(Ordering::SeqCst);
    a.word(t, PUTTER).store(dead_claim(), Ordering::SeqCst);
    assert_eq!(a.try_push(&chunk(1)).unwrap(), Some(t));
    // A live process naming itself at the head: not taken over; the get answers "nothing
    // yet" (it waits as for a change) rather than calling the ring corrupt, and goes on
    // once that name is gone.
    let mut child = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let live = u64::from(child.id()) | (me() >> 32) << 32;
    let h = b.head().load(Ordering::SeqCst);
    b.word(h, GETTER).store(live, Ordering::SeqCst);
    assert!(b.try_pop().unwrap().is_none());
    assert!(!b.may_claim(b.head(), 1, GETTER));
    assert_eq!(b.head().load(Ordering::SeqCst), h);
    child.kill().unwrap();
    child.wait().unwrap();
    b.word(h, GETTER).store(0, Ordering::SeqCst);
    assert!(b.may_claim(b.head(), 1, GETTER));
    let (p, got) = b.try_pop().unwrap().unwrap();
    assert_eq!((p, got.unwrap()), (t, chunk(1)));
    b.release(p);
}

#[test]
fn a_claim_of_a_live_process_or_one_too_young_to_judge_is_never_taken_over() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 2).unwrap();
    // Claimed, unpublished; the claimer's word still 0, this process's, or a live
    // process's of another pid namespace (here: a made-up namespace).
    let mut child = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let live = u64::from(child.id()) | (me() >> 32) << 32;
    let other_ns = dead_claim() ^ (1 << 40);
    a.tail().store(1, Ordering::SeqCst);
    for who in [0, me(), live, other_ns] {
        a.word(0, PUTTER).store(who, Ordering::SeqCst);
        assert!(!a.recover_get(), "{who:#x}");
    }
    // Published and claimed by a live getter: not handed back either.
    a.word(0, 0).store(1, Ordering::SeqCst);
    a.head().store(1, Ordering::SeqCst);
    a.tail().store(2, Ordering::SeqCst);
    a.word(1, 0).store(2, Ordering::SeqCst);
    a.tail().store(2, Ordering::SeqCst);
    for who in [0, me(), live, other_ns] {
        a.word(0, GETTER).store(who, Ordering::SeqCst);
        assert!(!a.recover_put(), "{who:#x}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_channel_in_a_full_directory_says_how_much_is_needed_and_what_to_do() {
    let Some(fs) = crate::segment::SmallTmpfs::mount("256k") else {
        return;
    };
    let Err(err) = Ring::create(fs.dir.path(), "shmstore-chan-full", MAX_CAPACITY) else {
        panic!("a channel larger than its directory was made");
    };
    assert!(
        matches!(
            err,
            ChannelError::Segment(crate::segment::SegmentError::Full { .. })
        ),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(fs.dir.path()).unwrap().count(), 0);
}

/// Threads that keep every core busy until `stop` is set (bounded by the caller's scope),
/// so that the waits below run with more runnable threads than cores.
fn busy_loops<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    stop: &'s std::sync::atomic::AtomicBool,
) -> usize {
    let n = std::thread::available_parallelism().map_or(2, |n| n.get()) + 2;
    for _ in 0..n {
        s.spawn(move || {
            let end = Instant::now() + Duration::from_secs(60);
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
        });
    }
    n
}

#[test]
fn a_ping_pong_under_busy_loops_loses_no_wake_up() {
    // Two mappings answer each other one handle at a time while busy threads take every
    // core: each wait ends by its spin, by a futex wake-up, or by the futex word having
    // moved; a lost wake-up would leave one side asleep until the far deadline (60 s) and
    // fail the `Waited::Again` assertions.
    let d = dir();
    let ab = Ring::create(d.path(), "shmstore-ab", 2).unwrap();
    let ba = Ring::create(d.path(), "shmstore-ba", 2).unwrap();
    let (ab_path, ba_path) = (d.path().join("shmstore-ab"), d.path().join("shmstore-ba"));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let rounds = 300u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let take = |r: &Ring| loop {
        if let Some((p, h)) = r.try_pop().unwrap() {
            r.release(p);
            return h.unwrap();
        }
        assert_eq!(
            r.wait_to_get(deadline),
            Waited::Again,
            "woken before the deadline"
        );
    };
    std::thread::scope(|s| {
        busy_loops(s, &stop);
        let echo = s.spawn(|| {
            let (inbox, outbox) = (Ring::open(&ab_path).unwrap(), Ring::open(&ba_path).unwrap());
            for _ in 0..rounds {
                let h = take(&inbox);
                outbox.try_push(&h).unwrap().unwrap();
            }
        });
        for i in 0..rounds {
            ab.try_push(&chunk(i)).unwrap().unwrap();
            assert_eq!(take(&ba), chunk(i));
        }
        echo.join().unwrap();
        stop.store(true, Ordering::Relaxed);
    });
    // The spin budget stays within its bounds whatever the waits measured.
    let ns = u64::from(ab.spin_ns.load(Ordering::Relaxed));
    assert!((SPIN_MIN.as_nanos() as u64..=SPIN_MAX.as_nanos() as u64).contains(&ns));
}

#[test]
fn putters_and_getters_under_busy_loops_all_progress_in_order_and_time_out_when_due() {
    // Several putters (each in order) and getters share a small ring while busy threads
    // take every core: every handle comes out exactly once, each putter's in the order it
    // put them (the ring is first in, first out), every putter and getter finishes (none
    // is starved for ever: all end before the far deadline), and then a wait on the empty
    // ring ends `TimedOut` once its near deadline has passed, not earlier.
    let d = dir();
    let path = d.path().join("shmstore-ch");
    drop(Ring::create(d.path(), "shmstore-ch", 4).unwrap());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (putters, getters, per) = (3u64, 3usize, 200u64);
    let deadline = Instant::now() + Duration::from_secs(60);
    let got = std::sync::Mutex::new(Vec::new());
    let total = putters * per;
    let taken = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        busy_loops(s, &stop);
        let mut joins = vec![];
        for p in 0..putters {
            let path = &path;
            joins.push(s.spawn(move || {
                let r = Ring::open(path).unwrap();
                for i in 0..per {
                    let h = chunk(p * 1_000_000 + i);
                    while r.try_push(&h).unwrap().is_none() {
                        assert_eq!(r.wait_to_put(deadline), Waited::Again);
                    }
                }
            }));
        }
        for _ in 0..getters {
            let (path, got, taken) = (&path, &got, &taken);
            joins.push(s.spawn(move || {
                let r = Ring::open(path).unwrap();
                let mut mine = vec![];
                while taken.load(Ordering::SeqCst) < total {
                    if let Some((p, h)) = r.try_pop().unwrap() {
                        r.release(p);
                        taken.fetch_add(1, Ordering::SeqCst);
                        mine.push(h.unwrap().offset);
                        continue;
                    }
                    let slice = (Instant::now() + Duration::from_millis(50)).min(deadline);
                    let _ = r.wait_to_get(slice);
                    assert!(Instant::now() < deadline, "a getter was starved");
                }
                got.lock().unwrap().push(mine);
            }));
        }
        for j in joins {
            j.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    let got = got.into_inner().unwrap();
    let mut all: Vec<u64> = got.iter().flatten().copied().collect();
    // Within each getter, each putter's handles come in the order put.
    for mine in &got {
        for p in 0..putters {
            let seq: Vec<u64> = mine
                .iter()
                .copied()
                .filter(|&o| (o - 4096) / 64 / 1_000_000 == p)
                .collect();
            assert!(seq.windows(2).all(|w| w[0] < w[1]), "out of order");
        }
    }
    all.sort_unstable();
    let mut want: Vec<u64> = (0..putters)
        .flat_map(|p| (0..per).map(move |i| chunk(p * 1_000_000 + i).offset))
        .collect();
    want.sort_unstable();
    assert_eq!(all, want, "every handle exactly once");
    let r = Ring::open(&path).unwrap();
    let near = Instant::now() + Duration::from_millis(30);
    assert_eq!(r.wait_to_get(near), Waited::TimedOut);
    assert!(Instant::now() >= near, "a timeout never comes early");
}

/// The start word of the live process `pid` as a claim of it carries it (see [`my_start`]),
/// its start time moved by `shift` ticks.
fn start_word(pid: u32, shift: i64) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let t = start_time(&stat).unwrap();
    (t.wrapping_add_signed(shift) & START_MASK) | time_ns() << START_BITS
}

/// A claim whose pid now names another process (the claimer was SIGKILLed and the system
/// gave its pid to a process started later) is taken over: the claim carries when its
/// process started. Before, every get (or put) waited behind it for as long as the other
/// process lived. The same pid with the claimer's own start, with no start, or with a start
/// read in another time namespace counts as alive.
#[test]
fn a_claim_whose_pid_now_names_another_process_is_taken_over() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 2).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let who = u64::from(child.id()) | (me() >> 32) << 32;
    let same = start_word(child.id(), 0);
    let earlier = start_word(child.id(), -1);
    let unsure = [same, 0, same ^ (1 << START_BITS)];
    // A put claimed position 0 and was killed; its pid now names `child`.
    a.tail().store(1, Ordering::SeqCst);
    a.word(0, PUTTER).store(who, Ordering::SeqCst);
    for start in unsure {
        a.word(0, PUTTER_START).store(start, Ordering::SeqCst);
        assert!(!b.recover_get(), "{start:#x}");
    }
    a.word(0, PUTTER_START).store(earlier, Ordering::SeqCst);
    let p1 = a.try_push(&chunk(1)).unwrap().unwrap();
    // A put records when its own process started.
    let mine = start_word(std::process::id(), 0);
    assert_eq!(a.word(p1, PUTTER_START).load(Ordering::SeqCst), mine);
    assert!(b.try_pop().unwrap().is_none());
    assert!(b.recover_get());
    let (p, h) = b.try_pop().unwrap().unwrap();
    assert_eq!(b.word(p, GETTER_START).load(Ordering::SeqCst), mine);
    assert_eq!((p, h.unwrap()), (p1, chunk(1)));
    b.release(p);
    // A get claimed a published handle and was killed; its pid now names `child`.
    let p2 = a.try_push(&chunk(2)).unwrap().unwrap();
    a.try_push(&chunk(3)).unwrap().unwrap();
    assert_eq!(a.try_push(&chunk(4)).unwrap(), None);
    b.head().store(p2 + 1, Ordering::SeqCst);
    b.word(p2, GETTER).store(who, Ordering::SeqCst);
    for start in unsure {
        b.word(p2, GETTER_START).store(start, Ordering::SeqCst);
        assert!(!a.recover_put(), "{start:#x}");
    }
    b.word(p2, GETTER_START).store(earlier, Ordering::SeqCst);
    assert!(a.recover_put());
    assert!(a.taken(p2));
    child.kill().unwrap();
    child.wait().unwrap();
    // This process's own pid with another start (the claimer died and the system gave its
    // pid to this process): dead too; with this process's start, its own live claim.
    let c = Ring::create(d.path(), "shmstore-ch2", 2).unwrap();
    c.tail().store(1, Ordering::SeqCst);
    c.word(0, PUTTER).store(me(), Ordering::SeqCst);
    for start in [mine, 0, mine ^ (1 << START_BITS)] {
        c.word(0, PUTTER_START).store(start, Ordering::SeqCst);
        assert!(!c.recover_get(), "{start:#x}");
    }
    c.word(0, PUTTER_START).store(mine ^ 1, Ordering::SeqCst);
    assert!(c.recover_get());
}

/// The supervisor's sweep reads what a channel holds in either layout: version 2's (the
/// path at word 9) and version 1's (at word 7), which processes of an earlier shmstore may
/// still be using; a file of any other version holds nothing it can read.
#[test]
fn the_sweep_reads_what_a_channel_of_either_layout_holds() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 2).unwrap();
    let p = a.try_push(&chunk(1)).unwrap().unwrap();
    let path = d.path().join("shmstore-ch");
    assert_eq!(scan::held_paths(&path), vec![chunk(1).path]);
    for w in 0..CELL_WORDS - PATH_AT {
        let v = a.word(p, PATH_AT + w).load(Ordering::SeqCst);
        a.word(p, 7 + w).store(v, Ordering::SeqCst);
    }
    a.u32_at(8).store(1, Ordering::SeqCst);
    assert_eq!(scan::held_paths(&path), vec![chunk(1).path]);
    a.u32_at(8).store(99, Ordering::SeqCst);
    assert!(scan::held_paths(&path).is_empty());
}

/// Pin the calling thread to the CPU it runs on now; that CPU, as the hint words say it.
fn pin_to_this_cpu() -> u32 {
    // SAFETY: `sched_getcpu` takes nothing; the CPU set lives on this stack for the call, and
    // `sched_setaffinity(0, ...)` changes only the calling thread.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu failed");
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
        cpu as u32 + 1
    }
}

/// A put and a get say which CPU they ran on; a waiter whose other side last ran on its own
/// CPU sleeps at once instead of spinning (on one core the spin only keeps the answer from
/// being made), and spins again when the other side is elsewhere. Nothing is lost either way.
#[test]
fn a_waiter_does_not_spin_for_a_peer_on_its_own_cpu() {
    let d = dir();
    let a = Ring::create(d.path(), "shmstore-ch", 4).unwrap();
    let b = Ring::open(&d.path().join("shmstore-ch")).unwrap();
    // On a thread of its own: the pin does not outlive the test.
    std::thread::scope(|s| {
        s.spawn(|| {
            let cpu = pin_to_this_cpu();
            let pos = a.try_push(&chunk(1)).unwrap().unwrap();
            assert_eq!(a.u32_at(AT_PUT_CPU).load(Ordering::Relaxed), cpu);
            let (p, h) = b.try_pop().unwrap().unwrap();
            assert_eq!((p, h.unwrap()), (pos, chunk(1)));
            b.release(p);
            assert_eq!(b.u32_at(AT_GET_CPU).load(Ordering::Relaxed), cpu);
            // Both sides' last calls ran here: no spin, a sleep until the deadline.
            assert_eq!(b.wait_to_get(soon()), Waited::TimedOut);
            assert_eq!(b.spun.load(Ordering::Relaxed), 0);
            for _ in 0..4 {
                a.try_push(&chunk(2)).unwrap().unwrap();
            }
            assert_eq!(a.wait_to_put(soon()), Waited::TimedOut);
            assert_eq!(a.spun.load(Ordering::Relaxed), 0);
            // The other side elsewhere (the hint says another CPU): a wait spins first.
            a.u32_at(AT_GET_CPU).store(cpu + 1, Ordering::Relaxed);
            assert_eq!(a.wait_to_put(soon()), Waited::TimedOut);
            assert_eq!(a.spun.load(Ordering::Relaxed), 1);
            // A get that comes while the putter sleeps wakes it (no lost wake-up).
            s.spawn(|| {
                pin_to_this_cpu();
                let (p, _) = b.try_pop().unwrap().unwrap();
                b.release(p);
            });
            let until = Instant::now() + Duration::from_secs(30);
            while a.try_push(&chunk(3)).unwrap().is_none() {
                assert_eq!(
                    a.wait_to_put(until),
                    Waited::Again,
                    "the get was never seen"
                );
            }
        });
    });
}
