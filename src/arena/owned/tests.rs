//! Tests of this process's own arenas: growth, placing (and retrying chunks leased
//! elsewhere), idle release and a forked child's view of its parent's arenas.

use std::cell::RefCell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::arena::lease::{ofd_lock, Lock};
use crate::arena::Lease;
use crate::segment;

/// A use of an arena as plain as can be: the file, nothing registered.
struct Use {
    file: Arc<ArenaFile>,
}

thread_local! {
    /// The uses made by this test's thread (to ask `letting_go`'s predicate about).
    static MADE: RefCell<Vec<Arc<Use>>> = const { RefCell::new(Vec::new()) };
    /// The arenas `letting_go` was told of, by this test's thread.
    static LET_GO: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
}

impl ArenaUser for Use {
    fn file(&self) -> &ArenaFile {
        &self.file
    }

    fn letting_go(gone: &dyn Fn(&Arc<Self>) -> bool) {
        let paths: Vec<PathBuf> = MADE.with(|m| {
            m.borrow()
                .iter()
                .filter(|u| gone(u))
                .map(|u| u.file.path.clone())
                .collect()
        });
        LET_GO.with(|l| l.borrow_mut().extend(paths));
    }
}

fn let_go_paths() -> Vec<PathBuf> {
    LET_GO.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The next arena of `arenas` in `dir`, as the binding layer makes it (sized by how many
/// this process holds).
fn new_arena(arenas: &Arenas<Use>, dir: &Path, made: usize) -> Owned<Use> {
    let cap = arenas.next_capacity(made, 0);
    let (writer, file) = make_arena(dir, &segment::random_name(), cap).unwrap();
    let u = Arc::new(Use { file });
    MADE.with(|m| m.borrow_mut().push(u.clone()));
    Owned::new(dir.to_owned(), writer, u)
}

/// A chunk for `max_len` bytes, as the binding layer reserves one: placed in an arena of
/// this process, or in a new one when none has room.
fn reserve(arenas: &Arenas<Use>, dir: &Path, max_len: u64) -> Placed<Use> {
    match arenas.place(dir, max_len).unwrap() {
        Ok(p) => p,
        Err(made) => {
            let new = new_arena(arenas, dir, made);
            arenas.adopt(new, dir, max_len).unwrap().unwrap()
        }
    }
}

/// A handle's hold on a chunk given out: the chunk, and the lease that keeps it.
struct Held {
    path: Arc<Path>,
    chunk: Chunk,
    _lease: Lease,
}

/// Put `len` bytes into an arena of `arenas` and hold the chunk, as a small `put` does.
fn put(arenas: &Arenas<Use>, dir: &Path, len: u64) -> Held {
    let (path, mut r, arena) = reserve(arenas, dir, len);
    r.write_at(0, &vec![7u8; len as usize]).unwrap();
    let chunk = arenas.commit(&path, &r, len).unwrap().unwrap();
    let (lease, _, _) = arena.file.lease_own(chunk, len);
    arenas.settled(&path, chunk.offset, true);
    Held {
        path,
        chunk,
        _lease: lease,
    }
}

/// Another process's lease on `held`'s chunk: a shared lock through a descriptor of its own.
fn lease_elsewhere(held: &Held) -> Elsewhere {
    let file = File::open(&held.path).unwrap();
    let (offset, size) = (held.chunk.offset, held.chunk.size);
    assert!(ofd_lock(&file, Lock::Shared, offset, size).unwrap());
    Elsewhere { file, offset, size }
}

/// A lease taken through a descriptor of its own, as another process would hold one.
/// Dropped, it unlocks its range before closing: closing alone would leave the lock held
/// while any process forked meanwhile (another test of this binary) still has a copy of
/// the descriptor, since an OFD lock belongs to the open file description.
struct Elsewhere {
    file: File,
    offset: u64,
    size: u64,
}

impl Drop for Elsewhere {
    fn drop(&mut self) {
        ofd_lock(&self.file, Lock::Unlock, self.offset, self.size).unwrap();
    }
}

fn capacities(arenas: &Arenas<Use>) -> Vec<u64> {
    arenas.usage().iter().map(|&(_, _, cap)| cap).collect()
}

#[test]
fn each_arena_is_twice_the_last_or_room_for_three_large_chunks_up_to_the_largest() {
    let arenas = Arenas::<Use>::with_limits(64 * MIB, DEFAULT_IDLE);
    let sizes: Vec<u64> = (0..7).map(|made| arenas.next_capacity(made, 0)).collect();
    assert_eq!(
        sizes,
        [
            4 * MIB,
            8 * MIB,
            16 * MIB,
            32 * MIB,
            64 * MIB,
            64 * MIB,
            64 * MIB
        ]
    );
    // However many there are (no overflow).
    assert_eq!(arenas.next_capacity(usize::MAX, u64::MAX), 64 * MIB);
    // An arena made for a large chunk holds three like it (whole MiB), at least twice the
    // last, at most the largest; up to 1 MiB objects the growth is as for any.
    assert_eq!(arenas.next_capacity(0, MIB + 4 * KIB), 4 * MIB);
    assert_eq!(arenas.next_capacity(0, 8 * MIB + 4 * KIB), 25 * MIB);
    assert_eq!(arenas.next_capacity(3, 8 * MIB), 32 * MIB);
    assert_eq!(arenas.next_capacity(0, 30 * MIB), 64 * MIB);
    // A largest arena below the first size: every arena is that large.
    let small = Arenas::<Use>::with_limits(256 * KIB, DEFAULT_IDLE);
    assert_eq!(small.next_capacity(0, 0), 256 * KIB);
    assert_eq!(small.next_capacity(3, 100 * KIB), 256 * KIB);
    // What fits: the largest arena, less a chunk header.
    assert!(small.room_for(256 * KIB - 64));
    assert!(!small.room_for(256 * KIB - 63));
}

#[test]
fn arenas_grow_as_objects_fill_them() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(16 * MIB, DEFAULT_IDLE);
    // 3 MiB objects, all held: one fits the first arena, two the second, five the third.
    let held: Vec<Held> = (0..4).map(|_| put(&arenas, dir.path(), 3 * MIB)).collect();
    assert_eq!(capacities(&arenas), [4 * MIB, 8 * MIB, 16 * MIB]);
    let paths: Vec<&Path> = held.iter().map(|h| &*h.path).collect();
    assert!(paths[0] != paths[1] && paths[1] == paths[2] && paths[2] != paths[3]);
    // A chunk goes to the newest arena with room (the third), not the older ones.
    let next = put(&arenas, dir.path(), 3 * MIB);
    assert_eq!(next.path, held[3].path);
}

/// `n` chunks of `len` bytes put and held.
fn put_n(arenas: &Arenas<Use>, dir: &Path, n: usize, len: u64) -> Vec<Held> {
    (0..n).map(|_| put(arenas, dir, len)).collect()
}

#[test]
fn chunks_released_here_are_reused_once_a_batch_has_gathered() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    let mut held = put_n(&arenas, dir.path(), RECLAIM_BATCH + 1, 1000);
    let first = held[0].chunk;
    // One released by its last handle: not tried at the next put (one lock per object
    // would be a system call per object), the arena has room elsewhere.
    drop(held.remove(0));
    let next = put(&arenas, dir.path(), 1000);
    assert_ne!(next.chunk.offset, first.offset);
    // A batch released: reclaimed at the next put, which takes the lowest of them (best
    // fit, lowest offset), a new generation.
    held.drain(..RECLAIM_BATCH - 1).for_each(drop);
    let c = put(&arenas, dir.path(), 1000);
    assert_eq!(c.chunk.offset, first.offset);
    assert_ne!(c.chunk.generation, first.generation);
    assert_eq!(capacities(&arenas).len(), 1);
}

#[test]
fn a_released_chunk_is_reused_before_a_new_arena_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    // Fill the one arena, then release one chunk: fewer than a batch, yet the next put
    // reclaims it rather than make a second arena.
    let mut held = vec![put(&arenas, dir.path(), 5000)];
    while let Ok((path, r, _)) = arenas.place(dir.path(), 5000).unwrap() {
        arenas.cancel(&path, &r);
        held.push(put(&arenas, dir.path(), 5000));
    }
    assert!(
        held.len() > 3 && held.len() < RECLAIM_BATCH,
        "{} chunks",
        held.len()
    );
    let freed = held.remove(1).chunk;
    let again = put(&arenas, dir.path(), 5000);
    assert_eq!(again.chunk.offset, freed.offset);
    assert_ne!(again.chunk.generation, freed.generation);
    assert_eq!(capacities(&arenas).len(), 1);
}

#[test]
fn a_cancelled_or_unheld_chunk_is_free_again() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    let (path, r, _) = reserve(&arenas, dir.path(), 1000);
    arenas.cancel(&path, &r);
    assert_eq!(arenas.usage()[0].1, 0);
    // Given out, but its handle was never made: a reuse candidate, reclaimed with the
    // next batch of released chunks.
    let (path, mut r, _) = reserve(&arenas, dir.path(), 1000);
    r.write_at(0, &[1u8; 1000]).unwrap();
    let chunk = arenas.commit(&path, &r, 1000).unwrap().unwrap();
    arenas.settled(&path, chunk.offset, false);
    drop(put_n(&arenas, dir.path(), RECLAIM_BATCH - 1, 1000));
    let again = put(&arenas, dir.path(), 1000);
    assert_eq!(again.chunk.offset, chunk.offset);
    assert_ne!(again.chunk.generation, chunk.generation);
}

#[test]
fn a_chunk_leased_elsewhere_is_retried_at_later_reclaims() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    let mut batch = put_n(&arenas, dir.path(), RECLAIM_BATCH, 1000);
    let _kept = put(&arenas, dir.path(), 1000);
    let first = batch[0].chunk;
    let elsewhere = lease_elsewhere(&batch[0]);
    batch.clear();
    // Released here, still leased by another process: not reused; the rest of the batch
    // is (the lowest of them).
    let c = put(&arenas, dir.path(), 1000);
    assert_ne!(c.chunk.offset, first.offset);
    // Once the other process lets go, the next reclaim tries it again and it is reused
    // (the lowest free offset, an exact fit).
    drop(elsewhere);
    drop(put_n(&arenas, dir.path(), RECLAIM_BATCH, 1000));
    let d = put(&arenas, dir.path(), 1000);
    assert_eq!(d.chunk.offset, first.offset);
    assert_eq!(capacities(&arenas).len(), 1);
}

/// The calls made while holding the interpreter (`try_place`, `try_commit`,
/// `try_settled`) never wait for the lock and never do what may take long: with the lock
/// held elsewhere, with no arena yet, and with an arena full until every chunk leased
/// elsewhere is tried again, they decline, and the waiting calls do it.
#[test]
fn the_calls_that_never_wait_decline_what_may_take_long() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    assert!(arenas.try_place(dir.path(), 4000).is_none(), "no arena yet");
    let mut held = vec![put(&arenas, dir.path(), 4000)];
    let (placed, idle) = arenas.try_place(dir.path(), 4000).unwrap();
    let (path, mut r, _) = placed.unwrap();
    assert!(idle.is_empty());
    r.write_at(0, &[5u8; 4000]).unwrap();
    {
        let _held_elsewhere = arenas.lock_for_fork();
        assert!(arenas.try_place(dir.path(), 4000).is_none());
        assert!(arenas.try_commit(&path, &r, 4000).is_err());
    }
    let chunk = arenas
        .try_commit(&path, &r, 4000)
        .unwrap()
        .unwrap()
        .unwrap();
    {
        let _held_elsewhere = arenas.lock_for_fork();
        assert!(!arenas.try_settled(&path, chunk.offset, false));
    }
    assert!(arenas.try_settled(&path, chunk.offset, false));
    // Fill the arena; three neighbours released here and leased elsewhere stay refused.
    while let Ok((path, r, _)) = arenas.place(dir.path(), 4000).unwrap() {
        arenas.cancel(&path, &r);
        held.push(put(&arenas, dir.path(), 4000));
    }
    // (held[1..4]: adjacent; the chunk given out unheld above was reused at the end.)
    let elsewhere: Vec<Elsewhere> = held[1..4].iter().map(lease_elsewhere).collect();
    drop(held.drain(1..4).collect::<Vec<Held>>());
    assert!(matches!(arenas.place(dir.path(), 4000).unwrap(), Err(1)));
    drop(elsewhere);
    // Room only once the refused chunks are tried again: the waiting call's work.
    assert!(arenas.try_place(dir.path(), 3 * 4096 - 64).is_none());
    let (path, r, _) = arenas.place(dir.path(), 3 * 4096 - 64).unwrap().unwrap();
    arenas.cancel(&path, &r);
    assert_eq!(capacities(&arenas).len(), 1);
}

#[test]
fn a_full_arena_retries_every_chunk_leased_elsewhere_before_a_new_one_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    // Fill the one arena with 4 KiB chunks.
    let mut held = vec![put(&arenas, dir.path(), 4000)];
    while held.len() < 64 {
        match arenas.place(dir.path(), 4000).unwrap() {
            Ok((path, r, _)) => {
                arenas.cancel(&path, &r);
                held.push(put(&arenas, dir.path(), 4000));
            }
            Err(made) => {
                assert_eq!(made, 1);
                break;
            }
        }
    }
    assert!(held.len() > 3 && held.len() < 64, "{} chunks", held.len());
    // Three neighbours released here, leased elsewhere: refused, the arena stays full.
    let elsewhere: Vec<Elsewhere> = held[..3].iter().map(lease_elsewhere).collect();
    let freed: Vec<Held> = held.drain(..3).collect();
    let start = freed.iter().map(|h| h.chunk.offset).min().unwrap();
    drop(freed);
    assert!(matches!(arenas.place(dir.path(), 4000).unwrap(), Err(1)));
    // Let go of elsewhere: a put of three chunks' size finds no room after its one retry,
    // so it retries all of them (coalesced) before asking for a new arena.
    drop(elsewhere);
    let (path, r, _) = match arenas.place(dir.path(), 3 * 4096 - 64).unwrap() {
        Ok(p) => p,
        Err(made) => panic!("no room after the retry ({made} arenas)"),
    };
    assert_eq!(*path, *held[0].path);
    assert!(r.room() >= 3 * 4096 - 64);
    arenas.cancel(&path, &r);
    let again = put(&arenas, dir.path(), 3 * 4096 - 64);
    assert_eq!(again.chunk.offset, start);
    assert_eq!(capacities(&arenas).len(), 1);
}

#[test]
fn an_older_arena_unused_for_the_idle_limit_is_let_go_of() {
    let limit = Duration::from_secs(10);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let arenas = Arenas::<Use>::with_limits(64 * KIB, limit);
    // Two arenas in `a` (the first full), one in `b`.
    let big = 64 * KIB - 64;
    let older = put(&arenas, a.path(), big);
    let newer = put(&arenas, a.path(), big);
    let other = put(&arenas, b.path(), big);
    assert_ne!(older.path, newer.path);
    let t0 = Instant::now();
    let sweep = |at: Instant| {
        let mut list = arenas.lock();
        let gone = arenas.take_idle(&mut list, at);
        drop(list);
        let paths: Vec<PathBuf> = gone.iter().map(|o| o.writer.path().to_owned()).collect();
        let_go(gone);
        paths
    };
    // In use: kept, however long.
    assert!(sweep(t0).is_empty());
    assert!(sweep(t0 + 2 * limit).is_empty());
    let older_path = older.path.to_path_buf();
    drop((older, newer, other));
    // Unused since this sweep: kept until the limit has passed since.
    assert!(sweep(t0).is_empty());
    assert!(sweep(t0 + limit / 2).is_empty());
    assert_eq!(sweep(t0 + limit), std::slice::from_ref(&older_path));
    assert_eq!(let_go_paths(), [older_path]);
    // The newest arena of each directory stays, unused or not.
    assert!(sweep(t0 + 10 * limit).is_empty());
    assert_eq!(capacities(&arenas).len(), 2);
}

#[test]
fn an_arena_used_again_starts_its_idle_time_over() {
    let limit = Duration::from_secs(10);
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, limit);
    let big = 64 * KIB - 64;
    let older = put(&arenas, dir.path(), big);
    let newer = put(&arenas, dir.path(), big);
    let older_path = older.path.to_path_buf();
    let t0 = Instant::now();
    let sweep = |at: Instant| {
        let mut list = arenas.lock();
        let gone = arenas.take_idle(&mut list, at);
        gone.len()
    };
    drop(older);
    assert_eq!(sweep(t0), 0);
    // Used again (the newer one is full: the chunk goes to the older one).
    let again = put(&arenas, dir.path(), big);
    assert_eq!(*again.path, *older_path);
    assert_eq!(sweep(t0 + limit / 2), 0);
    drop(again);
    assert_eq!(sweep(t0 + limit), 0, "idle only since the last sweep");
    assert_eq!(sweep(t0 + 2 * limit), 1);
    drop(newer);
}

#[test]
fn every_64th_put_sweeps_for_idle_arenas() {
    let (dir, elsewhere) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let arenas = Arenas::<Use>::with_limits(64 * KIB, Duration::ZERO);
    let big = 64 * KIB - 64;
    let older = put(&arenas, dir.path(), big); // put 1
    let newer = put(&arenas, dir.path(), big); // put 2 (no room in the first arena)
    drop(older);
    // Puts into another directory (no arena there: none made here) up to the 63rd.
    for _ in 3..IDLE_SWEEP_EVERY {
        assert!(matches!(
            arenas.place(elsewhere.path(), 64).unwrap(),
            Err(2)
        ));
    }
    assert_eq!(capacities(&arenas).len(), 2);
    assert!(let_go_paths().is_empty());
    // The 64th: the older arena, unused, is let go of (the limit is zero).
    assert!(matches!(
        arenas.place(elsewhere.path(), 64).unwrap(),
        Err(1)
    ));
    assert_eq!(capacities(&arenas).len(), 1);
    assert_eq!(let_go_paths().len(), 1);
    drop(newer);
}

#[test]
fn let_go_of_arenas_keep_the_chunks_given_out() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, DEFAULT_IDLE);
    let (path, mut r, arena) = reserve(&arenas, dir.path(), 1000);
    let held = put(&arenas, dir.path(), 1000);
    // Let go of (as `_arena_release` does) while a put writes into it: the chunk is never
    // given out, and the chunk held before is still read.
    let gone = arenas.take_all();
    assert_eq!(gone.len(), 1);
    drop(gone);
    r.write_at(0, &[1u8; 1000]).unwrap();
    assert!(arenas.commit(&path, &r, 1000).is_none());
    arenas.settled(&path, 0, true); // a no-op now
    assert!(arenas.usage().is_empty());
    let (_lease, at, len) = arena.file.lease_own(held.chunk, 1000);
    let mut got = vec![0u8; len as usize];
    std::os::unix::fs::FileExt::read_exact_at(arena.file.file(), &mut got, at).unwrap();
    assert_eq!(got, vec![7u8; 1000]);
}

#[test]
fn a_forked_child_never_fills_its_parents_arenas() {
    let dir = tempfile::tempdir().unwrap();
    let arenas = Arenas::<Use>::with_limits(64 * KIB, Duration::ZERO);
    // Two arenas: the older one full, then unused (idle: the limit is zero).
    let older = put(&arenas, dir.path(), 64 * KIB - 64);
    let held = put(&arenas, dir.path(), 1000);
    let parents = held.path.to_path_buf();
    drop(older);
    // SAFETY: the child runs only this test's code on its own objects (the arena layer's
    // process-wide locks are held across the fork by their hooks), never unwinds out of the
    // closure, and leaves with `_exit`, running no destructor of the parent's.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let checks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Not its own: not listed, not placed into, not counted for the next size.
            let none_listed = arenas.usage().is_empty();
            let not_placed = matches!(arenas.place(dir.path(), 1000), Ok(Err(0)));
            // Nor let go of as idle (the parent's to let go of).
            let mut list = arenas.lock();
            let not_idle = arenas.take_idle(&mut list, Instant::now()).is_empty();
            drop(list);
            // Its own first arena (the first size) replaces the parent's copies.
            let new = new_arena(&arenas, dir.path(), 0);
            let placed = arenas.adopt(new, dir.path(), 1000);
            let own = match placed {
                Ok(Some((path, _, _))) => *path != *parents,
                _ => false,
            };
            let only_own = arenas.lock().len() == 1 && arenas.usage().len() == 1;
            none_listed && not_placed && not_idle && own && only_own
        }));
        let ok = matches!(checks, Ok(true));
        // SAFETY: ends the child at once (no destructor: the directory is the parent's).
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child made above.
    let waited = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(waited, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's checks failed"
    );
    // The parent's arenas are untouched: still both, the newer still holding its chunk.
    let usage = arenas.usage();
    assert_eq!(usage.len(), 2);
    assert_eq!(usage[1], (parents, held.chunk.size, 64 * KIB));
}
