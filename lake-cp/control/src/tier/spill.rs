//! Spills: a full node's victims go to the pool, not away. An L1 victim
//! that would be dropped — no room below it, no L3 — is offered to the
//! summary's leader instead, which asks this node to place it in the
//! member with the most room (`lake-cp::summary::link`); once it landed
//! there, this node's copy is a copy and goes
//! ([`Tiers::placed_away`]). Where no member has room the leader says so
//! (or, gone, says nothing until the wait runs out): the block goes first
//! and is dropped as it would have been, and the node offers none for a
//! while.

use super::*;

/// Spills offered and not yet placed, at most: past it, victims are
/// dropped as they would have been.
pub(super) const SPILLS_IN_FLIGHT: usize = 32;

/// How long a spill waits to be placed (ns): then the block is dropped
/// when next a victim, and no spill is offered for as long.
pub(super) const SPILL_WAIT_NS: u64 = 500_000_000;

/// Blocks remembered as not placed, at most.
const UNPLACED_MAX: usize = 4096;

/// Where spills stand.
#[derive(Debug, Default)]
pub(super) struct Spills {
    /// The leader places them.
    on: bool,
    /// To offer the leader ([`Tiers::take_spills`]).
    out: Vec<BlockKey>,
    /// Offered, and until when they wait.
    pub(super) waiting: HashMap<BlockKey, u64>,
    /// None is offered before this (one went unplaced).
    paused_until_ns: u64,
    /// Blocks whose spill went unplaced: dropped when next a victim.
    unplaced: HashSet<BlockKey>,
}

impl Tiers {
    /// Whether the summary's leader places this node's spills (it said
    /// so on connecting; a node without a leader drops its victims).
    pub fn set_spills(&mut self, on: bool) {
        self.spills.on = on;
    }

    /// The victims to offer the leader now: the caller sends each with
    /// its L1 replica, or says it could not ([`Tiers::spill_done`]).
    pub fn take_spills(&mut self) -> Vec<BlockKey> {
        core::mem::take(&mut self.spills.out)
    }

    /// A spill of `key` ended: placed elsewhere (`landed`; the caller
    /// then calls [`Tiers::placed_away`]), or not. Whether it was one.
    pub fn spill_done(&mut self, key: &BlockKey, landed: bool) -> bool {
        if self.spills.waiting.remove(key).is_none() {
            return false;
        }
        if landed {
            self.counters.spills_landed += 1;
        } else {
            self.spill_unplaced(*key);
        }
        true
    }

    /// Not placed: the block goes first, and is dropped when taken.
    fn spill_unplaced(&mut self, key: BlockKey) {
        self.counters.spills_unplaced += 1;
        for ((tier, _), space) in &mut self.spaces {
            if *tier == Tier::L1Dram && space.cache.index.contains(&key) {
                space.cache.make_cold(&key);
            }
        }
        if self.spills.unplaced.len() >= UNPLACED_MAX {
            self.spills.unplaced.clear();
        }
        self.spills.unplaced.insert(key);
        self.spills.paused_until_ns = self.now_ns.saturating_add(SPILL_WAIT_NS);
    }

    /// Whether L1 victim `key`, to be dropped, is offered instead: not
    /// while [`SPILLS_IN_FLIGHT`] wait (a save or a landing waiting for
    /// room is not held up by them) nor while spills pause, and not a
    /// block whose spill went unplaced (taken out of those).
    pub(super) fn spills_instead(&mut self, key: &BlockKey) -> bool {
        self.spills.on
            && self.now_ns >= self.spills.paused_until_ns
            && self.spills.waiting.len() < SPILLS_IN_FLIGHT
            && !self.spills.unplaced.remove(key)
    }

    /// Spills waiting whose block is in L1 `region`.
    pub(super) fn spills_from(&self, region: u16, locations: &Locations) -> usize {
        let here = |key: &BlockKey| locations.ready(key).any(|r| r.tier == Tier::L1Dram && r.region.0 == region);
        self.spills.waiting.keys().filter(|key| here(key)).count()
    }

    /// Offers victim `key` (of `namespace`, under `parent`): back in its
    /// cache until placed.
    pub(super) fn spill(&mut self, key: BlockKey, (parent, kind): (Option<BlockKey>, ObjectKind), namespace: u64) {
        self.space(Tier::L1Dram, namespace).cache.add(parent, key, kind);
        self.spills.waiting.insert(key, self.now_ns.saturating_add(SPILL_WAIT_NS));
        self.spills.out.push(key);
        self.counters.spills += 1;
    }

    /// Spills whose wait ran out: not placed (one whose block left
    /// meanwhile is only forgotten).
    pub(super) fn expire_spills(&mut self, locations: &Locations) {
        if self.spills.waiting.is_empty() {
            return;
        }
        let now = self.now_ns;
        let late: Vec<BlockKey> =
            self.spills.waiting.iter().filter(|&(_, &until)| until <= now).map(|(key, _)| *key).collect();
        for key in late {
            self.spills.waiting.remove(&key);
            if locations.ready(&key).any(|r| r.tier == Tier::L1Dram) {
                self.spill_unplaced(key);
            }
        }
    }
}
