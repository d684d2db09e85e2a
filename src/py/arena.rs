//! `put(obj, arena=True)`: small objects into this process's arena segments
//! (docs/arena.md), and the allocator simulation of the fragmentation benchmark.

use std::collections::HashSet;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::Error;
use super::store::{self, ArenaUse, Registration, Store};
use super::write::Encoder;
use crate::archive::builder::Sink;
use crate::archive::{Builder, Kind};
use crate::arena::{alloc, ArenaFile, ArenaWriter, PartState, Reservation};
use crate::process::{self, ForkHooks, ForkLock};
use crate::segment;

/// Largest payload of a known size (an array's data, bytes) that goes into an arena: up to
/// and including 1 MiB (bigger ones get a segment of their own).
pub(crate) const MAX_PAYLOAD: usize = 1 << 20;
/// Largest object archive that goes into an arena: a payload of [`MAX_PAYLOAD`] with its
/// archive's own bytes ([`ARCHIVE_ROOM`]), so that a 1 MiB array or bytes object is an
/// arena object, as documented ("<= 1 MiB"), and not a segment of its own.
pub(crate) const MAX_OBJECT: usize = MAX_PAYLOAD + ARCHIVE_ROOM;
/// Bytes of chunks of the largest arena segment, unless `SHMSTORE_ARENA_SIZE` says otherwise.
const DEFAULT_CAPACITY: u64 = 64 << 20;
/// Bytes of chunks of a process's first arena; each next one is twice the last, up to
/// [`capacity`]: a process that puts a few small objects reserves 4 MiB, not 64.
const FIRST_CAPACITY: u64 = 4 << 20;

/// A chunk reserved in an arena of this process: the arena's path, the reservation, and
/// this process's use of the arena.
type Placed = (PathBuf, Reservation, Arc<ArenaUse>);

/// One arena of this process: the writer, this process's use of it (the opened file, whose
/// releases say which chunks this process no longer holds, and the supervisor
/// registration), and chunks released since the last reclaim (the writer keeps those found
/// leased elsewhere).
struct Owned {
    dir: PathBuf,
    writer: ArenaWriter,
    arena: Arc<ArenaUse>,
    pending: HashSet<u64>,
    /// Since when no object has used it (seen by [`take_idle`]; reset when a chunk is placed
    /// in it).
    idle_since: Option<Instant>,
}

static ARENAS: Mutex<Vec<Owned>> = Mutex::new(Vec::new());

/// Every this many small `put`s, the process looks for older arenas of its own that no
/// object has used for [`idle_limit`] and hands them back ([`take_idle`]).
const IDLE_SWEEP_EVERY: u64 = 64;
/// How long an older arena stays reserved with no object in it, unless
/// `SHMSTORE_ARENA_IDLE` (seconds) says otherwise.
const DEFAULT_IDLE: Duration = Duration::from_secs(10);
/// Chunks that other processes held at their last try, tried again at each small `put`
/// (in the arena it goes to; all of them when that arena has no room left) ...
const RETRIES_PER_PUT: usize = 1;
/// ... and at each sweep for idle arenas, in each older arena.
const RETRIES_PER_SWEEP: usize = 64;
/// Small `put`s so far (for [`IDLE_SWEEP_EVERY`]).
static PUTS: AtomicU64 = AtomicU64::new(0);

/// The largest arena's capacity: `SHMSTORE_ARENA_SIZE`, read once per process (at its first
/// small `put`), or [`DEFAULT_CAPACITY`].
fn capacity() -> u64 {
    static CAPACITY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CAPACITY.get_or_init(|| {
        std::env::var("SHMSTORE_ARENA_SIZE")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|&n| n >= 4096)
            .unwrap_or(DEFAULT_CAPACITY)
    })
}

/// How long an older arena may go unused before it is handed back: `SHMSTORE_ARENA_IDLE`
/// (seconds, read once per process), or [`DEFAULT_IDLE`].
fn idle_limit() -> Duration {
    static IDLE: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *IDLE.get_or_init(|| {
        std::env::var("SHMSTORE_ARENA_IDLE")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(DEFAULT_IDLE)
    })
}

/// A chunk for an archive of up to `max_len` bytes in one of this process's arenas in
/// `dir`; `None` when none has room.
fn place(arenas: &mut [Owned], dir: &Path, max_len: u64) -> Result<Option<Placed>, Error> {
    for a in arenas
        .iter_mut()
        .rev()
        .filter(|a| a.writer.is_ours() && a.dir == dir)
    {
        let released = a.arena.file.take_released();
        a.pending.extend(released);
        let path = a.writer.path().to_owned();
        let arena_err = |err| arena_error(&path, err);
        a.writer
            .reclaim_some(&mut a.pending, RETRIES_PER_PUT)
            .map_err(arena_err)?;
        let mut reserved = a.writer.reserve(max_len).map_err(arena_err)?;
        if reserved.is_none() && a.writer.refused_count() > 0 {
            // No room: every chunk held elsewhere at its last try is tried again before
            // the next arena is made (once per time this arena fills up).
            a.writer.reclaim(&mut a.pending).map_err(arena_err)?;
            reserved = a.writer.reserve(max_len).map_err(arena_err)?;
        }
        if let Some(r) = reserved {
            a.idle_since = None;
            return Ok(Some((path, r, a.arena.clone())));
        }
    }
    Ok(None)
}

/// This process's arenas that no object has used for [`idle_limit`] (every chunk free once
/// the chunks no process holds are reclaimed, at this sweep and at the ones since it was
/// first seen so, and nothing placed in it meanwhile), except the newest in each directory,
/// where the next objects go: taken out of `arenas`, to be dropped (outside the lock), which
/// hands their shared memory back once no process maps them. A burst of small objects grows
/// a process's arenas (4, 8, 16 MiB...); without this they would stay reserved while it
/// lives. The delay keeps a stream of objects that cycles through its arenas from handing
/// one back and making it again (a 64 MiB arena takes tens of milliseconds to make).
fn take_idle(arenas: &mut Vec<Owned>, now: Instant) -> Vec<Owned> {
    let mut newest: HashSet<PathBuf> = HashSet::new();
    let mut idle = vec![false; arenas.len()];
    for (i, a) in arenas.iter_mut().enumerate().rev() {
        if !a.writer.is_ours() || newest.insert(a.dir.clone()) {
            continue;
        }
        let released = a.arena.file.take_released();
        a.pending.extend(released);
        if a.writer
            .reclaim_some(&mut a.pending, RETRIES_PER_SWEEP)
            .is_ok()
            && a.writer.usage().0 == 0
        {
            let since = *a.idle_since.get_or_insert(now);
            idle[i] = now.saturating_duration_since(since) >= idle_limit();
        } else {
            a.idle_since = None;
        }
    }
    let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(arenas)
        .into_iter()
        .zip(idle)
        .partition(|(_, idle)| *idle);
    *arenas = kept.into_iter().map(|(a, _)| a).collect();
    gone.into_iter().map(|(a, _)| a).collect()
}

/// Let go of `idle` arenas ([`take_idle`]), with the process's last-used arena if it is one
/// of them (call without the arenas' lock: a drop queues a DROP, taking the client's lock).
fn let_go(idle: Vec<Owned>) {
    if idle.is_empty() {
        return;
    }
    log::debug!("handing back {} arenas no object uses", idle.len());
    store::forget_last_arena_if(|u| idle.iter().any(|a| Arc::ptr_eq(u, &a.arena)));
    drop(idle);
}

/// The size of this process's next arena when it has `made` arenas already.
fn next_capacity(made: usize) -> u64 {
    let max = capacity();
    let grown = FIRST_CAPACITY
        .checked_shl(made.min(16) as u32)
        .unwrap_or(max);
    grown.min(max)
}

/// A new arena in the segment directory, registered with the supervisor before it exists.
/// `None` without a supervisor: then nothing would remove the arena after a crash, so
/// objects get segments of their own instead.
/// Also `None` when the segment directory has no room for a whole arena: a small object
/// that fits gets a segment of its own there (an arena is only a way to make puts cheaper).
fn new_arena(py: Python<'_>, dir: PathBuf, made: usize) -> PyResult<Option<Owned>> {
    let cap = next_capacity(made);
    let full = |e: &crate::arena::ArenaError| {
        matches!(
            e,
            crate::arena::ArenaError::Segment(segment::SegmentError::Full { .. })
        )
    };
    let room = py.detach(|| ArenaWriter::preflight(&dir, cap));
    if room.as_ref().is_err_and(full) {
        log::debug!(
            "no room for an arena in {}: a segment per object",
            dir.display()
        );
        return Ok(None);
    }
    let name = segment::random_name();
    let registration = Registration::created(py, dir.join(&name));
    if !registration.is_active() {
        return Ok(None);
    }
    let made = py.detach(|| {
        let w = ArenaWriter::create(&dir, &name, cap)?;
        let f = ArenaFile::open(w.path())?;
        f.mark_owned();
        Ok::<_, crate::arena::ArenaError>((w, f))
    });
    let (writer, file) = match made {
        Err(e) if full(&e) => return Ok(None), // filled meanwhile
        made => made.map_err(|err| Error::Arena {
            at: format!("new arena in {}", dir.display()),
            err,
        })?,
    };
    log::debug!("created arena {} ({cap} bytes)", writer.path().display());
    Ok(Some(Owned {
        dir,
        writer,
        arena: ArenaUse::created(file, registration),
        pending: HashSet::new(),
        idle_since: None,
    }))
}

/// Containers with more items than this are not tried in an arena: their archive would
/// hardly fit in [`MAX_OBJECT`] bytes, and finding out costs an encoding.
const MAX_ITEMS: usize = 1 << 16;

/// Whether `obj` may have an archive small enough for an arena: its known size
/// (`size_hint`) is at most [`MAX_PAYLOAD`], or, unknown, it holds at most [`MAX_ITEMS`] items.
pub(crate) fn may_fit(obj: &Bound<'_, PyAny>, size_hint: Option<u64>) -> bool {
    match size_hint {
        Some(n) => n <= MAX_PAYLOAD as u64,
        None => obj.len().map_or(true, |n| n <= MAX_ITEMS),
    }
}

/// Bytes of an object archive besides a known-size payload (header, index, metadata, the
/// payload's alignment), reserved up front by [`encode_small`]; more is grown into.
const ARCHIVE_ROOM: usize = 4096;

/// An in-memory sink that refuses to grow past [`MAX_OBJECT`] bytes (and says so in `over`).
struct Bounded<'a> {
    out: Cursor<Vec<u8>>,
    over: &'a std::sync::atomic::AtomicBool,
}

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let end = (self.out.position() as usize).saturating_add(buf.len());
        if end > MAX_OBJECT {
            self.over.store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(std::io::Error::other("larger than an arena object"));
        }
        self.out.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink for Bounded<'_> {}

impl std::io::Seek for Bounded<'_> {
    fn seek(&mut self, pos: std::io::SeekFrom) -> std::io::Result<u64> {
        self.out.seek(pos)
    }
}

/// The object archive of `obj`, built in memory; `None` when it is larger than
/// [`MAX_OBJECT`] (found out while writing: at most that much is buffered). `size_hint`:
/// the payload's size when known (an array, bytes): the buffer is made that large plus room
/// for the archive's own bytes at once, not grown (and copied) step by step while writing.
pub(crate) fn encode_small(
    obj: &Bound<'_, PyAny>,
    size_hint: Option<u64>,
) -> PyResult<Option<Vec<u8>>> {
    let over = std::sync::atomic::AtomicBool::new(false);
    let room = size_hint
        .and_then(|n| usize::try_from(n).ok())
        .map_or(0, |n| n.min(MAX_PAYLOAD).saturating_add(ARCHIVE_ROOM));
    let sink = Bounded {
        out: Cursor::new(Vec::with_capacity(room)),
        over: &over,
    };
    let archive_err = |err| Error::Archive {
        at: "obj".into(),
        err,
    };
    let built = (|| {
        let mut builder =
            Builder::new(sink, Kind::Object, crate::arena::pid()).map_err(archive_err)?;
        Encoder::new(&mut builder, "obj").write_record(obj, None)?;
        let (out, _) = builder.finish(now_ms()).map_err(archive_err)?;
        Ok::<_, PyErr>(out.out.into_inner())
    })();
    match built {
        Ok(bytes) => Ok(Some(bytes)),
        Err(_) if over.load(std::sync::atomic::Ordering::Relaxed) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Put an encoded object archive into an arena of this process and map it; `None` when it
/// is too large for an arena or arenas are unavailable (no supervisor).
pub(crate) fn put_archive(
    py: Python<'_>,
    archive: &[u8],
    dir: Option<PathBuf>,
) -> PyResult<Option<Arc<Store>>> {
    let Some(placed) = reserve(py, archive.len() as u64, dir)? else {
        return Ok(None);
    };
    let (path, mut r, arena) = placed;
    if let Err(e) = r.write_at(0, archive) {
        cancel(py, &path, &r);
        return Err(arena_io(&path, e));
    }
    give_out(py, path, r, archive.len() as u64, arena)
}

/// What became of [`put_in_place`].
pub(crate) enum InPlace {
    /// In a chunk, mapped for its handle.
    Put(Arc<Store>),
    /// No arena available (no supervisor, no room for one): the object needs a segment.
    NoArena,
    /// Its archive may be larger than the chunk an arena would reserve: encode it into
    /// memory first ([`encode_small`]) to find out.
    DidNotFit,
}

/// Put `obj`, whose payload is `size` bytes (an array, `bytes`), into an arena of this
/// process, encoding its archive straight into a chunk reserved for it (no buffer, one
/// copy of the payload; the chunk shrinks to the archive's length), and map it.
pub(crate) fn put_in_place(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    size: u64,
    dir: Option<PathBuf>,
) -> PyResult<InPlace> {
    let slot = overhead_slot(obj);
    let max_len = size.saturating_add(overhead(slot));
    if !fits(max_len) {
        return Ok(InPlace::DidNotFit);
    }
    let Some((path, mut r, arena)) = reserve(py, max_len, dir)? else {
        return Ok(InPlace::NoArena);
    };
    // Encoding runs Python code: no lock of this process is held meanwhile (the reserved
    // chunk is this call's alone until it is given out).
    let built = build(obj, r.sink());
    match built {
        Ok(len) => {
            note_overhead(slot, len, size);
            // Let go of meanwhile: encoded again, into memory, for a new arena.
            Ok(give_out(py, path, r, len, arena)?.map_or(InPlace::DidNotFit, InPlace::Put))
        }
        Err(e) => {
            cancel(py, &path, &r);
            if r.overflowed() {
                // More than the objects before it needed besides their payload (another
                // shape, a bytes object after arrays): found out by encoding into memory.
                return Ok(InPlace::DidNotFit);
            }
            Err(e)
        }
    }
}

/// The archive of `obj` took `len` bytes for a payload of `size`: reserve that much more
/// than the payload for objects like it from now on.
pub(crate) fn learn_overhead(obj: &Bound<'_, PyAny>, len: u64, size: u64) {
    note_overhead(overhead_slot(obj), len, size);
}

fn note_overhead(slot: usize, len: u64, size: u64) {
    OVERHEAD[slot].fetch_max(len.saturating_sub(size), Ordering::Relaxed);
}

/// Which objects share an [`OVERHEAD`]: arrays by their number of dimensions (a shape's
/// size), everything else together.
fn overhead_slot(obj: &Bound<'_, PyAny>) -> usize {
    if obj.is_instance_of::<pyo3::types::PyBytes>() {
        return OTHER;
    }
    obj.getattr(pyo3::intern!(obj.py(), "ndim"))
        .and_then(|n| n.extract::<usize>())
        .map_or(OTHER, |n| n.min(OTHER - 1))
}

/// The most bytes an archive of a known-size object took besides its payload so far in
/// this process (header, record, metadata, the payload's alignment), for arrays of each
/// number of dimensions (up to 64) and for other objects ([`OTHER`]); 0 until the first
/// ([`ARCHIVE_ROOM`] is reserved then). The chunk reserved for the next one is that much
/// larger than its payload: objects of one type and shape get chunks of one size, which
/// fit the holes their predecessors leave.
static OVERHEAD: [AtomicU64; OTHER + 1] = [const { AtomicU64::new(0) }; OTHER + 1];
const OTHER: usize = 65;

fn overhead(slot: usize) -> u64 {
    match OVERHEAD[slot].load(Ordering::Relaxed) {
        0 => ARCHIVE_ROOM as u64,
        n => n,
    }
}

/// Build the object archive of `obj` into `sink`; its length.
fn build<W: Sink + Send>(obj: &Bound<'_, PyAny>, sink: W) -> PyResult<u64> {
    let archive_err = |err| Error::Archive {
        at: "obj".into(),
        err,
    };
    let mut builder = Builder::new(sink, Kind::Object, crate::arena::pid()).map_err(archive_err)?;
    Encoder::new(&mut builder, "obj").write_record(obj, None)?;
    let (_, len) = builder.finish(now_ms()).map_err(archive_err)?;
    Ok(len)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn arena_io(path: &Path, e: std::io::Error) -> PyErr {
    let err = crate::arena::ArenaError::Segment(segment::SegmentError::io(path, e));
    arena_error(path, err).into()
}

/// An arena error, said of the arena at `path`.
fn arena_error(path: &Path, err: crate::arena::ArenaError) -> Error {
    Error::Arena {
        at: format!("arena {:?}", path.display().to_string()),
        err,
    }
}

/// Whether an archive of up to `max_len` bytes may go into an arena at all.
fn fits(max_len: u64) -> bool {
    max_len <= MAX_OBJECT as u64 && max_len.saturating_add(64) <= capacity()
}

/// Run `f` on this process's arena at `path` under the arenas' lock, without the GIL;
/// `None` if the process let go of it.
fn with_owned<R: Send>(
    py: Python<'_>,
    path: &Path,
    f: impl FnOnce(&mut Owned) -> R + Send,
) -> Option<R> {
    py.detach(|| {
        let mut arenas = arenas();
        arenas
            .iter_mut()
            .find(|a| a.writer.path().as_os_str() == path.as_os_str())
            .map(f)
    })
}

/// A chunk for an archive of up to `max_len` bytes in one of this process's arenas in `dir`
/// (the default directory if `None`), a new arena made when none has room; `None` when it
/// is too large for an arena or arenas are unavailable (no supervisor, no room).
fn reserve(py: Python<'_>, max_len: u64, dir: Option<PathBuf>) -> PyResult<Option<Placed>> {
    if !fits(max_len) {
        return Ok(None);
    }
    // Arena work needs no Python: done without the GIL (never wait for the lock with it).
    let dir = dir.unwrap_or_else(segment::default_dir);
    let sweep = PUTS.fetch_add(1, Ordering::Relaxed) % IDLE_SWEEP_EVERY == IDLE_SWEEP_EVERY - 1;
    let placed = py.detach(|| {
        let mut arenas = arenas();
        let placed = place(&mut arenas, &dir, max_len);
        let idle = if sweep {
            take_idle(&mut arenas, Instant::now())
        } else {
            Vec::new()
        };
        // With no room: how many arenas this process holds (the next one's size).
        let made = arenas.iter().filter(|a| a.writer.is_ours()).count();
        drop(arenas);
        let_go(idle);
        Ok::<_, Error>(placed?.ok_or(made))
    })?;
    match placed {
        Ok(p) => Ok(Some(p)),
        Err(made) => {
            let Some(new) = new_arena(py, dir.clone(), made)? else {
                return Ok(None);
            };
            let placed = py.detach(|| {
                let mut arenas = arenas();
                // A forked child's copies of its parent's arenas are not ours to fill
                // (dropped after the lock: a drop queues a DROP, taking the client's lock).
                let (ours, inherited) = std::mem::take(&mut *arenas)
                    .into_iter()
                    .partition(|a| a.writer.is_ours());
                *arenas = ours;
                arenas.push(new);
                let n = arenas.len();
                let placed = place(&mut arenas[n - 1..], &dir, max_len);
                drop(arenas);
                drop::<Vec<Owned>>(inherited);
                placed
            })?;
            Ok(placed)
        }
    }
}

/// Give a reserved chunk back (nothing was given out from it).
fn cancel(py: Python<'_>, path: &Path, r: &Reservation) {
    with_owned(py, path, |a| a.writer.cancel(r));
}

/// Give out the chunk of `r`, holding an archive of `len` bytes, and map it for this
/// process's handle; `None` if this process let go of the arena meanwhile
/// (`_arena_release`, by another thread or by code the encoding ran): the chunk was never
/// given out, the object goes elsewhere.
fn give_out(
    py: Python<'_>,
    path: PathBuf,
    r: Reservation,
    len: u64,
    arena: Arc<ArenaUse>,
) -> PyResult<Option<Arc<Store>>> {
    let committed = with_owned(py, &path, |a| {
        a.writer
            .commit(&r, len)
            .map_err(|err| arena_error(&path, err))
    })
    .transpose()?;
    let Some(chunk) = committed else {
        log::debug!(
            "arena {} let go of while an object was written into it",
            path.display()
        );
        return Ok(None);
    };
    let written = r.map().clone();
    let opened = store::open_chunk(py, path.clone(), chunk, Some((arena, len, written)));
    let failed = opened.is_err();
    // Held by its handle now (or failed): the chunk is an ordinary one from here on; if the
    // handle was not made, this process holds no lease on it, so it is a reuse candidate.
    with_owned(py, &path, |a| {
        a.writer.settled(chunk.offset);
        if failed {
            a.pending.insert(chunk.offset);
        }
    });
    opened.map(Some)
}

thread_local! {
    /// [`ARENAS`], held by the forking thread from before the fork to after it: a child
    /// never inherits it locked by a thread that does not exist in it (it would hang at its
    /// first small `put`).
    static HELD: std::cell::RefCell<Option<MutexGuard<'static, Vec<Owned>>>> =
        const { std::cell::RefCell::new(None) };
}

fn release_held() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

/// Register the fork hooks of [`ARENAS`] ([`ForkLock::Arenas`]: after the arena files,
/// before the arena uses of `store`; no code holds it while taking a lock ordered before
/// it).
fn fork_hooks() {
    // The hooks only lock and unlock a process-global mutex held for short stretches,
    // never touch Python and never unwind (poisoning is recovered from). The value guarded
    // is left as it is (nothing is dropped in the child but the guard).
    process::on_fork(
        ForkLock::Arenas,
        ForkHooks {
            before: || {
                let arenas = ARENAS.lock().unwrap_or_else(|p| p.into_inner());
                HELD.with(|h| *h.borrow_mut() = Some(arenas));
            },
            after_parent: release_held,
            after_child: release_held,
        },
    );
}

/// [`ARENAS`], locked, with the fork hooks registered.
fn arenas() -> MutexGuard<'static, Vec<Owned>> {
    fork_hooks();
    ARENAS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Let go of this process's arenas (and of the arena it last read from): no new object goes
/// into them, and each is removed once no process uses a chunk of it any more (handles made
/// before keep working). For tests and for long-lived processes done with small objects.
#[pyfunction]
pub(crate) fn _arena_release(py: Python<'_>) -> usize {
    let gone = py.detach(|| std::mem::take(&mut *arenas()));
    let n = gone.len();
    // Dropping sends the supervisor a DROP for each (queued, never blocks).
    drop(gone);
    store::forget_last_arena();
    n
}

/// Bytes in use and capacity of this process's arenas: [(path, used, capacity)].
#[pyfunction]
pub(crate) fn _arena_usage(py: Python<'_>) -> Vec<(String, u64, u64)> {
    py.detach(|| {
        let arenas = arenas();
        arenas
            .iter()
            .filter(|a| a.writer.is_ours())
            .map(|a| {
                let (used, cap) = a.writer.usage();
                (a.writer.path().display().to_string(), used, cap)
            })
            .collect()
    })
}

/// The fragmentation benchmark's allocator simulation (`alloc::simulate`): `ops` random
/// put/free operations, sizes log-uniform in [lo, hi]. policy: "best-fit" (the arena's
/// allocator) or "first-fit" (first fit without coalescing). Returns a dict with ops,
/// peak_live and peak_end (bytes), and seconds.
#[pyfunction]
#[pyo3(signature = (policy, ops, lo=64, hi=1_048_576, live_target=1000, seed=1))]
pub(crate) fn _arena_simulate<'py>(
    py: Python<'py>,
    policy: &str,
    ops: u64,
    lo: u64,
    hi: u64,
    live_target: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let best_fit = match policy {
        "best-fit" => true,
        "first-fit" => false,
        other => return Err(Error::Usage(format!("unknown policy {other:?}")).into()),
    };
    if lo == 0 || hi < lo {
        return Err(Error::Usage("need 0 < lo <= hi".into()).into());
    }
    let t = std::time::Instant::now();
    let stats = py.detach(|| alloc::simulate(best_fit, ops, lo, hi, live_target, seed));
    let d = PyDict::new(py);
    d.set_item("ops", stats.ops)?;
    d.set_item("peak_live", stats.peak_live)?;
    d.set_item("peak_end", stats.peak_end)?;
    d.set_item("seconds", t.elapsed().as_secs_f64())?;
    Ok(d)
}

/// `shmstore inspect` of an arena: {"capacity", "creator_pid", "chunks": [{"offset", "size",
/// "generation", "state"}]} (docs/arena.md, "Inspecting an arena"). `path`: the arena file.
#[pyfunction]
pub(crate) fn _arena_info<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let survey = py
        .detach(|| crate::arena::survey(&path))
        .map_err(|err| arena_error(&path, err))?;
    let d = PyDict::new(py);
    d.set_item("capacity", survey.capacity)?;
    d.set_item("creator_pid", survey.creator_pid)?;
    let chunks = pyo3::types::PyList::empty(py);
    for p in &survey.parts {
        let c = PyDict::new(py);
        c.set_item("offset", p.offset)?;
        c.set_item("size", p.size)?;
        c.set_item("generation", p.generation)?;
        c.set_item(
            "state",
            match p.state {
                PartState::Free => "free",
                PartState::Leased => "leased",
                PartState::Unleased => "unleased",
                PartState::Unused => "unused",
            },
        )?;
        chunks.append(c)?;
    }
    d.set_item("chunks", chunks)?;
    Ok(d)
}
