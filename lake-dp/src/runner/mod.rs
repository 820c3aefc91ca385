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
//! Work reaches the poller from `lake-cp` (tier moves and evictions, over
//! the link of [`crate::cplink`]) and from agents (saves and loads, over
//! in-process ports; see [`pool`]); `--selftest-blocks` runs a built-in
//! write-back and promotion workload through the same loop.

pub mod attach;
pub mod config;
pub use lake_core::os;
pub mod pool;

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use self::config::RunnerConfig;
use self::link::{Reconnect, link_to_cp, register_regions};
use self::os::{Signals, Wakeup};
use crate::arena::{Arena, SlotTable};
use crate::cplink::CpLink;
use crate::io::{Clock, IoBackend, MonotonicClock};
use crate::l2::{L2Slots, L2Tier, format};
use crate::model::key::BlockKey;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{Durability, ObjectKind, Priority, ReplicaWire, Tier};
use crate::op::{Command, Event, L2Slot, ReadBlock, Request, WriteBlock};
use crate::poller::{L2Geometry, PollResult, Poller, PollerConfig};
use crate::region::SlotRegion;
use crate::stored::{ObjectMeta, object_bytes};
use crate::uring::UringBackend;
use crate::wire::hello::Identity;
use crate::wire::message::{
    BLOCK_FLAG_VERIFIED, BlockEvicted, BlockRecord, DataPlaneStats, EvictReason, RegisterRegion, Role, text_field,
};

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

/// What an embedder connects to the runner besides its config: agents in
/// the same process, a shared wake-up, a stop flag.
#[derive(Debug, Default)]
pub struct RunnerPorts {
    /// The data plane's ends of in-process agent ports.
    pub agents: Vec<crate::agent::port::DpPort>,
    /// The wake-up those ports signal (the runner makes its own if none).
    pub wakeup: Option<Arc<Wakeup>>,
    /// Set to stop the runner (like SIGTERM).
    pub stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Set to close the pool to saves (its engines' loads still served):
    /// an embedder writing L1 down before it stops takes no block it
    /// would then lose.
    pub close_saves: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// How commits' payloads are checked (default: before publishing).
    pub commit_check: pool::CommitCheck,
    /// Where the node's transport listens for blocks peers send into its
    /// L1 (P→D, replication); none: it takes none.
    pub transport_listen: Option<std::net::SocketAddr>,
    /// Inbound transport connections held at once, at most (none: the
    /// transport's default, [`crate::transport::tcp::TcpConfig::inbound_max`]).
    pub transport_inbound_max: Option<usize>,
    /// The nodes this node's transport sends to (`lake-cp`'s copies to
    /// another node's L1) over the storage network: node id and its rails
    /// (one per NIC: the peer's address there, and the local address to
    /// leave from), slices spread over them by measured speed.
    pub transport_peers: Vec<(u32, Vec<crate::transport::tcp::Rail>)>,
    /// The cluster's link key: every transport connection is then
    /// authenticated and every frame tagged (see [`crate::auth`]); a peer
    /// without the key gets nothing through.
    pub link_key: Option<crate::auth::LinkKey>,
    /// The tenants' data keys, changed while it runs: a namespace with one
    /// is sealed below L1 (see [`crate::auth::at_rest`]); one forgotten is
    /// purged.
    pub tenant_keys: Option<Arc<crate::auth::at_rest::TenantKeys>>,
    /// An RDMA device: each peer's link then negotiates RDMA over its TCP
    /// connection and falls back to TCP (needs the `rdma` feature).
    pub rdma: Option<RdmaDevice>,
}

pub use crate::transport::rdma::RdmaDevice;

/// Lines for the operator's log from the node's transport: links refused,
/// RDMA links that came up or fell back (nothing allocated when there are
/// none).
fn log_links(transport: &mut dyn crate::transport::Links) {
    for what in transport.tcp().take_security_events() {
        tracing::warn!(event = "link_refused", what = %what);
    }
    for what in transport.take_rdma_events() {
        tracing::info!(event = "rdma_link", what = %what);
    }
}

/// A traced load's line for the operator's log: the engine's trace id,
/// where it ran and what it took.
fn log_span(node: u32, span: &pool::LoadSpan) {
    let tier = match crate::model::replica::Tier::from_u8(span.tier) {
        Some(crate::model::replica::Tier::L3Object) => "l3",
        Some(crate::model::replica::Tier::L2Nvme) => "l2",
        _ => "?",
    };
    let result = span.result.map_or_else(crate::agent::port::AgentError::name, |()| "ok");
    tracing::info!(
        event = "trace",
        trace = %format_args!("{:016x}", span.trace),
        node,
        op = "load",
        agent = span.agent,
        tier,
        result,
        us = span.took_ns / 1000
    );
}

/// A traced block's line for the operator's log: one a peer sent under an
/// engine's trace id, as it landed here (what it took, from its
/// reservation or first slice to its check).
fn log_trace_event(node: u32, event: &crate::transport::tcp::TraceEvent) {
    use crate::transport::frame::AckStatus;
    let crate::transport::tcp::TraceEvent::Landed { trace, from, target, bytes, status, us } = *event else {
        // This node's own copies carry no trace id.
        return;
    };
    let result = match status {
        Some(AckStatus::Landed) => "ok",
        Some(AckStatus::Refused) => "refused",
        Some(AckStatus::Corrupt) => "corrupt",
        Some(AckStatus::Busy) => "busy",
        Some(AckStatus::Later) => "later",
        None => "abandoned",
    };
    // The sender's address, or `?` once its connection closed (written
    // in place: nothing allocated per line).
    struct From(Option<std::net::SocketAddr>);
    impl core::fmt::Display for From {
        fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            match self.0 {
                Some(address) => address.fmt(f),
                None => f.write_str("?"),
            }
        }
    }
    let from = From(from);
    tracing::info!(
        event = "trace",
        trace = %format_args!("{trace:016x}"),
        node,
        op = "land",
        from = %from,
        region = target.region,
        slot = target.slot,
        bytes,
        result,
        us
    );
}

/// What each rail to each peer carried, for the control plane's metrics.
fn rail_entries(
    transport: &dyn crate::transport::Links,
    peers: &[(u32, crate::transport::PeerId)],
) -> Vec<crate::wire::message::RailEntry> {
    let mut entries = Vec::new();
    for &(node, peer) in peers {
        for (rail, report) in transport.rail_reports(peer).iter().enumerate() {
            entries.push(crate::wire::message::RailEntry {
                node,
                rail: u16::try_from(rail).unwrap_or(u16::MAX),
                up: u8::from(report.up),
                reserved: 0,
                bytes: report.bytes,
                breaks: report.breaks,
            });
        }
    }
    entries
}

/// The wire's error code for a transfer that did not land.
fn transfer_code(error: &crate::transport::TransferError) -> crate::wire::message::ErrorCode {
    use crate::transport::TransferError as E;
    use crate::wire::message::ErrorCode as C;
    match error {
        E::Refused => C::StaleEpoch,
        E::Corrupt => C::Checksum,
        E::Busy => C::QueueFull,
        E::PeerLost(_) | E::Unreachable(_) => C::Io,
        E::Timeout => C::DeadlineExceeded,
        E::Invalid(_) => C::BadFrame,
        E::Cancelled => C::Cancelled,
    }
}

/// Why the runner could not start, or stopped with an error.
#[derive(Debug)]
pub enum RunnerError {
    /// The settings cannot be served on this machine: a core or a NUMA node
    /// it does not have, RDMA with no transport, access, tenant or L3
    /// settings refused. Starting again unchanged fails again (`lake-dp`
    /// exits 2, as for a bad file, which the shipped unit does not restart).
    Config(String),
    /// Something the node needs could not be opened, or failed while it
    /// served: `what` was being done (a device, a socket, the control
    /// plane, a thread).
    Failed {
        /// What was being done.
        what: String,
        /// What went wrong.
        error: String,
    },
}

impl core::fmt::Display for RunnerError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Config(why) => f.write_str(why),
            Self::Failed { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

impl std::error::Error for RunnerError {}

fn fail(what: &str) -> impl FnOnce(&dyn core::fmt::Display) -> RunnerError + '_ {
    move |e| RunnerError::Failed { what: what.to_owned(), error: e.to_string() }
}

macro_rules! try_to {
    ($what:expr, $e:expr) => {
        $e.map_err(|e| fail($what)(&e))?
    };
}

// Declared after `try_to!`, which they use.
mod link;
mod open;
mod serve;
mod shutdown;
pub mod simulation;

/// The L1 capacity `lake-dp` tells `lake-cp`: its smallest class's slot
/// size, and how many of those its bytes hold. `lake-cp` counts a block at
/// that slot size, or at its own bytes where more (a block of a larger
/// class), so one-class arenas count every block as a slot, as before.
///
/// Fixed classes: the arena's bytes. Shared classes: less what the classes
/// may strand — one partly used chunk each, and the free slots each keeps
/// for loads — so that `lake-cp`, keeping L1 below its high-water mark of
/// this, leaves a class that runs short memory to take (a chunk nobody
/// uses, or one the pool empties by moving another class's blocks).
pub fn l1_capacity(header: &crate::arena::layout::ArenaHeader, load_reserve_slots: u32) -> (u64, u32) {
    let classes = &header.classes[..usize::from(header.class_count)];
    let slot_bytes = classes.iter().map(|c| c.slot_bytes).min().unwrap_or(1).max(1);
    let mut bytes = header.slots_bytes;
    if header.chunk_bytes != 0 {
        let stranded: u64 =
            classes.iter().map(|c| u64::from(header.chunk_bytes) + u64::from(load_reserve_slots) * c.slot_bytes).sum();
        // Never below one chunk's worth.
        bytes = bytes.saturating_sub(stranded).max(u64::from(header.chunk_bytes));
    }
    (slot_bytes, u32::try_from(bytes / slot_bytes).unwrap_or(u32::MAX))
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
    /// Reports sent to `lake-cp`.
    pub cp_sent: u64,
    /// Reports dropped (the link's buffer was full or it was closed).
    pub cp_dropped: u64,
    /// Links to a control plane made again after one closed (a standby
    /// that took over, or a restart), each with a re-adoption report.
    pub cp_reconnects: u64,
    /// Reports `lake-cp` refused.
    pub cp_refused: u64,
    /// Operations still in flight when the drain timed out (0 after a
    /// clean drain).
    pub abandoned: u64,
    /// Agent records released because their process died (their pins
    /// dropped).
    pub agents_released: u64,
    /// Agents that attached through the attach socket.
    pub agents_attached: u64,
    /// The block service's figures.
    pub pool: pool::PoolStats,
    /// The object store tier's.
    pub l3: pool::L3Stats,
    /// Blocks peers sent that this node READ over RDMA and landed checked
    /// (0 without RDMA).
    pub rdma_landed: u64,
    /// Bytes this node READ over RDMA.
    pub rdma_read_bytes: u64,
    /// Chunks of a shared L1 that one size class took from another.
    pub l1_chunks_moved: u64,
    /// Chunks of a shared L1 emptied (their blocks moved) and given up.
    pub l1_chunks_evacuated: u64,
}

impl RunnerStats {
    fn json(&self, event: &str) -> String {
        format!(
            "{{\"event\":\"{event}\",\"polls\":{},\"busy_polls\":{},\"busy_ns\":{},\"idle_ns\":{},\"parked_ns\":{},\
             \"parks\":{},\"ops_ok\":{},\"ops_failed\":{},\"selftest_written\":{},\"selftest_read\":{},\
             \"cp_sent\":{},\"cp_dropped\":{},\"cp_reconnects\":{},\"cp_refused\":{},\"abandoned\":{},\"agents_released\":{},\"saves\":{},\"saves_refused\":{},\
             \"commits_corrupt\":{},\"commits_corrupt_late\":{},\"commits_foreign\":{},\"commits_verified\":{},\"promotions\":{},\"demotions\":{},\"evictions\":{},\"commands_failed\":{},\
             \"l3_writes\":{},\"l3_reads\":{},\"l3_deletes\":{},\"l3_failed\":{},\"l3_lost\":{},\"rdma_landed\":{},\"rdma_read_bytes\":{},\
             \"l1_chunks_moved\":{},\"l1_chunks_evacuated\":{},\"l1_moves\":{},\"l1_class_short\":{}}}",
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
            self.cp_sent,
            self.cp_dropped,
            self.cp_reconnects,
            self.cp_refused,
            self.abandoned,
            self.agents_released,
            self.pool.saves,
            self.pool.saves_refused,
            self.pool.commits_corrupt,
            self.pool.commits_corrupt_late,
            self.pool.commits_foreign,
            self.pool.commits_verified,
            self.pool.promotions,
            self.pool.demotions,
            self.pool.evictions,
            self.pool.commands_failed,
            self.l3.writes,
            self.l3.reads,
            self.l3.deletes,
            self.l3.failed,
            self.l3.lost,
            self.rdma_landed,
            self.rdma_read_bytes,
            self.l1_chunks_moved,
            self.l1_chunks_evacuated,
            self.pool.l1_moves,
            self.pool.l1_class_short
        )
    }
}

/// The runner's parts, borrowed together for the block service and the
/// self-test.
pub(crate) struct Parts<'a, B: IoBackend = UringBackend> {
    pub poller: &'a mut Poller<B>,
    pub table: &'a mut SlotTable,
    pub l2: &'a mut L2Slots,
    pub region: &'a SlotRegion,
    pub link: &'a mut Option<CpLink>,
    /// The pass's clock.
    pub now_ns: u64,
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
    /// This node and the L2 geometry, for reports to `lake-cp`.
    node: u32,
    geometry: L2Geometry,
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
    fn feed<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, epoch: u64, pool: &mut pool::Pool) {
        let Parts { poller, table, l2, region, link, .. } = parts;
        let poller = &mut **poller;
        while self.remaining > 0 {
            let recent = self.written.back().copied();
            let read = self.issued % 3 == 2 && self.written.len() > 2 * poller.config().ops_max as usize;
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
                        if !pool.l2_holds(oldest.slot, oldest.generation) || l2.release(oldest.slot).is_err() {
                            // Evicted on lake-cp's command already: try
                            // the next oldest.
                            let _ = table.retire(grant.slot);
                            continue;
                        }
                        pool.l2_released(oldest.slot);
                        if let Some(link) = link {
                            link.evicted(&BlockEvicted {
                                replica: l2_replica(&self.geometry, self.node, epoch, oldest.slot, oldest.generation),
                                key: oldest.key,
                                reason: EvictReason::Capacity as u8,
                                reserved: [0; 7],
                            });
                        }
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
                    seal: None,
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

    fn done<B: IoBackend>(
        &mut self,
        event: &Event,
        parts: &mut Parts<'_, B>,
        stats: &mut RunnerStats,
        pool: &mut pool::Pool,
    ) {
        let Parts { table, l2, link, .. } = parts;
        self.in_flight = self.in_flight.saturating_sub(1);
        match (event.command, event.outcome) {
            (Command::Write(write), Ok(_)) => {
                stats.selftest_written += 1;
                pool.l2_written(write.target, &write.meta);
                if let Some(link) = link {
                    let epoch = write.meta.region_epoch;
                    link.committed(&l2_record(&self.geometry, self.node, epoch, write.target, &write.meta));
                }
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

/// The wire replica of the object of `generation` in an L2 slot.
pub(crate) fn l2_replica(geometry: &L2Geometry, node: u32, epoch: u64, slot: L2Slot, generation: u32) -> ReplicaWire {
    ReplicaWire {
        tier: Tier::L2Nvme as u8,
        reserved: 0,
        region: geometry.region(slot.file).0,
        node,
        region_epoch: epoch,
        slot: slot.slot,
        generation,
    }
}

/// The wire record of a block in an L2 slot.
pub(crate) fn l2_record(geometry: &L2Geometry, node: u32, epoch: u64, slot: L2Slot, meta: &ObjectMeta) -> BlockRecord {
    block_record(l2_replica(geometry, node, epoch, slot, meta.generation), meta, Durability::Acked)
}

/// The wire record of the replica `replica` of the object `meta` describes.
pub(crate) fn block_record(replica: ReplicaWire, meta: &ObjectMeta, durability: Durability) -> BlockRecord {
    BlockRecord {
        replica,
        key: meta.key,
        parent_key: meta.parent_key,
        namespace: meta.namespace.0,
        layout_fingerprint: meta.layout_fingerprint,
        payload_len: meta.payload_len,
        block_index: meta.block_index,
        kind: meta.kind as u16,
        durability: durability as u8,
        flags: 0,
    }
}

/// Objects one message of the background scan carries.
const SCAN_BATCH: usize = 32;

/// What the background scan of the store sends the runner.
#[allow(clippy::large_enum_variant)] // a batch travels by value: the runner's side never touches the heap for it
enum ScanMessage {
    /// Objects found (a batch's last message may hold fewer).
    Found([Option<ObjectMeta>; SCAN_BATCH]),
    /// The scan ended: what it found, damaged and skipped, in how long.
    Done { found: u64, damaged: usize, skipped: usize, ms: u128 },
    /// The store could not be listed or read (the reason).
    Failed(String),
}

/// Scans the store on a thread of its own, handing the headers it reads
/// to the runner in batches (the runner serves meanwhile: a store of many
/// objects does not hold the node up). Ends when the runner stops taking
/// them.
fn scan_in_background(
    mut store: Box<dyn crate::l3::ObjectStore>,
    prefix: String,
    limit: usize,
    wakeup: Arc<Wakeup>,
) -> Result<std::sync::mpsc::Receiver<ScanMessage>, RunnerError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(64);
    let thread = std::thread::Builder::new().name("lake-l3-scan".into()).spawn(move || {
        scan_to(store.as_mut(), &prefix, limit, &mut |message| {
            let sent = tx.send(message).is_ok();
            wakeup.wake_if_parked();
            sent
        });
    });
    thread.map_err(|e| fail("l3: starting the scan")(&e))?;
    Ok(rx)
}

/// Scans the store, handing what it finds to `send` in batches and then
/// how the scan ended; stops once `send` says the runner took no more.
fn scan_to(
    store: &mut dyn crate::l3::ObjectStore,
    prefix: &str,
    limit: usize,
    send: &mut dyn FnMut(ScanMessage) -> bool,
) {
    let started = std::time::Instant::now();
    let mut batch = [None; SCAN_BATCH];
    let mut count = 0;
    let mut found = 0u64;
    let scan = crate::l3::scan(store, prefix, limit, &mut |meta| {
        batch[count] = Some(*meta);
        count += 1;
        found += 1;
        if count < SCAN_BATCH {
            return true;
        }
        count = 0;
        send(ScanMessage::Found(core::mem::replace(&mut batch, [None; SCAN_BATCH])))
    });
    if count > 0 && !send(ScanMessage::Found(batch)) {
        return;
    }
    let _ = match scan {
        Ok(scan) => send(ScanMessage::Done {
            found,
            damaged: scan.damaged.len(),
            skipped: scan.skipped,
            ms: started.elapsed().as_millis(),
        }),
        Err(e) => send(ScanMessage::Failed(e.to_string())),
    };
}

/// Takes up to four batches of what the background scan found into the
/// catalog (re-adopted to the control plane); says when the scan ended (an
/// event). Returns the batches taken and whether it ended.
fn take_scanned(
    scan: &std::sync::mpsc::Receiver<ScanMessage>,
    pool: &mut pool::Pool,
    link: &mut Option<CpLink>,
) -> (u32, bool) {
    let mut batches = 0;
    for _ in 0..4 {
        match scan.try_recv() {
            Ok(ScanMessage::Found(objects)) => {
                for meta in objects.iter().flatten() {
                    pool.l3_adopt(meta, link);
                }
                batches += 1;
                continue;
            }
            Ok(ScanMessage::Done { found, damaged, skipped, ms }) => {
                tracing::info!(event = "l3_scanned", found, objects = pool.l3_objects(), damaged, skipped, ms);
            }
            Ok(ScanMessage::Failed(why)) => tracing::error!(event = "l3_scan_failed", why = %why),
            Err(std::sync::mpsc::TryRecvError::Empty) => return (batches, false),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return (batches, true),
        }
        return (batches, true);
    }
    (batches, false)
}

/// The object store tier `config` names: its client started (waking the
/// runner on every completion), its catalog empty, and the scan that
/// fills it started in the background.
fn start_l3(
    config: &self::config::L3Section,
    wakeup: &Arc<Wakeup>,
) -> Result<(pool::L3Tier, std::sync::mpsc::Receiver<ScanMessage>), RunnerError> {
    use crate::l3::{ObjectStore, StoreError};
    let s3 = config.s3().map_err(|e| RunnerError::Config(e.to_string()))?;
    if config.create_bucket
        && let Some(s3) = &s3
    {
        try_to!("l3: creating the bucket", crate::l3::s3::S3Store::create_bucket(s3));
    }
    let dir = config.dir.clone();
    let make = move || -> Result<Box<dyn ObjectStore>, StoreError> {
        match (&dir, &s3) {
            (Some(dir), _) => Ok(Box::new(crate::l3::dir::DirStore::open(dir)?)),
            (None, Some(s3)) => Ok(Box::new(crate::l3::s3::S3Store::open(s3)?)),
            (None, None) => Err(StoreError::Permanent("l3: no store named".into())),
        }
    };
    let store = try_to!("l3: opening the store", make());
    let scan = scan_in_background(store, config.prefix.clone(), config.objects as usize, Arc::clone(wakeup))?;
    let waker = Arc::clone(wakeup);
    let client = try_to!(
        "l3: starting the client",
        crate::l3::L3Client::start_notifying(
            config.client(),
            &config.prefix,
            make,
            Some(Arc::new(move || waker.wake_if_parked())),
        )
    );
    Ok((pool::L3Tier::new(client, config.region, config.objects, config.queue_depth), scan))
}

/// Says the runner parks (or woke), to in-process submitters and to
/// agents in other processes.
fn set_parked(wakeup: &Wakeup, attach: Option<&attach::AttachServer>, parked: bool) {
    wakeup.set_parked(parked);
    if let Some(attach) = attach {
        attach.set_parked(parked);
    }
}

/// Runs a `lake-dp` until SIGTERM or SIGINT (or, with a self-test and no
/// signal, until the self-test is done). Writes one JSON line when serving
/// and one when stopped to `out`.
pub fn run(config: &RunnerConfig, options: &RunnerOptions, out: &mut dyn Write) -> Result<RunnerStats, RunnerError> {
    run_with(config, options, RunnerPorts::default(), out)
}

impl Selftest {
    /// The built-in workload of `blocks` blocks, which evicts (or reads)
    /// first what the last run left in L2.
    fn adopting(
        config: &RunnerConfig,
        blocks: u64,
        l2_slot_bytes: u64,
        table: &SlotTable,
        tier: &L2Tier,
        found: &crate::l2::Readoption,
    ) -> Self {
        let l2_total = u64::from(tier.geometry().files) * u64::from(tier.geometry().slots_per_file);
        let payload = config.l1.classes[0].payload_bytes.min(l2_slot_bytes - 4096);
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
            remaining: blocks,
            payload,
            class: table.class_for(object_bytes(payload)).unwrap_or(0),
            written,
            in_flight: 0,
            issued: 0,
            node: config.node.id,
            geometry: tier.geometry(),
        }
    }
}

/// [`run`], with agents in this process (and a stop flag) attached.
pub fn run_with(
    config: &RunnerConfig,
    options: &RunnerOptions,
    mut ports: RunnerPorts,
    out: &mut dyn Write,
) -> Result<RunnerStats, RunnerError> {
    let mut node = Node::open(config, options, &mut ports, out)?;
    let mut stats = RunnerStats::default();
    node.serve(config, options, &ports, &mut stats)?;
    node.shut_down(config, stats, out)
}

/// The transport's transfers as the runner follows them, sized up front
/// (no allocation while it runs).
struct Transfers {
    done: Vec<crate::transport::Completion>,
    trace_events: Vec<crate::transport::tcp::TraceEvent>,
    /// When each transfer to another node was written, until it ends
    /// (room for the transport's most in flight).
    started: std::collections::HashMap<u64, u64>,
    latency: crate::wire::message::PathEntry,
}

impl Transfers {
    fn new() -> Self {
        Self {
            done: Vec::with_capacity(256),
            trace_events: Vec::with_capacity(crate::transport::tcp::TRACE_EVENTS_MAX),
            started: std::collections::HashMap::with_capacity(4096),
            latency: crate::wire::message::PathEntry::new(crate::wire::message::Path::TransferStorage),
        }
    }
}

/// What a running node holds, from [`Node::open`] to [`Node::shut_down`].
/// Fields drop in declaration order: what names the arena's memory (the
/// agents' ports, the transport's RDMA registrations, the poller's
/// io_uring registration) before the region and the arena, as when the
/// runner returns early.
struct Node<B: IoBackend = UringBackend, C: Clock = MonotonicClock> {
    attach: Option<attach::AttachServer>,
    peers_by_node: open::PeersByNode,
    transport: Option<Box<dyn crate::transport::Links>>,
    extra_fds: Vec<i32>,
    park_fds: Vec<libc::pollfd>,
    l3_scan: Option<std::sync::mpsc::Receiver<ScanMessage>>,
    pool: pool::Pool,
    l2_slots: L2Slots,
    poller: Poller<B>,
    wakeup: Arc<Wakeup>,
    link: Option<CpLink>,
    region: Arc<SlotRegion>,
    table: SlotTable,
    arena: Arena,
    /// The L2 files (none under the simulator) and their geometry.
    tier: Option<L2Tier>,
    geometry: L2Geometry,
    signals: Option<Signals>,
    selftest: Option<Selftest>,
    events: Vec<Event>,
    transfers: Transfers,
    reconnect: Reconnect,
    epoch: u64,
    header: crate::arena::layout::ArenaHeader,
    node_id: u32,
    clock: C,
    pace: serve::Pace,
}

#[cfg(test)]
mod tests {
    use super::RdmaDevice;

    #[test]
    fn an_rdma_device_is_a_name_or_any_with_an_optional_port_and_gid() {
        let named = RdmaDevice { name: Some("mlx5_0".into()), port: 1, gid_index: 0 };
        assert_eq!(RdmaDevice::parse("mlx5_0"), Ok(named.clone()));
        assert_eq!(RdmaDevice::parse("mlx5_0:2:3"), Ok(RdmaDevice { port: 2, gid_index: 3, ..named }));
        assert_eq!(RdmaDevice::parse("any:1:1").map(|d| d.name), Ok(None));
        for bad in ["", ":1", "mlx5_0:x", "mlx5_0:1:300", "mlx5_0:1:1:1"] {
            assert!(RdmaDevice::parse(bad).is_err(), "{bad:?}");
        }
    }
}
