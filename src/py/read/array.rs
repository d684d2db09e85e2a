//! `ArrayOwner`: the `.base` of a zero-copy numpy array over a store's pages.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::py::store::Store;

/// Owns the mapping behind a numpy array (the array's `.base`). The array is made through
/// numpy's C API (`ndarray.rs`), or where that is not usable by `numpy.asarray`, which reads
/// the data address from `__array_interface__`, marked read-only.
#[pyclass(name = "ArrayOwner", module = "shmstore", frozen, weakref)]
pub(crate) struct ArrayOwner {
    store: Arc<Store>,
    typestr: String,
    shape: Vec<usize>,
    offset: usize,
}

impl ArrayOwner {
    pub(crate) fn new(store: Arc<Store>, typestr: &str, shape: Vec<usize>, offset: usize) -> Self {
        ArrayOwner {
            store,
            typestr: typestr.to_owned(),
            shape,
            offset,
        }
    }

    /// The stored array's type string and shape.
    pub(crate) fn spec(&self) -> (&str, &[usize]) {
        (&self.typestr, &self.shape)
    }

    /// The address of the stored array's first byte (inside the mapping this owner keeps).
    pub(crate) fn data_ptr(&self) -> *mut std::os::raw::c_void {
        self.store.reader.bytes()[self.offset..].as_ptr() as *mut std::os::raw::c_void
    }
}

#[pymethods]
impl ArrayOwner {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let addr = self.store.reader.bytes().as_ptr() as usize + self.offset;
        d.set_item("version", 3)?;
        d.set_item("typestr", &self.typestr)?;
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        // (address, read_only=True): numpy marks the array non-writeable, and the pages
        // are mapped PROT_READ anyway.
        d.set_item("data", (addr, true))?;
        Ok(d)
    }

    /// (address, length) of the whole mapping the array lies in (`Mapping::extent`),
    /// mapped as long as this owner exists: what `shmstore.torch.pin` registers.
    fn _mapping_extent(&self) -> (usize, usize) {
        self.store.mapping().extent()
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmstore.ArrayOwner {} of {}>",
            self.typestr,
            self.store.describe()
        )
    }
}
