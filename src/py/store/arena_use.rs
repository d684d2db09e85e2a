//! This process's uses of arenas (one per arena, kept by its chunks' stores and by the arena
//! read from last), their fork hooks, and opening a chunk.

use super::*;
use crate::archive::header::Header;
use std::sync::atomic::{AtomicU64, Ordering};

/// This process's use of one arena: the file opened and mapped once, registered with the
/// supervisor once (or, without one, held with a shared `flock`), for as long as any chunk
/// of it is used here (each chunk's `Store` holds it) or [`LAST_ARENA`] keeps it.
pub(crate) struct ArenaUse {
    pub(crate) file: Arc<ArenaFile>,
    /// Declared last: the mapping (the file's, unless chunks still hold it) goes first.
    pub(super) registration: Registration,
}

impl ArenaUse {
    /// The creator's use of the arena it just made (`registration`: its `NEW`).
    pub(crate) fn created(file: Arc<ArenaFile>, registration: Registration) -> Arc<ArenaUse> {
        let u = Arc::new(ArenaUse { file, registration });
        remember_use(&u);
        u
    }

    pub(super) fn path(&self) -> &Path {
        &self.registration.path
    }
}

/// The arenas used in this process, by path (`ArenaUse`s are kept by their chunks).
pub(super) type ArenaUses = HashMap<PathBuf, Weak<ArenaUse>>;

/// The map of the arenas used here, with the fork hooks registered ([`fork_hooks`]).
pub(super) fn uses() -> &'static Mutex<ArenaUses> {
    fork_hooks();
    uses_map()
}

pub(super) fn uses_map() -> &'static Mutex<ArenaUses> {
    static USES: OnceLock<Mutex<ArenaUses>> = OnceLock::new();
    USES.get_or_init(Default::default)
}

/// [`LAST_ARENA`], locked, with the fork hooks registered ([`fork_hooks`]).
pub(super) fn last_arena() -> MutexGuard<'static, LastArena> {
    fork_hooks();
    LAST_ARENA.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) type HeldUses = (
    MutexGuard<'static, LastArena>,
    MutexGuard<'static, ArenaUses>,
);

thread_local! {
    /// [`LAST_ARENA`] and the map of [`uses`], held by the forking thread from before the
    /// fork to after it: a child never inherits one of them locked by a thread that does
    /// not exist in it (it would hang at its first chunk).
    static HELD: std::cell::RefCell<Option<HeldUses>> = const { std::cell::RefCell::new(None) };
}

/// Register the fork hooks of [`LAST_ARENA`] and the map of [`uses`]
/// ([`ForkLock::ArenaUses`]: in this order, after the arena files and this process's own
/// arenas; no code holds one of them while taking a lock ordered before it).
pub(super) fn fork_hooks() {
    // The hooks only lock and unlock process-global mutexes held for short stretches,
    // never touch Python and never unwind (poisoning is recovered from). The values
    // guarded are left as they are (nothing is dropped in the child but the guards).
    process::on_fork(
        ForkLock::ArenaUses,
        ForkHooks {
            before: || {
                let last = LAST_ARENA.lock().unwrap_or_else(|p| p.into_inner());
                let uses = uses_map().lock().unwrap_or_else(|p| p.into_inner());
                HELD.with(|h| *h.borrow_mut() = Some((last, uses)));
            },
            after_parent: release_held,
            after_child: release_held,
        },
    );
}

pub(super) fn release_held() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

pub(super) fn remember_use(u: &Arc<ArenaUse>) {
    let mut uses = uses().lock().unwrap_or_else(|p| p.into_inner());
    uses.retain(|_, w| w.strong_count() > 0);
    uses.insert(u.path().to_owned(), Arc::downgrade(u));
}

/// The arena this process read a chunk of last, kept open and registered after its last
/// chunk here is gone. A process that reads many chunks of one arena one after another would
/// otherwise open the file again and register it with the supervisor (a round trip) for
/// every chunk. At most one arena per process is held this way (docs/arena.md).
pub(super) type LastArena = Option<Arc<ArenaUse>>;
pub(super) static LAST_ARENA: Mutex<LastArena> = Mutex::new(None);

/// Let go of the arena kept by [`LAST_ARENA`].
pub(crate) fn forget_last_arena() {
    forget_last_arena_if(|_| true);
}

/// Let go of the arena kept by [`LAST_ARENA`] if `which` says so of it.
pub(crate) fn forget_last_arena_if(which: impl Fn(&Arc<ArenaUse>) -> bool) {
    let old = {
        let mut last = last_arena();
        if last.as_ref().is_some_and(which) {
            last.take()
        } else {
            None
        }
    };
    drop(old); // outside the lock: queues a DROP (never blocks)
}

/// This process's use of the arena at `path`: the one it has (its last, or one a live chunk
/// holds), else the arena opened, mapped and registered now.
///
/// An arena this process already uses is not looked up by name again (no `statx`): while
/// this process holds its registration (or its `flock`), neither the supervisor nor
/// `shmstore gc` removes it, so its name cannot lead to another file (docs/arena.md,
/// "One mapping per arena per process").
pub(super) fn arena_use(py: Python<'_>, path: &Path) -> Result<Arc<ArenaUse>, StoreErr> {
    let me = crate::arena::pid();
    // Byte equality first (the path a handle carries is the one this process opened, and a
    // `Path` compares component by component); a path spelled otherwise is found in the map.
    let found = |u: &Arc<ArenaUse>| {
        u.file.pid() == me && (u.path().as_os_str() == path.as_os_str() || u.path() == path)
    };
    if let Some(u) = last_arena().as_ref().filter(|u| found(u)) {
        return Ok(u.clone());
    }
    let known = uses()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(path)
        .and_then(Weak::upgrade)
        .filter(found);
    let u = match known {
        Some(u) => u,
        None => {
            // Registered before it is mapped (docs/invariants.md, 5).
            let mut registration = Registration::new(py, path.to_owned(), false);
            let file = py.detach(|| {
                let file = ArenaFile::open(path).map_err(StoreErr::Arena)?;
                // As for a segment attached by name: in a directory where someone else can
                // rename our files, the arena under this name may be another one, and a
                // chunk of the same offset, size and generation in it another object
                // (docs/security.md). An arena this process made or maps already is found
                // above and not looked at again.
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                segment::check_dir_of(path, &name).map_err(StoreErr::Segment)?;
                registration
                    .lock_if_unsupervised(file.ident())
                    .map_err(StoreErr::Segment)?;
                Ok::<_, StoreErr>(file)
            })?;
            let u = Arc::new(ArenaUse { file, registration });
            remember_use(&u);
            u
        }
    };
    let old = last_arena().replace(u.clone());
    drop(old); // outside the lock: may queue a DROP (never blocks)
    Ok(u)
}

/// A step of a small object's arena work that was done the slow way, without the GIL (the
/// arenas' lock held by someone else at that moment, a new arena, a full reclaim, a chunk
/// whose archive has large metadata): counted per process ([`handbacks`]).
#[derive(Clone, Copy)]
pub(crate) enum Handback {
    /// Placing a `put`'s object in an arena.
    Place,
    /// Giving its chunk out.
    Commit,
    /// Settling it once its handle holds it.
    Settle,
    /// Opening a chunk another handle names (`open_chunk`).
    Open,
}

static HANDBACKS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

pub(crate) fn handed_back(step: Handback) {
    HANDBACKS[step as usize].fetch_add(1, Ordering::Relaxed);
}

/// How many times each [`Handback`] happened in this process.
pub(crate) fn handbacks() -> [(&'static str, u64); 4] {
    let n = |s: Handback| HANDBACKS[s as usize].load(Ordering::Relaxed);
    [
        ("place", n(Handback::Place)),
        ("commit", n(Handback::Commit)),
        ("settle", n(Handback::Settle)),
        ("open", n(Handback::Open)),
    ]
}

/// Most metadata (the archive's part the reader hashes and parses at open: indexes,
/// symbols, shapes, tables) of a chunk opened without giving the GIL back (`open_chunk`).
const OPEN_WITH_GIL: u64 = 64 * 1024;

/// Open a chunk of an arena another handle names: find or open this process's use of the
/// arena (registered once), take a lease on the chunk, check its generation, and open its
/// archive in a window of the arena's one mapping in this process.
pub(crate) fn open_chunk(py: Python<'_>, path: PathBuf, chunk: Chunk) -> PyResult<Arc<Store>> {
    fork_hooks();
    let source = Source::Arena { path, chunk };
    let failed = |e: StoreErr| e.into_error(&format!("store {:?}", source.name()));
    let arena = arena_use(py, source.path()).map_err(failed)?;
    // The lease (a lock of the chunk's range that never waits, `F_OFD_SETLK`, and a count
    // under a lock no Python runs under) and the window are short work that never waits:
    // done with the GIL, whatever the chunk's size. So is opening an archive whose metadata
    // is small, however large its payload (an array's is never read here): giving the GIL
    // back and taking it again costs some 400 instructions on CPython 3.11 (8% of a
    // channel's get of a 1 KiB array), and up to the interpreter's switch interval (5 ms)
    // while another thread runs Python. Larger metadata is parsed without it.
    let opened = arena
        .file
        .lease(chunk)
        .map_err(StoreErr::Arena)
        .and_then(|(lease, at, len)| {
            let mapping = Mapping::window(arena.file.map(), source.path(), at, len)
                .map_err(StoreErr::Segment)?;
            let metadata = Header::metadata_len_unchecked(mapping.as_ref());
            let open = || Reader::open(mapping).map_err(StoreErr::Archive);
            let reader = if metadata <= OPEN_WITH_GIL {
                open()
            } else {
                handed_back(Handback::Open);
                py.detach(open)
            }?;
            Ok((reader, lease))
        });
    let (reader, lease) = opened.map_err(failed)?;
    Ok(Arc::new(chunk_store(reader, lease, arena, source)))
}

/// The creator's store of the chunk it just wrote into its own arena (an archive of `len`
/// bytes, through the writable mapping `written`), made without Python (the caller need not
/// hold the GIL: `put` makes it in the same stretch without the GIL as it commits the
/// chunk). Its lease is counted here without a lock (`ArenaFile::lease_own`), and it reads
/// the chunk through the mapping it was written with (its pages are in: no page fault, and
/// no pages of a second mapping to take down later).
pub(crate) fn own_chunk(
    path: PathBuf,
    chunk: Chunk,
    arena: Arc<ArenaUse>,
    len: u64,
    written: &Arc<memmap2::MmapRaw>,
) -> Result<Store, Error> {
    fork_hooks();
    let source = Source::Arena { path, chunk };
    let (lease, at, len) = arena.file.lease_own(chunk, len);
    let opened = Mapping::written_window(written, source.path(), at, len)
        .map_err(StoreErr::Segment)
        .and_then(|m| Reader::open(m).map_err(StoreErr::Archive));
    match opened {
        Ok(reader) => Ok(chunk_store(reader, lease, arena, source)),
        Err(e) => Err(e.into_error(&format!("store {:?}", source.name()))),
    }
}

/// A chunk of its own arena this process holds for a reader elsewhere without reading it
/// itself (a channel's object in flight): what a `Store` of it would hold (the lease, this
/// process's use of the arena), without opening the archive. Fields drop in order, as a
/// `Store`'s: the lease before the use of the arena.
pub(crate) struct HeldChunk {
    pub(crate) path: Arc<Path>,
    pub(crate) chunk: Chunk,
    _lease: crate::arena::Lease,
    _arena: Arc<ArenaUse>,
}

/// Hold the chunk this process just wrote into its own arena (an archive of `len` bytes),
/// without Python, as [`own_chunk`] does but without opening it.
pub(crate) fn hold_own_chunk(
    path: Arc<Path>,
    chunk: Chunk,
    arena: Arc<ArenaUse>,
    len: u64,
) -> HeldChunk {
    fork_hooks();
    let (lease, _, _) = arena.file.lease_own(chunk, len);
    HeldChunk {
        path,
        chunk,
        _lease: lease,
        _arena: arena,
    }
}

/// A chunk's store: its reader, this process's lease on it and use of its arena.
fn chunk_store(
    reader: Reader<Mapping>,
    lease: crate::arena::Lease,
    arena: Arc<ArenaUse>,
    source: Source,
) -> Store {
    // A chunk's registration is its arena's (`arena`): the store's own names nothing.
    let registration = Registration::none(PathBuf::new());
    Store {
        reader,
        ident: arena.file.ident(),
        source,
        py_symbols: PyOnceLock::new(),
        _lease: Some(lease),
        arena: Some(arena),
        registration,
    }
}
