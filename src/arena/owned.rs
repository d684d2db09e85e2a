//! This process's own arenas (docs/arena.md, "Arena size and idle arenas"): the policy of a
//! small `put`, with no Python in it. Which arena a chunk comes from (the newest with room,
//! best fit in it; a chunk released here but still leased by another process tried again
//! later), when a new arena is needed and how large (each twice the last, from
//! [`FIRST_CAPACITY`] up to the largest, `SHMSTORE_ARENA_SIZE`), when an older arena nobody
//! uses is let go of (every [`IDLE_SWEEP_EVERY`]th small `put`, after
//! `SHMSTORE_ARENA_IDLE` seconds), and what a forked child does with its parent's arenas
//! (never fills them: they are not its own).
//!
//! [`Arenas`] is generic over this process's use of an arena ([`ArenaUser`]): the binding
//! layer's `ArenaUse` (the arena file opened once plus the supervisor registration) in the
//! module, a plain file in the tests here. The binding layer makes the arena itself (the
//! registration needs Python: [`make_arena`] does the rest) and holds [`Arenas`] in a static,
//! whose lock it registers with `crate::process` (`ForkLock::Arenas`, given as `fork_hooks`
//! to [`Arenas::new`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use super::file::ArenaFile;
use super::format::ArenaError;
use super::writer::{ArenaWriter, Chunk, Reservation};
use super::Offsets;
use crate::segment::SegmentError;

/// Bytes of chunks of the largest arena segment, unless `SHMSTORE_ARENA_SIZE` says otherwise.
pub const DEFAULT_CAPACITY: u64 = 64 << 20;
/// Bytes of chunks of a process's first arena; each next one is twice the last, up to
/// [`Arenas::capacity`]: a process that puts a few small objects reserves 4 MiB, not 64.
pub const FIRST_CAPACITY: u64 = 4 << 20;
/// An arena made for a large chunk (up to an eighth of the largest arena: a payload of
/// known size, docs/arena.md) has room for this many like it, so that a stream of such
/// objects with a few in flight stays in one arena instead of making one per object (1 MiB
/// objects: the first arena's 4 MiB, as before).
pub const ROOM_FOR_LARGE: u64 = 3;
/// Every this many small `put`s, the process looks for older arenas of its own that no
/// object has used for [`Arenas::idle_limit`] and hands them back ([`Arenas::take_idle`]).
pub const IDLE_SWEEP_EVERY: u64 = 64;
/// How long an older arena stays reserved with no object in it, unless
/// `SHMSTORE_ARENA_IDLE` (seconds) says otherwise.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(10);
/// Chunks released here are reclaimed (each checked for other processes' leases: one OFD
/// lock per run of adjacent chunks) once this many have gathered, or when the arena has no
/// room otherwise. One at every small `put` was a system call per object, and each such
/// call walks the file's whole list of locks, which a stream of objects in flight makes
/// long; gathered, the chunks of a stream are mostly adjacent and go back in one call.
pub const RECLAIM_BATCH: usize = 16;
/// Chunks that other processes held at their last try, tried again at each reclaim of a
/// batch, as many as the batch (in the arena a `put` goes to; all of them when that arena
/// has no room left) ...
const RETRIES_PER_BATCH: usize = RECLAIM_BATCH;
/// ... and at each sweep for idle arenas, in each older arena.
const RETRIES_PER_SWEEP: usize = 64;

/// This process's use of one of its arenas, kept by [`Arenas`] and by every chunk of it
/// used here: the binding layer's `ArenaUse` (the file and the supervisor registration).
pub trait ArenaUser: Send + Sync + Sized + 'static {
    /// The arena file as this process opened it (marked owned): its releases say which
    /// chunks this process no longer holds.
    fn file(&self) -> &ArenaFile;

    /// Called just before arenas of this process are let go of for being idle (without the
    /// arenas' lock): `gone` says which. Whatever else keeps them lets go here.
    fn letting_go(gone: &dyn Fn(&Arc<Self>) -> bool);
}

/// A chunk reserved in an arena of this process: the arena's path, the reservation, and
/// this process's use of the arena.
pub type Placed<U> = (Arc<Path>, Reservation, Arc<U>);

/// An arena error, with the arena it was met in.
#[derive(Debug)]
pub struct InArena {
    pub path: PathBuf,
    pub err: ArenaError,
}

/// One arena of this process: the writer, this process's use of it (the opened file, whose
/// releases say which chunks this process no longer holds, and what else the user keeps),
/// and chunks released since the last reclaim (the writer keeps those found leased
/// elsewhere).
pub struct Owned<U> {
    dir: PathBuf,
    /// The arena's path (the writer's), shared with each chunk placed in it: no copy per put.
    path: Arc<Path>,
    writer: ArenaWriter,
    arena: Arc<U>,
    pending: Offsets,
    /// Since when no object has used it (seen by [`Arenas::take_idle`]; reset when a chunk
    /// is placed in it).
    idle_since: Option<Instant>,
}

impl<U: ArenaUser> Owned<U> {
    /// A new arena in `dir` ([`make_arena`]) and this process's use of it.
    pub fn new(dir: PathBuf, writer: ArenaWriter, arena: Arc<U>) -> Self {
        Owned {
            dir,
            path: writer.path().into(),
            writer,
            arena,
            pending: Offsets::default(),
            idle_since: None,
        }
    }

    /// Take the chunks released here since the last look into `pending`.
    fn note_released(&mut self) {
        self.arena.file().move_released_into(&mut self.pending);
    }
}

/// Whether `e` says the segment directory is full.
pub fn is_full(e: &ArenaError) -> bool {
    matches!(e, ArenaError::Segment(SegmentError::Full { .. }))
}

/// Whether `dir` lacks room for a whole arena of `capacity` bytes (other failures of the
/// check are left to [`make_arena`]).
pub fn no_room(dir: &Path, capacity: u64) -> bool {
    ArenaWriter::preflight(dir, capacity)
        .as_ref()
        .is_err_and(is_full)
}

/// Make the arena file `name` in `dir` with `capacity` bytes of chunks, and open it as its
/// creator's (marked owned). The caller registers it with the supervisor first.
pub fn make_arena(
    dir: &Path,
    name: &str,
    capacity: u64,
) -> Result<(ArenaWriter, Arc<ArenaFile>), ArenaError> {
    let w = ArenaWriter::create(dir, name, capacity)?;
    let f = ArenaFile::open(w.path())?;
    f.mark_owned();
    Ok((w, f))
}

/// This process's arenas (of one kind of use, `U`), with the small-`put` counter and the
/// limits. A static of the binding layer holds the module's.
pub struct Arenas<U> {
    list: Mutex<Vec<Owned<U>>>,
    /// Small `put`s so far (for [`IDLE_SWEEP_EVERY`]).
    puts: AtomicU64,
    capacity: OnceLock<u64>,
    idle: OnceLock<Duration>,
    /// Registers the fork hooks of `list` (run before every lock of it).
    fork_hooks: fn(),
}

/// The arenas' list, locked.
pub type ArenasGuard<'a, U> = MutexGuard<'a, Vec<Owned<U>>>;

impl<U: ArenaUser> Arenas<U> {
    /// No arenas yet; the limits are read from the environment at first use
    /// ([`Self::capacity`], [`Self::idle_limit`]). `fork_hooks` registers the hooks that
    /// hold the lock across a fork ([`Self::lock_for_fork`]); it runs before every lock.
    pub const fn new(fork_hooks: fn()) -> Self {
        Arenas {
            list: Mutex::new(Vec::new()),
            puts: AtomicU64::new(0),
            capacity: OnceLock::new(),
            idle: OnceLock::new(),
            fork_hooks,
        }
    }

    /// No arenas yet, with these limits (not the environment's) and no fork hooks.
    #[cfg(test)]
    pub(crate) fn with_limits(capacity: u64, idle: Duration) -> Self {
        Arenas {
            capacity: OnceLock::from(capacity),
            idle: OnceLock::from(idle),
            ..Arenas::new(|| {})
        }
    }

    /// The list, locked, with the fork hooks registered.
    fn lock(&self) -> ArenasGuard<'_, U> {
        (self.fork_hooks)();
        self.lock_for_fork()
    }

    /// The list, locked (poisoning recovered from), without registering anything: for the
    /// hook that holds it across a fork.
    pub fn lock_for_fork(&self) -> ArenasGuard<'_, U> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The list, locked, with the fork hooks registered, if no one holds the lock now.
    fn try_lock(&self) -> Option<ArenasGuard<'_, U>> {
        (self.fork_hooks)();
        match self.list.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The largest arena's capacity: `SHMSTORE_ARENA_SIZE`, read once (at the first small
    /// `put`), or [`DEFAULT_CAPACITY`].
    pub fn capacity(&self) -> u64 {
        *self.capacity.get_or_init(|| {
            std::env::var("SHMSTORE_ARENA_SIZE")
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .filter(|&n| n >= 4096)
                .unwrap_or(DEFAULT_CAPACITY)
        })
    }

    /// How long an older arena may go unused before it is handed back:
    /// `SHMSTORE_ARENA_IDLE` (seconds, read once), or [`DEFAULT_IDLE`].
    pub fn idle_limit(&self) -> Duration {
        *self.idle.get_or_init(|| {
            std::env::var("SHMSTORE_ARENA_IDLE")
                .ok()
                .and_then(|s| s.parse::<f64>().ok())
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .unwrap_or(DEFAULT_IDLE)
        })
    }

    /// Whether an archive of up to `max_len` bytes fits in the largest arena.
    pub fn room_for(&self, max_len: u64) -> bool {
        max_len.saturating_add(64) <= self.capacity()
    }

    /// The size of this process's next arena when it has `made` arenas already, made for
    /// an archive of up to `max_len` bytes: twice the last (from [`FIRST_CAPACITY`]), and at
    /// least room for [`ROOM_FOR_LARGE`] chunks like this one (whole MiB), up to the largest
    /// arena.
    pub fn next_capacity(&self, made: usize, max_len: u64) -> u64 {
        let max = self.capacity();
        let grown = FIRST_CAPACITY
            .checked_shl(made.min(16) as u32)
            .unwrap_or(max);
        const MIB: u64 = 1 << 20;
        let wanted = max_len
            .saturating_add(super::format::CHUNK_HEADER)
            .saturating_mul(ROOM_FOR_LARGE)
            .div_ceil(MIB)
            .saturating_mul(MIB);
        grown.max(wanted).min(max)
    }

    /// A chunk for an archive of up to `max_len` bytes in one of this process's arenas in
    /// `dir`, or, when none has room, how many arenas this process holds (the next one's
    /// size: [`Self::next_capacity`]; make it and hand it to [`Self::adopt`]). Counts a
    /// small `put`: every [`IDLE_SWEEP_EVERY`]th also lets go of idle arenas
    /// ([`Self::take_idle`]). Takes the lock: call without the GIL.
    pub fn place(&self, dir: &Path, max_len: u64) -> Result<Result<Placed<U>, usize>, InArena> {
        let sweep = self.count_put();
        let mut arenas = self.lock();
        let placed = place_in(&mut arenas, dir, max_len, Reclaim::All);
        let idle = if sweep {
            self.take_idle(&mut arenas, Instant::now())
        } else {
            Vec::new()
        };
        // With no room: how many arenas this process holds (the next one's size).
        let made = arenas.iter().filter(|a| a.writer.is_ours()).count();
        drop(arenas);
        let_go(idle);
        match placed? {
            PlaceIn::Placed(p) => Ok(Ok(p)),
            PlaceIn::NoRoom | PlaceIn::Later => Ok(Err(made)),
        }
    }

    /// [`Self::place`] when it can be done at once, for a caller that holds the
    /// interpreter: only if the lock is free now (never waited for), and only where an
    /// arena in `dir` has room without trying again every chunk other processes held (a
    /// reclaim whose cost grows with what they hold) and without a new arena. `None`
    /// otherwise: then call [`Self::place`], which does the same and the rest. Arenas the
    /// sweep found idle come back with the chunk: hand them to [`let_go`] without the
    /// interpreter (dropping an arena unmaps it).
    #[allow(clippy::type_complexity)]
    pub fn try_place(
        &self,
        dir: &Path,
        max_len: u64,
    ) -> Option<(Result<Placed<U>, InArena>, Vec<Owned<U>>)> {
        let mut arenas = self.try_lock()?;
        let placed = match place_in(&mut arenas, dir, max_len, Reclaim::Bounded) {
            Ok(PlaceIn::Placed(p)) => Ok(p),
            Ok(PlaceIn::NoRoom | PlaceIn::Later) => return None,
            Err(e) => Err(e),
        };
        let idle = if self.count_put() {
            self.take_idle(&mut arenas, Instant::now())
        } else {
            Vec::new()
        };
        Some((placed, idle))
    }

    /// Count a small `put`; whether it is the one that sweeps for idle arenas.
    fn count_put(&self) -> bool {
        self.puts.fetch_add(1, Ordering::Relaxed) % IDLE_SWEEP_EVERY == IDLE_SWEEP_EVERY - 1
    }

    /// Add `new`, an arena made after [`Self::place`] found no room, and place the chunk in
    /// it. A forked child's copies of its parent's arenas are not ours to fill: they are
    /// dropped now (after the lock: a drop may take locks ordered after it).
    pub fn adopt(
        &self,
        new: Owned<U>,
        dir: &Path,
        max_len: u64,
    ) -> Result<Option<Placed<U>>, InArena> {
        let mut arenas = self.lock();
        let (ours, inherited) = std::mem::take(&mut *arenas)
            .into_iter()
            .partition(|a| a.writer.is_ours());
        *arenas = ours;
        arenas.push(new);
        let n = arenas.len();
        let placed = place_in(&mut arenas[n - 1..], dir, max_len, Reclaim::All);
        drop(arenas);
        drop::<Vec<Owned<U>>>(inherited);
        Ok(match placed? {
            PlaceIn::Placed(p) => Some(p),
            PlaceIn::NoRoom | PlaceIn::Later => None,
        })
    }

    /// This process's arenas that no object has used for [`Self::idle_limit`] (every chunk
    /// free once the chunks no process holds are reclaimed, at this sweep and at the ones
    /// since it was first seen so, and nothing placed in it meanwhile), except the newest in
    /// each directory, where the next objects go: taken out of `arenas`, to be let go of
    /// (outside the lock), which hands their shared memory back once no process maps them.
    /// A burst of small objects grows a process's arenas (4, 8, 16 MiB...); without this
    /// they would stay reserved while it lives. The delay keeps a stream of objects that
    /// cycles through its arenas from handing one back and making it again (a 64 MiB arena
    /// takes tens of milliseconds to make).
    fn take_idle(&self, arenas: &mut Vec<Owned<U>>, now: Instant) -> Vec<Owned<U>> {
        let limit = self.idle_limit();
        let mut newest: HashSet<PathBuf> = HashSet::new();
        let mut idle = vec![false; arenas.len()];
        for (i, a) in arenas.iter_mut().enumerate().rev() {
            if !a.writer.is_ours() || newest.insert(a.dir.clone()) {
                continue;
            }
            a.note_released();
            if a.writer
                .reclaim_some(&mut a.pending, RETRIES_PER_SWEEP)
                .is_ok()
                && a.writer.usage().0 == 0
            {
                let since = *a.idle_since.get_or_insert(now);
                idle[i] = now.saturating_duration_since(since) >= limit;
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

    /// Run `f` on this process's arena at `path` under the lock; `None` if the process let
    /// go of it.
    fn with_owned<R>(&self, path: &Path, f: impl FnOnce(&mut Owned<U>) -> R) -> Option<R> {
        owned_at(&mut self.lock(), path).map(f)
    }

    /// [`Self::with_owned`] if no one holds the lock now (never waits: for a caller that
    /// holds the interpreter); `Err(())` when someone does.
    fn try_with_owned<R>(
        &self,
        path: &Path,
        f: impl FnOnce(&mut Owned<U>) -> R,
    ) -> Result<Option<R>, ()> {
        Ok(owned_at(&mut self.try_lock().ok_or(())?, path).map(f))
    }

    /// Give a reserved chunk of the arena at `path` back (nothing was given out from it).
    pub fn cancel(&self, path: &Path, r: &Reservation) {
        self.with_owned(path, |a| a.writer.cancel(r));
    }

    /// Give out the chunk of `r` in the arena at `path`, holding an archive of `len` bytes;
    /// `None` if this process let go of the arena meanwhile (the chunk was never given out).
    /// Then [`Self::settled`] once its handle holds it (or was not made).
    pub fn commit(&self, path: &Path, r: &Reservation, len: u64) -> Option<Result<Chunk, InArena>> {
        self.with_owned(path, |a| commit_in(a, path, r, len))
    }

    /// [`Self::commit`] if the lock is free now; `Err(())` when it is taken (then call
    /// [`Self::commit`] without the interpreter). A commit is one `fcntl` that never waits.
    #[allow(clippy::type_complexity)]
    pub fn try_commit(
        &self,
        path: &Path,
        r: &Reservation,
        len: u64,
    ) -> Result<Option<Result<Chunk, InArena>>, ()> {
        self.try_with_owned(path, |a| commit_in(a, path, r, len))
    }

    /// The chunk at `offset` of the arena at `path` is held by its handle now (`held`), or
    /// its handle was not made: an ordinary chunk from here on, and without a handle, one
    /// this process holds no lease on, so a reuse candidate.
    pub fn settled(&self, path: &Path, offset: u64, held: bool) {
        self.with_owned(path, |a| settle(a, offset, held));
    }

    /// [`Self::settled`] if the lock is free now; `false` when it is taken (then call
    /// [`Self::settled`] without the interpreter).
    pub fn try_settled(&self, path: &Path, offset: u64, held: bool) -> bool {
        self.try_with_owned(path, |a| settle(a, offset, held))
            .is_ok()
    }

    /// Bytes in use and capacity of this process's arenas: [(path, used, capacity)].
    pub fn usage(&self) -> Vec<(PathBuf, u64, u64)> {
        let arenas = self.lock();
        arenas
            .iter()
            .filter(|a| a.writer.is_ours())
            .map(|a| {
                let (used, cap) = a.writer.usage();
                (a.writer.path().to_owned(), used, cap)
            })
            .collect()
    }

    /// Every arena, taken out (no new chunk goes into them): drop them outside the lock.
    pub fn take_all(&self) -> Vec<Owned<U>> {
        std::mem::take(&mut *self.lock())
    }
}

/// This process's arena at `path` among `arenas`.
fn owned_at<'a, U>(arenas: &'a mut [Owned<U>], path: &Path) -> Option<&'a mut Owned<U>> {
    arenas
        .iter_mut()
        .find(|a| a.writer.path().as_os_str() == path.as_os_str())
}

/// See [`Arenas::commit`].
fn commit_in<U>(
    a: &mut Owned<U>,
    path: &Path,
    r: &Reservation,
    len: u64,
) -> Result<Chunk, InArena> {
    a.writer.commit(r, len).map_err(|err| InArena {
        path: path.to_owned(),
        err,
    })
}

/// See [`Arenas::settled`].
fn settle<U>(a: &mut Owned<U>, offset: u64, held: bool) {
    a.writer.settled(offset);
    if !held {
        a.pending.insert(offset);
    }
}

/// How much reclaiming [`place_in`] may do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reclaim {
    /// Whatever finding room takes: an arena with no room tries again every chunk other
    /// processes held at their last try.
    All,
    /// Only what was released since the last reclaim (amortised over the releases) and
    /// [`RETRIES_PER_BATCH`] retries: an arena that needs more stops the search.
    Bounded,
}

/// What [`place_in`] found.
enum PlaceIn<U> {
    Placed(Placed<U>),
    /// No arena in the directory has room: a new one is needed.
    NoRoom,
    /// The newest arena with a chance of room needs more reclaiming than allowed.
    Later,
}

/// A chunk for an archive of up to `max_len` bytes in one of `arenas` in `dir` (the newest
/// first, only this process's own), reclaiming as `reclaim` allows.
fn place_in<U: ArenaUser>(
    arenas: &mut [Owned<U>],
    dir: &Path,
    max_len: u64,
    reclaim: Reclaim,
) -> Result<PlaceIn<U>, InArena> {
    for a in arenas
        .iter_mut()
        .rev()
        .filter(|a| a.writer.is_ours() && a.dir == dir)
    {
        a.note_released();
        let path = a.path.clone();
        let in_arena = |err| InArena {
            path: path.to_path_buf(),
            err,
        };
        if a.pending.len() >= RECLAIM_BATCH {
            a.writer
                .reclaim_some(&mut a.pending, RETRIES_PER_BATCH)
                .map_err(in_arena)?;
        }
        let mut reserved = a.writer.reserve(max_len).map_err(in_arena)?;
        if reserved.is_none() && (a.writer.refused_count() > 0 || !a.pending.is_empty()) {
            // No room: every chunk released here and every one held elsewhere at its last
            // try is tried before the next arena is made (once per time this arena fills
            // up).
            if reclaim == Reclaim::Bounded {
                return Ok(PlaceIn::Later);
            }
            a.writer.reclaim(&mut a.pending).map_err(in_arena)?;
            reserved = a.writer.reserve(max_len).map_err(in_arena)?;
        }
        if let Some(r) = reserved {
            a.idle_since = None;
            return Ok(PlaceIn::Placed((path, r, a.arena.clone())));
        }
    }
    Ok(PlaceIn::NoRoom)
}

/// Let go of `idle` arenas ([`Arenas::take_idle`]), telling the user first (call without
/// the arenas' lock: dropping a use may take locks ordered after it).
pub fn let_go<U: ArenaUser>(idle: Vec<Owned<U>>) {
    if idle.is_empty() {
        return;
    }
    log::debug!("handing back {} arenas no object uses", idle.len());
    U::letting_go(&|u| idle.iter().any(|a| Arc::ptr_eq(u, &a.arena)));
    drop(idle);
}

#[cfg(test)]
mod tests;
