//! Which fast paths of reading (and hashing) this process has on, and why any is off.
//!
//! Every fast path that depends on something outside this crate's control (the interpreter's
//! object layout as pyo3 sets it up, a type slot being there to replace, the CPU) is switched
//! on in one place, at module init, by a check that either holds or names what did not
//! hold. Nothing falls back silently: a path that is off is
//! - reported by `shmstore._native._fast_paths()` (`{name: True | "why it is off"}`), which
//!   `tests/test_fast_paths.py` checks against what this interpreter and build should have;
//! - logged once, as a warning on the `shmstore.store` logger, at import, unless it is off
//!   for a reason that holds for the whole build (the stable ABI, a CPU without AVX2), which
//!   the report says instead;
//! - an `ImportError` when the environment variable `SHMSTORE_REQUIRE_FAST_PATHS` is `1`
//!   (for CI and benchmark machines: a result measured without them is not comparable).
//!
//! docs/architecture.md ("Read") describes the decision.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Why a fast path is off for the whole build: expected, not warned about.
pub(crate) const ABI3: &str = "off: stable ABI (abi3) build, which hides the type slots";
pub(crate) const NO_AVX2: &str = "off: this CPU has no AVX2";
pub(crate) const NOT_X86: &str = "off: not an x86-64 build";

/// Every view fast path's name (those `freelist::install` reports; the stable ABI build
/// reports them all off).
#[cfg(feature = "abi3")]
pub(crate) const NAMES: &[&str] = &[
    "freelist.ListView",
    "freelist.DictView",
    "freelist.ListIter",
    "freelist.DictIter",
    "freelist.RecordIter",
    "freelist.KeyIter",
    "direct.ListView",
    "direct.DictView",
    "direct.ListIter",
    "direct.DictIter",
    "direct.RecordIter",
    "direct.KeyIter",
    "slots.ListView.subscript",
    "slots.DictView.subscript",
    "slots.SharedList.subscript",
    "slots.SharedDict.subscript",
    "slots.ListView.len",
    "slots.DictView.len",
    "slots.ListView.iter",
    "slots.DictView.iter",
    "slots.ListIter.next",
    "slots.DictIter.next",
    "slots.RecordIter.next",
    "slots.KeyIter.next",
    "slots.int_index",
];

/// The fast paths in the order they were reported, each `Ok` (on) or the reason it is off.
static PATHS: Mutex<Vec<(String, Result<(), String>)>> = Mutex::new(Vec::new());

/// Whether `reason` is one that holds for the whole build (not a layout that differs).
fn expected(reason: &str) -> bool {
    [ABI3, NO_AVX2, NOT_X86].contains(&reason)
}

/// Record the state of the fast path `name` (a later report of the same name replaces it).
pub(crate) fn report(name: impl Into<String>, state: Result<(), String>) {
    let name = name.into();
    if let Err(why) = &state {
        if !expected(why) {
            log::warn!(
                "shmstore: the fast path {name} is off ({why}); reads work, only slower. \
                 Please report it with your Python and shmstore versions."
            );
        }
    }
    let mut paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
    match paths.iter_mut().find(|(n, _)| *n == name) {
        Some(slot) => slot.1 = state,
        None => paths.push((name, state)),
    }
}

/// Report the hashing paths (the CPU's, known at once).
pub(crate) fn report_hashing() {
    #[cfg(target_arch = "x86_64")]
    let avx2 = if std::is_x86_feature_detected!("avx2") {
        Ok(())
    } else {
        Err(NO_AVX2.to_owned())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = Err(NOT_X86.to_owned());
    report("hash.xxh3_avx2", avx2);
}

/// Raise `ImportError` if `SHMSTORE_REQUIRE_FAST_PATHS=1` and a fast path is off for a
/// reason other than the build's.
pub(crate) fn enforce() -> PyResult<()> {
    if std::env::var_os("SHMSTORE_REQUIRE_FAST_PATHS").is_none_or(|v| v != "1") {
        return Ok(());
    }
    let paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
    let off: Vec<String> = paths
        .iter()
        .filter_map(|(n, s)| match s {
            Err(why) if !expected(why) => Some(format!("{n} ({why})")),
            _ => None,
        })
        .collect();
    if off.is_empty() {
        return Ok(());
    }
    Err(crate::py::errors::Error::FastPathsOff(format!(
        "shmstore: SHMSTORE_REQUIRE_FAST_PATHS=1 and these fast paths are off: {}",
        off.join(", ")
    ))
    .into())
}

/// `{name: True | "why it is off"}` for every fast path of this process (see the module's
/// text).
#[pyfunction]
pub(crate) fn _fast_paths(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
    for (name, state) in paths.iter() {
        match state {
            Ok(()) => d.set_item(name, true)?,
            Err(why) => d.set_item(name, why)?,
        }
    }
    Ok(d)
}
