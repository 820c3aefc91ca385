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
//!
//! Here: the manager's state and the reports that change it. One pass of
//! planning is in `plan.rs`; L2 drains in `drain.rs`; copies to L3 in
//! `writeback.rs`; namespaces' and tenants' counts and purges in
//! `quota.rs`; the settings, commands and counters in `config.rs`; the
//! invariants over its whole state in `invariants.rs`.

use std::collections::{HashMap, HashSet};

use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::{BlockEvicted, DrainRegion, EvictReason, SLOT_ANY, Transfer};
use lake_dp::{BlockKey, ObjectKind, Priority, Replica, Tier};

use crate::evict::{Cache, Lake, Lru, Policy, Verdict};
use crate::lease::Leases;
use crate::location::Locations;

mod config;
mod drain;
mod invariants;
mod plan;
mod quota;
mod spill;
#[cfg(test)]
mod tests;
mod writeback;

pub use config::*;
use drain::*;
pub use drain::{DrainStatus, RegionStatus};

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

/// Pulled-in L1 blocks followed at once (past it, one is kept as any).
const PULLED_IN_MAX: usize = 1 << 20;

/// Write-backs queued at most; beyond, the oldest are let go (counted).
const WRITE_BACK_QUEUE_MAX: usize = 1 << 20;

/// Write-backs one pass may ask at most.
const WRITE_BACKS_PER_PASS: usize = COMMANDS_PER_PASS / 4;

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
    /// L1 blocks pulled here from another node's copy (which stays
    /// there): cold as they land, and dropped when they are victims
    /// rather than written below — the pool keeps one copy of a
    /// block, at its holder, not one per node that read it.
    pulled_in: HashSet<BlockKey>,
    /// Of them, copies of blocks saved here and placed in their homes
    /// elsewhere: dropped as soon as they may be.
    placed_away: std::collections::VecDeque<BlockKey>,
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
    /// L1 victims offered to the pool rather than dropped.
    spills: spill::Spills,
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
            pulled_in: HashSet::new(),
            placed_away: std::collections::VecDeque::new(),
            marked: HashMap::new(),
            mark_order: std::collections::VecDeque::new(),
            unmarks: Vec::new(),
            cleaned: Vec::new(),
            recheck: Vec::new(),
            recent: std::collections::VecDeque::new(),
            recent_keys: HashMap::new(),
            to_clean: std::collections::VecDeque::new(),
            spills: spill::Spills::default(),
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
            self.continued_in_l1(parent, region);
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
        if info.tier == Tier::L1Dram {
            self.pulled_in.remove(key);
        }
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
        // Waiting after a refused command, out of every cache: it waits no
        // more (its wait's end would put a gone block back in the cache).
        let namespace = namespace.or_else(|| {
            let at = self.cooling.iter().position(|(_, p)| p.key == *key && p.region == region)?;
            Some(self.cooling.swap_remove(at).1.namespace)
        });
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

    /// The new L1 replica of `key` (of `namespace`) was pulled here from
    /// another node, whose copy stays (see `pulled_in`).
    pub fn pulled_in(&mut self, namespace: u64, key: BlockKey) {
        if self.pulled_in.len() < PULLED_IN_MAX {
            // First in line at once (not new: the engine that pulled it
            // holds a lease while it loads it).
            self.pulled_in.insert(key);
            self.space(Tier::L1Dram, namespace).cache.make_cold(&key);
        }
    }

    /// This node's L1 copy of `key` was placed in its home, another node,
    /// whose copy is the pool's now: it becomes a copy as one pulled in
    /// is (first in line, dropped rather than written below), and is
    /// dropped at once where it may be (see `plan_placed_away`): its room
    /// goes to the blocks this node keeps for the pool. Where its L1 copy
    /// went before the home had it (taken as a victim while the copy was
    /// under way), the one it left in L2 is dropped the same way. Whether
    /// this node held it.
    pub fn placed_away(&mut self, key: &BlockKey) -> bool {
        if self.pulled_in.len() >= PULLED_IN_MAX {
            return false;
        }
        let in_l1 = self.spaces.iter_mut().find(|((tier, _), s)| *tier == Tier::L1Dram && s.cache.index.contains(key));
        if let Some((_, space)) = in_l1 {
            space.cache.make_cold(key);
        } else if !(self.marked.contains_key(key)
            || self.pending_of.keys().any(|(k, _)| k == key)
            || self.spaces.iter().any(|((tier, _), s)| *tier == Tier::L2Nvme && s.cache.index.contains(key)))
        {
            // Not on its way out or down (the copy it leaves below is
            // dropped once there), nor below only.
            return false;
        }
        self.pulled_in.insert(*key);
        self.placed_away.push_back(*key);
        true
    }

    /// Copies placed away ([`Tiers::placed_away`]) not dropped yet.
    pub fn placed_away_waiting(&self) -> usize {
        self.placed_away.len()
    }

    /// Whether `key`'s L1 copy here was pulled in from another node.
    pub fn is_pulled_in(&self, key: &BlockKey) -> bool {
        !self.pulled_in.is_empty() && self.pulled_in.contains(key)
    }

    /// Another node read this node's block `key` (a pull copied it
    /// there): an access, so the copy the pool keeps is the one that
    /// stays.
    pub fn read_remotely(&mut self, key: &BlockKey) {
        for ((tier, _), space) in &mut self.spaces {
            if matches!(tier, Tier::L1Dram | Tier::L2Nvme) && space.cache.index.contains(key) {
                space.cache.accessed(std::slice::from_ref(key));
            }
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
        // A copy pulled in stays first in line: its holder's copy is the
        // one kept (touched there when it was pulled).
        let kept: Vec<BlockKey>;
        let keys = if keys.iter().any(|k| self.is_pulled_in(k)) {
            kept = keys.iter().filter(|k| !self.pulled_in.contains(k)).copied().collect();
            &kept[..]
        } else {
            keys
        };
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
        // An eager write-back to L3 the data plane could not take now
        // (its store's queue full, no L1 slot to stage an L2 block in):
        // queued again, so L3 comes to hold every block as promised. (A
        // victim's write below ahead of demand, out of its cache while it
        // is written, goes back there as any refused one does.)
        let transient = [lake_dp::wire::message::ErrorCode::QueueFull, lake_dp::wire::message::ErrorCode::NoSpace];
        let again = self.pending.get(&request).filter(|p| {
            transient.iter().any(|&c| c as u32 == code) && p.to == Some(Tier::L3Object) && !p.frees && !p.cleans
        });
        if let Some(&pending) = again {
            self.counters.l3_copies_deferred += 1;
            self.pending.remove(&request);
            self.pending_of.remove(&(pending.key, pending.region));
            self.write_back.push_back((pending.key, pending.namespace));
            return;
        }
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

    /// Commands in flight.
    pub fn pending(&self) -> usize {
        self.pending.len()
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
