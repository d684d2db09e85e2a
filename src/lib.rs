//! shmstore: one copy of a read-only dataset shared by many processes.
//!
//! Layers (arrows point down): `py` (pyo3 bindings, feature `python`) -> `archive`
//! (value model, builder, reader) and `segment` (named shared memory) and `supervisor`.
//! The three lower layers never import pyo3; `cargo test` needs no Python.

// Crate-private: the crate's only user is its own binding layer (and the unit tests), so
// the compiler reports anything that nothing calls. Without the `python` feature most of
// it has no caller, so dead code is reported only in the full build.
#![cfg_attr(not(feature = "python"), allow(dead_code, unused_imports))]

mod archive;
mod arena;
mod channel;
mod graph;
mod segment;
mod supervisor;

#[cfg(feature = "python")]
mod py;
