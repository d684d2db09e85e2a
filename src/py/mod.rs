//! pyo3 binding layer: a thin adapter over `archive` and `segment`.

mod decode;
mod encode;
mod errors;
mod fetch;
mod graph;
mod handles;
mod logging;
mod store;
mod supervise;
mod views;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
mod _native {
    use super::*;

    #[pymodule_export]
    use super::fetch::{_cluster_identity, _import_archive};
    #[pymodule_export]
    use super::handles::{
        _cleanup_at_exit, _crafted_archive, _fuzz_case, _rebuild, _rebuild_view, _store_info, put,
        KeyIter, RecordIter, Ref, SharedDict, SharedList, StoreHandle,
    };
    #[pymodule_export]
    use super::supervise::{
        _search_dirs, _segment_users, _supervisor_main, supervisor_info, sweep,
    };
    #[pymodule_export]
    use super::views::{ArrayOwner, DictIter, DictView, ListIter, ListView};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        logging::install(m.py())?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        errors::register(m)?;
        graph::register(m)?;
        supervise::configure(m.py())?;
        Ok(())
    }
}
