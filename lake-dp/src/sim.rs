//! A simulated storage backend: an in-memory disk that completes I/O in
//! virtual time and injects faults from one seeded PRNG — EIO, short
//! transfers, torn writes, reordering, latency, stale duplicate completions,
//! failed fdatasyncs, and crash-and-restart (process crash or power loss).
//!
//! The real poller runs unchanged on top of it, so a failing seed replays
//! the exact same run.

use crate::io::{IoBackend, IoCompletion, IoKind, IoOp};
use crate::rng::SimRng;
use crate::tag::Tag;
use crate::usize_from;

/// Fault rates (per million ops) and latencies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimFaults {
    /// Reads and writes that fail with EIO (a failing write may land torn).
    pub eio_ppm: u32,
    /// Reads and writes that transfer only part of their bytes.
    pub short_ppm: u32,
    /// fdatasyncs that fail with EIO (nothing becomes durable).
    pub fsync_eio_ppm: u32,
    /// Completions followed by a stale duplicate of an older completion.
    pub stale_duplicate_ppm: u32,
    /// Completion latency range.
    pub latency_min_ns: u64,
    /// Completion latency range (inclusive upper bound).
    pub latency_max_ns: u64,
    /// Deliver due completions in random order rather than by due time.
    pub reorder: bool,
}

impl SimFaults {
    /// No faults, fixed latency: the simulator as a plain fast disk.
    pub fn none(latency_ns: u64) -> Self {
        Self {
            eio_ppm: 0,
            short_ppm: 0,
            fsync_eio_ppm: 0,
            stale_duplicate_ppm: 0,
            latency_min_ns: latency_ns,
            latency_max_ns: latency_ns,
            reorder: false,
        }
    }
}

/// How a simulated crash ends the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashKind {
    /// The process dies; the device and its caches survive. Every completed
    /// write stays; writes in flight land torn, whole or not at all.
    Process,
    /// Power is lost: writes not covered by a completed fdatasync may each be
    /// lost, kept or torn; in-flight writes too.
    PowerLoss,
}

/// Counters of what the simulator injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Ops completed.
    pub completed: u64,
    /// EIOs injected.
    pub eio: u64,
    /// Short transfers injected.
    pub short: u64,
    /// Writes that landed torn (on error or at a crash).
    pub torn: u64,
    /// fdatasync failures injected.
    pub fsync_eio: u64,
    /// Stale duplicate completions delivered.
    pub stale_duplicates: u64,
    /// Completions from before a crash delivered after it.
    pub ghosts: u64,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    op: IoOp,
    /// When the op completes; `None` until submitted.
    due_ns: Option<u64>,
}

/// One simulated file: what the device shows now, and what is on media
/// for certain (as of the last successful fdatasync).
#[derive(Debug)]
struct SimFile {
    volatile: Vec<u8>,
    durable: Vec<u8>,
    /// Writes completed since the last successful fdatasync: (offset, len).
    unflushed: Vec<(u64, u64)>,
}

/// Largest number of writes remembered per file between fdatasyncs.
const UNFLUSHED_MAX: usize = 4096;
/// Tags remembered for stale duplicates and ghosts.
const RECENT_MAX: usize = 64;

/// The simulated disk. See the module docs.
#[derive(Debug)]
pub struct SimDisk {
    rng: SimRng,
    faults: SimFaults,
    depth: usize,
    files: Vec<SimFile>,
    pending: Vec<Pending>,
    recent: Vec<Tag>,
    ghosts: Vec<Tag>,
    stats: SimStats,
}

impl SimDisk {
    /// A disk of `files` zeroed files of `file_bytes`, a queue `depth` deep,
    /// driven by `seed`.
    pub fn new(seed: u64, faults: SimFaults, depth: usize, files: usize, file_bytes: usize) -> Self {
        Self {
            rng: SimRng::new(seed),
            faults,
            depth: depth.max(1),
            files: (0..files)
                .map(|_| SimFile {
                    volatile: vec![0; file_bytes],
                    durable: vec![0; file_bytes],
                    unflushed: Vec::with_capacity(UNFLUSHED_MAX),
                })
                .collect(),
            pending: Vec::with_capacity(depth.max(1)),
            recent: Vec::with_capacity(RECENT_MAX),
            ghosts: Vec::with_capacity(RECENT_MAX),
            stats: SimStats::default(),
        }
    }

    /// What was injected so far.
    pub fn stats(&self) -> &SimStats {
        &self.stats
    }

    /// Changes the fault rates (a test may calm the disk to drain it).
    pub fn set_faults(&mut self, faults: SimFaults) {
        self.faults = faults;
    }

    /// Flips bits of one byte on the media (a latent sector error, bit rot):
    /// both what the device shows and what survives a power loss.
    pub fn corrupt_byte(&mut self, file: usize, offset: usize, mask: u8) {
        if let Some(file) = self.files.get_mut(file)
            && offset < file.volatile.len()
        {
            file.volatile[offset] ^= mask;
            file.durable[offset] ^= mask;
        }
    }

    /// The bytes the device currently shows for `file` (for test oracles).
    pub fn file(&self, file: usize) -> Option<&[u8]> {
        self.files.get(file).map(|f| f.volatile.as_slice())
    }

    /// Ends the process that drove this disk: every op in flight is dropped
    /// (writes land torn, whole or not at all), and for a power loss the
    /// unflushed writes are rolled back, kept or torn. Completions of the
    /// dropped ops may still be delivered later as ghosts (their tags carry
    /// the old epoch).
    ///
    /// # Safety
    ///
    /// The buffers of the ops in flight must still be valid (the L1 region
    /// must outlive the crashed poller), as [`IoBackend::push`] required.
    pub unsafe fn crash(&mut self, kind: CrashKind) {
        let pending = core::mem::take(&mut self.pending);
        for Pending { op, .. } in &pending {
            if op.kind == IoKind::Write {
                match self.rng.below(3) {
                    0 => {}
                    1 => {
                        // SAFETY: the caller guarantees the buffer is valid.
                        unsafe { self.apply_write(op, op.len as usize) };
                    }
                    _ => {
                        let cut = usize_from(self.rng.below(u64::from(op.len)));
                        // SAFETY: as above.
                        unsafe { self.apply_write(op, cut) };
                        self.stats.torn += 1;
                    }
                }
            }
            if self.ghosts.len() < RECENT_MAX {
                self.ghosts.push(op.tag);
            }
        }
        self.pending = pending;
        self.pending.clear();
        if kind == CrashKind::PowerLoss {
            for index in 0..self.files.len() {
                self.lose_power(index);
            }
        }
    }

    fn lose_power(&mut self, index: usize) {
        let file = &mut self.files[index];
        let shown = core::mem::take(&mut file.volatile);
        let mut writes = core::mem::take(&mut file.unflushed);
        // Start from the media's certain state, then let each unflushed
        // write survive whole, torn, or not at all.
        let mut media = file.durable.clone();
        for &(offset, len) in &writes {
            let start = usize_from(offset);
            let end = start + usize_from(len);
            match self.rng.below(3) {
                0 => {}
                1 => media[start..end].copy_from_slice(&shown[start..end]),
                _ => {
                    let cut = start + usize_from(self.rng.below(len));
                    media[start..cut].copy_from_slice(&shown[start..cut]);
                    self.stats.torn += 1;
                }
            }
        }
        writes.clear();
        let file = &mut self.files[index];
        file.durable.copy_from_slice(&media);
        file.volatile = media;
        file.unflushed = writes;
    }

    /// Writes the first `len` bytes of `op`'s buffer to the device.
    ///
    /// # Safety
    ///
    /// `op.buf` must be valid for `op.len` bytes.
    unsafe fn apply_write(&mut self, op: &IoOp, len: usize) {
        let Some(file) = self.files.get_mut(usize::from(op.file)) else { return };
        let start = usize_from(op.offset);
        let end = (start + len).min(file.volatile.len());
        if start >= end {
            return;
        }
        // SAFETY: the caller guarantees `buf` is valid for op.len >= len.
        let source = unsafe { core::slice::from_raw_parts(op.buf, end - start) };
        file.volatile[start..end].copy_from_slice(source);
        if file.unflushed.len() < UNFLUSHED_MAX {
            file.unflushed.push((start as u64, (end - start) as u64));
        } else {
            // Too many to track one by one: treat the whole file as written.
            file.unflushed.clear();
            let whole = file.volatile.len() as u64;
            file.unflushed.push((0, whole));
        }
    }

    /// Performs `op` at completion time and returns its result.
    ///
    /// # Safety
    ///
    /// `op.buf` must be valid for `op.len` bytes (push's contract).
    unsafe fn perform(&mut self, op: &IoOp) -> i32 {
        let Some(file_len) = self.files.get(usize::from(op.file)).map(|f| f.volatile.len()) else {
            return -libc::EBADF;
        };
        let len = op.len as usize;
        let start = usize_from(op.offset);
        if op.kind != IoKind::Fsync && (start.checked_add(len).is_none_or(|end| end > file_len)) {
            return -libc::EINVAL;
        }
        match op.kind {
            IoKind::Fsync => {
                if self.rng.chance(self.faults.fsync_eio_ppm) {
                    self.stats.fsync_eio += 1;
                    return -libc::EIO;
                }
                let file = &mut self.files[usize::from(op.file)];
                file.durable.copy_from_slice(&file.volatile);
                file.unflushed.clear();
                0
            }
            IoKind::Read => {
                let eio = self.rng.chance(self.faults.eio_ppm);
                let short = !eio && self.rng.chance(self.faults.short_ppm);
                let moved = if short { usize_from(self.rng.below(len as u64)) } else { len };
                // SAFETY: valid for len bytes (caller); no other user.
                let target = unsafe { core::slice::from_raw_parts_mut(op.buf, len) };
                if eio {
                    // After EIO the buffer holds garbage: never trust it.
                    let garbage = self.rng.next_u64().to_le_bytes();
                    for (i, byte) in target.iter_mut().enumerate().take(4096) {
                        *byte = garbage[i % 8];
                    }
                    self.stats.eio += 1;
                    return -libc::EIO;
                }
                let file = &self.files[usize::from(op.file)];
                target[..moved].copy_from_slice(&file.volatile[start..start + moved]);
                if short {
                    self.stats.short += 1;
                }
                i32::try_from(moved).unwrap_or(i32::MAX)
            }
            IoKind::Write => {
                if self.rng.chance(self.faults.eio_ppm) {
                    let cut = usize_from(self.rng.below(len as u64));
                    // SAFETY: valid for len bytes (caller).
                    unsafe { self.apply_write(op, cut) };
                    self.stats.eio += 1;
                    self.stats.torn += 1;
                    return -libc::EIO;
                }
                let moved =
                    if self.rng.chance(self.faults.short_ppm) { usize_from(self.rng.below(len as u64)) } else { len };
                // SAFETY: valid for len bytes (caller).
                unsafe { self.apply_write(op, moved) };
                if moved < len {
                    self.stats.short += 1;
                }
                i32::try_from(moved).unwrap_or(i32::MAX)
            }
        }
    }
}

impl IoBackend for SimDisk {
    fn queue_depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    unsafe fn push(&mut self, op: IoOp) -> Result<(), IoOp> {
        if self.pending.len() >= self.depth {
            return Err(op);
        }
        self.pending.push(Pending { op, due_ns: None });
        Ok(())
    }

    fn submit(&mut self, now_ns: u64) -> std::io::Result<usize> {
        let mut submitted = 0;
        let span = self.faults.latency_max_ns.saturating_sub(self.faults.latency_min_ns);
        for index in 0..self.pending.len() {
            if self.pending[index].due_ns.is_none() {
                let latency = self.faults.latency_min_ns + self.rng.below(span + 1);
                self.pending[index].due_ns = Some(now_ns + latency);
                submitted += 1;
            }
        }
        Ok(submitted)
    }

    fn complete(&mut self, now_ns: u64, out: &mut [IoCompletion]) -> usize {
        let mut count = 0;
        // Ghosts from before a crash come first, as a slow device would
        // deliver them.
        while count < out.len() {
            let Some(tag) = self.ghosts.pop() else { break };
            out[count] = IoCompletion { tag, result: -libc::ECANCELED };
            self.stats.ghosts += 1;
            count += 1;
        }
        while count < out.len() {
            // Pick a due op: the earliest, or a random due one.
            let mut chosen: Option<usize> = None;
            let mut due_count = 0u64;
            for (index, pending) in self.pending.iter().enumerate() {
                let Some(due_ns) = pending.due_ns else { continue };
                if due_ns > now_ns {
                    continue;
                }
                due_count += 1;
                chosen = match chosen {
                    None => Some(index),
                    Some(best) if self.faults.reorder => {
                        // Reservoir sampling keeps the choice uniform.
                        if self.rng.below(due_count) == 0 { Some(index) } else { Some(best) }
                    }
                    Some(best) => {
                        let best_due = self.pending[best].due_ns.unwrap_or(u64::MAX);
                        if due_ns < best_due { Some(index) } else { Some(best) }
                    }
                };
            }
            let Some(index) = chosen else { break };
            let Pending { op, .. } = self.pending.swap_remove(index);
            // SAFETY: the op was pushed under push's contract and its
            // completion has not been returned yet.
            let result = unsafe { self.perform(&op) };
            out[count] = IoCompletion { tag: op.tag, result };
            self.stats.completed += 1;
            count += 1;
            if self.recent.len() == RECENT_MAX {
                self.recent.swap_remove(usize_from(self.rng.below(RECENT_MAX as u64)));
            }
            self.recent.push(op.tag);
            if count < out.len() && self.rng.chance(self.faults.stale_duplicate_ppm) {
                let pick = usize_from(self.rng.below(self.recent.len() as u64));
                out[count] = IoCompletion { tag: self.recent[pick], result: 0 };
                self.stats.stale_duplicates += 1;
                count += 1;
            }
        }
        count
    }
}
