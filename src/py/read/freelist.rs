//! Free lists for the view types: a view is made and dropped for every container a read
//! passes through, so its allocation is on the hot path. A dropped view's memory is kept
//! (up to `CAP` per type) and handed back to the next view of the same type, without
//! calling the allocator, zeroing or linking it into the collector's lists.
//!
//! pyo3's own `freelist` option guards its list with a mutex, which costs more than the
//! allocation it saves (about 18 ns per view here). These lists are guarded by the GIL
//! instead: `tp_alloc` and `tp_free` run with it held, so only one thread touches a list at a
//! time. On a free-threaded interpreter there is no GIL: there these lists stay unused
//! (`install` checks at run time; `RECYCLE` stays off) and each thread recycles its own
//! views instead, in lists per thread (`thread_lists`), on the direct path below. With the
//! stable ABI (abi3), which hides the type object's slots, none of this is installed.
//!
//! Where the lists are installed, instances of these types are also born untracked (the
//! allocator untracks a fresh object at once), so making a view needs no separate untrack
//! call ([`new_view`]), and nothing ever tracks them: a kept object is never in the
//! collector's lists.
//!
//! A kept object keeps its type and its reference to the type, so reusing one is a single
//! reference-count increment rather than `PyObject_Init` (a call into the interpreter that
//! sets the type, takes a reference to it and updates tracemalloc's trace of the memory:
//! with tracemalloc on, a recycled view keeps the trace of its memory's first allocation).
//!
//! Making and dropping a view is also done here rather than by pyo3's generic path, which
//! calls `object.__new__` with an empty argument tuple and enters a trampoline (thread-local
//! counters, a panic guard) for every dealloc: together about a third of the cost of
//! `view[k]`. `new_view` writes the value straight into a recycled object and the types'
//! `tp_dealloc` is ours. Both rely on where pyo3 puts the value inside the object, which is
//! not a public interface: the direct path writes at offsets fixed at compile time
//! (`Layout::expected`: the object is exactly its header, the value and, for a class
//! declared with `weakref` (`recycled!`'s `weakref`), the weak-reference list, in that
//! order), and module init checks them against each type object's size and weak-reference
//! slot (`Layout::of_type`) before it turns the direct path on. A type whose layout differs
//! keeps pyo3's path, and that is reported (`direct.<type>` in `_fast_paths()`, a warning at
//! import: src/py/read/fastpaths.rs), never silent. The direct path needs no GIL: on a
//! free-threaded interpreter it is on as well, recycling through the lists per thread.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::PyClass;

use super::StoreRef;

/// Whether `install` put the types' allocation (untracked from birth, and the direct path
/// where the layout is known) in place.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Whether dropped objects are kept for reuse: only where the GIL serialises the lists (set
/// by `install` before any object exists, never cleared).
#[cfg(not(feature = "abi3"))]
static RECYCLE: AtomicBool = AtomicBool::new(false);

/// What a recycled type's value holds that needs releasing: its store (the rest is plain
/// data).
pub(crate) trait HoldsStore {
    /// The store reference, taken out as the value is dropped (by our dealloc, which the
    /// stable ABI build does not have).
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    fn into_store(self) -> StoreRef;
}

/// A view or iterator type whose objects are recycled (implemented by `lists!`).
pub(crate) trait Recycled:
    PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync + HoldsStore
{
    /// Whether the class is declared with `weakref` (its objects then end with a weak-reference
    /// list): part of the layout the direct path writes, checked against the type object at
    /// install (`Layout::of_type`).
    #[cfg_attr(feature = "abi3", allow(dead_code))] // the stable ABI has no direct path
    const WEAKREF: bool;

    /// The value as pyo3's initializer, for the generic path.
    fn init(self) -> pyo3::PyClassInitializer<Self>;

    #[cfg(not(feature = "abi3"))]
    #[doc(hidden)]
    fn list() -> &'static imp::FreeList;
}

/// A new view or iterator object, untracked by the cyclic GC (as [`super::new_untracked`]):
/// with the free lists installed it is untracked from birth, and made without pyo3's
/// generic path once the type's layout is known.
#[inline(always)]
pub(crate) fn new_view<T: Recycled>(py: Python<'_>, value: T) -> PyResult<Bound<'_, T>> {
    if INSTALLED.load(Ordering::Relaxed) {
        #[cfg(not(feature = "abi3"))]
        {
            // SAFETY: the lists are installed; with a GIL it serialises every use of them,
            // and without one (free-threaded) no thread touches the global lists' items
            // (`RECYCLE` is off): `make` uses this thread's own (`thread_lists`).
            return unsafe { T::list().make(py, value) };
        }
        #[allow(unreachable_code)]
        return Bound::new(py, value.init());
    }
    super::new_untracked(py, value.init())
}

/// A new view or iterator object holding `value()`, made from an object its free list (or,
/// free-threaded, the thread's own list) kept, with nothing that can fail (for the tiny
/// read paths, `read::slots::FastGet::tiny_get`): `None`, with nothing done and `value` not
/// called, when there is none to take or the lists are not in use (a layout that is not the
/// expected one); the caller's whole way then makes it as usual.
#[cfg(not(feature = "abi3"))]
#[inline(always)]
pub(crate) fn kept_view<T: Recycled>(
    _py: Python<'_>,
    value: impl FnOnce() -> T,
) -> Option<*mut pyo3::ffi::PyObject> {
    // SAFETY: the thread is attached (`_py`) and `T::list()` is `T`'s list.
    unsafe { T::list().make_kept(value) }
}

/// [`kept_view`] of a value that holds `store`, a reference counted for it: given back
/// (a plain decrement) when no view is made.
#[cfg(not(feature = "abi3"))]
#[inline(always)]
pub(crate) fn kept_view_holding<T: Recycled>(
    py: Python<'_>,
    store: StoreRef,
    value: impl FnOnce(StoreRef) -> T,
) -> Option<*mut pyo3::ffi::PyObject> {
    let mut store = std::mem::ManuallyDrop::new(store);
    let made = kept_view(py, || {
        // SAFETY: `store` is taken out at most once, here, when `make_kept` calls this,
        // and only then: it returns `None` without calling it.
        value(unsafe { std::mem::ManuallyDrop::take(&mut store) })
    });
    if made.is_none() {
        // SAFETY: not taken (above); the thread is attached (`py`).
        unsafe { std::mem::ManuallyDrop::into_inner(store).release() };
    }
    made
}

#[cfg(not(feature = "abi3"))]
pub(crate) mod imp {
    use std::cell::UnsafeCell;
    use std::os::raw::c_void;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use pyo3::prelude::*;
    use pyo3::{ffi, PyTypeInfo};

    use super::super::thread_lists;
    use super::super::{DictIter, DictView, ListIter, ListView};
    use super::Recycled;

    /// The next type's slot in the lists per thread (`thread_lists`), given out by
    /// `install_type`.
    static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

    /// A type without a slot in the lists per thread.
    const NO_SLOT: usize = usize::MAX;

    /// Whether this build is for a free-threaded interpreter, known when compiling: its
    /// object header is larger (the owning thread and two counts, 32 bytes, against 16).
    /// The lists per thread are compiled only there, so that the paths with a GIL carry
    /// no branch for them (the run-time check, `RECYCLE`, still decides).
    pub(crate) const FT_BUILD: bool = std::mem::size_of::<ffi::PyObject>() > 16;

    /// Dropped views kept per type: enough for the views alive at once in any usual loop
    /// (a record's nested containers), few enough to be negligible memory.
    const CAP: usize = 256;

    /// Where a type's value and weak-reference list sit inside its objects (bytes from the
    /// object's start; `weak` is 0 for a type without weak references).
    #[derive(Clone, Copy)]
    struct Layout {
        value: usize,
        weak: usize,
    }

    impl Layout {
        /// Write the contents of a new object of `T` at `obj`: `value` and, for a type
        /// with weak references, the list set empty, the only other field. The object is
        /// then complete, as pyo3 would have made it.
        ///
        /// # Safety
        /// `obj` is a new object of `T`'s type (its header set, one reference) and `self`
        /// is `T`'s layout, checked against its type at init (`Layout::of_type`).
        #[inline(always)]
        unsafe fn fill<T>(self, obj: *mut ffi::PyObject, value: T) {
            // SAFETY: the caller's contract: both fields are inside the object.
            unsafe {
                let base = obj.cast::<u8>();
                base.add(self.value).cast::<T>().write(value);
                if self.weak != 0 {
                    base.add(self.weak)
                        .cast::<*mut ffi::PyObject>()
                        .write(std::ptr::null_mut());
                }
            }
        }

        /// Where `T`'s objects hold their value and weak-reference list, as this module
        /// relies on: the object is its header, the value right after it and (for a class
        /// with weak references) the list pointer right after the value, with nothing else
        /// (pyo3 0.30's `#[repr(C)]` object for a frozen, `Sync` class without `__dict__`).
        /// A constant, so the direct path's reads and writes have fixed offsets; whether the
        /// type object agrees is checked once, at install (`of_type`).
        #[inline(always)]
        const fn expected<T: Recycled>() -> Layout {
            let value = std::mem::size_of::<ffi::PyObject>();
            Layout {
                value,
                weak: if T::WEAKREF {
                    value + std::mem::size_of::<T>()
                } else {
                    0
                },
            }
        }

        /// Whether `T`'s type object has the layout of [`Self::expected`]: its size, its
        /// weak-reference slot and the value's alignment; what differs otherwise.
        ///
        /// # Safety
        /// The GIL is held and `ty` is `T`'s live type object.
        unsafe fn of_type<T: Recycled>(ty: *mut ffi::PyTypeObject) -> Result<(), String> {
            // SAFETY: `ty` is a live type object (the caller's contract).
            let (size, weak) = unsafe { ((*ty).tp_basicsize, (*ty).tp_weaklistoffset) };
            let want = Self::expected::<T>();
            let t = std::mem::size_of::<T>();
            let word = std::mem::size_of::<usize>();
            let want_size = want.value + t + if T::WEAKREF { word } else { 0 };
            let aligned = std::mem::align_of::<T>() <= std::mem::align_of::<ffi::PyObject>();
            if aligned
                && usize::try_from(size).ok() == Some(want_size)
                && usize::try_from(weak).ok() == Some(want.weak)
            {
                return Ok(());
            }
            Err(format!(
                "unexpected object layout: tp_basicsize {size} (expected {want_size}), \
                 tp_weaklistoffset {weak} (expected {}), value {t} bytes aligned to {}",
                want.weak,
                std::mem::align_of::<T>()
            ))
        }
    }

    /// The dropped objects a list keeps: `objs[..len]`, the last kept given out first. A
    /// fixed array in the list's static (2 KiB), so keeping and taking one are a compare and
    /// a store or load, with no capacity to check or grow.
    struct Kept {
        len: usize,
        objs: [*mut ffi::PyObject; CAP],
    }

    impl Kept {
        #[inline(always)]
        fn pop(&mut self) -> Option<*mut ffi::PyObject> {
            let len = self.len.checked_sub(1)?;
            let obj = *self.objs.get(len)?;
            self.len = len;
            Some(obj)
        }
    }

    /// `FreeList::mode`: the layout is not the expected one; pyo3's path makes and drops
    /// the objects.
    const DIRECT_OFF: u8 = 0;
    /// Made and dropped directly (`make`, `dealloc`), dropped objects kept in the type's
    /// list (with a GIL: `RECYCLE`).
    const DIRECT_GLOBAL: u8 = 1;
    /// Made and dropped directly, dropped objects kept by each thread (free-threaded: the
    /// type has a slot in the lists per thread).
    const DIRECT_THREAD: u8 = 2;
    /// Made and dropped directly, dropped objects freed (free-threaded, no lists per thread).
    const DIRECT_ONLY: u8 = 3;

    pub(crate) struct FreeList {
        ty: UnsafeCell<*mut ffi::PyTypeObject>,
        items: UnsafeCell<Kept>,
        /// How objects of the type are made and dropped (`DIRECT_*`), set by `install`:
        /// whether the layout is the expected one (`Layout::expected`; if not, pyo3's path)
        /// and where dropped objects are kept. One value, so the tiny read paths and the
        /// dealloc decide with one load.
        mode: UnsafeCell<u8>,
        /// The type's list in each thread's lists (free-threaded, direct path only), or
        /// `NO_SLOT`; set by `install` like `mode`.
        slot: UnsafeCell<usize>,
    }

    // SAFETY: `ty` and `mode` are written only by `install`, during the module's init,
    // before any object of the type exists (the type is not reachable from Python code yet),
    // and only read afterwards. `items` is read and written only by `alloc`, `free`, `make`
    // and the type's dealloc below, and only while `RECYCLE` is on, which `install` sets
    // only on an interpreter with a GIL: there they run with the GIL held (CPython calls
    // tp_alloc, tp_free and tp_dealloc with it; `make` is called with it), which serialises
    // every access. On a free-threaded interpreter no thread touches `items` (`alloc` and
    // `keep` check `RECYCLE` first); `slot` is set at install like `mode`.
    unsafe impl Sync for FreeList {}

    impl FreeList {
        pub(crate) const fn new() -> Self {
            FreeList {
                ty: UnsafeCell::new(std::ptr::null_mut()),
                items: UnsafeCell::new(Kept {
                    len: 0,
                    objs: [std::ptr::null_mut(); CAP],
                }),
                mode: UnsafeCell::new(DIRECT_OFF),
                slot: UnsafeCell::new(NO_SLOT),
            }
        }

        /// A new object of `T` holding `value`.
        ///
        /// # Safety
        /// The thread is attached (holds the GIL where there is one) and the lists are
        /// installed; `self` is `T`'s list.
        #[inline(always)]
        pub(crate) unsafe fn make<'py, T: Recycled>(
            &self,
            py: Python<'py>,
            value: T,
        ) -> PyResult<Bound<'py, T>> {
            // SAFETY: written only at install, before any object exists (see `Sync`).
            let (ty, mode) = unsafe { (*self.ty.get(), *self.mode.get()) };
            if mode == DIRECT_OFF {
                // SAFETY: as above.
                return unsafe { self.make_slow(py, value) };
            }
            // SAFETY: the thread is attached and `ty` is `T`'s type (set by `install`).
            let obj = unsafe { self.alloc_direct(ty, mode) };
            if obj.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: `obj` is a new object of `T`'s type with a reference count of 1,
            // either fresh from the generic allocator (zeroed) or recycled by `dealloc`
            // below (its value moved out, its weak-reference list cleared), and the type's
            // layout is the expected one (`mode`).
            unsafe {
                Layout::expected::<T>().fill(obj, value);
                Ok(Bound::from_owned_ptr(py, obj).cast_into_unchecked())
            }
        }

        /// A new object of `T` holding `value()`, made from a kept object with no call
        /// beyond `PyObject_Init` (for the tiny read paths, `read::slots::FastGet::tiny_get`,
        /// which must neither fail nor panic): with a GIL one this list kept (a reference
        /// count increment makes it new), without one (free-threaded) one this thread kept
        /// (`thread_lists`, initialised as `alloc_direct` does). `None`, with nothing done
        /// and `value` not called, when the layout is not the expected one or none is kept.
        /// The new reference otherwise.
        ///
        /// # Safety
        /// The thread is attached; `self` is `T`'s list.
        #[inline(always)]
        pub(crate) unsafe fn make_kept<T: Recycled>(
            &self,
            value: impl FnOnce() -> T,
        ) -> Option<*mut ffi::PyObject> {
            // SAFETY: written only at install, before any object exists (see `Sync`).
            let mode = unsafe { *self.mode.get() };
            let obj = if mode == DIRECT_GLOBAL {
                // SAFETY: recycling is on, so the GIL is held (the thread is attached) and
                // it serialises every use of the list. `obj` is a kept object of exactly
                // `T`'s type, as `alloc` hands one out: one increment makes it a fresh
                // object holding its type.
                unsafe {
                    let obj = (*self.items.get()).pop()?;
                    ffi::Py_INCREF(obj);
                    obj
                }
            } else if FT_BUILD && mode == DIRECT_THREAD {
                // SAFETY: written only at install (see `Sync`).
                let slot = unsafe { *self.slot.get() };
                // SAFETY: as in `alloc_direct`: a slot is set only with the lists per
                // thread on and is below `thread_lists::TYPES`; the thread is attached; the
                // object popped is the memory of a dropped object of exactly `T`'s type,
                // which `PyObject_Init` (never failing for a non-null object) makes new.
                // `DIRECT_THREAD` is set only with a slot.
                unsafe { ffi::PyObject_Init(thread_lists::pop(slot)?, *self.ty.get()) }
            } else {
                return None;
            };
            // SAFETY: `obj` is a new object of `T`'s type with one reference, and the type's
            // layout is the expected one (`mode` is not `DIRECT_OFF`).
            unsafe { Layout::expected::<T>().fill(obj, value()) };
            Some(obj)
        }

        /// An object made by pyo3's generic path: for a type whose layout is not the
        /// expected one (reported at init), still allocated by `alloc` (born untracked).
        ///
        /// # Safety
        /// As `make`.
        #[cold]
        #[inline(never)]
        unsafe fn make_slow<'py, T: Recycled>(
            &self,
            py: Python<'py>,
            value: T,
        ) -> PyResult<Bound<'py, T>> {
            Bound::new(py, value.init())
        }

        /// A new object for the direct path (`make`): on a free-threaded interpreter one
        /// this thread kept (`thread_lists`), initialised as a fresh object, else as `alloc`.
        ///
        /// # Safety
        /// The thread is attached (holds the GIL where there is one); `ty` is this list's
        /// type, its layout is known (the direct path is installed) and `mode` is its `mode`.
        #[inline(always)]
        unsafe fn alloc_direct(&self, ty: *mut ffi::PyTypeObject, mode: u8) -> *mut ffi::PyObject {
            if FT_BUILD && mode == DIRECT_THREAD {
                // SAFETY: written only at install (see `Sync`); `DIRECT_THREAD` is set only
                // with a slot.
                let slot = unsafe { *self.slot.get() };
                // SAFETY: a slot is set only with the lists per thread on, and is below
                // `thread_lists::TYPES`; the thread is attached.
                if let Some(obj) = unsafe { thread_lists::pop(slot) } {
                    // SAFETY: `obj` is the memory of a dropped object of exactly this type
                    // (only our dealloc keeps objects there, each under its type's slot):
                    // its value dropped, weak references cleared, untracked, holding no
                    // reference to its type. `PyObject_Init` makes it a new object with one
                    // reference (this thread its owner, the type set and referenced, as
                    // `PyType_GenericAlloc` would); `make` writes all of its contents.
                    return unsafe { ffi::PyObject_Init(obj, ty) };
                }
            }
            // SAFETY: the caller's contract.
            unsafe { self.alloc(ty, 0) }
        }

        /// # Safety
        /// The thread is attached (holds the GIL where there is one); `subtype` is a valid
        /// type object.
        #[inline(always)]
        unsafe fn alloc(
            &self,
            subtype: *mut ffi::PyTypeObject,
            nitems: ffi::Py_ssize_t,
        ) -> *mut ffi::PyObject {
            // SAFETY: written only at install (see `Sync`).
            let ty = unsafe { *self.ty.get() };
            if nitems == 0 && std::ptr::eq(subtype, ty) && super::RECYCLE.load(Ordering::Relaxed) {
                // SAFETY: recycling is on, so the GIL is held (the caller's contract) and
                // nothing else uses the list.
                let items = unsafe { &mut *self.items.get() };
                if let Some(obj) = items.pop() {
                    // SAFETY: `obj` is the memory of a dropped instance of exactly this type
                    // (`keep` holds nothing else), released by a dealloc: its value is
                    // dropped, it is not tracked by the collector, its type is still set and
                    // the reference to the type that it held alive stayed with it while it
                    // was kept (`keep`). Its reference count is 0 since its dealloc; one
                    // increment makes it the single reference that a fresh object has, which
                    // with the type is all `PyObject_Init` would set (on an interpreter with
                    // a GIL; `install` refuses the others). The caller then writes all of the
                    // contents, as after a fresh allocation.
                    unsafe { ffi::Py_INCREF(obj) };
                    return obj;
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

        /// Keep `obj` for a later `alloc` if there is room; the caller frees it otherwise.
        /// A kept object holds on to a reference to its type, which `alloc` hands to the
        /// object it becomes: setting up a recycled object is then a reference-count
        /// increment, with no call into the interpreter.
        ///
        /// # Safety
        /// The thread is attached (holds the GIL where there is one); `obj` is an instance
        /// of this list's type whose dealloc has run (the value is dropped) and which holds
        /// a reference to its type.
        #[inline(always)]
        unsafe fn keep(&self, obj: *mut ffi::PyObject) -> bool {
            // Nothing is kept without a GIL (see `Sync`): checked before the list is touched.
            if !super::RECYCLE.load(Ordering::Relaxed) {
                return false;
            }
            // SAFETY: `Py_TYPE` reads the header of a live allocation.
            let exact = unsafe { std::ptr::eq(ffi::Py_TYPE(obj), *self.ty.get()) };
            // SAFETY: recycling is on and the type exact: the caller's contract is `keep_own`'s.
            exact && unsafe { self.keep_own(obj) }
        }

        /// `keep` for an object known to be of exactly this list's type, with recycling on.
        ///
        /// # Safety
        /// As `keep`, and `RECYCLE` is on (so the GIL is held) and `obj`'s type is exactly
        /// this list's.
        #[inline(always)]
        unsafe fn keep_own(&self, obj: *mut ffi::PyObject) -> bool {
            // Not tracked by the collector: born untracked (`alloc`), never tracked since, and
            // pyo3's dealloc untracks before calling `free` too.
            // SAFETY: recycling is on, so the GIL is held (the caller's contract) and
            // serialises every use of the list.
            let items = unsafe { &mut *self.items.get() };
            let Some(at) = items.objs.get_mut(items.len) else {
                return false;
            };
            *at = obj;
            items.len += 1;
            true
        }

        /// `tp_free` (pyo3's dealloc calls it, then releases the type).
        ///
        /// # Safety
        /// The thread is attached (holds the GIL where there is one); `obj` is an instance
        /// of this list's type whose dealloc has run.
        #[inline(always)]
        unsafe fn free(&self, obj: *mut c_void) {
            let obj = obj.cast::<ffi::PyObject>();
            if obj.is_null() {
                return;
            }
            // SAFETY: the thread is attached; `obj` is a released instance of this type. A kept
            // object holds a reference to its type (`keep`); pyo3's dealloc gives back the
            // object's own after this returns, so the kept one is taken here (the type is
            // alive: the object's reference to it is not given back yet).
            unsafe {
                let ty = ffi::Py_TYPE(obj);
                if self.keep(obj) {
                    ffi::Py_INCREF(ty.cast());
                    return;
                }
                // The inverse of `PyType_GenericAlloc` for a GC type.
                ffi::PyObject_GC_Del(obj.cast());
            }
        }
    }

    /// `tp_dealloc` of a recycled type once its layout is known: what pyo3's dealloc does
    /// for it (clear weak references, drop the value, free the memory, release the type),
    /// without its trampoline. Nothing here can panic.
    unsafe extern "C" fn dealloc<T: Recycled>(obj: *mut ffi::PyObject) {
        let list = T::list();
        // SAFETY: CPython calls tp_dealloc on an attached thread (with the GIL held where
        // there is one), on an object of `T`'s type
        // whose reference count reached 0; the type's layout is known (this dealloc is
        // installed only then, and never removed), so the value and the weak-reference
        // list are where `layout` says. The value is moved out once and the memory goes
        // back to the list (or the allocator) before anything that could run Python code
        // (the store's release, the type's) happens. The store reference is released by a
        // plain decrement: no pyo3 code runs here that would defer it.
        unsafe {
            let layout = Layout::expected::<T>();
            let base = obj.cast::<u8>();
            if layout.weak != 0
                && !base
                    .add(layout.weak)
                    .cast::<*mut ffi::PyObject>()
                    .read()
                    .is_null()
            {
                ffi::PyObject_ClearWeakRefs(obj);
            }
            let value = base.add(layout.value).cast::<T>().read();
            // Kept in the global list (with a GIL: `DIRECT_GLOBAL` is set only with
            // recycling on): the object keeps its reference to the type (`keep`), so that
            // is all. The object is exactly `T` (this dealloc is `T`'s only, and `T` has no
            // subclasses).
            let mode = *list.mode.get();
            if mode == DIRECT_GLOBAL && list.keep_own(obj) {
                value.into_store().release();
                return;
            }
            // Kept by this thread (free-threaded; `DIRECT_THREAD` is set only with a slot):
            // memory only. Kept so or freed, the object's reference to its type is given back.
            let ty = ffi::Py_TYPE(obj);
            let kept =
                FT_BUILD && mode == DIRECT_THREAD && thread_lists::keep(*list.slot.get(), obj);
            if !kept {
                ffi::PyObject_GC_Del(obj.cast());
            }
            value.into_store().release();
            ffi::Py_DECREF(ty.cast());
        }
    }

    /// `tp_alloc` of a recycled type.
    unsafe extern "C" fn alloc<T: Recycled>(
        subtype: *mut ffi::PyTypeObject,
        nitems: ffi::Py_ssize_t,
    ) -> *mut ffi::PyObject {
        // SAFETY: CPython calls tp_alloc on an attached thread, with a valid type.
        unsafe { T::list().alloc(subtype, nitems) }
    }

    /// `tp_free` of a recycled type.
    unsafe extern "C" fn free<T: Recycled>(obj: *mut c_void) {
        // SAFETY: CPython (pyo3's dealloc) calls tp_free on an attached thread, on an instance
        // of a type whose tp_free this is.
        unsafe { T::list().free(obj) }
    }

    /// Without a GIL: give `T` a slot in every thread's lists (recycled by each thread on
    /// the direct path, so only if `direct` is on); why not, otherwise.
    ///
    /// # Safety
    /// As `install_type`.
    unsafe fn give_slot<T: Recycled>(direct: bool) -> Result<(), String> {
        if !direct {
            return Err("off: recycled per thread on the direct path only, which is off".into());
        }
        if !FT_BUILD {
            return Err("off: a free-threaded interpreter, but not a build for one".into());
        }
        if !thread_lists::on() {
            return Err(thread_lists::why_off());
        }
        let slot = NEXT_SLOT.fetch_add(1, Ordering::Relaxed);
        if slot >= thread_lists::TYPES {
            return Err(format!(
                "off: more than {} recycled types",
                thread_lists::TYPES
            ));
        }
        // SAFETY: written before any object of `T` exists and only read afterwards (the
        // caller's contract; see `Sync`).
        unsafe { *T::list().slot.get() = slot };
        Ok(())
    }

    /// Put `T`'s free list in place (its `tp_alloc` and `tp_free`), and with them our
    /// direct path (`make`, our dealloc) if `T`'s layout is the expected one; reported as
    /// `freelist.<type>` (objects recycled: with a GIL, or per thread without one) and
    /// `direct.<type>` (the layout).
    ///
    /// # Safety
    /// The thread is attached, `RECYCLE` and the lists per thread are set up as they stay
    /// (by `install`) and no instance of `T` exists yet (module init), so no alloc, free or
    /// dealloc of this type is under way and no other thread can reach the type.
    pub(crate) unsafe fn install_type<T: Recycled>(py: Python<'_>) {
        let ty = <T as PyTypeInfo>::type_object_raw(py);
        // SAFETY: the thread is attached and `ty` is `T`'s live type object.
        let layout = unsafe { Layout::of_type::<T>(ty) };
        // SAFETY: the caller's contract. The type is a heap type that pyo3 made for this
        // module; it is not subclassable, and its allocation and release go through these
        // slots only (pyo3 reads them from the type). Our dealloc goes in only with the
        // layout checked above, for every object of the type (none was made before).
        unsafe {
            *T::list().ty.get() = ty;
            (*ty).tp_alloc = Some(alloc::<T>);
            (*ty).tp_free = Some(free::<T>);
        }
        let recycled = if super::RECYCLE.load(Ordering::Relaxed) {
            Ok(())
        } else {
            // SAFETY: as above (module init, no instance yet).
            unsafe { give_slot::<T>(layout.is_ok()) }
        };
        if layout.is_ok() {
            let mode = if super::RECYCLE.load(Ordering::Relaxed) {
                DIRECT_GLOBAL
            } else if recycled.is_ok() {
                DIRECT_THREAD
            } else {
                DIRECT_ONLY
            };
            // SAFETY: as above; our dealloc goes in with the mode that it reads set.
            unsafe {
                *T::list().mode.get() = mode;
                (*ty).tp_dealloc = Some(dealloc::<T>);
            }
        }
        let name = std::any::type_name::<T>()
            .rsplit("::")
            .next()
            .unwrap_or("?");
        super::super::fastpaths::report(format!("freelist.{name}"), recycled);
        super::super::fastpaths::report(format!("direct.{name}"), layout);
    }

    super::recycled! {
        LIST_VIEWS: ListView, weakref;
        DICT_VIEWS: DictView, weakref;
        LIST_ITERS: ListIter;
        DICT_ITERS: DictIter;
    }

    /// Install the free lists of the view types, and of the types that `more` installs
    /// (with [`install_type`]: the handles' iterators, which this layer does not name), then
    /// the views' fast slots. On a free-threaded interpreter the same, recycling in lists
    /// per thread (see the module's text), and each thread reads through a handle with a
    /// store reference of its own; the types of what reads make are made immortal.
    pub(crate) fn install(py: Python<'_>, more: &[unsafe fn(Python<'_>)]) -> PyResult<()> {
        use super::super::fastpaths::report;
        use super::super::slots;
        if free_threaded(py)? {
            super::super::set_per_thread();
            thread_lists::init();
            let types = [
                ListView::type_object(py),
                DictView::type_object(py),
                ListIter::type_object(py),
                DictIter::type_object(py),
                super::super::owner::StoreCell::type_object(py),
            ];
            report(IMMORTAL_TYPES, immortal_types(py, &types));
        } else {
            super::RECYCLE.store(true, Ordering::Relaxed);
        }
        // SAFETY: the thread is attached, `RECYCLE` is set for good (above) and no instance
        // exists yet (this runs in the module's init, before any view is made).
        unsafe {
            install_type::<ListView>(py);
            install_type::<DictView>(py);
            install_type::<ListIter>(py);
            install_type::<DictIter>(py);
            for f in more {
                f(py);
            }
        }
        super::INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: the thread is attached and no instance exists yet (module init), so no
        // other thread can call these slots yet. None of these types is subclassable.
        unsafe {
            report("slots.ListView.subscript", slots::install::<ListView>(py));
            report("slots.DictView.subscript", slots::install::<DictView>(py));
            report("slots.ListView.len", slots::install_len::<ListView>(py));
            report("slots.DictView.len", slots::install_len::<DictView>(py));
            report("slots.ListView.iter", slots::install_iter::<ListView>(py));
            report("slots.DictView.iter", slots::install_iter::<DictView>(py));
            report("slots.ListIter.next", slots::install_next::<ListIter>(py));
            report("slots.DictIter.next", slots::install_next::<DictIter>(py));
            report("slots.int_index", slots::install_int_index(py));
        }
        Ok(())
    }

    /// On a free-threaded interpreter, the name under which `_fast_paths()` reports
    /// whether the view types were made immortal.
    pub(crate) const IMMORTAL_TYPES: &str = "freethreaded.immortal_view_types";

    /// Free-threaded interpreter: make the types of the objects a read makes (views, their
    /// iterators, the store references) immortal. Every object holds a reference to its
    /// type, and pyo3's dealloc gives it back with a plain `Py_DECREF`, which other threads
    /// than the type's owner make with an atomic add on the type object's header, where the
    /// interpreter also reads the instance size at every allocation: threads making views
    /// in parallel took turns at that cache line (in `perf`, 28% of a two-thread read loop
    /// on one load of the type's size). An immortal object's count is never written. The
    /// types live as long as the module anyway (pyo3 keeps them in statics). CPython has no
    /// public call for it: `_Py_SetImmortal` (3.12+) is looked up at run time, and the
    /// result checked with `sys._is_immortal`; either failing is reported, not fatal.
    fn immortal_types(
        py: Python<'_>,
        types: &[Bound<'_, pyo3::types::PyType>],
    ) -> Result<(), String> {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks the symbol up.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_Py_SetImmortal".as_ptr()) };
        if sym.is_null() {
            return Err("off: this interpreter does not export _Py_SetImmortal".into());
        }
        // SAFETY: the symbol is CPython's `void _Py_SetImmortal(PyObject *)` (3.12-3.14).
        let set: unsafe extern "C" fn(*mut ffi::PyObject) = unsafe { std::mem::transmute(sym) };
        let check = py
            .import("sys")
            .and_then(|m| m.getattr("_is_immortal"))
            .map_err(|e| format!("off: no sys._is_immortal to check with ({e})"))?;
        for ty in types {
            // SAFETY: the thread is attached and `ty` is a live type object that lives as
            // long as the process (a pyo3 class's type, kept in a static).
            unsafe { set(ty.as_ptr()) };
            let done = check
                .call1((ty,))
                .and_then(|v| v.is_truthy())
                .unwrap_or(false);
            if !done {
                return Err(format!(
                    "off: {} did not become immortal",
                    ty.name().map(|n| n.to_string()).unwrap_or_default()
                ));
            }
        }
        Ok(())
    }

    /// Whether this interpreter is a free-threaded build (then the lists stay off): its ABI
    /// flags hold a `t`, as `sysconfig`'s `Py_GIL_DISABLED` says (importing `sysconfig`
    /// would cost a fresh process ~3 ms).
    fn free_threaded(py: Python<'_>) -> PyResult<bool> {
        let flags = py.import("sys")?.getattr("abiflags");
        if let Ok(flags) = flags.and_then(|f| f.extract::<String>()) {
            return Ok(flags.contains('t'));
        }
        py.import("sysconfig")?
            .call_method1("get_config_var", ("Py_GIL_DISABLED",))?
            .is_truthy()
    }
}

#[cfg(not(feature = "abi3"))]
pub(crate) use imp::{install, install_type, FreeList, FT_BUILD};

/// Make each `$t` a [`Recycled`] type with a free list of its own (the static `$list`),
/// put in place by [`install`] (through [`install_type`]). Used here for the views and by
/// `handles` for its iterators, which this layer does not name.
macro_rules! recycled {
    ($($list:ident: $t:ty $(, $weak:ident)?);* $(;)?) => {
        $(
            #[cfg(not(feature = "abi3"))]
            static $list: $crate::py::read::FreeList = $crate::py::read::FreeList::new();

            impl $crate::py::read::Recycled for $t {
                const WEAKREF: bool = $crate::py::read::recycled!(@weakref $($weak)?);

                #[inline(always)]
                fn init(self) -> pyo3::PyClassInitializer<Self> {
                    self.into()
                }

                #[cfg(not(feature = "abi3"))]
                #[inline(always)]
                fn list() -> &'static $crate::py::read::FreeList {
                    &$list
                }
            }
        )*
    };
    (@weakref weakref) => {
        true
    };
    (@weakref) => {
        false
    };
}
pub(crate) use recycled;

#[cfg(feature = "abi3")]
recycled! {
    LIST_VIEWS: super::ListView, weakref;
    DICT_VIEWS: super::DictView, weakref;
    LIST_ITERS: super::ListIter;
    DICT_ITERS: super::DictIter;
}

/// The stable ABI hides the slots: views use the generic allocator.
#[cfg(feature = "abi3")]
pub(crate) fn install(
    _py: pyo3::Python<'_>,
    _more: &[unsafe fn(pyo3::Python<'_>)],
) -> pyo3::PyResult<()> {
    for name in super::fastpaths::NAMES {
        super::fastpaths::report(*name, Err(super::fastpaths::ABI3.to_owned()));
    }
    Ok(())
}
