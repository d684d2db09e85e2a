//! Ground truth about who uses a segment: `/proc/*/maps` (mapped) and `/proc/*/fd`
//! (held open, e.g. a writer still building it). Used by the supervisor before every unlink
//! and by the orphan sweep (`shmstore gc`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::segment::PREFIX;

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

/// `pid`'s descendants (children, their children, ...), from /proc/PID/task/*/children.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Ok(kids) = std::fs::read_to_string(t.path().join("children")) {
                for k in kids
                    .split_whitespace()
                    .filter_map(|k| k.parse::<u32>().ok())
                {
                    if !out.contains(&k) && out.len() < 100_000 {
                        out.push(k);
                        todo.push(k);
                    }
                }
            }
        }
    }
    out
}

/// Unlink `path` only if it is still the file `id` names: between a /proc scan and the
/// unlink the name may have been removed and created again (another store), and that one
/// must not be touched. Returns whether it was removed.
pub fn remove_if_same(path: &Path, id: FileId) -> std::io::Result<bool> {
    if file_id(path) != Some(id) {
        return Ok(false);
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
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
    let mut out: HashMap<PathBuf, Vec<u32>> = HashMap::new();
    let ids: HashMap<FileId, &PathBuf> = paths
        .iter()
        .filter_map(|p| file_id(p).map(|id| (id, p)))
        .collect();
    if ids.is_empty() {
        return out;
    }
    let me = std::process::id();
    for pid in pids {
        if pid == me {
            continue;
        }
        let dir = PathBuf::from(format!("/proc/{pid}"));
        let mut found: HashSet<&PathBuf> = HashSet::new();
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
                if let Some(hit) = maps_dev(dev).and_then(|d| ids.get(&(d, ino))) {
                    found.insert(hit);
                }
            }
        }
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten() {
                // metadata() follows the magic link to the open file, deleted or not.
                if let Some(hit) = file_id(&fd.path()).and_then(|id| ids.get(&id)) {
                    found.insert(hit);
                }
            }
        }
        for p in found {
            out.entry(p.clone()).or_default().push(pid);
        }
    }
    out
}

/// This user's shmstore files in `dir` (sealed segments and `.part-` files being built).
pub fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let uid = rustix::process::geteuid().as_raw();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(PREFIX) {
            continue;
        }
        if let Ok(meta) = e.path().symlink_metadata() {
            use std::os::unix::fs::MetadataExt;
            if meta.is_file() && meta.uid() == uid {
                out.push(e.path());
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
        .filter_map(|p| file_id(p).map(|id| (p.clone(), id)))
        .collect();
    let users = holders(&candidates);
    let mut out: Vec<Swept> = candidates
        .into_iter()
        .filter(|p| ids.contains_key(p))
        .map(|path| {
            let size = path.metadata().map(|m| m.len()).unwrap_or(0);
            let pids = users.get(&path).cloned().unwrap_or_default();
            let removed =
                pids.is_empty() && (dry_run || remove_if_same(&path, ids[&path]).unwrap_or(false));
            Swept {
                path,
                size,
                removed,
                users: pids,
            }
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_keeps_files_in_use_and_removes_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let orphan = dir.path().join("shmstore-orphan");
        let open = dir.path().join("shmstore-open");
        let kept = dir.path().join("shmstore-kept");
        let other = dir.path().join("not-ours");
        for p in [&orphan, &open, &kept, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        // A child process holds `open` open: the sweep must leave it alone.
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<{}; read line", open.display()))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Wait (bounded) until the child really holds the file.
        let want: HashSet<PathBuf> = [open.clone()].into();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while holders(&want).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "child never opened the file"
            );
            std::thread::yield_now();
        }
        let keep: HashSet<PathBuf> = [kept.clone()].into();
        let dry = sweep(&[dir.path().to_owned()], &keep, true);
        assert!(orphan.exists(), "dry run removed a file");
        assert_eq!(dry.iter().filter(|s| s.removed).count(), 1);
        let done = sweep(&[dir.path().to_owned()], &keep, false);
        assert!(!orphan.exists());
        assert!(open.exists() && kept.exists() && other.exists());
        let o = done.iter().find(|s| s.path == open).unwrap();
        assert!(!o.removed && o.users == vec![child.id()]);
        assert!(descendants(std::process::id()).contains(&child.id()));
        assert_eq!(holders_among(&want, [child.id()])[&open], vec![child.id()]);
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}
