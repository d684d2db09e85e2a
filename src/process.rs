//! The process: its id (cached, forgotten in a forked child), the one `pthread_atfork`
//! registration of the crate, with the order in which every process-wide lock is taken
//! before a fork, and the reader seats' flags, which a forked child tells apart from its
//! parent's.
//!
//! A thread may hold one of these locks (with the GIL released) while another thread forks.
//! The child would inherit it locked by a thread that does not exist there, and hang at its
//! first use. So the forking thread takes every one of them before the fork (waiting for the
//! short stretch another thread holds it) and releases them after it, in the parent and in
//! the child. The locks are taken in one order, [`ForkLock`]'s, lowest first; no code holds
//! one of them while waiting for one that comes before it. The layers register their hooks
//! here ([`on_fork`]) before they first take the locks; a slot not registered yet is skipped.
//!
//! The order, as the prepare hook takes them:
//!
//! 1. [`ForkLock::ArenaFiles`]: the arena files opened in this process (`arena::file`);
//! 2. [`ForkLock::Arenas`]: this process's own arenas (`ARENAS`, `py::arena`, an
//!    `arena::owned::Arenas`);
//! 3. [`ForkLock::ArenaUses`]: the arena read from last, then the arenas used here
//!    (`py::store`);
//! 4. [`ForkLock::SupervisorClient`]: the supervisor client's conversation (`IO`), then its
//!    bookkeeping (`STATE`) (`supervisor::client`);
//! 5. [`ForkLock::OwnedNames`]: the names of the segments this process created
//!    (`segment::mapping`).
//!
//! After the fork they are released in the reverse order, in the parent and in the child;
//! in the child the cached pid is forgotten and the fork generation counted first.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Once, OnceLock};

/// This process's id, cached (`getpid` is a system call, and a small `put` asked for it
/// three times). A forked child forgets the parent's (the fork hook is installed before the
/// first value is cached), so it never takes itself for its parent.
pub fn pid() -> u32 {
    let p = PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    install();
    let p = std::process::id();
    PID.store(p, Ordering::Relaxed);
    p
}

static PID: AtomicU32 = AtomicU32::new(0);

/// How many forks lie between this process and the first of its line to load the crate
/// (0 there; a forked child is one more than its parent).
fn generation() -> u32 {
    GENERATION.load(Ordering::Relaxed)
}

static GENERATION: AtomicU32 = AtomicU32::new(0);

/// Reader seats: a flag per seat (a small number a thread holds, given by the binding
/// layer's lists per thread) by which that thread says it is in the middle of a read that
/// another thread must wait for before giving back what the read may still count a
/// reference on (the handles' tables of per-thread references, `py::handles::slot`).
pub const SEATS: usize = 256;

/// A seat's flag, on cache lines of its own (its thread writes it twice per read).
#[repr(C, align(128))]
struct Seat {
    /// Nonzero while the seat's thread reads: the process's fork generation + 1, so that a
    /// forked child never waits for a flag that a thread of its parent (which the child
    /// does not have) left set at the fork.
    reading: AtomicU32,
}

static SEAT_FLAGS: [Seat; SEATS] = [const {
    Seat {
        reading: AtomicU32::new(0),
    }
}; SEATS];

/// The calling thread, which holds `seat` (< [`SEATS`]), starts a read: the store is
/// sequentially consistent, so that a later sequentially consistent load of the reader's
/// (such as its load of a handle's table) cannot be seen before it by [`seat_reading`].
#[inline(always)]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub fn seat_enter(seat: usize) {
    SEAT_FLAGS[seat]
        .reading
        .store(generation().wrapping_add(1), Ordering::SeqCst);
}

/// The read started by [`seat_enter`] is over (a release store: what it did is seen by a
/// thread that then sees the flag clear).
#[inline(always)]
#[cfg_attr(feature = "abi3", allow(dead_code))]
pub fn seat_leave(seat: usize) {
    SEAT_FLAGS[seat].reading.store(0, Ordering::Release);
}

/// Whether the thread of `seat` (< [`SEATS`]), a thread of this process, is in the middle
/// of a read (sequentially consistent: see [`seat_enter`]).
pub fn seat_reading(seat: usize) -> bool {
    SEAT_FLAGS[seat].reading.load(Ordering::SeqCst) == generation().wrapping_add(1)
}

/// The process-wide locks taken around a fork, in the order they are taken (see the module
/// docs). A layer's lock comes before the locks of any layer it may take while holding it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkLock {
    /// The arena files opened in this process (`arena::file`).
    ArenaFiles,
    /// This process's own arenas (`ARENAS` of `py::arena`, an `arena::owned::Arenas`).
    Arenas,
    /// The arena read from last and the arenas used in this process (`py::store`).
    ArenaUses,
    /// The supervisor client's `IO` then `STATE` (`supervisor::client`).
    SupervisorClient,
    /// The names of the segments this process created (`segment::mapping`).
    OwnedNames,
}

impl ForkLock {
    /// Every lock, in the order the prepare hook takes them.
    pub const ORDER: [ForkLock; 5] = [
        ForkLock::ArenaFiles,
        ForkLock::Arenas,
        ForkLock::ArenaUses,
        ForkLock::SupervisorClient,
        ForkLock::OwnedNames,
    ];
}

/// What a layer does around a fork for one [`ForkLock`]. Each runs in the forking thread:
/// `before` takes the lock(s) (keeping the guards in a thread-local), `after_parent` and
/// `after_child` release them (the child may also reset what only the parent owns). They
/// must not touch Python, do I/O, wait for anything but the lock itself, or unwind.
#[derive(Clone, Copy)]
pub struct ForkHooks {
    pub before: fn(),
    pub after_parent: fn(),
    pub after_child: fn(),
}

/// The hooks of each [`ForkLock`], in its order.
struct Registry {
    slots: [OnceLock<ForkHooks>; ForkLock::ORDER.len()],
}

impl Registry {
    const fn new() -> Self {
        Registry {
            slots: [const { OnceLock::new() }; ForkLock::ORDER.len()],
        }
    }

    /// Set the hooks of `lock` (the first registration stays; later ones are ignored).
    fn register(&self, lock: ForkLock, hooks: ForkHooks) {
        let _ = self.slots[lock as usize].set(hooks);
    }

    fn before(&self) {
        for hooks in self.slots.iter().filter_map(OnceLock::get) {
            (hooks.before)();
        }
    }

    fn after_parent(&self) {
        for hooks in self.slots.iter().rev().filter_map(OnceLock::get) {
            (hooks.after_parent)();
        }
    }

    fn after_child(&self) {
        for hooks in self.slots.iter().rev().filter_map(OnceLock::get) {
            (hooks.after_child)();
        }
    }
}

static HOOKS: Registry = Registry::new();

/// Register what a layer does around a fork for `lock` (once; later calls for the same lock
/// are ignored). Call it before the first time the lock is taken.
pub fn on_fork(lock: ForkLock, hooks: ForkHooks) {
    install();
    HOOKS.register(lock, hooks);
}

extern "C" fn prepare() {
    HOOKS.before();
}

extern "C" fn parent() {
    HOOKS.after_parent();
}

extern "C" fn child() {
    PID.store(0, Ordering::Relaxed);
    GENERATION.fetch_add(1, Ordering::Relaxed);
    HOOKS.after_child();
}

/// The crate's one `pthread_atfork` registration (once per process). The Python module
/// makes it happen at import (through the first [`on_fork`]), before any thread of the
/// program can be in the middle of it: a fork while another thread runs this for the first
/// time would leave the child a `Once` that never completes.
fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the three handlers only run the registered hooks, which lock and unlock
        // process-global mutexes (held for short stretches by threads that never wait for
        // a lock ordered before theirs), store to atomics and never unwind; they touch no
        // Python and do no I/O.
        unsafe {
            libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    thread_local! {
        /// The hooks run by this test's thread, in order.
        static CALLS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    }

    fn note(what: &str) {
        CALLS.with(|c| c.borrow_mut().push(what.to_string()));
    }

    fn calls() -> Vec<String> {
        CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()))
    }

    macro_rules! hooks {
        ($name:literal) => {
            ForkHooks {
                before: || note(concat!("before ", $name)),
                after_parent: || note(concat!("parent ", $name)),
                after_child: || note(concat!("child ", $name)),
            }
        };
    }

    #[test]
    fn locks_are_taken_in_the_declared_order_and_released_in_reverse() {
        let registry = Registry::new();
        // Registered in another order than they are taken (as the layers do, lazily).
        registry.register(ForkLock::OwnedNames, hooks!("owned names"));
        registry.register(ForkLock::SupervisorClient, hooks!("client"));
        registry.register(ForkLock::ArenaUses, hooks!("arena uses"));
        registry.register(ForkLock::ArenaFiles, hooks!("arena files"));
        registry.register(ForkLock::Arenas, hooks!("arenas"));
        registry.register(ForkLock::Arenas, hooks!("ignored"));
        calls();
        registry.before();
        registry.after_parent();
        registry.after_child();
        let calls = calls();
        let order = [
            "arena files",
            "arenas",
            "arena uses",
            "client",
            "owned names",
        ];
        let mut want: Vec<String> = order.iter().map(|n| format!("before {n}")).collect();
        want.extend(order.iter().rev().map(|n| format!("parent {n}")));
        want.extend(order.iter().rev().map(|n| format!("child {n}")));
        assert_eq!(calls, want);
    }

    #[test]
    fn a_lock_not_registered_yet_is_skipped() {
        let registry = Registry::new();
        registry.register(ForkLock::SupervisorClient, hooks!("client only"));
        calls();
        registry.before();
        registry.after_child();
        assert_eq!(calls(), ["before client only", "child client only"]);
    }

    #[test]
    fn the_order_lists_every_lock_once_in_declaration_order() {
        for (i, lock) in ForkLock::ORDER.iter().enumerate() {
            assert_eq!(*lock as usize, i);
        }
    }

    #[test]
    fn a_forked_child_never_waits_for_a_reader_of_its_parent() {
        // A thread of the parent is in the middle of a read at the fork (seat 7, which no
        // other test uses); the child does not have that thread.
        pid(); // the fork hook is installed
        seat_enter(7);
        assert!(seat_reading(7));
        // SAFETY: the child only reads atomics and leaves with `_exit`, as below.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let before = !seat_reading(7);
            // The child's own reads are seen as such.
            seat_enter(7);
            let own = seat_reading(7);
            seat_leave(7);
            let ok = before && own && !seat_reading(7);
            // SAFETY: ends the child at once, running no destructor.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        let waited = unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(waited, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(seat_reading(7), "the parent's reader is still reading");
        seat_leave(7);
        assert!(!seat_reading(7));
    }

    #[test]
    fn a_forked_child_has_its_own_pid() {
        let parent = pid();
        assert_eq!(parent, std::process::id());
        // SAFETY: the child only reads its pid (an atomic and a system call) and leaves
        // with `_exit`, running no destructor and taking no lock another thread may hold.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let ok = pid() != parent && pid() == std::process::id();
            // SAFETY: ends the child at once, as above.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        let waited = unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(waited, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert_eq!(pid(), parent);
    }
}
