//! The real storage backend: io_uring over O_DIRECT files.
//!
//! Files are registered once (`IORING_REGISTER_FILES`), so an SQE names a
//! file by index; the L1 slot memory is registered once as fixed buffers
//! (`IORING_REGISTER_BUFFERS`), so reads and writes between an L1 slot and
//! an L2 slot are `ReadFixed`/`WriteFixed` with no per-I/O page pinning and
//! no copy. The ring is sized at construction and never grows: a full
//! queue hands the op back ([`IoBackend::push`]). Nothing here blocks; the
//! poller's thread is the only user.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{IoUring, opcode, types};

use crate::io::{IoBackend, IoCompletion, IoKind, IoOp};
use crate::region::SlotRegion;
use crate::tag::Tag;
use crate::usize_from;

/// Largest single registered buffer the kernel accepts.
const FIXED_BUFFER_BYTES_MAX: u64 = 1 << 30;

/// Most registered buffers one ring holds (the kernel's limit is 16384).
const FIXED_BUFFERS_MAX: usize = 16_384;

/// A registered buffer: `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FixedSpan {
    start: usize,
    len: usize,
}

/// Which paths the ops took: a slow path is never silent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringStats {
    /// Reads and writes through a registered (fixed) buffer.
    pub fixed: u64,
    /// Reads and writes whose buffer lies outside the registered ones.
    pub unfixed: u64,
    /// fdatasyncs.
    pub fsyncs: u64,
}

/// io_uring over a set of registered files. See the module docs.
pub struct UringBackend {
    ring: IoUring,
    /// Kept open for as long as the ring names them by index.
    files: Vec<File>,
    /// Registered buffers, sorted by start and disjoint.
    fixed: Vec<FixedSpan>,
    depth: usize,
    in_flight: usize,
    stats: UringStats,
}

impl core::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("UringBackend")
            .field("files", &self.files.len())
            .field("fixed_buffers", &self.fixed.len())
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl UringBackend {
    /// A ring of `depth` entries (a power of two, at most 32768) over
    /// `files`, registered in order: file index `i` is `files[i]`.
    pub fn new(files: Vec<File>, depth: u32) -> io::Result<Self> {
        if depth == 0 || !depth.is_power_of_two() || depth > 32_768 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "io_uring depth: a power of two up to 32768"));
        }
        if files.is_empty() || files.len() > usize::from(u16::MAX) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "io_uring files: between 1 and 65535"));
        }
        // Twice the completion entries: completions never overflow even
        // while the poller drains them in bounded batches.
        let ring = IoUring::builder().setup_cqsize(depth * 2).build(depth)?;
        let fds: Vec<RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
        ring.submitter().register_files(&fds)?;
        Ok(Self { ring, files, fixed: Vec::new(), depth: depth as usize, in_flight: 0, stats: UringStats::default() })
    }

    /// Registers `region`'s slots as fixed buffers: whole slots grouped
    /// into buffers of at most 1 GiB, so that every slot lies inside one.
    ///
    /// # Safety
    ///
    /// `region` must stay mapped, at the same address, for as long as this
    /// backend lives (the kernel pins its pages until then).
    pub unsafe fn register_region(&mut self, region: &SlotRegion) -> io::Result<()> {
        if !self.fixed.is_empty() {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "io_uring: buffers already registered"));
        }
        let mut spans: Vec<FixedSpan> = Vec::new();
        let chunk_bytes = region.chunk_bytes();
        if let Some(per_buffer) = FIXED_BUFFER_BYTES_MAX.checked_div(chunk_bytes) {
            // Shared classes: whole chunks per buffer, so that every slot of
            // every class lies inside one.
            let chunks = region.spans().first().map_or(0, |s| u64::from(s.chunks()));
            let per_buffer = per_buffer.max(1);
            let mut chunk = 0u64;
            while chunk < chunks {
                let count = per_buffer.min(chunks - chunk);
                let start = region.base() as usize + usize_from(chunk * chunk_bytes);
                spans.push(FixedSpan { start, len: usize_from(count * chunk_bytes) });
                chunk += count;
            }
        }
        for class in region.spans().iter().filter(|_| chunk_bytes == 0) {
            let per_buffer = (FIXED_BUFFER_BYTES_MAX / class.slot_bytes).max(1);
            let mut slot = 0u64;
            while slot < u64::from(class.slots) {
                let count = per_buffer.min(u64::from(class.slots) - slot);
                let start = region.base() as usize + usize_from(class.offset + slot * class.slot_bytes);
                spans.push(FixedSpan { start, len: usize_from(count * class.slot_bytes) });
                slot += count;
            }
        }
        if spans.len() > FIXED_BUFFERS_MAX {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "io_uring: too many fixed buffers for the region"));
        }
        let iovecs: Vec<libc::iovec> =
            spans.iter().map(|s| libc::iovec { iov_base: s.start as *mut libc::c_void, iov_len: s.len }).collect();
        // SAFETY: every iovec lies inside `region`, which the caller keeps
        // mapped for the backend's life.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }?;
        spans.sort_by_key(|s| s.start);
        self.fixed = spans;
        Ok(())
    }

    /// The registered buffer holding `[buf, buf + len)`, if one does.
    fn fixed_index(&self, buf: *mut u8, len: u32) -> Option<u16> {
        let start = buf as usize;
        let end = start.checked_add(len as usize)?;
        let index = self.fixed.partition_point(|s| s.start <= start).checked_sub(1)?;
        let span = self.fixed[index];
        (end <= span.start + span.len).then(|| u16::try_from(index).ok()).flatten()
    }

    /// Has the kernel signal `eventfd` on every completion, so a parked
    /// runner wakes when I/O finishes.
    pub fn register_eventfd(&self, eventfd: RawFd) -> io::Result<()> {
        self.ring.submitter().register_eventfd(eventfd)
    }

    /// Registered buffers.
    pub fn fixed_buffers(&self) -> usize {
        self.fixed.len()
    }

    /// Counts of the paths taken.
    pub fn stats(&self) -> UringStats {
        self.stats
    }
}

impl IoBackend for UringBackend {
    fn queue_depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn push(&mut self, op: IoOp) -> Result<(), IoOp> {
        if self.in_flight >= self.depth || usize::from(op.file) >= self.files.len() {
            return Err(op);
        }
        let file = types::Fixed(u32::from(op.file));
        let fixed = match op.kind {
            IoKind::Fsync => None,
            IoKind::Read | IoKind::Write => self.fixed_index(op.buf, op.len),
        };
        let entry = match (op.kind, fixed) {
            (IoKind::Read, Some(index)) => {
                opcode::ReadFixed::new(file, op.buf, op.len, index).offset(op.offset).build()
            }
            (IoKind::Read, None) => opcode::Read::new(file, op.buf, op.len).offset(op.offset).build(),
            (IoKind::Write, Some(index)) => {
                opcode::WriteFixed::new(file, op.buf, op.len, index).offset(op.offset).build()
            }
            (IoKind::Write, None) => opcode::Write::new(file, op.buf, op.len).offset(op.offset).build(),
            (IoKind::Fsync, _) => opcode::Fsync::new(file).flags(types::FsyncFlags::DATASYNC).build(),
        };
        let entry = entry.user_data(op.tag.raw());
        // SAFETY: the buffer is valid and exclusively the op's until its
        // completion (this function's contract); the file index is
        // registered (checked above).
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            return Err(op);
        }
        self.in_flight += 1;
        match (op.kind, fixed) {
            (IoKind::Fsync, _) => self.stats.fsyncs += 1,
            (_, Some(_)) => self.stats.fixed += 1,
            (_, None) => self.stats.unfixed += 1,
        }
        Ok(())
    }

    fn submit(&mut self, _now_ns: u64) -> io::Result<usize> {
        match self.ring.submit() {
            Ok(count) => Ok(count),
            // The kernel is short of resources or completions are backed
            // up: try again on the next pass.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY | libc::EINTR)) => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn complete(&mut self, _now_ns: u64, out: &mut [IoCompletion]) -> usize {
        let mut count = 0;
        for (slot, cqe) in out.iter_mut().zip(self.ring.completion()) {
            *slot = IoCompletion { tag: Tag::from_raw(cqe.user_data()), result: cqe.result() };
            count += 1;
        }
        self.in_flight -= count;
        count
    }
}
