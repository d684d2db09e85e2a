//! `Channel`: a bounded queue of objects between processes, whose objects travel as
//! handles through a ring in shared memory (`crate::channel`, docs/channel.md): a put
//! writes the object once (into a chunk of this process's arena, or a segment when large)
//! and its handle into the ring; a get maps the object where it is.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::arena::Put;
use super::errors::Error;
use super::handles::put_object;
use super::read::protocol::Seq;
use super::read::StoreRef;
use super::store::{self, Registration, Source, Store};
use crate::archive::Kind;
use crate::channel::{ChannelError, Handle, Ring, Waited, CHUNK, SEGMENT};
use crate::segment;

/// One process's use of a channel: its mapping of the ring, its registration with the
/// supervisor, and the objects it put that no get has taken yet.
struct Shared {
    ring: Ring,
    /// Objects put here and not yet taken, oldest first: (position, the object held).
    /// Holding it (a chunk held, or a segment's store) keeps it for the getter.
    in_flight: Mutex<VecDeque<(u64, Put)>>,
    /// Arenas this process told the supervisor to keep while the channel is in use, by
    /// their paths' bytes (a `Path`'s hash walks its components: a tenth of a small put).
    pinned: Mutex<HashSet<std::ffi::OsString, ahash::RandomState>>,
    /// The channel file's directory, where its objects go (looked up once).
    dir: PathBuf,
    /// Declared last: the mapping is gone before the supervisor hears of the drop.
    _registration: Registration,
}

/// Channels whose `Channel` objects are gone in this process while objects it put are not
/// yet taken: kept (and looked at by later puts) so those objects stay readable.
static LEFT: Mutex<Vec<Arc<Shared>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Let go of the objects whose handles were taken (in order: a later one taken first
    /// waits for the ones before it). Whether any is left.
    fn settle(&self) -> bool {
        let mut done = Vec::new();
        let left = {
            let mut q = lock(&self.in_flight);
            while q.front().is_some_and(|(pos, _)| self.ring.taken(*pos)) {
                done.extend(q.pop_front());
            }
            !q.is_empty()
        };
        drop(done); // outside the lock: may queue a DROP
        left
    }
}

fn channel_err(path: &Path, err: ChannelError) -> Error {
    match err {
        ChannelError::Corrupt { what, .. } => Error::Corrupt {
            at: format!("channel {:?}", name_of(path)),
            what,
        },
        ChannelError::Segment(e) => Error::Segment(e),
    }
}

/// The directory of the channel file at `path`: where the objects put into it go (an arena
/// or segment elsewhere would work as well, but the supervisor keeps only files of the
/// same directory for a channel).
fn dir_of(path: &Path) -> PathBuf {
    path.parent().unwrap_or(Path::new("/")).to_owned()
}

fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The deadline of a wait: `None` for no wait, a far one for "forever" (waits are made in
/// slices of at most `crate::channel::MAX_SLEEP` anyway, checking signals in between).
fn deadline(block: bool, timeout: Option<f64>) -> PyResult<Option<Instant>> {
    if !block {
        return Ok(None);
    }
    let Some(t) = timeout else {
        return Ok(Some(
            Instant::now() + Duration::from_secs(86_400 * 365 * 30),
        ));
    };
    let d = Duration::try_from_secs_f64(t).map_err(|_| Error::Invalid {
        at: "timeout".into(),
        what: format!("{t} is not a number of seconds >= 0"),
    })?;
    Ok(Some(Instant::now() + d))
}

/// One wait of a put or get, without the GIL (a slice of at most `MAX_SLEEP`, see
/// `Ring::wait_to_get`), then a look for signals: `timed_out` when `until` has passed, or
/// at once when there is no `until` (`block=False`).
fn wait(
    py: Python<'_>,
    until: Option<Instant>,
    slice: impl FnOnce(Instant) -> Waited + Send,
    timed_out: Error,
) -> PyResult<()> {
    let Some(until) = until else {
        return Err(timed_out.into());
    };
    if py.detach(move || slice(until)) == Waited::TimedOut {
        return Err(timed_out.into());
    }
    py.check_signals()
}

/// A bounded queue of objects between processes, like `multiprocessing.Queue`, whose
/// objects are written once into shared memory instead of pickled through a pipe
/// (docs/channel.md; the stub file has the examples).
#[pyclass(name = "Channel", module = "shmstore", frozen, weakref)]
pub(crate) struct Channel {
    shared: Arc<Shared>,
    /// `close()` was called on this object: its put and get raise ValueError, as a closed
    /// `multiprocessing.Queue`'s do (other objects of the same channel, in this process or
    /// another, are not affected).
    closed: AtomicBool,
}

impl Drop for Channel {
    fn drop(&mut self) {
        if self.shared.settle() {
            lock(&LEFT).push(self.shared.clone());
        }
    }
}

impl Channel {
    fn file(&self) -> &Path {
        self.shared.ring.path()
    }

    /// ValueError (`Error::Usage`) once `close()` was called, with `multiprocessing.Queue`'s
    /// wording.
    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(
                Error::Usage(format!("Channel {:?} is closed", name_of(self.file()))).into(),
            );
        }
        Ok(())
    }

    fn err(&self, err: ChannelError) -> PyErr {
        channel_err(self.file(), err).into()
    }

    /// The handle of an object just put (borrowing its path).
    fn handle_of<'a>(&self, put: &'a Put) -> PyResult<Handle<&'a Path>> {
        let s = match put {
            Put::Store(s) => s,
            Put::Held(held) => {
                return self.checked(Handle {
                    kind: CHUNK,
                    path: &*held.path,
                    offset: held.chunk.offset,
                    size: held.chunk.size,
                    generation: held.chunk.generation,
                })
            }
        };
        let h = match &s.source {
            Source::Arena { path, chunk } => Handle {
                kind: CHUNK,
                path: path.as_path(),
                offset: chunk.offset,
                size: chunk.size,
                generation: chunk.generation,
            },
            Source::Segment { path, .. } => Handle {
                kind: SEGMENT,
                path: path.as_path(),
                offset: 0,
                size: 0,
                generation: 0,
            },
            Source::File { path } => {
                return Err(Error::Invalid {
                    at: format!("channel {:?}", name_of(self.file())),
                    what: format!("{} is a saved file, not shared memory", path.display()),
                }
                .into())
            }
            Source::Buffer { label } => {
                return Err(Error::Invalid {
                    at: format!("channel {:?}", name_of(self.file())),
                    what: format!(
                        "{} is a store read from a buffer, which has no name another \
                         process could attach by",
                        label.display()
                    ),
                }
                .into())
            }
        };
        self.checked(h)
    }

    /// `h`, if a cell of the ring can carry its path.
    fn checked<'a>(&self, h: Handle<&'a Path>) -> PyResult<Handle<&'a Path>> {
        let len = h.path.as_os_str().len();
        if len > crate::channel::MAX_PATH {
            return Err(Error::Invalid {
                at: format!("channel {:?}", name_of(self.file())),
                what: format!(
                    "the channel directory's path is too long for a channel's handles \
                     ({len} bytes, at most {}): make the channel in a shorter directory \
                     (Channel(dir=...), or SHMSTORE_DIR when no dir is given)",
                    crate::channel::MAX_PATH
                ),
            }
            .into());
        }
        Ok(h)
    }

    /// Ask the supervisor to keep the arena or segment at `path` while this channel is in
    /// use (once per arena; a segment is one object).
    fn pin(&self, py: Python<'_>, h: &Handle<&Path>) {
        if h.kind == CHUNK {
            let mut pinned = lock(&self.shared.pinned);
            // Looked up before a copy of the path is made: every small object of a stream
            // goes into an arena pinned already.
            if pinned.contains(h.path.as_os_str()) || !pinned.insert(h.path.as_os_str().into()) {
                return;
            }
        }
        let (holder, path) = (self.file().to_owned(), h.path.to_owned());
        if let Err(e) = py.detach(|| crate::supervisor::client::pin_segment(&holder, &path)) {
            log::debug!(
                "channel {}: no pin for {}: {e}",
                holder.display(),
                path.display()
            );
        }
    }

    /// Map the object a handle names (taking this process's own hold on it).
    fn open(&self, py: Python<'_>, h: Handle) -> PyResult<Arc<Store>> {
        let store = match h.kind {
            CHUNK => store::open_chunk(
                py,
                h.path,
                crate::arena::Chunk {
                    offset: h.offset,
                    size: h.size,
                    generation: h.generation,
                },
            )?,
            _ => {
                let name = name_of(&h.path);
                segment::normalize_name(&name)
                    .ok()
                    .filter(|n| *n == name)
                    .ok_or_else(|| Error::Corrupt {
                        at: format!("channel {:?}", name_of(self.file())),
                        what: format!("{} is not a segment's path", h.path.display()),
                    })?;
                store::attach_source(py, Source::Segment { name, path: h.path })?
            }
        };
        store::expect_kind(&store, Kind::Object)?;
        Ok(store)
    }
}

/// Let go of objects taken from channels whose `Channel` objects are gone here.
fn settle_left() {
    let done: Vec<Arc<Shared>> = {
        let mut left = lock(&LEFT);
        if left.is_empty() {
            return;
        }
        let (done, kept) = std::mem::take(&mut *left)
            .into_iter()
            .partition(|s| !s.settle());
        *left = kept;
        done
    };
    drop(done);
}

#[pymethods]
impl Channel {
    /// A new channel with room for `capacity` objects waiting (a power of two), in `dir`
    /// (default: the segment directory, `$SHMSTORE_DIR` or /dev/shm).
    #[new]
    #[pyo3(signature = (capacity = 1024, *, dir = None))]
    fn new(py: Python<'_>, capacity: i128, dir: Option<PathBuf>) -> PyResult<Self> {
        let capacity = valid_capacity(capacity)?;
        let dir = dir.unwrap_or_else(segment::default_dir);
        // Absolute: the path is what other processes open it by.
        let dir = store::absolute_path(dir)?;
        let name = segment::random_name();
        let path = dir.join(&name);
        // The supervisor knows the file before it exists, so it is removed after the last
        // process using it goes, whatever ends it.
        let registration = Registration::created(py, path.clone());
        if !registration.is_active() {
            return Err(Error::Missing(format!(
                "a Channel needs the supervisor, which is unavailable for {} (see the warning \
                 above; SHMSTORE_SUPERVISOR=0 turns it off)",
                dir.display()
            ))
            .into());
        }
        let ring = py
            .detach(|| Ring::create(&dir, &name, capacity))
            .map_err(|e| channel_err(&path, e))?;
        let objects_dir = dir_of(ring.path());
        Ok(Channel {
            shared: Arc::new(Shared {
                ring,
                in_flight: Mutex::new(VecDeque::new()),
                pinned: Mutex::new(HashSet::default()),
                dir: objects_dir,
                _registration: registration,
            }),
            closed: AtomicBool::new(false),
        })
    }

    /// Put `obj`; wait for room while the channel is full (up to `timeout` seconds, or
    /// forever; `queue.Full` after that, or at once when `block` is false).
    #[pyo3(signature = (obj, block = true, timeout = None))]
    fn put(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        block: bool,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        self.check_open()?;
        let until = deadline(block, timeout)?;
        self.shared.settle();
        settle_left();
        // Into the channel's directory (`dir_of`).
        // Held, not opened: the getter opens it.
        let store: Put = put_object(py, obj, None, Some(&self.shared.dir), true)?;
        let h = self.handle_of(&store)?;
        self.pin(py, &h);
        let ring = &self.shared.ring;
        loop {
            if let Some(pos) = ring.try_push(&h).map_err(|e| self.err(e))? {
                lock(&self.shared.in_flight).push_back((pos, store));
                return Ok(());
            }
            wait(py, until, |d| ring.wait_to_put(d), Error::QueueFull)?;
            self.shared.settle();
        }
    }

    /// Take the oldest object; wait while the channel is empty (up to `timeout` seconds,
    /// or forever; `queue.Empty` after that, or at once when `block` is false).
    #[pyo3(signature = (block = true, timeout = None))]
    fn get(&self, py: Python<'_>, block: bool, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        self.check_open()?;
        let until = deadline(block, timeout)?;
        let ring = &self.shared.ring;
        loop {
            if let Some((pos, h)) = ring.try_pop().map_err(|e| self.err(e))? {
                // The cell goes back only after this process holds the object (its lease or
                // registration), so the putter never lets go of an object nobody holds.
                let opened = match h {
                    Ok(h) => self.open(py, h),
                    Err(what) => Err(Error::Corrupt {
                        at: format!("channel {:?}", name_of(self.file())),
                        what,
                    }
                    .into()),
                };
                ring.release(pos);
                let store = StoreRef::new(py, opened?)?;
                return Seq::Records(&store).item(py, 0, false).map(Bound::unbind);
            }
            wait(py, until, |d| ring.wait_to_get(d), Error::QueueEmpty)?;
        }
    }

    /// `put(obj, block=False)`.
    fn put_nowait(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        self.put(py, obj, false, None)
    }

    /// `get(block=False)`.
    fn get_nowait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.get(py, false, None)
    }

    /// This process puts and gets no more through this object: later calls of `put` and
    /// `get` raise ValueError (as `multiprocessing.Queue.close()`). Objects already put stay
    /// readable for other processes until taken. Calling it again does nothing.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.shared.settle();
    }

    /// Whether `close()` was called on this object.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// After `close()`: returns at once. A put is complete when it returns (the object is in
    /// shared memory, its handle in the ring), so there is no feeder thread to wait for, as
    /// there is in `multiprocessing.Queue`. ValueError before `close()`.
    fn join_thread(&self) -> PyResult<()> {
        if !self.closed.load(Ordering::Acquire) {
            return Err(Error::Usage(format!(
                "Channel {:?} is not closed: call close() before join_thread()",
                name_of(self.file())
            ))
            .into());
        }
        Ok(())
    }

    /// Does nothing: no feeder thread holds the process's exit (objects put stay readable
    /// after this process exits). There for `multiprocessing.Queue` compatibility.
    fn cancel_join_thread(&self) {}

    /// How many objects wait (approximate while other processes put and get).
    fn qsize(&self) -> u64 {
        self.shared.ring.len()
    }

    /// Whether no object waits (approximate while other processes put and get).
    fn empty(&self) -> bool {
        self.shared.ring.len() == 0
    }

    /// Whether `capacity` objects wait (approximate while other processes put and get).
    fn full(&self) -> bool {
        self.shared.ring.len() >= self.shared.ring.capacity()
    }

    /// How many objects may wait at once.
    #[getter]
    fn capacity(&self) -> u64 {
        self.shared.ring.capacity()
    }

    /// The channel's file name (what other processes open it by).
    #[getter]
    fn name(&self) -> String {
        name_of(self.file())
    }

    /// The channel's file.
    #[getter(path)]
    fn path_of(&self) -> PathBuf {
        self.file().to_owned()
    }

    /// How many objects this process put that no get has taken yet.
    fn _in_flight(&self) -> usize {
        self.shared.settle();
        lock(&self.shared.in_flight).len()
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let f = super::store::Rebuild::Channel.function(py)?;
        (f, (self.file().display().to_string(),)).into_pyobject(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Channel({:?}, capacity={}, waiting={})",
            name_of(self.file()),
            self.shared.ring.capacity(),
            self.shared.ring.len()
        )
    }
}

/// Unpickle a `Channel`: open it by path (ours, mode 0600, a channel header; registered
/// with the supervisor before it is mapped).
#[pyfunction]
pub(crate) fn _rebuild_channel(py: Python<'_>, path: PathBuf) -> PyResult<Channel> {
    let name = name_of(&path);
    if !path.is_absolute() || segment::normalize_name(&name).ok().as_deref() != Some(&name) {
        return Err(Error::Invalid {
            at: "unpickling a Channel".into(),
            what: format!("{} is not a channel's path", path.display()),
        }
        .into());
    }
    let registration = Registration::used(py, path.clone());
    let ring = py
        .detach(|| Ring::open(&path))
        .map_err(|e| channel_err(&path, e))?;
    let objects_dir = dir_of(ring.path());
    Ok(Channel {
        shared: Arc::new(Shared {
            ring,
            in_flight: Mutex::new(VecDeque::new()),
            pinned: Mutex::new(HashSet::default()),
            dir: objects_dir,
            _registration: registration,
        }),
        closed: AtomicBool::new(false),
    })
}

/// A channel's capacity from Python: a power of two from 2 to
/// `crate::channel::MAX_CAPACITY` (ValueError otherwise; pyo3 raises TypeError for a
/// non-int, OverflowError beyond 128 bits).
fn valid_capacity(capacity: i128) -> PyResult<u64> {
    let max = crate::channel::MAX_CAPACITY;
    match u64::try_from(capacity) {
        Ok(c) if c.is_power_of_two() && (2..=max).contains(&c) => Ok(c),
        _ => Err(Error::Invalid {
            at: "Channel(capacity=...)".into(),
            what: format!(
                "{capacity} is not a power of two from 2 to {max} (the number of objects \
                 that may wait at once)"
            ),
        }
        .into()),
    }
}
