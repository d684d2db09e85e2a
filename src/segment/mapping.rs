//! Read-only mappings of sealed segments, and the creator's ownership of a segment's name.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use memmap2::Mmap;

use super::SegmentError;

/// Names this process created and still owns: unlinked when their mapping is dropped in
/// this process, or at interpreter exit (`cleanup_owned`).
fn owned() -> &'static Mutex<HashSet<(PathBuf, u32)>> {
    static OWNED: OnceLock<Mutex<HashSet<(PathBuf, u32)>>> = OnceLock::new();
    OWNED.get_or_init(Default::default)
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

/// A sealed segment mapped read-only.
pub struct Mapping {
    mmap: Mmap,
    path: PathBuf,
    name: String,
    /// Set in the creating process: (path, pid) of the name it owns.
    owner: Mutex<Option<(PathBuf, u32)>>,
}

impl Mapping {
    /// Map `path` read-only. `require_owner`: refuse files of another user (segments in
    /// shared memory); saved archive files may be shared between users.
    pub fn open(path: &Path, name: &str, require_owner: bool) -> Result<Self, SegmentError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(
                (rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW).bits() as i32,
            )
            .open(path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => SegmentError::NotFound {
                    name: name.to_owned(),
                    path: path.to_owned(),
                },
                _ => SegmentError::io(path, e),
            })?;
        Self::from_file(file, path, name, require_owner)
    }

    /// Map an already open segment file (e.g. the one just written by this process).
    pub fn from_file(
        file: File,
        path: &Path,
        name: &str,
        require_owner: bool,
    ) -> Result<Self, SegmentError> {
        let meta = file.metadata().map_err(|e| SegmentError::io(path, e))?;
        let me = rustix::process::geteuid().as_raw();
        if require_owner && meta.uid() != me {
            return Err(SegmentError::WrongOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                me,
            });
        }
        if !meta.is_file() {
            return Err(SegmentError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
            ));
        }
        if meta.len() == 0 {
            return Err(SegmentError::Empty {
                path: path.to_owned(),
            });
        }
        // SAFETY: memmap2 requires that the file is not modified or truncated while mapped.
        // Segments are sealed before they get their name (mode 0400, written once, never
        // reopened for writing by shmstore) and belong to this user; a same-user process
        // that deliberately truncates one can still cause SIGBUS, as with any mmap. The
        // mapping is PROT_READ, so this process can never write the shared pages.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| SegmentError::io(path, e))?;
        Ok(Mapping {
            mmap,
            path: path.to_owned(),
            name: name.to_owned(),
            owner: Mutex::new(None),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn name(&self) -> &str {
        &self.name
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

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        &self.mmap
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
