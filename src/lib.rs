//! shmstore: one copy of a read-only dataset shared by many processes.
//!
//! Layers, lowest first; each uses only layers before it (`.ci/check-layers` checks it):
//! `process` (pid, the one fork hook and the order of the locks it takes) < `archive`
//! (value model, builder, reader) < `segment` (named shared memory) < `arena` (small
//! objects in chunks) < `channel` (the queue's ring) < `supervisor` (who uses what) <
//! `graph` (the leaks analysis) < `py` (pyo3 bindings, feature `python`).
//! Only `py` imports pyo3; `cargo test` needs no Python.

// Crate-private: the crate's only user is its own binding layer (and the unit tests), so
// the compiler reports anything that nothing calls. Without the `python` feature most of
// it has no caller, so dead code is reported only in the full build.
#![cfg_attr(not(feature = "python"), allow(dead_code, unused_imports))]

mod archive;
mod arena;
mod channel;
mod graph;
mod process;
mod segment;
mod supervisor;

#[cfg(feature = "python")]
mod py;
