//! `Store`: one mapped archive in this process (mapping + validating reader + a cache of
//! interned key strings), the per-process attach cache, and building a new store.
//!
//! (Over 800 lines: not split yet; its seams are the supervisor registration, arena uses,
//! opening and building.)

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;

use super::errors::Error;
use crate::archive::{ArchiveError, Builder, Kind, Reader};
use crate::arena::{ArenaError, ArenaFile, Chunk, Lease};
use crate::process::{self, ForkHooks, ForkLock};
use crate::segment::{self, Mapping, SegmentError, SegmentWriter};
use crate::supervisor;

/// One mapped archive. Views, arrays and handles hold an `Arc<Store>`; the mapping lives
/// until the last of them is gone (docs/invariants.md, 3).
pub(crate) struct Store {
    pub(crate) reader: Reader<Mapping>,
    /// Where it came from: a segment name (shared memory) or a saved file.
    pub(crate) source: Source,
    /// (device, inode) of the mapped file, to notice a name that now means another store.
    ident: (u64, u64),
    /// Python str objects for the symbol table (dict keys), and each shape's fields by
    /// key object, made once per process.
    py_symbols: PyOnceLock<Symbols>,
    /// A chunk of an arena: this process's lease on it, released after the mapping is gone.
    _lease: Option<Lease>,
    /// A chunk of an arena: this process's use of the arena (its one mapping and its one
    /// registration), let go of after the lease.
    arena: Option<Arc<ArenaUse>>,
    /// The supervisor knows this process uses the segment (told before mapping it).
    /// Declared last: fields drop in order, so the mapping is gone before DROP is sent and
    /// the supervisor's /proc check does not see this process as still mapping it.
    registration: Registration,
}

/// A store's symbols as Python objects, and its shapes' fields by those objects.
pub(crate) struct Symbols {
    strs: Vec<Py<PyString>>,
    fields: Vec<Box<[PyField]>>,
}

/// One field of a shape: its key's str object (by address: the objects live in `strs`,
/// as long as the store), and where and how its value is stored in a dict's slots.
#[derive(Clone, Copy)]
pub(crate) struct PyField {
    pub(crate) key: usize,
    pub(crate) enc: crate::archive::format::Enc,
    pub(crate) off: u32,
}

/// "This process uses the segment": told to the supervisor when made, DROP queued when
/// dropped (for a failed build or attach, or with the `Store` that owns it; never blocks).
/// Without a supervisor, the segment file is held with a shared `flock` instead, which the
/// supervisor and `shmstore gc` respect even when `/proc` cannot show them this process.
pub(crate) struct Registration {
    path: PathBuf,
    active: bool,
    lock: Option<std::fs::File>,
}

impl Registration {
    fn new(py: Python<'_>, path: PathBuf, created: bool) -> Self {
        let active = register(py, &path, created);
        Registration {
            path,
            active,
            lock: None,
        }
    }

    /// This process is about to create the segment (or arena) at `path`.
    pub(crate) fn created(py: Python<'_>, path: PathBuf) -> Self {
        Registration::new(py, path, true)
    }

    /// This process is about to map the existing file at `path` (a round trip: the
    /// supervisor knows before the file is mapped).
    pub(crate) fn used(py: Python<'_>, path: PathBuf) -> Self {
        Registration::new(py, path, false)
    }

    /// Whether the supervisor knows.
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// This process attached (mapped) the segment at `path` through a locked descriptor
    /// (`Mapping::open_locked`: the lock lasts as long as the mapping): tell the supervisor
    /// without waiting for its answer when possible (`client::use_segment_nowait`).
    fn attached(py: Python<'_>, path: PathBuf) -> Self {
        let active = match py.detach(|| supervisor::client::use_segment_nowait(&path)) {
            Ok(()) => {
                late_news();
                true
            }
            Err(e) => unavailable(&path, e),
        };
        Registration {
            path,
            active,
            lock: None,
        }
    }

    /// Nothing to register (a saved file, not a segment).
    fn none(path: PathBuf) -> Self {
        Registration {
            path,
            active: false,
            lock: None,
        }
    }

    fn follow(&mut self, py: Python<'_>, path: PathBuf) {
        if path != self.path {
            let old = std::mem::replace(self, Registration::new(py, path, true));
            drop(old);
        }
    }

    /// Not registered: hold a shared lock on the segment file `ident` names (see the type's
    /// docs). An error if the name was removed meanwhile (by a supervisor that saw no user).
    fn lock_if_unsupervised(&mut self, ident: (u64, u64)) -> Result<(), SegmentError> {
        if self.active {
            return Ok(());
        }
        let file = segment::lock_shared(&self.path, ident)?;
        self.lock = Some(file);
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // The lock goes first: a supervisor that acts on the DROP finds the file unlocked.
        drop(self.lock.take());
        if self.active {
            supervisor::client::drop_segment(&self.path);
        }
    }
}

/// Tell the supervisor (starting it if needed) that this process uses `path`. False when
/// it is unavailable or disabled: then only the orphan sweep covers the segment. Said at
/// WARNING once per process (with what it means and how to fix it), unless disabled on
/// purpose.
fn register(py: Python<'_>, path: &Path, created: bool) -> bool {
    match py.detach(|| supervisor::client::use_segment(path, created)) {
        Ok(()) => {
            late_news();
            true
        }
        Err(e) => unavailable(path, e),
    }
}

/// Say (once per process, see [`unavailable`]) why a segment attached earlier without
/// waiting for the supervisor's answer is not covered by it, if that was learnt since.
fn late_news() {
    if let Some(why) = supervisor::client::take_late() {
        warn_unsupervised(&why, None);
    }
}

/// The supervisor is unavailable for `path` (`e` says why): false, and the reason said at
/// WARNING once per process, unless it is disabled on purpose.
fn unavailable(path: &Path, e: supervisor::client::Unavailable) -> bool {
    use supervisor::client::Unavailable;
    match e {
        Unavailable::Disabled => false,
        e => {
            late_news();
            warn_unsupervised(&e.to_string(), Some(path));
            false
        }
    }
}

fn warn_unsupervised(e: &str, path: Option<&Path>) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        log::warn!(
            target: "shmstore::supervisor",
            "shmstore runs without its supervisor: {e}. What this means: segments this \
             process creates are removed when it closes them or exits normally, but if \
             it is killed (SIGKILL, OOM) they stay until the next supervisor starts or \
             `shmstore gc` runs. (Said once per process; SHMSTORE_SUPERVISOR=0 turns the \
             supervisor off without this warning.)"
        );
    } else if let Some(path) = path {
        log::debug!(
            target: "shmstore::supervisor",
            "supervisor unavailable for {}: {e}",
            path.display()
        );
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Segment {
        name: String,
        path: PathBuf,
    },
    File {
        path: PathBuf,
    },
    /// A chunk of the arena at `path` (docs/arena.md).
    Arena {
        path: PathBuf,
        chunk: Chunk,
    },
}

/// What a pickle of a handle or view carries: (path, "s" for a segment or "" for a saved
/// file, record, position). A segment's name is its file name, so it is not repeated.
pub(crate) type PickleArgs = (String, String, u64, u64);

impl Source {
    pub(crate) fn path(&self) -> &Path {
        match self {
            Source::Segment { path, .. } | Source::File { path } | Source::Arena { path, .. } => {
                path
            }
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Source::Segment { name, .. } => name.clone(),
            Source::File { path } => path.display().to_string(),
            // What `Ref.attach` accepts: the arena's name, then where the chunk is.
            Source::Arena { path, chunk } => format!(
                "{}@{}:{}:{}",
                path.file_name().unwrap_or_default().to_string_lossy(),
                chunk.offset,
                chunk.size,
                chunk.generation
            ),
        }
    }

    /// The source a pickle's (path, flag) names (the inverse of [`Store::pickle_args`]).
    pub(crate) fn from_pickle(path: PathBuf, flag: &str) -> Source {
        if let Some(chunk) = flag.strip_prefix('a').and_then(parse_chunk) {
            return Source::Arena { path, chunk };
        }
        match (
            flag,
            path.file_name().and_then(|n| n.to_str()).map(str::to_owned),
        ) {
            ("s", Some(name)) => Source::Segment { name, path },
            _ => Source::File { path },
        }
    }
}

impl Store {
    pub(crate) fn mapping(&self) -> &Mapping {
        self.reader.backing()
    }

    /// "store 'shmstore-…'" for error messages.
    pub(crate) fn describe(&self) -> String {
        format!("store {:?}", self.source.name())
    }

    /// Turns an archive error about this store into an [`Error`] naming it.
    pub(crate) fn archive_err(&self) -> impl Fn(ArchiveError) -> Error + '_ {
        move |err| Error::Archive {
            at: self.describe(),
            err,
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        self.reader.kind()
    }

    /// Whether the supervisor knows this process uses the store.
    pub(crate) fn registered(&self) -> bool {
        let r = match &self.arena {
            Some(u) => &u.registration,
            None => &self.registration,
        };
        r.active && supervisor::client::registered(&r.path)
    }

    pub(crate) fn nbytes(&self) -> usize {
        self.reader.bytes().len()
    }

    /// The pickle payload of something at (`rec`, `pos`) in this store.
    pub(crate) fn pickle_args(&self, rec: u64, pos: u64) -> PickleArgs {
        match &self.source {
            Source::Segment { path, .. } => (path.display().to_string(), "s".into(), rec, pos),
            Source::File { path } => (path.display().to_string(), String::new(), rec, pos),
            Source::Arena { path, chunk } => (
                path.display().to_string(),
                format!("a{}:{}:{}", chunk.offset, chunk.size, chunk.generation),
                rec,
                pos,
            ),
        }
    }

    /// The Python str for symbol `id` (shared, immutable, private to this process).
    pub(crate) fn py_symbol<'py>(
        &self,
        py: Python<'py>,
        id: u32,
    ) -> PyResult<Bound<'py, PyString>> {
        match self.py_symbols(py)?.get(id as usize) {
            Some(s) => Ok(s.bind(py).clone()),
            None => Err(self.archive_err()(ArchiveError::Corrupt(format!(
                "symbol {id} out of range"
            )))
            .into()),
        }
    }

    /// All symbols as interned Python strs, made on first use. Interned: a key literal in
    /// user code is the very same object, so lookups can match by identity first.
    pub(crate) fn py_symbols(&self, py: Python<'_>) -> PyResult<&[Py<PyString>]> {
        Ok(&self.symbols(py)?.strs)
    }

    /// The fields of shape `id` by key object (`None` for an id out of range), for
    /// `view["field"]`: a compare per field and the slot's place, with no other lookup.
    #[inline(always)]
    pub(crate) fn py_fields(&self, py: Python<'_>, id: u32) -> Option<&[PyField]> {
        self.symbols(py)
            .ok()?
            .fields
            .get(id as usize)
            .map(|f| &f[..])
    }

    #[inline(always)]
    fn symbols(&self, py: Python<'_>) -> PyResult<&Symbols> {
        self.py_symbols.get_or_try_init(py, || {
            let strs = (0..self.reader.symbol_count() as u32)
                .map(|i| {
                    let s = self.reader.symbol(i).map_err(self.archive_err())?;
                    Ok::<_, PyErr>(PyString::intern(py, s).unbind())
                })
                .collect::<PyResult<Vec<_>>>()?;
            let r = &self.reader;
            let fields = (0..r.shape_count() as u32)
                .map(|id| {
                    let Some(sh) = r.shape_def(id) else {
                        return Box::default();
                    };
                    sh.keys
                        .iter()
                        .zip(sh.encs.iter().zip(sh.offsets.iter()))
                        .map(|(&k, (&enc, &off))| PyField {
                            // A key out of range matches no object (address 0).
                            key: strs.get(k as usize).map_or(0, |s| s.as_ptr() as usize),
                            enc,
                            off,
                        })
                        .collect()
                })
                .collect();
            Ok(Symbols { strs, fields })
        })
    }
}

fn file_ident(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// name/path -> store: N attaches of one store in a process share one mapping.
fn cache() -> &'static Mutex<HashMap<PathBuf, Weak<Store>>> {
    static CACHE: OnceLock<Mutex<HashMap<PathBuf, Weak<Store>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn cached(path: &Path) -> Option<Arc<Store>> {
    let mut map = cache().lock().unwrap_or_else(|p| p.into_inner());
    let store = map.get(path).and_then(Weak::upgrade);
    match store {
        // Same file still behind the name: reuse. A recreated name is a new store.
        Some(s) if file_ident(path) == Some(s.ident) => Some(s),
        _ => {
            map.retain(|_, w| w.strong_count() > 0);
            None
        }
    }
}

fn remember(store: &Arc<Store>) {
    cache()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(store.source.path().to_owned(), Arc::downgrade(store));
}

/// "offset:size:generation" of a chunk, as in a name or pickle.
fn parse_chunk(s: &str) -> Option<Chunk> {
    let mut it = s.split(':').map(str::parse::<u64>);
    let (Some(Ok(offset)), Some(Ok(size)), Some(Ok(generation)), None) =
        (it.next(), it.next(), it.next(), it.next())
    else {
        return None;
    };
    Some(Chunk {
        offset,
        size,
        generation,
    })
}

/// This process's use of one arena: the file opened and mapped once, registered with the
/// supervisor once (or, without one, held with a shared `flock`), for as long as any chunk
/// of it is used here (each chunk's `Store` holds it) or [`LAST_ARENA`] keeps it.
pub(crate) struct ArenaUse {
    pub(crate) file: Arc<ArenaFile>,
    /// Declared last: the mapping (the file's, unless chunks still hold it) goes first.
    registration: Registration,
}

impl ArenaUse {
    /// The creator's use of the arena it just made (`registration`: its `NEW`).
    pub(crate) fn created(file: Arc<ArenaFile>, registration: Registration) -> Arc<ArenaUse> {
        let u = Arc::new(ArenaUse { file, registration });
        remember_use(&u);
        u
    }

    fn path(&self) -> &Path {
        &self.registration.path
    }
}

/// The arenas used in this process, by path (`ArenaUse`s are kept by their chunks).
type ArenaUses = HashMap<PathBuf, Weak<ArenaUse>>;

/// The map of the arenas used here, with the fork hooks registered ([`fork_hooks`]).
fn uses() -> &'static Mutex<ArenaUses> {
    fork_hooks();
    uses_map()
}

fn uses_map() -> &'static Mutex<ArenaUses> {
    static USES: OnceLock<Mutex<ArenaUses>> = OnceLock::new();
    USES.get_or_init(Default::default)
}

/// [`LAST_ARENA`], locked, with the fork hooks registered ([`fork_hooks`]).
fn last_arena() -> MutexGuard<'static, LastArena> {
    fork_hooks();
    LAST_ARENA.lock().unwrap_or_else(|p| p.into_inner())
}

type HeldUses = (
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
fn fork_hooks() {
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

fn release_held() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

fn remember_use(u: &Arc<ArenaUse>) {
    let mut uses = uses().lock().unwrap_or_else(|p| p.into_inner());
    uses.retain(|_, w| w.strong_count() > 0);
    uses.insert(u.path().to_owned(), Arc::downgrade(u));
}

/// The arena this process read a chunk of last, kept open and registered after its last
/// chunk here is gone. A process that reads many chunks of one arena one after another would
/// otherwise open the file again and register it with the supervisor (a round trip) for
/// every chunk. At most one arena per process is held this way (docs/arena.md).
type LastArena = Option<Arc<ArenaUse>>;
static LAST_ARENA: Mutex<LastArena> = Mutex::new(None);

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
fn arena_use(py: Python<'_>, path: &Path) -> Result<Arc<ArenaUse>, StoreErr> {
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

/// Open a chunk of an arena: find or open this process's use of the arena (registered once),
/// take a lease on the chunk, check its generation, and open its archive in a window of the
/// arena's one mapping in this process. `own`: the creator's put, which just wrote the chunk
/// (an archive of this many bytes) into its arena (`ArenaFile::lease_own`).
pub(crate) fn open_chunk(
    py: Python<'_>,
    path: PathBuf,
    chunk: Chunk,
    own: Option<(Arc<ArenaUse>, u64, Arc<memmap2::MmapRaw>)>,
) -> PyResult<Arc<Store>> {
    fork_hooks();
    let source = Source::Arena { path, chunk };
    let failed = |e: StoreErr| e.into_error(&format!("store {:?}", source.name()));
    let (arena, own) = match own {
        Some((u, len, written)) => (u, Some((len, written))),
        None => (arena_use(py, source.path()).map_err(failed)?, None),
    };
    let opened = py.detach(|| {
        let (lease, window) = match own {
            // The creator reads its chunk through the mapping it wrote it with (its pages
            // are in: no page fault, and no pages of a second mapping to take down later).
            Some((len, written)) => {
                let (lease, at, len) = arena.file.lease_own(chunk, len);
                (
                    lease,
                    Mapping::written_window(&written, source.path(), at, len),
                )
            }
            None => {
                let (lease, at, len) = arena.file.lease(chunk).map_err(StoreErr::Arena)?;
                (
                    lease,
                    Mapping::window(arena.file.map(), source.path(), at, len),
                )
            }
        };
        let mapping = window.map_err(StoreErr::Segment)?;
        let reader = Reader::open(mapping).map_err(StoreErr::Archive)?;
        Ok::<_, StoreErr>((reader, lease))
    });
    let (reader, lease) = opened.map_err(failed)?;
    let registration = Registration::none(source.path().to_owned());
    Ok(Arc::new(Store {
        reader,
        ident: arena.file.ident(),
        source,
        py_symbols: PyOnceLock::new(),
        _lease: Some(lease),
        arena: Some(arena),
        registration,
    }))
}

fn open_store(py: Python<'_>, source: Source) -> PyResult<Arc<Store>> {
    if let Source::Arena { path, chunk } = source {
        return open_chunk(py, path, chunk, None);
    }
    if let Some(s) = cached(source.path()) {
        return Ok(s);
    }
    let (path, name, is_segment) = match &source {
        Source::Segment { name, path } => (path.clone(), name.clone(), true),
        Source::File { path } => (path.clone(), path.display().to_string(), false),
        Source::Arena { .. } => unreachable!("handled above"),
    };
    // A segment is locked (shared `flock`) before it is mapped and checked, through the
    // descriptor it is mapped from: the lock lasts as long as the mapping (here and in
    // forked children), and while it does neither the supervisor nor `shmstore gc` removes
    // the segment. So the supervisor is told after the checks, without waiting for its
    // answer (docs/lifecycle.md, "Attaching without waiting").
    let opened = py.detach(|| {
        let (mapping, ident) = if is_segment {
            Mapping::open_locked(&path, &name).map_err(StoreErr::Segment)?
        } else {
            let mapping = Mapping::open(&path, &name, false).map_err(StoreErr::Segment)?;
            (mapping, file_ident(&path).unwrap_or((0, 0)))
        };
        let reader = Reader::open(mapping).map_err(StoreErr::Archive)?;
        Ok::<_, StoreErr>((reader, ident))
    });
    let (reader, ident) = match opened {
        Ok(x) => x,
        Err(e) => return Err(e.into_error(&format!("store {name:?}")).into()),
    };
    let registration = if is_segment {
        Registration::attached(py, path)
    } else {
        Registration::none(path)
    };
    let store = Arc::new(Store {
        reader,
        source: source.clone(),
        ident,
        py_symbols: PyOnceLock::new(),
        _lease: None,
        arena: None,
        registration,
    });
    log::debug!(
        "attached {} ({} bytes)",
        store.source.name(),
        store.nbytes()
    );
    remember(&store);
    Ok(store)
}

enum StoreErr {
    Segment(segment::SegmentError),
    Archive(crate::archive::ArchiveError),
    Arena(ArenaError),
}

impl StoreErr {
    fn into_error(self, at: &str) -> Error {
        match self {
            StoreErr::Segment(e) => Error::Segment(e),
            StoreErr::Arena(err) => Error::Arena {
                at: at.to_owned(),
                err,
            },
            StoreErr::Archive(err) => Error::Archive {
                at: at.to_owned(),
                err,
            },
        }
    }
}

/// Attach to the segment `name` in `dir`, or in the segment directory and then the
/// fallback directory.
pub(crate) fn attach(py: Python<'_>, name: &str, dir: Option<&Path>) -> PyResult<Arc<Store>> {
    // A chunk of an arena: "<arena name>@<offset>:<size>:<generation>" (`Ref.name`).
    if let Some((arena, chunk)) = name.split_once('@') {
        let arena = segment::normalize_name(arena).map_err(Error::from)?;
        let chunk = parse_chunk(chunk).ok_or_else(|| Error::Invalid {
            at: format!("name {name:?}"),
            what: "a chunk of an arena is named <arena>@<offset>:<size>:<generation>".into(),
        })?;
        let dirs = match dir {
            Some(d) => vec![d.to_owned()],
            None => segment::search_dirs(),
        };
        let path = dirs
            .iter()
            .map(|d| d.join(&arena))
            .find(|p| p.exists())
            .unwrap_or_else(|| dirs[0].join(&arena));
        return open_chunk(py, path, chunk, None);
    }
    let name = segment::normalize_name(name).map_err(Error::from)?;
    let dirs = match dir {
        Some(d) => vec![d.to_owned()],
        None => segment::search_dirs(),
    };
    let path = dirs
        .iter()
        .map(|d| d.join(&name))
        .find(|p| p.exists())
        .unwrap_or_else(|| dirs[0].join(&name));
    open_store(py, Source::Segment { name, path })
}

/// Where a new store goes: `dir` if given (no fallback); else the segment directory, or
/// the fallback directory when `size_hint` bytes do not fit (logged as a warning).
fn placement(dir: Option<PathBuf>, size_hint: Option<u64>) -> PyResult<(PathBuf, Option<PathBuf>)> {
    if let Some(d) = dir {
        if let Some(n) = size_hint {
            segment::preflight(&d, n).map_err(Error::from)?;
        }
        return Ok((d, None));
    }
    let primary = segment::default_dir();
    let fallback = segment::fallback_dir();
    let Some(n) = size_hint else {
        return Ok((primary, fallback));
    };
    match segment::preflight(&primary, n) {
        Ok(()) => Ok((primary, fallback)),
        Err(e) => match fallback {
            Some(fb)
                if segment::private_dir(&fb, true).is_ok()
                    && segment::preflight(&fb, n).is_ok() =>
            {
                log::warn!(
                    "{} cannot hold {n} bytes: storing in {} instead (disk-backed; see docs/lifecycle.md)",
                    primary.display(),
                    fb.display()
                );
                Ok((fb, None))
            }
            _ => Err(Error::from(e).into()),
        },
    }
}

/// Attach by source (what pickles carry: a segment's path, or a saved archive file).
pub(crate) fn attach_source(py: Python<'_>, source: Source) -> PyResult<Arc<Store>> {
    open_store(py, source)
}

/// Map a saved archive file.
pub(crate) fn open_file(py: Python<'_>, path: &Path) -> PyResult<Arc<Store>> {
    let abs = std::path::absolute(path).map_err(|err| Error::Io {
        at: path.display().to_string(),
        err,
    })?;
    open_store(py, Source::File { path: abs })
}

/// The handle class for a kind of store.
pub(crate) fn class_of(kind: Kind) -> &'static str {
    match kind {
        Kind::List => "SharedList",
        Kind::Dict => "SharedDict",
        Kind::Object => "Ref",
    }
}

/// Check that `store` holds `want`, else a clear error naming the right class.
pub(crate) fn expect_kind(store: &Store, want: Kind) -> PyResult<()> {
    let have = store.kind();
    if have == want {
        return Ok(());
    }
    Err(Error::WrongKind {
        store: store.describe(),
        have: have.name(),
        class: class_of(have),
        want: want.name(),
    }
    .into())
}

/// Build a new store: `feed` writes the records into the builder; on any error (including
/// a Python exception raised by the input iterator) the partial segment is removed.
pub(crate) fn build(
    py: Python<'_>,
    kind: Kind,
    name: Option<&str>,
    dir: Option<PathBuf>,
    size_hint: Option<u64>,
    feed: impl FnOnce(&mut Builder<SegmentWriter>) -> PyResult<()>,
) -> PyResult<Arc<Store>> {
    let name = match name {
        Some(n) => segment::normalize_name(n).map_err(Error::from)?,
        None => segment::random_name(),
    };
    let (dir, fallback) = placement(dir, size_hint)?;
    let context = format!("store {name:?}");
    let archive_err = |err| Error::Archive {
        at: context.clone(),
        err,
    };
    // The supervisor knows the segment before anything of it exists (docs/invariants.md, 5),
    // so the death of this process at any point (even mid-build) is noticed and cleaned up.
    let mut reg = Registration::new(py, dir.join(&name), true);
    let writer = SegmentWriter::create(&dir, &name, fallback.as_deref()).map_err(Error::from)?;
    let mut builder = Builder::new(writer, kind, std::process::id()).map_err(archive_err)?;
    feed(&mut builder)?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let (writer, total) = builder.finish(now_ms).map_err(archive_err)?;
    // The writer may have moved to the fallback directory when the first one filled up.
    reg.follow(py, writer.final_path());
    let store = publish(py, writer, reg, name, &context, Sealed::Built)?;
    log::debug!(
        "created {} ({total} bytes, {} records)",
        store.source.name(),
        store.reader.len()
    );
    Ok(store)
}

/// How a segment is sealed: built in this machine (mode 0400) or a fetched copy of an
/// archive built elsewhere (0500: the owner-execute bit marks it for `shmstore ls`; nothing
/// maps a segment executable).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sealed {
    Built,
    Fetched,
}

impl Sealed {
    fn mode(self) -> u32 {
        match self {
            Sealed::Built => 0o400,
            Sealed::Fetched => 0o500,
        }
    }
}

/// Seal and publish what `writer` holds, map it from the still-open descriptor and make
/// the `Store` (registered as `reg`).
fn publish(
    py: Python<'_>,
    writer: SegmentWriter,
    mut reg: Registration,
    name: String,
    context: &str,
    sealed: Sealed,
) -> PyResult<Arc<Store>> {
    let (path, file) = py
        .detach(|| writer.publish_mode(sealed.mode()))
        .map_err(Error::from)?;
    let registered = reg.active;
    let opened = py.detach(|| {
        let mapping = Mapping::from_file(file, &path, true).map_err(StoreErr::Segment)?;
        if !registered {
            // No supervisor: this process owns the name and removes it when done.
            mapping.take_ownership();
        }
        let ident = file_ident(&path).unwrap_or((0, 0));
        reg.lock_if_unsupervised(ident).map_err(StoreErr::Segment)?;
        let reader = Reader::open(mapping).map_err(StoreErr::Archive)?;
        Ok::<_, StoreErr>((reader, ident))
    });
    let (reader, ident) = match opened {
        Ok(x) => x,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e.into_error(context).into()); // `reg` drops the registration
        }
    };
    let store = Arc::new(Store {
        reader,
        source: Source::Segment { name, path },
        ident,
        py_symbols: PyOnceLock::new(),
        _lease: None,
        arena: None,
        registration: reg,
    });
    remember(&store);
    Ok(store)
}

/// Make a segment `name` in `dir` from archive bytes produced elsewhere (a copy fetched
/// from another machine): registered before its first byte exists, written by `feed`
/// into a private `.part` file (removed on any error), sealed as fetched and published
/// with `link()` (never over an existing name).
pub(crate) fn import(
    py: Python<'_>,
    name: &str,
    dir: &Path,
    feed: impl FnOnce(&mut SegmentWriter) -> PyResult<()>,
) -> PyResult<Arc<Store>> {
    let name = segment::normalize_name(name).map_err(Error::from)?;
    let context = format!("store {name:?}");
    let reg = Registration::new(py, dir.join(&name), true);
    let mut writer = SegmentWriter::create(dir, &name, None).map_err(Error::from)?;
    feed(&mut writer)?;
    let store = publish(py, writer, reg, name, &context, Sealed::Fetched)?;
    log::debug!("fetched {} ({} bytes)", store.source.name(), store.nbytes());
    Ok(store)
}

/// Write the archive to a regular file, atomically and safely in shared directories
/// (`segment::save_file`), with permission bits `mode`.
pub(crate) fn save(py: Python<'_>, store: &Store, path: &Path, mode: u32) -> PyResult<()> {
    if mode & !0o777 != 0 {
        return Err(Error::Invalid {
            at: format!("mode {mode:#o}"),
            what: "only permission bits (0o000..0o777) can be given".into(),
        }
        .into());
    }
    let bytes = store.reader.bytes();
    py.detach(|| segment::save_file(bytes, path, mode))
        .map_err(Error::Save)?;
    Ok(())
}
