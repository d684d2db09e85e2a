//! Free lists for the view types: a view is made and dropped for every container a read
//! passes through, so its allocation is on the hot path. A dropped view's memory is kept
//! (up to `CAP` per type) and handed back to the next view of the same type, without
//! calling the allocator, zeroing or linking it into the collector's lists.
//!
//! pyo3's own `freelist` option guards its list with a mutex, which costs more than the
//! allocation it saves (about 18 ns per view here). These lists are guarded by the GIL
//! instead: `tp_alloc` and `tp_free` run with it held, so only one thread touches a list at a
//! time. On a free-threaded interpreter there is no GIL, so the lists are not installed
//! (`install` checks at run time), nor with the stable ABI (abi3), which hides the type
//! object's slots.
//!
//! Where the lists are installed, instances of these types are also born untracked (the
//! allocator untracks a fresh object at once), so making a view needs no separate untrack
//! call ([`new_view`]), and nothing ever tracks them: a kept object is never in the
//! collector's lists.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::PyClass;

/// Whether `install` put the free lists (and untracked allocation) in place.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A new view or iterator object, untracked by the cyclic GC (as [`super::new_untracked`]):
/// with the free lists installed it is untracked from birth.
#[inline]
pub(crate) fn new_view<T: PyClass>(
    py: Python<'_>,
    value: impl Into<pyo3::PyClassInitializer<T>>,
) -> PyResult<Bound<'_, T>> {
    if INSTALLED.load(Ordering::Relaxed) {
        return Bound::new(py, value);
    }
    super::new_untracked(py, value)
}

#[cfg(not(feature = "abi3"))]
mod imp {
    use std::cell::UnsafeCell;
    use std::os::raw::c_void;
    use std::sync::atomic::Ordering;

    use pyo3::prelude::*;
    use pyo3::{ffi, PyTypeInfo};

    use super::super::{DictIter, DictView, ListIter, ListView};

    /// Dropped views kept per type: enough for the views alive at once in any usual loop
    /// (a record's nested containers), few enough to be negligible memory.
    const CAP: usize = 256;

    pub(super) struct FreeList {
        ty: UnsafeCell<*mut ffi::PyTypeObject>,
        items: UnsafeCell<Vec<*mut ffi::PyObject>>,
    }

    // SAFETY: a list is read and written only by `alloc`/`free` below, which CPython calls
    // with the GIL held (and `install`, also under the GIL, which runs before any of them
    // for this type): the GIL serialises every access. `install` refuses free-threaded
    // interpreters, where there is no GIL.
    unsafe impl Sync for FreeList {}

    impl FreeList {
        const fn new() -> Self {
            FreeList {
                ty: UnsafeCell::new(std::ptr::null_mut()),
                items: UnsafeCell::new(Vec::new()),
            }
        }

        /// # Safety
        /// The GIL is held; `subtype` is a valid type object.
        unsafe fn alloc(
            &self,
            subtype: *mut ffi::PyTypeObject,
            nitems: ffi::Py_ssize_t,
        ) -> *mut ffi::PyObject {
            // SAFETY: the GIL is held (the caller's contract), so nothing else uses the list.
            let (ty, items) = unsafe { (*self.ty.get(), &mut *self.items.get()) };
            if nitems == 0 && std::ptr::eq(subtype, ty) {
                if let Some(obj) = items.pop() {
                    // SAFETY: `obj` is the memory of a dropped instance of exactly this type
                    // (`free` keeps nothing else), released by pyo3's dealloc: its contents
                    // are dropped and it is not tracked by the collector. `PyObject_Init`
                    // sets its type (taking a reference to the heap type, which the dealloc
                    // gives back) and a reference count of 1; pyo3 then writes all of the
                    // contents, as it does after a fresh allocation.
                    return unsafe { ffi::PyObject_Init(obj, subtype) };
                }
            }
            // SAFETY: the generic allocator, as the type had before `install`; the new
            // object is untracked at once (it holds no reference a traversal would need).
            unsafe {
                let obj = ffi::PyType_GenericAlloc(subtype, nitems);
                if !obj.is_null() {
                    ffi::PyObject_GC_UnTrack(obj.cast());
                }
                obj
            }
        }

        /// # Safety
        /// The GIL is held; `obj` is an instance of this list's type whose dealloc has run.
        unsafe fn free(&self, obj: *mut c_void) {
            let obj = obj.cast::<ffi::PyObject>();
            if obj.is_null() {
                return;
            }
            // Not tracked by the collector: born untracked (`alloc`), never tracked since, and
            // pyo3's dealloc untracks before calling here too.
            // SAFETY: the GIL is held (the caller's contract).
            let items = unsafe { &mut *self.items.get() };
            // SAFETY: `Py_TYPE` reads the header; the type is still alive (pyo3's dealloc
            // drops its reference after `tp_free` returns).
            let exact = unsafe { std::ptr::eq(ffi::Py_TYPE(obj), *self.ty.get()) };
            if exact && items.len() < CAP {
                if items.capacity() == 0 {
                    items.reserve_exact(CAP);
                }
                items.push(obj);
                return;
            }
            // SAFETY: the inverse of `PyType_GenericAlloc` for a GC type.
            unsafe { ffi::PyObject_GC_Del(obj.cast()) };
        }
    }

    macro_rules! lists {
        ($($list:ident, $alloc:ident, $free:ident, $t:ty;)*) => {
            $(
                static $list: FreeList = FreeList::new();

                unsafe extern "C" fn $alloc(
                    subtype: *mut ffi::PyTypeObject,
                    nitems: ffi::Py_ssize_t,
                ) -> *mut ffi::PyObject {
                    // SAFETY: CPython calls tp_alloc with the GIL held and a valid type.
                    unsafe { $list.alloc(subtype, nitems) }
                }

                unsafe extern "C" fn $free(obj: *mut c_void) {
                    // SAFETY: CPython (pyo3's dealloc) calls tp_free with the GIL held, on
                    // an instance of a type whose tp_free this is.
                    unsafe { $list.free(obj) }
                }
            )*

            pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
                if free_threaded(py)? {
                    return Ok(());
                }
                $(
                    let ty = <$t as PyTypeInfo>::type_object_raw(py);
                    // SAFETY: the GIL is held and no instance exists yet (this runs in the
                    // module's init, before any view is made), so no alloc or free of this
                    // type is under way. The type is a heap type that pyo3 made for this
                    // module; it is not subclassable, and its allocation and release go
                    // through these two slots only (pyo3 reads them from the type).
                    unsafe {
                        *$list.ty.get() = ty;
                        (*ty).tp_alloc = Some($alloc);
                        (*ty).tp_free = Some($free);
                    }
                )*
                super::INSTALLED.store(true, Ordering::Relaxed);
                Ok(())
            }
        };
    }

    lists! {
        LIST_VIEWS, list_view_alloc, list_view_free, ListView;
        DICT_VIEWS, dict_view_alloc, dict_view_free, DictView;
        LIST_ITERS, list_iter_alloc, list_iter_free, ListIter;
        DICT_ITERS, dict_iter_alloc, dict_iter_free, DictIter;
    }

    /// Whether this interpreter runs without a GIL (then the lists stay off).
    fn free_threaded(py: Python<'_>) -> PyResult<bool> {
        let v = py
            .import("sysconfig")?
            .call_method1("get_config_var", ("Py_GIL_DISABLED",))?;
        v.is_truthy()
    }
}

#[cfg(not(feature = "abi3"))]
pub(crate) use imp::install;

/// The stable ABI hides the slots: views use the generic allocator.
#[cfg(feature = "abi3")]
pub(crate) fn install(_py: pyo3::Python<'_>) -> pyo3::PyResult<()> {
    Ok(())
}
