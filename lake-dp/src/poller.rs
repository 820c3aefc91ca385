//! The poller: a value the embedder drives, never a thread of its own.
//!
//! ```text
//! poll(now, budget):
//!   1. intake     drain the command ring (bounded), admit into op slots
//!   2. io reap    drain backend completions (bounded), check tags, verify
//!   3. timers     deadlines of waiting ops, batched fdatasync
//!   4. issue      highest priority first, until the device queue is full
//!   5. events     into the events ring, if one is attached
//!   → Busy if any stage did work, else Idle
//! ```
//!
//! What else a node's loop does — agents' ports, the control plane's
//! link, the transport, L3 — are the runner's own stages around this one
//! (`runner::serve`), not plugged in here.
//!
//! Every pool is sized from [`PollerConfig`] when the poller is built; after
//! [`Poller::seal`] nothing allocates (a test with a counting allocator
//! holds it to that). In-flight operations live in a fixed slot array and
//! are named by [`Tag`]s (`epoch | slot | generation`); a completion whose
//! tag does not name a live in-flight op is counted as stale and dropped.
//! A full queue hands the request back; nothing blocks and nothing grows.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::constants::{DIRECT_IO_ALIGN_BYTES, SEGMENTS_MAX, STORED_HEADER_BYTES};
use crate::io::{IoBackend, IoCompletion, IoKind, IoOp};
use crate::model::replica::{Durability, Priority, RegionId};
use crate::op::{
    Command, Done, Event, L2Slot, OpError, ReadBlock, RejectReason, Rejected, Request, Ticket, WriteBlock,
};
use crate::region::SlotRegion;
use crate::ring::{Consumer, Producer};
use crate::stored::{decode_header, encode_header_sealed, object_bytes, segment_crcs};
use crate::tag::{TAG_SLOTS_MAX, Tag};
use crate::wire::message::{Path, PathEntry};

/// Sizes and policies of one poller, fixed at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollerConfig {
    /// The region epoch of this incarnation (persisted and bumped at start).
    pub epoch: u64,
    /// Operation slots: the most requests admitted at once.
    pub ops_max: u32,
    /// Most items one stage handles per pass.
    pub batch_max: u32,
    /// Resubmissions after a short transfer or EAGAIN before giving up.
    pub io_retries_max: u8,
    /// Longest a durable write waits for its fdatasync to be batched.
    pub flush_delay_ns: u64,
    /// Waiting durable writes that trigger an fdatasync at once.
    pub flush_batch: u32,
    /// L2 geometry.
    pub l2: L2Geometry,
    /// Ops of the background classes (write-back, demotion, replication)
    /// in the device at once, at most; 0: no cap. The device serves what
    /// it holds in its own order, so a critical load issued behind a full
    /// queue of writes waits for them: a cap keeps room ahead of it.
    pub background_in_flight_max: u32,
}

/// Whether work of class `priority` is background (write-back, demotion,
/// replication: nobody waits on it), not a load a request waits for.
fn is_background(priority: Priority) -> bool {
    !matches!(priority, Priority::CriticalLoad | Priority::PrefillToDecode)
}

/// The L2 tier as the poller addresses it: `files` files of
/// `slots_per_file` slots of `slot_bytes` each; file `i` is region
/// `region_first + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Geometry {
    /// Files (backend file indices `0..files`).
    pub files: u16,
    /// Slots per file.
    pub slots_per_file: u32,
    /// Bytes per slot (a multiple of 4096).
    pub slot_bytes: u64,
    /// Region id of file 0.
    pub region_first: u16,
}

impl L2Geometry {
    /// The region id of `file`.
    pub fn region(&self, file: u16) -> RegionId {
        RegionId(self.region_first.wrapping_add(file))
    }

    /// Byte offset of a slot in its file.
    pub fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }
}

/// Why a poller could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// A field is out of range; the name says which.
    Field(&'static str),
}

impl core::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Field(field) => write!(f, "poller config field `{field}` is out of range"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// What a poll pass found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollResult {
    /// Nothing to do: the runner may back off.
    Idle,
    /// Work was done: poll again soon.
    Busy,
}

/// Counters, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollerStats {
    /// Poll passes.
    pub polls: u64,
    /// Passes that did work.
    pub busy_polls: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests handed back because every op slot was in use.
    pub rejected_full: u64,
    /// Ops finished successfully.
    pub completed_ok: u64,
    /// Ops finished with an error.
    pub completed_err: u64,
    /// Completions that named no live op (stale epoch, slot or generation).
    pub stale_completions: u64,
    /// Resubmissions (short transfers, EAGAIN).
    pub retries: u64,
    /// Bytes read from L2 into L1 by successful reads.
    pub l2_bytes_read: u64,
    /// Bytes written from L1 to L2 by successful writes.
    pub l2_bytes_written: u64,
    /// fdatasyncs completed.
    pub flushes: u64,
    /// Ops issued per priority class.
    pub issued_by_priority: [u64; Priority::COUNT],
    /// How long ops took, submission to end, by path: L2 reads a request
    /// waits on, other L2 reads, L2 writes (time as the poller's passes
    /// see it).
    pub latency: [PathEntry; 3],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpState {
    Free,
    /// Admitted, waiting in a priority queue (or the retry queue).
    Pending,
    /// Handed to the backend.
    InFlight,
    /// Write acked; waiting for an fdatasync submitted after the ack.
    AwaitFlush,
    /// Finished; waiting to be reaped.
    Done,
}

#[derive(Clone, Copy, Debug)]
struct Op {
    /// Bumped when the slot is freed: tickets name (slot, generation).
    generation: u32,
    /// Bumped at every issue: I/O tags name (slot, io_generation), so a
    /// late completion of an earlier attempt never matches a retry.
    io_generation: u32,
    state: OpState,
    request: Request,
    /// Bytes of the whole transfer, and bytes done so far.
    io_len: u32,
    io_done: u32,
    retries: u8,
    cancelled: bool,
    /// For AwaitFlush: the per-file flush sequence that covers this op.
    flush_needed: u64,
    /// The L1 slot this op holds busy until it is reaped.
    l1_held: Option<u32>,
    outcome: Result<Done, OpError>,
    /// When it was submitted (the poller's last pass).
    submitted_ns: u64,
}

impl Op {
    fn free() -> Self {
        Self {
            generation: 0,
            io_generation: 0,
            state: OpState::Free,
            request: Request {
                command: Command::Flush { file: 0 },
                priority: Priority::Replication,
                deadline_ns: 0,
                cookie: 0,
            },
            io_len: 0,
            io_done: 0,
            retries: 0,
            cancelled: false,
            flush_needed: 0,
            l1_held: None,
            outcome: Err(OpError::Cancelled),
            submitted_ns: 0,
        }
    }
}

/// Per-file fdatasync state. Fsyncs of one file are issued one at a time.
#[derive(Clone, Copy, Debug, Default)]
struct FileFlush {
    /// Fsyncs submitted (a sequence number; one in flight at a time, so
    /// the one completing is always the latest submitted).
    submitted: u64,
    in_flight: bool,
    /// Ops waiting on this file and when the oldest started waiting.
    waiters: u32,
    oldest_wait_ns: u64,
    /// A caller asked for a flush now.
    forced: bool,
}

/// The data-plane poller. See the module docs.
pub struct Poller<B: IoBackend> {
    config: PollerConfig,
    backend: B,
    l1: Arc<SlotRegion>,
    ops: Vec<Op>,
    free: Vec<u32>,
    pending: [VecDeque<u32>; Priority::COUNT],
    /// Background-class ops in the device now
    /// ([`PollerConfig::background_in_flight_max`]).
    background_in_flight: u32,
    /// The time the last pass was given.
    now_ns: u64,
    retry: VecDeque<u32>,
    awaiting_flush: Vec<u32>,
    done: VecDeque<u32>,
    flush: Vec<FileFlush>,
    l1_busy: Vec<bool>,
    completions: Vec<IoCompletion>,
    intake: Option<Consumer<Request>>,
    events_out: Option<Producer<Event>>,
    sealed: bool,
    /// Ops were pushed to the backend but not yet submitted to the device.
    unsubmitted: bool,
    next_sweep_ns: u64,
    stats: PollerStats,
}

impl<B: IoBackend> core::fmt::Debug for Poller<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Poller").field("config", &self.config).field("stats", &self.stats).finish_non_exhaustive()
    }
}

/// [`DIRECT_IO_ALIGN_BYTES`] as a transfer length.
const ALIGN_U32: u32 = 4096;
const _: () = assert!(ALIGN_U32 as usize == DIRECT_IO_ALIGN_BYTES);

/// How often queued ops are checked against their deadlines.
pub const DEADLINE_SWEEP_NS: u64 = 50_000;

fn low24(value: u64) -> u32 {
    // Masked to 24 bits, so it fits.
    u32::try_from(value & 0xff_ffff).unwrap_or(0)
}

impl<B: IoBackend> Poller<B> {
    /// Builds a poller over `backend` and the L1 region, sizing every pool.
    pub fn new(config: PollerConfig, backend: B, l1: Arc<SlotRegion>) -> Result<Self, ConfigError> {
        let files = usize::from(config.l2.files);
        if config.ops_max == 0 || config.ops_max.saturating_add(u32::from(config.l2.files)) > TAG_SLOTS_MAX {
            return Err(ConfigError::Field("ops_max"));
        }
        if config.batch_max == 0 {
            return Err(ConfigError::Field("batch_max"));
        }
        if files == 0 {
            return Err(ConfigError::Field("l2.files"));
        }
        if config.l2.slots_per_file == 0 {
            return Err(ConfigError::Field("l2.slots_per_file"));
        }
        if config.l2.slot_bytes == 0
            || !config.l2.slot_bytes.is_multiple_of(DIRECT_IO_ALIGN_BYTES as u64)
            || config.l2.slot_bytes > u64::from(u32::MAX)
        {
            return Err(ConfigError::Field("l2.slot_bytes"));
        }
        let ops = config.ops_max as usize;
        let queue = || VecDeque::with_capacity(ops);
        Ok(Self {
            config,
            backend,
            ops: vec![Op::free(); ops],
            // Popped from the end: slot 0 first.
            free: (0..config.ops_max).rev().collect(),
            pending: core::array::from_fn(|_| queue()),
            background_in_flight: 0,
            now_ns: 0,
            retry: queue(),
            awaiting_flush: Vec::with_capacity(ops),
            done: queue(),
            flush: vec![FileFlush::default(); files],
            l1_busy: vec![false; l1.slots() as usize],
            l1,
            completions: vec![IoCompletion::default(); config.batch_max as usize],
            intake: None,
            events_out: None,
            sealed: false,
            unsubmitted: false,
            next_sweep_ns: 0,
            stats: PollerStats {
                latency: [Path::L2ReadCritical, Path::L2ReadBackground, Path::L2Write].map(PathEntry::new),
                ..PollerStats::default()
            },
        })
    }

    /// Attaches a ring other threads submit requests through. Before seal.
    pub fn attach_intake(&mut self, intake: Consumer<Request>) -> Result<(), ConfigError> {
        if self.sealed {
            return Err(ConfigError::Field("intake (poller sealed)"));
        }
        self.intake = Some(intake);
        Ok(())
    }

    /// Attaches a ring events are pushed into (instead of [`Poller::reap`]).
    /// While it is full, events wait in the poller. Before seal.
    pub fn attach_events(&mut self, events: Producer<Event>) -> Result<(), ConfigError> {
        if self.sealed {
            return Err(ConfigError::Field("events (poller sealed)"));
        }
        self.events_out = Some(events);
        Ok(())
    }

    /// Ends initialization: from here on the poller never allocates.
    pub fn seal(&mut self) {
        self.sealed = true;
    }

    /// Whether [`Poller::seal`] was called.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// The configuration.
    pub fn config(&self) -> &PollerConfig {
        &self.config
    }

    /// Counters so far.
    pub fn stats(&self) -> &PollerStats {
        &self.stats
    }

    /// The backend (for its own counters, or to inject faults in tests).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Takes the poller apart (a simulated crash, or an orderly shutdown
    /// after draining): its backend and its L1 region.
    pub fn into_parts(self) -> (B, Arc<SlotRegion>) {
        (self.backend, self.l1)
    }

    /// The L1 region.
    pub fn l1(&self) -> &Arc<SlotRegion> {
        &self.l1
    }

    /// Admitted requests that have not been reaped yet.
    pub fn ops_in_use(&self) -> usize {
        self.ops.len() - self.free.len()
    }

    /// Admits a request. A full poller, a busy L1 slot or an invalid
    /// request hands it back.
    // The request is handed back by value: boxing it would allocate on the
    // hot path, which is the one thing the poller never does.
    #[allow(clippy::result_large_err)]
    pub fn submit(&mut self, request: Request) -> Result<Ticket, Rejected> {
        let reject = |reason| Rejected { request, reason };
        self.validate(&request).map_err(|what| reject(RejectReason::Invalid(what)))?;
        self.admit(request)
    }

    #[allow(clippy::result_large_err)] // as for submit
    fn admit(&mut self, request: Request) -> Result<Ticket, Rejected> {
        let reject = |reason| Rejected { request, reason };
        let l1_slot = match request.command {
            Command::Write(write) => Some(write.l1_slot),
            Command::Read(read) => Some(read.l1_slot),
            Command::Flush { .. } => None,
        };
        if let Some(slot) = l1_slot
            && self.l1_busy[slot as usize]
        {
            return Err(reject(RejectReason::L1SlotBusy));
        }
        let Some(index) = self.free.pop() else {
            self.stats.rejected_full += 1;
            return Err(reject(RejectReason::Full));
        };
        if let Some(slot) = l1_slot {
            self.l1_busy[slot as usize] = true;
        }
        self.occupy(index, request, l1_slot);
        match request.command {
            Command::Flush { file } => {
                // No I/O of its own: it waits for the next fdatasync, forced.
                let flush = &mut self.flush[usize::from(file)];
                flush.forced = true;
                self.await_flush(index, file, 0);
            }
            _ => self.pending[request.priority as usize].push_back(index),
        }
        Ok(Ticket(self.tag(index)))
    }

    /// Cancels a request that has not started (or a read in flight, whose
    /// data is then discarded). Returns whether it will end as
    /// [`OpError::Cancelled`]. Writes already sent to the device (in flight,
    /// being retried, or waiting for their fdatasync) finish and report what
    /// really happened.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        let Some(index) = self.ticket_index(ticket) else { return false };
        let op = &mut self.ops[index as usize];
        match op.state {
            // A write being retried was already (partly) sent to the device:
            // it must finish and report what really happened.
            OpState::Pending if op.retries > 0 && matches!(op.request.command, Command::Write(_)) => false,
            OpState::Pending => {
                let queue = &mut self.pending[op.request.priority as usize];
                if let Some(position) = queue.iter().position(|&i| i == index) {
                    queue.remove(position);
                } else if let Some(position) = self.retry.iter().position(|&i| i == index) {
                    self.retry.remove(position);
                }
                self.finish(index, Err(OpError::Cancelled));
                true
            }
            OpState::InFlight if matches!(op.request.command, Command::Read(_)) => {
                op.cancelled = true;
                true
            }
            _ => false,
        }
    }

    /// Moves up to `out.len()` finished events into `out`, freeing their op
    /// slots (and L1 slots) for reuse. Returns how many.
    pub fn reap(&mut self, out: &mut [Event]) -> usize {
        let mut count = 0;
        while count < out.len() {
            let Some(index) = self.done.pop_front() else { break };
            out[count] = self.release(index);
            count += 1;
        }
        count
    }

    /// One bounded pass over every stage. `budget` bounds the items each
    /// stage handles (and is itself capped by `batch_max`).
    pub fn poll(&mut self, now_ns: u64, budget: u32) -> PollResult {
        self.now_ns = now_ns;
        let budget = budget.clamp(1, self.config.batch_max);
        let mut work = 0u32;
        work += self.drain_intake(budget);
        work += self.reap_io(now_ns, budget);
        work += self.run_timers(now_ns);
        work += self.issue(now_ns, budget);
        work += self.push_events(budget);
        self.stats.polls += 1;
        if work > 0 {
            self.stats.busy_polls += 1;
            PollResult::Busy
        } else {
            PollResult::Idle
        }
    }

    /// Whether anything is admitted and unfinished, or waiting to be reaped.
    pub fn has_work(&self) -> bool {
        self.ops_in_use() > 0
    }

    fn validate(&self, request: &Request) -> Result<(), &'static str> {
        let l2 = &self.config.l2;
        let check_l2 = |target: L2Slot| {
            if target.file >= l2.files {
                return Err("L2 file out of range");
            }
            if target.slot >= l2.slots_per_file {
                return Err("L2 slot out of range");
            }
            Ok(())
        };
        let check_len = |payload_len: u64, l1_slot: u32| {
            let l1_bytes = self.l1.slot_len(l1_slot).ok_or("L1 slot out of range")?;
            if payload_len == 0 || object_bytes(payload_len) > l2.slot_bytes {
                return Err("payload does not fit an L2 slot");
            }
            if object_bytes(payload_len) > l1_bytes as u64 {
                return Err("payload does not fit the L1 slot");
            }
            Ok(())
        };
        match request.command {
            Command::Write(WriteBlock { l1_slot, target, meta, durability, .. }) => {
                check_l2(target)?;
                check_len(meta.payload_len, l1_slot)?;
                meta.segment_count().map_err(|_| "segment geometry")?;
                if meta.slot != target.slot {
                    return Err("meta.slot differs from the target slot");
                }
                if meta.region != l2.region(target.file) {
                    return Err("meta.region differs from the target file's region");
                }
                if meta.region_epoch != self.config.epoch {
                    return Err("meta.region_epoch is not this poller's epoch");
                }
                if durability == Durability::Volatile {
                    return Err("an L2 write is at least acked");
                }
            }
            Command::Read(ReadBlock { source, l1_slot, payload_len, .. }) => {
                check_l2(source)?;
                check_len(payload_len, l1_slot)?;
            }
            Command::Flush { file } => {
                if file >= l2.files {
                    return Err("L2 file out of range");
                }
            }
        }
        Ok(())
    }

    fn tag(&self, index: u32) -> Tag {
        Tag::new(self.config.epoch, index, self.ops[index as usize].generation)
    }

    fn flush_tag(&self, file: u16) -> Tag {
        let flush = &self.flush[usize::from(file)];
        // The generation of a flush tag is its sequence number.
        Tag::new(self.config.epoch, self.config.ops_max + u32::from(file), low24(flush.submitted))
    }

    /// The op a ticket names, if it is still admitted.
    fn ticket_index(&self, ticket: Ticket) -> Option<u32> {
        let index = ticket.0.slot();
        let op = self.ops.get(index as usize)?;
        (op.state != OpState::Free && ticket.0.matches(self.config.epoch, index, op.generation)).then_some(index)
    }

    /// The op an I/O completion names, if it names the attempt in flight.
    fn in_flight_index(&self, tag: Tag) -> Option<u32> {
        let index = tag.slot();
        let op = self.ops.get(index as usize)?;
        (op.state == OpState::InFlight && tag.matches(self.config.epoch, index, op.io_generation)).then_some(index)
    }

    fn drain_intake(&mut self, budget: u32) -> u32 {
        let mut admitted = 0;
        while admitted < budget {
            let Some(intake) = self.intake.as_mut() else { break };
            let Some(&request) = intake.peek() else { break };
            let accepted = match self.validate(&request) {
                Ok(()) => self.admit(request).is_ok(),
                // A bad request from a ring cannot be handed back: it takes
                // an op slot and ends at once as an event carrying the error.
                Err(what) => self.admit_invalid(request, what),
            };
            if !accepted {
                // Out of op slots (or the L1 slot is busy): leave it in the
                // ring; backpressure reaches the producer when the ring fills.
                break;
            }
            if let Some(intake) = self.intake.as_mut() {
                intake.pop();
            }
            admitted += 1;
        }
        admitted
    }

    /// Fills a free op slot with a new request, keeping its generations.
    fn occupy(&mut self, index: u32, request: Request, l1_held: Option<u32>) {
        let op = &mut self.ops[index as usize];
        debug_assert_eq!(op.state, OpState::Free);
        let (generation, io_generation) = (op.generation, op.io_generation);
        let submitted_ns = self.now_ns;
        *op = Op { generation, io_generation, state: OpState::Pending, request, l1_held, submitted_ns, ..Op::free() };
        self.stats.admitted += 1;
    }

    fn admit_invalid(&mut self, request: Request, what: &'static str) -> bool {
        let Some(index) = self.free.pop() else { return false };
        self.occupy(index, request, None);
        self.finish(index, Err(OpError::Invalid(what)));
        true
    }

    fn reap_io(&mut self, now_ns: u64, budget: u32) -> u32 {
        let limit = (budget as usize).min(self.completions.len());
        let mut buf = core::mem::take(&mut self.completions);
        let count = self.backend.complete(now_ns, &mut buf[..limit]);
        for completion in &buf[..count] {
            self.on_completion(now_ns, *completion);
        }
        self.completions = buf;
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    fn on_completion(&mut self, now_ns: u64, completion: IoCompletion) {
        let tag = completion.tag;
        let index = tag.slot();
        if index >= self.config.ops_max {
            return self.on_flush_completion(now_ns, tag, completion.result);
        }
        let Some(index) = self.in_flight_index(tag) else {
            self.stats.stale_completions += 1;
            return;
        };
        // It left the device, whatever comes of it.
        if is_background(self.ops[index as usize].request.priority) {
            self.background_in_flight = self.background_in_flight.saturating_sub(1);
        }
        let result = completion.result;
        if self.ops[index as usize].cancelled {
            // Only reads are cancelled in flight; whatever the device did,
            // the requester has given up on the data.
            return self.finish(index, Err(OpError::Cancelled));
        }
        if result < 0 {
            let errno = -result;
            if (errno == libc::EAGAIN || errno == libc::EINTR) && self.try_retry(index) {
                return;
            }
            return self.finish(index, Err(OpError::Io(errno)));
        }
        let op = &mut self.ops[index as usize];
        let moved = u32::try_from(result).unwrap_or(0);
        op.io_done = op.io_done.saturating_add(moved).min(op.io_len);
        let op = *op;
        if op.io_done < op.io_len {
            if moved > 0 && self.try_retry(index) {
                return;
            }
            let op = &self.ops[index as usize];
            let error = OpError::Short { expected: op.io_len, got: op.io_done };
            return self.finish(index, Err(error));
        }
        match op.request.command {
            Command::Read(read) => {
                let outcome = self.verify_read(&read, op.io_len);
                if outcome.is_ok() {
                    self.stats.l2_bytes_read += u64::from(op.io_len);
                }
                self.finish(index, outcome)
            }
            Command::Write(write) => {
                self.stats.l2_bytes_written += u64::from(op.io_len);
                if write.durability == Durability::Durable {
                    self.await_flush(index, write.target.file, now_ns);
                } else {
                    let bytes = u64::from(op.io_len);
                    self.finish(index, Ok(Done { bytes, durability: Durability::Acked }));
                }
            }
            Command::Flush { .. } => self.finish(index, Err(OpError::Io(libc::EINVAL))),
        }
    }

    fn try_retry(&mut self, index: u32) -> bool {
        let op = &mut self.ops[index as usize];
        if op.retries >= self.config.io_retries_max {
            return false;
        }
        op.retries += 1;
        op.state = OpState::Pending;
        self.retry.push_back(index);
        self.stats.retries += 1;
        true
    }

    fn await_flush(&mut self, index: u32, file: u16, now_ns: u64) {
        let flush = &mut self.flush[usize::from(file)];
        let op = &mut self.ops[index as usize];
        op.state = OpState::AwaitFlush;
        // Only an fdatasync submitted after this point covers the op.
        op.flush_needed = flush.submitted + 1;
        if flush.waiters == 0 {
            flush.oldest_wait_ns = now_ns;
        }
        flush.waiters += 1;
        self.awaiting_flush.push(index);
        debug_assert!(self.awaiting_flush.len() <= self.ops.len());
    }

    fn on_flush_completion(&mut self, _now_ns: u64, tag: Tag, result: i32) {
        let file_index = tag.slot() - self.config.ops_max;
        let Ok(file) = u16::try_from(file_index) else {
            self.stats.stale_completions += 1;
            return;
        };
        let epoch_ok = Tag::new(self.config.epoch, 0, 0).epoch_bits() == tag.epoch_bits();
        let Some(flush) = self.flush.get_mut(usize::from(file)) else {
            self.stats.stale_completions += 1;
            return;
        };
        let expected = low24(flush.submitted);
        if !epoch_ok || !flush.in_flight || tag.generation_bits() != expected {
            self.stats.stale_completions += 1;
            return;
        }
        flush.in_flight = false;
        let sequence = flush.submitted;
        self.stats.flushes += 1;
        let outcome_for = |op: &Op| -> Result<Done, OpError> {
            if result < 0 {
                return Err(OpError::FlushFailed(-result));
            }
            let bytes = if matches!(op.request.command, Command::Write(_)) { u64::from(op.io_len) } else { 0 };
            Ok(Done { bytes, durability: Durability::Durable })
        };
        let mut position = 0;
        while position < self.awaiting_flush.len() {
            let index = self.awaiting_flush[position];
            let op = self.ops[index as usize];
            let op_file = match op.request.command {
                Command::Write(write) => write.target.file,
                Command::Flush { file } => file,
                Command::Read(_) => u16::MAX,
            };
            if op_file == file && op.flush_needed <= sequence {
                self.awaiting_flush.swap_remove(position);
                let flush = &mut self.flush[usize::from(file)];
                flush.waiters -= 1;
                self.finish(index, outcome_for(&op));
            } else {
                position += 1;
            }
        }
        let flush = &mut self.flush[usize::from(file)];
        if flush.waiters > 0 {
            // The remaining waiters arrived while this fsync was in flight:
            // flush them without waiting for the batching delay again.
            flush.forced = true;
        }
    }

    fn run_timers(&mut self, now_ns: u64) -> u32 {
        let mut work = self.sweep_deadlines(now_ns);
        for file in 0..self.config.l2.files {
            let flush = self.flush[usize::from(file)];
            if flush.in_flight || flush.waiters == 0 {
                continue;
            }
            let due = flush.forced
                || flush.waiters >= self.config.flush_batch
                || now_ns.saturating_sub(flush.oldest_wait_ns) >= self.config.flush_delay_ns;
            if !due {
                continue;
            }
            let tag = {
                let flush = &mut self.flush[usize::from(file)];
                flush.submitted += 1;
                self.flush_tag(file)
            };
            let op = IoOp { kind: IoKind::Fsync, file, offset: 0, buf: core::ptr::null_mut(), len: 0, tag };
            // SAFETY: an fsync carries no buffer.
            if unsafe { self.backend.push(op) }.is_ok() {
                self.unsubmitted = true;
                let flush = &mut self.flush[usize::from(file)];
                flush.in_flight = true;
                flush.forced = false;
                work += 1;
            } else {
                // Queue full: undo and try next pass.
                self.flush[usize::from(file)].submitted -= 1;
            }
        }
        work
    }

    /// Background-class ops in the device now.
    pub fn background_in_flight(&self) -> u32 {
        self.background_in_flight
    }

    /// Queue `class`: 0 is the retry queue, `1 + p` the queue of priority p.
    fn queue_mut(&mut self, class: usize) -> &mut VecDeque<u32> {
        if class == 0 { &mut self.retry } else { &mut self.pending[class - 1] }
    }

    fn issue(&mut self, now_ns: u64, budget: u32) -> u32 {
        let mut issued = 0;
        let mut device_full = false;
        // The retry queue goes first: those ops already waited their turn.
        for class in 0..=Priority::COUNT {
            while issued < budget && !device_full {
                let Some(&index) = self.queue_mut(class).front() else { break };
                let op = self.ops[index as usize];
                // Background work waits while it fills its share of the
                // device (resumed transfers, in the retry queue, go on).
                let background = is_background(op.request.priority);
                let cap = self.config.background_in_flight_max;
                if class > 0 && background && cap > 0 && self.background_in_flight >= cap {
                    break;
                }
                if op.request.deadline_ns != 0 && now_ns > op.request.deadline_ns && op.io_done == 0 {
                    self.queue_mut(class).pop_front();
                    self.finish(index, Err(OpError::DeadlineExceeded));
                    issued += 1;
                    continue;
                }
                let io = match self.prepare(index) {
                    Ok(io) => io,
                    Err(error) => {
                        self.queue_mut(class).pop_front();
                        self.finish(index, Err(error));
                        issued += 1;
                        continue;
                    }
                };
                // SAFETY: the op owns its L1 slot exclusively from admission
                // (l1_busy) until it is reaped, so the buffer stays valid and
                // untouched by us until the completion arrives.
                if unsafe { self.backend.push(io) }.is_err() {
                    device_full = true;
                    break;
                }
                self.queue_mut(class).pop_front();
                if background {
                    self.background_in_flight += 1;
                }
                let op = &mut self.ops[index as usize];
                op.state = OpState::InFlight;
                self.stats.issued_by_priority[op.request.priority as usize] += 1;
                issued += 1;
            }
            if issued >= budget || device_full {
                break;
            }
        }
        if issued > 0 {
            self.unsubmitted = true;
        }
        if self.unsubmitted {
            // One submission (one io_uring_enter) per pass, and only when
            // something was queued; a failed one is retried next pass while
            // the ops wait in the backend's queue.
            if self.backend.submit(now_ns).is_ok() {
                self.unsubmitted = false;
            }
        }
        issued
    }

    /// Ends every queued op whose deadline has passed (runs every
    /// [`DEADLINE_SWEEP_NS`], so ops stuck behind a full device time out too).
    fn sweep_deadlines(&mut self, now_ns: u64) -> u32 {
        if now_ns < self.next_sweep_ns {
            return 0;
        }
        self.next_sweep_ns = now_ns.saturating_add(DEADLINE_SWEEP_NS);
        let mut expired = 0;
        for class in 0..=Priority::COUNT {
            let mut position = 0;
            while position < self.queue_mut(class).len() {
                let index = self.queue_mut(class)[position];
                let op = self.ops[index as usize];
                if op.request.deadline_ns != 0 && now_ns > op.request.deadline_ns && op.io_done == 0 {
                    self.queue_mut(class).remove(position);
                    self.finish(index, Err(OpError::DeadlineExceeded));
                    expired += 1;
                } else {
                    position += 1;
                }
            }
        }
        expired
    }

    /// Builds the I/O for an op's next (or remaining) transfer. A write's
    /// first attempt seals the header into the L1 slot.
    fn prepare(&mut self, index: u32) -> Result<IoOp, OpError> {
        let op = self.ops[index as usize];
        let l2 = self.config.l2;
        let (kind, target, l1_slot, payload_len) = match op.request.command {
            Command::Write(write) => (IoKind::Write, write.target, write.l1_slot, write.meta.payload_len),
            Command::Read(read) => (IoKind::Read, read.source, read.l1_slot, read.payload_len),
            Command::Flush { .. } => return Err(OpError::Io(libc::EINVAL)),
        };
        let total = u32::try_from(object_bytes(payload_len)).map_err(|_| OpError::Io(libc::EINVAL))?;
        if op.io_done == 0
            && let Command::Write(write) = op.request.command
        {
            self.seal_header(&write)?;
        }
        let base = self.l1.slot_ptr(l1_slot).ok_or(OpError::Io(libc::EINVAL))?;
        let op = &mut self.ops[index as usize];
        op.io_generation = (op.io_generation + 1) & 0xff_ffff;
        let tag = Tag::new(self.config.epoch, index, op.io_generation);
        op.io_len = total;
        // Resume after a short transfer at a 4 KiB boundary (O_DIRECT).
        let resume = op.io_done - op.io_done % ALIGN_U32;
        op.io_done = resume;
        Ok(IoOp {
            kind,
            file: target.file,
            offset: l2.offset(target.slot) + u64::from(resume),
            buf: base.wrapping_add(resume as usize),
            len: total - resume,
            tag,
        })
    }

    fn seal_header(&mut self, write: &WriteBlock) -> Result<(), OpError> {
        // SAFETY: the op owns the L1 slot exclusively (l1_busy) and it is
        // not in flight (first attempt).
        let slot = unsafe { self.l1.slot_mut(write.l1_slot) }.ok_or(OpError::Io(libc::EINVAL))?;
        let payload_len = usize::try_from(write.meta.payload_len).map_err(|_| OpError::Io(libc::EINVAL))?;
        let end = STORED_HEADER_BYTES + payload_len;
        let padded = usize::try_from(object_bytes(write.meta.payload_len)).map_err(|_| OpError::Io(libc::EINVAL))?;
        let (header, body) = slot.split_at_mut(STORED_HEADER_BYTES);
        let mut crcs = [0u32; SEGMENTS_MAX];
        let count =
            segment_crcs(&body[..payload_len], write.meta.segment_bytes, &mut crcs).map_err(OpError::Corrupt)?;
        let header: &mut [u8; STORED_HEADER_BYTES] = header.try_into().map_err(|_| OpError::Io(libc::EINVAL))?;
        encode_header_sealed(&write.meta, &crcs[..usize::from(count)], write.seal.as_ref(), header)
            .map_err(OpError::Corrupt)?;
        // Zero the padding so the object on disk is deterministic.
        slot[end..padded].fill(0);
        Ok(())
    }

    fn verify_read(&self, read: &ReadBlock, io_len: u32) -> Result<Done, OpError> {
        // SAFETY: the read completed and the op still owns the L1 slot.
        let slot = unsafe { self.l1.slot(read.l1_slot) }.ok_or(OpError::Io(libc::EINVAL))?;
        let header = decode_header(slot).map_err(OpError::Corrupt)?;
        let meta = header.meta();
        if meta.key != read.key {
            return Err(OpError::Mismatch("key"));
        }
        if meta.slot != read.source.slot || meta.region != self.config.l2.region(read.source.file) {
            return Err(OpError::Mismatch("slot"));
        }
        if meta.generation != read.generation {
            return Err(OpError::Mismatch("generation"));
        }
        if meta.payload_len != read.payload_len {
            return Err(OpError::Mismatch("payload length"));
        }
        let end =
            usize::try_from(STORED_HEADER_BYTES as u64 + meta.payload_len).map_err(|_| OpError::Io(libc::EINVAL))?;
        let payload = slot.get(STORED_HEADER_BYTES..end).ok_or(OpError::Io(libc::EINVAL))?;
        header.verify_payload(payload).map_err(OpError::Corrupt)?;
        Ok(Done { bytes: u64::from(io_len), durability: Durability::Volatile })
    }

    fn finish(&mut self, index: u32, outcome: Result<Done, OpError>) {
        let op = &mut self.ops[index as usize];
        debug_assert!(op.state != OpState::Free && op.state != OpState::Done);
        op.state = OpState::Done;
        op.outcome = outcome;
        let path = match op.request.command {
            Command::Read(_) if !is_background(op.request.priority) => Some(0),
            Command::Read(_) => Some(1),
            Command::Write(_) => Some(2),
            Command::Flush { .. } => None,
        };
        if let Some(path) = path {
            self.stats.latency[path].record(self.now_ns.saturating_sub(op.submitted_ns));
        }
        if outcome.is_ok() {
            self.stats.completed_ok += 1;
        } else {
            self.stats.completed_err += 1;
        }
        self.done.push_back(index);
        debug_assert!(self.done.len() <= self.ops.len());
    }

    /// The event a done op ends with.
    fn event_of(&self, index: u32) -> Event {
        let op = &self.ops[index as usize];
        debug_assert_eq!(op.state, OpState::Done);
        Event {
            ticket: Ticket(self.tag(index)),
            cookie: op.request.cookie,
            command: op.request.command,
            outcome: op.outcome,
        }
    }

    /// Turns a done op into its event and frees its slots.
    fn release(&mut self, index: u32) -> Event {
        let event = self.event_of(index);
        let op = &mut self.ops[index as usize];
        if let Some(slot) = op.l1_held.take() {
            self.l1_busy[slot as usize] = false;
        }
        op.state = OpState::Free;
        op.generation = op.generation.wrapping_add(1) & 0xff_ffff;
        self.free.push(index);
        event
    }

    fn push_events(&mut self, budget: u32) -> u32 {
        let mut pushed = 0;
        while pushed < budget {
            if self.events_out.is_none() {
                break;
            }
            let Some(&index) = self.done.front() else { break };
            let event = self.event_of(index);
            let Some(out) = self.events_out.as_mut() else { break };
            if out.push(event).is_err() {
                break;
            }
            self.done.pop_front();
            self.release(index);
            pushed += 1;
        }
        pushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::key::BlockKey;
    use crate::model::namespace::NamespaceId;
    use crate::model::replica::ObjectKind;
    use crate::ring::ring;
    use crate::sim::{SimDisk, SimFaults};
    use crate::stored::ObjectMeta;

    const SLOT: u64 = 16 * 1024;

    fn config(ops_max: u32) -> PollerConfig {
        PollerConfig {
            background_in_flight_max: 0,
            epoch: 3,
            ops_max,
            batch_max: 8,
            io_retries_max: 2,
            flush_delay_ns: 10_000,
            flush_batch: 4,
            l2: L2Geometry { files: 1, slots_per_file: 4, slot_bytes: SLOT, region_first: 0 },
        }
    }

    fn poller(ops_max: u32, latency_ns: u64, depth: usize) -> Poller<SimDisk> {
        let disk = SimDisk::new(1, SimFaults::none(latency_ns), depth, 1, 4 * SLOT as usize);
        let region = Arc::new(SlotRegion::heap(SLOT, 4).unwrap());
        Poller::new(config(ops_max), disk, region).unwrap()
    }

    fn write(l1_slot: u32, slot: u32, durability: Durability) -> Request {
        let meta = ObjectMeta {
            kind: ObjectKind::KvBlock,
            key: BlockKey([slot as u8 + 1; 16]),
            parent_key: BlockKey::NONE,
            block_index: 0,
            namespace: NamespaceId(1),
            layout_fingerprint: 2,
            region: RegionId(0),
            region_epoch: 3,
            slot,
            generation: 5,
            committed_unix_ns: 0,
            payload_len: 10_000,
            segment_bytes: 4096,
        };
        let target = L2Slot { file: 0, slot };
        let command = Command::Write(WriteBlock { l1_slot, target, meta, durability, seal: None });
        Request { command, priority: Priority::WriteBack, deadline_ns: 0, cookie: u64::from(slot) }
    }

    fn read(l1_slot: u32, slot: u32) -> Request {
        let command = Command::Read(ReadBlock {
            source: L2Slot { file: 0, slot },
            l1_slot,
            key: BlockKey([slot as u8 + 1; 16]),
            generation: 5,
            payload_len: 10_000,
        });
        Request { command, priority: Priority::CriticalLoad, deadline_ns: 0, cookie: 100 + u64::from(slot) }
    }

    fn run_until_events(poller: &mut Poller<SimDisk>, now: &mut u64, want: usize) -> Vec<Event> {
        let mut events = Vec::new();
        let mut buf = [Event::placeholder(); 8];
        for _ in 0..10_000 {
            *now += 1_000;
            poller.poll(*now, 8);
            let count = poller.reap(&mut buf);
            events.extend_from_slice(&buf[..count]);
            if events.len() >= want {
                break;
            }
        }
        events
    }

    #[test]
    fn durable_write_then_verified_read() {
        let mut p = poller(4, 2_000, 4);
        // SAFETY: no op holds L1 slot 0 yet.
        unsafe { p.l1().slot_mut(0).unwrap()[4096..4096 + 10_000].fill(0xab) };
        let mut now = 0;
        p.submit(write(0, 2, Durability::Durable)).unwrap();
        let events = run_until_events(&mut p, &mut now, 1);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].outcome.unwrap().durability, Durability::Durable);
        assert_eq!(p.stats().flushes, 1);
        p.submit(read(1, 2)).unwrap();
        let events = run_until_events(&mut p, &mut now, 1);
        assert_eq!(events[0].cookie, 102);
        assert!(events[0].outcome.is_ok(), "{:?}", events[0].outcome);
        // SAFETY: the read's event handed L1 slot 1 back.
        let data = unsafe { p.l1().slot(1).unwrap() };
        assert!(data[4096..4096 + 10_000].iter().all(|&b| b == 0xab));
        // A read expecting another generation is refused.
        let mut stale = read(1, 2);
        if let Command::Read(r) = &mut stale.command {
            r.generation = 4;
        }
        p.submit(stale).unwrap();
        let events = run_until_events(&mut p, &mut now, 1);
        assert_eq!(events[0].outcome, Err(OpError::Mismatch("generation")));
    }

    #[test]
    fn a_full_poller_hands_the_request_back() {
        let mut p = poller(1, 1_000, 4);
        let first = write(0, 0, Durability::Acked);
        p.submit(first).unwrap();
        let second = write(1, 1, Durability::Acked);
        let rejected = p.submit(second).unwrap_err();
        assert_eq!(rejected, Rejected { request: second, reason: RejectReason::Full });
        assert_eq!(p.stats().rejected_full, 1);
        // The same L1 slot cannot be used twice at once.
        let mut q = poller(2, 1_000, 4);
        q.submit(first).unwrap();
        assert_eq!(q.submit(read(0, 1)).unwrap_err().reason, RejectReason::L1SlotBusy);
        // Invalid requests are named.
        let mut bad = write(0, 3, Durability::Acked);
        if let Command::Write(w) = &mut bad.command {
            w.meta.region_epoch = 2;
        }
        assert!(matches!(q.submit(bad).unwrap_err().reason, RejectReason::Invalid(_)));
    }

    #[test]
    fn queued_ops_miss_their_deadline_and_cancel() {
        // A one-deep device that takes a second: the second op waits.
        let mut p = poller(4, 1_000_000_000, 1);
        let mut now = 1_000;
        p.submit(write(0, 0, Durability::Acked)).unwrap();
        let mut late = write(1, 1, Durability::Acked);
        late.deadline_ns = 100_000;
        p.submit(late).unwrap();
        let cancelled = p.submit(write(2, 2, Durability::Acked)).unwrap();
        p.poll(now, 8);
        assert!(p.cancel(cancelled));
        now = 200_000;
        p.poll(now, 8);
        let mut buf = [Event {
            ticket: cancelled,
            cookie: 0,
            command: Command::Flush { file: 0 },
            outcome: Ok(Done { bytes: 0, durability: Durability::Volatile }),
        }; 4];
        let count = p.reap(&mut buf);
        let outcomes: Vec<_> = buf[..count].iter().map(|e| (e.cookie, e.outcome)).collect();
        assert!(outcomes.contains(&(2, Err(OpError::Cancelled))), "{outcomes:?}");
        assert!(outcomes.contains(&(1, Err(OpError::DeadlineExceeded))), "{outcomes:?}");
        assert!(!p.cancel(cancelled), "a reaped ticket is gone");
    }

    #[test]
    fn a_read_cancelled_in_flight_ends_cancelled_and_frees_its_slot() {
        let mut p = poller(2, 50_000, 4);
        let mut now = 0;
        let ticket = p.submit(read(0, 1)).unwrap();
        p.poll(now, 8);
        assert_eq!(p.backend().in_flight(), 1);
        assert!(p.cancel(ticket));
        let events = run_until_events(&mut p, &mut now, 1);
        assert_eq!(events[0].outcome, Err(OpError::Cancelled));
        assert_eq!(p.ops_in_use(), 0);
        // L1 slot 0 is free again.
        p.submit(read(0, 1)).unwrap();
    }

    #[test]
    fn background_work_keeps_to_its_share_of_the_device_and_loads_go_past_it() {
        for (cap, expected) in [(0, 4), (2, 3)] {
            let disk = SimDisk::new(1, SimFaults::none(50_000), 8, 1, 4 * SLOT as usize);
            let region = Arc::new(SlotRegion::heap(SLOT, 4).unwrap());
            let config = PollerConfig { background_in_flight_max: cap, ..config(4) };
            let mut p = Poller::new(config, disk, region).unwrap();
            let mut now = 0;
            for slot in 0..3 {
                p.submit(write(slot, slot, Durability::Acked)).unwrap();
            }
            p.submit(read(3, 3)).unwrap();
            p.poll(now, 8);
            // With a cap of 2, the third write waits and the load is in.
            assert_eq!(p.backend().in_flight(), expected, "cap {cap}");
            assert_eq!(p.background_in_flight(), if cap == 0 { 3 } else { cap });
            let events = run_until_events(&mut p, &mut now, 4);
            assert_eq!(events.len(), 4, "cap {cap}: every op ends");
            assert_eq!(events.iter().filter(|e| e.outcome.is_ok()).count(), 3, "the three writes land");
            assert_eq!(p.background_in_flight(), 0);
        }
    }

    #[test]
    fn rings() {
        let mut p = poller(4, 1_000, 4);
        let (mut tx, rx) = ring::<Request>(8);
        let (etx, mut erx) = ring::<Event>(8);
        p.attach_intake(rx).unwrap();
        p.attach_events(etx).unwrap();
        p.seal();
        let (_, late) = ring::<Request>(8);
        assert!(p.attach_intake(late).is_err(), "rings attach before the seal");
        tx.push(write(0, 0, Durability::Acked)).unwrap();
        let mut bad = read(1, 0);
        if let Command::Read(r) = &mut bad.command {
            r.source.slot = 99;
        }
        tx.push(bad).unwrap();
        let mut now = 0;
        let mut events = Vec::new();
        for _ in 0..100 {
            now += 1_000;
            p.poll(now, 8);
            while let Some(event) = erx.pop() {
                events.push(event);
            }
        }
        assert_eq!(events.len(), 2);
        assert!(events.iter().any(|e| e.cookie == 0 && e.outcome.is_ok()));
        assert!(events.iter().any(|e| e.cookie == 100 && e.outcome == Err(OpError::Invalid("L2 slot out of range"))));
        assert_eq!(p.ops_in_use(), 0);
    }
}
