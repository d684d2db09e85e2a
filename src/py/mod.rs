//! pyo3 binding layer (feature `python`): a thin adapter over `archive`, `segment` and
//! `supervisor`. One file per Python class; what they share lives once:
//!
//! - `errors`: the exception hierarchy and the one `From<Error> for PyErr`;
//! - `store`: one mapped archive (`Store`), the attach cache, building and saving;
//! - `keys`: dict keys between Python and the archive; `write`: Python -> archive values;
//! - `read/`: archive values -> Python (`ListView`, `DictView`, `ArrayOwner`) and
//!   `read::protocol`, the Sequence/Mapping behaviour that handles and views share;
//! - `handles/`: `StoreHandle`, `SharedList`, `SharedDict`, `Ref` + `put`;
//! - `fetch`: a store's content digest, and importing one fetched from another machine;
//! - `pickle`: unpickling handles and views; `admin`: supervisor entry points, sweep,
//!   listing, store facts; `graph`: the leaks engine's snapshot; `logging`: Rust log
//!   records -> Python loggers.
//!
//! Dependencies point one way: errors <- store, keys <- read <- write <- handles <- pickle,
//! admin, fetch. (Inside `read/`, the conversion and the view types refer to each other: a
//! lazy view is made by the conversion and converts its items.)

mod admin;
mod arena;
mod channel;
mod errors;
mod fetch;
mod graph;
mod handles;
mod keys;
mod logging;
mod pickle;
mod read;
mod store;
mod write;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
mod _native {
    use super::*;

    #[pymodule_export]
    use super::admin::{
        _cleanup_at_exit, _crafted_archive, _crafted_names, _flush_drops, _fuzz_case,
        _remove_segment, _search_dirs, _segment_name, _segment_paths, _segment_users, _store_info,
        _supervisor_main, supervisor_info, sweep,
    };
    #[pymodule_export]
    use super::arena::{_arena_info, _arena_release, _arena_simulate, _arena_usage};
    #[pymodule_export]
    use super::channel::{_rebuild_channel, Channel};
    #[pymodule_export]
    use super::fetch::{_cluster_identity, _import_archive};
    #[pymodule_export]
    use super::handles::{put, KeyIter, RecordIter, Ref, SharedDict, SharedList, StoreHandle};
    #[pymodule_export]
    use super::pickle::{_rebuild, _rebuild_chunk, _rebuild_view};
    #[pymodule_export]
    use super::read::fastpaths::_fast_paths;
    #[pymodule_export]
    use super::read::{ArrayOwner, DictIter, DictView, ListIter, ListView};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        logging::install(m.py())?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("_SEGMENT_PREFIX", crate::segment::PREFIX)?;
        errors::register(m)?;
        graph::register(m)?;
        admin::configure(m.py())?;
        // Before any thread of the program can hold the owned-names lock (fork safety).
        crate::segment::install_fork_handlers();
        // Connect to a running supervisor now (never waits): see `client::prepare`.
        m.py().detach(crate::supervisor::client::prepare);
        read::install_freelists(m.py())?;
        read::fastpaths::report_hashing();
        read::fastpaths::enforce()?;
        Ok(())
    }
}
