//! How much of this thread's stack is left: deep conversions (`to_python`, `==` on views,
//! `put` of a view or a nested value) recurse once per level of nesting, about 2 KiB of
//! stack a level, and threads started with a small stack (`threading.stack_size(64 KiB)`)
//! ran out at a depth the format accepts (100): a crash (SIGSEGV), where plain Python's
//! `repr`, `==` and `pickle` of the same list work. [`check`] is called before each level
//! and raises `RecursionError` (saying what to do) while there is still room to raise it.

use std::cell::Cell;

use pyo3::PyResult;

/// Stack kept free below a level: one level's frames, and whatever the conversion calls in
/// between (Python's allocator, numpy, raising the error itself).
const RESERVE: usize = 32 * 1024;

thread_local! {
    /// This thread's lowest usable stack address (0: not looked up yet, 1: unknown).
    static LOW: Cell<usize> = const { Cell::new(0) };
}

/// The lowest address of this thread's stack (the guard page excluded), or `None` when the
/// system cannot say.
fn stack_low() -> Option<usize> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: pthread_getattr_np initialises `attr` for the calling thread when it returns
    // 0; it is destroyed below, once read.
    if unsafe { libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) } != 0 {
        return None;
    }
    let mut addr: *mut libc::c_void = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    let mut guard: libc::size_t = 0;
    // SAFETY: `attr` was initialised above; the out-pointers point to our locals.
    let ok = unsafe {
        let ok = libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size) == 0;
        libc::pthread_attr_getguardsize(attr.as_ptr(), &mut guard);
        libc::pthread_attr_destroy(attr.as_mut_ptr());
        ok
    };
    (ok && !addr.is_null()).then(|| addr as usize + guard)
}

/// `Ok` while more than [`RESERVE`] bytes of this thread's stack are left; else
/// `RecursionError` saying what was being done (`what()`, asked only then) and what to do.
#[inline]
pub(crate) fn check(what: impl FnOnce() -> String) -> PyResult<()> {
    let low = LOW.with(|c| {
        if c.get() == 0 {
            c.set(stack_low().unwrap_or(1));
        }
        c.get()
    });
    if low <= 1 {
        return Ok(());
    }
    let marker = 0u8;
    let here = std::ptr::addr_of!(marker) as usize;
    if here.saturating_sub(low) > RESERVE {
        return Ok(());
    }
    let what = what();
    Err(super::errors::stack_exhausted(format!(
        "{what}: this thread's stack is nearly used up by the nesting of the value (about \
         2 KiB a level); run this in a thread with a larger stack (threading.stack_size(), \
         e.g. 1 MiB) or flatten the data"
    )))
}
