//! `put(obj, arena=True)`: small objects into this process's arena segments
//! (docs/arena.md), and the allocator simulation of the fragmentation benchmark.

use std::borrow::Cow;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::Error;
use super::store::{self, ArenaUse, Handback, Registration, Store};
use super::write::Encoder;
use crate::archive::builder::Sink;
use crate::archive::{Builder, Kind};
use crate::arena::owned::{self, ArenaUser, Arenas, InArena, Owned};
use crate::arena::{alloc, Chunk, PartState, Reservation};
use crate::process::{self, ForkHooks, ForkLock};
use crate::segment;

/// Largest payload of a known size (an array's data, bytes) that goes into an arena: an
/// eighth of the largest arena ([`Arenas::capacity`]: 8 MiB by default), and never less than
/// [`MIN_PAYLOAD`]; bigger ones get a segment of their own. Such a payload is encoded
/// straight into its chunk (no copy through memory), and an arena's pages, once written,
/// are written again by the next objects instead of a new segment's being faulted in, which
/// is most of a multi-megabyte segment's cost (docs/arena.md, "The threshold"). An eighth:
/// the arena made for such an object has room for three like it ([`Arenas::next_capacity`])
/// and stays within the largest, so a stream of them with a few in flight stays in one
/// arena.
pub(crate) fn max_payload() -> u64 {
    (ARENAS.capacity() / PAYLOAD_SHARE).max(MIN_PAYLOAD)
}

/// [`max_payload`] is this share of the largest arena ...
const PAYLOAD_SHARE: u64 = 8;
/// ... and at least this: a 1 MiB array or bytes object is an arena object whatever
/// `SHMSTORE_ARENA_SIZE` says, as long as it fits in an arena.
const MIN_PAYLOAD: u64 = 1 << 20;

/// An arena made for a large chunk takes at most this share of its directory's room
/// ([`new_arena`]).
const LARGE_ARENA_SHARE: u64 = 4;

/// Largest archive of an object of unknown size (a dict, a list) that goes into an arena:
/// it is built in memory first ([`encode_small`]), so its size is found out by encoding,
/// at most this much buffered: 1 MiB and the archive's own bytes ([`ARCHIVE_ROOM`]).
pub(crate) const MAX_BUFFERED: u64 = MIN_PAYLOAD + ARCHIVE_ROOM as u64;

/// A chunk reserved in an arena of this process: the arena's path, the reservation, and
/// this process's use of the arena.
type Placed = owned::Placed<ArenaUse>;

/// This process's arenas (`crate::arena::owned`: which arena a chunk goes to, growth, idle
/// release, a forked child's copies), with the fork hooks of their lock.
static ARENAS: Arenas<ArenaUse> = Arenas::new(fork_hooks);

impl ArenaUser for ArenaUse {
    fn file(&self) -> &crate::arena::ArenaFile {
        &self.file
    }

    /// With the process's last-used arena if it is one of them.
    fn letting_go(gone: &dyn Fn(&Arc<Self>) -> bool) {
        store::forget_last_arena_if(gone);
    }
}

/// A new arena in the segment directory, registered with the supervisor before it exists.
/// `None` without a supervisor: then nothing would remove the arena after a crash, so
/// objects get segments of their own instead.
/// Also `None` when the segment directory has no room for a whole arena: a small object
/// that fits gets a segment of its own there (an arena is only a way to make puts cheaper).
/// An arena made for a chunk larger than [`MAX_BUFFERED`] (an array or `bytes` over 1 MiB)
/// takes at most a [`LARGE_ARENA_SHARE`]th of the room left in the directory, else the
/// object gets a segment of its own: such an arena stays reserved while its process lives,
/// and must not crowd other processes' segments out of a small /dev/shm (a container's is
/// 64 MiB by default).
fn new_arena(
    py: Python<'_>,
    dir: PathBuf,
    made: usize,
    max_len: u64,
) -> PyResult<Option<Owned<ArenaUse>>> {
    let cap = ARENAS.next_capacity(made, max_len);
    let room = if max_len > MAX_BUFFERED {
        cap.saturating_mul(LARGE_ARENA_SHARE)
    } else {
        cap
    };
    if py.detach(|| owned::no_room(&dir, room)) {
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
    let made = py.detach(|| owned::make_arena(&dir, &name, cap));
    let (writer, file) = match made {
        Err(e) if owned::is_full(&e) => return Ok(None), // filled meanwhile
        made => made.map_err(|err| Error::Arena {
            at: format!("new arena in {}", dir.display()),
            err,
        })?,
    };
    log::debug!("created arena {} ({cap} bytes)", writer.path().display());
    Ok(Some(Owned::new(
        dir,
        writer,
        ArenaUse::created(file, registration),
    )))
}

/// Containers with more items than this are not tried in an arena: their archive would
/// hardly fit in [`MAX_BUFFERED`] bytes, and finding out costs an encoding.
const MAX_ITEMS: usize = 1 << 16;

/// Whether `obj` may have an archive small enough for an arena: its known size
/// (`size_hint`) is at most [`max_payload`], or, unknown, it holds at most [`MAX_ITEMS`] items.
pub(crate) fn may_fit(obj: &Bound<'_, PyAny>, size_hint: Option<u64>) -> bool {
    match size_hint {
        Some(n) => n <= max_payload(),
        None => obj.len().map_or(true, |n| n <= MAX_ITEMS),
    }
}

/// Bytes of an object archive besides a known-size payload (header, index, metadata, the
/// payload's alignment), reserved up front by [`encode_small`]; more is grown into.
const ARCHIVE_ROOM: usize = 4096;

/// An in-memory sink that refuses to grow past `limit` bytes (and says so in `over`).
struct Bounded<'a> {
    out: Cursor<Vec<u8>>,
    limit: u64,
    over: &'a std::sync::atomic::AtomicBool,
}

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let end = self.out.position().saturating_add(buf.len() as u64);
        if end > self.limit {
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

/// The object archive of `obj`, built in memory; `None` when it is larger than an arena
/// takes (found out while writing: at most that much is buffered): [`MAX_BUFFERED`], or,
/// for a larger payload of known size (`size_hint`: an array, bytes; this way only when
/// encoding it straight into a chunk overflowed the room reserved for its archive's own
/// bytes), that payload and [`ARCHIVE_ROOM`]. For a known size the buffer is made that
/// large at once, not grown (and copied) step by step while writing.
pub(crate) fn encode_small(
    obj: &Bound<'_, PyAny>,
    size_hint: Option<u64>,
) -> PyResult<Option<Vec<u8>>> {
    let over = std::sync::atomic::AtomicBool::new(false);
    let (limit, room) = match size_hint {
        Some(n) if n <= max_payload() => {
            let room = n.saturating_add(ARCHIVE_ROOM as u64);
            (room.max(MAX_BUFFERED), usize::try_from(room).unwrap_or(0))
        }
        Some(_) => return Ok(None),
        None => (MAX_BUFFERED, 0),
    };
    let sink = Bounded {
        out: Cursor::new(Vec::with_capacity(room)),
        limit,
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

/// A chunk of an arena of this process just committed: the arena's path, the chunk, this
/// process's use of the arena, and the archive's length and the mapping it was written
/// through.
pub(crate) struct Committed<'a> {
    path: &'a Arc<Path>,
    chunk: Chunk,
    arena: Arc<ArenaUse>,
    len: u64,
    written: &'a Arc<memmap2::MmapRaw>,
}

/// What a put keeps of the object it wrote: a store, mapped and opened, for a handle
/// (`Arc<Store>`: `shmstore.put`), or a [`Put`] (a channel's objects, read only by their
/// getters).
pub(crate) trait Keep: Sized + Send {
    /// Kept of a chunk just committed; made without Python (the GIL is not held).
    fn chunk(c: Committed<'_>) -> Result<Self, Error>;
    /// Kept of an object that went into a segment of its own.
    fn segment(store: Arc<Store>) -> Self;
}

impl Keep for Arc<Store> {
    fn chunk(c: Committed<'_>) -> Result<Self, Error> {
        store::own_chunk(c.path.to_path_buf(), c.chunk, c.arena, c.len, c.written).map(Arc::new)
    }

    fn segment(store: Arc<Store>) -> Self {
        store
    }
}

/// An object put into a channel: the store of its own segment, or, in an arena, its chunk
/// held without opening the archive (a store's reader made and dropped for nothing was a
/// tenth of a small channel put; the getter opens it).
pub(crate) enum Put {
    Store(Arc<Store>),
    Held(store::HeldChunk),
}

impl Keep for Put {
    fn chunk(c: Committed<'_>) -> Result<Self, Error> {
        let held = store::hold_own_chunk(c.path.clone(), c.chunk, c.arena, c.len);
        Ok(Put::Held(held))
    }

    fn segment(store: Arc<Store>) -> Self {
        Put::Store(store)
    }
}

/// Put an encoded object archive into an arena of this process (in `dir`, the default
/// directory if `None`) and keep it (`K`); `None` when it is too large for an arena or
/// arenas are unavailable (no supervisor).
pub(crate) fn put_archive<K: Keep>(
    py: Python<'_>,
    archive: &[u8],
    dir: Option<&Path>,
) -> PyResult<Option<K>> {
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
pub(crate) enum InPlace<K> {
    /// In a chunk, kept (`K`).
    Put(K),
    /// No arena available (no supervisor, no room for one): the object needs a segment.
    NoArena,
    /// Its archive may be larger than the chunk an arena would reserve: encode it into
    /// memory first ([`encode_small`]) to find out.
    DidNotFit,
}

/// Put `obj`, whose payload is `size` bytes (an array, `bytes`), into an arena of this
/// process, encoding its archive straight into a chunk reserved for it (no buffer, one
/// copy of the payload; the chunk shrinks to the archive's length), and keep it (`K`).
pub(crate) fn put_in_place<K: Keep>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    size: u64,
    dir: Option<&Path>,
) -> PyResult<InPlace<K>> {
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

fn in_arena(e: InArena) -> Error {
    arena_error(&e.path, e.err)
}

/// How many times this process gave the GIL back for a step of a small object's arena
/// work: {"place": n, "commit": n, "settle": n, "open": n} (`store::Handback`). A test
/// checks that uncontended puts and gets of small objects give it back for none.
#[pyfunction]
pub(crate) fn _arena_gil_handbacks() -> std::collections::HashMap<&'static str, u64> {
    store::handbacks().into_iter().collect()
}

/// Whether an archive of up to `max_len` bytes may go into an arena at all.
fn fits(max_len: u64) -> bool {
    max_len <= max_payload().saturating_add(ARCHIVE_ROOM as u64) && ARENAS.room_for(max_len)
}

/// A chunk for an archive of up to `max_len` bytes in one of this process's arenas in `dir`
/// (the default directory if `None`), a new arena made when none has room; `None` when it
/// is too large for an arena or arenas are unavailable (no supervisor, no room).
fn reserve(py: Python<'_>, max_len: u64, dir: Option<&Path>) -> PyResult<Option<Placed>> {
    if !fits(max_len) {
        return Ok(None);
    }
    // A directory already absolute (a channel's, every put) is taken as it is, not copied.
    let dir = match dir {
        Some(d) if segment::is_plain_absolute(d) => Cow::Borrowed(d),
        Some(d) => Cow::Owned(store::absolute_path(d.to_owned())?),
        None => Cow::Owned(segment::default_dir()),
    };
    // Arena work needs no Python. Done with the GIL when it can be done at once (the lock
    // free now, room without a full reclaim or a new arena: a few microseconds): handing
    // the GIL back and taking it again costs more than that, and, while another thread
    // runs Python, takes up to the interpreter's switch interval (5 ms) each time. Else
    // without the GIL: the lock is never waited for with it.
    let placed = match ARENAS.try_place(&dir, max_len) {
        Some((placed, idle)) => {
            if !idle.is_empty() {
                py.detach(|| owned::let_go(idle));
            }
            placed.map(Ok)
        }
        None => {
            store::handed_back(Handback::Place);
            py.detach(|| ARENAS.place(&dir, max_len))
        }
    }
    .map_err(in_arena)?;
    match placed {
        Ok(p) => Ok(Some(p)),
        Err(made) => {
            let Some(new) = new_arena(py, dir.clone().into_owned(), made, max_len)? else {
                return Ok(None);
            };
            let placed = py.detach(|| ARENAS.adopt(new, &dir, max_len));
            Ok(placed.map_err(in_arena)?)
        }
    }
}

/// Give a reserved chunk back (nothing was given out from it).
fn cancel(py: Python<'_>, path: &Path, r: &Reservation) {
    py.detach(|| ARENAS.cancel(path, r));
}

/// Give out the chunk of `r`, holding an archive of `len` bytes, and keep it (`K`: a store
/// for this process's handle, or the chunk only held); `None` if this process let go of the
/// arena meanwhile (`_arena_release`, by another thread or by code the encoding ran): the
/// chunk was never given out, the object goes elsewhere. Done with the GIL, as placing it
/// ([`reserve`]): committing the chunk (one `fcntl` that never waits) and settling it are
/// short, and so is making its store (a lease taken without waiting, the archive's tables
/// parsed: at most as much work as writing them, which this call just did with the GIL);
/// only a lock someone holds now is waited for without the GIL.
fn give_out<K: Keep>(
    py: Python<'_>,
    path: Arc<Path>,
    r: Reservation,
    len: u64,
    arena: Arc<ArenaUse>,
) -> PyResult<Option<K>> {
    let committed = match ARENAS.try_commit(&path, &r, len) {
        Ok(done) => done,
        Err(()) => {
            store::handed_back(Handback::Commit);
            py.detach(|| ARENAS.commit(&path, &r, len))
        }
    };
    let chunk = match committed {
        Some(Ok(chunk)) => chunk,
        Some(Err(e)) => return Err(in_arena(e).into()),
        None => {
            log::debug!(
                "arena {} let go of while an object was written into it",
                path.display()
            );
            return Ok(None);
        }
    };
    let opened = K::chunk(Committed {
        path: &path,
        chunk,
        arena,
        len,
        written: r.map(),
    });
    // Held by its handle now (or failed): the chunk is an ordinary one from here on; if the
    // handle was not made, this process holds no lease on it, so it is a reuse candidate.
    let held = opened.is_ok();
    if !ARENAS.try_settled(&path, chunk.offset, held) {
        store::handed_back(Handback::Settle);
        py.detach(|| ARENAS.settled(&path, chunk.offset, held));
    }
    Ok(Some(opened?))
}

thread_local! {
    /// [`ARENAS`], held by the forking thread from before the fork to after it: a child
    /// never inherits it locked by a thread that does not exist in it (it would hang at its
    /// first small `put`).
    static HELD: std::cell::RefCell<Option<MutexGuard<'static, Vec<Owned<ArenaUse>>>>> =
        const { std::cell::RefCell::new(None) };
}

fn release_held() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

/// Register the fork hooks of [`ARENAS`] ([`ForkLock::Arenas`]: after the arena files,
/// before the arena uses of `store`; no code holds it while taking a lock ordered before
/// it). [`ARENAS`] runs this before every lock of it.
fn fork_hooks() {
    // The hooks only lock and unlock a process-global mutex held for short stretches,
    // never touch Python and never unwind (poisoning is recovered from). The value guarded
    // is left as it is (nothing is dropped in the child but the guard).
    process::on_fork(
        ForkLock::Arenas,
        ForkHooks {
            before: || {
                let arenas = ARENAS.lock_for_fork();
                HELD.with(|h| *h.borrow_mut() = Some(arenas));
            },
            after_parent: release_held,
            after_child: release_held,
        },
    );
}

/// Let go of this process's arenas (and of the arena it last read from): no new object goes
/// into them, and each is removed once no process uses a chunk of it any more (handles made
/// before keep working). For tests and for long-lived processes done with small objects.
#[pyfunction]
pub(crate) fn _arena_release(py: Python<'_>) -> usize {
    let gone = py.detach(|| ARENAS.take_all());
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
        ARENAS
            .usage()
            .into_iter()
            .map(|(path, used, cap)| (path.display().to_string(), used, cap))
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
