//! What the stores call: registering, pinning and dropping segments (a connection made,
//! and a supervisor started, when needed), and the thread that sends queued DROPs.

use super::*;

pub(super) type IoGuard = MutexGuard<'static, Io>;

/// Make sure this process has a live connection, connecting (and starting a supervisor
/// when `may_spawn`) if needed; a fresh connection re-registers every segment in use, and
/// `Ok(true)` says so. Called with `IO` held; releases it only while starting a supervisor
/// (which may fork: never with our locks held, see the module docs).
pub(super) fn ensure(mut io: IoGuard, may_spawn: bool) -> (IoGuard, Result<bool, Unavailable>) {
    own_conn(&mut io);
    if io.conn.is_some() {
        return (io, Ok(false));
    }
    if let Some((until, why)) = &lock(state()).backoff {
        if Instant::now() < *until {
            return (io, Err(Unavailable::NoAnswer(why.clone())));
        }
    }
    // Every segment in use is registered on a new connection, the first batch in the same
    // write as the HELLO.
    let mut uses = registrations();
    let mut c = match connect(Instant::now() + timeout(), &uses) {
        Ok(c) => c,
        Err(Unavailable::NotRunning(_)) if may_spawn => {
            let start = Instant::now();
            drop(io);
            let spawned = spawn_supervisor();
            io = lock(&IO);
            if let Err(e) = spawned {
                return (io, Err(e));
            }
            if io.conn.is_some() {
                // Another thread connected meanwhile and registered everything in `uses`.
                return (io, Ok(true));
            }
            uses = registrations();
            loop {
                match connect(Instant::now() + timeout(), &uses) {
                    Ok(c) => break c,
                    Err(Unavailable::NotRunning(e)) if start.elapsed() >= SPAWN_WAIT => {
                        return (io, Err(Unavailable::NotRunning(e)))
                    }
                    Err(Unavailable::NotRunning(_)) => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => return (io, Err(e)),
                }
            }
        }
        Err(e) => return (io, Err(e)),
    };
    // Re-registering many stores may take several deadlines' worth: one per batch.
    for chunk in uses[uses.len().min(BATCH)..].chunks(BATCH) {
        if let Err(e) = c.requests(chunk, Instant::now() + timeout()) {
            return (io, Err(fail(&c, e)));
        }
    }
    // Then every pin, after the registrations (a supervisor that started since knows none).
    // One it refuses (say its directory is not a segment directory to this supervisor yet)
    // is forgotten, not a reason to give up the connection.
    let pins: Vec<(PathBuf, PathBuf)> = lock(state()).pins.iter().cloned().collect();
    for chunk in pins.chunks(BATCH) {
        let reqs: Vec<Request> = chunk
            .iter()
            .map(|(holder, path)| Request::Pin {
                holder: holder.clone(),
                path: path.clone(),
            })
            .collect();
        match c.exchange(&reqs, Instant::now() + timeout()) {
            Ok(replies) => {
                let mut st = lock(state());
                for (pin, reply) in chunk.iter().zip(replies) {
                    if !reply.starts_with("OK") {
                        st.pins.remove(pin);
                    }
                }
            }
            Err(e) => return (io, Err(fail(&c, e))),
        }
    }
    io.conn = Some(c);
    (io, Ok(true))
}

/// Make `io.conn` this process's own: a forked child's inherited connection is its
/// parent's (forgotten: see `after_fork_child`; never read the parent's pending replies,
/// and its locks on pending segments stay open here too, harmless since this process maps
/// those segments as well). A connection opened at import ([`prepare`]) that has not been
/// used yet is closed if the supervisor it reaches is no longer the one the environment
/// names (`SHMSTORE_SUPERVISOR_NAME` or the state directory changed since): it registered
/// nothing, and registering with the one named at the first use is what a process did
/// before connections were opened at import.
pub(super) fn own_conn(io: &mut Io) {
    let me = std::process::id();
    if io.pid != me {
        if let Some(c) = io.conn.take() {
            std::mem::forget(c);
        }
        io.pid = me;
    }
    let stale = io
        .conn
        .as_ref()
        .and_then(|c| c.prepared.as_ref())
        .is_some_and(|target| {
            *target
                != (
                    crate::supervisor::state_dir_path(),
                    crate::supervisor::socket_name(),
                )
        });
    if stale {
        io.conn = None;
    }
}

/// What a new connection registers: every segment in use here. A new connection knows
/// nothing of earlier DROPs: they are forgotten.
pub(super) fn registrations() -> Vec<Request> {
    let mut st = lock(state());
    st.drops.clear();
    st.uses
        .iter()
        .filter(|(_, u)| !u.refused)
        .map(|(p, u)| {
            if u.created {
                Request::New(p.clone())
            } else {
                Request::Use(p.clone())
            }
        })
        .collect()
}

/// The supervisor answered a USE written without waiting with `reply`, not OK: the segment
/// is not registered (it stays locked while this process maps it, see
/// [`use_segment_nowait`]).
pub(super) fn refused(path: PathBuf, reply: &str) {
    let mut st = lock_state();
    let why = format!(
        "the supervisor refused to register {} (it said {reply:?})",
        path.display()
    );
    if let Some(u) = st.uses.get_mut(&path) {
        u.refused = true;
    }
    st.late.get_or_insert(why);
}

/// Close this process's connection (it failed, or missed a deadline). The next
/// conversation reconnects and registers every segment in use again, including those whose
/// USE was still waiting for its answer.
pub(super) fn lose(io: &mut Io) {
    io.conn = None;
}

pub(super) fn lock_state() -> MutexGuard<'static, State> {
    lock(state())
}

pub(super) fn fail(c: &Conn, e: io::Error) -> Unavailable {
    if is_timeout(&e) {
        no_answer(c.supervisor)
    } else {
        Unavailable::NotRunning(e)
    }
}

/// Send `req` on this process's connection (reconnecting once if the supervisor went
/// away). On a missed deadline the connection is closed (the caller gives the supervisor
/// up for [`BACKOFF`]).
pub(super) fn send(mut io: IoGuard, req: Request, may_spawn: bool) -> Result<(), Unavailable> {
    for attempt in 0..2 {
        let (back, fresh) = ensure(io, may_spawn);
        io = back;
        let fresh = fresh?;
        if fresh && matches!(req, Request::Use(_) | Request::New(_)) {
            return Ok(()); // `ensure` registered everything in `uses`, this path included
        }
        let c = io.conn.as_mut().expect("ensured");
        c.prepared = None;
        match c.requests(std::slice::from_ref(&req), Instant::now() + timeout()) {
            Ok(()) => return Ok(()),
            Err(e) => {
                let err = fail(c, e);
                lose(&mut io);
                if matches!(err, Unavailable::NoAnswer(_)) || attempt == 1 {
                    return Err(err);
                }
                // It died (e.g. was killed): reconnect and re-register once.
            }
        }
    }
    unreachable!("the loop returns")
}

pub(super) fn give_up(err: &Unavailable) {
    if let Unavailable::NoAnswer(why) = err {
        lock(state()).backoff = Some((Instant::now() + BACKOFF, why.clone()));
    }
}

/// This process uses the segment at `path` (call before creating or mapping it; `created`:
/// this process creates it). An error means the supervisor is unavailable (it says why and
/// what to do); the segment is then only covered by the orphan sweep.
pub fn use_segment(path: &Path, created: bool) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    {
        let mut st = lock(state());
        if let Some(u) = st.uses.get_mut(path) {
            if u.count > 0 {
                u.count += 1;
                return Ok(());
            }
        }
    }
    // Hold the conversation from here: a DROP of this path can only be sent after our
    // registration, never before it.
    let io = lock(&IO);
    {
        let mut st = lock(state());
        let u = st.uses.entry(path.to_owned()).or_default();
        u.count += 1;
        u.created |= created;
        if u.count > 1 {
            return Ok(());
        }
        if st.drops.remove(path) {
            return Ok(()); // its DROP was never sent: still registered
        }
    }
    let req = if created {
        Request::New(path.to_owned())
    } else {
        Request::Use(path.to_owned())
    };
    let res = send(io, req, true);
    if let Err(e) = &res {
        give_up(e);
        let mut st = lock(state());
        if let Some(u) = st.uses.get_mut(path) {
            u.count -= 1;
            if u.count == 0 {
                st.uses.remove(path);
            }
        }
    }
    res
}

/// Keep the segment at `path` while the segment `holder` is in use (`PIN`, see
/// docs/lifecycle.md, "Pins"): e.g. an arena holding objects whose handles wait in a
/// channel, kept after this process exits until the channel itself is removed. Both must
/// be in the same segment directory. Sent once per (holder, path) in this process (later
/// calls return at once) and again on every new connection, so a supervisor started since
/// learns it too. A round trip with the usual deadline; `Unavailable::Other` if the
/// supervisor refuses the pin (it says why), the other errors as [`use_segment`].
pub fn pin_segment(holder: &Path, path: &Path) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    let pin = (holder.to_owned(), path.to_owned());
    if lock(state()).pins.contains(&pin) {
        return Ok(());
    }
    let mut io = lock(&IO);
    if lock(state()).pins.contains(&pin) {
        return Ok(()); // another thread pinned it meanwhile
    }
    let req = Request::Pin {
        holder: pin.0.clone(),
        path: pin.1.clone(),
    };
    let mut res = Err(Unavailable::Other("not sent".into()));
    for attempt in 0..2 {
        let (back, fresh) = ensure(io, true);
        io = back;
        if let Err(e) = fresh {
            res = Err(e);
            break;
        }
        let c = io.conn.as_mut().expect("ensured");
        c.prepared = None;
        let sent = c.exchange(std::slice::from_ref(&req), Instant::now() + timeout());
        match sent.map(|replies| replies.into_iter().next().unwrap_or_default()) {
            Ok(reply) if reply.starts_with("OK") => {
                // Recorded with `IO` still held: a reconnection by another thread after this
                // point sends it again.
                lock(state()).pins.insert(pin);
                return Ok(());
            }
            Ok(reply) => {
                return Err(Unavailable::Other(format!(
                    "the supervisor refused to keep {} while {} is in use (it said {reply:?})",
                    path.display(),
                    holder.display(),
                )));
            }
            Err(e) => {
                let err = fail(c, e);
                lose(&mut io);
                let last = matches!(err, Unavailable::NoAnswer(_)) || attempt == 1;
                res = Err(err);
                if last {
                    break;
                }
                // It died (e.g. was killed): reconnect, re-register, and pin, once.
            }
        }
    }
    drop(io);
    if let Err(e) = &res {
        give_up(e);
    }
    res
}

/// This process attached the segment at `path`, holding a shared `flock` on it for as long
/// as it maps it (`segment::Mapping::open_locked`): tell the supervisor without waiting for
/// its answer when that is possible, else as [`use_segment`] does.
///
/// Why not waiting is safe (docs/lifecycle.md, "Attaching without waiting"): the supervisor
/// and `shmstore gc` remove a segment only under an exclusive `flock` taken without
/// waiting, which is refused while any process maps the segment through a locked
/// descriptor. The USE is written now on this process's connection (opened at import,
/// [`prepare`], or now if a supervisor is listening), and its answer read by a later
/// conversation ([`Conn::poll_pending`], [`Conn::settle`]). An answer other than OK leaves
/// the segment unregistered, said by the next attach ([`take_late`]); a connection that
/// fails first is opened again by the next conversation, which registers every segment in
/// use. Nothing the supervisor says is needed to read the segment safely: it was checked
/// before it was mapped.
pub fn use_segment_nowait(path: &Path) -> Result<(), Unavailable> {
    if !enabled() {
        return Err(Unavailable::Disabled);
    }
    install_fork_handlers();
    {
        let mut st = lock_state();
        if let Some(u) = st.uses.get_mut(path) {
            if u.count > 0 {
                u.count += 1;
                return Ok(());
            }
        }
    }
    let mut io = lock(&IO);
    {
        let mut st = lock_state();
        let u = st.uses.entry(path.to_owned()).or_default();
        u.count += 1;
        if u.count > 1 {
            return Ok(());
        }
        if st.drops.remove(path) {
            return Ok(()); // its DROP was never sent: still registered
        }
    }
    if use_without_waiting(&mut io, path) {
        return Ok(());
    }
    // The usual round trip (it may start a supervisor, or reconnect and register every
    // segment in use again).
    let res = send(io, Request::Use(path.to_owned()), true);
    if let Err(e) = &res {
        give_up(e);
        let mut st = lock_state();
        if let Some(u) = st.uses.get_mut(path) {
            u.count -= 1;
            if u.count == 0 {
                st.uses.remove(path);
            }
        }
    }
    res
}

/// Open this process's connection now, if a supervisor is listening: called when shmstore
/// is imported, so that the first attach writes one line instead of connecting (a connect
/// wakes the supervisor, which on a busy machine costs about as much as the rest of an
/// attach). Never starts a supervisor, never waits: the HELLO's answer is read by the
/// next conversation. Nothing is registered. Any failure is silent (the first real
/// conversation meets it again and says so).
pub fn prepare() {
    if !enabled() {
        return;
    }
    install_fork_handlers();
    let mut io = lock(&IO);
    own_conn(&mut io);
    if io.conn.is_some() {
        return;
    }
    let me = std::process::id();
    {
        let st = lock_state();
        let backoff = st
            .backoff
            .as_ref()
            .is_some_and(|(until, _)| Instant::now() < *until);
        if backoff || !st.uses.is_empty() {
            return;
        }
    }
    let Ok(dir) = crate::supervisor::state_dir() else {
        return;
    };
    let name = crate::supervisor::socket_name();
    // A deadline of now: a full listen backlog is not waited on.
    let Ok(mut c) = open_conn(&dir, &name, Instant::now()) else {
        return;
    };
    c.prepared = Some((crate::supervisor::state_dir_path(), name));
    let hello = Request::Hello(me).encode();
    if c.send_all(hello.as_bytes(), Instant::now() + timeout())
        .is_err()
    {
        return;
    }
    c.pending.push_back(Pending {
        path: None,
        sent: Instant::now(),
    });
    io.conn = Some(c);
}

/// Close this process's connection without a word (the supervisor process itself, which
/// imported shmstore, must not be another supervisor's client).
pub fn disconnect() {
    let mut io = lock(&IO);
    if io.pid == std::process::id() {
        io.conn = None;
    }
}

/// Write `USE path` on this process's connection (opening it if a supervisor is listening
/// and nothing else needs registering), its answer to be read later. False when that is
/// not possible now: the caller then does the round trip.
pub(super) fn use_without_waiting(io: &mut Io, path: &Path) -> bool {
    let me = std::process::id();
    own_conn(io);
    if io.conn.is_none() {
        {
            let st = lock_state();
            if st
                .backoff
                .as_ref()
                .is_some_and(|(until, _)| Instant::now() < *until)
            {
                return false;
            }
            // Only this segment to register: a reconnection that registers more is a
            // round trip (`ensure`).
            if st.uses.len() != 1 {
                return false;
            }
        }
        let Ok(dir) = crate::supervisor::state_dir() else {
            return false;
        };
        let Ok(mut c) = open_conn(
            &dir,
            &crate::supervisor::socket_name(),
            Instant::now() + timeout(),
        ) else {
            return false; // none running (then one is started), or another failure
        };
        let hello = Request::Hello(me).encode();
        if c.send_all(hello.as_bytes(), Instant::now() + timeout())
            .is_err()
        {
            return false;
        }
        c.pending.push_back(Pending {
            path: None,
            sent: Instant::now(),
        });
        registrations(); // forgets queued DROPs: none was sent on this connection
        io.conn = Some(c);
    }
    let c = io.conn.as_mut().expect("connected above");
    c.prepared = None;
    // Take the replies that came meanwhile; a reply overdue (or many unread) is waited for
    // by the round trip instead, which tells a stopped or gone supervisor.
    if c.poll_pending().is_err() {
        lose(io);
        return false;
    }
    let overdue = c
        .pending
        .front()
        .is_some_and(|p| p.sent.elapsed() >= timeout());
    // A HELLO not answered yet: a supervisor that is stopped would not answer this USE
    // either; the round trip says so at once.
    let unanswered = c.pending.front().is_some_and(|p| p.path.is_none());
    if overdue || c.pending.len() >= MAX_PENDING || (unanswered && stopped(c.supervisor)) {
        return false;
    }
    let text = Request::Use(path.to_owned()).encode();
    // (No logging here: never while holding `IO`, see the module docs.)
    if c.send_all(text.as_bytes(), Instant::now() + timeout())
        .is_err()
    {
        lose(io);
        return false;
    }
    c.pending.push_back(Pending {
        path: Some(path.to_owned()),
        sent: Instant::now(),
    });
    true
}

/// Why a segment this process attached without waiting is not covered by the supervisor
/// (learnt after the attach returned), once.
pub fn take_late() -> Option<String> {
    lock_state().late.take()
}

/// Whether this process told the supervisor that it uses `path` (its answer may not be
/// read yet) and the supervisor did not refuse it.
pub fn registered(path: &Path) -> bool {
    lock_state()
        .uses
        .get(path)
        .is_some_and(|u| u.count > 0 && !u.refused)
}

/// Read the replies to this process's requests that are still pending (called before
/// questions about what the supervisor tracks, so that the answer includes every segment
/// this process attached before asking).
pub fn settle() {
    let mut io = lock(&IO);
    if io.pid != std::process::id() {
        return;
    }
    let Some(c) = io.conn.as_mut() else {
        return;
    };
    if let Err(e) = c.settle(Instant::now() + timeout()) {
        let err = fail(c, e);
        lose(&mut io);
        drop(io);
        give_up(&err);
    }
}

/// This process no longer uses the segment at `path` (its last mapping here is gone).
/// Never blocks on the supervisor: the DROP is queued for the sender thread.
pub fn drop_segment(path: &Path) {
    let mut st = lock(state());
    let Some(u) = st.uses.get_mut(path) else {
        return;
    };
    u.count -= 1;
    if u.count > 0 {
        return;
    }
    let refused = u.refused;
    st.uses.remove(path);
    if refused {
        return; // never registered
    }
    st.drops.insert(path.to_owned());
    let me = std::process::id();
    if st.sender != me {
        let started = spawn_without_signals("shmstore-drops", send_drops);
        if started.is_ok() {
            st.sender = me;
        }
    }
    WAKE.notify_one();
}

/// The sender thread: waits for queued DROPs and sends them in batches.
pub(super) fn send_drops() {
    loop {
        {
            let mut st = lock(state());
            while st.drops.is_empty() {
                st = WAKE.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
        flush_drops();
    }
}

/// Send every queued DROP now (what the sender thread does; tests call it to wait).
pub fn flush_drops() {
    let mut io = lock(&IO);
    let paths: Vec<PathBuf> = lock(state()).drops.drain().collect();
    // Many DROPs per line (up to ~1 MiB): the supervisor settles a line with one /proc scan.
    let mut batch: Vec<Request> = Vec::new();
    let mut line: Vec<PathBuf> = Vec::new();
    let mut bytes = 0;
    for p in paths {
        bytes += p.as_os_str().len() + 1;
        line.push(p);
        if bytes >= DROP_LINE_BYTES {
            batch.push(Request::DropMany(std::mem::take(&mut line)));
            bytes = 0;
        }
    }
    match line.len() {
        0 => {}
        1 => batch.push(Request::Drop(line.remove(0))),
        _ => batch.push(Request::DropMany(line)),
    }
    if batch.is_empty() || io.pid != std::process::id() {
        return;
    }
    let Some(c) = io.conn.as_mut() else {
        return; // not connected: the supervisor has none of them registered
    };
    let mut res = Ok(());
    for chunk in batch.chunks(BATCH) {
        res = c.requests(chunk, Instant::now() + timeout());
        if res.is_err() {
            break;
        }
    }
    if let Err(e) = res {
        // Closing the connection drops all our registrations at once; the supervisor's
        // /proc check still sees what we map. The next call reconnects and re-registers.
        let err = fail(c, e);
        lose(&mut io);
        drop(io);
        give_up(&err);
    }
}
