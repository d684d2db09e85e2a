//! Read-only mappings of sealed segments, and the creator's ownership of a segment's name.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{Mmap, MmapRaw};

use super::SegmentError;
use crate::process::{self, ForkHooks, ForkLock};

type Owned = BTreeSet<(PathBuf, u32)>;

/// Names this process created and still owns: unlinked when their mapping is dropped in
/// this process, or at interpreter exit (`cleanup_owned`).
static OWNED: Mutex<Owned> = Mutex::new(BTreeSet::new());

/// [`OWNED`], with the fork handlers installed.
///
/// Fork safety: the set is locked with the GIL released (a segment made or unlinked without
/// a supervisor), so a thread may hold it while another thread forks. The fork hook
/// (`crate::process`) takes the lock, so the fork waits for that thread's short insert or
/// remove, and the child gets the set unlocked: before, a child forked at that moment hung
/// at its first unsupervised segment. No code holds this lock while taking another one
/// (it is the last of `crate::process`'s order).
fn owned() -> &'static Mutex<Owned> {
    install_fork_handlers();
    &OWNED
}

thread_local! {
    /// [`OWNED`], held by the forking thread from `prepare` to `parent`/`child`.
    static HELD: std::cell::RefCell<Option<MutexGuard<'static, Owned>>> =
        const { std::cell::RefCell::new(None) };
}

fn before_fork() {
    let guard = OWNED.lock().unwrap_or_else(|p| p.into_inner());
    HELD.with(|h| *h.borrow_mut() = Some(guard));
}

fn after_fork() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

/// Register the fork hooks of the owned-names set ([`ForkLock::OwnedNames`]: taken last,
/// see `crate::process`). The Python module does it at import, before any thread of the
/// program can be in the middle of it: a fork while another thread runs the process
/// module's registration for the first time would leave the child a `Once` that never
/// completes.
pub fn install_fork_handlers() {
    // The hooks only lock and unlock a process-global mutex that is held for short
    // stretches by threads that take no other lock meanwhile; they never touch Python,
    // never allocate besides what `Mutex::lock` does, and never unwind (poisoning is
    // recovered from).
    process::on_fork(
        ForkLock::OwnedNames,
        ForkHooks {
            before: before_fork,
            after_parent: after_fork,
            after_child: after_fork,
        },
    );
}

/// Unlink every segment this process (pid) created and still owns. Forked children
/// inherit the set but never act on their parent's entries.
pub fn cleanup_owned() -> usize {
    let pid = std::process::id();
    let mut set = owned().lock().unwrap_or_else(|p| p.into_inner());
    let mine: Vec<_> = set.iter().filter(|(_, p)| *p == pid).cloned().collect();
    for entry in &mine {
        let _ = std::fs::remove_file(&entry.0);
        set.remove(entry);
    }
    mine.len()
}

/// A sealed segment mapped read-only, a window of an arena's mapping, or bytes another
/// library owns (a foreign buffer).
pub struct Mapping {
    mmap: Mapped,
    /// The bytes `mmap` holds, found once when made: every read of the archive asks for
    /// them (several times per `lst[i]`), and a stored (address, length) is two loads where
    /// finding them again is a match on the kind of mapping, a call that is not inlined.
    bytes: Span,
    /// The file it maps, whose name it may own (`take_ownership`, `unlink`); empty for a
    /// window into an arena (a chunk has no name of its own: its store's `Source` says
    /// where it is), so that opening a chunk copies no path.
    path: PathBuf,
    /// Set in the creating process: (path, pid) of the name it owns.
    owner: Mutex<Option<(PathBuf, u32)>>,
    /// Mapped from a private sealed copy, not the file (see `Mapping::from_file`).
    private_copy: bool,
}

/// The pages behind a [`Mapping`].
enum Mapped {
    /// A mapping of its own (a segment or saved file), all of it readable.
    Own(Mmap),
    /// `len` bytes at `start` of an arena's mapping in this process (a chunk's archive),
    /// shared with every other chunk of that arena read here: it stays mapped as long as
    /// any window into it exists.
    Window {
        arena: ArenaMap,
        start: usize,
        len: usize,
    },
    /// `len` bytes at `start` that `owner` keeps valid and unchanged as long as it lives
    /// (another library's buffer: see [`Mapping::foreign`]).
    Foreign {
        _owner: Box<dyn Send + Sync>,
        start: ForeignPtr,
        len: usize,
    },
}

/// The bytes of a [`Mapping`]: `len` bytes at `ptr`, readable and unchanged while the
/// mapping lives (a dangling, aligned `ptr` when `len` is 0).
struct Span {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes behind the pointer are only read, never written, and do not change while
// the mapping that holds them lives (`Mapped::span`): reading them from any thread is as safe
// as reading a `&[u8]`.
unsafe impl Send for Span {}
// SAFETY: as for `Send`: shared reads of bytes that nobody writes.
unsafe impl Sync for Span {}

/// The address of a foreign buffer's first byte.
struct ForeignPtr(*const u8);

// SAFETY: the pointer is only read through (`Mapping::as_ref`), never written, and the bytes
// behind it do not change while the mapping lives (the contract of `Mapping::foreign`), so
// reading them from any thread is as safe as reading a `&[u8]`.
unsafe impl Send for ForeignPtr {}
// SAFETY: as for `Send`: shared reads of bytes that nobody writes.
unsafe impl Sync for ForeignPtr {}

/// The arena mapping a window reads through.
enum ArenaMap {
    /// The arena's one read-only mapping in this process.
    Read(Arc<Mmap>),
    /// The arena creator's own writable mapping (its handles of the chunks it wrote): its
    /// pages are in already, so reading them takes no page fault.
    Written(Arc<MmapRaw>),
}

impl ArenaMap {
    fn as_ptr(&self) -> *const u8 {
        match self {
            ArenaMap::Read(m) => m.as_ptr(),
            ArenaMap::Written(m) => m.as_ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            ArenaMap::Read(m) => m.len(),
            ArenaMap::Written(m) => m.len(),
        }
    }
}

/// "a FIFO (named pipe) owned by uid 1001" and so on, for error messages.
pub(crate) fn describe_file(mode: u32, uid: u32) -> String {
    let what = match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFIFO => "a FIFO (named pipe)",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFDIR => "a directory",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "a file of unknown type",
    };
    let me = rustix::process::geteuid().as_raw();
    if uid == me {
        format!("{what} of yours (uid {uid})")
    } else {
        format!("{what} owned by uid {uid}, not by you (uid {me})")
    }
}

/// Whether this process may map the file in place: it is ours and nobody else can write
/// it (docs/security.md, "Files"). Otherwise its bytes could change under a reader after
/// they were validated (a crash, not an error), or the file could be truncated (SIGBUS):
/// such a file is read from a private sealed copy.
fn trusted_in_place(uid: u32, mode: u32) -> bool {
    uid == rustix::process::geteuid().as_raw() && mode & 0o022 == 0
}

/// Whether some process has `file` open for writing (or mapped writable), found with a
/// read lease taken and given back at once (`F_SETLEASE`: refused with `EAGAIN` while any
/// writer holds the file; only the file's owner may take one). Local writers only: a file
/// system without leases (NFS, for example) cannot say, and the file counts as not open for
/// writing (docs/security.md). While the lease is held a writer's `open` would break it: the
/// holder would be sent a signal, made `SIGURG` (ignored by default) for the few instructions
/// the lease lasts.
fn open_for_writing(file: &File, path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    // Linux's F_SETSIG (not in the libc crate for every target).
    const F_SETSIG: libc::c_int = 10;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    unsafe {
        libc::fcntl(fd, F_SETSIG, libc::SIGURG);
        if libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) == 0 {
            libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK);
            return false;
        }
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EAGAIN) {
        log::info!(
            "{} is open for writing in some process: it is read from a private copy",
            path.display()
        );
        return true;
    }
    log::debug!(
        "cannot tell whether {} is open for writing ({err}); mapped in place",
        path.display()
    );
    false
}

/// Copy `len` bytes of `file` into an anonymous memory file (memfd) and seal it against
/// writing, shrinking and growing (`F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL`):
/// from then on the kernel refuses every change, whoever asks, so validation holds.
fn sealed_copy(file: &File, len: u64, path: &Path) -> Result<File, SegmentError> {
    use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags, SealFlags};
    use std::os::unix::fs::FileExt;
    let fd = memfd_create(
        "shmstore-private-copy",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| SegmentError::io(path, e.into()))?;
    let copy = File::from(fd);
    // Only the file's data is copied: its holes stay holes in the copy (the copy is
    // `len` long but costs no more memory than the file has data). Another user's file of
    // a few KiB of data and a hole of gigabytes used to cost every process that opened it
    // gigabytes of shared memory.
    copy.set_len(len).map_err(|e| SegmentError::io(path, e))?;
    // Read through the descriptor we checked (never the path again), at most `len` bytes:
    // a file that another process grows while we copy cannot make us copy forever.
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    let mut end = len;
    while pos < end {
        let (data, hole) = data_extent(file, pos, end);
        let mut at = data;
        while at < hole {
            let want = (hole - at).min(buf.len() as u64) as usize;
            let n = match file.read_at(&mut buf[..want], at) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(SegmentError::io(path, e)),
            };
            if n == 0 {
                // Truncated while we read it: the copy is cut here, and the header check
                // refuses it.
                log::warn!(
                    "{} shrank while it was being copied ({at} of {len} bytes)",
                    path.display()
                );
                copy.set_len(at).map_err(|e| SegmentError::io(path, e))?;
                end = at;
                break;
            }
            copy.write_all_at(&buf[..n], at)
                .map_err(|e| SegmentError::io(path, e))?;
            at += n as u64;
        }
        pos = hole.max(pos + 1).min(end);
    }
    fcntl_add_seals(
        &copy,
        SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
    )
    .map_err(|e| SegmentError::io(path, e.into()))?;
    Ok(copy)
}

/// The next stretch of data of `file` at or after `pos` and before `end`: `(start, stop)`,
/// `start == stop == end` when only a hole is left. A file system that cannot tell holes
/// (`SEEK_DATA` unsupported) has data everywhere.
fn data_extent(file: &File, pos: u64, end: u64) -> (u64, u64) {
    use rustix::fs::{seek, SeekFrom};
    let data = match seek(file, SeekFrom::Data(pos)) {
        Ok(d) => d.min(end),
        Err(rustix::io::Errno::NXIO) => return (end, end),
        Err(_) => return (pos, end),
    };
    let hole = match seek(file, SeekFrom::Hole(data)) {
        Ok(h) => h.clamp(data, end),
        Err(_) => end,
    };
    (data, hole)
}

/// Refuse what cannot be mapped as a store: not a regular file, empty, or (`require_owner`)
/// another user's.
fn check_file(
    meta: &std::fs::Metadata,
    path: &Path,
    require_owner: bool,
) -> Result<(), SegmentError> {
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_file() {
        return Err(SegmentError::NotAFile {
            path: path.to_owned(),
            what: describe_file(meta.mode(), meta.uid()),
        });
    }
    if require_owner && meta.uid() != me {
        return Err(SegmentError::WrongOwner {
            path: path.to_owned(),
            owner: meta.uid(),
            me,
        });
    }
    if meta.len() == 0 {
        return Err(SegmentError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// Open `path` for mapping, never blocking and (`require_owner`: a segment) never
/// following a symlink (see [`Mapping::open`]); `write`: read-write.
fn open_file(
    path: &Path,
    name: &str,
    require_owner: bool,
    write: bool,
) -> Result<File, SegmentError> {
    let mut flags = rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NONBLOCK;
    if require_owner {
        flags |= rustix::fs::OFlags::NOFOLLOW;
    }
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(flags.bits() as i32)
        .open(path)
        .map_err(|e| open_error(path, name, e))
}

/// Open a file of this user's that other processes write too (a channel): like a segment
/// name (never blocking, never following a symlink), read-write, and refused unless it is
/// a regular, non-empty file owned by this user. Its status, checked.
pub fn open_owned_rw(path: &Path, name: &str) -> Result<(File, std::fs::Metadata), SegmentError> {
    let file = open_file(path, name, true, true)?;
    let meta = file.metadata().map_err(|e| SegmentError::io(path, e))?;
    check_file(&meta, path, true)?;
    Ok((file, meta))
}

/// What a failed open of a store's file means: not found, a symlink (never followed), or
/// the OS error.
fn open_error(path: &Path, name: &str, e: std::io::Error) -> SegmentError {
    match e.kind() {
        std::io::ErrorKind::NotFound => SegmentError::NotFound {
            name: name.to_owned(),
            path: path.to_owned(),
        },
        _ if e.raw_os_error() == Some(libc::ELOOP) => SegmentError::NotAFile {
            path: path.to_owned(),
            what: "a symbolic link (shmstore never follows links to stores)".into(),
        },
        _ => SegmentError::io(path, e),
    }
}

impl Mapping {
    /// A mapping over `mmap`'s bytes (found here once), named `path`.
    fn new(mmap: Mapped, path: PathBuf, private_copy: bool) -> Self {
        let bytes = mmap.span();
        Mapping {
            mmap,
            bytes,
            path,
            owner: Mutex::new(None),
            private_copy,
        }
    }

    /// Map `path` read-only. `require_owner`: refuse files of another user (segments in
    /// shared memory); saved archive files of other users are read from a private copy.
    /// Never blocks: a FIFO or device under the name is refused, not waited on
    /// (`O_NONBLOCK`, then `fstat` of what was opened). A segment name that is a symlink is
    /// refused (`O_NOFOLLOW`: in a shared directory anyone may plant one); a file path the
    /// caller gave may be a symlink, since what counts is the file it opens.
    pub fn open(path: &Path, name: &str, require_owner: bool) -> Result<Self, SegmentError> {
        let file = open_file(path, name, require_owner, false)?;
        Self::from_file(file, path, require_owner)
    }

    /// Map the segment at `path` (as [`Mapping::open`] with `require_owner`) through a
    /// descriptor that holds a shared `flock`, taken before the file is checked and mapped;
    /// returned with the file's (device, inode). A `flock` belongs to the open file, which
    /// the mapping keeps open: the lock lasts as long as the mapping (in this process and in
    /// forked children that inherit it), with no descriptor left open. The supervisor and
    /// `shmstore gc` unlink a segment only under an exclusive lock taken without waiting, so
    /// they never remove one mapped this way (docs/lifecycle.md). The name is checked to
    /// still lead to the locked file once the lock is held: a segment removed just before
    /// is `NotFound`, as if the attach had come a moment later. (A private copy, see
    /// [`Mapping::from_file`], is not the file: its lock ends when this returns.)
    pub fn open_locked(path: &Path, name: &str) -> Result<(Self, (u64, u64)), SegmentError> {
        let file = open_file(path, name, true, false)?;
        let meta = file.metadata().map_err(|e| SegmentError::io(path, e))?;
        // What is not ours (or not a file) is refused before it is locked: another user
        // holding a lock on a file planted under the name cannot turn that clear error into
        // a wait.
        check_file(&meta, path, true)?;
        // A directory where someone else can rename our segments cannot tell us that the
        // file under this name is the store the name was given to.
        super::check_dir_of(path, name)?;
        super::flock_shared(&file, path)?;
        // The name still leads to this file (so it still has a name): a removal, which
        // happens only under an exclusive lock, did not come first.
        let ident = (meta.dev(), meta.ino());
        let named =
            rustix::fs::statat(rustix::fs::CWD, path, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| (st.st_dev, st.st_ino) == ident);
        if !named {
            return Err(SegmentError::NotFound {
                name: name.to_owned(),
                path: path.to_owned(),
            });
        }
        let mapping = Self::from_meta(file, meta, path, true)?;
        Ok((mapping, ident))
    }

    /// Map an already open segment file (e.g. the one just written by this process).
    pub fn from_file(file: File, path: &Path, require_owner: bool) -> Result<Self, SegmentError> {
        let meta = file.metadata().map_err(|e| SegmentError::io(path, e))?;
        Self::from_meta(file, meta, path, require_owner)
    }

    /// [`Mapping::from_file`] of a file whose status is `meta`.
    fn from_meta(
        file: File,
        meta: std::fs::Metadata,
        path: &Path,
        require_owner: bool,
    ) -> Result<Self, SegmentError> {
        check_file(&meta, path, require_owner)?;
        // A saved file of ours that no one else may write can still be open for writing by
        // someone who opened it while they could (mode bits do not revoke descriptors).
        let private_copy = !trusted_in_place(meta.uid(), meta.mode())
            || (!require_owner && open_for_writing(&file, path));
        let mapped = if private_copy {
            log::info!(
                "{} is {}{}: reading a private sealed copy ({} bytes of this process's memory)",
                path.display(),
                describe_file(meta.mode(), meta.uid()),
                if meta.mode() & 0o022 != 0 {
                    ", writable by others"
                } else {
                    ""
                },
                meta.len()
            );
            sealed_copy(&file, meta.len(), path)?
        } else {
            file
        };
        // SAFETY: memmap2 requires that the file is not modified or truncated while mapped.
        // A private copy is sealed (the kernel refuses writes, truncation and growth to
        // everyone). Otherwise the file is ours and writable by nobody else
        // (`trusted_in_place`): segments are sealed to 0400 before they get their name and
        // shmstore never reopens one for writing; saved files are written to a new inode
        // and renamed into place. Only a process of this same user (or root) that
        // deliberately rewrites or truncates the file can still break this — the trust
        // boundary of docs/security.md. The mapping is PROT_READ, so this process can never
        // write the pages.
        let mmap = unsafe { Mmap::map(&mapped) }.map_err(|e| SegmentError::io(path, e))?;
        Ok(Mapping::new(
            Mapped::Own(mmap),
            path.to_owned(),
            private_copy,
        ))
    }

    /// The `len` bytes at `offset` of `arena`, an arena's mapping (a chunk's archive),
    /// read-only. The rest of `arena` belongs to other chunks and is never read through
    /// this window; it stays mapped as long as the window exists.
    pub fn window(
        arena: &Arc<Mmap>,
        path: &Path,
        offset: u64,
        len: u64,
    ) -> Result<Self, SegmentError> {
        Self::chunk(ArenaMap::Read(arena.clone()), path, offset, len)
    }

    /// The same through `arena`, the arena creator's writable mapping (a chunk it wrote and
    /// holds), read-only through this window: without the page faults of a second mapping
    /// of pages the creator has in already.
    pub fn written_window(
        arena: &Arc<MmapRaw>,
        path: &Path,
        offset: u64,
        len: u64,
    ) -> Result<Self, SegmentError> {
        Self::chunk(ArenaMap::Written(arena.clone()), path, offset, len)
    }

    /// A window of `len` bytes at `offset` of `arena`, checked to be non-empty and inside it.
    fn chunk(arena: ArenaMap, path: &Path, offset: u64, len: u64) -> Result<Self, SegmentError> {
        let inside = usize::try_from(offset)
            .ok()
            .zip(usize::try_from(len).ok())
            .filter(|&(start, len)| {
                len > 0 && start.checked_add(len).is_some_and(|end| end <= arena.len())
            });
        let Some((start, len)) = inside else {
            return Err(SegmentError::Empty {
                path: path.to_owned(),
            });
        };
        Ok(Mapping::new(
            Mapped::Window { arena, start, len },
            PathBuf::new(),
            false,
        ))
    }

    /// `len` bytes at `start` that `owner` keeps (a buffer of another library, e.g. Ray's
    /// object store, through the Python buffer protocol), read in place. `label` names it in
    /// messages. An empty buffer is allowed here: the archive's header check refuses it.
    ///
    /// # Safety
    /// `start..start + len` must be readable and must not change (nor be unmapped or freed)
    /// for as long as `owner` lives: the caller has checked that the buffer is read-only and
    /// holds what keeps it so (the exported buffer, which pins the exporting object).
    pub unsafe fn foreign(
        owner: Box<dyn Send + Sync>,
        start: *const u8,
        len: usize,
        label: &Path,
    ) -> Self {
        Mapping::new(
            Mapped::Foreign {
                _owner: owner,
                start: ForeignPtr(start),
                len,
            },
            label.to_owned(),
            false,
        )
    }

    /// A private copy of `bytes` in anonymous memory of this process, mapped read-only once
    /// written (page-aligned, so every array of the archive keeps its alignment). `label`
    /// names it in messages.
    pub fn copy_of(bytes: &[u8], label: &Path) -> Result<Self, SegmentError> {
        if bytes.is_empty() {
            // An anonymous mapping cannot be empty; an empty mapping reads no byte.
            // SAFETY: nothing is read through a mapping of length 0 (`as_ref` gives `&[]`).
            return Ok(unsafe { Self::foreign(Box::new(()), std::ptr::null(), 0, label) });
        }
        let mut mmap = memmap2::MmapOptions::new()
            .len(bytes.len())
            .map_anon()
            .map_err(|e| SegmentError::io(label, e))?;
        mmap[..bytes.len()].copy_from_slice(bytes);
        let mmap = mmap
            .make_read_only()
            .map_err(|e| SegmentError::io(label, e))?;
        Ok(Mapping::new(Mapped::Own(mmap), label.to_owned(), true))
    }

    /// The whole mapping these bytes lie in, as (address, length): the segment's or saved
    /// file's own mapping, or for an arena chunk the arena's one mapping in this process
    /// (shared by every chunk of it read here). It stays mapped as long as `self` exists.
    /// What `shmstore.torch.pin` registers with CUDA, once per mapping.
    pub fn extent(&self) -> (usize, usize) {
        match &self.mmap {
            Mapped::Own(m) => (m.as_ptr() as usize, m.len()),
            Mapped::Window { arena, .. } => (arena.as_ptr() as usize, arena.len()),
            Mapped::Foreign { start, len, .. } => (start.0 as usize, *len),
        }
    }

    /// Whether this mapping is of a private sealed copy (another user's file, or one that
    /// others can write), not of the file itself; or a private copy of a foreign buffer.
    pub fn is_private_copy(&self) -> bool {
        self.private_copy
    }

    /// Mark this process as the owner of the name: dropping the mapping unlinks it.
    pub fn take_ownership(&self) {
        let entry = (self.path.clone(), std::process::id());
        owned()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.clone());
        *self.owner.lock().unwrap_or_else(|p| p.into_inner()) = Some(entry);
    }

    /// Whether this process owns the name.
    pub fn is_owner(&self) -> bool {
        matches!(&*self.owner.lock().unwrap_or_else(|p| p.into_inner()),
            Some((_, pid)) if *pid == std::process::id())
    }

    /// Remove the name now (live mappings, here and elsewhere, keep working). Returns
    /// whether a file was removed.
    pub fn unlink(&self) -> Result<bool, SegmentError> {
        if matches!(self.mmap, Mapped::Window { .. } | Mapped::Foreign { .. }) {
            // A chunk of an arena has no name of its own; the arena is removed once no
            // process uses it (docs/arena.md). A foreign buffer has none either: its owner
            // decides when it goes.
            return Ok(false);
        }
        if let Some(entry) = self.owner.lock().unwrap_or_else(|p| p.into_inner()).take() {
            owned()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&entry);
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(SegmentError::io(&self.path, e)),
        }
    }
}

impl Mapped {
    /// Where the bytes are: found once, when the mapping is made (`Mapping::new`).
    fn span(&self) -> Span {
        let (ptr, len) = match self {
            Mapped::Own(m) => (m.as_ptr(), m.len()),
            // The window lies inside the arena's mapping (checked in `chunk`), which lives as
            // long as the window holds its `Arc`. Only the address is computed here (no
            // reference to the bytes outside the window, other chunks, which may change).
            // SAFETY: `start + len <= arena.len()` (checked in `chunk`), so the offset stays
            // inside the arena's mapping.
            Mapped::Window { arena, start, len } => (unsafe { arena.as_ptr().add(*start) }, *len),
            Mapped::Foreign { start, len, .. } => (start.0, *len),
        };
        if len == 0 || ptr.is_null() {
            // A slice of length 0 reads nothing; a null address (an empty foreign buffer may
            // have any) is replaced by a dangling, aligned one.
            return Span {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
            };
        }
        Span { ptr, len }
    }
}

impl AsRef<[u8]> for Mapping {
    #[inline]
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `bytes` is the span of `self.mmap` (set once in `Mapping::new`, never
        // changed), whose pages stay where they are as long as `self` lives (a mapping's
        // address does not move with the value that owns it). They are readable and do not
        // change meanwhile:
        // - `Own`: our PROT_READ mapping of a sealed or trusted file (`from_file`) or of a
        //   private copy;
        // - `Window`: a chunk this process holds (a lease, or for the creator its own handle
        //   count, `ArenaFile::lease_own`), which the creator never writes or reuses while
        //   held (it writes other chunks through its writable mapping with raw pointers,
        //   never references), and nobody else can write the file (ours, checked by
        //   `ArenaFile::open`; docs/arena.md);
        // - `Foreign`: `Mapping::foreign`'s contract (readable and unchanged while the owner,
        //   which `self` holds, lives).
        unsafe { std::slice::from_raw_parts(self.bytes.ptr, self.bytes.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let owner = self
            .owner
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(entry) = owner {
            if entry.1 == std::process::id() {
                let _ = std::fs::remove_file(&entry.0);
                owned()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&entry);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A foreign mapping reads its owner's bytes in place and holds the owner exactly as long
    /// as it lives; a copy is page-aligned memory of its own; an empty one reads nothing.
    #[test]
    fn foreign_bytes_are_held_and_copies_are_private() {
        let data: Arc<Vec<u8>> = Arc::new((0..=255u8).collect());
        let owner = Arc::clone(&data);
        // SAFETY: `owner` keeps the vector (never written) alive as long as the mapping.
        let m = unsafe { Mapping::foreign(Box::new(owner), data.as_ptr(), 256, Path::new("<t>")) };
        assert_eq!(Arc::strong_count(&data), 2);
        assert_eq!(m.as_ref(), &data[..]);
        assert_eq!(m.extent(), (data.as_ptr() as usize, 256));
        assert!(!m.is_private_copy());
        assert!(
            !m.unlink().unwrap(),
            "a foreign buffer has no name to remove"
        );
        drop(m);
        assert_eq!(Arc::strong_count(&data), 1);

        let c = Mapping::copy_of(&data, Path::new("<t>")).unwrap();
        assert_eq!(c.as_ref(), &data[..]);
        assert_ne!(c.as_ref().as_ptr(), data.as_ptr());
        assert_eq!(c.as_ref().as_ptr() as usize % 4096, 0);
        assert!(c.is_private_copy());
        assert!(Mapping::copy_of(&[], Path::new("<t>"))
            .unwrap()
            .as_ref()
            .is_empty());
    }

    /// Whether thread `tid` of this process is waiting in `futex` (blocked on a mutex).
    fn in_futex(tid: libc::pid_t) -> bool {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<libc::c_long>().ok())
            == Some(libc::SYS_futex)
    }

    /// A fork while another thread holds the owned-names lock: the child must get it
    /// unlocked (before: the child hung at its first unsupervised segment; here it would be
    /// killed by its alarm). The holder lets go only once the forking thread is blocked in
    /// the prepare handler (or, without handlers, once the fork is done).
    #[test]
    fn fork_while_another_thread_holds_the_owned_set() {
        install_fork_handlers();
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (forked_tx, forked_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let guard = OWNED.lock().unwrap();
            held_tx.send(()).unwrap();
            let start = std::time::Instant::now();
            // Bounded: 30 s at most, whatever happens.
            while forked_rx.try_recv().is_err()
                && !in_futex(me)
                && start.elapsed() < std::time::Duration::from_secs(30)
            {
                std::thread::yield_now();
            }
            drop(guard);
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only takes the lock, calls alarm and _exit (no allocation
        // besides the lock's, which the child's own handlers left usable).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: alarm and _exit are async-signal-safe.
            unsafe { libc::alarm(10) };
            let ok = OWNED.lock().is_ok();
            // SAFETY: _exit ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let _ = forked_tx.send(()); // the holder may be gone already
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        holder.join().unwrap();
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the forked child could not take the owned-names lock (status {status:#x})"
        );
    }
}
