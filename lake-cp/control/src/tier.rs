//! Placement and eviction across this node's tiers: per-tier byte
//! capacities, per-namespace quotas, leaf-first victims chosen by the
//! eviction policies of [`crate::evict`], demotion before a drop, and
//! admission for L2 writes.
//!
//! Each (tier, namespace) pair is a *space* with its own cache — the radix
//! of the blocks that have a replica in that tier, under the tier's policy
//! — and its own byte count. A block whose parent is not in the same tier
//! starts a subtree of its own there, so "leaf-first" holds per tier: a
//! block leaves L1 only when none of its continuations is in L1.
//!
//! When a tier is above its high-water mark (or a namespace above its
//! quota) the manager takes victims — from the space furthest over its
//! share — until the tier is back under the low-water mark, and turns each
//! into a command for the `lake-dp` that holds it:
//!
//! - an L1 victim with a ready L2 copy is dropped from L1 (`EvictBlock`);
//! - an L1 victim without one is demoted (`MoveBlock` L1→L2; the data plane
//!   writes L2, reports the new replica, then frees L1), unless L2 is full
//!   and L2's policy would not admit the block over its own victim (or the
//!   node has no L2): then it goes to L3 if the node has an object store
//!   and L3 holds none of it, else it is dropped (admission control for L2
//!   writes);
//! - an L2 victim with a ready L3 copy is dropped; one without is moved to
//!   L3 (`MoveBlock` L2→L3: the object is stored, reported `Durable`, then
//!   the L2 slot freed) where the node has an object store, else dropped;
//! - an L3 victim (past the catalog's capacity) is deleted.
//!
//! With [`L3WriteBack::Eager`], every block saved (or landed) in L1 or L2
//! is also copied to L3 soon after (`CopyBlock`, from L2 if it is there
//! by then, at write-back priority, a bounded number per pass), so L3
//! holds the whole pool and an eviction from L2 is a drop.
//!
//! A replica a reader holds a lease on is passed over. Bytes of commands in
//! flight count as already gone, so one pass does not ask twice; a command
//! that fails (or is not answered within [`PENDING_TIMEOUT_NS`]) puts its
//! block back in the cache.
//!
//! Accounting is by slot: a block costs its region's slot size. Byte counts
//! are kept per (region, namespace), so a `lake-dp` restart (a region's new
//! epoch) resets exactly what that region held.

use std::collections::{HashMap, HashSet};

use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::{BlockEvicted, DrainRegion, EvictReason, SLOT_ANY, Transfer};
use lake_dp::{BlockKey, ObjectKind, Priority, Replica, Tier};

use crate::evict::{Cache, Lake, Lru, Policy, Verdict};
use crate::lease::Leases;
use crate::location::Locations;

/// A command not answered within this time is given up (its block goes
/// back in the cache).
pub const PENDING_TIMEOUT_NS: u64 = 30_000_000_000;

/// A block whose command the data plane refused waits this long before
/// it may be chosen again.
pub const RETRY_WAIT_NS: u64 = 50_000_000;

/// Commands one planning pass may issue at most (the rest wait for the
/// next pass, so a burst of pressure does not flood the data plane).
pub const COMMANDS_PER_PASS: usize = 256;

/// Which policy each space runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// [`Lake`]: shadow experts (the default).
    #[default]
    Lake,
    /// [`Lru`]: the baseline.
    Lru,
}

impl PolicyKind {
    /// By name: `lake` or `lru`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "lake" => Some(Self::Lake),
            "lru" => Some(Self::Lru),
            _ => None,
        }
    }

    fn build(self, capacity_blocks: usize) -> Box<dyn Policy + Send> {
        match self {
            Self::Lake => Box::new(Lake::new(capacity_blocks.max(1))),
            Self::Lru => Box::new(Lru::default()),
        }
    }
}

/// When blocks are written to L3 (the object store).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum L3WriteBack {
    /// When they leave L2 (or L1 with nowhere else to go): L3 holds what
    /// the node's faster tiers could not.
    #[default]
    #[value(name = "evict")]
    OnEviction,
    /// As soon as they are saved, whatever the pressure: L3 holds
    /// everything, the source of truth.
    Eager,
}

/// Write-backs to L2 ([`Tiers::persist`]) in flight at most.
const PERSIST_IN_FLIGHT: usize = 8;

/// L1 blocks added this lately are not marked to be dropped (ns): a save's
/// own blocks are not the victims of the rest of it.
const MARK_AFTER_NS: u64 = 250_000_000;

/// L1 blocks are written below ahead of demand once this old (ns)...
const CLEAN_AFTER_NS: u64 = 100_000_000;

/// ...and L1 is this full (percent of its capacity).
const CLEAN_FROM_PERCENT: u8 = 50;

/// Victims one pass takes out of an L1 region's caches at most.
const MARKS_PER_PASS: usize = 512;

// An L1 region's data plane holds a quarter of its slots in marked
// victims (and victims being written below to be marked): spent by saves
// and loads that find no free slot and by the evictions that keep L1 under
// its mark, chosen again every pass. Few enough that the cache's policy
// (leaf-first: a shared prefix outlives its tails), not the order they
// were marked in, decides what goes; marking every block broke that.

/// Writes below ahead of demand in flight at most, per L1 region (each
/// stages its block in a free L1 slot).
const CLEANING_IN_FLIGHT: usize = 16;

/// Write-backs queued at most; beyond, the oldest are let go (counted).
const WRITE_BACK_QUEUE_MAX: usize = 1 << 20;

/// Write-backs one pass may ask at most.
const WRITE_BACKS_PER_PASS: usize = COMMANDS_PER_PASS / 4;

/// Which L1 victims are written to L2 (the rest are dropped from L1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum L2Admission {
    /// Every victim L2 has room for; once L2 is over its high-water mark
    /// its policy also judges each against its own victim.
    #[default]
    Always,
    /// Only a block seen a second time — looked up and hit after it was
    /// saved, or saved again after an earlier victim of it was dropped —
    /// or the continuation of a prefix seen a second time (its parent
    /// was: a conversation's next turn). A block used once (a one-off
    /// document) is not worth an L2 write. Remembered for the last
    /// [`SEEN_MAX`] blocks of each kind.
    SecondAccess,
}

/// Blocks the second-access filter remembers, of those seen again and of
/// those dropped (each a bounded FIFO set).
pub const SEEN_MAX: usize = 1 << 20;

/// A set that forgets its oldest members beyond a bound.
#[derive(Debug, Default)]
struct Remembered {
    members: HashSet<BlockKey>,
    order: std::collections::VecDeque<BlockKey>,
}

impl Remembered {
    fn note(&mut self, key: BlockKey) {
        if self.members.insert(key) {
            self.order.push_back(key);
            if self.order.len() > SEEN_MAX
                && let Some(old) = self.order.pop_front()
            {
                self.members.remove(&old);
            }
        }
    }

    fn contains(&self, key: &BlockKey) -> bool {
        self.members.contains(key)
    }
}

/// A namespace's byte quota in one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// The namespace id.
    pub namespace: u64,
    /// The tier.
    pub tier: Tier,
    /// Bytes it may hold there.
    pub bytes: u64,
}

/// A tenant's byte quota in one tier, over all its namespaces (the
/// namespaces are the tenant's as the operator says: a namespace id names
/// a tenant key only to those who hold it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantQuota {
    /// The tenant's name (for logs and `/metrics`).
    pub tenant: String,
    /// Its namespaces.
    pub namespaces: Vec<u64>,
    /// The tier.
    pub tier: Tier,
    /// Bytes its namespaces may hold there together.
    pub bytes: u64,
}

/// How the tiers are managed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes each tier may hold, by `Tier as usize` (`None`: what its
    /// regions hold).
    pub capacity_bytes: [Option<u64>; 4],
    /// Per-namespace quotas.
    pub quotas: Vec<Quota>,
    /// Per-tenant quotas, over several namespaces.
    pub tenant_quotas: Vec<TenantQuota>,
    /// Eviction starts above this percentage of a tier's capacity...
    pub high_percent: u8,
    /// ...and stops below this one.
    pub low_percent: u8,
    /// The policy of every space.
    pub policy: PolicyKind,
    /// When blocks go to L3 (where a node has an object store).
    pub l3_write_back: L3WriteBack,
    /// Which L1 victims are written to L2.
    pub l2_admission: L2Admission,
    /// A copy to another node not sent by then (held behind its tenant's
    /// cap, say) is dropped by its data plane, its slot released: the
    /// deadline every copy carries, from when it is asked (ms; 0: none).
    pub copy_deadline_ms: u64,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: [None; 4],
            quotas: Vec::new(),
            tenant_quotas: Vec::new(),
            high_percent: 95,
            low_percent: 90,
            policy: PolicyKind::Lake,
            l3_write_back: L3WriteBack::OnEviction,
            l2_admission: L2Admission::Always,
            copy_deadline_ms: 30_000,
        }
    }
}

impl TierConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.low_percent == 0 || self.low_percent >= self.high_percent || self.high_percent > 100 {
            return Err(format!(
                "tiers: need 0 < low_percent ({}) < high_percent ({}) <= 100",
                self.low_percent, self.high_percent
            ));
        }
        Ok(())
    }
}

/// A command for the `lake-dp` holding `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierCommand {
    /// Its request id (the data plane's `TransferDone` echoes it).
    pub request: u64,
    /// The region of the replica it acts on (routes it to its `lake-dp`).
    pub region: u16,
    /// What to do.
    pub action: TierAction,
}

/// What a [`TierCommand`] asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierAction {
    /// Write the source into the target tier, then free the source.
    Move(Transfer),
    /// Write the source into the target (another node's L1), keep it.
    Copy(Transfer),
    /// Free the replica.
    Evict(BlockEvicted),
    /// Drain the L2 region (its data plane writes nothing new there), or
    /// use it again.
    Drain(DrainRegion),
    /// Take back the command's request (a copy to another node not sent
    /// yet): the data plane drops it (`Cancel`, wire kind 10).
    Cancel,
    /// An L1 block chosen as a victim: its data plane may take it for a
    /// save that finds no free slot (`MarkEvictable`; not answered).
    Mark(BlockEvicted),
    /// The mark taken back (`UnmarkEvictable`): the block is wanted again,
    /// or its copy below went.
    Unmark(BlockEvicted),
    /// Whether more victims may come in an L1 region (`VictimsLeft`; not
    /// answered): with none, its data plane refuses a save that finds no
    /// slot at once instead of waiting.
    VictimsLeft(lake_dp::wire::message::VictimsLeft),
}

/// What the manager has done, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Demotions asked (L1→L2).
    pub demotions: u64,
    /// Moves to L3 asked (L2→L3, or L1→L3 on a node without room in L2).
    pub l3_moves: u64,
    /// Eager write-backs asked (copies to L3).
    pub l3_copies: u64,
    /// Eager write-backs let go because the queue was full.
    pub l3_copies_dropped: u64,
    /// Write-backs asked (L1→L2, the L1 copy kept: [`Tiers::persist`]).
    pub l2_write_backs: u64,
    /// Drops asked, by the tier dropped from (`Tier as usize`).
    pub drops: [u64; 4],
    /// L1 victims dropped rather than demoted because L2's policy did not
    /// admit them into a full L2.
    pub admission_refused: u64,
    /// Victims passed over because a lease held them.
    pub leased_kept: u64,
    /// Victims passed over because a copy of them (to L3, to another
    /// node) was in flight.
    pub copying_kept: u64,
    /// Commands that failed or timed out (their blocks went back): the
    /// sum of the four below.
    pub failed: u64,
    /// Of those, refused by the data plane, by error code (index: the
    /// code; 0: an unknown one).
    pub refused: [u64; 16],
    /// Of those, not answered within [`PENDING_TIMEOUT_NS`].
    pub timed_out: u64,
    /// Of those, in flight when their data plane's link closed.
    pub link_lost: u64,
    /// Of those, never sent: no data plane holds the region, or it cannot
    /// take the command (an older build).
    pub unrouted: u64,
    /// Evictions reported for a block no space knew (not counted off).
    pub unattributed: u64,
    /// Second copies of a block in one region, evicted.
    pub duplicates: u64,
    /// Blocks asked out because their tenant was over its quota.
    pub tenant_quota_evictions: u64,
    /// L1 victims dropped rather than written to L2 because the
    /// second-access filter had not seen them twice.
    pub l2_filtered: u64,
    /// Replicas dropped by purges of their namespace.
    pub purged: u64,
    /// Purges asked, and those that finished (the namespace held nothing
    /// more in any tier).
    pub purges_started: u64,
    /// See `purges_started`.
    pub purges_done: u64,
    /// Blocks moved off a drained L2 region to another (`MoveBlock`
    /// L2→L2 asked).
    pub drain_moves: u64,
    /// Replicas in a drained L2 region dropped because another L2 region
    /// or L3 holds the block.
    pub drain_drops: u64,
    /// L1 blocks written below ahead of demand (their L1 copy kept), so
    /// that a save may take their slot at once.
    pub cleanings: u64,
    /// Write-backs of L1 blocks its data plane put off (no free L1 slot to
    /// stage the block in): asked again later.
    pub write_backs_deferred: u64,
    /// L1 blocks marked evictable in their data plane: with a copy below,
    /// and without one (no lower tier had room: dropped if taken).
    pub marked_clean: u64,
    /// See [`TierCounters::marked_clean`].
    pub marked_drop: u64,
    /// Marks taken back (the block wanted again, its copy below gone).
    pub unmarked: u64,
    /// Marked blocks a save took on the spot, by their data plane: with a
    /// copy below, and dropped.
    pub taken_clean: u64,
    /// See [`TierCounters::taken_clean`].
    pub taken_dropped: u64,
}

#[derive(Clone, Copy, Debug)]
struct RegionUse {
    tier: Tier,
    slot_bytes: u64,
    slots: u64,
    epoch: u64,
    node: u32,
}

struct Space {
    cache: Cache<Box<dyn Policy + Send>>,
    quota: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    key: BlockKey,
    parent: Option<BlockKey>,
    kind: ObjectKind,
    namespace: u64,
    tier: Tier,
    region: u16,
    bytes: u64,
    deadline_ns: u64,
    /// It frees its source (a move or a drop), not a copy.
    frees: bool,
    /// The tier it writes to (a move or a copy).
    to: Option<Tier>,
    /// A write below of an L1 victim ahead of demand: once done, the
    /// block is marked evictable.
    cleans: bool,
}

/// An L1 block taken out of its cache as a victim and marked evictable in
/// its data plane (`MarkEvictable`): the data plane takes it for a save
/// that finds no free slot, or this manager evicts it first when L1 is
/// over its mark.
#[derive(Clone, Copy, Debug)]
struct Marked {
    namespace: u64,
    parent: Option<BlockKey>,
    kind: ObjectKind,
    replica: Replica,
    /// `Demoted` (a copy is below) or `Capacity` (dropped if taken).
    reason: EvictReason,
}

/// An L2 region being drained ([`Tiers::drain`]).
#[derive(Debug, Default)]
struct Drain {
    /// The data plane took it: it writes nothing new there.
    announced: bool,
    /// The announcement in flight.
    asking: Option<u64>,
    /// Not announced again before this time (after a refusal).
    retry_ns: u64,
    /// Why the last announcement was refused.
    refused: Option<String>,
    /// Blocks to move off, from the last scan, taken from the end.
    queue: Vec<BlockKey>,
    /// When the region's blocks were last scanned for (never: `None`).
    scanned_ns: Option<u64>,
    /// Blocks moved off and replicas dropped (another copy kept).
    moved: u64,
    dropped: u64,
}

/// A drained region's blocks are looked for again at most this often
/// (a block saved there before the data plane took the drain, one whose
/// move failed, one a lease held).
const DRAIN_SCAN_NS: u64 = 200_000_000;

/// Moves off drained regions one pass may ask at most.
const DRAINS_PER_PASS: usize = 16;

/// Commands in flight from one drained region at most: a drain is
/// background work, and each move holds a staging L1 slot and a device
/// read then write.
const DRAIN_IN_FLIGHT_MAX: usize = 16;

/// A drained announcement refused is sent again after this.
const DRAIN_RETRY_NS: u64 = 1_000_000_000;

/// A drain, for the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainStatus {
    /// The L2 region (one file).
    pub region: u16,
    /// Its node.
    pub node: u32,
    /// Whether its data plane took the drain (it writes nothing new there).
    pub announced: bool,
    /// Why its data plane refused it, if it did (retried each second).
    pub refused: Option<String>,
    /// Blocks it still holds.
    pub blocks_left: u64,
    /// Blocks moved off to another region, and replicas dropped because
    /// another L2 region or L3 holds the block.
    pub moved: u64,
    /// See `moved`.
    pub dropped: u64,
    /// Announced, nothing left there, nothing in flight from it: the
    /// file may be taken away.
    pub done: bool,
}

/// A region, for the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionStatus {
    /// Its id.
    pub region: u16,
    /// Its tier.
    pub tier: Tier,
    /// Its node.
    pub node: u32,
    /// Where it lives (an L2 file's path, the arena's), as registered.
    pub name: String,
    /// Bytes and blocks it holds.
    pub bytes: u64,
    /// See `bytes`.
    pub blocks: u64,
    /// Bytes its slots hold in all.
    pub capacity_bytes: u64,
    /// Whether it is being drained.
    pub draining: bool,
}

/// The tier manager. See the module docs.
pub struct Tiers {
    config: TierConfig,
    /// The node is being drained ([`Tiers::drain_node`]).
    draining_node: bool,
    /// Stopping: L1's capacity is nothing ([`Tiers::empty_l1`]).
    emptying_l1: bool,
    regions: HashMap<u16, RegionUse>,
    /// Bytes held, by (region, namespace).
    used: HashMap<(u16, u64), u64>,
    /// Blocks held, by region.
    blocks: HashMap<u16, u64>,
    /// L1 blocks larger than their region's slot size (an arena of several
    /// size classes, registered by its smallest), by (key, region): what
    /// they hold, and what leaving frees. Empty for one-class arenas.
    sizes: HashMap<(BlockKey, u16), u64>,
    spaces: HashMap<(Tier, u64), Space>,
    pending: HashMap<u64, Pending>,
    /// The pending request of a (key, region), to resolve it when the
    /// eviction is reported.
    pending_of: HashMap<(BlockKey, u16), u64>,
    next_request: u64,
    /// Second copies of a block in a region (two agents saved the same
    /// block at once): evicted at the next pass; their reports expected.
    duplicates: Vec<(BlockKey, Replica)>,
    /// Evictions of duplicates sent and not yet reported.
    duplicates_sent: HashSet<(BlockKey, u16, u32, u32)>,
    /// Blocks whose command was refused, back in their cache at the time
    /// given.
    cooling: Vec<(u64, Pending)>,
    /// The latest planning pass's time.
    now_ns: u64,
    /// Blocks to copy to L3 ([`L3WriteBack::Eager`]), oldest first.
    write_back: std::collections::VecDeque<(BlockKey, u64)>,
    /// L1 blocks to write back to L2, their L1 copy kept
    /// ([`Tiers::persist`]), oldest first.
    persist: std::collections::VecDeque<(BlockKey, u64)>,
    /// Namespaces being purged: every replica of theirs dropped from
    /// every tier, until they hold nothing.
    purging: Vec<u64>,
    /// L2 regions being drained.
    drains: std::collections::BTreeMap<u16, Drain>,
    /// Regions to be used again: their data plane is told next pass.
    undrained: Vec<u16>,
    /// Regions' names as registered.
    names: HashMap<u16, String>,
    /// For [`L2Admission::SecondAccess`]: blocks seen a second time, and
    /// L1 victims it dropped (one saved again is seen a second time).
    seen_twice: Remembered,
    dropped_once: Remembered,
    /// L1 regions whose data plane takes marks ([`TierAction::Mark`]).
    marks_taken: HashSet<u16>,
    /// New L1 blocks the policy would not have let in (see
    /// [`crate::evict::Policy::keeps`]), made cold once no longer new.
    unwanted: HashMap<BlockKey, u64>,
    /// What each such region's data plane was last told of victims left
    /// (absent: more may come, as a data plane assumes).
    victims_left: HashMap<u16, bool>,
    /// L1 blocks marked evictable, and the order they were marked in (an
    /// entry no longer in `marked` is stale).
    marked: HashMap<BlockKey, Marked>,
    mark_order: std::collections::VecDeque<BlockKey>,
    /// Marks to take back at the next pass.
    unmarks: Vec<(BlockKey, Marked)>,
    /// Cleaned L1 blocks to mark at the next pass (their write below done).
    cleaned: Vec<Pending>,
    /// Marked blocks whose copy below went: checked at the next pass.
    recheck: Vec<BlockKey>,
    /// L1 blocks added lately, by when (not marked before
    /// [`MARK_AFTER_NS`]): a save's own blocks are not its victims.
    recent: std::collections::VecDeque<(u64, BlockKey)>,
    recent_keys: HashMap<BlockKey, u64>,
    /// L1 blocks to write below ahead of demand, oldest first: (when
    /// added, key, region, namespace).
    to_clean: std::collections::VecDeque<(u64, BlockKey, u16, u64)>,
    /// What it has done.
    pub counters: TierCounters,
}

impl core::fmt::Debug for Tiers {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Tiers")
            .field("regions", &self.regions.len())
            .field("spaces", &self.spaces.len())
            .field("pending", &self.pending.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

/// One tier's figures, for metrics and the demo.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Bytes held (slots in use × slot size).
    pub bytes: u64,
    /// Blocks held.
    pub blocks: u64,
    /// The capacity eviction keeps it under.
    pub capacity_bytes: u64,
    /// Bytes of commands in flight that will free space here.
    pub pending_bytes: u64,
}

/// L1's watermarks while the node is drained (percent): blocks copied
/// away go down to L2, so promotions for copies find slots.
const DRAINING_L1_HIGH: u8 = 50;
/// See [`DRAINING_L1_HIGH`].
const DRAINING_L1_LOW: u8 = 40;

impl Tiers {
    /// How long a copy to another node may wait to be sent (ms; 0: no
    /// limit): [`TierConfig::copy_deadline_ms`].
    pub fn copy_deadline_ms(&self) -> u64 {
        self.config.copy_deadline_ms
    }

    /// Whether the node is being drained (`lake drain-node`): its L1 keeps
    /// half its room free for the promotions that copy its L2 blocks to
    /// other nodes.
    pub fn drain_node(&mut self, on: bool) {
        self.draining_node = on;
    }

    /// The node is stopping: L1 (volatile) is emptied into L2, the pool's
    /// recovery point — every block with no copy below is demoted (whatever
    /// the L2 admission policy: it was acked), the others dropped from L1 —
    /// so that a restart re-adopts them. [`Tiers::usage`] of L1 says how
    /// far it is.
    pub fn empty_l1(&mut self) {
        self.emptying_l1 = true;
    }

    /// A manager under `config` (checked with [`TierConfig::validate`]).
    pub fn new(config: TierConfig) -> Self {
        Self {
            config,
            draining_node: false,
            emptying_l1: false,
            regions: HashMap::new(),
            used: HashMap::new(),
            blocks: HashMap::new(),
            sizes: HashMap::new(),
            spaces: HashMap::new(),
            pending: HashMap::new(),
            pending_of: HashMap::new(),
            // Request ids of commands: high bit set, apart from the data
            // plane's own report ids.
            next_request: 1 << 63,
            duplicates: Vec::new(),
            duplicates_sent: HashSet::new(),
            write_back: std::collections::VecDeque::new(),
            persist: std::collections::VecDeque::new(),
            purging: Vec::new(),
            drains: std::collections::BTreeMap::new(),
            undrained: Vec::new(),
            names: HashMap::new(),
            seen_twice: Remembered::default(),
            dropped_once: Remembered::default(),
            cooling: Vec::new(),
            now_ns: 0,
            marks_taken: HashSet::new(),
            victims_left: HashMap::new(),
            unwanted: HashMap::new(),
            marked: HashMap::new(),
            mark_order: std::collections::VecDeque::new(),
            unmarks: Vec::new(),
            cleaned: Vec::new(),
            recheck: Vec::new(),
            recent: std::collections::VecDeque::new(),
            recent_keys: HashMap::new(),
            to_clean: std::collections::VecDeque::new(),
            counters: TierCounters::default(),
        }
    }

    /// The data plane of L1 region `region` takes marks
    /// ([`lake_dp::wire::FEATURE_EVICTABLE`]): its victims are chosen
    /// ahead of demand, written below where there is room, and handed to
    /// it, so a save into a full L1 takes one at once.
    pub fn takes_marks(&mut self, region: u16) {
        self.marks_taken.insert(region);
    }

    /// What each cache's policy has learnt, for reports: (tier,
    /// namespace, its summary), where it says anything.
    pub fn policy_states(&self) -> Vec<(Tier, u64, String)> {
        let mut states: Vec<(Tier, u64, String)> = self
            .spaces
            .iter()
            .map(|(&(tier, namespace), space)| (tier, namespace, space.cache.policy.summary()))
            .filter(|(_, _, summary)| !summary.is_empty())
            .collect();
        states.sort_by_key(|(tier, namespace, _)| (*tier as u8, *namespace));
        states
    }

    /// L1 blocks marked evictable now.
    pub fn marked(&self) -> usize {
        self.marked.len()
    }

    /// A region was registered (again after a restart: a new epoch resets
    /// what it held).
    pub fn register(&mut self, region: u16, tier: Tier, node: u32, epoch: u64, slot_bytes: u64, slots: u64) {
        let previous = self.regions.insert(region, RegionUse { tier, slot_bytes, slots, epoch, node });
        if let Some(drain) = self.drains.get_mut(&region)
            && previous.is_none_or(|p| p.epoch != epoch)
        {
            // A restarted data plane forgot the drain: it is told again.
            drain.announced = false;
            drain.asking = None;
            drain.retry_ns = 0;
        }
        if previous.is_some_and(|p| p.epoch != epoch) {
            self.marked.retain(|_, m| m.replica.region.0 != region);
            self.marks_taken.remove(&region);
            self.victims_left.remove(&region);
            self.used.retain(|(r, _), _| *r != region);
            self.sizes.retain(|(_, r), _| *r != region);
            self.blocks.remove(&region);
            let gone: Vec<u64> =
                self.pending.iter().filter(|(_, p)| p.region == region).map(|(&request, _)| request).collect();
            for request in gone {
                self.forget(request);
            }
        }
    }

    /// A replica of `key` became ready in `region` (`new`: the region held
    /// none of it before), `bytes` long as stored (header and padded
    /// payload; 0: the region's slot size). A block takes a whole slot, so
    /// it counts as the region's slot size — which, for an L1 of several
    /// size classes, is its smallest (what its data plane registers) — or
    /// as its own bytes in L1 where those are more: a block of a larger
    /// class (each class is sized to a layout's blocks).
    #[allow(clippy::too_many_arguments)] // one report's fields
    pub fn added(
        &mut self,
        region: u16,
        namespace: u64,
        parent: Option<BlockKey>,
        key: BlockKey,
        kind: ObjectKind,
        new: bool,
        bytes: u64,
    ) {
        let Some(info) = self.regions.get(&region).copied() else { return };
        if new && info.tier == Tier::L1Dram {
            self.recent.push_back((self.now_ns, key));
            self.recent_keys.insert(key, self.now_ns);
            if self.marks_taken.contains(&region) {
                // Bounded: twice the region's slots (the oldest, most
                // likely gone by now, make way).
                if self.to_clean.len() as u64 >= 2 * info.slots.max(1) {
                    self.to_clean.pop_front();
                }
                self.to_clean.push_back((self.now_ns, key, region, namespace));
            }
        }
        if new {
            let held = if info.tier == Tier::L1Dram && bytes > info.slot_bytes {
                self.sizes.insert((key, region), bytes);
                bytes
            } else {
                info.slot_bytes
            };
            *self.used.entry((region, namespace)).or_default() += held;
            *self.blocks.entry(region).or_default() += 1;
        }
        if self.config.l2_admission == L2Admission::SecondAccess
            && info.tier == Tier::L1Dram
            && self.dropped_once.contains(&key)
        {
            self.seen_twice.note(key);
        }
        let eager = self.config.l3_write_back == L3WriteBack::Eager
            && new
            && matches!(info.tier, Tier::L1Dram | Tier::L2Nvme)
            && self.region_on(Tier::L3Object, info.node).is_some();
        if eager {
            if self.write_back.len() >= WRITE_BACK_QUEUE_MAX {
                self.write_back.pop_front();
                self.counters.l3_copies_dropped += 1;
            }
            self.write_back.push_back((key, namespace));
        }
        let space = self.space(info.tier, namespace);
        if info.tier == Tier::L2Nvme && space.cache.index.contains(&key) {
            // A second L2 copy (a block moved off a drained file): the
            // tier holds it already, and the move is not an access.
            return;
        }
        // Taken (L1 takes every save), though the policy would not have
        // let it in: first in line once it is no longer new.
        let unwanted = info.tier == Tier::L1Dram && new && !space.cache.keeps(&key);
        space.cache.add(parent, key, kind);
        if unwanted {
            self.unwanted.insert(key, namespace);
        }
    }

    /// Whether the replica of `key` in `region` is being moved to another
    /// L2 region (off a drained file).
    pub fn is_relocating(&self, key: &BlockKey, region: u16) -> bool {
        self.pending_of
            .get(&(*key, region))
            .and_then(|r| self.pending.get(r))
            .is_some_and(|p| p.tier == Tier::L2Nvme && p.to == Some(Tier::L2Nvme))
    }

    /// The region of `tier` on `node` (the lowest id), if it has one.
    fn region_on(&self, tier: Tier, node: u32) -> Option<(u16, RegionUse)> {
        self.regions
            .iter()
            .filter(|(_, r)| r.tier == tier && r.node == node)
            .min_by_key(|(id, _)| **id)
            .map(|(id, r)| (*id, *r))
    }

    /// The L2 region of `node` that blocks are written to: its first one
    /// not being drained.
    fn l2_written_to(&self, node: u32) -> Option<(u16, RegionUse)> {
        self.regions
            .iter()
            .filter(|(id, r)| r.tier == Tier::L2Nvme && r.node == node && !self.drains.contains_key(id))
            .min_by_key(|(id, _)| **id)
            .map(|(id, r)| (*id, *r))
    }

    /// Whether a command about the replica of `key` in `region` is in
    /// flight (it is on its way out, or being copied).
    pub fn is_pending(&self, key: &BlockKey, region: u16) -> bool {
        self.pending_of.contains_key(&(*key, region))
    }

    /// Whether the replica of `key` in `region` is on its way out: a move
    /// or an eviction of it is in flight (not a copy).
    pub fn is_leaving(&self, key: &BlockKey, region: u16) -> bool {
        self.pending_of.get(&(*key, region)).and_then(|r| self.pending.get(r)).is_some_and(|p| p.frees)
    }

    /// The report of `replica`'s eviction, when it comes, is of one this
    /// manager already let go (taken out of the view ahead of it).
    pub fn expect_eviction(&mut self, key: BlockKey, replica: Replica) {
        if self.duplicates_sent.len() < COMMANDS_PER_PASS * 64 {
            self.duplicates_sent.insert((key, replica.region.0, replica.slot, replica.generation));
        }
    }

    /// A second replica of `key` in a region that holds one already (two
    /// agents saved the same block at once): the first stays, this one is
    /// evicted at the next pass.
    pub fn duplicate(&mut self, key: BlockKey, replica: Replica) {
        if self.duplicates.len() < COMMANDS_PER_PASS * 16 {
            self.counters.duplicates += 1;
            self.duplicates.push((key, replica));
        }
    }

    /// Whether a reported eviction is that of a duplicate this manager
    /// asked for (it was never in the location view).
    pub fn take_duplicate(&mut self, key: &BlockKey, replica: &Replica) -> bool {
        self.duplicates_sent.remove(&(*key, replica.region.0, replica.slot, replica.generation))
    }

    /// Bytes the replica of `key` in `region` holds.
    fn block_bytes(&self, region: u16, key: &BlockKey) -> u64 {
        self.sizes
            .get(&(*key, region))
            .copied()
            .or_else(|| self.regions.get(&region).map(|r| r.slot_bytes))
            .unwrap_or(0)
    }

    /// The replica of `key` in `region` went away.
    pub fn removed(&mut self, region: u16, key: &BlockKey) {
        let Some(info) = self.regions.get(&region).copied() else { return };
        let held = self.sizes.remove(&(*key, region)).unwrap_or(info.slot_bytes);
        let marked = match self.marked.get(key) {
            Some(m) if m.replica.region.0 == region => {
                // Taken by its data plane for a save (no command of ours
                // on it).
                if !self.pending_of.contains_key(&(*key, region)) {
                    if m.reason == EvictReason::Demoted {
                        self.counters.taken_clean += 1;
                    } else {
                        self.counters.taken_dropped += 1;
                    }
                }
                self.marked.remove(key).map(|m| m.namespace)
            }
            Some(m) if m.reason == EvictReason::Demoted && info.tier != Tier::L1Dram => {
                // Its copy below went: dropping its L1 copy would lose it.
                self.recheck.push(*key);
                None
            }
            _ => None,
        };
        let namespace = match self.pending_of.remove(&(*key, region)) {
            Some(request) => self.pending.remove(&request).map(|p| p.namespace),
            None => marked,
        };
        let namespace = namespace.or_else(|| {
            let found =
                self.spaces.iter_mut().find(|((tier, _), space)| *tier == info.tier && space.cache.index.contains(key));
            found.map(|((_, namespace), space)| {
                space.cache.remove(key);
                *namespace
            })
        });
        match namespace {
            Some(namespace) => {
                if let Some(bytes) = self.used.get_mut(&(region, namespace)) {
                    *bytes = bytes.saturating_sub(held);
                }
                if let Some(blocks) = self.blocks.get_mut(&region) {
                    *blocks = blocks.saturating_sub(1);
                }
            }
            None => self.counters.unattributed += 1,
        }
    }

    /// Blocks hit (found and served) by a request: seen a second time,
    /// for [`L2Admission::SecondAccess`].
    pub fn reused(&mut self, keys: &[BlockKey]) {
        if self.config.l2_admission == L2Admission::SecondAccess {
            for key in keys {
                self.seen_twice.note(*key);
            }
        }
    }

    /// An agent's request: its keys in prefix order.
    pub fn accessed(&mut self, namespace: u64, keys: &[BlockKey]) {
        // Wanted again: a marked one goes back in its cache (unmarked).
        for key in keys {
            if let Some(marked) = self.marked.remove(key) {
                self.unmarks.push((*key, marked));
                self.space(Tier::L1Dram, marked.namespace).cache.add(marked.parent, *key, marked.kind);
            }
        }
        for ((_, ns), space) in &mut self.spaces {
            if *ns == namespace {
                space.cache.accessed(keys);
            }
        }
    }

    /// The data plane refused command `request` with `code` (an
    /// `ErrorCode`): counted by code, then as [`Tiers::done`] failed.
    pub fn refused(&mut self, request: u64, code: u32) {
        // A write-back of an L1 block that found no free L1 slot to stage
        // in: asked again later (its block stays in L1), not a failure.
        let deferred = self.pending.get(&request).filter(|p| {
            code == lake_dp::wire::message::ErrorCode::NoSpace as u32
                && p.tier == Tier::L1Dram
                && !p.frees
                && p.to == Some(Tier::L2Nvme)
        });
        if let Some(&pending) = deferred {
            self.counters.write_backs_deferred += 1;
            self.pending.remove(&request);
            self.pending_of.remove(&(pending.key, pending.region));
            if pending.cleans {
                self.space(Tier::L1Dram, pending.namespace).cache.add(pending.parent, pending.key, pending.kind);
            } else {
                self.persist.push_back((pending.key, pending.namespace));
            }
            return;
        }
        if self.is_known(request) {
            let index = usize::try_from(code).ok().filter(|&c| c < self.counters.refused.len()).unwrap_or(0);
            self.counters.refused[index] += 1;
        }
        self.done(request, false);
    }

    /// Command `request` was never sent (see [`TierCounters::unrouted`]).
    pub fn unrouted(&mut self, request: u64) {
        if self.is_known(request) {
            self.counters.unrouted += 1;
        }
        self.done(request, false);
    }

    /// Whether `request` is a command in flight whose failure counts.
    fn is_known(&self, request: u64) -> bool {
        self.pending.contains_key(&request)
    }

    /// The data plane answered command `request` (`ok`: it did it).
    pub fn done(&mut self, request: u64, ok: bool) {
        if let Some(drain) = self.drains.values_mut().find(|d| d.asking == Some(request)) {
            drain.asking = None;
            if ok {
                drain.announced = true;
                drain.refused = None;
            } else {
                drain.retry_ns = self.now_ns.saturating_add(DRAIN_RETRY_NS);
                drain.refused.get_or_insert_with(|| "its lake-dp refused it".to_owned());
            }
            return;
        }
        let Some(pending) = self.pending.remove(&request) else { return };
        self.pending_of.remove(&(pending.key, pending.region));
        if pending.cleans {
            // Written below (or not: no L1 slot to stage it in, say):
            // marked, or back in its cache.
            if ok {
                self.cleaned.push(pending);
            } else {
                self.space(Tier::L1Dram, pending.namespace).cache.add(pending.parent, pending.key, pending.kind);
            }
            return;
        }
        if ok {
            return;
        }
        // Refused (the target full, the slot held...): the block goes back
        // after a wait, so a pass does not ask the same again at once.
        self.counters.failed += 1;
        if pending.frees && self.cooling.len() < COMMANDS_PER_PASS * 64 {
            self.cooling.push((self.now_ns.saturating_add(RETRY_WAIT_NS), pending));
        } else {
            self.put_back(&pending);
        }
    }

    /// Every command sent to the `lake-dp` holding `regions` failed (its
    /// connection closed).
    pub fn lost_regions(&mut self, regions: &[u16]) {
        let gone: Vec<u64> =
            self.pending.iter().filter(|(_, p)| regions.contains(&p.region)).map(|(&request, _)| request).collect();
        for request in gone {
            self.counters.failed += 1;
            self.counters.link_lost += 1;
            self.forget(request);
        }
    }

    /// Drops a pending command and puts its block back in its cache (a
    /// copy never took it out).
    fn forget(&mut self, request: u64) {
        let Some(pending) = self.pending.remove(&request) else { return };
        self.pending_of.remove(&(pending.key, pending.region));
        self.put_back(&pending);
    }

    /// The block of a command that did not happen goes back in its cache
    /// (a copy never took it out).
    fn put_back(&mut self, pending: &Pending) {
        if pending.frees || pending.cleans {
            let space = self.space(pending.tier, pending.namespace);
            // A block moving between regions of one tier never left its
            // cache: it is not touched again.
            if !space.cache.index.contains(&pending.key) {
                space.cache.add(pending.parent, pending.key, pending.kind);
            }
        }
    }

    /// Sends `action` for the block `pending` describes: numbered, kept
    /// until answered, queued in `out`.
    fn ask(&mut self, mut pending: Pending, action: TierAction, out: &mut Vec<TierCommand>) {
        let request = self.next_request;
        self.next_request += 1;
        pending.to = match action {
            TierAction::Move(t) | TierAction::Copy(t) => Tier::from_u8(t.target.tier),
            TierAction::Evict(_)
            | TierAction::Drain(_)
            | TierAction::Cancel
            | TierAction::Mark(_)
            | TierAction::Unmark(_)
            | TierAction::VictimsLeft(_) => None,
        };
        self.pending.insert(request, pending);
        self.pending_of.insert((pending.key, pending.region), request);
        out.push(TierCommand { request, region: pending.region, action });
    }

    fn space(&mut self, tier: Tier, namespace: u64) -> &mut Space {
        let quota = self.config.quotas.iter().find(|q| q.namespace == namespace && q.tier == tier).map(|q| q.bytes);
        let slot_bytes =
            self.regions.values().filter(|r| r.tier == tier).map(|r| r.slot_bytes).max().unwrap_or(1).max(1);
        let capacity = quota.unwrap_or_else(|| self.capacity(tier));
        let policy = self.config.policy;
        self.spaces.entry((tier, namespace)).or_insert_with(|| Space {
            cache: Cache::live(policy.build(usize::try_from(capacity / slot_bytes).unwrap_or(usize::MAX))),
            quota,
        })
    }

    /// The bytes `tier` may hold.
    /// Regions being drained are not counted: what they hold must fit in
    /// the rest.
    pub fn capacity(&self, tier: Tier) -> u64 {
        if tier == Tier::L1Dram && self.emptying_l1 {
            return 0;
        }
        let physical = || {
            self.regions
                .iter()
                .filter(|(id, r)| r.tier == tier && !self.drains.contains_key(id))
                .map(|(_, r)| r.slot_bytes * r.slots)
                .sum()
        };
        match self.config.capacity_bytes[tier as usize] {
            Some(configured) if self.drains.is_empty() => configured,
            Some(configured) => configured.min(physical()),
            None => physical(),
        }
    }

    fn used_by(&self, tier: Tier, namespace: Option<u64>) -> u64 {
        self.used
            .iter()
            .filter(|((region, ns), _)| {
                self.regions.get(region).is_some_and(|r| r.tier == tier) && namespace.is_none_or(|n| n == *ns)
            })
            .map(|(_, bytes)| bytes)
            .sum()
    }

    fn pending_by(&self, tier: Tier, namespace: Option<u64>) -> u64 {
        self.pending
            .values()
            .filter(|p| p.frees && p.tier == tier && namespace.is_none_or(|n| n == p.namespace))
            .map(|p| p.bytes)
            .sum()
    }

    /// A tier's figures.
    pub fn usage(&self, tier: Tier) -> TierUsage {
        let bytes = self.used_by(tier, None);
        let blocks = self
            .blocks
            .iter()
            .filter(|(region, _)| self.regions.get(region).is_some_and(|r| r.tier == tier))
            .map(|(_, blocks)| blocks)
            .sum();
        TierUsage { bytes, blocks, capacity_bytes: self.capacity(tier), pending_bytes: self.pending_by(tier, None) }
    }

    /// Purges `namespace`: from the next pass on, every replica of its
    /// blocks is dropped from every tier (a leased one once its lease
    /// ends), until it holds nothing — an old model version, or a tenant
    /// secret rotated away. Blocks it saves while purging go too.
    pub fn purge(&mut self, namespace: u64) {
        if !self.purging.contains(&namespace) {
            self.purging.push(namespace);
            self.counters.purges_started += 1;
        }
    }

    /// Where the tier manager tracks `key`: each tier's space holding it,
    /// as (tier, namespace, hits the tier's policy counted). Walks every
    /// space (for the operator, not the data path).
    pub fn tracked(&self, key: &BlockKey) -> Vec<(Tier, u64, u32)> {
        let mut out: Vec<(Tier, u64, u32)> = self
            .spaces
            .iter()
            .filter_map(|(&(tier, namespace), space)| {
                space.cache.index.get(key).map(|b| (tier, namespace, space.cache.index.hits(b)))
            })
            .collect();
        out.sort_unstable_by_key(|&(tier, namespace, _)| (tier as u8, namespace));
        out
    }

    /// Namespaces being purged.
    pub fn purging(&self) -> &[u64] {
        &self.purging
    }

    /// Drains the L2 region `region` (one file of a node's L2, on its own
    /// device): its data plane is told to write nothing new there, then
    /// every block it holds is moved to another L2 region of the node
    /// (`MoveBlock` L2→L2), or dropped where another L2 region or L3
    /// holds it; the tier's capacity leaves the region out meanwhile, so
    /// if the rest cannot hold everything the usual eviction makes room
    /// (the coldest go to L3, or away). [`Tiers::drains`] says when the
    /// region is empty. Errors if no L2 region has that id.
    pub fn drain(&mut self, region: u16) -> Result<(), String> {
        match self.regions.get(&region) {
            Some(r) if r.tier == Tier::L2Nvme => {}
            Some(r) => return Err(format!("region {region} is not an L2 file (it is {:?})", r.tier)),
            None => return Err(format!("no region {region} is registered")),
        }
        self.undrained.retain(|&r| r != region);
        self.drains.entry(region).or_default();
        Ok(())
    }

    /// Uses a drained region again (its data plane is told). Errors if it
    /// was not being drained.
    pub fn undrain(&mut self, region: u16) -> Result<(), String> {
        if self.drains.remove(&region).is_none() {
            return Err(format!("region {region} is not being drained"));
        }
        self.undrained.push(region);
        Ok(())
    }

    /// The data plane holding `region` cannot take a drain (`why`).
    pub fn drain_refused(&mut self, region: u16, why: &str) {
        if let Some(drain) = self.drains.get_mut(&region) {
            drain.refused = Some(why.to_owned());
        }
    }

    /// Every drain and how far it is.
    pub fn drains(&self) -> Vec<DrainStatus> {
        self.drains
            .iter()
            .map(|(&region, d)| {
                let info = self.regions.get(&region);
                let blocks_left = self.blocks.get(&region).copied().unwrap_or(0);
                let in_flight = self.pending.values().any(|p| p.region == region);
                DrainStatus {
                    region,
                    node: info.map_or(0, |r| r.node),
                    announced: d.announced,
                    refused: d.refused.clone(),
                    blocks_left,
                    moved: d.moved,
                    dropped: d.dropped,
                    done: d.announced && blocks_left == 0 && !in_flight,
                }
            })
            .collect()
    }

    /// Names a region as its data plane registered it (an L2 file's path).
    pub fn name_region(&mut self, region: u16, name: &str) {
        self.names.insert(region, name.to_owned());
    }

    /// Every registered region: what it is, what it holds, whether it is
    /// being drained, by id.
    pub fn regions(&self) -> Vec<RegionStatus> {
        let mut out: Vec<RegionStatus> = self
            .regions
            .iter()
            .map(|(&region, r)| {
                let bytes = self.region_bytes(region);
                RegionStatus {
                    region,
                    tier: r.tier,
                    node: r.node,
                    name: self.names.get(&region).cloned().unwrap_or_default(),
                    bytes,
                    blocks: self.blocks.get(&region).copied().unwrap_or(0),
                    capacity_bytes: r.slot_bytes * r.slots,
                    draining: self.drains.contains_key(&region),
                }
            })
            .collect();
        out.sort_unstable_by_key(|r| r.region);
        out
    }

    /// Bytes `region` holds, all namespaces.
    fn region_bytes(&self, region: u16) -> u64 {
        self.used.iter().filter(|((r, _), _)| *r == region).map(|(_, b)| b).sum()
    }

    /// Tells data planes of drains begun and ended, then moves blocks off
    /// the drained regions, within this pass's budget.
    fn plan_drains(
        &mut self,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        start: usize,
        out: &mut Vec<TierCommand>,
    ) {
        for region in core::mem::take(&mut self.undrained) {
            let request = self.next_request;
            self.next_request += 1;
            let action = TierAction::Drain(DrainRegion { region, draining: 0, reserved: [0; 5] });
            out.push(TierCommand { request, region, action });
        }
        let regions: Vec<u16> = self.drains.keys().copied().collect();
        let mut asked = 0;
        for region in regions {
            let Some(info) = self.regions.get(&region).copied() else { continue };
            let Some(drain) = self.drains.get_mut(&region) else { continue };
            if !drain.announced {
                if drain.asking.is_none() && now_ns >= drain.retry_ns {
                    let request = self.next_request;
                    self.next_request += 1;
                    drain.asking = Some(request);
                    let action = TierAction::Drain(DrainRegion { region, draining: 1, reserved: [0; 5] });
                    out.push(TierCommand { request, region, action });
                }
                continue;
            }
            let mut queue = core::mem::take(&mut drain.queue);
            if queue.is_empty() && drain.scanned_ns.is_none_or(|t| now_ns >= t.saturating_add(DRAIN_SCAN_NS)) {
                drain.scanned_ns = Some(now_ns);
                if self.region_bytes(region) > 0 {
                    queue = self
                        .spaces
                        .iter()
                        .filter(|((tier, _), _)| *tier == Tier::L2Nvme)
                        .flat_map(|(_, space)| space.cache.index.blocks().map(|b| space.cache.index.key(b)))
                        .filter(|key| locations.ready(key).any(|r| r.region.0 == region))
                        .collect();
                }
            }
            let mut in_flight = self.pending.values().filter(|p| p.region == region).count();
            while asked < DRAINS_PER_PASS && in_flight < DRAIN_IN_FLIGHT_MAX && out.len() - start < COMMANDS_PER_PASS {
                let Some(key) = queue.pop() else { break };
                let Some(source) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
                if self.pending_of.contains_key(&(key, region)) {
                    continue;
                }
                if leases.is_held(&key, region) {
                    // Found again by a later scan.
                    self.counters.leased_kept += 1;
                    continue;
                }
                let Some(namespace) = self
                    .spaces
                    .iter()
                    .find(|((tier, _), space)| *tier == Tier::L2Nvme && space.cache.index.contains(&key))
                    .map(|((_, namespace), _)| *namespace)
                else {
                    continue;
                };
                let drains = &self.drains;
                let other_l2 = locations
                    .ready(&key)
                    .any(|r| r.tier == Tier::L2Nvme && r.region.0 != region && !drains.contains_key(&r.region.0));
                let in_l3 = locations.ready(&key).any(|r| r.tier == Tier::L3Object);
                let pending = self.leaving(locations, key, (namespace, Tier::L2Nvme), region, now_ns);
                let action = if other_l2 || in_l3 {
                    if !other_l2 && let Some(space) = self.spaces.get_mut(&(Tier::L2Nvme, namespace)) {
                        // L3 alone holds it after this: it leaves L2.
                        space.cache.remove(&key);
                    }
                    TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
                } else {
                    let Some((target_region, target_info)) = self.l2_written_to(info.node) else {
                        // Nowhere to go on this node: the tier's capacity
                        // (zero now) has its eviction take them.
                        break;
                    };
                    if self.l2_pressure(info.slot_bytes).1 {
                        // No room yet: eviction makes some first.
                        queue.push(key);
                        break;
                    }
                    let target = l2_target(target_region, &target_info);
                    TierAction::Move(transfer(&source, target, key, Priority::Demotion))
                };
                if let Some(drain) = self.drains.get_mut(&region) {
                    let (total, this) = if matches!(action, TierAction::Move(_)) {
                        (&mut self.counters.drain_moves, &mut drain.moved)
                    } else {
                        (&mut self.counters.drain_drops, &mut drain.dropped)
                    };
                    *total += 1;
                    *this += 1;
                }
                self.ask(pending, action, out);
                asked += 1;
                in_flight += 1;
            }
            if let Some(drain) = self.drains.get_mut(&region) {
                drain.queue = queue;
            }
        }
    }

    /// Bytes `namespace` holds in `tier` (commands in flight included).
    pub fn namespace_bytes(&self, tier: Tier, namespace: u64) -> u64 {
        self.used_by(tier, Some(namespace))
    }

    /// Every namespace with bytes in some tier, and its bytes by
    /// `Tier as usize`.
    pub fn namespaces(&self) -> Vec<(u64, [u64; 4])> {
        let mut by: HashMap<u64, [u64; 4]> = HashMap::new();
        for (&(region, namespace), &bytes) in &self.used {
            if let Some(r) = self.regions.get(&region) {
                by.entry(namespace).or_default()[r.tier as usize] += bytes;
            }
        }
        let mut out: Vec<(u64, [u64; 4])> = by.into_iter().filter(|(_, b)| b.iter().any(|&n| n > 0)).collect();
        out.sort_unstable();
        out
    }

    /// Drops what purged namespaces still hold, tier by tier, within this
    /// pass's budget; a namespace holding nothing more is done.
    fn plan_purges(
        &mut self,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        start: usize,
        out: &mut Vec<TierCommand>,
    ) {
        for namespace in self.purging.clone() {
            // Its marked victims back in their cache first, to be purged.
            let marked: Vec<BlockKey> =
                self.marked.iter().filter(|(_, m)| m.namespace == namespace).map(|(key, _)| *key).collect();
            for key in marked {
                self.unmark(key);
            }
            for tier in [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object] {
                let Some(space) = self.spaces.get(&(tier, namespace)) else { continue };
                let keys: Vec<BlockKey> = space.cache.index.blocks().map(|b| space.cache.index.key(b)).collect();
                for key in keys {
                    if out.len() - start >= COMMANDS_PER_PASS {
                        return;
                    }
                    let Some(replica) = locations.ready(&key).find(|r| r.tier == tier) else { continue };
                    if self.pending_of.contains_key(&(key, replica.region.0)) {
                        continue;
                    }
                    if leases.is_held(&key, replica.region.0) {
                        self.counters.leased_kept += 1;
                        continue;
                    }
                    if let Some(space) = self.spaces.get_mut(&(tier, namespace)) {
                        space.cache.remove(&key);
                    }
                    let pending = self.leaving(locations, key, (namespace, tier), replica.region.0, now_ns);
                    self.counters.purged += 1;
                    self.ask(pending, TierAction::Evict(evict_body(&replica, &key, EvictReason::Released)), out);
                }
            }
        }
        let done: Vec<u64> = self
            .purging
            .iter()
            .copied()
            .filter(|&n| [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object].iter().all(|&t| self.used_by(t, Some(n)) == 0))
            .collect();
        for namespace in done {
            self.purging.retain(|&n| n != namespace);
            self.counters.purges_done += 1;
        }
    }

    /// Each tenant quota's tenant, tier, bytes its namespaces hold there
    /// (less what is on its way out) and the quota.
    pub fn tenant_usage(&self) -> Vec<(&str, Tier, u64, u64)> {
        self.config
            .tenant_quotas
            .iter()
            .map(|q| {
                let live: u64 = q
                    .namespaces
                    .iter()
                    .map(|&n| self.used_by(q.tier, Some(n)).saturating_sub(self.pending_by(q.tier, Some(n))))
                    .sum();
                (q.tenant.as_str(), q.tier, live, q.bytes)
            })
            .collect()
    }

    /// Commands in flight.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// One planning pass: gives up commands past their deadline, then
    /// takes victims wherever a quota or a tier's high-water mark is
    /// exceeded, appending the commands to `out`.
    pub fn plan(&mut self, locations: &Locations, leases: &Leases, now_ns: u64, out: &mut Vec<TierCommand>) {
        self.now_ns = now_ns;
        let mut at = 0;
        while at < self.cooling.len() {
            if self.cooling[at].0 <= now_ns {
                let (_, pending) = self.cooling.swap_remove(at);
                self.put_back(&pending);
            } else {
                at += 1;
            }
        }
        let late: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.deadline_ns < now_ns).map(|(&request, _)| request).collect();
        for request in late {
            self.counters.failed += 1;
            self.counters.timed_out += 1;
            self.forget(request);
        }
        let start = out.len();
        for (key, replica) in self.duplicates.drain(..) {
            let request = self.next_request;
            self.next_request += 1;
            if self.duplicates_sent.len() < COMMANDS_PER_PASS * 64 {
                self.duplicates_sent.insert((key, replica.region.0, replica.slot, replica.generation));
            }
            let action = TierAction::Evict(evict_body(&replica, &key, EvictReason::Released));
            out.push(TierCommand { request, region: replica.region.0, action });
        }
        self.plan_write_backs(locations, now_ns, out);
        self.plan_persist(locations, now_ns, out);
        self.plan_purges(locations, leases, now_ns, start, out);
        self.plan_drains(locations, leases, now_ns, start, out);
        for tier in [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object] {
            if !self.regions.values().any(|r| r.tier == tier) {
                continue;
            }
            // Quotas first. A tenant over its quota gives up blocks of its
            // namespace holding the most there, until it is under.
            let tenants: Vec<(Vec<u64>, u64)> = self
                .config
                .tenant_quotas
                .iter()
                .filter(|q| q.tier == tier)
                .map(|q| (q.namespaces.clone(), q.bytes))
                .collect();
            for (namespaces, quota) in tenants {
                let live = |tiers: &Self, namespace: u64| {
                    tiers.used_by(tier, Some(namespace)).saturating_sub(tiers.pending_by(tier, Some(namespace)))
                };
                while out.len() - start < COMMANDS_PER_PASS
                    && namespaces.iter().map(|&n| live(self, n)).sum::<u64>() > quota
                {
                    let mut largest: Vec<(u64, u64)> = namespaces.iter().map(|&n| (live(self, n), n)).collect();
                    largest.sort_unstable_by(|a, b| b.cmp(a));
                    let evicted = largest.iter().any(|&(_, namespace)| {
                        (tier == Tier::L1Dram
                            && self.evict_marked(Some(namespace), false, locations, leases, now_ns, out))
                            || self.evict_one(tier, namespace, locations, leases, now_ns, out)
                    });
                    if !evicted {
                        break;
                    }
                    self.counters.tenant_quota_evictions += 1;
                }
            }
            // A namespace over its own quota gives up its own.
            let quotas: Vec<(u64, u64)> =
                self.config.quotas.iter().filter(|q| q.tier == tier).map(|q| (q.namespace, q.bytes)).collect();
            for (namespace, quota) in quotas {
                while out.len() - start < COMMANDS_PER_PASS
                    && self.used_by(tier, Some(namespace)).saturating_sub(self.pending_by(tier, Some(namespace)))
                        > quota
                {
                    let marked = tier == Tier::L1Dram
                        && self.evict_marked(Some(namespace), false, locations, leases, now_ns, out);
                    if !marked && !self.evict_one(tier, namespace, locations, leases, now_ns, out) {
                        break;
                    }
                }
            }
            let capacity = self.capacity(tier);
            let (mut high_percent, mut low_percent) = (self.config.high_percent, self.config.low_percent);
            if tier == Tier::L1Dram && self.draining_node {
                // Its L1 is where its L2 blocks are promoted to be copied
                // away: half of it is kept free for them.
                (high_percent, low_percent) = (high_percent.min(DRAINING_L1_HIGH), low_percent.min(DRAINING_L1_LOW));
            }
            let high = percent_of(capacity, high_percent);
            let low = percent_of(capacity, low_percent);
            let live = |tiers: &Self| tiers.used_by(tier, None).saturating_sub(tiers.pending_by(tier, None));
            if live(self) <= high {
                continue;
            }
            while out.len() - start < COMMANDS_PER_PASS && live(self) > low {
                // The victims already chosen that have a copy below go
                // first, in their order: dropping them loses nothing. (The
                // others, marked to be dropped, go only when a save or a
                // load needs their slot.)
                if tier == Tier::L1Dram && self.evict_marked(None, true, locations, leases, now_ns, out) {
                    continue;
                }
                // Where an L1 victim would be dropped (no room below) and
                // the data plane takes marked victims when a save needs a
                // slot, nothing is dropped ahead of that need (while no L2
                // file is drained: then none are marked).
                if tier == Tier::L1Dram
                    && !self.emptying_l1
                    && !self.draining_node
                    && self.drains.is_empty()
                    && !self.marks_taken.is_empty()
                    && self.l1_victims_dropped()
                {
                    break;
                }
                // The space furthest over its share: bytes over its quota
                // (or over the whole tier, for namespaces without one).
                let mut candidates: Vec<(u64, u64)> = self
                    .spaces
                    .iter()
                    .filter(|((t, _), space)| *t == tier && !space.cache.index.is_empty())
                    .map(|((_, namespace), space)| {
                        let live = self
                            .used_by(tier, Some(*namespace))
                            .saturating_sub(self.pending_by(tier, Some(*namespace)));
                        let share = space.quota.unwrap_or(capacity).max(1);
                        (live.saturating_mul(1024) / share, *namespace)
                    })
                    .collect();
                candidates.sort_unstable_by(|a, b| b.cmp(a));
                let evicted = candidates
                    .iter()
                    .any(|&(_, namespace)| self.evict_one(tier, namespace, locations, leases, now_ns, out));
                if !evicted {
                    break;
                }
            }
        }
        // Last: what the evictions above took from the victims chosen
        // ahead is chosen again, so the data planes hold their reserve.
        self.plan_cleaning(locations, now_ns, out);
        self.plan_marks(locations, leases, now_ns, out);
    }

    /// The pending entry of a command that frees `key`'s replica in
    /// `region` (a move down or a drop): its parent and kind from the
    /// index, its bytes from the region.
    fn leaving(
        &self,
        locations: &Locations,
        key: BlockKey,
        (namespace, tier): (u64, Tier),
        region: u16,
        now_ns: u64,
    ) -> Pending {
        let (parent, kind) = parent_and_kind(locations, &key);
        Pending {
            key,
            parent,
            kind,
            namespace,
            tier,
            region,
            bytes: self.block_bytes(region, &key),
            deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
            frees: true,
            to: None,
            cleans: false,
        }
    }

    /// Takes one victim from the space (tier, namespace) and appends its
    /// command; false when nothing there may go.
    fn evict_one(
        &mut self,
        tier: Tier,
        namespace: u64,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        out: &mut Vec<TierCommand>,
    ) -> bool {
        let (pending_of, pending) = (&self.pending_of, &self.pending);
        let (mut kept, mut copying) = (0, 0);
        let Some(space) = self.spaces.get_mut(&(tier, namespace)) else { return false };
        let verdict = |key: &BlockKey| {
            let Some(replica) = locations.ready(key).find(|r| r.tier == tier) else { return Verdict::Gone };
            match pending_of.get(&(*key, replica.region.0)).and_then(|request| pending.get(request)) {
                // Already on its way out (moved or dropped).
                Some(command) if command.frees => return Verdict::Gone,
                // Being copied (to L3, to another node): it stays in this
                // tier, so it stays in its cache; another victim this time.
                Some(_) => {
                    copying += 1;
                    return Verdict::Keep;
                }
                None => {}
            }
            if leases.is_held(key, replica.region.0) {
                kept += 1;
                return Verdict::Keep;
            }
            Verdict::Evict
        };
        let victim = space.cache.take_victim(64, verdict);
        self.counters.leased_kept += kept;
        self.counters.copying_kept += copying;
        let Some(key) = victim else { return false };
        let Some(source) = locations.ready(&key).find(|r| r.tier == tier) else { return false };
        let pending = self.leaving(locations, key, (namespace, tier), source.region.0, now_ns);
        let parent = pending.parent;
        let held_in = |t: Tier| locations.ready(&key).any(|r| r.tier == t);
        let move_to = |target| TierAction::Move(transfer(&source, target, key, Priority::Demotion));
        let node = source.node.0;
        // For an L1 victim: L2's pressure for one more of its blocks.
        let l2 = (tier == Tier::L1Dram)
            .then(|| self.region_on(Tier::L2Nvme, node))
            .flatten()
            .map(|(region, info)| (region, info, self.l2_pressure(info.slot_bytes)));
        // An L1 victim L3 holds is only worth writing to L2 while L2 has
        // room: otherwise the write pushes another block out of L2.
        let l2_full = l2.is_some_and(|(_, _, (over_high, no_room))| over_high || no_room);
        let action = if tier == Tier::L1Dram && (held_in(Tier::L2Nvme) || (held_in(Tier::L3Object) && l2_full)) {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
        } else if tier == Tier::L1Dram
            && l2.is_some()
            && self.config.l2_admission == L2Admission::SecondAccess
            && !self.emptying_l1
            && !self.seen_twice.contains(&key)
            && !parent.is_some_and(|p| self.seen_twice.contains(&p))
            && !held_in(Tier::L3Object)
        {
            // Used once: not worth an L2 write. Remembered, so a block
            // saved again after this is written next time.
            self.counters.l2_filtered += 1;
            self.counters.drops[tier as usize] += 1;
            self.dropped_once.note(key);
            TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity))
        } else if let Some(target) =
            l2.and_then(|(region, info, pressure)| self.demotion_target(namespace, &key, region, &info, pressure))
        {
            self.counters.demotions += 1;
            move_to(target)
        } else if tier != Tier::L3Object && held_in(Tier::L3Object) {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
        } else if let Some(target) = (tier != Tier::L3Object).then(|| self.l3_target(node)).flatten() {
            self.counters.l3_moves += 1;
            move_to(target)
        } else {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity))
        };
        self.ask(pending, action, out);
        true
    }

    /// Marks `key` (its L1 `replica`) evictable in its data plane.
    fn mark(&mut self, key: BlockKey, marked: Marked, out: &mut Vec<TierCommand>) {
        if marked.reason == EvictReason::Demoted {
            self.counters.marked_clean += 1;
        } else {
            self.counters.marked_drop += 1;
        }
        self.marked.insert(key, marked);
        self.mark_order.push_back(key);
        if self.mark_order.len() > 2 * self.marked.len() + 1024 {
            let live = &self.marked;
            self.mark_order.retain(|k| live.contains_key(k));
        }
        let body = evict_body(&marked.replica, &key, marked.reason);
        out.push(TierCommand { request: 0, region: marked.replica.region.0, action: TierAction::Mark(body) });
    }

    /// Takes the mark of `key` back (in its data plane too), and puts the
    /// block back in its cache.
    fn unmark(&mut self, key: BlockKey) {
        if let Some(marked) = self.marked.remove(&key) {
            self.unmarks.push((key, marked));
            self.space(Tier::L1Dram, marked.namespace).cache.add(marked.parent, key, marked.kind);
        }
    }

    /// L1 blocks being written below with their L1 copy kept (of `region`,
    /// if given).
    fn l1_copies_below(&self, region: Option<u16>) -> usize {
        self.pending
            .values()
            .filter(|p| p.tier == Tier::L1Dram && !p.frees && p.to.is_some() && region.is_none_or(|r| r == p.region))
            .count()
    }

    /// Writes L1 blocks below ahead of demand (their L1 copy kept, in
    /// their cache as before), oldest first, once they are
    /// [`CLEAN_AFTER_NS`] old and L1 is [`CLEAN_FROM_PERCENT`] full, where
    /// the node's L2 has room and admits them: a victim chosen later then
    /// has a copy below, and a save takes its slot at once.
    fn plan_cleaning(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
        if self.emptying_l1 {
            return;
        }
        // Each write stages its block in a free L1 slot: none while L1 is
        // over its mark (its evictions make room first). None while an L2
        // file is drained either: its blocks need the others' room.
        let capacity = self.capacity(Tier::L1Dram);
        let used = self.used_by(Tier::L1Dram, None);
        if used < percent_of(capacity, CLEAN_FROM_PERCENT) || self.l1_over_high() || !self.drains.is_empty() {
            return;
        }
        let mut in_flight = self.l1_copies_below(None);
        while in_flight < CLEANING_IN_FLIGHT {
            let Some(&(at, key, region, namespace)) = self.to_clean.front() else { break };
            if at.saturating_add(CLEAN_AFTER_NS) > now_ns {
                break;
            }
            let Some(info) = self.regions.get(&region).copied() else {
                self.to_clean.pop_front();
                continue;
            };
            let Some((l2_region, l2_info)) = self.l2_written_to(info.node) else { break };
            if self.l2_pressure(l2_info.slot_bytes) != (false, false) {
                // L2 over its mark: a block written there now would push
                // out another (or this one, soon after its L1 copy goes).
                break;
            }
            self.to_clean.pop_front();
            let Some(source) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
            let (parent, kind) = parent_and_kind(locations, &key);
            if held_below(locations, &key)
                || !self.worth_l2(&key, parent)
                || self.pending_of.contains_key(&(key, region))
                || self.marked.contains_key(&key)
            {
                continue;
            }
            let pending = self.l1_copy(key, (parent, kind), namespace, region, now_ns, false);
            let target = l2_target(l2_region, &l2_info);
            self.ask(pending, TierAction::Copy(transfer(&source, target, key, Priority::WriteBack)), out);
            self.counters.cleanings += 1;
            in_flight += 1;
        }
    }

    /// Chooses L1 victims ahead of demand, for every L1 region whose data
    /// plane takes marks: in each cache's policy order, a victim with a
    /// copy below is marked evictable at once; one without is first
    /// written below (its L1 copy kept) where a lower tier has room, and
    /// marked when that is done; where none has, it is marked to be
    /// dropped. A save into a full L1 then takes a marked victim's slot on
    /// the spot, with no command on its way.
    fn plan_marks(&mut self, locations: &Locations, leases: &Leases, now_ns: u64, out: &mut Vec<TierCommand>) {
        while let Some(&(at, key)) = self.recent.front() {
            if at.saturating_add(MARK_AFTER_NS) > now_ns {
                break;
            }
            self.recent.pop_front();
            if self.recent_keys.get(&key) == Some(&at) {
                self.recent_keys.remove(&key);
                if let Some(namespace) = self.unwanted.remove(&key)
                    && let Some(space) = self.spaces.get_mut(&(Tier::L1Dram, namespace))
                {
                    space.cache.make_cold(&key);
                }
            }
        }
        if self.emptying_l1 {
            // Stopping: what has no copy below is demoted, not dropped.
            let dirty: Vec<BlockKey> =
                self.marked.iter().filter(|(_, m)| m.reason != EvictReason::Demoted).map(|(k, _)| *k).collect();
            for key in dirty {
                self.unmark(key);
            }
        }
        for key in std::mem::take(&mut self.recheck) {
            if self.marked.contains_key(&key) && !held_below(locations, &key) {
                self.unmark(key);
            }
        }
        for (key, marked) in self.unmarks.drain(..) {
            self.counters.unmarked += 1;
            let body = evict_body(&marked.replica, &key, marked.reason);
            out.push(TierCommand { request: 0, region: marked.replica.region.0, action: TierAction::Unmark(body) });
        }
        for pending in std::mem::take(&mut self.cleaned) {
            let key = pending.key;
            let source = locations.ready(&key).find(|r| r.region.0 == pending.region);
            let below = held_below(locations, &key);
            match source {
                Some(replica) if below && !self.pending_of.contains_key(&(key, pending.region)) => {
                    let marked = Marked {
                        namespace: pending.namespace,
                        parent: pending.parent,
                        kind: pending.kind,
                        replica,
                        reason: EvictReason::Demoted,
                    };
                    self.mark(key, marked, out);
                }
                Some(_) => self.put_back(&pending),
                None => {}
            }
        }
        let used = self.used_by(Tier::L1Dram, None);
        if self.emptying_l1
            || (self.l1_over_high() && !self.l1_victims_dropped())
            || used < percent_of(self.capacity(Tier::L1Dram), CLEAN_FROM_PERCENT)
            || !self.drains.is_empty()
        {
            // Over its mark, L1's evictions make room first (and a victim
            // written below would find no slot to stage in) — unless its
            // victims would be dropped: then nothing is dropped ahead of a
            // save's need, and marks are what makes room. Under half full,
            // no save needs a victim; while an L2 file is drained, L1's
            // victims are demoted as they go (its blocks need the other
            // files' room). Room is made (or not needed) either way.
            let regions: Vec<u16> = self.marks_taken.iter().copied().collect();
            for region in regions {
                self.say_victims_left(region, true, out);
            }
            return;
        }
        let regions: Vec<(u16, RegionUse)> = self
            .regions
            .iter()
            .filter(|(region, info)| info.tier == Tier::L1Dram && self.marks_taken.contains(region))
            .map(|(&region, &info)| (region, info))
            .collect();
        for (region, info) in regions {
            let mut cleaning = self.l1_copies_below(Some(region));
            let l2 = self.l2_written_to(info.node);
            let l3 = self.l3_target(info.node);
            let mut namespaces: Vec<(u64, u64)> = self
                .spaces
                .iter()
                .filter(|((tier, _), space)| *tier == Tier::L1Dram && !space.cache.index.is_empty())
                .map(|((_, namespace), _)| (self.used.get(&(region, *namespace)).copied().unwrap_or(0), *namespace))
                .collect();
            namespaces.sort_unstable_by(|a, b| b.cmp(a));
            let target = (info.slots / 4).max(1);
            let held = self.marked.values().filter(|m| m.replica.region.0 == region).count() as u64;
            let wanted = target.saturating_sub(held + cleaning as u64);
            let mut budget = MARKS_PER_PASS.min(usize::try_from(wanted).unwrap_or(usize::MAX));
            let mut capped = false;
            for (_, namespace) in namespaces {
                while budget > 0 {
                    // Room below: L2 under its mark (a block written
                    // there past it would push out another, or soon itself).
                    let room_below = l2.is_some_and(|(_, info)| self.l2_pressure(info.slot_bytes) == (false, false));
                    if (room_below || l3.is_some()) && cleaning >= CLEANING_IN_FLIGHT {
                        // Its victims would wait to be written below.
                        capped = true;
                        break;
                    }
                    // Blocks saved lately are not victims while older
                    // ones are (a save's own blocks are not the victims of
                    // the rest of it); where nothing has room below (the
                    // victim would be dropped), not at all.
                    let drops = !room_below && l3.is_none();
                    let key = self.take_l1_victim(region, namespace, false, locations, leases).or_else(|| {
                        if drops { None } else { self.take_l1_victim(region, namespace, true, locations, leases) }
                    });
                    let Some(key) = key else { break };
                    budget -= 1;
                    let Some(replica) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
                    let (parent, kind) = parent_and_kind(locations, &key);
                    let below = held_below(locations, &key);
                    let worth_l2 = self.worth_l2(&key, parent);
                    let marked = |reason| Marked { namespace, parent, kind, replica, reason };
                    let target = match (below, l2) {
                        (true, _) => None,
                        (false, Some((l2_region, l2_info))) if room_below && worth_l2 => {
                            Some(l2_target(l2_region, &l2_info))
                        }
                        (false, _) => l3,
                    };
                    match (below, target) {
                        (true, _) => self.mark(key, marked(EvictReason::Demoted), out),
                        (false, Some(target)) => {
                            let pending = self.l1_copy(key, (parent, kind), namespace, region, now_ns, true);
                            let copy = TierAction::Copy(transfer(&replica, target, key, Priority::WriteBack));
                            self.ask(pending, copy, out);
                            if target.tier == Tier::L3Object as u8 {
                                self.counters.l3_copies += 1;
                            } else {
                                self.counters.cleanings += 1;
                            }
                            cleaning += 1;
                        }
                        (false, None) if self.recent_keys.contains_key(&key) => {
                            // Not worth an L2 write, and new: not dropped yet.
                            self.space(Tier::L1Dram, namespace).cache.add(parent, key, kind);
                        }
                        (false, None) => self.mark(key, marked(EvictReason::Capacity), out),
                    }
                }
            }
            // No victim left to mark, none marked, and nothing on its way
            // out or below: a save that finds no slot here would wait for
            // nothing.
            let held = self.marked.values().any(|m| m.replica.region.0 == region);
            let moving = self.pending.values().any(|p| p.region == region && p.tier == Tier::L1Dram);
            let exhausted = budget > 0 && !capped && !held && !moving;
            self.say_victims_left(region, !exhausted, out);
        }
    }

    /// Tells the data plane of L1 `region` whether more victims may come,
    /// where that changed since it was last told.
    fn say_victims_left(&mut self, region: u16, left: bool, out: &mut Vec<TierCommand>) {
        if self.victims_left.get(&region).copied().unwrap_or(true) == left {
            return;
        }
        self.victims_left.insert(region, left);
        let body = lake_dp::wire::message::VictimsLeft { region, left: u8::from(left), reserved: [0; 5] };
        out.push(TierCommand { request: 0, region, action: TierAction::VictimsLeft(body) });
    }

    /// The next victim of `namespace`'s L1 cache that may be marked: its
    /// replica in `region` ready, no command on it, no lease, and (unless
    /// `recent_too`) not added lately. Taken out of the cache.
    fn take_l1_victim(
        &mut self,
        region: u16,
        namespace: u64,
        recent_too: bool,
        locations: &Locations,
        leases: &Leases,
    ) -> Option<BlockKey> {
        let (pending_of, recent) = (&self.pending_of, &self.recent_keys);
        let space = self.spaces.get_mut(&(Tier::L1Dram, namespace))?;
        space.cache.take_victim(64, |key| {
            let Some(replica) = locations.ready(key).find(|r| r.tier == Tier::L1Dram) else { return Verdict::Gone };
            if replica.region.0 != region
                || pending_of.contains_key(&(*key, replica.region.0))
                || leases.is_held(key, replica.region.0)
                || (!recent_too && recent.contains_key(key))
            {
                return Verdict::Keep;
            }
            Verdict::Evict
        })
    }

    /// Whether an L1 block is worth an L2 write: always, or (under
    /// [`L2Admission::SecondAccess`]) once it or its parent was seen twice.
    fn worth_l2(&self, key: &BlockKey, parent: Option<BlockKey>) -> bool {
        self.config.l2_admission == L2Admission::Always
            || self.seen_twice.contains(key)
            || parent.is_some_and(|p| self.seen_twice.contains(&p))
    }

    /// The pending entry of a copy of `key`'s L1 replica in `region`
    /// below, its L1 copy kept (`cleans`: marked once it lands).
    fn l1_copy(
        &self,
        key: BlockKey,
        (parent, kind): (Option<BlockKey>, ObjectKind),
        namespace: u64,
        region: u16,
        now_ns: u64,
        cleans: bool,
    ) -> Pending {
        Pending {
            key,
            parent,
            kind,
            namespace,
            tier: Tier::L1Dram,
            region,
            bytes: self.block_bytes(region, &key),
            deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
            frees: false,
            to: None,
            cleans,
        }
    }

    /// Whether an L1 victim would now be dropped: no L3, and L2 missing
    /// or over its mark.
    fn l1_victims_dropped(&self) -> bool {
        !self.regions.values().any(|r| r.tier == Tier::L3Object)
            && self.regions.values().find(|r| r.tier == Tier::L2Nvme).is_none_or(|r| self.l2_pressure(r.slot_bytes).0)
    }

    /// Whether L1 holds more than its high-water mark (counting what is on
    /// its way out as gone).
    fn l1_over_high(&self) -> bool {
        let live = self.used_by(Tier::L1Dram, None).saturating_sub(self.pending_by(Tier::L1Dram, None));
        live > percent_of(self.capacity(Tier::L1Dram), self.config.high_percent)
    }

    /// Evicts the first marked victim (of `namespace`, if given; with a
    /// copy below, if `clean_only`) whose replica is as marked, nothing on
    /// it: the victims chosen ahead go before any other. False when there
    /// is none.
    fn evict_marked(
        &mut self,
        namespace: Option<u64>,
        clean_only: bool,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        out: &mut Vec<TierCommand>,
    ) -> bool {
        let mut looked = 0;
        let queued = self.mark_order.len();
        while looked < queued {
            looked += 1;
            let Some(key) = self.mark_order.pop_front() else { return false };
            let Some(marked) = self.marked.get(&key).copied() else { continue };
            let region = marked.replica.region.0;
            let same = locations.ready(&key).any(|r| {
                r.region.0 == region && (r.slot, r.generation) == (marked.replica.slot, marked.replica.generation)
            });
            if !same {
                self.unmark(key);
                continue;
            }
            if namespace.is_some_and(|n| n != marked.namespace)
                || (clean_only && marked.reason != EvictReason::Demoted)
                || self.pending_of.contains_key(&(key, region))
                || leases.is_held(&key, region)
            {
                self.mark_order.push_back(key);
                continue;
            }
            self.marked.remove(&key);
            let pending = self.leaving(locations, key, (marked.namespace, Tier::L1Dram), region, now_ns);
            self.counters.drops[Tier::L1Dram as usize] += 1;
            self.ask(pending, TierAction::Evict(evict_body(&marked.replica, &key, marked.reason)), out);
            return true;
        }
        false
    }

    /// The L3 region of `node` as a target (the data plane picks the
    /// catalog entry), if it has an object store.
    fn l3_target(&self, node: u32) -> Option<ReplicaWire> {
        let (region, info) = self.region_on(Tier::L3Object, node)?;
        Some(ReplicaWire {
            tier: Tier::L3Object as u8,
            reserved: 0,
            region,
            node,
            region_epoch: info.epoch,
            slot: SLOT_ANY,
            generation: 0,
        })
    }

    /// Eager write-back: copies to L3 of blocks queued by
    /// [`Tiers::added`] that are still where they landed and not in L3
    /// yet, a bounded number per pass.
    fn plan_write_backs(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
        let mut asked = 0;
        while asked < WRITE_BACKS_PER_PASS {
            let Some((key, namespace)) = self.write_back.pop_front() else { break };
            let ready: Vec<Replica> = locations.ready(&key).collect();
            if ready.iter().any(|r| r.tier == Tier::L3Object) {
                continue;
            }
            // From L2 if it is there, else from L1.
            let Some(source) = ready
                .iter()
                .filter(|r| matches!(r.tier, Tier::L1Dram | Tier::L2Nvme))
                .max_by_key(|r| r.tier as u8)
                .copied()
            else {
                continue;
            };
            if self.pending_of.contains_key(&(key, source.region.0)) {
                continue;
            }
            let Some(target) = self.l3_target(source.node.0) else { continue };
            let pending = Pending {
                key,
                parent: None,
                kind: ObjectKind::KvBlock,
                namespace,
                tier: source.tier,
                region: source.region.0,
                bytes: self.block_bytes(source.region.0, &key),
                deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
                frees: false,
                to: None,
                cleans: false,
            };
            self.ask(pending, TierAction::Copy(transfer(&source, target, key, Priority::WriteBack)), out);
            self.counters.l3_copies += 1;
            asked += 1;
        }
    }

    /// Write-backs queued and not yet asked.
    pub fn write_backs_queued(&self) -> usize {
        self.write_back.len()
    }

    /// The L1 blocks of `namespace` (of every namespace: `None`) with no
    /// copy below L1 yet, each to be written to its node's L2 while it
    /// stays in L1 — so that it survives the host, not only a clean stop.
    /// Returns how many were queued; [`Tiers::l1_only`] says how many are
    /// left.
    pub fn persist(&mut self, locations: &Locations, namespace: Option<u64>) -> usize {
        let queued: Vec<(BlockKey, u64)> = self.l1_only_blocks(locations, namespace).collect();
        let count = queued.len();
        self.persist.extend(queued);
        count
    }

    /// Write-backs to L2 queued and not yet asked.
    pub fn persist_queued(&self) -> usize {
        self.persist.len()
    }

    /// L1 blocks of `namespace` (every namespace: `None`) with no copy in
    /// L2 or L3.
    pub fn l1_only(&self, locations: &Locations, namespace: Option<u64>) -> usize {
        self.l1_only_blocks(locations, namespace).count()
    }

    fn l1_only_blocks<'a>(
        &'a self,
        locations: &'a Locations,
        namespace: Option<u64>,
    ) -> impl Iterator<Item = (BlockKey, u64)> + 'a {
        // In their caches, or marked to be dropped (out of them).
        let marked = self
            .marked
            .iter()
            .filter(move |(_, m)| m.reason != EvictReason::Demoted && namespace.is_none_or(|n| n == m.namespace))
            .map(|(key, m)| (*key, m.namespace));
        self.spaces
            .iter()
            .filter(move |((tier, ns), _)| *tier == Tier::L1Dram && namespace.is_none_or(|n| n == *ns))
            .flat_map(|((_, ns), space)| {
                let index = &space.cache.index;
                index.blocks().map(move |block| (index.key(block), *ns))
            })
            .chain(marked)
            .filter(|(key, _)| !held_below(locations, key))
    }

    /// Write-backs to L2 of the blocks [`Tiers::persist`] queued that are
    /// still in L1 only, a bounded number per pass, while L2 has room.
    fn plan_persist(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
        // Each write-back stages its block in a free L1 slot: a few at a
        // time, so they do not take the slots saves and loads need.
        let in_flight =
            self.pending.values().filter(|p| p.tier == Tier::L1Dram && p.to == Some(Tier::L2Nvme) && !p.frees).count();
        let mut asked = 0;
        while asked < WRITE_BACKS_PER_PASS && in_flight + asked < PERSIST_IN_FLIGHT {
            let Some(&(key, namespace)) = self.persist.front() else { break };
            let ready: Vec<Replica> = locations.ready(&key).collect();
            let source = ready.iter().find(|r| r.tier == Tier::L1Dram).copied();
            let below = ready.iter().any(|r| matches!(r.tier, Tier::L2Nvme | Tier::L3Object));
            let Some(source) = source.filter(|s| !below && !self.pending_of.contains_key(&(key, s.region.0))) else {
                // Written down already, gone, or on its way somewhere.
                self.persist.pop_front();
                continue;
            };
            let bytes = self.block_bytes(source.region.0, &key);
            let Some((region, info)) = self.l2_written_to(source.node.0) else { break };
            if self.l2_pressure(bytes).1 {
                // No L2 slot free: L2's own eviction makes room first.
                break;
            }
            self.persist.pop_front();
            let pending = Pending {
                key,
                parent: None,
                kind: ObjectKind::KvBlock,
                namespace,
                tier: Tier::L1Dram,
                region: source.region.0,
                bytes,
                deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
                frees: false,
                to: Some(Tier::L2Nvme),
                cleans: false,
            };
            let target = l2_target(region, &info);
            self.ask(pending, TierAction::Copy(transfer(&source, target, key, Priority::WriteBack)), out);
            self.counters.l2_write_backs += 1;
            asked += 1;
        }
    }

    /// Where an L1 victim of `namespace` is demoted to — `region` of its
    /// node's L2, under `pressure` ([`Tiers::l2_pressure`]) — or `None`
    /// when it is not: L2 is full, or over its mark and its policy would
    /// not admit the block.
    fn demotion_target(
        &mut self,
        namespace: u64,
        key: &BlockKey,
        region: u16,
        info: &RegionUse,
        (over_high, no_room): (bool, bool),
    ) -> Option<ReplicaWire> {
        if no_room {
            // Every slot is taken or promised (moves out of L2 still in
            // flight hold theirs): the write would fail.
            return None;
        }
        if over_high && !self.space(Tier::L2Nvme, namespace).cache.admits(key) {
            self.counters.admission_refused += 1;
            return None;
        }
        Some(l2_target(region, info))
    }
}

impl Tiers {
    /// L2's pressure for one more block of `bytes`: above the high-water
    /// mark (counting moves out in flight as gone, writes in flight into
    /// it as landed), and with no slot left
    /// at all (counting them as still there, and writes in flight into L2
    /// as landed).
    fn l2_pressure(&self, bytes: u64) -> (bool, bool) {
        let capacity = self.capacity(Tier::L2Nvme);
        let used = self.used_by(Tier::L2Nvme, None);
        let live = used.saturating_sub(self.pending_by(Tier::L2Nvme, None));
        let inbound: u64 = self.pending.values().filter(|p| p.to == Some(Tier::L2Nvme)).map(|p| p.bytes).sum();
        let over_high = live + inbound + bytes > percent_of(capacity, self.config.high_percent);
        // Room is in the regions written to: not those being drained.
        let drained: u64 = self.drains.keys().map(|&region| self.region_bytes(region)).sum();
        (over_high, used.saturating_sub(drained) + inbound + bytes > capacity)
    }
}

/// The L2 tier of `region`'s node as a target: the data plane picks the
/// file (not one being drained) and the slot.
fn l2_target(region: u16, info: &RegionUse) -> ReplicaWire {
    ReplicaWire {
        tier: Tier::L2Nvme as u8,
        reserved: 0,
        region,
        node: info.node,
        region_epoch: info.epoch,
        slot: SLOT_ANY,
        generation: 0,
    }
}

fn transfer(source: &Replica, target: ReplicaWire, key: BlockKey, priority: Priority) -> Transfer {
    Transfer { source: source.to_wire(), target, key, deadline_unix_ns: 0, priority: priority as u8, reserved: [0; 7] }
}

/// `key`'s parent and kind, as the index knows them.
fn parent_and_kind(locations: &Locations, key: &BlockKey) -> (Option<BlockKey>, ObjectKind) {
    let index = &locations.index;
    index.get(key).map_or((None, ObjectKind::KvBlock), |b| (index.parent(b).map(|p| index.key(p)), index.kind(b)))
}

/// Whether a copy of `key` below L1 (in L2 or L3) is ready.
fn held_below(locations: &Locations, key: &BlockKey) -> bool {
    locations.ready(key).any(|r| matches!(r.tier, Tier::L2Nvme | Tier::L3Object))
}

fn percent_of(bytes: u64, percent: u8) -> u64 {
    u64::try_from(u128::from(bytes) * u128::from(percent) / 100).unwrap_or(u64::MAX)
}

fn evict_body(replica: &Replica, key: &BlockKey, reason: EvictReason) -> BlockEvicted {
    BlockEvicted { replica: replica.to_wire(), key: *key, reason: reason as u8, reserved: [0; 7] }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lake_dp::NodeId;

    const SLOT: u64 = 1024;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    /// A node with L1 (region 0) and L2 (region 1), ten slots each.
    struct World {
        locations: Locations,
        leases: Leases,
        tiers: Tiers,
        next_slot: u32,
    }

    impl World {
        fn new(config: TierConfig) -> Self {
            let mut world =
                Self { locations: Locations::new(1), leases: Leases::new(), tiers: Tiers::new(config), next_slot: 0 };
            for (region, tier) in [(0, Tier::L1Dram), (1, Tier::L2Nvme)] {
                world.locations.register_region(region, tier, NodeId(0), 5).unwrap();
                world.tiers.register(region, tier, 0, 5, SLOT, 10);
            }
            world
        }

        /// Block `k` (under `parent`) of `namespace` lands in `region`.
        fn add(&mut self, region: u16, namespace: u64, parent: Option<u8>, k: u8) {
            self.next_slot += 1;
            let parent = parent.map(key);
            self.locations.adopt(parent, key(k), ObjectKind::KvBlock, region, 5, self.next_slot, 1).unwrap();
            self.tiers.added(region, namespace, parent, key(k), ObjectKind::KvBlock, true, 0);
        }

        /// With an L3 region (9) too, and L2 holding blocks 1..=9 (over its
        /// mark of 80%, to come down to 50%; LRU).
        fn with_l3(config: TierConfig) -> Self {
            let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..config };
            let mut world = Self::new(config);
            world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
            world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
            for k in 1..=9 {
                world.add(1, 7, None, k);
            }
            world
        }

        fn plan(&mut self) -> Vec<TierCommand> {
            let mut out = Vec::new();
            self.tiers.plan(&self.locations, &self.leases, 0, &mut out);
            out
        }

        /// The data plane carried `command` out.
        fn carry_out(&mut self, command: &TierCommand) {
            match command.action {
                TierAction::Move(transfer) if transfer.source.tier == 2 && transfer.target.tier == 2 => {
                    // A block moving off a drained region: the data plane
                    // reports the copy, then frees the source.
                    let source = Replica::from_wire(&transfer.source).unwrap();
                    self.next_slot += 1;
                    let target = transfer.target.region;
                    self.locations
                        .adopt(None, transfer.key, ObjectKind::KvBlock, target, 5, self.next_slot, 1)
                        .unwrap();
                    self.tiers.added(target, 7, None, transfer.key, ObjectKind::KvBlock, true, 0);
                    self.locations.remove(&transfer.key, source.region.0).unwrap();
                    self.tiers.removed(source.region.0, &transfer.key);
                }
                TierAction::Move(transfer) => {
                    let source = Replica::from_wire(&transfer.source).unwrap();
                    let parent = self
                        .locations
                        .index
                        .get(&transfer.key)
                        .and_then(|b| self.locations.index.parent(b))
                        .map(|p| self.locations.index.key(p));
                    self.next_slot += 1;
                    self.locations.adopt(parent, transfer.key, ObjectKind::KvBlock, 1, 5, self.next_slot, 1).unwrap();
                    self.tiers.added(1, 7, parent, transfer.key, ObjectKind::KvBlock, true, 0);
                    self.locations.remove(&transfer.key, source.region.0).unwrap();
                    self.tiers.removed(source.region.0, &transfer.key);
                }
                TierAction::Evict(evict) => {
                    self.locations.remove(&evict.key, evict.replica.region).unwrap();
                    self.tiers.removed(evict.replica.region, &evict.key);
                }
                // Copies it plans are eager write-backs to L3 (region 9).
                TierAction::Copy(transfer) => {
                    self.next_slot += 1;
                    let target = transfer.target.region;
                    self.locations
                        .adopt(None, transfer.key, ObjectKind::KvBlock, target, 5, self.next_slot, 1)
                        .unwrap();
                    self.tiers.added(target, 7, None, transfer.key, ObjectKind::KvBlock, true, 0);
                }
                TierAction::Drain(_)
                | TierAction::Cancel
                | TierAction::Mark(_)
                | TierAction::Unmark(_)
                | TierAction::VictimsLeft(_) => {}
            }
            self.tiers.done(command.request, true);
        }
    }

    fn keys_of(commands: &[TierCommand]) -> Vec<(u8, &'static str)> {
        commands
            .iter()
            .map(|c| match c.action {
                TierAction::Move(t) => (t.key.0[0], "move"),
                TierAction::Evict(e) => (e.key.0[0], "evict"),
                TierAction::Copy(t) => (t.key.0[0], "copy"),
                TierAction::Drain(d) => (u8::try_from(d.region).unwrap_or(u8::MAX), "drain"),
                TierAction::Cancel => (0, "cancel"),
                TierAction::Mark(m) => (m.key.0[0], "mark"),
                TierAction::Unmark(m) => (m.key.0[0], "unmark"),
                TierAction::VictimsLeft(v) => (v.left, "victims_left"),
            })
            .collect()
    }

    /// Found by the eager write-back over a 16-slot L1 (a stall
    /// about one run in 13): an L1 victim whose copy to L3 was in flight
    /// was taken for one on its way out and dropped from L1's cache while
    /// it stayed in L1; once every block there was so, nothing in L1 could
    /// be evicted again and saves stopped.
    #[test]
    fn a_victim_being_copied_stays_in_its_tiers_cache_and_goes_once_copied() {
        let config = TierConfig {
            high_percent: 80,
            low_percent: 50,
            policy: PolicyKind::Lru,
            l3_write_back: L3WriteBack::Eager,
            ..TierConfig::default()
        };
        let mut world = World::new(config);
        world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
        world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
        for k in 1..=9 {
            world.add(0, 7, None, k);
        }
        // L1 is over its mark, but every block's copy to L3 is asked first:
        // none may go while it is read, and none is forgotten.
        let commands = world.plan();
        assert_eq!(commands.len(), 9, "{:?}", keys_of(&commands));
        assert!(commands.iter().all(|c| matches!(c.action, TierAction::Copy(_))));
        assert!(world.tiers.counters.copying_kept > 0);
        assert!(
            (1..=9).all(|k| world.tiers.tracked(&key(k)).iter().any(|&(t, _, _)| t == Tier::L1Dram)),
            "a block being copied left L1's cache"
        );
        for command in &commands {
            world.carry_out(command);
        }
        // Copied: the coldest now leave L1 down to its low mark (demoted:
        // L2 has room; the block passed over first counts as touched).
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(2, "move"), (3, "move"), (4, "move"), (5, "move")]);
    }

    #[test]
    fn a_data_plane_is_told_when_no_more_l1_victims_can_come_and_when_they_can() {
        // L2 nearly full (no room to write a victim below, so victims are
        // dropped) and L1 90% full of blocks saved just now: nothing may be
        // marked (a save's own blocks are not its victims), nothing is on
        // its way out.
        let config = TierConfig { high_percent: 95, low_percent: 80, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        world.tiers.takes_marks(0);
        for k in 1..=9 {
            world.add(1, 7, None, 100 + k);
        }
        for k in 1..=9 {
            world.add(0, 7, (k > 1).then(|| k - 1), k);
        }
        let told = |commands: &[TierCommand]| -> Vec<u8> {
            commands
                .iter()
                .filter_map(|c| match c.action {
                    TierAction::VictimsLeft(v) => {
                        assert_eq!((c.region, v.region), (0, 0));
                        Some(v.left)
                    }
                    _ => None,
                })
                .collect()
        };
        let mut out = Vec::new();
        world.tiers.plan(&world.locations, &world.leases, 1, &mut out);
        assert_eq!(told(&out), [0], "{:?}", keys_of(&out));
        assert!(!out.iter().any(|c| matches!(c.action, TierAction::Mark(_))));
        // Said once, not every pass.
        out.clear();
        world.tiers.plan(&world.locations, &world.leases, 2, &mut out);
        assert!(told(&out).is_empty(), "{:?}", keys_of(&out));
        // A while later the blocks are no longer new: the coldest leaf is
        // marked to be dropped, and the data plane told victims come again.
        out.clear();
        world.tiers.plan(&world.locations, &world.leases, 1 + MARK_AFTER_NS + 1, &mut out);
        assert!(out.iter().any(|c| matches!(c.action, TierAction::Mark(_))), "{:?}", keys_of(&out));
        assert_eq!(told(&out), [1], "{:?}", keys_of(&out));
    }

    #[test]
    fn an_l1_over_its_mark_whose_victims_would_be_dropped_still_marks_them() {
        // L1 90% full (over its 80% mark) of blocks no longer new, L2 at
        // its mark (no room for one more): L1's evictions drop nothing
        // ahead of a save's need, so room comes only from victims marked
        // for saves to take. Without them L1 stood full and every save was
        // refused.
        let config = TierConfig { high_percent: 80, low_percent: 60, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        world.tiers.takes_marks(0);
        for k in 1..=8 {
            world.add(1, 7, None, 100 + k);
        }
        for k in 1..=9 {
            world.add(0, 7, (k > 1).then(|| k - 1), k);
        }
        let mut out = Vec::new();
        world.tiers.plan(&world.locations, &world.leases, 1 + MARK_AFTER_NS + 1, &mut out);
        let marked: Vec<u8> = out
            .iter()
            .filter_map(|c| match c.action {
                TierAction::Mark(m) => Some(m.key.0[0]),
                _ => None,
            })
            .collect();
        assert!(!marked.is_empty(), "nothing marked: {:?}", keys_of(&out));
        assert_eq!(marked[0], 9, "the chain's leaf first: {:?}", keys_of(&out));
        assert!(!out.iter().any(|c| matches!(c.action, TierAction::Evict(_))), "nothing dropped ahead of need");
    }

    #[test]
    fn failed_commands_are_counted_by_why() {
        let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        for k in 1..=9 {
            world.add(0, 7, None, k);
        }
        let commands = world.plan();
        assert_eq!(commands.len(), 4);
        let code = lake_dp::wire::message::ErrorCode::NoSpace as u32;
        world.tiers.refused(commands[0].request, code);
        world.tiers.refused(commands[1].request, 99);
        world.tiers.unrouted(commands[2].request);
        world.tiers.lost_regions(&[0]);
        // Answered twice: counted once.
        world.tiers.refused(commands[0].request, code);
        let c = world.tiers.counters;
        assert_eq!((c.refused[code as usize], c.refused[0], c.unrouted, c.link_lost), (1, 1, 1, 1), "{c:?}");
        assert_eq!(c.failed, 4);
        assert_eq!(c.failed, c.refused.iter().sum::<u64>() + c.unrouted + c.link_lost + c.timed_out);
    }

    #[test]
    fn a_drained_l2_region_is_announced_then_emptied_into_the_others() {
        let mut world = World::new(TierConfig { policy: PolicyKind::Lru, ..TierConfig::default() });
        // A second L2 file (region 2) and an object store (region 9).
        for (region, tier, slots) in [(2, Tier::L2Nvme, 10), (9, Tier::L3Object, 100)] {
            world.locations.register_region(region, tier, NodeId(0), 5).unwrap();
            world.tiers.register(region, tier, 0, 5, SLOT, slots);
        }
        world.tiers.name_region(1, "/disk/a/l2-0");
        for k in 1..=5 {
            world.add(1, 7, None, k);
        }
        // Block 5 is in L3 too.
        world.locations.adopt(None, key(5), ObjectKind::KvBlock, 9, 5, 99, 1).unwrap();
        world.tiers.added(9, 7, None, key(5), ObjectKind::KvBlock, true, 0);
        world.add(2, 7, None, 6);
        assert_eq!(world.tiers.capacity(Tier::L2Nvme), 20 * SLOT);

        assert!(world.tiers.drain(0).unwrap_err().contains("not an L2 file"));
        assert!(world.tiers.drain(42).unwrap_err().contains("no region 42"));
        world.tiers.drain(1).unwrap();
        // Its room is no longer the tier's.
        assert_eq!(world.tiers.capacity(Tier::L2Nvme), 10 * SLOT);
        // The data plane is told first; nothing moves before it took it.
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(1, "drain")]);
        let TierAction::Drain(told) = commands[0].action else { unreachable!() };
        assert_eq!((commands[0].region, told.draining), (1, 1));
        assert!(world.plan().is_empty(), "asked once while in flight");
        assert!(!world.tiers.drains()[0].announced);
        world.tiers.done(commands[0].request, true);

        // Blocks only there move to region 2; block 5, which L3 holds, is
        // dropped from it.
        let mut commands = world.plan();
        commands.sort_unstable_by_key(|c| keys_of(core::slice::from_ref(c))[0]);
        assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move"), (3, "move"), (4, "move"), (5, "evict")]);
        for command in &commands[..4] {
            let TierAction::Move(t) = command.action else { unreachable!() };
            assert_eq!((t.source.region, t.target.tier, t.target.region, t.target.slot), (1, 2, 2, SLOT_ANY));
        }
        assert!(world.plan().is_empty(), "each asked once");
        assert_eq!(world.tiers.drains()[0].blocks_left, 5);
        assert!(!world.tiers.drains()[0].done);
        for command in &commands {
            world.carry_out(command);
        }
        let drain = &world.tiers.drains()[0];
        assert_eq!((drain.blocks_left, drain.moved, drain.dropped, drain.done), (0, 4, 1, true), "{drain:?}");
        let regions = world.tiers.regions();
        let l2: Vec<(u16, u64, bool)> =
            regions.iter().filter(|r| r.tier == Tier::L2Nvme).map(|r| (r.region, r.blocks, r.draining)).collect();
        assert_eq!(l2, vec![(1, 0, true), (2, 5, false)]);
        assert_eq!(regions[1].name, "/disk/a/l2-0");
        // The moved blocks are still L2's, block 5 L3's alone.
        assert!(world.tiers.tracked(&key(3)).iter().any(|&(t, _, _)| t == Tier::L2Nvme));
        assert!(!world.tiers.tracked(&key(5)).iter().any(|&(t, _, _)| t == Tier::L2Nvme));
        assert_eq!(world.tiers.counters.drain_moves, 4);

        // Used again: its data plane is told, its room counted again.
        world.tiers.undrain(1).unwrap();
        assert!(world.tiers.undrain(1).is_err());
        assert_eq!(world.tiers.capacity(Tier::L2Nvme), 20 * SLOT);
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(1, "drain")]);
        let TierAction::Drain(told) = commands[0].action else { unreachable!() };
        assert_eq!(told.draining, 0);
    }

    #[test]
    fn a_drain_the_data_plane_refused_is_asked_again_later_and_moves_nothing_meanwhile() {
        let mut world = World::new(TierConfig::default());
        world.locations.register_region(2, Tier::L2Nvme, NodeId(0), 5).unwrap();
        world.tiers.register(2, Tier::L2Nvme, 0, 5, SLOT, 10);
        world.add(1, 7, None, 1);
        world.tiers.drain(1).unwrap();
        let commands = world.plan();
        world.tiers.drain_refused(1, "its lake-dp does not drain (an older build)");
        world.tiers.done(commands[0].request, false);
        let drain = &world.tiers.drains()[0];
        assert_eq!(drain.refused.as_deref(), Some("its lake-dp does not drain (an older build)"));
        assert!(!drain.announced && !drain.done);
        assert!(world.plan().is_empty(), "not again within the retry wait, and no block moved");
        let mut out = Vec::new();
        world.tiers.plan(&world.locations, &world.leases, DRAIN_RETRY_NS, &mut out);
        assert_eq!(keys_of(&out), vec![(1, "drain")]);
        // A data plane that restarted forgets the drain: told again.
        world.tiers.done(out[0].request, true);
        assert!(world.tiers.drains()[0].announced);
        world.tiers.register(1, Tier::L2Nvme, 0, 6, SLOT, 10);
        assert!(!world.tiers.drains()[0].announced);
    }

    #[test]
    fn above_high_water_the_coldest_leaves_are_demoted_then_dropped() {
        let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        // A chain 1..=9 in L1: 9 of 10 slots, above 80%.
        world.add(0, 7, None, 1);
        for k in 2..=9 {
            world.add(0, 7, Some(k - 1), k);
        }
        let commands = world.plan();
        // Down to 50% (5 blocks): the chain's tail goes, leaf first,
        // demoted because L2 holds none of it.
        assert_eq!(keys_of(&commands), vec![(9, "move"), (8, "move"), (7, "move"), (6, "move")]);
        for command in &commands {
            let TierAction::Move(t) = command.action else { unreachable!() };
            assert_eq!((t.target.tier, t.target.slot, t.priority), (2, SLOT_ANY, Priority::Demotion as u8));
        }
        // In flight, they count as gone: no second ask.
        assert!(world.plan().is_empty());
        assert_eq!(world.tiers.usage(Tier::L1Dram).pending_bytes, 4 * SLOT);
        for command in &commands {
            world.carry_out(command);
        }
        assert_eq!(world.tiers.usage(Tier::L1Dram).bytes, 5 * SLOT);
        assert_eq!(world.tiers.usage(Tier::L2Nvme).bytes, 4 * SLOT);
        // Promoted back (a hit), block 9 is in both tiers; the coldest when
        // L1 fills again, it is dropped from L1, not written again.
        world.add(0, 7, Some(8), 9);
        for k in 20..24 {
            world.add(0, 7, None, k);
        }
        world.tiers.accessed(7, &[key(1), key(2), key(3), key(4), key(5), key(20), key(21), key(22), key(23)]);
        let commands = world.plan();
        assert_eq!(keys_of(&commands)[0], (9, "evict"), "{:?}", keys_of(&commands));
        assert_eq!(world.tiers.counters.drops[Tier::L1Dram as usize], 1);
    }

    #[test]
    fn l1_blocks_of_several_size_classes_count_at_their_own_bytes() {
        let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        // Four blocks of a class twice the smallest (say another model's
        // layout) in the 10-slot L1, and one smaller than a slot (it takes
        // one all the same): 9 slots' bytes, over the mark.
        for k in 1..=4 {
            world.next_slot += 1;
            world.locations.adopt(None, key(k), ObjectKind::KvBlock, 0, 5, world.next_slot, 1).unwrap();
            world.tiers.added(0, 7, None, key(k), ObjectKind::KvBlock, true, 2 * SLOT);
        }
        world.next_slot += 1;
        world.locations.adopt(None, key(5), ObjectKind::KvBlock, 0, 5, world.next_slot, 1).unwrap();
        world.tiers.added(0, 7, None, key(5), ObjectKind::KvBlock, true, SLOT / 2);
        let usage = world.tiers.usage(Tier::L1Dram);
        assert_eq!((usage.bytes, usage.blocks), (9 * SLOT, 5));
        let commands = world.plan();
        // What the victims free is their own bytes: down to 50% and no
        // further (two large blocks and at most the small one).
        let freed = world.tiers.usage(Tier::L1Dram).pending_bytes;
        let victims = commands.len() as u64;
        assert!((4 * SLOT..=5 * SLOT).contains(&freed), "{victims} victims free {freed}");
        for command in &commands {
            world.carry_out(command);
        }
        let usage = world.tiers.usage(Tier::L1Dram);
        assert_eq!(usage.bytes, 9 * SLOT - freed);
        assert_eq!(usage.blocks, 5 - victims);
        assert_eq!(world.tiers.regions()[0].blocks, 5 - victims);
    }

    #[test]
    fn a_namespace_over_its_quota_gives_up_its_own_blocks() {
        let config = TierConfig {
            quotas: vec![Quota { namespace: 2, tier: Tier::L1Dram, bytes: 2 * SLOT }],
            policy: PolicyKind::Lru,
            ..TierConfig::default()
        };
        let mut world = World::new(config);
        world.add(0, 1, None, 1);
        world.add(0, 2, None, 2);
        world.add(0, 2, None, 3);
        world.add(0, 2, None, 4);
        // The tier is far from full; namespace 2 is one over its quota.
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(2, "move")]);
    }

    #[test]
    fn a_tenant_over_its_quota_gives_up_blocks_of_its_largest_namespace() {
        let tenant = TenantQuota { tenant: "acme".into(), namespaces: vec![2, 3], tier: Tier::L1Dram, bytes: 3 * SLOT };
        let config = TierConfig { tenant_quotas: vec![tenant], policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        // Namespace 1 is another tenant's, far larger, and left alone.
        for k in 1..=5 {
            world.add(0, 1, None, k);
        }
        // Acme: namespace 2 holds three, namespace 3 two — five against a
        // quota of three, though neither namespace alone is over it.
        world.add(0, 2, None, 10);
        world.add(0, 2, None, 11);
        world.add(0, 2, None, 12);
        world.add(0, 3, None, 20);
        world.add(0, 3, None, 21);
        let commands = world.plan();
        // The largest first (namespace 2's coldest), then, even at two
        // each, namespace 3's (the larger id among equals).
        assert_eq!(keys_of(&commands), vec![(10, "move"), (20, "move")]);
        assert_eq!(world.tiers.counters.tenant_quota_evictions, 2);
        // What is on its way out counts as gone.
        assert_eq!(world.tiers.tenant_usage(), vec![("acme", Tier::L1Dram, 3 * SLOT, 3 * SLOT)]);
        for command in &commands {
            world.carry_out(command);
        }
        assert!(world.plan().is_empty(), "at its quota: nothing more");
    }

    #[test]
    fn a_purged_namespace_loses_every_replica_in_every_tier_and_the_purge_ends() {
        let config = TierConfig { policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
        world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
        // Namespace 7 in L1, L2 and L3; namespace 8 in L1.
        world.add(0, 7, None, 40);
        world.add(0, 7, Some(40), 41);
        world.add(1, 7, None, 42);
        world.add(9, 7, None, 43);
        world.add(9, 7, None, 40);
        world.add(0, 8, None, 50);
        let before = world.tiers.namespaces();
        let held = |n: u64| before.iter().find(|(ns, _)| *ns == n).map(|(_, b)| *b).unwrap_or_default();
        assert!(held(7).iter().sum::<u64>() > 0 && held(8)[Tier::L1Dram as usize] > 0);
        world.tiers.purge(7);
        world.tiers.purge(7);
        assert_eq!((world.tiers.purging(), world.tiers.counters.purges_started), (&[7][..], 1));
        let commands = world.plan();
        assert!(!commands.is_empty());
        for command in &commands {
            assert!(matches!(command.action, TierAction::Evict(_)), "{command:?}");
            world.carry_out(command);
        }
        // Nothing of namespace 7 anywhere; namespace 8 untouched.
        for tier in [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object] {
            assert_eq!(world.tiers.namespace_bytes(tier, 7), 0, "{tier:?}");
        }
        assert_eq!(world.tiers.namespace_bytes(Tier::L1Dram, 8), held(8)[Tier::L1Dram as usize]);
        assert_eq!(world.tiers.counters.purged, commands.len() as u64);
        assert!(world.plan().is_empty());
        assert_eq!((world.tiers.purging(), world.tiers.counters.purges_done), (&[][..], 1));
    }

    #[test]
    fn the_second_access_filter_writes_only_blocks_seen_twice_to_l2() {
        let config = TierConfig {
            high_percent: 80,
            low_percent: 50,
            policy: PolicyKind::Lru,
            l2_admission: L2Admission::SecondAccess,
            ..TierConfig::default()
        };
        let mut world = World::new(config);
        for k in 1..=9 {
            world.add(0, 7, None, k);
        }
        // Blocks 2 and 4 were hit after their save; the others never.
        for k in [2, 4] {
            world.tiers.accessed(7, &[key(k)]);
            world.tiers.reused(&[key(k)]);
        }
        // 9 of 10 slots, down to 5: the four coldest (LRU: 1, 3, 5, 6) go,
        // each used once, so dropped rather than written to L2.
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(1, "evict"), (3, "evict"), (5, "evict"), (6, "evict")]);
        assert_eq!((world.tiers.counters.l2_filtered, world.tiers.counters.demotions), (4, 0));
        for command in &commands {
            world.carry_out(command);
        }
        // Block 1 saved again: its second life. Then 10..=12, and a
        // request touching all but 1 (only 2 and 4 of it hits).
        world.add(0, 7, None, 1);
        for k in 10..=12 {
            world.add(0, 7, None, k);
        }
        let touched: Vec<BlockKey> = [2, 4, 7, 8, 9, 10, 11, 12].map(key).to_vec();
        world.tiers.accessed(7, &touched);
        world.tiers.reused(&[key(2), key(4)]);
        // Four victims again: those seen twice (1, 2, 4) are written, the
        // others dropped.
        let commands = keys_of(&world.plan());
        assert_eq!(commands.len(), 4);
        assert_eq!(commands[0], (1, "move"), "{commands:?}");
        for &(k, action) in &commands {
            assert_eq!(action, if [1, 2, 4].contains(&k) { "move" } else { "evict" }, "{commands:?}");
        }
        let moves = commands.iter().filter(|(_, a)| *a == "move").count() as u64;
        assert_eq!((world.tiers.counters.l2_filtered, world.tiers.counters.demotions), (4 + 4 - moves, moves));
    }

    #[test]
    fn a_leased_replica_is_passed_over_and_a_failed_command_puts_its_block_back() {
        let config = TierConfig { high_percent: 80, low_percent: 70, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        for k in 1..=9 {
            world.add(0, 7, None, k);
        }
        // A reader holds block 1 (the coldest) under a lease.
        let replica = |locations: &Locations, k: &BlockKey| locations.ready(k).next();
        world.leases.grant(1, 1, [key(1)], |k| replica(&world.locations, k), 1000, 0);
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(2, "move"), (3, "move")]);
        assert!(world.tiers.counters.leased_kept > 0);
        // The data plane could not do the first: the block is back (as the
        // most recent, so a refusal is not retried at once).
        world.tiers.done(commands[0].request, false);
        world.carry_out(&commands[1]);
        assert_eq!(world.tiers.counters.failed, 1);
        assert_eq!(world.tiers.usage(Tier::L1Dram).bytes, 8 * SLOT);
        world.add(0, 7, None, 10);
        let again = world.plan();
        assert_eq!(keys_of(&again), vec![(4, "move"), (5, "move")]);
        // Its data plane went away: everything in flight fails.
        world.tiers.lost_regions(&[0]);
        assert_eq!(world.tiers.pending(), 0);
        assert_eq!(world.tiers.counters.failed, 3);
    }

    #[test]
    fn l2_victims_go_to_l3_and_eager_write_back_copies_every_saved_block() {
        // L2 over its mark: the coldest go to L3, not away.
        let mut world = World::with_l3(TierConfig::default());
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move"), (3, "move"), (4, "move")]);
        for command in &commands {
            let TierAction::Move(t) = command.action else { unreachable!() };
            assert_eq!((t.source.tier, t.target.tier, t.target.region, t.target.slot), (2, 3, 9, SLOT_ANY));
        }
        assert_eq!(world.tiers.counters.l3_moves, 4);
        // A block L3 holds already is dropped from L2, not written again.
        let mut world = World::with_l3(TierConfig::default());
        world.locations.adopt(None, key(1), ObjectKind::KvBlock, 9, 5, 1, 1).unwrap();
        world.tiers.added(9, 7, None, key(1), ObjectKind::KvBlock, true, 0);
        let commands = world.plan();
        assert_eq!(keys_of(&commands)[..2], [(1, "evict"), (2, "move")], "{:?}", keys_of(&commands));

        // Eager: a block saved into L1 is copied to L3 (kept in L1), once.
        let config = TierConfig { l3_write_back: L3WriteBack::Eager, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = World::new(config);
        world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
        world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
        world.add(0, 7, None, 1);
        world.add(0, 7, Some(1), 2);
        let copies = world.plan();
        assert_eq!(keys_of(&copies), vec![(1, "copy"), (2, "copy")]);
        let TierAction::Copy(t) = copies[0].action else { unreachable!() };
        assert_eq!((t.source.tier, t.target.tier, t.priority), (1, 3, Priority::WriteBack as u8));
        // A copy frees nothing: L1's figures do not count it as leaving.
        assert_eq!(world.tiers.usage(Tier::L1Dram).pending_bytes, 0);
        assert!(world.plan().is_empty(), "asked once");
        // Refused, it is not asked again by itself (the next save of the
        // block, or its eviction, writes L3).
        world.tiers.done(copies[0].request, false);
        assert!(world.plan().is_empty());
        assert_eq!(world.tiers.counters.l3_copies, 2);
    }

    #[test]
    fn a_full_l2_admits_a_demotion_only_where_its_policy_would() {
        let config =
            TierConfig { high_percent: 50, low_percent: 40, policy: PolicyKind::Lake, ..TierConfig::default() };
        let mut world = World::new(config);
        // L2 above its high-water mark with blocks read again and again.
        for k in 30..36 {
            world.add(1, 7, None, k);
        }
        for _ in 0..50 {
            world.tiers.accessed(7, &[key(30), key(31), key(32), key(33), key(34), key(35)]);
        }
        // L1 over its mark with one-off blocks: demoting them would push
        // the reused ones out of L2.
        for k in 1..=6 {
            world.add(0, 7, None, k);
        }
        let commands = world.plan();
        let l1: Vec<_> = commands.iter().filter(|c| c.region == 0).collect();
        assert!(!l1.is_empty());
        assert!(world.tiers.counters.admission_refused > 0, "{:?}", world.tiers.counters);
        assert!(l1.iter().any(|c| matches!(c.action, TierAction::Evict(_))));
    }
}
