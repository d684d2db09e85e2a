//! Writing a segment: a buffered, capacity-checked writer over a temporary file, published
//! under its final name only once sealed. Dropping an unpublished writer removes the file,
//! so an error (or a Python exception) never leaves a partial segment behind.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::SegmentError;

/// Small writes (records, metadata) are collected into a buffer of this size.
const BUF: usize = 1 << 20;
/// Writes of at least `BUF` bytes skip the buffer and go to the file in `write()`s of at most
/// this size (one capacity check each). No `fallocate` first: on tmpfs it zeroes every page
/// that the write then overwrites (measured 5 % slower for 256 MiB).
const DIRECT: usize = 16 << 20;
/// Space left free in the directory after a write (tmpfs needs some slack for metadata).
const RESERVE: u64 = 1 << 20;

/// Free bytes (for unprivileged users) in the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64, SegmentError> {
    let st = rustix::fs::statvfs(dir).map_err(|e| SegmentError::io(dir, e.into()))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

fn full_error(dir: &Path, needed: u64, free: u64) -> SegmentError {
    let hint = if dir.starts_with("/dev/shm") {
        "free space in /dev/shm (remove leftovers with `shmstore gc`), enlarge it (docker run \
         --shm-size=..., or mount -o remount,size=... /dev/shm), or choose a directory on a \
         larger filesystem (dir=..., or SHMSTORE_DIR for every store)"
    } else {
        "free space there, or choose another directory (dir=..., or SHMSTORE_DIR for every store)"
    };
    SegmentError::Full {
        dir: dir.to_owned(),
        needed,
        free,
        hint: hint.into(),
    }
}

/// Fail early, before writing, when `dir` cannot hold `needed` more bytes.
pub fn preflight(dir: &Path, needed: u64) -> Result<(), SegmentError> {
    let free = free_bytes(dir)?;
    if free < needed.saturating_add(RESERVE) {
        return Err(full_error(dir, needed.saturating_add(RESERVE), free));
    }
    Ok(())
}

/// Writes a new segment; see the module docs.
pub struct SegmentWriter {
    file: Option<File>,
    dir: PathBuf,
    /// Where to move the segment if `dir` fills up (a disk-backed directory).
    fallback: Option<PathBuf>,
    name: String,
    tmp: PathBuf,
    buf: Vec<u8>,
    written: u64,
    published: bool,
}

impl SegmentWriter {
    /// Create `dir/<name>.part-<random>` (mode 0600, must not exist). If `dir` turns out
    /// too small while writing, what was written moves to `fallback` and writing goes on
    /// there (with a logged warning).
    pub fn create(dir: &Path, name: &str, fallback: Option<&Path>) -> Result<Self, SegmentError> {
        let (tmp, file) = Self::create_tmp(dir, name)?;
        Ok(SegmentWriter {
            file: Some(file),
            dir: dir.to_owned(),
            fallback: fallback.filter(|f| *f != dir).map(Path::to_owned),
            name: name.to_owned(),
            tmp,
            buf: Vec::with_capacity(BUF),
            written: 0,
            published: false,
        })
    }

    fn create_tmp(dir: &Path, name: &str) -> Result<(PathBuf, File), SegmentError> {
        let suffix = &super::random_name()[super::PREFIX.len()..][..12];
        let tmp = dir.join(format!("{name}.part-{suffix}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::CLOEXEC.bits() as i32)
            .open(&tmp)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => SegmentError::Io {
                    path: dir.to_owned(),
                    source: io::Error::new(io::ErrorKind::NotFound, "directory does not exist"),
                },
                _ => SegmentError::io(&tmp, e),
            })?;
        Ok((tmp, file))
    }

    /// Move what was written to the fallback directory and continue there.
    fn spill(&mut self, need: u64) -> io::Result<bool> {
        let Some(fallback) = self.fallback.take() else {
            return Ok(false);
        };
        if super::private_dir(&fallback, true).is_err()
            || preflight(&fallback, self.written + need).is_err()
        {
            return Ok(false);
        }
        let (tmp, mut file) = Self::create_tmp(&fallback, &self.name).map_err(io::Error::other)?;
        let old = self.file.as_mut().expect("writer used after publish");
        old.seek(SeekFrom::Start(0))?;
        let copied = io::copy(old, &mut file);
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        log::warn!(
            "{} is too small for segment {} ({} bytes written so far): moved it to {} (disk-backed: \
             pages can be evicted and re-read; see docs/lifecycle.md)",
            self.dir.display(),
            self.name,
            self.written,
            fallback.display()
        );
        let _ = std::fs::remove_file(&self.tmp);
        self.file = Some(file);
        self.tmp = tmp;
        self.dir = fallback;
        Ok(true)
    }

    pub fn final_path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    fn flush_buf(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let buf = std::mem::take(&mut self.buf);
        let res = self.write_checked(&buf);
        self.buf = buf;
        self.buf.clear();
        res
    }

    /// Write `data` to the file at its end, after checking that the directory can hold it.
    fn write_checked(&mut self, data: &[u8]) -> io::Result<()> {
        // Check capacity before every chunk: tmpfs would otherwise fail mid-write with
        // ENOSPC (or, for mapped writes, SIGBUS); this way the error says how much is needed.
        let mut free = free_bytes(&self.dir).map_err(io::Error::other)?;
        let need = data.len() as u64;
        if free < need.saturating_add(RESERVE) && self.spill(need)? {
            free = free_bytes(&self.dir).map_err(io::Error::other)?;
        }
        let file = self.file.as_mut().expect("writer used after publish");
        if free < need.saturating_add(RESERVE) {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                // Both counted for the whole store: what it needs so far (with the slack
                // tmpfs keeps) against what the directory could give it.
                full_error(
                    &self.dir,
                    self.written + need + RESERVE,
                    free + self.written,
                ),
            ));
        }
        file.write_all(data).map_err(|e| {
            if e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) {
                io::Error::new(
                    io::ErrorKind::StorageFull,
                    full_error(
                        &self.dir,
                        self.written + need + RESERVE,
                        free + self.written,
                    ),
                )
            } else {
                e
            }
        })?;
        self.written += need;
        Ok(())
    }

    /// Seal (`mode`: 0400, or 0500 for a fetched copy) and publish under the final name;
    /// fails if the name is taken. Returns the path and the still-open file: map it from
    /// this descriptor, so there is no moment when the segment exists but no process holds or
    /// maps it (an orphan sweep running then would remove it).
    pub fn publish_mode(mut self, mode: u32) -> Result<(PathBuf, File), SegmentError> {
        let mode = mode & 0o500;
        let tmp = self.tmp.clone();
        self.flush_buf().map_err(|e| SegmentError::io(&tmp, e))?;
        let file = self.file.take().expect("published twice");
        // The mark first, then the mode (a mode change leaves the modification time as it
        // is): a writer killed in between leaves a `.part-` file of mode 0600, which the
        // sweep removes, never a read-only one without the mark.
        super::mark_sealed(&file).map_err(|e| SegmentError::io(&tmp, e))?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(|e| SegmentError::io(&tmp, e))?;
        let final_path = self.final_path();
        // link() fails with EEXIST instead of replacing, so two creators of one name cannot
        // silently swap the segment under a reader.
        match std::fs::hard_link(&self.tmp, &final_path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(taken(&self.name, final_path));
            }
            Err(e) => return Err(SegmentError::io(&final_path, e)),
        }
        self.published = true;
        let _ = std::fs::remove_file(&self.tmp);
        let file = reopen_same(&final_path, file);
        Ok((final_path, file))
    }
}

/// The file of `path` opened read-only, if it is still the inode of `file`; else `file`.
///
/// A mapping made through `file` would show in /proc/PID/maps (and so in `pmap`, `smem`,
/// `shmstore.memory`) under the build name, `<name>.part-<random> (deleted)`, which reads like
/// a leak and splits one segment in two in per-name accounting. Mapping the public name
/// avoids that. If the name was removed or replaced meanwhile, `file` is still right.
fn reopen_same(path: &Path, file: File) -> File {
    use std::os::unix::fs::MetadataExt;
    let flags = (rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW).bits() as i32;
    let Ok(reopened) = OpenOptions::new().read(true).custom_flags(flags).open(path) else {
        return file;
    };
    match (reopened.metadata(), file.metadata()) {
        (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()) => reopened,
        _ => file,
    }
}

/// The error for a name that exists: "attach to it" only when it is a store of ours; for
/// another user's file or a non-regular file, say what is there and what to do instead.
fn taken(name: &str, path: PathBuf) -> SegmentError {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid().as_raw();
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_file() && m.uid() == me => SegmentError::Exists {
            name: name.to_owned(),
            path,
        },
        Ok(m) => SegmentError::NameTaken {
            name: name.to_owned(),
            what: super::mapping::describe_file(m.mode(), m.uid()),
            fix: if m.uid() == me {
                " (or remove it: it is yours)"
            } else {
                " (or ask its owner or root to remove it)"
            },
            path,
        },
        // Gone again: still report the name as taken at the time.
        Err(_) => SegmentError::Exists {
            name: name.to_owned(),
            path,
        },
    }
}

impl Write for SegmentWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write_all(data)?;
        Ok(data.len())
    }

    fn write_all(&mut self, mut data: &[u8]) -> io::Result<()> {
        if data.len() >= BUF {
            // Large data (an array payload) goes from the caller's memory straight to the
            // file in DIRECT-sized write()s, each capacity-checked: no copy into the buffer,
            // no extra memory. What is buffered goes first, to keep the order.
            self.flush_buf()?;
            for chunk in data.chunks(DIRECT) {
                self.write_checked(chunk)?;
            }
            return Ok(());
        }
        while !data.is_empty() {
            let room = BUF - self.buf.len();
            let n = room.min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == BUF {
                self.flush_buf()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_buf()
    }
}

impl crate::archive::builder::Sink for SegmentWriter {}

impl Seek for SegmentWriter {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.flush_buf()?;
        let p = self
            .file
            .as_mut()
            .expect("writer used after publish")
            .seek(pos)?;
        Ok(p)
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The published file is open under its public name, so a mapping of it shows that
    /// name in /proc/PID/maps instead of `<name>.part-<random> (deleted)`.
    #[test]
    fn published_file_is_open_under_its_public_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SegmentWriter::create(dir.path(), "shmstore-w", None).unwrap();
        w.write_all(b"sealed").unwrap();
        let (path, file) = w.publish_mode(0o400).unwrap();
        assert_eq!(path, dir.path().join("shmstore-w"));
        let shown = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
        assert_eq!(shown, path);
    }

    /// Large writes bypass the 1 MiB buffer (no copy, no growth) and keep the byte order
    /// with the small writes around them.
    #[test]
    fn large_writes_go_straight_to_the_file_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SegmentWriter::create(dir.path(), "shmstore-big", None).unwrap();
        let big: Vec<u8> = (0..DIRECT + BUF + 17).map(|i| (i % 251) as u8).collect();
        w.write_all(b"head").unwrap();
        w.write_all(&big).unwrap();
        // Nothing of the large write was buffered, and the buffer never grew.
        assert!(w.buf.is_empty());
        assert_eq!(w.buf.capacity(), BUF);
        w.write_all(b"tail").unwrap();
        assert_eq!(w.buf.len(), 4);
        let (path, _) = w.publish_mode(0o400).unwrap();
        let got = std::fs::read(path).unwrap();
        assert_eq!(got.len(), 8 + big.len());
        assert_eq!(&got[..4], b"head");
        assert!(got[4..4 + big.len()] == big[..]);
        assert_eq!(&got[4 + big.len()..], b"tail");
    }
}

// ---------------------------------------------------------------------------------------
// Saving an archive to a regular file.

/// Temporary files of `save_file` are named `.<file>.shmstore-save-<16 hex>`.
const SAVE_TAG: &str = ".shmstore-save-";
/// A leftover temporary file is removed only once it is this old (and unlocked).
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);
/// Most directory entries looked at for leftovers per save.
const SCAN_LIMIT: usize = 100_000;

/// A failed save: which step, on which path, and the OS error (errno and its text).
#[derive(Debug, thiserror::Error)]
#[error("saving to {target}: {step} {path}: {source}")]
pub struct SaveError {
    /// The file being saved.
    pub target: PathBuf,
    /// What was being done ("cannot create a temporary file in", ...).
    pub step: &'static str,
    /// The path the step acted on (the directory, the temporary file or the target).
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn is_save_tmp(name: &[u8]) -> bool {
    let tag = SAVE_TAG.as_bytes();
    name.len() > 1 + tag.len() + 16
        && name[0] == b'.'
        && name[name.len() - 16..].iter().all(u8::is_ascii_hexdigit)
        && name[..name.len() - 16].ends_with(tag)
}

/// Write `bytes` to `path` atomically: readers of `path` see the old file or the complete
/// new one, never a part. Safe in a directory other users can write:
/// - the data goes to an anonymous file (`O_TMPFILE`) — or, where the filesystem has none,
///   to a new file of an unguessable name (`O_CREAT|O_EXCL|O_NOFOLLOW`) — so nothing is
///   ever written through a name someone else planted (a symlink, a FIFO);
/// - it is given `mode` (exactly: `fchmod`, no umask), fsynced, linked under an unguessable
///   temporary name (`linkat` never follows or replaces) and renamed over `path` (`rename`
///   replaces a symlink at `path`, never its target); then the directory is fsynced;
/// - while it writes, the process holds an `flock` on the file: leftovers of a killed
///   writer (unlocked, ours, older than a minute, named `.<file>.shmstore-save-<hex>`) are
///   removed by the next save into the same directory.
pub fn save_file(bytes: &[u8], path: &Path, mode: u32) -> Result<(), SaveError> {
    use rustix::fs::{self as fs, AtFlags, FlockOperation, Mode, OFlags, CWD};
    let err = |step: &'static str, p: &Path, e: io::Error| SaveError {
        target: path.to_owned(),
        step,
        path: p.to_owned(),
        source: e,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Some(file_name) = path.file_name() else {
        return Err(err(
            "not a file path:",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "no file name"),
        ));
    };
    let dirfd = fs::openat(
        CWD,
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| err("cannot open the directory", dir, e.into()))?;
    remove_stale_tmp(&dirfd, dir);
    preflight(dir, bytes.len() as u64).map_err(|e| {
        err(
            "not enough space in",
            dir,
            io::Error::new(io::ErrorKind::StorageFull, e),
        )
    })?;

    let suffix = &super::random_name()[super::PREFIX.len()..][..16];
    let mut tmp_name = std::ffi::OsString::from(".");
    // Keep the name within NAME_MAX (255) whatever the target's length.
    let stem = file_name.as_encoded_bytes();
    let stem = &stem[..stem.len().min(200)];
    // SAFETY: a prefix of an OsStr's encoded bytes cut at any byte is valid input for
    // `from_encoded_bytes_unchecked` on Unix, where OsStr is arbitrary bytes.
    tmp_name.push(unsafe { std::ffi::OsStr::from_encoded_bytes_unchecked(stem) });
    tmp_name.push(SAVE_TAG);
    tmp_name.push(suffix);
    let tmp_path = dir.join(&tmp_name);

    let private = Mode::from_raw_mode(0o600);
    let (fd, anonymous) = match fs::openat(
        &dirfd,
        ".",
        OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
        private,
    ) {
        Ok(fd) => (fd, true),
        // No O_TMPFILE on this filesystem (or kernel): a named file nobody can predict.
        Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::ISDIR | rustix::io::Errno::INVAL) => {
            let fd = fs::openat(
                &dirfd,
                &tmp_name,
                OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::RDWR | OFlags::CLOEXEC,
                private,
            )
            .map_err(|e| err("cannot create a temporary file in", dir, e.into()))?;
            (fd, false)
        }
        Err(e) => return Err(err("cannot create a temporary file in", dir, e.into())),
    };
    // From here on a named temporary file is removed on any error.
    let named = std::cell::Cell::new(!anonymous);
    let cleanup = |e: SaveError| {
        if named.get() {
            let _ = fs::unlinkat(&dirfd, &tmp_name, AtFlags::empty());
        }
        e
    };
    let mut file = File::from(fd);
    let res = (|| {
        fs::flock(&file, FlockOperation::LockExclusive)
            .map_err(|e| err("cannot lock the temporary file", &tmp_path, e.into()))?;
        file.write_all(bytes).map_err(|e| {
            let e = if e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) {
                let free = free_bytes(dir).unwrap_or(0);
                io::Error::new(
                    io::ErrorKind::StorageFull,
                    full_error(dir, bytes.len() as u64, free),
                )
            } else {
                e
            };
            err("cannot write", &tmp_path, e)
        })?;
        fs::fchmod(&file, Mode::from_raw_mode(mode))
            .map_err(|e| err("cannot set the mode of", &tmp_path, e.into()))?;
        fs::fsync(&file).map_err(|e| err("cannot flush", &tmp_path, e.into()))?;
        if anonymous {
            // linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH; the /proc link does not.
            let proc_path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
            fs::linkat(
                CWD,
                proc_path.as_str(),
                &dirfd,
                &tmp_name,
                AtFlags::SYMLINK_FOLLOW,
            )
            .map_err(|e| err("cannot name the temporary file", &tmp_path, e.into()))?;
            named.set(true);
        }
        fs::renameat(&dirfd, &tmp_name, &dirfd, file_name)
            .map_err(|e| err("cannot rename the temporary file to", path, e.into()))?;
        named.set(false);
        // The rename is durable once the directory is.
        fs::fsync(&dirfd).map_err(|e| err("cannot flush the directory", dir, e.into()))?;
        Ok(())
    })();
    res.map_err(cleanup)
}

/// Remove leftovers of killed `save_file` calls in `dir` (see there); errors are ignored
/// (a leftover that cannot be checked stays).
fn remove_stale_tmp(dirfd: &impl std::os::fd::AsFd, dir: &Path) {
    use rustix::fs::{self as fs, AtFlags, FlockOperation, Mode, OFlags};
    let Ok(mut entries) = fs::Dir::read_from(dirfd) else {
        return;
    };
    let me = rustix::process::geteuid().as_raw();
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for entry in (&mut entries).take(SCAN_LIMIT).flatten() {
        let name = entry.file_name();
        if !is_save_tmp(name.to_bytes()) {
            continue;
        }
        let Ok(fd) = fs::openat(
            dirfd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        let Ok(st) = fs::fstat(&fd) else { continue };
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(st.st_mtime.max(0) as u64);
        let stale = now.duration_since(old).is_ok_and(|age| age >= STALE_AFTER);
        // Ours, a regular file, old, and no live writer holds its lock.
        if st.st_uid != me
            || fs::FileType::from_raw_mode(st.st_mode) != fs::FileType::RegularFile
            || !stale
            || fs::flock(&fd, FlockOperation::NonBlockingLockExclusive).is_err()
        {
            continue;
        }
        // Still the same file under that name (not swapped since it was opened).
        let same = fs::statat(dirfd, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|s| s.st_dev == st.st_dev && s.st_ino == st.st_ino);
        if same && fs::unlinkat(dirfd, name, AtFlags::empty()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        log::info!(
            "removed {removed} leftover temporary file(s) of interrupted saves in {}",
            dir.display()
        );
    }
}

#[cfg(test)]
mod save_tests {
    use super::*;

    #[test]
    fn save_tmp_names() {
        assert!(is_save_tmp(b".a.shmstore.shmstore-save-0123456789abcdef"));
        assert!(!is_save_tmp(b"a.shmstore.shmstore-save-0123456789abcdef"));
        assert!(!is_save_tmp(b".a.shmstore.shmstore-save-0123456789abcdeg"));
        assert!(!is_save_tmp(b".a.shmstore"));
    }

    #[test]
    fn save_replaces_a_symlink_not_its_target() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let target = dir.path().join("out.shmstore");
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        save_file(b"new", &target, 0o600).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        let meta = std::fs::symlink_metadata(&target).unwrap();
        assert!(meta.file_type().is_file());
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0o600
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        // Nothing else left in the directory.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn save_errors_keep_the_os_reason() {
        let e = save_file(b"x", Path::new("/nonexistent-dir/x"), 0o600).unwrap_err();
        assert_eq!(e.source.raw_os_error(), Some(libc::ENOENT));
        assert!(e.to_string().contains("No such file or directory"), "{e}");
    }
}
