//! A store's registration with the supervisor (`NEW`/`USE`, a DROP queued when it goes), or,
//! without one, a shared `flock` on its file.

use super::*;

/// "This process uses the segment": told to the supervisor when made, DROP queued when
/// dropped (for a failed build or attach, or with the `Store` that owns it; never blocks).
/// Without a supervisor, the segment file is held with a shared `flock` instead, which the
/// supervisor and `shmstore gc` respect even when `/proc` cannot show them this process.
pub(crate) struct Registration {
    pub(super) path: PathBuf,
    pub(super) active: bool,
    pub(super) lock: Option<std::fs::File>,
}

impl Registration {
    pub(super) fn new(py: Python<'_>, path: PathBuf, created: bool) -> Self {
        let active = register(py, &path, created);
        Registration {
            path,
            active,
            lock: None,
        }
    }

    /// This process is about to create the segment (or arena) at `path`.
    pub(crate) fn created(py: Python<'_>, path: PathBuf) -> Self {
        Registration::new(py, path, true)
    }

    /// [`Self::created`], then `then` (making the file), in one stretch without the GIL:
    /// each time the GIL is given back, a thread running Python may keep it for the
    /// interpreter's switch interval (5 ms), so a segment's build gives it back as few
    /// times as it can (the supervisor still knows the segment before it exists).
    pub(super) fn created_then<T: Send>(
        py: Python<'_>,
        path: PathBuf,
        then: impl FnOnce() -> T + Send,
    ) -> (Self, T) {
        let (told, made) = py.detach(|| (supervisor::client::use_segment(&path, true), then()));
        let active = told_supervisor(&path, told);
        let reg = Registration {
            path,
            active,
            lock: None,
        };
        (reg, made)
    }

    /// This process is about to map the existing file at `path` (a round trip: the
    /// supervisor knows before the file is mapped).
    pub(crate) fn used(py: Python<'_>, path: PathBuf) -> Self {
        Registration::new(py, path, false)
    }

    /// Whether the supervisor knows.
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// This process attached (mapped) the segment at `path` through a locked descriptor
    /// (`Mapping::open_locked`: the lock lasts as long as the mapping): tell the supervisor
    /// without waiting for its answer when possible (`client::use_segment_nowait`).
    pub(super) fn attached(py: Python<'_>, path: PathBuf) -> Self {
        let told = py.detach(|| supervisor::client::use_segment_nowait(&path));
        let active = told_supervisor(&path, told);
        Registration {
            path,
            active,
            lock: None,
        }
    }

    /// Nothing to register (a saved file, not a segment).
    pub(super) fn none(path: PathBuf) -> Self {
        Registration {
            path,
            active: false,
            lock: None,
        }
    }

    pub(super) fn follow(&mut self, py: Python<'_>, path: PathBuf) {
        if path != self.path {
            let old = std::mem::replace(self, Registration::new(py, path, true));
            drop(old);
        }
    }

    /// Not registered: hold a shared lock on the segment file `ident` names (see the type's
    /// docs). An error if the name was removed meanwhile (by a supervisor that saw no user).
    pub(super) fn lock_if_unsupervised(&mut self, ident: (u64, u64)) -> Result<(), SegmentError> {
        if self.active {
            return Ok(());
        }
        let file = segment::lock_shared(&self.path, ident)?;
        self.lock = Some(file);
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // The lock goes first: a supervisor that acts on the DROP finds the file unlocked.
        drop(self.lock.take());
        if self.active {
            supervisor::client::drop_segment(&self.path);
        }
    }
}

/// Tell the supervisor (starting it if needed) that this process uses `path`. False when
/// it is unavailable or disabled: then only the orphan sweep covers the segment. Said at
/// WARNING once per process (with what it means and how to fix it), unless disabled on
/// purpose.
pub(super) fn register(py: Python<'_>, path: &Path, created: bool) -> bool {
    let told = py.detach(|| supervisor::client::use_segment(path, created));
    told_supervisor(path, told)
}

/// Whether the supervisor knows `path`, from its answer (`told`); what was learnt said.
fn told_supervisor(path: &Path, told: Result<(), supervisor::client::Unavailable>) -> bool {
    match told {
        Ok(()) => {
            late_news();
            true
        }
        Err(e) => unavailable(path, e),
    }
}

/// Say (once per process, see [`unavailable`]) why a segment attached earlier without
/// waiting for the supervisor's answer is not covered by it, if that was learnt since.
pub(super) fn late_news() {
    if let Some(why) = supervisor::client::take_late() {
        warn_unsupervised(&why, None);
    }
}

/// The supervisor is unavailable for `path` (`e` says why): false, and the reason said at
/// WARNING once per process, unless it is disabled on purpose.
pub(super) fn unavailable(path: &Path, e: supervisor::client::Unavailable) -> bool {
    use supervisor::client::Unavailable;
    match e {
        Unavailable::Disabled => false,
        e => {
            late_news();
            warn_unsupervised(&e.to_string(), Some(path));
            false
        }
    }
}

pub(super) fn warn_unsupervised(e: &str, path: Option<&Path>) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        log::warn!(
            target: "shmstore::supervisor",
            "shmstore runs without its supervisor: {e}. What this means: segments this \
             process creates are removed when it closes them or exits normally, but if \
             it is killed (SIGKILL, OOM) they stay until the next supervisor starts or \
             `shmstore gc` runs. (Said once per process; SHMSTORE_SUPERVISOR=0 turns the \
             supervisor off without this warning.)"
        );
    } else if let Some(path) = path {
        log::debug!(
            target: "shmstore::supervisor",
            "supervisor unavailable for {}: {e}",
            path.display()
        );
    }
}
