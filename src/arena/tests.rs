//! Tests of the arena files, writers and leases.

use super::Offsets;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use super::file::*;
use super::format::*;
use super::writer::*;
use crate::segment;

fn arena(dir: &Path) -> ArenaWriter {
    ArenaWriter::create(dir, "shmstore-arena-test", 1 << 20).unwrap()
}

/// `n` chunks of `len` bytes each (the i-th filled with i), put and settled.
fn settled_chunks(w: &mut ArenaWriter, n: u8, len: usize) -> Vec<Chunk> {
    let cs: Vec<Chunk> = (0..n)
        .map(|i| w.put(&vec![i; len]).unwrap().unwrap())
        .collect();
    for c in &cs {
        w.settled(c.offset);
    }
    cs
}

#[test]
fn put_lease_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let meta = std::fs::metadata(w.path()).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o400);
    let c = w.put(b"hello arena").unwrap().unwrap();
    let f = ArenaFile::open(w.path()).unwrap();
    f.mark_owned();
    let (lease, at, len) = f.lease(c).unwrap();
    let mut got = vec![0u8; len as usize];
    f.file().read_exact_at(&mut got, at).unwrap();
    assert_eq!(got, b"hello arena");
    // Still sealed after the write (mode and the mtime mark).
    let meta = std::fs::metadata(w.path()).unwrap();
    assert_eq!(meta.mtime_nsec(), i64::from(segment::SEALED_MTIME_NSEC));
    drop(lease);
    let mut released = Offsets::default();
    f.move_released_into(&mut released);
    assert_eq!(released, Offsets::from_iter([c.offset]));
    f.move_released_into(&mut released);
    assert_eq!(released.len(), 1, "nothing released since");
}

#[test]
fn a_leased_chunk_is_not_reused_and_a_stale_handle_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let c = w.put(&[1u8; 1000]).unwrap().unwrap();
    w.settled(c.offset);
    let f = ArenaFile::open(w.path()).unwrap();
    let (lease, _, _) = f.lease(c).unwrap();
    // The creator gave it up, but a lease holds it: not reused.
    let mut pending = Offsets::from_iter([c.offset]);
    w.reclaim(&mut pending).unwrap();
    assert!(w.is_refused(c.offset));
    let d = w.put(&[2u8; 1000]).unwrap().unwrap();
    assert_ne!(d.offset, c.offset);
    drop(lease);
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
    assert_eq!(w.refused_count(), 0);
    // Reused: same place, new generation; the old handle is stale.
    let e = w.put(&[3u8; 1000]).unwrap().unwrap();
    w.settled(e.offset);
    assert_eq!(e.offset, c.offset);
    assert_ne!(e.generation, c.generation);
    match f.lease(c) {
        Err(ArenaError::Stale { want, have, .. }) => {
            assert_eq!((want, have), (c.generation, e.generation))
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // The refused lease left no lock behind: the new chunk can be freed and reused.
    let mut pending = Offsets::from_iter([e.offset]);
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
}

/// Adjacent chunks are reclaimed with one lock over the run when nobody holds any of
/// them; a lease on one of them keeps that one (only) from reuse.
#[test]
fn a_run_of_freed_chunks_is_reclaimed_around_a_leased_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let cs = settled_chunks(&mut w, 5, 300);
    assert!(cs
        .windows(2)
        .all(|p| p[0].offset + p[0].size == p[1].offset));
    let f = ArenaFile::open(w.path()).unwrap();
    let (lease, _, _) = f.lease(cs[2]).unwrap();
    let mut pending: Offsets = cs.iter().map(|c| c.offset).collect();
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
    assert!(w.is_refused(cs[2].offset) && w.refused_count() == 1);
    // The freed ones are locked again (free space): a lease on one is refused.
    assert!(matches!(f.lease(cs[0]), Err(ArenaError::Stale { .. })));
    assert!(matches!(f.lease(cs[4]), Err(ArenaError::Stale { .. })));
    // ...and reused, best fit from the lowest offset.
    let again = w.put(&[9u8; 300]).unwrap().unwrap();
    assert_eq!(again.offset, cs[0].offset);
    drop(lease);
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
    assert_eq!(w.refused_count(), 0);
    // A run nobody holds: reclaimed at once, every chunk of it refused to a lease.
    let run: Vec<Chunk> = (0..3u8)
        .map(|i| w.put(&[i; 2000]).unwrap().unwrap())
        .collect();
    let mut pending = Offsets::default();
    for c in &run {
        w.settled(c.offset);
        pending.insert(c.offset);
    }
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
    for c in &run {
        assert!(matches!(f.lease(*c), Err(ArenaError::Stale { .. })));
    }
}

/// Chunks found leased are tried again a few at a time, in offset order from where the
/// last call stopped; `reclaim` tries them all.
#[test]
fn chunks_held_elsewhere_are_retried_a_few_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let cs = settled_chunks(&mut w, 10, 500);
    let f = ArenaFile::open(w.path()).unwrap();
    let leases: Vec<_> = cs.iter().map(|c| f.lease(*c).unwrap().0).collect();
    // Released since the last call: every one is tried, however few retries are asked.
    let mut pending: Offsets = cs.iter().map(|c| c.offset).collect();
    w.reclaim_some(&mut pending, 0).unwrap();
    assert!(pending.is_empty());
    assert_eq!(w.refused_count(), 10);
    drop(leases);
    // No retries asked: nothing tried again.
    w.reclaim_some(&mut pending, 0).unwrap();
    assert_eq!(w.refused_count(), 10);
    let held =
        |w: &ArenaWriter| -> Vec<bool> { cs.iter().map(|c| w.is_refused(c.offset)).collect() };
    w.reclaim_some(&mut pending, 3).unwrap();
    assert_eq!(
        held(&w),
        [false, false, false, true, true, true, true, true, true, true]
    );
    w.reclaim_some(&mut pending, 3).unwrap();
    assert_eq!(
        held(&w),
        [false, false, false, false, false, false, true, true, true, true]
    );
    // Everything, and the freed chunks are reused.
    w.reclaim(&mut pending).unwrap();
    assert_eq!(w.refused_count(), 0);
    assert_eq!(w.put(&[1u8; 500]).unwrap().unwrap().offset, cs[0].offset);
}

/// A release of a chunk's offset that arrives between the write and the creator's own
/// lease (a stale handle of the same place let go meanwhile) does not free the chunk.
#[test]
fn a_fresh_chunk_is_not_reclaimed_before_it_is_settled() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let c = w.put(&[1u8; 100]).unwrap().unwrap();
    let mut pending = Offsets::from_iter([c.offset]);
    w.reclaim(&mut pending).unwrap();
    assert!(
        pending.contains(&c.offset),
        "freed before its handle held it"
    );
    assert_ne!(w.put(&[2u8; 100]).unwrap().unwrap().offset, c.offset);
    w.settled(c.offset);
    w.reclaim(&mut pending).unwrap();
    assert!(pending.is_empty());
}

#[test]
fn hostile_handles_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let c = w.put(b"x").unwrap().unwrap();
    let f = ArenaFile::open(w.path()).unwrap();
    for bad in [
        Chunk { offset: 0, ..c },
        Chunk {
            offset: c.offset + 1,
            ..c
        },
        Chunk {
            size: u64::MAX,
            ..c
        },
        Chunk {
            offset: u64::MAX - 63,
            ..c
        },
        Chunk {
            offset: c.offset + c.size,
            ..c
        },
    ] {
        assert!(f.lease(bad).is_err(), "{bad:?}");
    }
    // Not an arena at all.
    let other = dir.path().join("shmstore-not-arena");
    std::fs::write(&other, [0u8; 5000]).unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o400)).unwrap();
    assert!(matches!(
        ArenaFile::open(&other),
        Err(ArenaError::Corrupt { .. })
    ));
}

#[test]
fn survey_shows_chunks_and_free_space() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let a = w.put(&[1u8; 100]).unwrap().unwrap();
    let b = w.put(&[2u8; 1000]).unwrap().unwrap();
    let s = survey(w.path()).unwrap();
    assert_eq!(s.capacity, 1 << 20);
    assert_eq!(s.creator_pid, std::process::id());
    let chunks: Vec<_> = s.parts.iter().filter(|p| p.generation.is_some()).collect();
    assert_eq!(chunks.len(), 2);
    assert_eq!(
        (chunks[0].offset, chunks[0].generation),
        (a.offset, Some(1))
    );
    assert_eq!(
        (chunks[1].offset, chunks[1].generation),
        (b.offset, Some(2))
    );
    assert!(chunks.iter().all(|p| p.state == PartState::Unleased));
    let rest = s.parts.last().unwrap();
    assert_eq!((rest.generation, rest.state), (None, PartState::Free));
    assert_eq!(s.parts.iter().map(|p| p.size).sum::<u64>(), s.capacity);
}

/// A payload written through a chunk's sink comes back with the xxh3 of its bytes,
/// whether the copy streams and hashes on the way or not, aligned or not; past the room
/// it is refused.
#[test]
fn a_payload_is_hashed_as_it_is_written_into_a_chunk() {
    use crate::archive::builder::Sink;
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let f = ArenaFile::open(w.path()).unwrap();
    // Below and above the size from which the copy streams (and hashes on the way),
    // after an odd-sized write so that the payload starts unaligned too.
    for (n, pad) in [(1000, 0), (STREAM_COPY, 0), (65_536 + 7, 0), (65_536, 3)] {
        let payload: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut r = w.reserve(n as u64 + 64).unwrap().unwrap();
        let sum = {
            let mut sink = r.sink();
            sink.write_all(&[9u8; 3][..pad]).unwrap();
            sink.write_hashed(&payload).unwrap()
        };
        assert_eq!(sum, xxhash_rust::xxh3::xxh3_64(&payload), "{n} bytes");
        let c = w.commit(&r, (pad + n) as u64).unwrap();
        w.settled(c.offset);
        let (lease, at, len) = f.lease(c).unwrap();
        let mut got = vec![0u8; len as usize];
        f.file().read_exact_at(&mut got, at).unwrap();
        assert_eq!(&got[pad..], &payload[..], "{n} bytes");
        drop(lease);
        // Past the room: refused, nothing written.
        let mut r = w.reserve(100).unwrap().unwrap();
        let big = vec![1u8; r.room() as usize + 1];
        assert!(r.sink().write_hashed(&big).is_err());
        assert!(r.overflowed());
        w.cancel(&r);
    }
}

/// An archive written in place: the chunk is reserved larger, shrunk to what was
/// written at the commit; the tail is free space again (locked: no lease on it); a
/// write past the room is refused and a cancelled chunk is free (and locked) again.
#[test]
fn a_reserved_chunk_is_written_in_place_then_shrunk_or_cancelled() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut w = arena(dir.path());
    let f = ArenaFile::open(w.path()).unwrap();
    let mut r = w.reserve(10_000).unwrap().unwrap();
    assert!(r.room() >= 10_000);
    {
        let mut sink = r.sink();
        sink.write_all(&[0u8; 8]).unwrap();
        sink.write_all(b" in place").unwrap();
        sink.seek(SeekFrom::Start(0)).unwrap();
        sink.write_all(b"written!").unwrap();
    }
    let c = w.commit(&r, 17).unwrap();
    w.settled(c.offset);
    assert_eq!(
        c.size, 128,
        "shrunk to the chunk header and 17 bytes, 64-aligned"
    );
    let (lease, at, len) = f.lease(c).unwrap();
    let mut got = vec![0u8; len as usize];
    f.file().read_exact_at(&mut got, at).unwrap();
    assert_eq!(got, b"written! in place");
    // The tail is free space: locked by the creator, so no lease is taken on it.
    let tail = Chunk {
        offset: c.offset + c.size,
        size: 128,
        generation: 0,
    };
    assert!(matches!(f.lease(tail), Err(ArenaError::Stale { .. })));
    // ...and the next chunk is placed there.
    let mut r2 = w.reserve(100).unwrap().unwrap();
    assert_eq!(r2.offset, tail.offset);
    // Writing past the room is refused, nothing is given out; cancelled, the chunk is
    // free again and its range still refuses leases.
    assert!(r2.write_at(r2.room() - 1, b"ab").is_err());
    assert!(r2.overflowed());
    w.cancel(&r2);
    assert!(matches!(
        f.lease(Chunk {
            offset: r2.offset,
            size: r2.size,
            generation: r2.generation,
        }),
        Err(ArenaError::Stale { .. })
    ));
    assert_eq!(w.reserve(100).unwrap().unwrap().offset, tail.offset);
    // A commit longer than the reservation is refused (and frees it).
    let r3 = w.reserve(100).unwrap().unwrap();
    assert!(w.commit(&r3, r3.room() + 1).is_err());
    assert_eq!(w.reserve(100).unwrap().unwrap().offset, r3.offset);
    drop(lease);
}

#[test]
fn full_arena_says_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = ArenaWriter::create(dir.path(), "shmstore-arena-small", 4096).unwrap();
    assert!(w.put(&[0u8; 3000]).unwrap().is_some());
    assert!(w.put(&[0u8; 3000]).unwrap().is_none());
}
