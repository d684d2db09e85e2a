//! Rust `log` records -> Python `logging`, under logger names that say what the record is
//! about (`shmstore.store`, `shmstore.supervisor`, `shmstore.leaks`), not which Rust module
//! wrote it: a record's target is its module path unless the macro sets one, and pyo3-log
//! would turn `shmstore::py::store` into the logger `shmstore.py.store`. The mapping lives
//! here only, so moving code between modules never renames a logger.

use std::sync::OnceLock;

use log::{Log, Metadata, Record};
use pyo3::prelude::*;

/// The public logger (as a `log` target; pyo3-log turns `::` into `.`) for a record target.
pub(crate) fn public_target(target: &str) -> &'static str {
    let under = |prefix: &str| {
        target == prefix
            || target
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with("::"))
    };
    if under("shmstore::supervisor") || under("shmstore::py::admin") {
        "shmstore::supervisor"
    } else if under("shmstore::graph") || under("shmstore::py::graph") || under("shmstore::leaks") {
        "shmstore::leaks"
    } else {
        // Stores: create, attach, unlink, placement and fallback (py, archive, segment).
        "shmstore::store"
    }
}

/// Forwards to pyo3-log with the target replaced by [`public_target`]. The bridge is made
/// on the first record that needs it, not when the extension loads: making it imports
/// `logging` (~12 ms with `threading`, most of what `import shmstore` costs a process that
/// has not imported it). A record below WARNING while `logging` is not imported is
/// dropped without making it: no handler or level can have been set then, and `logging`'s
/// defaults would drop it too. A WARNING or worse makes it (`logging` shows such records
/// even unconfigured).
struct PublicNames(OnceLock<pyo3_log::Logger>);

impl PublicNames {
    /// The bridge, made now if a record of `level` needs it; `None` when the record can
    /// only be dropped (or the bridge cannot be made).
    fn bridge(&self, level: log::Level) -> Option<&pyo3_log::Logger> {
        if let Some(bridge) = self.0.get() {
            return Some(bridge);
        }
        Python::attach(|py| {
            // A Python exception being raised is put aside while we ask (as pyo3-log does).
            let pending = PyErr::take(py);
            let made = if level > log::Level::Warn && !imported(py, "logging") {
                None
            } else {
                make(py).ok()
            };
            if let Some(e) = pending {
                e.restore(py);
            }
            // Two threads may both make one: the first kept is used by all.
            made.map(|bridge| self.0.get_or_init(|| bridge))
        })
    }
}

/// Whether the module `name` is in `sys.modules` (an error counts as imported: then the
/// record goes the usual way).
fn imported(py: Python<'_>, name: &str) -> bool {
    py.import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|modules| modules.contains(name))
        .unwrap_or(true)
}

/// The bridge to `logging`, its loggers made and their level caches filled (as a Python
/// module makes its logger at import), so that the first records do not pay for that.
fn make(py: Python<'_>) -> PyResult<pyo3_log::Logger> {
    let bridge =
        pyo3_log::Logger::new(py, pyo3_log::Caching::Nothing)?.filter(log::LevelFilter::Trace);
    let logging = py.import("logging")?;
    for name in ["shmstore.store", "shmstore.supervisor", "shmstore.leaks"] {
        logging
            .call_method1("getLogger", (name,))?
            .call_method1("isEnabledFor", (10,))?;
    }
    Ok(bridge)
}

impl Log for PublicNames {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        let public = Metadata::builder()
            .level(metadata.level())
            .target(public_target(metadata.target()))
            .build();
        // Not made yet: maybe (`log` decides, making it if the record needs it).
        self.0.get().is_none_or(|bridge| bridge.enabled(&public))
    }

    fn log(&self, record: &Record<'_>) {
        let Some(bridge) = self.bridge(record.level()) else {
            return;
        };
        bridge.log(
            &Record::builder()
                .args(*record.args())
                .level(record.level())
                .target(public_target(record.target()))
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .build(),
        );
    }

    fn flush(&self) {
        if let Some(bridge) = self.0.get() {
            bridge.flush();
        }
    }
}

/// Install the logger (once per process; a second extension instance keeps the first's).
/// No level caching: we log only on create/attach/unlink, and users change levels at run time.
/// The bridge to `logging` is made by the first record that needs it ([`PublicNames`]).
pub(crate) fn install(_py: Python<'_>) -> PyResult<()> {
    if log::set_boxed_logger(Box::new(PublicNames(OnceLock::new()))).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    Ok(())
}
