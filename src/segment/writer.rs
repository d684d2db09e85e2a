//! Writing a segment: a buffered, capacity-checked writer over a temporary file, published
//! under its final name only once sealed. Dropping an unpublished writer removes the file,
//! so an error (or a Python exception) never leaves a partial segment behind.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::SegmentError;

const BUF: usize = 1 << 20;
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
         --shm-size=..., or mount -o remount,size=... /dev/shm), or set SHMSTORE_DIR to a \
         directory on a larger filesystem"
    } else {
        "free space there or set SHMSTORE_DIR to another directory"
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

    /// The directory the segment is being written to (changes after a fallback).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Move what was written to the fallback directory and continue there.
    fn spill(&mut self, need: u64) -> io::Result<bool> {
        let Some(fallback) = self.fallback.take() else {
            return Ok(false);
        };
        if std::fs::create_dir_all(&fallback).is_err()
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
        // Check capacity before every chunk: tmpfs would otherwise fail mid-write with
        // ENOSPC (or, for mapped writes, SIGBUS); this way the error says how much is needed.
        let mut free = free_bytes(&self.dir).map_err(io::Error::other)?;
        let need = self.buf.len() as u64;
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
        file.write_all(&self.buf).map_err(|e| {
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
        self.buf.clear();
        Ok(())
    }

    /// Seal (mode 0400) and publish under the final name; fails if the name is taken.
    /// Returns the path and the still-open file: map it from this descriptor, so there is no
    /// moment when the segment exists but no process holds or maps it (an orphan sweep
    /// running then would remove it).
    pub fn publish(mut self) -> Result<(PathBuf, File), SegmentError> {
        let tmp = self.tmp.clone();
        self.flush_buf().map_err(|e| SegmentError::io(&tmp, e))?;
        let file = self.file.take().expect("published twice");
        file.set_permissions(std::fs::Permissions::from_mode(0o400))
            .map_err(|e| SegmentError::io(&tmp, e))?;
        let final_path = self.final_path();
        // link() fails with EEXIST instead of replacing, so two creators of one name cannot
        // silently swap the segment under a reader.
        match std::fs::hard_link(&self.tmp, &final_path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(SegmentError::Exists {
                    name: self.name.clone(),
                    path: final_path,
                })
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

impl Write for SegmentWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write_all(data)?;
        Ok(data.len())
    }

    fn write_all(&mut self, mut data: &[u8]) -> io::Result<()> {
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
        let (path, file) = w.publish().unwrap();
        assert_eq!(path, dir.path().join("shmstore-w"));
        let shown = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
        assert_eq!(shown, path);
    }
}
