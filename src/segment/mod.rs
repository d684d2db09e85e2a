//! Pure-Rust segment layer (no pyo3): named shared-memory segments as files in a tmpfs
//! directory (`/dev/shm` by default), written once through a capacity-checked writer,
//! sealed (mode 0400), published atomically under their final name, then mapped read-only.
//!
//! Why files + memmap2 rather than the `shared_memory` crate: see docs/architecture.md.

mod mapping;
mod preallocated;
mod writer;

use std::path::{Path, PathBuf};

pub use mapping::{cleanup_owned, install_fork_handlers, open_owned_rw, Mapping};
#[cfg(test)]
pub(crate) use preallocated::SmallTmpfs;
pub use preallocated::{create_preallocated, CREATOR_PID_AT};
pub use writer::{preflight, save_file, SaveError, SegmentWriter};

/// Every segment name starts with this, so sweeps and listings can find ours.
pub const PREFIX: &str = "shmstore-";
/// Nanoseconds of the modification time the writer gives a segment when it seals it. With
/// the read-only mode (0400, or 0500 for a fetched copy) it marks "a segment shmstore made":
/// the supervisor and `shmstore gc` remove nothing else (`supervisor::sweep::is_segment`), so
/// a saved file (`save()`, whatever its mode) is never taken for a segment.
pub const SEALED_MTIME_NSEC: u32 = 314_159_265;

/// Set the seal mark (see [`SEALED_MTIME_NSEC`]) on a segment's file: its times become now,
/// with the mark as the nanoseconds of the modification time.
pub fn mark_sealed(file: &impl std::os::fd::AsFd) -> std::io::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let at = |nsec: u32| rustix::fs::Timespec {
        tv_sec: now.as_secs() as i64,
        tv_nsec: nsec as _,
    };
    rustix::fs::futimens(
        file,
        &rustix::fs::Timestamps {
            last_access: at(now.subsec_nanos()),
            last_modification: at(SEALED_MTIME_NSEC),
        },
    )?;
    Ok(())
}

/// Refuse to attach a segment (`name`, at `path`) whose directory lets another user rename
/// the files in it: a directory writable by group or others without the sticky bit (any
/// member can `mv` one of our sealed segments over another: owner and mode travel with the
/// file, so no check of the file can tell), or one owned by another user (its owner can
/// always rename entries). Sticky directories (/dev/shm, /tmp) let only a file's owner
/// rename it. A directory whose status cannot be read is left to the open, which fails.
pub fn check_dir_of(path: &Path, name: &str) -> Result<(), SegmentError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Ok(st) = rustix::fs::stat(dir) else {
        return Ok(());
    };
    let mode = st.st_mode & 0o7777;
    let me = rustix::process::geteuid().as_raw();
    let why = if st.st_uid != me && st.st_uid != 0 {
        format!(
            "is owned by uid {} (not by you, uid {me}, nor root)",
            st.st_uid
        )
    } else if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
            (true, true) => "group and others",
            (true, false) => "its group",
            _ => "others",
        };
        format!("(mode {mode:o}) is writable by {who} and not sticky")
    } else {
        return Ok(());
    };
    Err(SegmentError::SwappableDir {
        name: name.to_owned(),
        dir: dir.to_owned(),
        why,
    })
}

/// Longest accepted name: keeps pickled handles (which carry the path) under 256 bytes.
pub const MAX_NAME: usize = 128;

/// Errors of the segment layer.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("no shmstore segment named {name:?} (looked for {path}); it was unlinked, its creator exited, or the name is wrong")]
    NotFound { name: String, path: PathBuf },
    #[error(
        "a segment named {name:?} already exists ({path}); choose another name or attach to it"
    )]
    Exists { name: String, path: PathBuf },
    #[error("{path} belongs to uid {owner}, not to you (uid {me}): another user created a file under this store's name, and shmstore only reads its own user's segments; if you expected your own store, use another name or a private SHMSTORE_DIR (a directory only you can write)")]
    WrongOwner { path: PathBuf, owner: u32, me: u32 },
    /// The name exists but is not ours to use: another user's file, or not a regular file.
    #[error("cannot create {name:?}: {path} already exists and is {what}; it is not a store of yours, so attaching will not work either: use another name or a private SHMSTORE_DIR (a directory only you can write){fix}")]
    NameTaken {
        name: String,
        path: PathBuf,
        what: String,
        fix: &'static str,
    },
    /// Something other than a regular file under a store's name (a FIFO, a directory, ...).
    #[error("{path} is {what}, not a store file: shmstore opens only regular files of its own user (nothing else is read, and nothing waited for)")]
    NotAFile { path: PathBuf, what: String },
    #[error("not enough space in {dir}: the store needs at least {needed} bytes (with 1 MiB of slack) but only {free} are available to it; {hint}")]
    Full {
        dir: PathBuf,
        needed: u64,
        free: u64,
        hint: String,
    },
    #[error("{path}: truncated: the file is empty, not a shmstore archive")]
    Empty { path: PathBuf },
    #[error("invalid segment name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("refusing to use {path}: {why}; shmstore keeps its per-user files only in a directory that you own and that no one else can write ({fix})")]
    UnsafeDir {
        path: PathBuf,
        why: String,
        fix: &'static str,
    },
    /// The directory of a segment attached by name lets someone else rename the files in it
    /// (docs/security.md, "More neighbours").
    #[error("refusing to attach {name:?} from {dir}: the directory {why}, so they can rename, swap or replace the stores in it (attaching could silently give another store's data); attach only from a directory that is sticky (`chmod +t {dir}`, as /dev/shm and /tmp are) or that no one else can write (`chmod go-w {dir}`), or use a private SHMSTORE_DIR")]
    SwappableDir {
        name: String,
        dir: PathBuf,
        why: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl SegmentError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        SegmentError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// The directory segments live in: `$SHMSTORE_DIR`, else `/dev/shm`. Always absolute (a
/// relative `$SHMSTORE_DIR` is taken from the current directory): a segment's path is what
/// other processes (another working directory) and the supervisor (which refuses relative
/// paths) know it by.
pub fn default_dir() -> PathBuf {
    std::env::var_os("SHMSTORE_DIR")
        .filter(|v| !v.is_empty())
        .map(|v| absolute(PathBuf::from(v)))
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// `p` made absolute against the current directory (as is, if that cannot be known).
fn absolute(p: PathBuf) -> PathBuf {
    to_absolute(p).unwrap_or_else(|(p, _)| p)
}

/// `p` made absolute against the current directory, as `std::path::absolute` makes it; a
/// path already in that form ([`is_plain_absolute`]) is returned as it is, without the walk
/// over its components and a new allocation. On failure (the current directory cannot be
/// known), `p` back with the error.
pub fn to_absolute(p: PathBuf) -> Result<PathBuf, (PathBuf, std::io::Error)> {
    if is_plain_absolute(&p) {
        return Ok(p);
    }
    std::path::absolute(&p).map_err(|err| (p, err))
}

/// Whether `std::path::absolute` returns `p` as it is: absolute, with no `.` component and
/// no repeated or trailing separator (it keeps `..`, and so does this). Lets the directory
/// a small `put` goes to be taken as given, without a walk over its components and a new
/// allocation per object.
pub fn is_plain_absolute(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let b = p.as_os_str().as_bytes();
    b.first() == Some(&b'/')
        && (b.len() == 1
            || (!b.ends_with(b"/")
                && !b.ends_with(b"/.")
                && !b.windows(2).any(|w| w == b"//")
                && !b.windows(3).any(|w| w == b"/./")))
}

/// Where segments go when the segment directory is too small: `$SHMSTORE_FALLBACK_DIR`,
/// else `/var/tmp/shmstore-<uid>` (disk-backed); absolute, as [`default_dir`]. `None` when
/// `SHMSTORE_FALLBACK=0`.
pub fn fallback_dir() -> Option<PathBuf> {
    if matches!(
        std::env::var("SHMSTORE_FALLBACK").as_deref(),
        Ok("0") | Ok("off")
    ) {
        return None;
    }
    Some(
        std::env::var_os("SHMSTORE_FALLBACK_DIR")
            .filter(|v| !v.is_empty())
            .map(|v| absolute(PathBuf::from(v)))
            .unwrap_or_else(|| {
                PathBuf::from(format!(
                    "/var/tmp/shmstore-{}",
                    rustix::process::geteuid().as_raw()
                ))
            }),
    )
}

/// Directories searched, in order, when attaching by name: the segment directory, then
/// the fallback directory if it exists and is safe (ours, not writable by anyone else; see
/// [`private_dir`]): stores spilled there are never read from a directory another user
/// controls.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![default_dir()];
    dirs.extend(fallback_dir().filter(|d| private_dir(d, false).is_ok()));
    dirs
}

/// A per-user directory (the fallback directory, the supervisor's state directory), opened
/// and verified: keep `fd` and reach files through it (`openat`, or `/proc/self/fd/N/...`
/// for sockets), so the checked directory is the one used.
#[derive(Debug)]
pub struct PrivateDir {
    pub path: PathBuf,
    pub fd: std::os::fd::OwnedFd,
}

impl PrivateDir {
    /// A path that reaches `name` inside this very directory (through the open descriptor),
    /// whatever happens to `self.path` meanwhile; short enough for a socket address.
    pub fn fd_path(&self, name: &str) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.fd.as_raw_fd()))
    }
}

/// Open the per-user directory `path`, creating it (mode 0700) when `create` and it is
/// missing. Refuses (`UnsafeDir`, saying why) a symlink, a non-directory, a directory owned
/// by another user, or one that group or others may write: a directory another user
/// controls could swap our files or plant symlinks in it. Checked with `lstat` on the path
/// and `fstat` on the descriptor opened with `O_DIRECTORY | O_NOFOLLOW`, and both must name
/// the same directory.
pub fn private_dir(path: &Path, create: bool) -> Result<PrivateDir, SegmentError> {
    use rustix::fs::{FileType, Mode, OFlags};
    let unsafe_dir = |why: String| SegmentError::UnsafeDir {
        path: path.to_owned(),
        why,
        fix: "remove it, or point XDG_RUNTIME_DIR / SHMSTORE_FALLBACK_DIR elsewhere",
    };
    if create {
        if let Some(parent) = path.parent() {
            // Parents are created as usual (e.g. a missing XDG_RUNTIME_DIR in a test); only
            // the last component is ours and checked.
            if !parent.as_os_str().is_empty() && !parent.exists() {
                let _ = std::fs::create_dir_all(parent);
            }
        }
        match rustix::fs::mkdir(path, Mode::RWXU) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(SegmentError::io(path, e.into())),
        }
    }
    let lst = rustix::fs::lstat(path).map_err(|e| SegmentError::io(path, e.into()))?;
    if FileType::from_raw_mode(lst.st_mode) == FileType::Symlink {
        return Err(unsafe_dir("it is a symbolic link".into()));
    }
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP => {
            unsafe_dir("it is not a directory".into())
        }
        e => SegmentError::io(path, e.into()),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| SegmentError::io(path, e.into()))?;
    if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino) {
        return Err(unsafe_dir("it was replaced while being opened".into()));
    }
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return Err(unsafe_dir("it is not a directory".into()));
    }
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(unsafe_dir(format!(
            "it belongs to uid {}, not to you (uid {me})",
            st.st_uid
        )));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "its mode is {:o}: group or others may write to it",
            st.st_mode & 0o7777
        )));
    }
    Ok(PrivateDir {
        path: path.to_owned(),
        fd,
    })
}

/// Open `path` to read a file of ours: never through a symlink, never blocking (a FIFO put
/// there by someone else), closed on exec. The caller checks what it opened.
pub fn open_read_nofollow(path: &Path) -> std::io::Result<std::fs::File> {
    use rustix::fs::OFlags;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK).bits() as i32)
        .open(path)
}

/// Hold a shared `flock` on the segment at `path`, which must still be the file `ident`
/// names and still have a name: a reader that is not the supervisor's client holds one, and
/// the supervisor never unlinks a segment someone holds locked. If the supervisor removed
/// the name just before (it saw no user), the lock comes with the file already unlinked:
/// then this is `NotFound`, as if the attach had come a moment later.
pub fn lock_shared(path: &Path, ident: (u64, u64)) -> Result<std::fs::File, SegmentError> {
    use rustix::fs::{Mode, OFlags};
    let gone = || SegmentError::NotFound {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        path: path.to_owned(),
    };
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::NOENT => gone(),
        e => SegmentError::io(path, e.into()),
    })?;
    flock_shared(&fd, path)?;
    let st = rustix::fs::fstat(&fd).map_err(|e| SegmentError::io(path, e.into()))?;
    if (st.st_dev, st.st_ino) != ident || st.st_nlink == 0 {
        return Err(gone());
    }
    Ok(std::fs::File::from(fd))
}

/// Take a shared `flock` on `fd` (the file at `path`). The supervisor and `shmstore gc`
/// hold their exclusive lock only while they unlink: this waits a bounded moment.
pub(crate) fn flock_shared(fd: &impl std::os::fd::AsFd, path: &Path) -> Result<(), SegmentError> {
    use rustix::fs::FlockOperation;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
    loop {
        match rustix::fs::flock(fd, FlockOperation::NonBlockingLockShared) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(e) => return Err(SegmentError::io(path, e.into())),
        }
    }
}

/// A fresh unguessable name: the prefix and 128 random bits.
pub fn random_name() -> String {
    let mut bytes = [0u8; 16];
    // getrandom only fails when the OS has no entropy source at all.
    getrandom::fill(&mut bytes).expect("the OS random source is unavailable");
    let mut s = String::with_capacity(PREFIX.len() + 32);
    s.push_str(PREFIX);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Check a user-given name and add the prefix if it is missing.
pub fn normalize_name(name: &str) -> Result<String, SegmentError> {
    let bad = |why| {
        Err(SegmentError::BadName {
            name: name.to_owned(),
            why,
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return bad("use only letters, digits, '-', '_' and '.'");
    }
    if name.starts_with('.') {
        return bad("it must not start with '.'");
    }
    let full = if name.starts_with(PREFIX) {
        name.to_owned()
    } else {
        format!("{PREFIX}{name}")
    };
    if full.len() > MAX_NAME {
        return bad("it is longer than 128 characters (prefix included)");
    }
    if full.contains(".part-") {
        return bad("'.part-' is reserved for stores being built");
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path taken as it is by `is_plain_absolute` is exactly what `std::path::absolute`
    /// makes of it; every other spelling is left to `std::path::absolute`.
    #[test]
    fn plain_absolute_paths_are_what_absolute_makes_of_them() {
        let parts = [
            "", "/", "//", ".", "..", "a", "/.", "./", "dev", "shm", "x.y", ".z",
        ];
        let mut n_plain = 0;
        for a in parts {
            for b in parts {
                for c in parts {
                    let s = format!("{a}{b}{c}");
                    for p in [s.clone(), format!("/{s}"), format!("/dev/{s}")] {
                        let p = Path::new(&p);
                        if is_plain_absolute(p) {
                            n_plain += 1;
                            let abs = std::path::absolute(p).unwrap();
                            assert_eq!(abs.as_os_str(), p.as_os_str(), "{p:?}");
                        }
                    }
                }
            }
        }
        assert!(n_plain > 100, "{n_plain}");
        for p in ["/dev/shm", "/", "/a/../b", "/x.y/.z"] {
            assert!(is_plain_absolute(Path::new(p)), "{p}");
        }
        for p in [
            "dev/shm",
            "",
            "/dev/shm/",
            "/dev//shm",
            "/dev/./shm",
            "/dev/shm/.",
            "//",
        ] {
            assert!(!is_plain_absolute(Path::new(p)), "{p}");
        }
    }

    #[test]
    fn names() {
        assert_eq!(normalize_name("coco").unwrap(), "shmstore-coco");
        assert_eq!(normalize_name("shmstore-x").unwrap(), "shmstore-x");
        assert!(normalize_name("a/b").is_err());
        assert!(normalize_name("").is_err());
        assert!(normalize_name("..").is_err());
        assert!(normalize_name(&"x".repeat(300)).is_err());
        let r = random_name();
        assert!(r.starts_with(PREFIX) && r.len() == PREFIX.len() + 32);
        assert_ne!(random_name(), r);
        assert_eq!(normalize_name(&r).unwrap(), r);
    }

    #[test]
    fn private_dirs_are_created_0700_and_checked() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("mine");
        let pd = private_dir(&d, true).unwrap();
        assert_eq!(d.metadata().unwrap().permissions().mode() & 0o777, 0o700);
        assert!(pd.fd_path("x").starts_with("/proc/self/fd/"));
        assert!(private_dir(&d, false).is_ok());
        // Missing and not asked to create: an I/O error (not found), not a refusal.
        assert!(matches!(
            private_dir(&root.path().join("none"), false),
            Err(SegmentError::Io { .. })
        ));
        // A symlink to a good directory is refused.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let e = private_dir(&link, true).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // Writable by others: refused, and the message says why.
        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&open, true).unwrap_err().to_string();
        assert!(e.contains("mode is 777"), "{e}");
        // A file in its place.
        let file = root.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = private_dir(&file, true).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
