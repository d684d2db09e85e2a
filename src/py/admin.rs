//! Administration: how clients start the supervisor and its main function, the orphan
//! sweep, store facts and segment listing for the CLI and integrations, and the cleanup run
//! at interpreter exit.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
#[cfg(feature = "fuzzing")]
use pyo3::types::PyBytes;
use pyo3::types::{PyDict, PyList};

use super::errors::Error;
use super::handles::StoreHandle;
use super::store::{self, Store};
use crate::segment;
use crate::supervisor::{self, client, server, sweep as sw};

/// Tell the client how to start a supervisor: this interpreter, importing this package
/// from where it is installed (so it works from a venv, an editable install or PYTHONPATH).
pub(crate) fn configure(py: Python<'_>) -> PyResult<()> {
    let exe: PathBuf = py.import("sys")?.getattr("executable")?.extract()?;
    let pkg_file: PathBuf = py.import("shmstore")?.getattr("__file__")?.extract()?;
    let root = pkg_file
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let code = format!(
        "import sys; sys.path.insert(0, {root:?}); \
         from shmstore._native import _supervisor_main; _supervisor_main()"
    );
    client::set_spawn_command(client::SpawnCommand {
        program: exe,
        args: vec!["-I".into(), "-c".into(), code],
    });
    Ok(())
}

fn sweep_dirs() -> Vec<PathBuf> {
    segment::search_dirs()
}

/// Run the supervisor (called in a fresh interpreter by `client::spawn_supervisor`):
/// detach, then serve until no client is left.
#[pyfunction]
pub(crate) fn _supervisor_main(py: Python<'_>) -> PyResult<()> {
    // Importing shmstore may have connected to another supervisor (`client::prepare`).
    client::disconnect();
    let daemonized = supervisor::daemonize().map_err(|err| Error::Io {
        at: "daemonize".into(),
        err,
    })?;
    if !daemonized {
        return Ok(()); // the intermediate process: exit so the client's wait returns
    }
    let grace = std::env::var("SHMSTORE_SUPERVISOR_GRACE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(5.0);
    let Ok(state) = supervisor::state_dir() else {
        // The client checked the directory before starting us; it changed since. Nothing
        // safe to do: the client gives up on supervision and says why.
        std::process::exit(1);
    };
    let cfg = server::ServerConfig {
        name: supervisor::socket_name(),
        grace: Duration::from_secs_f64(grace),
        state,
        log: true,
        sweep_dirs: sweep_dirs(),
    };
    let res = py.detach(|| server::run(cfg));
    // Exit without running Python's shutdown: nothing of ours to flush, and a detached
    // process should not touch inherited state on its way out.
    std::process::exit(if res.is_ok() { 0 } else { 1 });
}

/// Remove orphaned segments: this user's shmstore files in the segment directory that no
/// live process maps or holds open (and that a running supervisor does not track).
/// Raises `StoreIOError` (touching nothing) when a supervisor is running but its list of
/// tracked segments is missing or incomplete, or when the supervisor's directory is not safe
/// to use (so no supervisor could be asked).
///
/// Returns one dict per file: path, size, removed, users (pids), locked.
#[pyfunction]
#[pyo3(signature = (dry_run=false, dirs=None))]
pub(crate) fn sweep<'py>(
    py: Python<'py>,
    dry_run: bool,
    dirs: Option<Vec<PathBuf>>,
) -> PyResult<Bound<'py, PyList>> {
    let dirs = dirs.unwrap_or_else(sweep_dirs);
    let report = py.detach(|| {
        let keep = client::list()?
            .map(|segs| segs.into_iter().map(|s| s.path).collect())
            .unwrap_or_default();
        Ok::<_, std::io::Error>(sw::sweep(&dirs, &keep, dry_run))
    });
    let report = report.map_err(|err| {
        let at = if err.kind() == std::io::ErrorKind::PermissionDenied {
            // The supervisor's directory is unsafe (`client::list`): no supervisor was asked.
            "not sweeping: cannot ask the supervisor which segments are in use, so segments \
             in use could look orphaned"
        } else {
            "not sweeping: the running supervisor's answer was missing or incomplete, so \
             segments in use could look orphaned; try again, or stop the supervisor first"
        };
        Error::Io { at: at.into(), err }
    })?;
    let out = PyList::empty(py);
    for s in report {
        let d = PyDict::new(py);
        d.set_item("path", s.path.display().to_string())?;
        d.set_item("size", s.size)?;
        d.set_item("removed", s.removed)?;
        d.set_item("users", s.users)?;
        d.set_item("locked", s.locked)?;
        out.append(d)?;
    }
    Ok(out)
}

/// The running supervisor (pid, log path, and the segments it tracks with the pids using
/// them), or None when none is running. Never starts one. Raises `StoreIOError` when one
/// is running but does not answer in time or its list is incomplete.
#[pyfunction]
pub(crate) fn supervisor_info(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let got = py.detach(|| Ok::<_, std::io::Error>((client::supervisor_pid()?, client::list()?)));
    let (pid, segs) = got.map_err(|err| Error::Io {
        at: "the supervisor".into(),
        err,
    })?;
    let (Some(pid), Some(segs)) = (pid, segs) else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("pid", pid)?;
    d.set_item("log", supervisor::log_path().display().to_string())?;
    let segments = PyDict::new(py);
    for s in segs {
        segments.set_item(s.path.display().to_string(), s.pids)?;
    }
    d.set_item("segments", segments)?;
    Ok(Some(d))
}

/// Send the DROPs this process has queued now and wait until the supervisor has them
/// (normally a background thread sends them within moments). For tests and benchmarks.
#[pyfunction]
pub(crate) fn _flush_drops(py: Python<'_>) {
    py.detach(client::flush_drops);
}

/// The directories segments are looked up in, in order: `$SHMSTORE_DIR` (else /dev/shm),
/// then the disk fallback unless `SHMSTORE_FALLBACK=0`. The one place that rule lives.
#[pyfunction]
pub(crate) fn _search_dirs() -> Vec<PathBuf> {
    segment::search_dirs()
}

/// This user's state directory (the supervisor's; created 0700 and verified, see
/// `supervisor::state_dir`): the one place for per-user files no one else may create, such
/// as the cluster fetch lock. Raises `StorePermissionError` when it is not safe to use.
#[pyfunction]
pub(crate) fn _state_dir(py: Python<'_>) -> PyResult<PathBuf> {
    let dir = py.detach(supervisor::state_dir).map_err(Error::from)?;
    Ok(dir.path)
}

/// For each path, the pids of other processes that map it or hold it open (ground truth
/// from /proc, matched by device and inode, as the supervisor does).
#[pyfunction]
pub(crate) fn _segment_users(
    py: Python<'_>,
    paths: Vec<PathBuf>,
) -> std::collections::HashMap<PathBuf, Vec<u32>> {
    let set = paths.into_iter().collect();
    py.detach(|| sw::holders(&set))
}

/// Unlink every store this process created and still owns (run at interpreter exit).
#[pyfunction]
pub(crate) fn _cleanup_at_exit() -> usize {
    crate::segment::cleanup_owned()
}

/// Header facts of a store: by handle, or by segment name / file path (for the CLI).
#[pyfunction]
pub(crate) fn _store_info<'py>(
    py: Python<'py>,
    target: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let store: std::sync::Arc<Store> = if let Ok(h) = target.cast::<StoreHandle>() {
        StoreHandle::store(h)?
    } else {
        let s: PathBuf = target.extract()?;
        let text = s.to_string_lossy().to_string();
        if text.contains('/') {
            store::open_file(py, &s)?
        } else {
            store::attach(py, &text, None)?
        }
    };
    let h = store.reader.header();
    let d = PyDict::new(py);
    d.set_item("name", store.source.name())?;
    d.set_item("path", store.source.path().display().to_string())?;
    d.set_item("kind", h.kind.name())?;
    d.set_item("count", h.count)?;
    d.set_item("nbytes", h.total_len)?;
    d.set_item(
        "records_nbytes",
        h.index_off - crate::archive::header::HEADER_LEN as u64,
    )?;
    d.set_item("metadata_nbytes", h.total_len - h.index_off)?;
    d.set_item("symbols", store.reader.symbol_count())?;
    d.set_item("shapes", store.reader.shapes().len())?;
    d.set_item("created_unix_ms", h.created_unix_ms)?;
    d.set_item("creator_pid", h.creator_pid)?;
    d.set_item("owned_here", store.mapping().is_owner())?;
    d.set_item("private_copy", store.mapping().is_private_copy())?;
    d.set_item("registered", store.registered())?;
    Ok(d)
}

#[cfg(feature = "fuzzing")]
/// Testing hook: fuzz case `seed` (src/archive/fuzz.rs) as (kind, archive bytes): an
/// archive with valid checksums and arbitrary structure, for tests/test_fuzz.py.
#[pyfunction]
pub(crate) fn _fuzz_case(py: Python<'_>, seed: u64) -> (&'static str, Bound<'_, PyBytes>) {
    let bytes = py.detach(|| crate::archive::fuzz::case(seed));
    (
        crate::archive::fuzz::kind_of(seed).name(),
        PyBytes::new(py, &bytes),
    )
}

#[cfg(feature = "fuzzing")]
/// Testing hook: the hostile archive `name` (src/archive/fuzz.rs, `CRAFTED`), as bytes.
#[pyfunction]
pub(crate) fn _crafted_archive<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
    let (_, bytes) = crate::archive::fuzz::crafted(name)
        .ok_or_else(|| Error::Usage(format!("no archive {name:?}")))?;
    Ok(PyBytes::new(py, &bytes))
}

#[cfg(feature = "fuzzing")]
/// Testing hook: the names `_crafted_archive` knows (all corrupt but those ending in `-ok`).
#[pyfunction]
pub(crate) fn _crafted_names() -> Vec<&'static str> {
    crate::archive::fuzz::CRAFTED.to_vec()
}

/// This user's regular files named `shmstore-*` (segments, `.part-` files being built, and
/// anything else under such a name) in `dir`, or in every search directory (`_search_dirs`),
/// sorted. Symlinks and other users' files are not listed.
#[pyfunction]
#[pyo3(signature = (dir=None))]
pub(crate) fn _segment_paths(py: Python<'_>, dir: Option<PathBuf>) -> Vec<PathBuf> {
    let dirs = dir.map(|d| vec![d]).unwrap_or_else(segment::search_dirs);
    py.detach(|| {
        let mut out: Vec<PathBuf> = dirs.iter().flat_map(|d| sw::named_files(d)).collect();
        out.sort();
        out
    })
}

/// The segment name `name` stands for (the prefix added), checked as attach and create check
/// it; InvalidInputError for a name shmstore would never create.
#[pyfunction]
pub(crate) fn _segment_name(name: &str) -> PyResult<String> {
    Ok(segment::normalize_name(name).map_err(Error::from)?)
}

/// Unlink the segment `name` (a checked name) from the first search directory that has it
/// as this user's regular file; returns its path, or None when there is none. Mappings in use
/// keep working.
#[pyfunction]
pub(crate) fn _remove_segment(py: Python<'_>, name: &str) -> PyResult<Option<PathBuf>> {
    let name = segment::normalize_name(name).map_err(Error::from)?;
    let me = rustix::process::geteuid().as_raw();
    let removed = py.detach(|| {
        for dir in segment::search_dirs() {
            let path = dir.join(&name);
            let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.file_type().is_file() && m.uid() == me
            });
            if !ours {
                continue;
            }
            return match std::fs::remove_file(&path) {
                Ok(()) => Ok(Some(path)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(err) => Err(Error::Io {
                    at: format!("removing {}", path.display()),
                    err,
                }),
            };
        }
        Ok(None)
    });
    Ok(removed?)
}
