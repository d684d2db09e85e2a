//! Free lists per thread, for a free-threaded interpreter: there no GIL serialises the
//! global lists of `freelist`, so each thread keeps the views it dropped in lists of its own
//! and hands them to the next views it makes. Making and dropping a view then skips the
//! allocator, the zeroing and the collector's bookkeeping there too (about 160 of the ~850
//! instructions of `ann["bbox"]` on 3.14t, callgrind).
//!
//! What a thread's lists hold is memory only: objects whose dealloc has run (the value
//! dropped, weak references cleared, untracked, no reference to their type kept). Reusing
//! one is `PyObject_Init`, as CPython's own free lists of a free-threaded build do: it sets
//! the owning thread, the reference counts and the type, and tells a reference tracer of a
//! new object, so nothing of the object's previous life (its owner thread, its shared
//! count) survives. Such an object is never seen by the collector: untracked objects are
//! skipped by every pass of the free-threaded collector (it only counts their blocks).
//!
//! Finding the thread's lists is one `pthread_getspecific` (a few instructions; a Rust
//! thread-local in a shared object is a call to the dynamic linker's `__tls_get_addr`, and
//! its destructor may run after the thread's Python state is gone). Ending a thread needs
//! no Python: the key's destructor puts its lists, objects and all, into a pool (atomic
//! slots, no lock: a fork can never find it held). A thread's first read takes lists from
//! there if any and frees the objects in them (it is attached then), then fills them with
//! its own: a thread must not reuse an ended thread's objects, whose pages the allocator
//! may have handed to another thread since, which then puts its new objects next to them
//! (two threads took turns at those cache lines: every second run of two threads read at
//! the speed of one). The number of lists is thus the most threads that ever made views at
//! once; only beyond [`POOL`] such threads ending together are a thread's lists left
//! allocated (their objects with them, at most `TYPES * CAP` of them). A forked child keeps
//! the lists of the thread that forked and of the pool; those of the parent's other
//! threads (which the child does not have) stay allocated, unused.
//!
//! A thread's lists also give it its identity for the handles' tables of per-thread store
//! references (src/py/handles/slot.rs): a key, new for each thread that takes the lists,
//! and a seat, a small number the lists hold for as long as they exist (so seats go to
//! whichever threads are alive, and a child keeps the parent's other threads' seats
//! unused, as it keeps their lists). Both are read with the lists' one
//! `pthread_getspecific`.

use std::os::raw::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use pyo3::ffi;

/// The types with a list in every thread's lists (the views, their iterators and the
/// handles' iterators: six).
pub(crate) const TYPES: usize = 8;

/// Objects kept per type and thread: the views alive at once in a usual loop (a record's
/// nested containers), few enough that a thread's lists stay small (5 KiB, and at most
/// `TYPES * CAP` objects of ~80 bytes).
const CAP: usize = 64;

/// Slots of the pool of ended threads' lists (see the module's text).
const POOL: usize = 1024;

/// One thread's lists: dropped objects per type, by the type's slot. Each list is
/// written at every view made and dropped, so each has cache lines of its own (two: the
/// adjacent-line prefetch pairs them), and no two threads' lists ever share one.
struct ThreadLists {
    lists: [List; TYPES],
    /// The seat these lists hold ([`SEATS`]; `NO_SEAT` when all were taken): the lists'
    /// for as long as they exist, so a thread that takes them from the pool takes it too.
    seat: u32,
    /// The key of the thread using the lists: unique in the process, never reused.
    key: u64,
}

// Seats (`process::SEATS`): a small number per thread, for the tables that handles keep of
// each thread's reference to their store (src/py/handles/slot.rs), with a flag by which the
// thread says it is reading one (`process::seat_enter`). The lists hold their seat for as
// long as they exist, so as many seats are taken as there were threads with views at once;
// threads beyond `SEATS` get none (their handles' reads take the slower way, which is
// logged once).
use crate::process::SEATS;

/// No seat (all taken).
const NO_SEAT: u32 = u32::MAX;

/// The next seat never taken.
static NEXT_SEAT: AtomicUsize = AtomicUsize::new(0);

/// The next thread key (0 is never given).
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// The calling thread's seat and key, for the handles' per-thread tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Me {
    pub(crate) seat: usize,
    pub(crate) key: u64,
}

/// The calling thread's seat and key; `None` if the lists are off, could not be made, or
/// every seat is taken.
///
/// # Safety
/// The thread is attached.
#[inline(always)]
pub(crate) unsafe fn me() -> Option<Me> {
    if !on() {
        return None;
    }
    // SAFETY: `on()`; the caller's contract.
    let lists = unsafe { current() };
    if lists.is_null() {
        return None;
    }
    // SAFETY: this thread's lists (see `pop`); only read here.
    let (seat, key) = unsafe { ((*lists).seat, (*lists).key) };
    (seat != NO_SEAT).then_some(Me {
        seat: seat as usize,
        key,
    })
}

#[repr(C, align(128))]
struct List {
    len: usize,
    items: [*mut ffi::PyObject; CAP],
}

/// Whether the lists are in use (set once by [`init`], before any view exists).
static ON: AtomicBool = AtomicBool::new(false);

/// The thread-specific key of a thread's lists (valid once `ON` is set).
static KEY: AtomicU32 = AtomicU32::new(0);

/// Lists of threads that ended, with the objects they kept, for threads that start later.
static PUT_BACK: [AtomicPtr<ThreadLists>; POOL] = [const { AtomicPtr::new(null_mut()) }; POOL];

/// Why the lists are off, if `init` failed.
static WHY_OFF: OnceLock<String> = OnceLock::new();

/// Make the key (once, at module init on a free-threaded interpreter); if that fails the
/// lists stay off, and [`why_off`] says why.
pub(crate) fn init() {
    if ON.load(Ordering::Relaxed) {
        return;
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is a valid place for the new key; `thread_ended` is a destructor that
    // never unwinds and touches nothing but the pool.
    let r = unsafe { libc::pthread_key_create(&mut key, Some(thread_ended)) };
    if r != 0 {
        let _ = WHY_OFF.set(format!(
            "off: no thread-specific key for the free lists per thread ({})",
            std::io::Error::from_raw_os_error(r)
        ));
        return;
    }
    KEY.store(key, Ordering::Relaxed);
    ON.store(true, Ordering::Release);
}

/// Why the lists are off (`init` failed, or was not called: an interpreter with a GIL).
pub(crate) fn why_off() -> String {
    WHY_OFF
        .get()
        .cloned()
        .unwrap_or_else(|| "off: not a free-threaded interpreter".to_owned())
}

/// Whether [`init`] succeeded (the per-thread lists are in use).
#[inline(always)]
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// This thread's lists, made (or taken from the pool) at its first use; null if the key
/// cannot hold them (out of memory).
///
/// # Safety
/// `on()`; the thread is attached.
#[inline(always)]
unsafe fn current() -> *mut ThreadLists {
    // SAFETY: the key was made by `init` (callers check `on()`); getspecific only reads
    // this thread's value of it.
    let p = unsafe { libc::pthread_getspecific(KEY.load(Ordering::Relaxed)) };
    if !p.is_null() {
        return p.cast();
    }
    // SAFETY: the caller's contract.
    unsafe { first_use() }
}

/// # Safety
/// The thread is attached (the objects of an ended thread's lists are freed here).
#[cold]
#[inline(never)]
unsafe fn first_use() -> *mut ThreadLists {
    // Looked at before it is taken: a swap of each empty slot would write every line of
    // the pool at each thread's start.
    let pooled = PUT_BACK
        .iter()
        .filter(|slot| !slot.load(Ordering::Relaxed).is_null())
        .map(|slot| slot.swap(null_mut(), Ordering::Acquire))
        .find(|p| !p.is_null());
    if let Some(p) = pooled {
        // SAFETY: taken out of the pool with a swap: this thread's alone now.
        for list in unsafe { &mut (*p).lists } {
            for &obj in &list.items[..list.len] {
                // SAFETY: a kept object (memory only, see `keep`): this frees it as our
                // dealloc would have; the thread is attached (the caller's contract).
                unsafe { ffi::PyObject_GC_Del(obj.cast()) };
            }
            list.len = 0;
        }
    }
    let lists = pooled.unwrap_or_else(|| {
        // A seat of its own, if any is left (taken once: a failed take leaves the count
        // past the end, where it stays).
        let seat = NEXT_SEAT.fetch_add(1, Ordering::Relaxed);
        Box::into_raw(Box::new(ThreadLists {
            lists: [const {
                List {
                    len: 0,
                    items: [null_mut(); CAP],
                }
            }; TYPES],
            seat: if seat < SEATS { seat as u32 } else { NO_SEAT },
            key: 0,
        }))
    });
    // SAFETY: `lists` is this thread's alone (fresh, or swapped out of the pool).
    unsafe { (*lists).key = NEXT_KEY.fetch_add(1, Ordering::Relaxed) };
    // SAFETY: the key is valid (as above); `lists` is owned by this thread from here on.
    if unsafe { libc::pthread_setspecific(KEY.load(Ordering::Relaxed), lists.cast()) } != 0 {
        put_back(lists);
        return null_mut();
    }
    lists
}

/// The key's destructor: the thread is ending and will never use its lists again.
unsafe extern "C" fn thread_ended(p: *mut c_void) {
    put_back(p.cast());
}

/// Hand `lists` (no longer any thread's) to the pool; left allocated if it is full.
fn put_back(lists: *mut ThreadLists) {
    for slot in &PUT_BACK {
        if slot.load(Ordering::Relaxed).is_null()
            && slot
                .compare_exchange(null_mut(), lists, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return;
        }
    }
}

/// A dropped object of the type in `slot`, kept by this thread; `None` if it has none.
///
/// # Safety
/// `on()`; the thread is attached; `slot < TYPES`. The object returned is memory only
/// (module text): the caller initialises it (`PyObject_Init`) before anything else.
#[inline(always)]
pub(crate) unsafe fn pop(slot: usize) -> Option<*mut ffi::PyObject> {
    // SAFETY: the caller's contract.
    let lists = unsafe { current() };
    if lists.is_null() {
        return None;
    }
    // SAFETY: `lists` is this thread's alone (set for it by `first_use`, taken out of the
    // pool with a swap); no other reference to it is alive: `pop` and `keep` end their
    // borrow before returning and call nothing that could re-enter them.
    let list = unsafe { &mut (*lists).lists[slot] };
    let len = list.len.checked_sub(1)?;
    list.len = len;
    list.items.get(len).copied()
}

/// Keep `obj` in this thread's list of `slot` if there is room; the caller frees it
/// otherwise.
///
/// # Safety
/// `on()`; the thread is attached; `slot < TYPES`; `obj`'s dealloc has run (its value is
/// dropped, its weak references cleared), it is untracked and the caller gives back its
/// reference to the type.
#[inline(always)]
pub(crate) unsafe fn keep(slot: usize, obj: *mut ffi::PyObject) -> bool {
    // SAFETY: the caller's contract.
    let lists = unsafe { current() };
    if lists.is_null() {
        return false;
    }
    // SAFETY: as in `pop`.
    let list = unsafe { &mut (*lists).lists[slot] };
    let Some(at) = list.items.get_mut(list.len) else {
        return false;
    };
    *at = obj;
    list.len += 1;
    true
}
