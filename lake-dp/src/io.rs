//! The storage edge: what the poller asks of an I/O backend. The real one
//! is io_uring over O_DIRECT files ([`crate::uring`]); the simulated one is
//! an in-memory disk with injected faults ([`crate::sim`]). Both are driven
//! only by the poller's thread and never block.

use crate::tag::Tag;

/// What an I/O does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// Read `len` bytes at `offset` into the buffer.
    Read,
    /// Write `len` bytes of the buffer at `offset`.
    Write,
    /// Flush the file's written data to stable storage (fdatasync).
    Fsync,
}

/// One I/O, shaped like an io_uring SQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoOp {
    /// What to do.
    pub kind: IoKind,
    /// The backend's file index (registered file).
    pub file: u16,
    /// Byte offset in the file (4 KiB aligned for O_DIRECT).
    pub offset: u64,
    /// The buffer (null for [`IoKind::Fsync`]).
    pub buf: *mut u8,
    /// Bytes (0 for [`IoKind::Fsync`]).
    pub len: u32,
    /// Returned with the completion.
    pub tag: Tag,
}

/// One completion, shaped like an io_uring CQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IoCompletion {
    /// The tag of the op.
    pub tag: Tag,
    /// Bytes transferred, or a negated errno.
    pub result: i32,
}

/// A storage backend driven by one poller thread.
pub trait IoBackend {
    /// Most ops that can be queued and in flight at once.
    fn queue_depth(&self) -> usize;

    /// Ops pushed and not yet completed.
    fn in_flight(&self) -> usize;

    /// Queues `op`; a full queue hands it back.
    ///
    /// # Safety
    ///
    /// For reads and writes, `op.buf` must be valid for `op.len` bytes and
    /// must not be read or written by anyone else until this backend returns
    /// the completion carrying `op.tag` (or is dropped). The poller upholds
    /// this by giving each in-flight op exclusive use of its L1 slot.
    unsafe fn push(&mut self, op: IoOp) -> Result<(), IoOp>;

    /// Hands queued ops to the device without waiting. Returns how many.
    fn submit(&mut self, now_ns: u64) -> std::io::Result<usize>;

    /// Moves up to `out.len()` completions into `out`; returns how many.
    fn complete(&mut self, now_ns: u64, out: &mut [IoCompletion]) -> usize;
}

/// The clock edge: monotonic nanoseconds. The poller never reads a clock
/// itself (it is handed `now`); runners and simulations supply one.
pub trait Clock {
    /// Monotonic time in nanoseconds.
    fn now_ns(&self) -> u64;
}

/// The machine's monotonic clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is
        // always available on Linux.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        debug_assert_eq!(rc, 0);
        let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
        let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
        secs * 1_000_000_000 + nanos
    }
}
