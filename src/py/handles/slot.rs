//! A handle's store ([`Slot`]): the reference every read through the handle starts from,
//! and on a free-threaded interpreter a reference of each reading thread's own, found
//! without a lock.
//!
//! With the GIL a handle holds one `StoreRef`; each read clones it inside a critical
//! section on the handle, which the GIL makes free.
//!
//! On a free-threaded interpreter the views a thread makes count references on an object
//! that thread made (its own `StoreRef`), not all threads on one, and a read finds it
//! without taking the handle's lock: the lock is one word that every reading thread would
//! write twice per read (two threads reading one list took 23 ms instead of 19-20, 1.6-1.7x
//! one thread instead of 1.9-2.0x: benchmarks/results/ft-slots-vm-2026-11-27.md). The
//! handle keeps a table of the threads' references, one entry per seat
//! (`read::thread_lists`: a small number each thread holds; its flag, on cache lines of its
//! own, is `process::seat_enter`'s). A read:
//!
//! 1. sets its seat's flag (a sequentially consistent store);
//! 2. loads the table (sequentially consistent), takes its entry if it is this thread's
//!    (the thread's key), and counts one more reference on it;
//! 3. clears the flag (a release store).
//!
//! A tiny read path (`with_own`) does the same with a borrowed reference, finding its
//! record and counting the reference for the view it makes between 2 and 3; it makes the
//! view only after the flag is cleared.
//!
//! Everything else happens inside the handle's critical section: a thread's first read
//! makes its reference and puts it in the table (which grows by copying into a larger one;
//! an old table is kept until the handle closes, since a reader may still look at it), and
//! `close` takes the table out (a sequentially consistent swap to null), then waits for the
//! flag of each seat the table has room for to be clear before it gives the references
//! back. Either a reader's flag comes before the close's look at it in the single order of
//! sequentially consistent operations — the close then waits for that read to have counted
//! its reference — or the reader's load of the table comes after the swap and finds none.
//! So no reference is given back while a reader may still be about to count one more on
//! it. Only a seat's own thread ever reads its entry, so replacing an entry a thread that
//! ended left in the seat needs no wait.
//!
//! A flag holds the process's fork generation + 1 (`process::seat_enter`): a forked child
//! waits only for its own threads, never for a flag that a thread of its parent, which the
//! child does not have, left set at the fork.
//!
//! Threads without a seat (more than [`SEATS`] with views at once) share the handle's own
//! reference under its lock, slower and never wrong; that is logged once.

use std::cell::UnsafeCell;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::critical_section::with_critical_section;

use crate::process::seat_reading;
use crate::py::read::StoreRef;
// The stable-ABI build is never loaded by a free-threaded interpreter: no per-thread
// references there (their table stays empty).
#[cfg(not(feature = "abi3"))]
use crate::process::{seat_enter, seat_leave, SEATS};
#[cfg(not(feature = "abi3"))]
use crate::py::read::{per_thread, this_thread, thread_lists_on, Me, FREE_THREADED_BUILD};
#[cfg(not(feature = "abi3"))]
use std::sync::{atomic::AtomicBool, Arc};

/// A handle's store, until `close()` takes it. Every write of it, and every read of the
/// handle's own reference, happens inside a critical section on the handle object
/// (`with_critical_section`): with the GIL that costs nothing (the GIL already serialises
/// them), on a free-threaded interpreter it is the handle's own lock. Inside, only
/// references are cloned, taken or stored and tables allocated — nothing calls back into
/// Python, so the section is never suspended while the slot is borrowed. A thread's read of
/// its own reference in `table` takes no lock (see the module's text).
pub(super) struct Slot {
    state: UnsafeCell<SlotState>,
    /// Free-threaded interpreter: the threads' references by seat; null before any thread
    /// has read and once closed.
    table: AtomicPtr<Table>,
}

struct SlotState {
    /// The handle's reference; `None` once closed.
    main: Option<StoreRef>,
    /// Tables replaced by larger ones, which a reader may still be looking at: freed when
    /// the handle closes (after the wait for readers) or is deallocated.
    retired: Vec<*mut Table>,
}

/// The threads' references, by seat: entry `i` is seat `i`'s thread's (its key) and holds
/// one reference to a `StoreRef`'s object (or null).
struct Table {
    entries: Box<[Entry]>,
}

struct Entry {
    #[cfg_attr(feature = "abi3", allow(dead_code))]
    key: AtomicU64,
    obj: AtomicPtr<ffi::PyObject>,
}

/// The first table's size, in seats (it grows to the seat a reading thread holds).
#[cfg(not(feature = "abi3"))]
const FIRST_TABLE: usize = 4;

// SAFETY: `state` is only touched inside a critical section on the handle that owns the
// slot (see above), which serialises every access to it; `table` is atomic, and the
// objects its entries point to are only given back as the module's text says.
unsafe impl Sync for Slot {}
// SAFETY: as above; the raw pointers are tables this slot owns.
unsafe impl Send for Slot {}

impl Slot {
    pub(super) fn new(main: StoreRef) -> Self {
        Slot {
            state: UnsafeCell::new(SlotState {
                main: Some(main),
                retired: Vec::new(),
            }),
            table: AtomicPtr::new(null_mut()),
        }
    }

    /// A reference to the store (this thread's own on a free-threaded interpreter), or
    /// `None` once closed.
    #[inline(always)]
    pub(super) fn get(&self, owner: &Bound<'_, PyAny>) -> Option<StoreRef> {
        #[cfg(not(feature = "abi3"))]
        if per_thread() {
            let py = owner.py();
            // SAFETY: the thread is attached (`owner` is bound to it).
            if let Some(me) = unsafe { this_thread() } {
                if let Some(mine) = self.mine(py, me) {
                    return Some(mine);
                }
                return self.first_read(owner, me);
            }
            no_seat();
        }
        self.main(owner)
    }

    /// `f` of the handle's own reference, borrowed rather than counted, for a tiny read
    /// path (`read::slots::FastGet::tiny_get`), which counts a reference only for what it
    /// makes; `None` once closed, and always on a free-threaded interpreter (where each
    /// thread reads through a reference of its own: `get`, `with_own`).
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    pub(super) fn with_main_gil<R>(
        &self,
        _owner: &Bound<'_, PyAny>,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        if FREE_THREADED_BUILD || per_thread() {
            return None;
        }
        // SAFETY: a build for an interpreter with a GIL, which the thread holds (`_owner`
        // is bound to it), so `take`, which alone changes `main`, cannot run while `f`
        // does: `f` is a tiny path, which runs no Python code and does not release the GIL.
        let main = unsafe { (*self.state.get()).main.as_ref()? };
        f(main)
    }

    /// The handle's own reference, or `None` once closed.
    #[inline(always)]
    fn main(&self, owner: &Bound<'_, PyAny>) -> Option<StoreRef> {
        let py = owner.py();
        with_critical_section(owner, || {
            // SAFETY: inside the owner's critical section (the type's contract); the
            // clone is a reference-count increment, no call into Python.
            unsafe { (*self.state.get()).main.as_ref().map(|s| s.clone_ref(py)) }
        })
    }

    /// This thread's reference from the table, without a lock (the module's text), or
    /// `None` if the table has none of this thread's (its first read, or closed).
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    fn mine(&self, py: Python<'_>, me: Me) -> Option<StoreRef> {
        self.with_entry(py, me, |store| Some(store.clone_ref(py)))
    }

    /// `f` of this thread's own reference, borrowed rather than counted, for a tiny read
    /// path on a free-threaded interpreter (`read::slots::FastGet::tiny_get`, which counts a
    /// reference only for what it makes); `None` without calling `f` where the thread has
    /// none in the table (its first read through the handle, which the whole way makes),
    /// has no seat, or the handle is closed, and on an interpreter with a GIL (where
    /// [`Self::with_main_gil`] serves). `f` runs with the seat's flag set, so a `close()` in
    /// another thread waits for it: it may only read and count references, never run Python
    /// code, make an object or wait.
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    pub(super) fn with_own<R>(
        &self,
        owner: &Bound<'_, PyAny>,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        if !per_thread() {
            return None;
        }
        // SAFETY: the thread is attached (`owner` is bound to it).
        let me = unsafe { this_thread() }?;
        self.with_entry(owner.py(), me, f)
    }

    /// A read of this thread's entry (the module's text, steps 1-3): `f` of the reference
    /// there, borrowed while the seat's flag is set; `None` without calling `f` if the
    /// table has none of this thread's (its first read, or closed). `f` may only read and
    /// count references (`close()` waits for the flag).
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    fn with_entry<R>(
        &self,
        py: Python<'_>,
        me: Me,
        f: impl FnOnce(&StoreRef) -> Option<R>,
    ) -> Option<R> {
        seat_enter(me.seat);
        let obj = self.own_obj(me);
        let out = if obj.is_null() {
            None
        } else {
            // SAFETY: the entry holds a reference to `obj`, not given back while our flag
            // is set, which it is until `f` has returned; the thread is attached (`py`).
            let store = unsafe { StoreRef::borrow_raw(py, obj) };
            f(&store)
        };
        seat_leave(me.seat);
        out
    }

    /// The object of this thread's reference in the table, or null if the table has none
    /// of this thread's (its first read, or closed).
    ///
    /// Call with the seat's flag set (`seat_enter(me.seat)`): the object is not given back
    /// until it is cleared.
    #[cfg(not(feature = "abi3"))]
    #[inline(always)]
    fn own_obj(&self, me: Me) -> *mut ffi::PyObject {
        let table = self.table.load(Ordering::SeqCst);
        if table.is_null() {
            return null_mut();
        }
        // SAFETY: a table stays allocated while our flag is set (`take` waits for it
        // before freeing one; a replaced table is kept until then).
        let entries = unsafe { &(*table).entries };
        match entries.get(me.seat) {
            // The entry of our seat is only ever written by this thread, or with the
            // table out of readers' reach: no other thread's key can be read with this
            // thread's object.
            Some(e) if e.key.load(Ordering::Relaxed) == me.key => e.obj.load(Ordering::Acquire),
            _ => null_mut(),
        }
    }

    /// This thread's first read through the handle: a reference of its own, put in the
    /// table; the handle's own if that cannot be made; `None` once closed.
    #[cfg(not(feature = "abi3"))]
    #[cold]
    #[inline(never)]
    fn first_read(&self, owner: &Bound<'_, PyAny>, me: Me) -> Option<StoreRef> {
        let py = owner.py();
        let main = self.main(owner)?;
        // Made outside the section: allocating may run the collector, which runs Python.
        let own = match StoreRef::new(py, Arc::clone(main.arc())) {
            Ok(own) => own,
            Err(err) => {
                // Out of memory: this read shares the handle's reference. The error is
                // handed to the interpreter and cleared there, not dropped here (this runs
                // in the read slots' fast path, which must not drop a `Py`:
                // src/py/read/slots.rs).
                err.restore(py);
                // SAFETY: the thread is attached; this clears the error just restored.
                unsafe { ffi::PyErr_Clear() };
                return Some(main);
            }
        };
        let kept = own.clone_ref(py).into_raw();
        let given_back = with_critical_section(owner, || {
            // SAFETY: inside the owner's critical section; nothing here calls Python (a
            // table is plain memory).
            let st = unsafe { &mut *self.state.get() };
            if st.main.is_none() {
                return kept; // closed meanwhile: not kept
            }
            let mut table = self.table.load(Ordering::Relaxed);
            // SAFETY: a non-null table is this slot's, alive (we are in the section).
            let len = unsafe { table.as_ref() }.map_or(0, |t| t.entries.len());
            if me.seat >= len {
                let bigger = Table::with_room_for(me.seat, table);
                self.table.store(bigger, Ordering::SeqCst);
                if !table.is_null() {
                    st.retired.push(table);
                }
                table = bigger;
            }
            // SAFETY: as above; `me.seat` is in range now.
            let e = unsafe { &(*table).entries[me.seat] };
            // The seat's earlier thread (ended) may have left its reference here; only
            // this thread reads this entry, so it can go at once.
            e.key.store(me.key, Ordering::Relaxed);
            e.obj.swap(kept, Ordering::AcqRel)
        });
        if !given_back.is_null() {
            // SAFETY: a reference this slot no longer holds (see above); the thread is
            // attached. A plain decrement: the store stays, `own` holds it.
            unsafe { StoreRef::release_raw(given_back) };
        }
        // SAFETY: the thread is attached.
        unsafe { main.release() };
        Some(own)
    }

    /// Close: the handle's references are given back (its own, then the threads', once no
    /// reader may still be counting one more on them). Waits, detached, for a reader that
    /// is in the middle of its few instructions (the module's text).
    pub(super) fn take(&self, owner: &Bound<'_, PyAny>) {
        let py = owner.py();
        let (main, table, retired) = with_critical_section(owner, || {
            // SAFETY: inside the owner's critical section.
            let st = unsafe { &mut *self.state.get() };
            (
                st.main.take(),
                self.table.swap(null_mut(), Ordering::SeqCst),
                std::mem::take(&mut st.retired),
            )
        });
        drop(main);
        if table.is_null() {
            debug_assert!(retired.is_empty());
            return;
        }
        // SAFETY: the table is out of the slot, not null (only readers that loaded it
        // before the swap may look at it, and those are waited for below).
        let seats = unsafe { &*table }.entries.len();
        wait_for_readers(py, seats);
        // SAFETY: no reader can reach these tables any more (see above); this slot owns
        // them and the references in `table`; the thread is attached.
        unsafe { free_tables(table, retired) };
    }

    /// Whether `take` ran (closed).
    pub(super) fn is_none(&self, owner: &Bound<'_, PyAny>) -> bool {
        // SAFETY: inside the owner's critical section.
        with_critical_section(owner, || unsafe { (*self.state.get()).main.is_none() })
    }
}

impl Drop for Slot {
    /// The handle is being deallocated: no thread can be reading through it (each reader
    /// holds a reference to the handle), so its tables go without a wait.
    fn drop(&mut self) {
        let table = *self.table.get_mut();
        let retired = std::mem::take(&mut self.state.get_mut().retired);
        if table.is_null() && retired.is_empty() {
            return;
        }
        Python::attach(|_py| {
            // SAFETY: as above; the thread is attached.
            unsafe { free_tables(table, retired) };
        });
    }
}

#[cfg(not(feature = "abi3"))]
impl Table {
    /// A table with room for `seat`, holding `old`'s entries (the old one stays valid).
    fn with_room_for(seat: usize, old: *mut Table) -> *mut Table {
        let len = (seat + 1).next_power_of_two().clamp(FIRST_TABLE, SEATS);
        // SAFETY: a non-null `old` is alive (the caller holds the section that frees tables).
        let old: &[Entry] = unsafe { old.as_ref() }.map_or(&[], |t| &t.entries);
        let entries: Box<[Entry]> = (0..len)
            .map(|i| match old.get(i) {
                Some(e) => Entry {
                    key: AtomicU64::new(e.key.load(Ordering::Relaxed)),
                    obj: AtomicPtr::new(e.obj.load(Ordering::Relaxed)),
                },
                None => Entry {
                    key: AtomicU64::new(0),
                    obj: AtomicPtr::new(null_mut()),
                },
            })
            .collect();
        Box::into_raw(Box::new(Table { entries }))
    }
}

/// Give back the references of `table` (its entries own one each; the `retired` tables'
/// entries are copies of some of them, owning none) and free the tables.
///
/// # Safety
/// No thread can read these tables any more; the caller owns them; the thread is attached.
unsafe fn free_tables(table: *mut Table, retired: Vec<*mut Table>) {
    if !table.is_null() {
        // SAFETY: the caller's contract: ours alone now.
        let table = unsafe { Box::from_raw(table) };
        for e in table.entries.iter() {
            let obj = e.obj.load(Ordering::Relaxed);
            if !obj.is_null() {
                // SAFETY: the entry's reference; the thread is attached.
                unsafe { StoreRef::release_raw(obj) };
            }
        }
    }
    for old in retired {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(old) });
    }
}

/// Wait until no thread of this process is in the middle of a read of a table with room
/// for `seats` seats (their flags clear). A reader's window is a few instructions without
/// a call, so this spins a little, then yields detached from the interpreter.
fn wait_for_readers(py: Python<'_>, seats: usize) {
    let reading: Vec<usize> = (0..seats).filter(|&i| seat_reading(i)).collect();
    if reading.is_empty() {
        return;
    }
    py.detach(|| {
        for i in reading {
            // Seen clear once, that read is over (a later one loads no table).
            let mut spins = 0u32;
            while seat_reading(i) {
                if spins < 64 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        }
    });
}

/// A thread without a seat read through a handle: said once per process.
#[cfg(not(feature = "abi3"))]
#[cold]
fn no_seat() {
    static SAID: AtomicBool = AtomicBool::new(false);
    // Not when the lists are off altogether (`_fast_paths()` says why then).
    if thread_lists_on() && !SAID.load(Ordering::Relaxed) && !SAID.swap(true, Ordering::Relaxed) {
        log::warn!(
            "shmstore: more than {SEATS} threads made views at once; the others read \
             through each handle's own reference count (slower on a free-threaded \
             interpreter, never wrong)"
        );
    }
}
