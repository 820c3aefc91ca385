//! The node authority: what this node's `lake-dp`s report — regions,
//! blocks written, blocks re-adopted after a restart, blocks evicted — is
//! applied to the location view, and every block whose ready replicas
//! changed is republished in the shared-memory mirror.
//!
//! A re-adopted block whose parent is not known yet (a `lake-dp`
//! re-adopts its files in disk order, not prefix order), and a pulled
//! block whose parent is still being pulled (copies land in any order),
//! waits under its parent's key, in a bounded set, and is applied as
//! soon as the parent is. One whose parent never comes (it was evicted
//! before the restart, its pull failed) is applied as a root of its own
//! after [`ORPHAN_WAIT_NS`]; so is a
//! committed block whose parent was evicted while it was being saved. A
//! block the data plane holds is never left unknown to the control plane:
//! that would hold its slot forever.

use std::collections::HashMap;

use lake_dp::mirror::{MirrorWriter, RegionRecord};
use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::{BlockEvicted, BlockRecord, RegisterRegion, Transfer};
use lake_dp::wire::{Message, MessageKind};
use lake_dp::{BlockKey, NodeId, ObjectKind, Priority, RegionId, Replica, Tier};

use crate::index::IndexError;
use crate::lease::Leases;
use crate::location::{LocationError, Locations};
use crate::tier::{TierAction, TierCommand, TierConfig, Tiers};

/// Request ids of copies to other nodes ([`Node::copy_to`]): apart from
/// the tier manager's.
const COPY_REQUESTS: u64 = 1 << 62;

/// Request ids of promotions into this node's L1 made for a copy to
/// another node (of a block held here only in L2): apart from both.
const PROMOTE_REQUESTS: u64 = 1 << 61;

/// Request ids of engines' pulls read from the object store this node
/// shares with the block's L3 holder ([`Node::pull`]): apart from all
/// three.
const STORE_READ_REQUESTS: u64 = 1 << 60;

/// Copies to other nodes tracked while out, at most (one past it still
/// goes; it cannot be taken back).
const COPIES_OUT_MAX: usize = 1 << 16;

/// Copies waiting for their block's promotion into L1, at most.
const PROMOTING_MAX: usize = 1024;

/// Promotions for copies in the data plane at once, at most: L1 slots
/// are what they need, and engines need them too.
const PROMOTIONS_IN_FLIGHT: usize = 8;

/// How long a copy waits for its block's promotion (then it is dropped:
/// whoever asked, asks again).
const PROMOTION_WAIT_NS: u64 = 30_000_000_000;

/// A promotion refused (no L1 slot free yet) is asked again this much
/// later.
const PROMOTION_RETRY_NS: u64 = 50_000_000;

/// A copy to another node of a block held here only in L2, waiting for
/// the block's promotion into this node's L1.
#[derive(Clone, Copy, Debug)]
struct Promoting {
    to: ReplicaWire,
    priority: Priority,
    /// Dropped past this (Unix ns).
    until_ns: u64,
    /// The promotion's request, while one is in the data plane.
    asked: Option<u64>,
    /// Not asked again before this (after a refusal).
    retry_at_ns: u64,
}

/// Blocks that may wait for their parent at once; beyond that the oldest
/// waiting ones are applied as roots (and counted).
pub const PENDING_MAX: usize = 1 << 16;

/// How long a block waits for its parent (re-adopted, or pulled) before
/// it is applied as a root of its own.
pub const ORPHAN_WAIT_NS: u64 = 2_000_000_000;

/// Why a report was not applied. The connection stays up: the report is
/// dropped and counted; only malformed frames close a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeError {
    /// The location view refused (stale epoch, unknown region, ...).
    Location(LocationError),
    /// A message a `lake-dp` does not send.
    Unexpected(MessageKind),
    /// A field out of its domain (the wire checks most; this is the rest).
    Field(&'static str),
}

impl core::fmt::Display for NodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Location(e) => write!(f, "{e}"),
            Self::Unexpected(kind) => write!(f, "node: {kind:?} is not expected from this peer"),
            Self::Field(field) => write!(f, "node: {field}"),
        }
    }
}

impl std::error::Error for NodeError {}

impl From<LocationError> for NodeError {
    fn from(e: LocationError) -> Self {
        Self::Location(e)
    }
}

/// What the node has done, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCounters {
    /// Regions registered (again after a restart included).
    pub regions: u64,
    /// Replicas committed by a `lake-dp`.
    pub committed: u64,
    /// Replicas re-adopted from disk.
    pub readopted: u64,
    /// Replicas evicted.
    pub evicted: u64,
    /// L2 replicas given up for a faster copy of a block L3 holds too (the
    /// index keeps two a block).
    pub replicas_given_up: u64,
    /// L3 copies not tracked: their block was in L1 and in a leased L2.
    pub l3_untracked: u64,
    /// Evictions reported of L3 copies the view holds none of (untracked
    /// ones, which their data plane held all along): accepted.
    pub l3_untracked_evicted: u64,
    /// Reports refused (stale epoch, unknown region, ...).
    pub refused: u64,
    /// Blocks that waited for their parent.
    pub waited: u64,
    /// Blocks applied as roots because their parent was gone (or too
    /// many waited).
    pub rooted: u64,
    /// Mirror entries refused or not written (table full, region id too
    /// large for the mirror).
    pub mirror_skipped: u64,
    /// Requests agents reported (lookups).
    pub accesses: u64,
    /// Blocks those requests asked for.
    pub requested_blocks: u64,
    /// Blocks of them that were a cached prefix (hits).
    pub hit_blocks: u64,
}

/// What happened to a block, as `lake inspect` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockEventKind {
    /// A replica was committed (saved, landed, promoted, moved in).
    Committed,
    /// A replica was re-adopted from a restarted data plane's media.
    Readopted,
    /// A replica went away (the wire's `EvictReason` code).
    Evicted(u8),
    /// The tier manager asked a move of it to `Tier as u8`.
    MoveAsked(u8),
    /// The tier manager (or a replication) asked a copy of it to
    /// `Tier as u8`.
    CopyAsked(u8),
    /// The tier manager asked a replica of it dropped.
    DropAsked,
    /// A second copy of it in one region (two engines saved it at once)
    /// was asked dropped; the first stays.
    SecondCopyDropAsked,
}

/// One entry of the node's recent history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEvent {
    /// When (Unix ns).
    pub unix_ns: u64,
    /// The block.
    pub key: BlockKey,
    /// What happened.
    pub what: BlockEventKind,
    /// The region of the replica it happened to (for asks: the source's).
    pub region: u16,
    /// That replica's slot.
    pub slot: u32,
}

/// Events kept in the node's history, the oldest let go first.
pub const HISTORY_MAX: usize = 1 << 16;

fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The node authority. See the module docs.
#[derive(Debug)]
pub struct Node {
    /// The location view.
    pub locations: Locations,
    mirror: Option<MirrorWriter>,
    /// The mirrors of the tenants kept apart (each one's namespaces): their
    /// blocks are published there, in no other.
    tenant_mirrors: Vec<(Vec<u64>, MirrorWriter)>,
    /// The keys of those tenants' blocks, and the mirror of each.
    tenant_of: HashMap<BlockKey, usize>,
    /// Those tenants as the data plane tells their engines apart (each
    /// one's namespaces, users and groups, in the mirrors' order), and
    /// the partition of each engine connected that is a tenant's.
    tenant_engines: lake_dp::runner::config::Partitions,
    engine_tenants: HashMap<u64, usize>,
    node: NodeId,
    /// Blocks waiting for their parent, by the parent's key.
    waiting: HashMap<BlockKey, Vec<(BlockRecord, bool)>>,
    waiting_count: usize,
    /// Parents waited for, oldest first, with when the wait began.
    waiting_order: std::collections::VecDeque<(BlockKey, u64)>,
    /// The time of the latest planning pass (Unix ns).
    now_ns: u64,
    /// What it has done.
    pub counters: NodeCounters,
    /// Leases granted to readers.
    pub leases: Leases,
    /// Placement and eviction across the tiers.
    pub tiers: Tiers,
    /// Keys of an access report, reused.
    scratch: Vec<BlockKey>,
    /// The latest figures the data plane sent.
    pub data_plane: Option<lake_dp::wire::message::DataPlaneStats>,
    /// Its refused saves by reason, as it last sent them (a data plane
    /// that takes [`lake_dp::wire::FEATURE_SAVE_REFUSALS`]).
    pub save_refusals: Option<lake_dp::wire::message::SaveRefusals>,
    /// The last count of connections its data plane's listeners let go.
    pub connections_shed: Option<lake_dp::wire::message::ConnectionsShed>,
    /// The latest rail figures of each network's transport (what each
    /// rail to each peer carried).
    pub rails: Vec<(lake_dp::wire::message::Network, Vec<lake_dp::wire::message::RailEntry>)>,
    /// The data plane's latency histogram of each path, as last sent.
    pub paths: Vec<lake_dp::wire::message::PathEntry>,
    /// Copies to other nodes asked and not yet sent to `lake-dp`.
    copies: Vec<TierCommand>,
    copy_requests: u64,
    /// Copies to other nodes of blocks held here only in L2: promoted into
    /// L1 first — the target, class and when the wait ends.
    promoting: HashMap<BlockKey, Promoting>,
    /// Copies to other nodes asked of the data plane and not answered
    /// yet: the source's region, whether asked while the node was
    /// drained, and the copy (asked again if it found no send free).
    copies_out: HashMap<u64, (u16, bool, Transfer)>,
    /// Of them, those refused for want of a send (`copy::CopyAgain`).
    copies_again: HashMap<u64, copy::CopyAgain>,
    /// Copies placing a block saved here in its home ([`Node::place_to`]),
    /// or moving it to the node that pulled it (`true`; see
    /// `pulls_move`), by request: once landed, this node's copy is a copy.
    placing: HashMap<u64, (BlockKey, bool)>,
    /// Whether a pull moves the block to its reader, as the summary's
    /// leader says ([`lake_dp::wire::FEATURE_PULLS_MOVE`]): the pulled
    /// copy here is the pool's, and a copy this node sends to a puller
    /// leaves this node's a copy once it landed. Else a pulled copy is
    /// one, first to go, and the holder's stays.
    pub pulls_move: bool,
    /// Engines' pulls of other nodes' blocks into this node's L1, for the
    /// summary's leader to relay ([`Node::take_pulls`]).
    pulls: Vec<Transfer>,
    /// Engines' pulls of blocks another node holds in L3, asked of this
    /// node's own data plane — a read of the object from the store — by
    /// request: relayed as the others are if the read fails.
    store_reads: HashMap<u64, Transfer>,
    /// Such pulls read from the store, and those that failed (then
    /// relayed).
    pub store_reads_done: u64,
    /// See `store_reads_done`.
    pub store_reads_failed: u64,
    /// Pulls refused for asking a namespace not the engine's tenant's.
    pub pulls_refused: u64,
    /// Blocks pulled lately and when each was asked: the copy that lands
    /// within [`copy::PULL_LANDS_NS`] is a pulled-in copy
    /// ([`crate::tier::Tiers::pulled_in`]).
    pulling: HashMap<BlockKey, u64>,
    /// Engines' pulls asked together (within [`copy::PULL_BATCH_NS`] of
    /// the first), by when the first was asked: how many, how many landed.
    pull_batches: HashMap<u64, (u32, u32)>,
    /// When the newest of them was first asked.
    pull_batch_at: u64,
    /// What a pulled block costs this node, as measured: a batch's time
    /// from its ask to its last block landing, over its blocks (a moving
    /// average; 0: none measured yet).
    pub pull_ns_per_block: u64,
    /// Copies taken back before they went ([`Node::cancel_copy`]).
    pub copies_cancelled: u64,
    /// Copies asked again: their data plane had no send free.
    pub copies_asked_again: u64,
    /// Promotions asked for such copies.
    pub copy_promotions: u64,
    /// Of them, refused by the data plane (no L1 slot free, the L2
    /// replica gone): the copy waits to be asked again.
    pub copy_promotions_failed: u64,
    /// Copies to other nodes that landed there, and that failed.
    pub copies_landed: u64,
    /// See `copies_landed`.
    pub copies_failed: u64,
    /// Of the copies landed, those that placed a block saved here in its
    /// home: this node's copy became a copy.
    pub placed_away: u64,
    /// Of the copies landed, those that moved a block to the node that
    /// pulled it ([`Node::pulls_move`]): this node's copy became a copy.
    pub moved_to_readers: u64,
    /// Shared prefixes here: blocks two or more chains here continue,
    /// which a pull copies rather than moves ([`copy::Shared`]).
    pub shared: copy::Shared,
    /// Blocks engines hold in their own GPU memory (advisory L0).
    pub l0: crate::l0::L0,
    /// Each engine's compute-network rails, by its connection, as it last
    /// reported them (gone with the connection).
    pub engine_rails: Vec<(u64, Vec<lake_dp::wire::message::RailEntry>)>,
    /// Each engine's own side of its reads and loads, by its connection,
    /// as it last reported it.
    pub engine_paths: Vec<(u64, Vec<lake_dp::wire::message::PathEntry>)>,
    /// What engines gone had reported, so the totals only grow.
    pub engine_paths_gone: Vec<lake_dp::wire::message::PathEntry>,
    /// Each capped tenant's waits for its bandwidth caps on the data
    /// plane, as last sent.
    pub tenant_throttles: Vec<lake_dp::wire::message::TenantWait>,
    /// What happened to blocks lately, oldest first ([`HISTORY_MAX`]).
    history: std::collections::VecDeque<BlockEvent>,
    /// An operator is taking this node out (`lake drain-node`, read from
    /// etcd by `lake serve`): `/readyz` answers not ready, so the fleet's
    /// router sends it no new requests while the leader moves its blocks.
    pub draining: bool,
}

/// Adds `entry` to the total of its path in `totals` (a new one if none).
fn fold_path(totals: &mut Vec<lake_dp::wire::message::PathEntry>, entry: &lake_dp::wire::message::PathEntry) {
    match totals.iter_mut().find(|e| e.path == entry.path) {
        Some(total) => total.add(entry),
        None => totals.push(*entry),
    }
}

impl Node {
    /// The authority for `node` at `term`, publishing into `mirror` if
    /// given.
    pub fn new(node: NodeId, term: u64, mirror: Option<MirrorWriter>) -> Self {
        Self {
            locations: Locations::new(term),
            mirror,
            tenant_mirrors: Vec::new(),
            tenant_of: HashMap::new(),
            tenant_engines: lake_dp::runner::config::Partitions::default(),
            engine_tenants: HashMap::new(),
            node,
            waiting: HashMap::new(),
            waiting_count: 0,
            waiting_order: std::collections::VecDeque::new(),
            now_ns: 0,
            counters: NodeCounters::default(),
            leases: Leases::new(),
            tiers: Tiers::new(TierConfig::default()),
            scratch: Vec::new(),
            l0: crate::l0::L0::default(),
            engine_rails: Vec::new(),
            engine_paths: Vec::new(),
            engine_paths_gone: Vec::new(),
            tenant_throttles: Vec::new(),
            data_plane: None,
            save_refusals: None,
            connections_shed: None,
            rails: Vec::new(),
            paths: Vec::new(),
            copies: Vec::new(),
            copy_requests: 0,
            promoting: HashMap::new(),
            copies_out: HashMap::new(),
            copies_again: HashMap::new(),
            placing: HashMap::new(),
            pulls_move: false,
            pulls: Vec::new(),
            store_reads: HashMap::new(),
            store_reads_done: 0,
            store_reads_failed: 0,
            pulls_refused: 0,
            pulling: HashMap::new(),
            pull_batches: HashMap::new(),
            pull_batch_at: 0,
            pull_ns_per_block: 0,
            copies_cancelled: 0,
            copies_asked_again: 0,
            copy_promotions: 0,
            copy_promotions_failed: 0,
            copies_landed: 0,
            placed_away: 0,
            moved_to_readers: 0,
            shared: copy::Shared::default(),
            copies_failed: 0,
            history: std::collections::VecDeque::new(),
            draining: false,
        }
    }

    fn record(&mut self, key: BlockKey, what: BlockEventKind, (region, slot): (u16, u32)) {
        if self.history.len() >= HISTORY_MAX {
            self.history.pop_front();
        }
        self.history.push_back(BlockEvent { unix_ns: unix_ns(), key, what, region, slot });
    }

    /// What happened to `key` lately, oldest first (at most the node's
    /// last [`HISTORY_MAX`] events of all blocks are kept).
    pub fn history_of(&self, key: &BlockKey) -> Vec<BlockEvent> {
        self.history.iter().filter(|e| e.key == *key).copied().collect()
    }

    /// Manages the tiers under `config` from now on (call before any
    /// region registers).
    pub fn with_tiers(mut self, config: TierConfig) -> Self {
        self.tiers = Tiers::new(config);
        self
    }

    /// One planning pass of the tier manager (see [`Tiers::plan`]): the
    /// moves and evictions to send, appended to `out`.
    pub fn plan(&mut self, now_ns: u64, out: &mut Vec<TierCommand>) {
        self.now_ns = now_ns;
        self.copy_promoted(now_ns);
        self.copies_due();
        out.append(&mut self.copies);
        self.root_orphans(|since| since.saturating_add(ORPHAN_WAIT_NS) < now_ns);
        let from = out.len();
        self.tiers.plan(&self.locations, &self.leases, now_ns, out);
        for command in &out[from..] {
            let (key, what, slot) = match &command.action {
                TierAction::Move(t) => (t.key, BlockEventKind::MoveAsked(t.target.tier), t.source.slot),
                TierAction::Copy(t) => (t.key, BlockEventKind::CopyAsked(t.target.tier), t.source.slot),
                TierAction::Evict(e) => {
                    let tracked = self
                        .locations
                        .ready(&e.key)
                        .any(|r| r.region.0 == e.replica.region && r.slot == e.replica.slot);
                    let what = if tracked { BlockEventKind::DropAsked } else { BlockEventKind::SecondCopyDropAsked };
                    (e.key, what, e.replica.slot)
                }
                TierAction::Drain(_)
                | TierAction::Cancel
                | TierAction::Mark(_)
                | TierAction::Unmark(_)
                | TierAction::VictimsLeft(_) => continue,
            };
            self.record(key, what, (command.region, slot));
        }
    }

    /// Applies as roots the waiting blocks whose wait began when `due`
    /// says, oldest first.
    fn root_orphans(&mut self, mut due: impl FnMut(u64) -> bool) {
        while let Some(&(parent, since)) = self.waiting_order.front() {
            if !due(since) {
                break;
            }
            self.waiting_order.pop_front();
            let Some(list) = self.waiting.remove(&parent) else { continue };
            self.waiting_count -= list.len();
            for (block, readopted) in list {
                self.counters.rooted += 1;
                if self.add_as(&block, readopted, true).is_err() {
                    self.counters.refused += 1;
                }
            }
        }
    }

    /// Marks the node drained or not (`lake drain-node`): `/readyz` says
    /// not ready, and its L1 keeps room for the promotions of copies.
    pub fn set_draining(&mut self, on: bool) {
        self.draining = on;
        self.tiers.drain_node(on);
        if !on {
            // Taken back: what the drain still had to copy stays here.
            self.promoting.clear();
            let drained: Vec<u64> = self.copies_out.iter().filter(|(_, out)| out.1).map(|(&r, _)| r).collect();
            for request in drained {
                self.cancel_copy(request);
            }
        }
    }

    /// Moves the location view's numbered changes since the last call
    /// into `out` (for the cluster summary); they are dropped if nobody
    /// takes them, so they never pile up.
    pub fn take_changes(&mut self, out: &mut Vec<crate::location::Change>) {
        out.extend(self.locations.drain_changes());
    }

    /// Engine `peer`'s connection closed: its path histograms are kept in
    /// the totals.
    pub fn engine_gone(&mut self, peer: u64) {
        self.engine_tenants.remove(&peer);
        let Some(at) = self.engine_paths.iter().position(|(p, _)| *p == peer) else { return };
        let (_, entries) = self.engine_paths.swap_remove(at);
        for entry in &entries {
            fold_path(&mut self.engine_paths_gone, entry);
        }
    }

    /// Every path's histogram: the data plane's as it last sent them, then
    /// the engines' own side, summed over every engine that reported.
    pub fn all_paths(&self) -> Vec<lake_dp::wire::message::PathEntry> {
        let mut all = self.paths.clone();
        let mut engines = self.engine_paths_gone.clone();
        for entry in self.engine_paths.iter().flat_map(|(_, entries)| entries) {
            fold_path(&mut engines, entry);
        }
        engines.sort_by_key(|e| e.path);
        all.extend(engines);
        all
    }

    /// The node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The mirror, if the node publishes one.
    pub fn mirror(&self) -> Option<&MirrorWriter> {
        self.mirror.as_ref()
    }

    /// Publishes the blocks of each tenant's namespaces in that tenant's
    /// own mirror, and only there: the engines of a tenant kept apart are
    /// given its mirror, and learn no other tenant's keys or hits.
    #[must_use]
    pub fn with_tenant_mirrors(mut self, mirrors: Vec<(Vec<u64>, MirrorWriter)>) -> Self {
        self.tenant_mirrors = mirrors;
        self
    }

    /// Blocks waiting for their parent.
    pub fn waiting(&self) -> usize {
        self.waiting_count
    }

    /// A command's answer: a pull read from the store, a promotion for a
    /// copy, a copy to another node, or a tier move (`status` 0: done).
    fn transfer_done(&mut self, request: u64, status: u32) {
        if request & STORE_READ_REQUESTS != 0 {
            self.store_read_done(request, status);
        } else if request & PROMOTE_REQUESTS != 0 {
            // A promotion for a copy: the copy goes once its L1 replica is
            // reported (a commit).
            self.promotion_done(request, status);
        } else if request & COPY_REQUESTS != 0 {
            if self.copy_again(request, status) {
                return;
            }
            self.copies_out.remove(&request);
            if let Some((key, to_reader)) = self.placing.remove(&request) {
                let spilled = self.tiers.spill_done(&key, status == 0);
                if status == 0 && self.goes_from_here(&key, to_reader) {
                    // A spill is counted by the tiers.
                    if to_reader {
                        self.moved_to_readers += 1;
                    } else if !spilled {
                        self.placed_away += 1;
                    }
                }
            }
            if status == lake_dp::wire::message::ErrorCode::Cancelled as u32 {
                self.copies_cancelled += 1;
            } else if status == 0 {
                self.copies_landed += 1;
            } else {
                self.copies_failed += 1;
            }
        } else if status == 0 {
            self.tiers.done(request, true);
        } else {
            self.tiers.refused(request, status);
        }
    }

    /// Applies one report from a `lake-dp` (`request`: the frame's request
    /// id; a `TransferDone` echoes the command's).
    pub fn on_data_plane(&mut self, request: u64, message: &Message<'_>) -> Result<(), NodeError> {
        let result = match message {
            Message::RegisterRegion(region) => self.register(region),
            Message::BlockCommitted(block) => self.add(block, false),
            Message::BlockReadopted(block) => self.add(block, true),
            Message::BlockEvicted(evicted) => self.evict(evicted),
            Message::TransferDone(done) => {
                self.transfer_done(request, done.status);
                Ok(())
            }
            Message::DataPlaneStats(stats) => {
                self.data_plane = Some(*stats);
                Ok(())
            }
            Message::SaveRefusals(refusals) => {
                self.save_refusals = Some(*refusals);
                Ok(())
            }
            Message::ConnectionsShed(shed) => {
                self.connections_shed = Some(*shed);
                Ok(())
            }
            Message::RailStats(head, entries) => {
                // Validated on decode: a known network.
                let Some(network) = lake_dp::wire::message::Network::from_u8(head.network) else {
                    return Err(NodeError::Unexpected(message.kind()));
                };
                let entries: Vec<_> = entries.iter().collect();
                match self.rails.iter_mut().find(|(n, _)| *n == network) {
                    Some((_, latest)) => *latest = entries,
                    None => self.rails.push((network, entries)),
                }
                Ok(())
            }
            Message::TenantThrottles(_, entries) => {
                // An older data plane: its first five paths.
                self.tenant_throttles = entries.iter().map(lake_dp::wire::message::TenantWait::from).collect();
                Ok(())
            }
            Message::TenantWaits(_, entries) => {
                self.tenant_throttles = entries.iter().collect();
                Ok(())
            }
            Message::PathLatency(_, entries) => {
                // Validated on decode: known paths, buckets within counts;
                // the engines' paths are theirs to send.
                let engines = lake_dp::wire::message::Path::AgentReadL1 as u8;
                self.paths = entries.iter().filter(|e| e.path < engines).collect();
                Ok(())
            }
            other => Err(NodeError::Unexpected(other.kind())),
        };
        if result.is_err() {
            self.counters.refused += 1;
        }
        result
    }

    /// Applies one request from an engine's agent (`peer` names its
    /// connection; leases are idempotent per peer and request id). Returns
    /// the lease granted, for a lease request.
    pub fn on_agent(
        &mut self,
        peer: u64,
        request: u64,
        message: &Message<'_>,
        now_ns: u64,
    ) -> Result<Option<&crate::lease::Lease>, NodeError> {
        match message {
            Message::LeaseRequest(head, keys) => {
                let locations = &self.locations;
                // The fastest ready replica of each key.
                let replica_of = |key: &BlockKey| locations.ready(key).min_by_key(|r| r.tier as u8);
                Ok(Some(self.leases.grant(peer, request, keys.iter(), replica_of, head.ttl_ms, now_ns)))
            }
            Message::LeaseRelease(release) => {
                self.leases.release(release.lease_id);
                Ok(None)
            }
            Message::Resident(head, keys) => {
                self.l0.report(peer, keys.iter(), head.resident == 1);
                Ok(None)
            }
            Message::RailStats(head, entries) if head.network == lake_dp::wire::message::Network::Compute as u8 => {
                let entries: Vec<_> = entries.iter().collect();
                match self.engine_rails.iter_mut().find(|(p, _)| *p == peer) {
                    Some((_, latest)) => *latest = entries,
                    None => self.engine_rails.push((peer, entries)),
                }
                Ok(None)
            }
            Message::PathLatency(_, entries) => {
                // Validated on decode (known paths); an engine times only
                // its own side.
                let entries: Vec<_> =
                    entries.iter().filter(|e| e.path >= lake_dp::wire::message::Path::AgentReadL1 as u8).collect();
                match self.engine_paths.iter_mut().find(|(p, _)| *p == peer) {
                    Some((_, latest)) => *latest = entries,
                    None => self.engine_paths.push((peer, entries)),
                }
                Ok(None)
            }
            Message::CopyBlock(transfer) => {
                self.pull(peer, transfer)?;
                Ok(None)
            }
            Message::Accessed(head, keys) => {
                self.counters.accesses += 1;
                self.counters.requested_blocks += u64::from(head.count);
                self.counters.hit_blocks += u64::from(head.hit_blocks);
                self.scratch.clear();
                self.scratch.extend(keys.iter());
                self.tiers.accessed(head.namespace, &self.scratch);
                // The leading hits were found and served: seen again.
                let hits = usize::try_from(head.hit_blocks).unwrap_or(usize::MAX).min(self.scratch.len());
                self.tiers.reused(&self.scratch[..hits]);
                Ok(None)
            }
            other => {
                self.counters.refused += 1;
                Err(NodeError::Unexpected(other.kind()))
            }
        }
    }

    fn register(&mut self, region: &RegisterRegion) -> Result<(), NodeError> {
        let tier = Tier::from_u8(region.tier).ok_or(NodeError::Field("register_region.tier"))?;
        if region.node != self.node.0 {
            return Err(NodeError::Field("register_region.node: another node's region"));
        }
        self.locations.register_region(region.region, tier, self.node, region.region_epoch)?;
        self.tiers.register(
            region.region,
            tier,
            self.node.0,
            region.region_epoch,
            region.slot_bytes,
            u64::from(region.slot_count),
        );
        self.tiers.name_region(region.region, region.name());
        self.counters.regions += 1;
        if let Some(info) = self.locations.region(region.region) {
            let record = RegionRecord { tier, epoch: info.epoch, epoch_tag: info.epoch_tag(), node: self.node };
            let tenants = self.tenant_mirrors.iter_mut().map(|(_, mirror)| mirror);
            for mirror in self.mirror.iter_mut().chain(tenants) {
                if mirror.set_region(RegionId(region.region), &record).is_err() {
                    self.counters.mirror_skipped += 1;
                }
            }
        }
        Ok(())
    }

    fn add(&mut self, block: &BlockRecord, readopted: bool) -> Result<(), NodeError> {
        self.add_as(block, readopted, false)
    }

    /// Adds a reported block; `as_root`: without its parent (gone).
    fn add_as(&mut self, block: &BlockRecord, readopted: bool, as_root: bool) -> Result<(), NodeError> {
        let replica = Replica::from_wire(&block.replica).ok_or(NodeError::Field("block.replica.tier"))?;
        if replica.node != self.node {
            return Err(NodeError::Field("block.replica.node: another node's replica"));
        }
        let kind = ObjectKind::from_u16(block.kind).ok_or(NodeError::Field("block.kind"))?;
        let parent = match self.locations.parent_of(&block.key) {
            // Held already: another replica joins the block where the
            // index has it (a root of its own, say, where it landed
            // before its parent — pulled blocks land in any order — or
            // outlived it).
            Some(held) => held,
            None => {
                // A new block continuing a copy pulled in from another
                // node is a root here: the copy, first to go, is not held
                // back as its parent.
                let after_pulled = self.tiers.is_pulled_in(&block.parent_key) && !self.pulling.contains_key(&block.key);
                (!block.parent_key.is_none() && !as_root && !after_pulled).then_some(block.parent_key)
            }
        };
        let existing = self.locations.ready(&block.key).find(|r| r.region == replica.region);
        if let Some(existing) = existing
            && (existing.slot, existing.generation) != (replica.slot, replica.generation)
            && !readopted
        {
            // Two agents saved the same block at once: the first copy
            // stays (readers may hold it), the second is freed.
            self.tiers.duplicate(block.key, replica);
            return Ok(());
        }
        let new = existing.is_none();
        if new && !readopted && !self.make_room_for(&block.key, replica.tier) {
            // An L3 copy of a block in L1 and a leased L2: not tracked
            // (the object stays in the store and the data plane's catalog,
            // reported again when the block next moves to L3).
            self.counters.l3_untracked += 1;
            return Ok(());
        }
        // A new L1 copy of a block a lower tier holds: a promotion.
        let promoted = new
            && !readopted
            && replica.tier == Tier::L1Dram
            && self.locations.ready(&block.key).any(|r| r.tier > Tier::L1Dram);
        let result = self.locations.adopt(
            parent,
            block.key,
            kind,
            replica.region.0,
            replica.region_epoch,
            replica.slot,
            replica.generation,
        );
        match result {
            Ok(at) => {
                // The summary's leader learns whose engines read it.
                self.locations.index.set_namespace(at, block.namespace);
                if readopted {
                    self.counters.readopted += 1;
                } else {
                    self.counters.committed += 1;
                }
                let what = if readopted { BlockEventKind::Readopted } else { BlockEventKind::Committed };
                self.record(block.key, what, (replica.region.0, replica.slot));
                let bytes = lake_dp::stored::object_bytes(block.payload_len);
                self.tiers.added(replica.region.0, block.namespace, parent, block.key, kind, new, bytes);
                // Most commits are no pull's: the map is not hashed into
                // while none waits.
                let pulling = if self.pulling.is_empty() { None } else { self.pulling.remove(&block.key) };
                let pulled = match pulling {
                    Some(at) if unix_ns() < at + copy::PULL_LANDS_NS => {
                        self.pull_landed(at);
                        true
                    }
                    _ => false,
                };
                if new && replica.tier == Tier::L1Dram && pulled && !self.pulls_move {
                    self.tiers.pulled_in(block.namespace, block.key);
                }
                if let Some(tenant) = self.tenant_mirrors.iter().position(|(ns, _)| ns.contains(&block.namespace)) {
                    self.tenant_of.insert(block.key, tenant);
                }
                if promoted {
                    // Read through for a reader that is about to pin it: it
                    // counts as accessed now, so the next victim is another.
                    self.tiers.accessed(block.namespace, &[block.key]);
                    self.tiers.reused(&[block.key]);
                }
                self.publish(&block.key);
                self.shared.continued(&self.locations.index, parent);
                self.release_children(block.key);
                Ok(())
            }
            // Re-adopted in disk order, or pulled with its parent (pulled
            // blocks land in any order): it waits for the parent, so the
            // chain stays one here. Applied as a root on its own, it
            // would leave the parent a leaf, which goes first — a hole at
            // the front of a chain whose end stays.
            Err(LocationError::Index(IndexError::NoParent))
                if readopted || self.pulling.contains_key(&block.parent_key) =>
            {
                self.wait(block, readopted);
                Ok(())
            }
            Err(LocationError::Index(IndexError::NoParent)) => {
                // Committed after its parent was evicted: a root of its own.
                self.counters.rooted += 1;
                self.add_as(block, readopted, true)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn wait(&mut self, block: &BlockRecord, readopted: bool) {
        if self.waiting_count >= PENDING_MAX {
            // Too many wait: the oldest stop waiting.
            let mut first = true;
            self.root_orphans(|_| std::mem::take(&mut first));
        }
        let list = self.waiting.entry(block.parent_key).or_default();
        if list.is_empty() {
            self.waiting_order.push_back((block.parent_key, self.now_ns));
        }
        list.push((*block, readopted));
        self.waiting_count += 1;
        self.counters.waited += 1;
    }

    /// Applies the blocks that waited for `parent`, and theirs in turn.
    fn release_children(&mut self, parent: BlockKey) {
        let mut ready = vec![parent];
        while let Some(key) = ready.pop() {
            let Some(children) = self.waiting.remove(&key) else { continue };
            self.waiting_count -= children.len();
            for (child, readopted) in children {
                // A refusal now (stale epoch after a restart) is counted.
                if self.add(&child, readopted).is_err() {
                    self.counters.refused += 1;
                }
                ready.push(child.key);
            }
        }
    }

    /// A block holds [`crate::index::REPLICAS_INLINE`] replicas at most.
    /// With eager write-back a block can be in L1, L2 and L3 at once — an
    /// L1 copy read through for a block L2 and L3 hold, an L3 copy landing
    /// for one in L1 and L2 — and the third report used to be refused,
    /// leaving the data plane holding a slot nobody freed (a pool of 16 L1
    /// slots stopped taking saves at 32 blocks). The new replica takes the
    /// place of the L2 copy, the redundant middle one, asked of the data
    /// plane to free — unless a reader leases it; then a new L1 copy takes
    /// the L3 one's place in this view only (the object stays in the store
    /// and the data plane's catalog, which reports it again when the block
    /// next moves to L3).
    ///
    /// Returns false for a new L3 copy that finds no room (its block in L1
    /// and in a leased L2): it is then not tracked.
    fn make_room_for(&mut self, key: &BlockKey, tier: Tier) -> bool {
        // Every commit passes here: the common case costs a count, no
        // allocation.
        if self.locations.ready(key).count() < crate::index::REPLICAS_INLINE {
            return true;
        }
        let held_in = |node: &Self, tier: Tier| node.locations.ready(key).find(|r| r.tier == tier);
        if tier == Tier::L2Nvme {
            // The copy of a block moving between L2 files (a drain): the
            // source leaves the view now so the copy fits beside an L1
            // replica; the data plane frees it and reports that next.
            let moving = {
                let tiers = &self.tiers;
                self.locations.ready(key).find(|r| r.tier == Tier::L2Nvme && tiers.is_relocating(key, r.region.0))
            };
            if let Some(source) = moving
                && self.locations.remove(key, source.region.0).is_ok()
            {
                self.tiers.removed(source.region.0, key);
                self.tiers.expect_eviction(*key, source);
                return true;
            }
            // A demotion's L2 copy of a block L3 holds too: its L1 copy is
            // on its way out (the data plane reports its eviction next), so
            // it leaves the view now — the block is never missing from it.
            if let Some(l1) = held_in(self, Tier::L1Dram)
                && self.tiers.is_leaving(key, l1.region.0)
                && self.locations.remove(key, l1.region.0).is_ok()
            {
                self.tiers.removed(l1.region.0, key);
                self.tiers.expect_eviction(*key, l1);
                self.counters.replicas_given_up += 1;
            }
            return true;
        }
        let (l2, l3) = (held_in(self, Tier::L2Nvme), held_in(self, Tier::L3Object));
        // One with a command in flight is on its way out already (or being
        // copied): not asked twice.
        let free =
            |node: &Self, r: &Replica| !node.leases.is_held(key, r.region.0) && !node.tiers.is_pending(key, r.region.0);
        if let Some(l2) = l2
            && free(self, &l2)
            && self.locations.remove(key, l2.region.0).is_ok()
        {
            self.tiers.removed(l2.region.0, key);
            self.tiers.duplicate(*key, l2);
            self.counters.replicas_given_up += 1;
        } else if tier == Tier::L1Dram
            && let Some(l3) = l3
            && free(self, &l3)
            && self.locations.remove(key, l3.region.0).is_ok()
        {
            self.tiers.removed(l3.region.0, key);
            self.counters.replicas_given_up += 1;
        } else if tier == Tier::L3Object {
            return false;
        }
        true
    }

    fn evict(&mut self, evicted: &BlockEvicted) -> Result<(), NodeError> {
        let replica = Replica::from_wire(&evicted.replica).ok_or(NodeError::Field("evicted.replica.tier"))?;
        let current = self.locations.ready(&evicted.key).find(|r| r.region == replica.region);
        // Only the replica the report names: a later one in the same region
        // (another slot or generation) stays.
        match current {
            Some(r) if r.slot == replica.slot && r.generation == replica.generation => {}
            _ if self.tiers.take_duplicate(&evicted.key, &replica) => {
                self.record(evicted.key, BlockEventKind::Evicted(evicted.reason), (replica.region.0, replica.slot));
                return Ok(());
            }
            // An L3 copy the view did not track (see `make_room_for`).
            None if replica.tier == Tier::L3Object => {
                self.counters.l3_untracked_evicted += 1;
                self.record(evicted.key, BlockEventKind::Evicted(evicted.reason), (replica.region.0, replica.slot));
                return Ok(());
            }
            _ => return Err(NodeError::Location(LocationError::StaleGeneration)),
        }
        self.locations.remove(&evicted.key, replica.region.0)?;
        self.tiers.removed(replica.region.0, &evicted.key);
        self.counters.evicted += 1;
        self.record(evicted.key, BlockEventKind::Evicted(evicted.reason), (replica.region.0, replica.slot));
        self.publish(&evicted.key);
        Ok(())
    }
}

mod copy;
mod publish;
#[cfg(test)]
mod tests;
