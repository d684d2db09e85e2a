//! `ArrayOwner`: the `.base` of a zero-copy numpy array over a store's pages.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::archive::value::TypeStr;
use crate::py::store::Store;

/// Owns the mapping behind a numpy array (the array's `.base`). The array is made through
/// numpy's C API (`ndarray.rs`), or where that is not usable by `numpy.asarray`, which reads
/// the data address from `__array_interface__`, marked read-only.
#[pyclass(name = "ArrayOwner", module = "shmstore", frozen, weakref)]
pub(crate) struct ArrayOwner {
    store: Arc<Store>,
    typestr: TypeStr,
    shape: Vec<usize>,
    offset: usize,
}

impl ArrayOwner {
    pub(crate) fn new(
        store: Arc<Store>,
        typestr: TypeStr,
        shape: Vec<usize>,
        offset: usize,
    ) -> Self {
        ArrayOwner {
            store,
            typestr,
            shape,
            offset,
        }
    }

    /// The stored array's type string and shape.
    pub(crate) fn spec(&self) -> (&str, &[usize]) {
        (self.typestr.as_str(), &self.shape)
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
        d.set_item("typestr", self.typestr.as_str())?;
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

    /// The buffer protocol: the stored array's bytes, read-only, as unsigned bytes
    /// (`memoryview(owner)`; what `StoreHandle.archive()` gives for the whole archive). A
    /// writable request is refused (`BufferError`).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        let bytes = me.store.reader.bytes();
        let len = crate::archive::value::typestr_itemsize(me.typestr.as_str())
            .and_then(|size| me.shape.iter().try_fold(size, |n, &d| n.checked_mul(d)))
            .filter(|&n| {
                me.offset
                    .checked_add(n)
                    .is_some_and(|end| end <= bytes.len())
            })
            .and_then(|n| isize::try_from(n).ok());
        let Some(len) = len else {
            return Err(
                me.store.archive_err()(crate::archive::ArchiveError::Corrupt(
                    "an array lies outside the store".into(),
                ))
                .into(),
            );
        };
        // SAFETY: `view` is the caller's Py_buffer to fill (the buffer protocol's
        // contract); the `len` bytes at `data_ptr` lie inside the store's mapping (checked
        // above), which `slf` keeps alive, and `PyBuffer_FillInfo` takes a reference to
        // `slf` into `view.obj` (released by `PyBuffer_Release`). readonly=1: a request
        // for a writable buffer fails there with BufferError.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), me.data_ptr(), len, 1, flags)
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmstore.ArrayOwner {} of {}>",
            self.typestr.as_str(),
            self.store.describe()
        )
    }
}
