//! Starting a supervisor process, and background threads that never take a signal.

use super::*;

/// Mark every descriptor above stderr close-on-exec, so that the supervisor (which outlives
/// the process that starts it) holds none of its starter's files, pipes or sockets. Without
/// this it kept, for example, the write end of multiprocessing's forkserver "alive" pipe
/// that a forkserver child receives without close-on-exec: the forkserver never saw EOF and
/// never exited while the supervisor ran.
pub(super) fn inherit_no_descriptors() -> io::Result<()> {
    // SAFETY: close_range only changes descriptor flags; CLOSE_RANGE_CLOEXEC (Linux >= 5.11)
    // marks instead of closing, so the pipe Command uses to report exec errors still works.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return Ok(());
    }
    // Older kernels: every descriptor number below the soft limit (bounded).
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let max = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(1 << 20) as libc::c_int
    } else {
        1024
    };
    for fd in 3..max {
        // SAFETY: fcntl on a number that may not be an open descriptor just fails (EBADF).
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

pub(super) fn spawn_supervisor() -> Result<(), Unavailable> {
    let cmd = SPAWN
        .get()
        .ok_or_else(|| Unavailable::Other("no way to start a supervisor was configured".into()))?;
    // The started process forks once and exits (the real supervisor is its child, in its
    // own session): waiting for it leaves no zombie behind.
    let mut command = Command::new(&cmd.program);
    command
        .args(&cmd.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the hook runs in the forked child between fork and exec; it only makes
    // syscalls (close_range, getrlimit, fcntl), which are async-signal-safe, and allocates
    // nothing.
    unsafe { command.pre_exec(inherit_no_descriptors) };
    let status = command
        .status()
        .map_err(|e| Unavailable::Other(format!("starting the supervisor: {e}")))?;
    if !status.success() {
        return Err(Unavailable::Other(format!(
            "the supervisor failed to start ({status})"
        )));
    }
    Ok(())
}

/// Start a background thread that blocks every signal, from its first instruction (it
/// inherits the mask set around the spawn). A signal sent to the process (Ctrl-C's SIGINT,
/// SIGTERM) then always goes to a thread that can handle it: if the kernel picked our
/// thread instead, CPython would only set a flag there, and a main thread blocked in a read
/// would never be interrupted (the program would ignore Ctrl-C).
pub(super) fn spawn_without_signals(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    // SAFETY: plain libc calls on local, initialised sigset_t values; the calling thread's
    // mask is restored right after the spawn, whatever the spawn's outcome.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let started = std::thread::Builder::new().name(name.into()).spawn(f);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        started
    }
}
