//! A preallocated file (an arena, a channel): made whole under a temporary name and only
//! then linked under its own, so no process ever opens a half-made one.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::{preflight, random_name, SegmentError, PREFIX};

/// Where the creator's pid sits in the header of an arena or a channel file (a
/// little-endian `u32`, after the 8-byte magic, the version and the sizes); read by
/// `shmstore gc` and listing to tell whose a file is.
pub const CREATOR_PID_AT: usize = 24;

/// Make `dir/name`, a file of `len` bytes reserved with `fallocate`: created as
/// `<name>.part-<random>` (mode 0600, `O_EXCL`, no symlink followed), reserved, handed to
/// `fill` (which writes its header, sets its mode, maps it: whatever the kind of file
/// needs), then linked under `name` (fails if the name exists); the temporary name is
/// removed whatever happens. `fill` gets the file and the temporary path.
///
/// A full directory is [`SegmentError::Full`] (how much is needed, how much is free, and
/// what to do), checked before anything is made and again if `fallocate` finds no room:
/// never a bare ENOSPC.
pub fn create_preallocated<T, E: From<SegmentError>>(
    dir: &Path,
    name: &str,
    len: u64,
    fill: impl FnOnce(File, &Path) -> Result<T, E>,
) -> Result<T, E> {
    preflight(dir, len)?;
    let suffix = &random_name()[PREFIX.len()..][..12];
    let tmp = dir.join(format!("{name}.part-{suffix}"));
    let path = dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags((rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW).bits() as i32)
        .open(&tmp)
        .map_err(|e| SegmentError::io(&tmp, e))?;
    let made = fill_and_link(dir, &tmp, &path, file, len, fill);
    let _ = std::fs::remove_file(&tmp);
    made
}

fn fill_and_link<T, E: From<SegmentError>>(
    dir: &Path,
    tmp: &PathBuf,
    path: &Path,
    file: File,
    len: u64,
    fill: impl FnOnce(File, &Path) -> Result<T, E>,
) -> Result<T, E> {
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len).map_err(|e| {
        if e == rustix::io::Errno::NOSPC {
            // Say how much and what to do, as for any segment.
            match preflight(dir, u64::MAX / 2) {
                Err(full) => full,
                Ok(()) => SegmentError::io(tmp, e.into()),
            }
        } else {
            SegmentError::io(tmp, e.into())
        }
    })?;
    let made = fill(file, tmp)?;
    std::fs::hard_link(tmp, path).map_err(|e| SegmentError::io(path, e))?;
    Ok(made)
}

/// A tmpfs of `size` (as `mount -o size=` takes it) mounted in a fresh temporary directory
/// for a test, unmounted when dropped; `None` (the test says why and passes) where mounting
/// is not allowed (not root).
#[cfg(test)]
pub(crate) struct SmallTmpfs {
    pub dir: tempfile::TempDir,
}

#[cfg(test)]
impl SmallTmpfs {
    pub(crate) fn mount(size: &str) -> Option<SmallTmpfs> {
        let dir = tempfile::tempdir().ok()?;
        let mounted = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .is_ok_and(|o| o.status.success());
        if !mounted {
            eprintln!("cannot mount a tmpfs here (needs root): capacity test skipped");
            return None;
        }
        Some(SmallTmpfs { dir })
    }
}

#[cfg(test)]
impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_directory_is_a_clear_full_error_and_leaves_no_file() {
        let Some(fs) = SmallTmpfs::mount("1m") else {
            return;
        };
        let got = create_preallocated(fs.dir.path(), "shmstore-big", 64 << 20, |_, _| {
            Ok::<_, SegmentError>(())
        });
        let err = got.unwrap_err();
        assert!(matches!(err, SegmentError::Full { .. }), "{err}");
        assert_eq!(std::fs::read_dir(fs.dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_file_is_linked_under_its_name_only_when_filled() {
        let dir = tempfile::tempdir().unwrap();
        let failed = create_preallocated(dir.path(), "shmstore-a", 4096, |_, tmp| {
            assert!(tmp.exists());
            Err::<(), _>(SegmentError::io(tmp, std::io::Error::other("refused")))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        create_preallocated(dir.path(), "shmstore-a", 4096, |file, _| {
            assert_eq!(file.metadata().unwrap().len(), 4096);
            Ok::<_, SegmentError>(())
        })
        .unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["shmstore-a"]);
    }
}
