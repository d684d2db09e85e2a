//! `Store`: one mapped archive in this process (mapping + validating reader + a cache of
//! interned key strings), the per-process attach cache, and building a new store.
//!
//! The files: this one has `Store`, `Source`, the attach cache and opening a store;
//! `registration.rs` a store's registration with the supervisor (or its `flock`);
//! `arena_use.rs` this process's uses of arenas and opening a chunk; `build.rs` building,
//! importing and saving a store; `foreign.rs` a store read from another library's buffer.

mod arena_use;
mod build;
mod foreign;
mod pickled;
mod registration;

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

impl Symbols {
    /// The fields of shape `id` (`None` for an id out of range).
    #[inline(always)]
    fn fields_of(&self, id: u32) -> Option<&[PyField]> {
        self.fields.get(id as usize).map(|f| &f[..])
    }
}

/// One field of a shape: its key's str object (by address: the objects live in `strs`,
/// as long as the store), and where and how its value is stored in a dict's slots.
#[derive(Clone, Copy)]
pub(crate) struct PyField {
    pub(crate) key: usize,
    pub(crate) enc: crate::archive::format::Enc,
    pub(crate) off: u32,
}

pub(crate) use arena_use::*;
pub(crate) use build::*;
pub(crate) use foreign::*;
pub(crate) use pickled::*;
pub(crate) use registration::*;

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
    /// Another library's buffer (`from_buffer`): no name and no file. `label` says what it
    /// was ("<buffer 3 of memoryview>"), unique in this process.
    Buffer {
        label: PathBuf,
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
            Source::Buffer { label } => label,
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
            Source::Buffer { label } => label.display().to_string(),
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

    /// The pickle payload of something at (`rec`, `pos`) in this store; a store read from a
    /// buffer has no name to pickle by (a `TypeError`, as for any object pickle cannot
    /// take, saying what to do instead).
    pub(crate) fn pickle_args(&self, rec: u64, pos: u64) -> Result<PickleArgs, Error> {
        Ok(match &self.source {
            Source::Segment { path, .. } => (path.display().to_string(), "s".into(), rec, pos),
            Source::File { path } => (path.display().to_string(), String::new(), rec, pos),
            Source::Arena { path, chunk } => (
                path.display().to_string(),
                format!("a{}:{}:{}", chunk.offset, chunk.size, chunk.generation),
                rec,
                pos,
            ),
            Source::Buffer { label } => {
                return Err(Error::Type(format!(
                    "cannot pickle a store read from a buffer ({}): it has no name another \
                     process could attach by. Pickle what made the buffer instead (e.g. the \
                     handle of shmstore.ray.share), convert the value to Python objects \
                     first (.to_python()), or build a store of it (SharedList(...))",
                    label.display()
                )))
            }
        })
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
        self.symbols(py).ok()?.fields_of(id)
    }

    /// [`Self::py_fields`] once the symbols are made (`None` before: making them is the
    /// whole way's work), for the tiny read paths, which call nothing that may fail.
    #[inline(always)]
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    pub(crate) fn py_fields_made(&self, py: Python<'_>, id: u32) -> Option<&[PyField]> {
        self.py_symbols.get(py)?.fields_of(id)
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

fn open_store(py: Python<'_>, source: Source) -> PyResult<Arc<Store>> {
    if let Source::Arena { path, chunk } = source {
        return open_chunk(py, path, chunk);
    }
    if let Some(s) = cached(source.path()) {
        return Ok(s);
    }
    let (path, name, is_segment) = match &source {
        Source::Segment { name, path } => (path.clone(), name.clone(), true),
        Source::File { path } => (path.clone(), path.display().to_string(), false),
        Source::Arena { .. } => unreachable!("handled above"),
        Source::Buffer { label } => {
            return Err(Error::Invalid {
                at: label.display().to_string(),
                what: "a store read from a buffer cannot be attached again; keep its \
                       handle, or call from_buffer again"
                    .into(),
            }
            .into())
        }
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
            Some(d) => vec![absolute_path(d.to_owned())?],
            None => segment::search_dirs(),
        };
        let path = dirs
            .iter()
            .map(|d| d.join(&arena))
            .find(|p| p.exists())
            .unwrap_or_else(|| dirs[0].join(&arena));
        return open_chunk(py, path, chunk);
    }
    let name = segment::normalize_name(name).map_err(Error::from)?;
    let dirs = match dir {
        Some(d) => vec![absolute_path(d.to_owned())?],
        None => segment::search_dirs(),
    };
    let path = dirs
        .iter()
        .map(|d| d.join(&name))
        .find(|p| p.exists())
        .unwrap_or_else(|| dirs[0].join(&name));
    open_store(py, Source::Segment { name, path })
}

/// A path given by the caller (a `dir=` argument, a saved archive file) made absolute
/// against the current directory, as the segment directory is: the path is what pickles
/// carry and what the supervisor is told (it refuses a relative one), and another process,
/// or this one after a `chdir`, must find the same files.
pub(crate) fn absolute_path(path: PathBuf) -> PyResult<PathBuf> {
    segment::to_absolute(path).map_err(|(path, err)| {
        Error::Io {
            at: path.display().to_string(),
            err,
        }
        .into()
    })
}

/// Where a new store goes: `dir` if given, made absolute (no fallback); else the segment
/// directory, or the fallback directory when `size_hint` bytes do not fit (logged as a
/// warning).
fn placement(dir: Option<PathBuf>, size_hint: Option<u64>) -> PyResult<(PathBuf, Option<PathBuf>)> {
    if let Some(d) = dir {
        let d = absolute_path(d)?;
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
    let abs = absolute_path(path.to_owned())?;
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
