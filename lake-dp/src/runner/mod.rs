//! The runner: what the `lake-dp` binary does around the poller. It pins
//! the poll thread to a core, binds memory to the NUMA node, opens the L2
//! tier (new epoch, re-adoption), creates the L1 arena, registers both with
//! io_uring, then drives the poller: busy passes back to back, a bounded
//! idle spin, then a park on an eventfd that io_uring completions (and
//! submitters) write to, so an idle `lake-dp` leaves its core to the
//! kernel. SIGTERM (or SIGINT) stops intake, drains what is in flight,
//! flushes every file and records a clean shutdown.
//!
//! Busy, idle-spin and parked time are counted per poller and reported.
//! Commands reach the poller from `lake-cp` once [3]'s protocol exists;
//! until then `--selftest-blocks` runs a built-in write-back and promotion
//! workload through the same loop.

pub mod config;
pub mod os;

use std::collections::VecDeque;
use std::io::Write;
use std::sync::Arc;

use self::config::RunnerConfig;
use self::os::{Signals, Wakeup};
use crate::arena::{Arena, SlotTable};
use crate::io::{Clock, MonotonicClock};
use crate::l2::{L2Slots, L2Tier, format};
use crate::model::key::BlockKey;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{Durability, ObjectKind, Priority};
use crate::op::{Command, Event, L2Slot, ReadBlock, Request, WriteBlock};
use crate::poller::{PollResult, Poller, PollerConfig};
use crate::region::SlotRegion;
use crate::stored::{ObjectMeta, object_bytes};
use crate::uring::UringBackend;

/// Command-line choices that override or add to the config file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunnerOptions {
    /// `--cores`: the poll thread's cores (the first is used).
    pub cores: Option<Vec<usize>>,
    /// `--numa-node`.
    pub numa_node: Option<u32>,
    /// `--selftest-blocks`: blocks the built-in workload writes (0: none).
    pub selftest_blocks: u64,
}

/// Why the runner stopped with an error.
#[derive(Debug)]
pub struct RunnerError(pub String);

impl core::fmt::Display for RunnerError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RunnerError {}

fn fail(what: &str) -> impl FnOnce(&dyn core::fmt::Display) -> RunnerError + '_ {
    move |e| RunnerError(format!("{what}: {e}"))
}

macro_rules! try_to {
    ($what:expr, $e:expr) => {
        $e.map_err(|e| fail($what)(&e))?
    };
}

/// What the loop did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunnerStats {
    /// Poll passes.
    pub polls: u64,
    /// Passes that did work.
    pub busy_polls: u64,
    /// Time in busy passes.
    pub busy_ns: u64,
    /// Time in idle passes (spinning).
    pub idle_ns: u64,
    /// Time parked.
    pub parked_ns: u64,
    /// Parks.
    pub parks: u64,
    /// Operations that ended well.
    pub ops_ok: u64,
    /// Operations that ended with an error.
    pub ops_failed: u64,
    /// Self-test blocks written (acked).
    pub selftest_written: u64,
    /// Self-test blocks read back and verified.
    pub selftest_read: u64,
    /// Operations still in flight when the drain timed out (0 after a
    /// clean drain).
    pub abandoned: u64,
}

impl RunnerStats {
    fn json(&self, event: &str) -> String {
        format!(
            "{{\"event\":\"{event}\",\"polls\":{},\"busy_polls\":{},\"busy_ns\":{},\"idle_ns\":{},\"parked_ns\":{},\
             \"parks\":{},\"ops_ok\":{},\"ops_failed\":{},\"selftest_written\":{},\"selftest_read\":{},\"abandoned\":{}}}",
            self.polls,
            self.busy_polls,
            self.busy_ns,
            self.idle_ns,
            self.parked_ns,
            self.parks,
            self.ops_ok,
            self.ops_failed,
            self.selftest_written,
            self.selftest_read,
            self.abandoned
        )
    }
}

/// The built-in workload: write-back of synthetic blocks from arena slots
/// to L2, with every third operation a promotion of a recent block back
/// into the arena (verified by the poller). Sized at start; no allocation
/// in the loop.
struct Selftest {
    remaining: u64,
    payload: u64,
    class: usize,
    /// Blocks on L2, oldest first (re-adopted ones first of all).
    written: VecDeque<Block>,
    in_flight: u32,
    issued: u64,
}

/// A block on L2 the self-test may read back or evict.
#[derive(Clone, Copy, Debug)]
struct Block {
    slot: L2Slot,
    generation: u32,
    key: BlockKey,
    payload_len: u64,
}

fn selftest_key(slot: L2Slot, generation: u32) -> BlockKey {
    let mut key = [0u8; 16];
    key[..2].copy_from_slice(&slot.file.to_le_bytes());
    key[2..6].copy_from_slice(&slot.slot.to_le_bytes());
    key[6..10].copy_from_slice(&generation.to_le_bytes());
    key[10..].copy_from_slice(b"SELFTE");
    BlockKey(key)
}

impl Selftest {
    fn feed(
        &mut self,
        poller: &mut Poller<UringBackend>,
        table: &mut SlotTable,
        l2: &mut L2Slots,
        region: &SlotRegion,
        epoch: u64,
    ) {
        while self.remaining > 0 {
            let recent = self.written.back().copied();
            let read = self.issued % 3 == 2 && self.written.len() > 2 * poller_ops(poller);
            let class = match (read, recent) {
                (true, Some(block)) => table.class_for(object_bytes(block.payload_len)).unwrap_or(self.class),
                _ => self.class,
            };
            let Some(grant) = table.allocate(class) else { return };
            let command = if let (true, Some(block)) = (read, recent) {
                Command::Read(ReadBlock {
                    source: block.slot,
                    l1_slot: grant.slot,
                    key: block.key,
                    generation: block.generation,
                    payload_len: block.payload_len,
                })
            } else {
                let target = match l2.allocate() {
                    Some(target) => target,
                    None => {
                        // Full: evict the oldest block (its slot is free
                        // again) and take a slot.
                        let Some(oldest) = self.written.pop_front() else {
                            let _ = table.retire(grant.slot);
                            return;
                        };
                        let _ = l2.release(oldest.slot);
                        let Some(target) = l2.allocate() else {
                            let _ = table.retire(grant.slot);
                            return;
                        };
                        target
                    }
                };
                // SAFETY: the table just granted this slot; no I/O uses it.
                if let Some(bytes) = unsafe { region.slot_mut(grant.slot) } {
                    let fill = (target.generation & 0xff) as u8;
                    if let Some(payload) = bytes.get_mut(4096..4096 + crate::usize_from(self.payload)) {
                        payload.fill(fill);
                    }
                }
                let meta = ObjectMeta {
                    kind: ObjectKind::KvBlock,
                    key: selftest_key(target.slot, target.generation),
                    parent_key: BlockKey::NONE,
                    block_index: 0,
                    namespace: NamespaceId(0x5e1f),
                    layout_fingerprint: 0,
                    region: poller.config().l2.region(target.slot.file),
                    region_epoch: epoch,
                    slot: target.slot.slot,
                    generation: target.generation,
                    committed_unix_ns: 0,
                    payload_len: self.payload,
                    segment_bytes: self.payload.div_ceil(8).next_multiple_of(4096).min(self.payload),
                };
                Command::Write(WriteBlock {
                    l1_slot: grant.slot,
                    target: target.slot,
                    meta,
                    durability: Durability::Acked,
                })
            };
            let request = Request { command, priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
            if let Err(rejected) = poller.submit(request) {
                let _ = table.retire(grant.slot);
                if let Command::Write(write) = rejected.request.command {
                    let _ = l2.release(write.target);
                }
                return;
            }
            self.issued += 1;
            self.in_flight += 1;
            if !read {
                self.remaining -= 1;
            }
        }
    }

    fn done(&mut self, event: &Event, table: &mut SlotTable, l2: &mut L2Slots, stats: &mut RunnerStats) {
        self.in_flight = self.in_flight.saturating_sub(1);
        match (event.command, event.outcome) {
            (Command::Write(write), Ok(_)) => {
                stats.selftest_written += 1;
                let _ = table.retire(write.l1_slot);
                if self.written.len() < self.written.capacity() {
                    let meta = write.meta;
                    let block = Block {
                        slot: write.target,
                        generation: meta.generation,
                        key: meta.key,
                        payload_len: meta.payload_len,
                    };
                    self.written.push_back(block);
                }
            }
            (Command::Write(write), Err(_)) => {
                let _ = table.retire(write.l1_slot);
                let _ = l2.release(write.target);
            }
            (Command::Read(read), outcome) => {
                if outcome.is_ok() {
                    stats.selftest_read += 1;
                }
                let _ = table.retire(read.l1_slot);
            }
            (Command::Flush { .. }, _) => {}
        }
        table.reclaim();
    }
}

fn poller_ops(poller: &Poller<UringBackend>) -> usize {
    poller.config().ops_max as usize
}

/// Runs a `lake-dp` until SIGTERM or SIGINT (or, with a self-test and no
/// signal, until the self-test is done). Writes one JSON line when serving
/// and one when stopped to `out`.
pub fn run(config: &RunnerConfig, options: &RunnerOptions, out: &mut dyn Write) -> Result<RunnerStats, RunnerError> {
    // Before anything else: later threads inherit the blocked mask.
    let signals = try_to!("blocking SIGTERM/SIGINT", Signals::new());
    let cores = options.cores.clone().unwrap_or_else(|| config.node.cores.clone());
    if let Some(&core) = cores.first() {
        let allowed = try_to!("reading the allowed cores", os::allowed_cores());
        if !allowed.contains(&core) {
            return Err(RunnerError(format!(
                "--cores: core {core} is not available to this process (allowed: {allowed:?})"
            )));
        }
        try_to!("pinning the poll thread", os::pin_to_core(core));
    }
    let numa_node = options.numa_node.or(config.node.numa_node);
    if let Some(node) = numa_node {
        if !crate::numa::node_exists(node) {
            return Err(RunnerError(format!("--numa-node: no NUMA node {node} (nodes: {:?})", crate::numa::nodes())));
        }
        // For the runner's whole life: every pool below lands on the node.
        try_to!("binding memory to the NUMA node", crate::numa::bind_thread(node));
    }

    let l2_config = config.l2();
    if config.l2.format_if_missing && l2_config.paths.iter().all(|p| !p.exists()) {
        try_to!("formatting the L2 tier", format(&l2_config));
    }
    let tier = try_to!("opening the L2 tier", L2Tier::open(&l2_config));
    let epoch = tier.epoch();
    let found = try_to!("re-adopting L2", tier.readopt(config.l2.queue_depth));
    let mut arena_config = config.arena(epoch);
    arena_config.numa_node = numa_node;
    let (arena, mut table) = try_to!("creating the L1 arena", Arena::create(&arena_config));
    let region = try_to!("mapping the L1 slots", arena.region());
    let wakeup = try_to!("creating the wake-up eventfd", Wakeup::new());
    let mut backend = try_to!(
        "setting up io_uring",
        UringBackend::new(try_to!("opening L2 files for io_uring", tier.backend_files()), config.l2.queue_depth)
    );
    // SAFETY: the region keeps the arena mapped, and it outlives the
    // backend: the poller (which owns the backend) is dropped first below.
    try_to!("registering the L1 arena with io_uring", unsafe { backend.register_region(&region) });
    try_to!("registering the wake-up eventfd with io_uring", backend.register_eventfd(wakeup.fd()));
    let p = &config.poller;
    let poller_config = PollerConfig {
        epoch,
        ops_max: p.ops_max,
        batch_max: p.batch_max,
        io_retries_max: p.io_retries_max,
        flush_delay_ns: p.flush_delay_us * 1000,
        flush_batch: p.flush_batch,
        l2: tier.geometry(),
    };
    let mut poller = try_to!("building the poller", Poller::new(poller_config, backend, Arc::clone(&region)));
    let mut l2_slots = L2Slots::from_readoption(tier.geometry(), &found);
    let l2_total = u64::from(tier.geometry().files) * u64::from(tier.geometry().slots_per_file);
    let mut selftest = (options.selftest_blocks > 0).then(|| {
        let payload = config.l1.classes[0].payload_bytes.min(l2_config.slot_bytes - 4096);
        let mut written = VecDeque::with_capacity(usize::try_from(l2_total).unwrap_or(0));
        // What the last run left is evicted (or read) first.
        for adopted in &found.adopted {
            let slot = L2Slot { file: adopted.file, slot: adopted.slot };
            let meta = adopted.meta;
            written.push_back(Block {
                slot,
                generation: meta.generation,
                key: meta.key,
                payload_len: meta.payload_len,
            });
        }
        Selftest {
            remaining: options.selftest_blocks,
            payload,
            class: table.class_for(object_bytes(payload)).unwrap_or(0),
            written,
            in_flight: 0,
            issued: 0,
        }
    });
    let mut events = vec![Event::placeholder(); p.batch_max as usize];
    poller.seal();
    let _ = writeln!(
        out,
        "{{\"event\":\"serving\",\"pid\":{},\"epoch\":{epoch},\"previous_shutdown_clean\":{},\"adopted\":{},\
         \"scrubbed\":{},\"torn\":{},\"damaged\":{},\"l1_bytes\":{},\"l2_free_slots\":{},\"core\":{},\"numa_node\":{}}}",
        std::process::id(),
        tier.previous_shutdown_clean(),
        found.adopted.len(),
        found.scrubbed,
        found.torn.len(),
        found.damaged.len(),
        arena.header().total_bytes,
        l2_slots.free_slots(),
        cores.first().map_or("null".into(), ToString::to_string),
        numa_node.map_or("null".into(), |n| n.to_string()),
    );
    let _ = out.flush();

    let clock = MonotonicClock;
    let mut stats = RunnerStats::default();
    let spin_ns = p.spin_us * 1000;
    let mut idle_since: Option<u64> = None;
    let mut stopping: Option<u64> = None;
    let budget = p.batch_max;
    loop {
        let now = clock.now_ns();
        if stopping.is_none() && (stats.polls.is_multiple_of(256) || idle_since.is_some()) && signals.take().is_some() {
            stopping = Some(now + p.drain_timeout_ms * 1_000_000);
        }
        let selftest_done = selftest.as_ref().is_none_or(|s| s.remaining == 0 && s.in_flight == 0);
        if options.selftest_blocks > 0 && selftest_done && stopping.is_none() {
            stopping = Some(now + p.drain_timeout_ms * 1_000_000);
        }
        if let Some(deadline) = stopping {
            if !poller.has_work() {
                break;
            }
            if now > deadline {
                stats.abandoned = poller.stats().admitted.saturating_sub(stats.ops_ok + stats.ops_failed);
                break;
            }
        } else if let Some(test) = &mut selftest {
            test.feed(&mut poller, &mut table, &mut l2_slots, &region, epoch);
        }
        let result = poller.poll(now, budget);
        let count = poller.reap(&mut events);
        for event in &events[..count] {
            if event.outcome.is_ok() {
                stats.ops_ok += 1;
            } else {
                stats.ops_failed += 1;
            }
            if let Some(test) = &mut selftest {
                test.done(event, &mut table, &mut l2_slots, &mut stats);
            }
        }
        let end = clock.now_ns();
        stats.polls += 1;
        if result == PollResult::Busy || count > 0 {
            stats.busy_polls += 1;
            stats.busy_ns += end - now;
            idle_since = None;
            continue;
        }
        stats.idle_ns += end - now;
        let since = *idle_since.get_or_insert(end);
        if end - since < spin_ns {
            continue;
        }
        // Idle past the spin budget: park until a completion, a wake-up or
        // a signal; briefly when timers (flush batching, deadlines) wait.
        let timeout_ms = if poller.has_work() { 1 } else { p.park_max_ms };
        try_to!("parking", os::park(&wakeup, &signals, timeout_ms));
        let woke = clock.now_ns();
        stats.parks += 1;
        stats.parked_ns += woke - end;
        idle_since = None;
    }

    // Make every acked write durable, then mark the shutdown clean.
    let files = tier.geometry().files;
    for file in 0..files {
        let flush =
            Request { command: Command::Flush { file }, priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
        // Refused only when every op slot is busy, which a drained poller
        // never is; shut_down_clean flushes every file again anyway.
        let _ = poller.submit(flush);
    }
    let flush_deadline = clock.now_ns() + p.drain_timeout_ms * 1_000_000;
    while poller.has_work() && clock.now_ns() < flush_deadline {
        poller.poll(clock.now_ns(), budget);
        let _ = poller.reap(&mut events);
    }
    let clean = !poller.has_work() && stats.abandoned == 0;
    drop(poller);
    drop(region);
    if clean {
        try_to!("recording the clean shutdown", tier.shut_down_clean());
    }
    drop(table);
    drop(arena);
    let _ = writeln!(out, "{}", stats.json(if clean { "stopped" } else { "stopped-unclean" }));
    let _ = out.flush();
    Ok(stats)
}
