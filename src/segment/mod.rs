//! Pure-Rust segment layer (no pyo3): named shared-memory segments as files in a tmpfs
//! directory (`/dev/shm` by default), written once through a capacity-checked writer,
//! sealed (mode 0400), published atomically under their final name, then mapped read-only.
//!
//! Why files + memmap2 rather than the `shared_memory` crate: see docs/architecture.md.

mod mapping;
mod writer;

use std::path::{Path, PathBuf};

pub use mapping::{cleanup_owned, Mapping};
pub use writer::{preflight, save_file, SaveError, SegmentWriter};

/// Every segment name starts with this, so sweeps and listings can find ours.
pub const PREFIX: &str = "shmstore-";
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

/// The directory segments live in: `$SHMSTORE_DIR`, else `/dev/shm`.
pub fn default_dir() -> PathBuf {
    std::env::var_os("SHMSTORE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// Where segments go when the segment directory is too small: `$SHMSTORE_FALLBACK_DIR`,
/// else `/var/tmp/shmstore-<uid>` (disk-backed). `None` when `SHMSTORE_FALLBACK=0`.
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
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(format!(
                    "/var/tmp/shmstore-{}",
                    rustix::process::geteuid().as_raw()
                ))
            }),
    )
}

/// Directories searched, in order, when attaching by name.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![default_dir()];
    dirs.extend(fallback_dir());
    dirs
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
}
