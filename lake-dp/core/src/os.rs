//! The operating-system edges of the runner: core pinning, the wake-up
//! eventfd, the termination signals as a file descriptor, parking on
//! both, and the futex a mirror's readers sleep on. The one place of the
//! runner with `unsafe`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// The exit code of a process ended by a panic on one of its threads
/// (`EX_SOFTWARE`).
pub const PANIC_EXIT: u8 = 70;

/// Makes a panic on any thread end the whole process with [`PANIC_EXIT`],
/// after the panic's own message and a line naming `program` and the
/// thread. A service whose worker thread died (an L3 worker, the commit
/// check, a plane) would otherwise go on answering its health checks while
/// its work piles up, and its supervisor would see nothing to restart.
pub fn exit_on_panic(program: &'static str) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        eprintln!("{program}: thread {name} panicked; the process exits so that its supervisor restarts it");
        std::process::exit(i32::from(PANIC_EXIT));
    }));
}

/// Raises this process's soft limit on open files to its hard limit (what
/// the service manager's `LimitNOFILE=` or the shell's `ulimit -Hn`
/// allows); returns the soft limit in force after (unchanged where the
/// kernel refuses more, or where it cannot be read: 1,024 assumed).
pub fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: a valid pointer to a limit no higher than the hard one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) } == 0 {
            limit = raised;
        }
    }
    limit.rlim_cur
}

/// The cores this process may run on.
pub fn allowed_cores() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: a valid out-pointer of the size given.
    check(unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut set) })?;
    // SAFETY: CPU_ISSET reads the set; the index is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect())
}

/// Pins the calling thread to `core`.
pub fn pin_to_core(core: usize) -> io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "core number too large"));
    }
    // SAFETY: as above.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: the index is below CPU_SETSIZE (checked).
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: a valid set of the size given; 0 is the calling thread.
    check(unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set) })?;
    Ok(())
}

/// An eventfd: the runner parks on it, and whoever has work for it (the
/// io_uring on a completion, a submitter) writes to it. Submitters write
/// only while the runner says it is parked, so a busy runner costs them no
/// system call.
#[derive(Debug)]
pub struct Wakeup(OwnedFd, AtomicBool, AtomicBool);

impl Wakeup {
    /// A non-blocking eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked.
        let fd = check(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }, AtomicBool::new(false), AtomicBool::new(false)))
    }

    /// The runner refuses saves now, or has room again (what
    /// [`crate::agent::shm::PortFile::set_save_pressure`] says to agents
    /// in other processes, for agents in this one).
    pub fn set_save_pressure(&self, pressure: bool) {
        self.2.store(pressure, Ordering::Relaxed);
    }

    /// Whether the runner refuses saves now.
    pub fn save_pressure(&self) -> bool {
        self.2.load(Ordering::Relaxed)
    }

    /// The runner is about to park (`true`) or has woken (`false`). After
    /// `true` the runner must look for work once more before it parks: a
    /// submitter that queued work before seeing the flag did not wake it.
    pub fn set_parked(&self, parked: bool) {
        self.1.store(parked, Ordering::Relaxed);
        // SeqCst: with the fence in wake_if_parked (store-buffer pattern),
        // either the submitter sees the flag or the runner sees the work.
        fence(Ordering::SeqCst);
    }

    /// Wakes the runner if it is parked (call after queueing work).
    pub fn wake_if_parked(&self) {
        fence(Ordering::SeqCst);
        if self.1.load(Ordering::Relaxed) {
            self.wake();
        }
    }

    /// Wakes the runner.
    pub fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64. A full counter (EAGAIN)
        // already means "awake".
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Clears pending wake-ups.
    fn drain(&self) {
        let mut value = 0u64;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN when none pending.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), (&raw mut value).cast(), 8) };
    }

    /// The descriptor (to register with io_uring).
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// SIGTERM and SIGINT, blocked for the process and read from a signalfd,
/// so a termination request is just another event of the loop.
#[derive(Debug)]
pub struct Signals(OwnedFd);

impl Signals {
    /// Blocks SIGTERM and SIGINT (call before starting other threads, which
    /// inherit the mask) and opens a signalfd for them.
    pub fn new() -> io::Result<Self> {
        Self::with(&[])
    }

    /// [`Signals::new`], and SIGHUP too (`lake serve` re-reads its tenant
    /// keys on it): [`Signals::take`] then gives it like the others, and
    /// the caller tells them apart.
    pub fn with_hangup() -> io::Result<Self> {
        Self::with(&[libc::SIGHUP])
    }

    fn with(extra: &[libc::c_int]) -> io::Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it.
        let mut set: libc::sigset_t = unsafe { core::mem::zeroed() };
        // SAFETY: valid pointers to the set above.
        unsafe {
            libc::sigemptyset(&raw mut set);
        }
        // SAFETY: as above.
        unsafe {
            libc::sigaddset(&raw mut set, libc::SIGTERM);
        }
        // SAFETY: as above.
        unsafe {
            libc::sigaddset(&raw mut set, libc::SIGINT);
        }
        for &signal in extra {
            // SAFETY: as above.
            unsafe {
                libc::sigaddset(&raw mut set, signal);
            }
        }
        // SAFETY: a valid set; the old mask is not wanted.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, core::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: a valid set; -1 asks for a new descriptor.
        let fd = check(unsafe { libc::signalfd(-1, &raw const set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) })?;
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// A pending termination signal's number, if one arrived.
    pub fn take(&self) -> Option<i32> {
        // SAFETY: signalfd_siginfo is plain data.
        let mut info: libc::signalfd_siginfo = unsafe { core::mem::zeroed() };
        let size = size_of::<libc::signalfd_siginfo>();
        // SAFETY: reads at most `size` bytes into `info`.
        let got = unsafe { libc::read(self.0.as_raw_fd(), (&raw mut info).cast(), size) };
        (usize::try_from(got).ok() == Some(size)).then(|| i32::try_from(info.ssi_signo).unwrap_or(0))
    }
}

/// Waits until one of `fds` has input (or its peer closed), or `timeout`
/// passes: a loop that polls sockets it does not own through an event
/// loop waits here rather than sleeping. Returns whether one has.
pub fn wait_readable(fds: &[RawFd], timeout: std::time::Duration) -> io::Result<bool> {
    let mut polls: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let count = libc::nfds_t::try_from(polls.len()).unwrap_or(libc::nfds_t::MAX);
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `polls` is an array of `count` pollfd for the call's length.
    let rc = unsafe { libc::poll(polls.as_mut_ptr(), count, ms) };
    if rc >= 0 {
        return Ok(rc > 0);
    }
    let error = io::Error::last_os_error();
    if error.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(error) }
}

/// Sleeps while `word` holds `seen`, at most `timeout`: a futex shared
/// between processes (the word lies in a mapping several map). Returns
/// at the timeout, on a wake, on a signal, or at once where the word no
/// longer holds `seen`; the caller looks again whichever it was.
pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: std::time::Duration) {
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos().cast_signed()),
    };
    // SAFETY: `word` is a live, aligned u32 for the call's length; a
    // FUTEX_WAIT only reads it (a read-only mapping serves).
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &raw const timeout, 0usize, 0u32);
    }
}

/// Wakes every process sleeping on `word` ([`futex_wait`]).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; a FUTEX_WAKE uses only its
    // address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Descriptors besides the wake-up and the signals a park waits on, at
/// most: the link to `lake-cp`, the transport's poll, the attach socket
/// and its agents.
pub const PARK_FDS_MAX: usize = 1 + 1 + 1 + 1024;

/// Parks until the wake-up fires, a signal arrives, one of `extra` (the
/// link to `lake-cp`, the attach socket and its agents) has input or
/// closes, or `timeout_ms` passes. Returns whether something (rather than
/// the timeout) woke it. `fds` is the caller's scratch, sized once.
pub fn park(
    wakeup: &Wakeup,
    signals: Option<&Signals>,
    extra: &[RawFd],
    fds: &mut Vec<libc::pollfd>,
    timeout_ms: u64,
) -> io::Result<bool> {
    fds.clear();
    fds.push(libc::pollfd { fd: wakeup.0.as_raw_fd(), events: libc::POLLIN, revents: 0 });
    // A negative descriptor is skipped by poll(2): no signals to watch.
    let signal_fd = signals.map_or(-1, |s| s.0.as_raw_fd());
    fds.push(libc::pollfd { fd: signal_fd, events: libc::POLLIN, revents: 0 });
    for &fd in extra.iter().take(fds.capacity().saturating_sub(2)) {
        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
    }
    let timeout = libc::c_int::try_from(timeout_ms).unwrap_or(libc::c_int::MAX);
    let count = libc::nfds_t::try_from(fds.len()).unwrap_or(2);
    // SAFETY: a valid array of `count` pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), count, timeout) };
    if rc < 0 {
        let error = io::Error::last_os_error();
        return if error.kind() == io::ErrorKind::Interrupted { Ok(true) } else { Err(error) };
    }
    wakeup.drain();
    Ok(rc > 0)
}

/// Most descriptors passed in one message.
pub const FDS_MAX: usize = 8;

/// Sends `bytes` on the Unix stream `socket` with `fds` attached
/// (`SCM_RIGHTS`, at most [`FDS_MAX`]). Returns the bytes sent.
pub fn send_with_fds(socket: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if fds.len() > FDS_MAX {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // Room for the control message, aligned for cmsghdr.
    let mut control = [0u64; 8];
    let fd_bytes = u32::try_from(size_of_val(fds)).unwrap_or(0);
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // SAFETY: msghdr is plain data; all zeroes is valid.
    let mut message: libc::msghdr = unsafe { core::mem::zeroed() };
    message.msg_iov = &raw mut iov;
    message.msg_iovlen = 1;
    if !fds.is_empty() {
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = space;
        // SAFETY: msg_control points at `control` (64 bytes ≥ space for eight
        // descriptors), so the first header is inside it.
        let header = unsafe { libc::CMSG_FIRSTHDR(&raw const message) };
        // SAFETY: a pure size computation.
        let len = unsafe { libc::CMSG_LEN(fd_bytes) } as usize;
        let value = libc::cmsghdr { cmsg_len: len, cmsg_level: libc::SOL_SOCKET, cmsg_type: libc::SCM_RIGHTS };
        // SAFETY: `header` is inside `control`, aligned for cmsghdr.
        unsafe { header.write(value) };
        // SAFETY: `header` is a valid header inside `control`.
        let data = unsafe { libc::CMSG_DATA(header) }.cast::<RawFd>();
        // SAFETY: `data` has room for `fds` (CMSG_SPACE counted them) and
        // does not overlap them.
        unsafe { core::ptr::copy_nonoverlapping(fds.as_ptr(), data, fds.len()) };
    }
    // SAFETY: a valid message over live buffers; MSG_NOSIGNAL: a closed
    // peer is an error, not a signal.
    let sent = unsafe { libc::sendmsg(socket, &raw const message, libc::MSG_NOSIGNAL) };
    usize::try_from(sent).map_err(|_| io::Error::last_os_error())
}

/// Receives into `buffer` from the Unix stream `socket`, appending the
/// descriptors that came with it to `fds` (each close-on-exec). Returns the
/// bytes received (0: the peer closed).
pub fn recv_with_fds(socket: RawFd, buffer: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: buffer.as_mut_ptr().cast(), iov_len: buffer.len() };
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; all zeroes is valid.
    let mut message: libc::msghdr = unsafe { core::mem::zeroed() };
    message.msg_iov = &raw mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = size_of_val(&control);
    // SAFETY: a valid message over live buffers.
    let received = unsafe { libc::recvmsg(socket, &raw mut message, libc::MSG_CMSG_CLOEXEC) };
    let received = usize::try_from(received).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: the kernel filled the control area; the macros walk it
    // within msg_controllen.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(&raw const message) };
    while !header.is_null() {
        // SAFETY: a header the kernel wrote inside `control`.
        let value = unsafe { header.read() };
        if value.cmsg_level == libc::SOL_SOCKET && value.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: pure size computation.
            let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = value.cmsg_len.saturating_sub(header_len) / size_of::<RawFd>();
            // SAFETY: a valid header inside `control`.
            let data = unsafe { libc::CMSG_DATA(header) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: within the header's data (count from its length);
                // unaligned read tolerated.
                let fd = unsafe { data.wrapping_add(i).read_unaligned() };
                // SAFETY: the kernel installed this descriptor for us; we
                // are its only owner.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: walks to the next header within msg_controllen.
        header = unsafe { libc::CMSG_NXTHDR(&raw const message, header) };
    }
    Ok(received)
}

/// Whether the peer of the stream socket `fd` has closed it (without
/// waiting, and without consuming anything it sent).
pub fn peer_closed(fd: RawFd) -> bool {
    let mut poll = libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd; zero timeout.
    let rc = unsafe { libc::poll(&raw mut poll, 1, 0) };
    rc > 0 && poll.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
}
