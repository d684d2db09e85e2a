//! shmstore: one copy of a read-only dataset shared by many processes.
//!
//! Layers (arrows point down): `py` (pyo3 bindings, feature `python`) -> `archive`
//! (value model, builder, reader) and `segment` (named shared memory) and `supervisor`.
//! The three lower layers never import pyo3; `cargo test` needs no Python.

pub mod archive;
pub mod graph;
pub mod segment;
pub mod supervisor;

#[cfg(feature = "python")]
mod py;
