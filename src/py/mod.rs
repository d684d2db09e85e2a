//! pyo3 binding layer (feature `python`): a thin adapter over the layers below it. One file
//! per Python class; what they share lives once:
//!
//! - `errors`: the exception hierarchy and the one `From<Error> for PyErr`;
//! - `stack`: how much of the thread's stack is left, checked before each level of a deep
//!   conversion; `logging`: Rust log records -> Python loggers;
//! - `keys`: dict keys between Python and the archive;
//! - `store`: one mapped archive (`Store`), the attach cache, arena chunks' uses, building
//!   and saving;
//! - `read/`: archive values -> Python (`ListView`, `DictView`, `ArrayOwner`) and
//!   `read::protocol`, the Sequence/Mapping behaviour that handles and views share;
//! - `write`: Python -> archive values; `arena`: `put` of small objects into this
//!   process's arenas;
//! - `handles/`: `StoreHandle`, `SharedList`, `SharedDict`, `Ref` + `put` (their free
//!   lists registered with `read` at init);
//! - `channel`: `Channel`; `pickle`: unpickling handles and views; `fetch`: a store's
//!   content digest, and importing one fetched from another machine; `graph`: the leaks
//!   engine's snapshot; `admin`: supervisor entry points, sweep, listing, store facts.
//!
//! Dependencies point one way, down this order (lowest first; `.ci/check-layers` checks
//! it): errors, stack, logging, keys, store, read, write, arena, handles, channel, pickle, fetch,
//! graph, admin. This file, the index, names them all. (Inside `read/`, the conversion and
//! the view types refer to each other: a lazy view is made by the conversion and converts
//! its items.)

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
mod stack;
mod store;
mod write;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
mod _native {
    use super::*;

    #[pymodule_export]
    use super::admin::{
        _cleanup_at_exit, _flush_drops, _remove_segment, _search_dirs, _segment_name,
        _segment_paths, _segment_users, _state_dir, _store_info, _supervisor_main, supervisor_info,
        sweep,
    };
    // The fuzzer's testing hooks: in test builds only (feature `fuzzing`, `make build`).
    #[cfg(feature = "fuzzing")]
    #[pymodule_export]
    use super::admin::{_crafted_archive, _crafted_names, _fuzz_case};
    #[pymodule_export]
    use super::arena::{
        _arena_gil_handbacks, _arena_info, _arena_release, _arena_simulate, _arena_usage,
    };
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
        // What `_segments.py` reads in an arena's or a channel's header (the magic, and
        // where the creator's pid is): said once, here.
        m.add(
            "_ARENA_MAGIC",
            pyo3::types::PyBytes::new(m.py(), crate::arena::MAGIC),
        )?;
        m.add(
            "_CHANNEL_MAGIC",
            pyo3::types::PyBytes::new(m.py(), crate::channel::MAGIC),
        )?;
        m.add("_CREATOR_PID_AT", crate::segment::CREATOR_PID_AT)?;
        // How many released chunks a process gathers before its next small put reclaims
        // them (for tests that need a chunk reused).
        m.add("_ARENA_RECLAIM_BATCH", crate::arena::owned::RECLAIM_BATCH)?;
        errors::register(m)?;
        graph::register(m)?;
        admin::configure(m.py())?;
        // Before any thread of the program can hold the owned-names lock (fork safety).
        crate::segment::install_fork_handlers();
        // Connect to a running supervisor now (never waits): see `client::prepare`.
        m.py().detach(crate::supervisor::client::prepare);
        read::install_freelists(m.py(), &[handles::install_freelists])?;
        read::fastpaths::report_hashing();
        read::fastpaths::enforce()?;
        Ok(())
    }
}
