//! The functions a pickle of a handle, view or channel names (their inverses, the
//! unpickling functions, are in src/py/pickle.rs and src/py/channel.rs).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// The unpickling functions a pickle of ours names.
#[derive(Clone, Copy)]
pub(crate) enum Rebuild {
    /// `_rebuild` (src/py/pickle.rs): a handle of a segment or file store.
    Handle,
    /// `_rebuild_chunk`: a `Ref` of a chunk of an arena.
    Chunk,
    /// `_rebuild_view`: a view.
    View,
    /// `_rebuild_channel` (src/py/channel.rs): a `Channel`.
    Channel,
}

static REBUILDERS: [PyOnceLock<Py<PyAny>>; 4] = [const { PyOnceLock::new() }; 4];

impl Rebuild {
    fn name(self) -> &'static str {
        match self {
            Rebuild::Handle => "_rebuild",
            Rebuild::Chunk => "_rebuild_chunk",
            Rebuild::View => "_rebuild_view",
            Rebuild::Channel => "_rebuild_channel",
        }
    }

    /// The function, as `shmstore.<name>`: looked up once per process. The package
    /// re-exports each under its own name with `__module__` "shmstore"
    /// (python/shmstore/__init__.py), so a pickle names a top-level module: the pickler's
    /// check and the unpickler's lookup import one module, not a package and its submodule
    /// (CPython's `PyImport_Import`, ~0.1 µs less on each side per pickled handle). Looked up
    /// through the package, as the pickler will, so a missing export fails here, once.
    pub(crate) fn function(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let f = REBUILDERS[self as usize].get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("shmstore")?.getattr(self.name())?.unbind())
        })?;
        Ok(f.bind(py).clone())
    }
}
