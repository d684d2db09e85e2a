//! Ground truth about who uses a segment: `/proc/*/maps` (mapped) and `/proc/*/fd`
//! (held open, e.g. a writer still building it). Used by the supervisor before every unlink
//! and by the orphan sweep (`shmstore gc`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::segment::{PREFIX, SEALED_MTIME_NSEC};

/// For each of `paths`, the pids (other than this process) that map it or hold it open.
pub fn holders(paths: &HashSet<PathBuf>) -> HashMap<PathBuf, Vec<u32>> {
    if paths.is_empty() {
        return HashMap::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    let pids = procs
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()));
    holders_among(paths, pids)
}

/// What [`remove_if_ours`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    Removed,
    /// The name is gone, or now names another file (removed and created again since the
    /// /proc scan): that one is not touched.
    Gone,
    /// Not a segment shmstore made (see [`is_segment`]): never removed.
    NotOurs,
    /// A reader that bypasses the supervisor holds a shared `flock` on it (see
    /// docs/lifecycle.md): kept, try again later.
    Locked,
}

/// Unlink `path` only if it is still the file `id` names, is a segment shmstore made
/// ([`is_segment`]), and no process holds a `flock` on it: the exclusive lock is taken
/// (non-blocking) on the very file, and the name removed while it is held, so a reader
/// that locks the file (shared) before using it either keeps it or finds it unlinked.
pub fn remove_if_ours(path: &Path, id: FileId) -> std::io::Result<Removal> {
    use rustix::fs::{FlockOperation, Mode, OFlags};
    let file = match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    ) {
        Ok(f) => f,
        Err(rustix::io::Errno::NOENT) => return Ok(Removal::Gone),
        Err(rustix::io::Errno::LOOP) => return Ok(Removal::NotOurs),
        Err(e) => return Err(e.into()),
    };
    let st = rustix::fs::fstat(&file)?;
    if (st.st_dev, st.st_ino) != id {
        return Ok(Removal::Gone);
    }
    if !is_segment(path, &st) {
        return Ok(Removal::NotOurs);
    }
    match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Ok(Removal::Locked),
        Err(e) => return Err(e.into()),
    }
    // The name may have been replaced between open and flock: check again under the lock.
    if file_id_nofollow(path) != Some(id) {
        return Ok(Removal::Gone);
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(Removal::Removed),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Removal::Gone),
        Err(e) => Err(e),
    }
}

/// Whether `path` (with status `st`) is a segment shmstore's writer made: named
/// `shmstore-...`, a regular file owned by this user, and either sealed (read-only mode 0400,
/// or 0500 for a fetched copy, with the writer's mark in its modification time, see
/// `segment::SEALED_MTIME_NSEC`) or a `.part-` file still being written (mode 0600, or 0400
/// and 0500 when its writer died between sealing its mode and marking it), or a
/// channel (mode 0600): with a channel's header, or one whose header was overwritten (a
/// random name, a channel's size and a ring's shape in its cells,
/// `channel::scan::is_headless_channel`). A saved file (`save()`), a symlink, another user's
/// file or a file someone made by hand is never removed by the supervisor or the sweep.
pub fn is_segment(path: &Path, st: &rustix::fs::Stat) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    if !name.starts_with(PREFIX) {
        return false;
    }
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
        || st.st_uid != rustix::process::geteuid().as_raw()
    {
        return false;
    }
    let mode = st.st_mode & 0o7777;
    let marked = i128::from(st.st_mtime_nsec) == i128::from(SEALED_MTIME_NSEC);
    let sealed = matches!(mode, 0o400 | 0o500)
        && (marked || (mode == 0o400 && has_magic(path, st, crate::arena::MAGIC)));
    // A writer killed between sealing a `.part-` file's mode and marking it leaves it 0400
    // (or 0500) without the mark: still the writer's, by its name.
    let part = name.contains(".part-") && matches!(mode, 0o400 | 0o500);
    sealed
        || part
        || (mode == 0o600
            && (name.contains(".part-")
                || has_magic(path, st, crate::channel::MAGIC)
                || (random_named(name)
                    && crate::channel::scan::is_headless_channel(path, (st.st_dev, st.st_ino)))))
}

/// Whether `name` is one `segment::random_name` makes (`shmstore-` and 32 lowercase hex
/// digits): a channel's, or an unnamed store's, never a name a user chose.
fn random_named(name: &str) -> bool {
    name.strip_prefix(PREFIX).is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Whether the file at `path` (the one `st` describes) starts with `magic`: an arena
/// (docs/arena.md) or a channel (docs/channel.md). An arena's creator writes chunks after
/// sealing it, through a mapping faulted in before the mark was set; a page faulted in
/// again for a write (after the kernel took it away) moves the modification time until the
/// creator next checks: a creator killed in between leaves an arena without the mark,
/// recognised by its header. A channel is written by every process using it (mode 0600,
/// never sealed): recognised by its header only.
fn has_magic(path: &Path, st: &rustix::fs::Stat, magic: &[u8; 8]) -> bool {
    use rustix::fs::{Mode, OFlags};
    let Ok(fd) = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    ) else {
        return false;
    };
    let same =
        rustix::fs::fstat(&fd).is_ok_and(|now| (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino));
    let mut head = [0u8; 8];
    same && rustix::io::pread(&fd, &mut head, 0) == Ok(8) && &head == magic
}

/// [`file_id`] of the name itself (a symlink is not followed).
pub fn file_id_nofollow(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// A file's identity: (device, inode). Paths are not enough: a process that mapped a
/// segment through the descriptor it wrote it with shows the temporary `.part-` name in
/// /proc/PID/maps, and any name shows as "(deleted)" once unlinked.
pub type FileId = (u64, u64);

pub fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Parse "MAJ:MIN" (hex) of a /proc/PID/maps line into a `st_dev` value.
fn maps_dev(field: &str) -> Option<u64> {
    let (maj, min) = field.split_once(':')?;
    let maj = u32::from_str_radix(maj, 16).ok()?;
    let min = u32::from_str_radix(min, 16).ok()?;
    Some(libc::makedev(maj, min))
}

/// `holders`, looking only at the given processes.
pub fn holders_among(
    paths: &HashSet<PathBuf>,
    pids: impl IntoIterator<Item = u32>,
) -> HashMap<PathBuf, Vec<u32>> {
    holders_among_with(paths, pids, |_| {})
}

/// [`holders_among`], calling `between(pid)` after reading a process's descriptors and
/// before reading its mappings (tests make the process move from one to the other there).
///
/// Two orders matter here:
/// - A file is known by its identity, and one identity can have several names at once: a
///   segment being published is linked under its final name before its `.part-` name is
///   removed. Every name of a used file is held, not just the last one looked at (else the
///   final name of a segment whose writer holds it would look unused and be removed).
/// - Descriptors are read before mappings. A process reading a segment goes from holding a
///   descriptor to mapping the file (open, map, close); read the other way round, a
///   process that made that move between the two reads would show neither.
pub(crate) fn holders_among_with(
    paths: &HashSet<PathBuf>,
    pids: impl IntoIterator<Item = u32>,
    mut between: impl FnMut(u32),
) -> HashMap<PathBuf, Vec<u32>> {
    let mut out: HashMap<PathBuf, Vec<u32>> = HashMap::new();
    let mut ids: HashMap<FileId, Vec<&PathBuf>> = HashMap::new();
    for p in paths {
        if let Some(id) = file_id(p) {
            ids.entry(id).or_default().push(p);
        }
    }
    if ids.is_empty() {
        return out;
    }
    let me = std::process::id();
    for pid in pids {
        if pid == me {
            continue;
        }
        let dir = PathBuf::from(format!("/proc/{pid}"));
        let mut found: HashSet<FileId> = HashSet::new();
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten() {
                // metadata() follows the magic link to the open file, deleted or not.
                if let Some(id) = file_id(&fd.path()).filter(|id| ids.contains_key(id)) {
                    found.insert(id);
                }
            }
        }
        between(pid);
        if let Ok(maps) = std::fs::read_to_string(dir.join("maps")) {
            for line in maps.lines() {
                // address perms offset dev inode pathname
                let mut f = line.split_ascii_whitespace().skip(3);
                let (Some(dev), Some(ino)) = (f.next(), f.next()) else {
                    continue;
                };
                let Ok(ino) = ino.parse::<u64>() else {
                    continue;
                };
                if ino == 0 {
                    continue;
                }
                if let Some(dev) = maps_dev(dev).filter(|&d| ids.contains_key(&(d, ino))) {
                    found.insert((dev, ino));
                }
            }
        }
        for id in found {
            for p in &ids[&id] {
                out.entry((*p).clone()).or_default().push(pid);
            }
        }
    }
    out
}

/// Every regular file of this user named `shmstore-*` in `dir` (what `shmstore ls` shows:
/// also files that are not segments shmstore made, e.g. a corrupt or hand-made one, which
/// nothing ever removes on its own).
pub fn named_files(dir: &Path) -> Vec<PathBuf> {
    let uid = rustix::process::geteuid().as_raw();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PREFIX))
        .map(|e| e.path())
        .filter(|p| {
            rustix::fs::lstat(p).is_ok_and(|st| {
                rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
                    && st.st_uid == uid
            })
        })
        .collect();
    out.sort();
    out
}

/// This user's segments in `dir` (sealed segments and `.part-` files being built; see
/// [`is_segment`]): what the sweep may remove.
pub fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(PREFIX) {
            continue;
        }
        let path = e.path();
        if let Ok(st) = rustix::fs::lstat(&path) {
            if is_segment(&path, &st) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// What the sweep did (or would do, with `dry_run`) to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swept {
    pub path: PathBuf,
    pub size: u64,
    /// Removed (or would be): no live process maps it or holds it open.
    pub removed: bool,
    /// Pids that still use it (then it is kept).
    pub users: Vec<u32>,
    /// Kept: a reader that bypasses the supervisor holds a lock on it.
    pub locked: bool,
}

/// Remove every shmstore file in `dirs` that no live process maps or holds open, except
/// `keep` (segments a live supervisor tracks). Never touches a file any process still uses.
pub fn sweep(dirs: &[PathBuf], keep: &HashSet<PathBuf>, dry_run: bool) -> Vec<Swept> {
    let candidates: HashSet<PathBuf> = dirs
        .iter()
        .flat_map(|d| segment_files(d))
        .filter(|p| !keep.contains(p))
        .collect();
    let ids: HashMap<PathBuf, FileId> = candidates
        .iter()
        .filter_map(|p| file_id_nofollow(p).map(|id| (p.clone(), id)))
        .collect();
    let users = holders(&candidates);
    let mut out: Vec<Swept> = candidates
        .into_iter()
        .filter(|p| ids.contains_key(p))
        .map(|path| {
            let size = path.metadata().map(|m| m.len()).unwrap_or(0);
            let pids = users.get(&path).cloned().unwrap_or_default();
            let outcome = match (pids.is_empty(), dry_run) {
                (false, _) => None,
                (true, true) => Some(Removal::Removed),
                (true, false) => remove_if_ours(&path, ids[&path]).ok(),
            };
            Swept {
                path,
                size,
                removed: outcome == Some(Removal::Removed),
                users: pids,
                locked: outcome == Some(Removal::Locked),
            }
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Seal a hand-made file as the writer seals a segment (mode 0400 + the mark).
#[cfg(test)]
pub(crate) fn seal(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o400)).unwrap();
    crate::segment::mark_sealed(&std::fs::File::open(p).unwrap()).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arena_without_the_seal_mark_is_still_ours() {
        // Its creator died between writing a chunk and putting the mark back.
        let dir = tempfile::tempdir().unwrap();
        let arena = dir.path().join("shmstore-arena");
        let other = dir.path().join("shmstore-not-an-arena");
        std::fs::write(&arena, b"SHMARENA and the rest").unwrap();
        std::fs::write(&other, b"SHMSTORE and the rest").unwrap();
        for p in [&arena, &other] {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o400))
                .unwrap();
        }
        let id = file_id_nofollow(&other).unwrap();
        assert_eq!(remove_if_ours(&other, id).unwrap(), Removal::NotOurs);
        let id = file_id_nofollow(&arena).unwrap();
        assert_eq!(remove_if_ours(&arena, id).unwrap(), Removal::Removed);
    }

    #[test]
    fn only_sealed_segments_of_ours_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let sealed = dir.path().join("shmstore-sealed");
        let saved = dir.path().join("shmstore-saved");
        let read_only_saved = dir.path().join("shmstore-read-only");
        let foreign_name = dir.path().join("data.bin");
        for p in [&sealed, &saved, &read_only_saved, &foreign_name] {
            std::fs::write(p, b"x").unwrap();
        }
        seal(&sealed);
        seal(&foreign_name);
        // A saved file made read-only by its owner: mode 0400, but not the writer's mark.
        std::fs::set_permissions(
            &read_only_saved,
            std::os::unix::fs::PermissionsExt::from_mode(0o400),
        )
        .unwrap();
        let link = dir.path().join("shmstore-link");
        std::os::unix::fs::symlink(&sealed, &link).unwrap();
        for (p, want) in [
            (&saved, Removal::NotOurs),
            (&read_only_saved, Removal::NotOurs),
            (&foreign_name, Removal::NotOurs),
            (&link, Removal::NotOurs),
        ] {
            let id = file_id_nofollow(p).unwrap();
            assert_eq!(remove_if_ours(p, id).unwrap(), want, "{}", p.display());
            assert!(p.symlink_metadata().is_ok());
        }
        // A shared lock held by a reader keeps it; released, it goes.
        let id = file_id_nofollow(&sealed).unwrap();
        let reader = std::fs::File::open(&sealed).unwrap();
        rustix::fs::flock(&reader, rustix::fs::FlockOperation::LockShared).unwrap();
        assert_eq!(remove_if_ours(&sealed, id).unwrap(), Removal::Locked);
        // Unlocked, not only closed: a process another test forks meanwhile would keep a
        // copy of the descriptor, and with it the lock (it belongs to the open file).
        rustix::fs::flock(&reader, rustix::fs::FlockOperation::Unlock).unwrap();
        drop(reader);
        assert_eq!(remove_if_ours(&sealed, id).unwrap(), Removal::Removed);
        assert!(!sealed.exists());
        assert_eq!(remove_if_ours(&sealed, id).unwrap(), Removal::Gone);
    }

    /// A `sh` that holds `path` open until its stdin closes; returned once it says it does.
    fn sh_holding(path: &Path) -> std::process::Child {
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<{}; echo open; read line", path.display()))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "open\n", "the child did not open {}", path.display());
        child
    }

    #[test]
    fn sweep_keeps_files_in_use_and_removes_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let orphan = dir.path().join("shmstore-orphan");
        let open = dir.path().join("shmstore-open");
        let kept = dir.path().join("shmstore-kept");
        let other = dir.path().join("not-ours");
        for p in [&orphan, &open, &kept, &other] {
            std::fs::write(p, b"x").unwrap();
            seal(p);
        }
        // Not made by shmstore's writer (a saved file, or by hand): never swept.
        let saved = dir.path().join("shmstore-saved");
        std::fs::write(&saved, b"x").unwrap();
        // A child process holds `open` open: the sweep must leave it alone.
        let mut child = sh_holding(&open);
        let want: HashSet<PathBuf> = [open.clone()].into();
        let keep: HashSet<PathBuf> = [kept.clone()].into();
        let dry = sweep(&[dir.path().to_owned()], &keep, true);
        assert!(orphan.exists(), "dry run removed a file");
        assert_eq!(dry.iter().filter(|s| s.removed).count(), 1);
        let done = sweep(&[dir.path().to_owned()], &keep, false);
        assert!(!orphan.exists());
        assert!(open.exists() && kept.exists() && other.exists() && saved.exists());
        let o = done.iter().find(|s| s.path == open).unwrap();
        assert!(!o.removed && o.users == vec![child.id()]);
        assert_eq!(holders_among(&want, [child.id()])[&open], vec![child.id()]);
        drop(child.stdin.take());
        child.wait().unwrap();
    }

    /// A file with two names (a segment being published: its final name linked, its
    /// `.part-` name not yet removed), held by a process through one of them: both names
    /// are held, so neither is removed as unused.
    #[test]
    fn every_name_of_a_held_file_is_held() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("shmstore-pub.part-0123456789ab");
        let published = dir.path().join("shmstore-pub");
        std::fs::write(&part, b"x").unwrap();
        seal(&part);
        std::fs::hard_link(&part, &published).unwrap();
        let mut child = sh_holding(&part);
        let both: HashSet<PathBuf> = [part.clone(), published.clone()].into();
        for _ in 0..4 {
            // (the map is keyed by identity: any order of the names must give both)
            let h = holders_among(&both, [child.id()]);
            assert_eq!(h.get(&part), Some(&vec![child.id()]), "{h:?}");
            assert_eq!(h.get(&published), Some(&vec![child.id()]), "{h:?}");
        }
        let swept = sweep(&[dir.path().to_owned()], &HashSet::new(), false);
        assert!(swept.iter().all(|s| !s.removed), "{swept:?}");
        assert!(part.exists() && published.exists());
        drop(child.stdin.take());
        child.wait().unwrap();
    }

    /// A process that goes from holding a file's descriptor to mapping it (open, map,
    /// close: how every reader maps a segment) while the scan looks at it is seen holding
    /// the file: descriptors are read before mappings. (The move is made between the two
    /// reads, on cue, not left to chance.)
    #[test]
    fn a_process_moving_from_descriptor_to_mapping_is_seen() {
        use std::io::{BufRead, BufReader, Write};
        let dir = tempfile::tempdir().unwrap();
        let seg = dir.path().join("shmstore-moving");
        std::fs::write(&seg, vec![7u8; 4096]).unwrap();
        seal(&seg);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "supervisor::sweep::tests::child_open_then_map",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("SHMSTORE_TEST_MOVING", &seg)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut expect = |what: &str| {
            let mut line = String::new();
            loop {
                line.clear();
                assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
                // (the harness's "test ... " has no newline: a cue may end its line)
                if line.trim_end().ends_with(what) {
                    return;
                }
            }
        };
        expect("open");
        let one: HashSet<PathBuf> = [seg.clone()].into();
        let mut moved = false;
        let h = holders_among_with(&one, [child.id()], |_| {
            stdin.write_all(b"map\n").unwrap();
            expect("mapped");
            moved = true;
        });
        assert!(moved);
        assert_eq!(h.get(&seg), Some(&vec![child.id()]), "{h:?}");
        // And mapped only, it is seen by a scan of its own.
        assert_eq!(
            holders_among(&one, [child.id()]).get(&seg),
            Some(&vec![child.id()])
        );
        drop(stdin);
        child.wait().unwrap();
    }

    /// Runs only as a child of [`a_process_moving_from_descriptor_to_mapping_is_seen`]:
    /// opens the file, then on cue maps it and closes the descriptor.
    #[test]
    #[ignore = "a helper process of a_process_moving_from_descriptor_to_mapping_is_seen"]
    fn child_open_then_map() {
        use std::io::{BufRead, Write};
        let Some(path) = std::env::var_os("SHMSTORE_TEST_MOVING") else {
            return;
        };
        let file = std::fs::File::open(path).unwrap();
        let mut stdout = std::io::stdout();
        writeln!(stdout, "open").unwrap();
        stdout.flush().unwrap();
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        // SAFETY: a sealed file nobody writes; the map is only held, never read.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        drop(file);
        writeln!(stdout, "mapped").unwrap();
        stdout.flush().unwrap();
        line.clear();
        let _ = std::io::stdin().lock().read_line(&mut line); // until the parent lets go
        drop(map);
    }

    #[test]
    fn a_part_file_sealed_but_not_marked_is_swept() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("shmstore-x.part-0123456789ab");
        let saved = dir.path().join("shmstore-saved");
        for p in [&part, &saved] {
            std::fs::write(p, b"SHMSTOR\0").unwrap();
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o400))
                .unwrap();
        }
        let done = sweep(&[dir.path().to_owned()], &HashSet::new(), false);
        let removed: Vec<&PathBuf> = done.iter().filter(|s| s.removed).map(|s| &s.path).collect();
        assert_eq!(removed, vec![&part]);
        assert!(saved.exists());
    }

    #[test]
    fn a_channel_whose_header_was_overwritten_is_swept() {
        use crate::channel::{Handle, Ring, CHUNK};
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let name = crate::segment::random_name();
        let path = dir.path().join(&name);
        {
            let ring = Ring::create(dir.path(), &name, 8).unwrap();
            let h = Handle {
                kind: CHUNK,
                path: dir.path().join("shmstore-arena"),
                offset: 4096,
                size: 100,
                generation: 1,
            };
            for _ in 0..3 {
                ring.try_push(&h).unwrap().unwrap();
            }
            let (pos, _) = ring.try_pop().unwrap().unwrap();
            ring.release(pos);
        }
        let garbage = [0x5au8; 64];
        let overwrite = |p: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .write_all_at(&garbage, 0)
                .unwrap()
        };
        overwrite(&path);
        assert!(crate::channel::Ring::open(&path).is_err());
        // The same bytes under a name a user chose, a saved archive of a channel's size, a
        // file of random bytes of a channel's size, and one of another mode: not ours to judge.
        let chosen = dir.path().join("shmstore-mine");
        std::fs::copy(&path, &chosen).unwrap();
        let archive = dir.path().join(crate::segment::random_name());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..8].copy_from_slice(&crate::archive::header::MAGIC);
        std::fs::write(&archive, &bytes).unwrap();
        let noise = dir.path().join(crate::segment::random_name());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..bytes.len())
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(&noise, &random).unwrap();
        let public = dir.path().join(crate::segment::random_name());
        std::fs::copy(&path, &public).unwrap();
        for p in [&chosen, &archive, &noise] {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .unwrap();
        }
        std::fs::set_permissions(&public, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        let done = sweep(&[dir.path().to_owned()], &HashSet::new(), false);
        let removed: Vec<&PathBuf> = done.iter().filter(|s| s.removed).map(|s| &s.path).collect();
        assert_eq!(removed, vec![&path]);
        assert!(!path.exists());
        assert!(chosen.exists() && archive.exists() && noise.exists() && public.exists());
    }
}
