//! The operating-system edges of the runner: core pinning, the wake-up
//! eventfd, the termination signals as a file descriptor, and parking on
//! both. The one place of the runner with `unsafe`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
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
/// io_uring on a completion, a submitter) writes to it.
#[derive(Debug)]
pub struct Wakeup(OwnedFd);

impl Wakeup {
    /// A non-blocking eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked.
        let fd = check(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
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

/// Parks until the wake-up fires, a signal arrives or `timeout_ms` passes.
/// Returns whether something (rather than the timeout) woke it.
pub fn park(wakeup: &Wakeup, signals: &Signals, timeout_ms: u64) -> io::Result<bool> {
    let mut fds = [
        libc::pollfd { fd: wakeup.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: signals.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    let timeout = libc::c_int::try_from(timeout_ms).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid array of two pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
    if rc < 0 {
        let error = io::Error::last_os_error();
        return if error.kind() == io::ErrorKind::Interrupted { Ok(true) } else { Err(error) };
    }
    wakeup.drain();
    Ok(rc > 0)
}
