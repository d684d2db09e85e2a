//! Python entry points of the supervisor: how clients start it, its main function, and the
//! orphan sweep / listing used by the CLI.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::Exc;
use crate::segment;
use crate::supervisor::{self, client, server, sweep as sw};

/// Tell the client how to start a supervisor: this interpreter, importing this package
/// from where it is installed (so it works from a venv, an editable install or PYTHONPATH).
pub fn configure(py: Python<'_>) -> PyResult<()> {
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
pub fn _supervisor_main(py: Python<'_>) -> PyResult<()> {
    if !supervisor::daemonize().map_err(|e| Exc::Io.err(format!("daemonize: {e}")))? {
        return Ok(()); // the intermediate process: exit so the client's wait returns
    }
    let grace = std::env::var("SHMSTORE_SUPERVISOR_GRACE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(5.0);
    let cfg = server::ServerConfig {
        name: supervisor::socket_name(),
        grace: Duration::from_secs_f64(grace),
        log: Some(supervisor::log_path()),
        sweep_dirs: sweep_dirs(),
    };
    let res = py.detach(|| server::run(cfg));
    // Exit without running Python's shutdown: nothing of ours to flush, and a detached
    // process should not touch inherited state on its way out.
    std::process::exit(if res.is_ok() { 0 } else { 1 });
}

/// Remove orphaned segments: this user's shmstore files in the segment directory that no
/// live process maps or holds open (and that a running supervisor does not track).
///
/// Returns one dict per file: path, size, removed, users (pids).
#[pyfunction]
#[pyo3(signature = (dry_run=false, dirs=None))]
pub fn sweep<'py>(
    py: Python<'py>,
    dry_run: bool,
    dirs: Option<Vec<PathBuf>>,
) -> PyResult<Bound<'py, PyList>> {
    let dirs = dirs.unwrap_or_else(sweep_dirs);
    let report = py.detach(|| {
        let keep = client::list()
            .map(|segs| segs.into_iter().map(|s| s.path).collect())
            .unwrap_or_default();
        sw::sweep(&dirs, &keep, dry_run)
    });
    let out = PyList::empty(py);
    for s in report {
        let d = PyDict::new(py);
        d.set_item("path", s.path.display().to_string())?;
        d.set_item("size", s.size)?;
        d.set_item("removed", s.removed)?;
        d.set_item("users", s.users)?;
        out.append(d)?;
    }
    Ok(out)
}

/// The running supervisor (pid, log path, and the segments it tracks with the pids using
/// them), or None when none is running. Never starts one.
#[pyfunction]
pub fn supervisor_info(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let (pid, segs) = py.detach(|| (client::supervisor_pid(), client::list()));
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

/// The directories segments are looked up in, in order: `$SHMSTORE_DIR` (else /dev/shm),
/// then the disk fallback unless `SHMSTORE_FALLBACK=0`. The one place that rule lives.
#[pyfunction]
pub fn _search_dirs() -> Vec<PathBuf> {
    segment::search_dirs()
}

/// For each path, the pids of other processes that map it or hold it open (ground truth
/// from /proc, matched by device and inode, as the supervisor does).
#[pyfunction]
pub fn _segment_users(
    py: Python<'_>,
    paths: Vec<PathBuf>,
) -> std::collections::HashMap<PathBuf, Vec<u32>> {
    let set = paths.into_iter().collect();
    py.detach(|| sw::holders(&set))
}
