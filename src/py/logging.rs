//! Rust `log` records -> Python `logging`, under logger names that say what the record is
//! about (`shmstore.store`, `shmstore.supervisor`, `shmstore.leaks`), not which Rust module
//! wrote it: a record's target is its module path unless the macro sets one, and pyo3-log
//! would turn `shmstore::py::store` into the logger `shmstore.py.store`. The mapping lives
//! here only, so moving code between modules never renames a logger.

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

/// Forwards to pyo3-log with the target replaced by [`public_target`].
struct PublicNames(pyo3_log::Logger);

impl Log for PublicNames {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        let public = Metadata::builder()
            .level(metadata.level())
            .target(public_target(metadata.target()))
            .build();
        self.0.enabled(&public)
    }

    fn log(&self, record: &Record<'_>) {
        self.0.log(
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
        self.0.flush();
    }
}

/// Install the logger (once per process; a second extension instance keeps the first's).
/// No level caching: we log only on create/attach/unlink, and users change levels at run time.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    let logger =
        pyo3_log::Logger::new(py, pyo3_log::Caching::Nothing)?.filter(log::LevelFilter::Trace);
    if log::set_boxed_logger(Box::new(PublicNames(logger))).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    // The loggers are made now, as a Python module makes its logger at import: not by the
    // first record (e.g. an attach's DEBUG line), which would pay for making the object.
    let logging = py.import("logging")?;
    // Asking once fills the logger's level cache (emptied by `logging` whenever a level
    // changes), which the first DEBUG record would otherwise fill.
    for name in ["shmstore.store", "shmstore.supervisor", "shmstore.leaks"] {
        logging
            .call_method1("getLogger", (name,))?
            .call_method1("isEnabledFor", (10,))?;
    }
    Ok(())
}
