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
    let marker = 0u8;
    if let Some(low) = main_stack_low(std::ptr::addr_of!(marker) as usize) {
        return Some(low);
    }
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

/// How far the main thread's stack mapping may end above the end of the environment's
/// strings: the executable's name (at most `PATH_MAX`, 4 KiB) and a null pointer lie
/// between them, and the end is a page boundary.
const ABOVE_ENVIRONMENT: usize = 8 * 1024;

/// The lowest address the main thread's stack may grow down to, when `here` (an address on
/// the calling thread's stack) is on it; `None` otherwise (another thread, a child forked
/// from one, no limit on the stack's size, a kernel that does not say), and [`stack_low`]
/// asks pthreads.
///
/// glibc's `pthread_getattr_np` finds the main thread's stack by reading and parsing
/// `/proc/self/maps`, line by line: 0.6 ms with numpy loaded (more with torch's thousands of
/// mappings), most of a process's first `get` of an array. This reads one line instead,
/// `/proc/self/stat` (its `start_stack` and `env_end`), and `RLIMIT_STACK`: the stack's
/// mapping may grow down to that limit below its end, which lies at most
/// [`ABOVE_ENVIRONMENT`] above the environment's end (the answer errs, by that, on the side
/// of less room).
fn main_stack_low(here: usize) -> Option<usize> {
    // Only the process's main thread (or a child's one thread) has the thread id of the
    // process: every other thread asks pthreads at once, without reading /proc.
    // SAFETY: gettid and getpid have no preconditions and cannot fail.
    if unsafe { libc::gettid() != libc::getpid() } {
        return None;
    }
    // Read into a buffer large enough for the line (`fs::read` and `read_to_end` would
    // `statx` the file first and, as /proc reports a size of 0, read it in growing steps).
    let mut buf = [0u8; 2048];
    let mut len = 0;
    let mut file = std::fs::File::open("/proc/self/stat").ok()?;
    while len < buf.len() {
        match std::io::Read::read(&mut file, &mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    let stat = &buf[..len];
    // Fields after the command's name (which may hold spaces and parentheses), from the
    // third (the state): `start_stack` is the 28th, `env_end` the 51st.
    let rest = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    let mut fields = std::str::from_utf8(rest).ok()?.split_ascii_whitespace();
    let start: usize = fields.nth(25)?.parse().ok()?;
    let env_end: usize = fields.nth(22)?.parse().ok()?;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given, ours.
    if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let limit = usize::try_from(limit.rlim_cur).ok()?;
    let low = env_end.checked_add(ABOVE_ENVIRONMENT)?.checked_sub(limit)?;
    // The main thread's stack runs from below `start_stack` (where the arguments' pointers
    // and the first frames are) down; a thread's stack lies elsewhere.
    (start <= env_end && low < here && here <= start).then_some(low)
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
