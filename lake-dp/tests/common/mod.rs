//! A deterministic workload and oracle over the real poller and the
//! simulated disk, shared by the simulation test (many seeds, crashes) and
//! the zero-allocation test (one long run after seal). After construction
//! the harness itself allocates nothing unless a check fails.

#![allow(dead_code, unreachable_pub)]
// Fixture numbers are small; the cast lints guard the library.
#![allow(clippy::cast_possible_truncation)]

use std::sync::Arc;

use lake_dp::io::IoBackend;
use lake_dp::op::{Command, Event, L2Slot, OpError, ReadBlock, RejectReason, Request, Ticket, WriteBlock};
use lake_dp::poller::{L2Geometry, Poller, PollerConfig};
use lake_dp::region::SlotRegion;
use lake_dp::rng::SimRng;
use lake_dp::sim::{CrashKind, SimDisk, SimFaults};
use lake_dp::stored::ObjectMeta;
use lake_dp::{BlockKey, Durability, NamespaceId, ObjectKind, Priority};

pub const SLOT_BYTES: u64 = 16 * 1024;
const L1_SLOTS: u32 = 8;
const L2_FILES: u16 = 2;
const L2_SLOTS: u32 = 12;
const PAYLOAD_MAX: u64 = SLOT_BYTES - 4096;

#[derive(Clone, Copy, Debug)]
struct Committed {
    key: BlockKey,
    generation: u32,
    payload_len: u64,
    durable: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct SlotModel {
    committed: Option<Committed>,
    /// A byte of the committed object was damaged on the media.
    rotted: bool,
    /// A write that was in flight at a crash: it may have landed whole,
    /// torn, or not at all.
    maybe: Option<Committed>,
    write_in_flight: bool,
    reads_in_flight: u32,
    next_generation: u32,
}

/// What a read's expectation is worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// The slot's committed object: must read back (or fail with an I/O
    /// error, never a verification error).
    Valid,
    /// The committed object, but damaged on the media: must not be ready.
    Rotted,
    /// A write in flight at a crash: ready only if every byte is right.
    Maybe,
    /// Wrong or stale: must never be ready.
    Wrong,
}

#[derive(Clone, Copy, Debug)]
struct Outstanding {
    ticket: Ticket,
    cookie: u64,
    l2: Option<usize>,
    l1: Option<u32>,
    /// For reads: what the expectation is worth.
    expect: Expect,
    expected: Option<Committed>,
    cancelled: bool,
    is_write: bool,
}

/// What one run did, for reporting and for assertions on coverage.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    pub writes_ok: u64,
    pub reads_ok: u64,
    pub errors: u64,
    pub corrupt_caught: u64,
    pub rotted: u64,
    pub cancelled: u64,
    pub crashes: u64,
    pub polls: u64,
    pub stale_seen: u64,
    pub stale_injected: u64,
}

pub struct Harness {
    pub seed: u64,
    rng: SimRng,
    poller: Option<Poller<SimDisk>>,
    config: PollerConfig,
    now_ns: u64,
    l1_held: Vec<bool>,
    slots: Vec<SlotModel>,
    outstanding: Vec<Outstanding>,
    events: Vec<Event>,
    next_cookie: u64,
    crashes_allowed: bool,
    pub tally: Tally,
    stale_base: u64,
}

macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

pub fn faults_for(rng: &mut SimRng) -> SimFaults {
    SimFaults {
        eio_ppm: rng.below(40_000) as u32,
        short_ppm: rng.below(40_000) as u32,
        fsync_eio_ppm: rng.below(20_000) as u32,
        stale_duplicate_ppm: rng.below(20_000) as u32,
        latency_min_ns: 1_000,
        latency_max_ns: 1_000 + rng.below(80_000),
        reorder: rng.below(2) == 1,
    }
}

impl Harness {
    pub fn new(seed: u64, crashes_allowed: bool) -> Self {
        let mut rng = SimRng::new(seed);
        let faults = faults_for(&mut rng);
        let config = PollerConfig {
            epoch: 1,
            ops_max: 2 + rng.below(6) as u32,
            batch_max: 1 + rng.below(8) as u32,
            io_retries_max: rng.below(3) as u8,
            flush_delay_ns: rng.below(100_000),
            flush_batch: 1 + rng.below(4) as u32,
            l2: L2Geometry { files: L2_FILES, slots_per_file: L2_SLOTS, slot_bytes: SLOT_BYTES, region_first: 10 },
            background_in_flight_max: 0,
        };
        let disk = SimDisk::new(
            rng.next_u64(),
            faults,
            1 + rng.below(6) as usize,
            usize::from(L2_FILES),
            (u64::from(L2_SLOTS) * SLOT_BYTES) as usize,
        );
        let region = Arc::new(SlotRegion::heap(SLOT_BYTES, L1_SLOTS).expect("L1 region"));
        let mut poller = Poller::new(config, disk, region).expect("poller config");
        poller.seal();
        Self {
            seed,
            rng,
            poller: Some(poller),
            config,
            now_ns: 1_000_000,
            l1_held: vec![false; L1_SLOTS as usize],
            slots: vec![
                SlotModel { next_generation: 1, ..SlotModel::default() };
                usize::from(L2_FILES) * L2_SLOTS as usize
            ],
            outstanding: Vec::with_capacity(64),
            events: vec![Event::placeholder(); 16],
            next_cookie: 1,
            crashes_allowed,
            tally: Tally::default(),
            stale_base: 0,
        }
    }

    fn poller(&mut self) -> &mut Poller<SimDisk> {
        self.poller.as_mut().expect("poller present between crashes")
    }

    /// The generator of the bytes block (key, generation) holds: a pure
    /// function of both.
    fn content(key: &BlockKey, generation: u32) -> SimRng {
        let mut seed = u64::from(generation);
        for chunk in key.0.chunks_exact(8) {
            seed ^= u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        }
        SimRng::new(seed)
    }

    fn fill(key: &BlockKey, generation: u32, out: &mut [u8]) {
        let mut rng = Self::content(key, generation);
        for chunk in out.chunks_mut(8) {
            chunk.copy_from_slice(&rng.next_u64().to_le_bytes()[..chunk.len()]);
        }
    }

    fn matches(key: &BlockKey, generation: u32, data: &[u8]) -> bool {
        let mut rng = Self::content(key, generation);
        data.chunks(8).all(|chunk| chunk == &rng.next_u64().to_le_bytes()[..chunk.len()])
    }

    fn free_l1(&mut self) -> Option<u32> {
        let start = self.rng.below(u64::from(L1_SLOTS)) as u32;
        (0..L1_SLOTS).map(|i| (start + i) % L1_SLOTS).find(|&s| !self.l1_held[s as usize])
    }

    fn l2_of(index: usize) -> L2Slot {
        L2Slot { file: (index / L2_SLOTS as usize) as u16, slot: (index % L2_SLOTS as usize) as u32 }
    }

    fn priority(&mut self) -> Priority {
        Priority::from_u8(self.rng.below(Priority::COUNT as u64) as u8).unwrap_or(Priority::WriteBack)
    }

    fn deadline(&mut self) -> u64 {
        if self.rng.chance(100_000) { self.now_ns + self.rng.below(30_000) } else { 0 }
    }

    fn track(&mut self, out: Outstanding) -> Result<(), String> {
        check!(
            self.outstanding.len() < self.outstanding.capacity(),
            "seed {}: harness outstanding overflow",
            self.seed
        );
        if let Some(l1) = out.l1 {
            self.l1_held[l1 as usize] = true;
        }
        self.outstanding.push(out);
        Ok(())
    }

    fn try_write(&mut self) -> Result<(), String> {
        let Some(l1) = self.free_l1() else { return Ok(()) };
        let index = self.rng.below(self.slots.len() as u64) as usize;
        let model = self.slots[index];
        if model.write_in_flight || model.reads_in_flight > 0 {
            return Ok(());
        }
        let mut key = BlockKey::NONE;
        let bits = self.rng.next_u64().to_le_bytes();
        key.0[..8].copy_from_slice(&bits);
        key.0[8] = 1;
        let generation = model.next_generation;
        let payload_len = 1 + self.rng.below(PAYLOAD_MAX);
        let segment_bytes = match self.rng.below(3) {
            0 => payload_len,
            1 => 4096,
            _ => 1 + self.rng.below(payload_len),
        };
        let target = Self::l2_of(index);
        let meta = ObjectMeta {
            kind: ObjectKind::KvBlock,
            key,
            parent_key: BlockKey::NONE,
            block_index: 0,
            namespace: NamespaceId(7),
            layout_fingerprint: 9,
            region: self.config.l2.region(target.file),
            region_epoch: self.config.epoch,
            slot: target.slot,
            generation,
            committed_unix_ns: 0,
            payload_len,
            segment_bytes,
        };
        if meta.segment_count().is_err() {
            return Ok(());
        }
        let region = self.poller().l1().clone();
        // SAFETY: the harness holds this L1 slot (no op references it).
        let slot = unsafe { region.slot_mut(l1) }.expect("l1 slot");
        Self::fill(&key, generation, &mut slot[4096..4096 + payload_len as usize]);
        let durability = if self.rng.below(2) == 0 { Durability::Acked } else { Durability::Durable };
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let request = Request {
            command: Command::Write(WriteBlock { l1_slot: l1, target, meta, durability, seal: None }),
            priority: self.priority(),
            deadline_ns: self.deadline(),
            cookie,
        };
        match self.poller().submit(request) {
            Ok(ticket) => {
                let slot = &mut self.slots[index];
                slot.write_in_flight = true;
                slot.committed = None;
                slot.rotted = false;
                slot.maybe = None;
                slot.next_generation += 1;
                let expected = Committed { key, generation, payload_len, durable: durability == Durability::Durable };
                self.track(Outstanding {
                    ticket,
                    cookie,
                    l2: Some(index),
                    l1: Some(l1),
                    expect: Expect::Valid,
                    expected: Some(expected),
                    cancelled: false,
                    is_write: true,
                })
            }
            Err(rejected) => {
                check!(
                    rejected.reason == RejectReason::Full,
                    "seed {}: write rejected: {:?}",
                    self.seed,
                    rejected.reason
                );
                Ok(())
            }
        }
    }

    fn try_read(&mut self) -> Result<(), String> {
        let Some(l1) = self.free_l1() else { return Ok(()) };
        let index = self.rng.below(self.slots.len() as u64) as usize;
        let model = self.slots[index];
        if model.write_in_flight {
            return Ok(());
        }
        // Mostly reads of the committed object; sometimes a stale or wrong
        // expectation, which must never be reported ready.
        let (expected, valid) = match (model.committed, model.maybe) {
            (None, Some(m)) if self.rng.below(2) == 0 => (m, Expect::Maybe),
            (Some(c), _) if self.rng.below(10) > 0 => (c, if model.rotted { Expect::Rotted } else { Expect::Valid }),
            (Some(c), _) => {
                let wrong = match self.rng.below(3) {
                    0 => Committed { generation: c.generation.wrapping_sub(1), ..c },
                    1 => Committed { key: BlockKey([3; 16]), ..c },
                    _ => Committed { payload_len: (c.payload_len % PAYLOAD_MAX) + 1, ..c },
                };
                if wrong.payload_len == c.payload_len && wrong.key == c.key && wrong.generation == c.generation {
                    return Ok(());
                }
                (wrong, Expect::Wrong)
            }
            (None, _) => {
                (Committed { key: BlockKey([5; 16]), generation: 1, payload_len: 100, durable: false }, Expect::Wrong)
            }
        };
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let request = Request {
            command: Command::Read(ReadBlock {
                source: Self::l2_of(index),
                l1_slot: l1,
                key: expected.key,
                generation: expected.generation,
                payload_len: expected.payload_len,
            }),
            priority: self.priority(),
            deadline_ns: self.deadline(),
            cookie,
        };
        match self.poller().submit(request) {
            Ok(ticket) => {
                self.slots[index].reads_in_flight += 1;
                self.track(Outstanding {
                    ticket,
                    cookie,
                    l2: Some(index),
                    l1: Some(l1),
                    expect: valid,
                    expected: Some(expected),
                    cancelled: false,
                    is_write: false,
                })
            }
            Err(rejected) => {
                check!(
                    rejected.reason == RejectReason::Full,
                    "seed {}: read rejected: {:?}",
                    self.seed,
                    rejected.reason
                );
                Ok(())
            }
        }
    }

    fn try_flush(&mut self) -> Result<(), String> {
        let file = self.rng.below(u64::from(L2_FILES)) as u16;
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let request =
            Request { command: Command::Flush { file }, priority: Priority::WriteBack, deadline_ns: 0, cookie };
        match self.poller().submit(request) {
            Ok(ticket) => self.track(Outstanding {
                ticket,
                cookie,
                l2: None,
                l1: None,
                expect: Expect::Valid,
                expected: None,
                cancelled: false,
                is_write: false,
            }),
            Err(rejected) => {
                check!(
                    rejected.reason == RejectReason::Full,
                    "seed {}: flush rejected: {:?}",
                    self.seed,
                    rejected.reason
                );
                Ok(())
            }
        }
    }

    fn try_invalid(&mut self) -> Result<(), String> {
        let request = Request {
            command: Command::Read(ReadBlock {
                source: L2Slot { file: L2_FILES, slot: 0 },
                l1_slot: 0,
                key: BlockKey::NONE,
                generation: 0,
                payload_len: 1,
            }),
            priority: Priority::CriticalLoad,
            deadline_ns: 0,
            cookie: 0,
        };
        let result = self.poller().submit(request);
        check!(
            matches!(result, Err(r) if matches!(r.reason, RejectReason::Invalid(_)) && r.request == request),
            "seed {}: an invalid request was not handed back: {result:?}",
            self.seed
        );
        Ok(())
    }

    /// Damages one byte of a committed object on the media.
    fn rot(&mut self) -> Result<(), String> {
        let index = self.rng.below(self.slots.len() as u64) as usize;
        let slot = self.slots[index];
        let Some(committed) = slot.committed else { return Ok(()) };
        if slot.write_in_flight || slot.reads_in_flight > 0 {
            return Ok(());
        }
        let target = Self::l2_of(index);
        let within = self.rng.below(4096 + committed.payload_len) as usize;
        let offset = (u64::from(target.slot) * SLOT_BYTES) as usize + within;
        let mask = 1u8 << self.rng.below(8);
        self.poller().backend_mut().corrupt_byte(usize::from(target.file), offset, mask);
        self.slots[index].rotted = true;
        self.tally.rotted += 1;
        Ok(())
    }

    fn try_cancel(&mut self) -> Result<(), String> {
        if self.outstanding.is_empty() {
            return Ok(());
        }
        let pick = self.rng.below(self.outstanding.len() as u64) as usize;
        let ticket = self.outstanding[pick].ticket;
        if self.poller().cancel(ticket) {
            self.outstanding[pick].cancelled = true;
        }
        Ok(())
    }

    fn crash(&mut self) -> Result<(), String> {
        let kind = if self.rng.below(2) == 0 { CrashKind::Process } else { CrashKind::PowerLoss };
        let stale = self.poller().stats().stale_completions;
        self.tally.stale_seen += stale;
        let poller = self.poller.take().expect("poller");
        let (mut disk, region) = poller.into_parts();
        // SAFETY: `region` is still alive, so in-flight buffers are valid.
        unsafe { disk.crash(kind) };
        for out in self.outstanding.drain(..) {
            if let Some(index) = out.l2 {
                let slot = &mut self.slots[index];
                if out.is_write && slot.write_in_flight {
                    // A write that may have landed whole, torn or not at all.
                    slot.write_in_flight = false;
                    slot.committed = None;
                    slot.maybe = out.expected;
                }
                slot.reads_in_flight = 0;
            }
        }
        for slot in &mut self.slots {
            slot.write_in_flight = false;
            if kind == CrashKind::PowerLoss
                && let Some(committed) = slot.committed
                && !committed.durable
            {
                // Acked but not flushed: a power loss may have rolled it
                // back or torn it.
                slot.committed = None;
                slot.maybe = Some(committed);
            }
        }
        self.l1_held.fill(false);
        self.config.epoch += 1;
        let mut poller = Poller::new(self.config, disk, region).map_err(|e| format!("restart: {e}"))?;
        poller.seal();
        self.poller = Some(poller);
        self.tally.crashes += 1;
        Ok(())
    }

    fn on_event(&mut self, event: Event) -> Result<(), String> {
        let seed = self.seed;
        let Some(position) = self.outstanding.iter().position(|o| o.ticket == event.ticket) else {
            return Err(format!("seed {seed}: event for an unknown or finished ticket: {event:?}"));
        };
        let out = self.outstanding.swap_remove(position);
        check!(out.cookie == event.cookie, "seed {seed}: cookie mismatch {event:?}");
        if let Some(l1) = out.l1 {
            self.l1_held[l1 as usize] = false;
        }
        if event.outcome == Err(OpError::Cancelled) {
            check!(out.cancelled, "seed {seed}: cancelled without being asked: {event:?}");
            self.tally.cancelled += 1;
        }
        match event.command {
            Command::Write(write) => {
                let index = out.l2.expect("write has a slot");
                let expected = out.expected.expect("write has an expectation");
                let slot = &mut self.slots[index];
                slot.write_in_flight = false;
                match event.outcome {
                    Ok(done) => {
                        check!(
                            done.durability >= write.durability,
                            "seed {seed}: write reached {:?}, asked {:?}",
                            done.durability,
                            write.durability
                        );
                        slot.committed =
                            Some(Committed { durable: done.durability == Durability::Durable, ..expected });
                        self.tally.writes_ok += 1;
                    }
                    Err(OpError::FlushFailed(_)) => {
                        slot.committed = Some(Committed { durable: false, ..expected });
                        self.tally.errors += 1;
                    }
                    Err(error) => {
                        check!(
                            !matches!(error, OpError::Corrupt(_) | OpError::Mismatch(_) | OpError::Invalid(_)),
                            "seed {seed}: a write failed verification: {error}"
                        );
                        slot.committed = None;
                        self.tally.errors += 1;
                    }
                }
            }
            Command::Read(read) => {
                let index = out.l2.expect("read has a slot");
                self.slots[index].reads_in_flight -= 1;
                match event.outcome {
                    Ok(_) => {
                        check!(
                            matches!(out.expect, Expect::Valid | Expect::Maybe),
                            "seed {seed}: a {:?} read was reported ready: {read:?}",
                            out.expect
                        );
                        let region = self.poller().l1().clone();
                        // SAFETY: the event handed the L1 slot back to us.
                        let slot = unsafe { region.slot(read.l1_slot) }.expect("slot");
                        let data = &slot[4096..4096 + read.payload_len as usize];
                        check!(
                            Self::matches(&read.key, read.generation, data),
                            "seed {seed}: a read was reported ready with wrong bytes: {read:?}"
                        );
                        self.tally.reads_ok += 1;
                    }
                    Err(error) => {
                        if out.expect == Expect::Valid {
                            check!(
                                !matches!(error, OpError::Corrupt(_) | OpError::Mismatch(_)),
                                "seed {seed}: a committed block failed verification: {error} ({read:?})"
                            );
                        } else if matches!(error, OpError::Corrupt(_) | OpError::Mismatch(_)) {
                            self.tally.corrupt_caught += 1;
                        }
                        self.tally.errors += 1;
                    }
                }
            }
            Command::Flush { .. } => {
                if event.outcome.is_err() {
                    self.tally.errors += 1;
                }
            }
        }
        Ok(())
    }

    fn poll_and_check(&mut self) -> Result<(), String> {
        self.now_ns += self.rng.below(20_000);
        let budget = 1 + self.rng.below(8) as u32;
        let now = self.now_ns;
        self.poller().poll(now, budget);
        self.tally.polls += 1;
        loop {
            let mut events = core::mem::take(&mut self.events);
            let count = self.poller().reap(&mut events);
            let mut result = Ok(());
            for event in &events[..count] {
                result = result.and_then(|()| self.on_event(*event));
            }
            self.events = events;
            result?;
            if count == 0 {
                return Ok(());
            }
        }
    }

    /// One step of the workload: maybe a request, then a poll.
    pub fn step(&mut self) -> Result<(), String> {
        match self.rng.below(100) {
            0..40 => self.try_write()?,
            40..75 => self.try_read()?,
            75..79 => self.try_cancel()?,
            79..82 => self.try_flush()?,
            82..83 => self.try_invalid()?,
            84..86 => self.rot()?,
            83..84 if self.crashes_allowed && self.rng.below(8) == 0 => self.crash()?,
            _ => {}
        }
        self.poll_and_check()
    }

    /// Calms the disk and polls until every admitted request has ended.
    pub fn drain(&mut self) -> Result<(), String> {
        let latency = 1_000;
        self.poller().backend_mut().set_faults(SimFaults::none(latency));
        for _ in 0..100_000 {
            if self.outstanding.is_empty() && !self.poller().has_work() {
                break;
            }
            self.poll_and_check()?;
        }
        check!(
            self.outstanding.is_empty(),
            "seed {}: {} requests never ended: {:?}",
            self.seed,
            self.outstanding.len(),
            &self.outstanding[..self.outstanding.len().min(3)]
        );
        let stats = *self.poller().stats();
        self.tally.stale_seen += stats.stale_completions;
        let disk = self.poller().backend().stats();
        self.tally.stale_injected = disk.stale_duplicates + disk.ghosts;
        check!(
            self.tally.stale_seen == self.tally.stale_injected,
            "seed {}: {} stale completions injected, {} recognised",
            self.seed,
            self.tally.stale_injected,
            self.tally.stale_seen
        );
        check!(self.poller().backend().in_flight() == 0, "seed {}: I/O left in flight", self.seed);
        Ok(())
    }

    pub fn poller_stats(&mut self) -> lake_dp::poller::PollerStats {
        *self.poller().stats()
    }
}
