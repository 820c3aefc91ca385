//! Placement: the node that keeps a block for the pool.
//!
//! Every block has a **home**: among the members that take copies (not
//! draining, their L1 known), the one a weighted rendezvous hash of the
//! block's key picks, each member weighted by the room it announced (its
//! L1 and L2 bytes). A block an engine saves lands in its own node's L1;
//! where that node is not the block's home, and the home holds no copy,
//! the leader asks the node to copy it there ([`Summary::placement_plan`],
//! sent as a write-back). Once the home has it, the saving node's copy is
//! a copy as a pulled one is: first in line, dropped rather than written
//! below. So the pool keeps one copy of each block, and the blocks spread
//! over the members in proportion to their room, whichever node their
//! engines ran on. A member joining or leaving moves the home of only the
//! blocks it takes or had (the rendezvous hash's property); blocks
//! already placed stay where they are. Draining nodes' blocks go to their
//! homes among the others ([`Summary::drain_plan`]).

use std::collections::{HashMap, VecDeque};

use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::{DeltaEntry, DeltaOp, Transfer};
use lake_dp::{BlockKey, Replica, Tier};

use super::{AggregatorCounters, Replication, Summary, tier_of};

/// Blocks waiting to be placed, at most: past it, a node's new blocks
/// stay where they were saved (counted).
pub(crate) const PLACING_MAX: usize = 1 << 20;

/// Blocks newly held in a node's L1, in the order their deltas came, where
/// the summary notes them (`None`: it does not).
#[derive(Debug, Default)]
pub(super) struct Pending {
    queue: Option<VecDeque<(u32, BlockKey)>>,
    /// Not noted: the queue was full.
    pub(super) dropped: u64,
}

/// Notes a node's change for placement: a new L1 replica.
pub(super) fn note(pending: &mut Pending, node: u32, entry: &DeltaEntry) {
    let Some(queue) = pending.queue.as_mut() else { return };
    if DeltaOp::from_u8(entry.op) != Some(DeltaOp::Add) || tier_of(entry) != Some(Tier::L1Dram) {
        return;
    }
    if queue.len() < PLACING_MAX {
        queue.push_back((node, entry.key));
    } else {
        pending.dropped += 1;
    }
}

/// A 64-bit mix (splitmix64's finalizer): keys that differ in a bit hash
/// apart, whatever made them.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `node`'s rendezvous score for `key` at `weight`: the largest wins. A
/// uniform draw `u` in (0, 1) scored `-weight / ln u` picks each node in
/// proportion to its weight.
#[allow(clippy::cast_precision_loss)] // 53 bits of draw exactly; a weight's low bits do not matter
pub(super) fn score(key: &BlockKey, node: u32, weight: u64) -> f64 {
    let (a, b) = key.0.split_at(8);
    let a = u64::from_le_bytes(a.try_into().unwrap_or([0; 8]));
    let b = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    let draw = mix(a ^ mix(b ^ mix(u64::from(node))));
    // 53 bits, never 0 or 1.
    let u = ((draw >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    weight.max(1) as f64 / -u.ln()
}

/// Of `candidates` (node, weight, where copies to it go), the one `key`'s
/// rendezvous picks.
pub(super) fn pick<'c>(
    key: &BlockKey,
    candidates: &'c [(u32, u64, ReplicaWire)],
) -> Option<&'c (u32, u64, ReplicaWire)> {
    candidates.iter().max_by(|a, b| score(key, a.0, a.1).total_cmp(&score(key, b.0, b.1)))
}

impl Summary {
    /// Notes the nodes' new L1 blocks from now on, for
    /// [`Summary::placement_plan`]: the leader placing blocks calls this
    /// once.
    pub fn track_placement(&mut self) {
        self.placing.queue.get_or_insert_with(VecDeque::new);
    }

    /// Notes `node`'s block `key` to be placed again (a copy asked a while
    /// ago that may not have landed): the next plan looks at it anew.
    pub fn place_again(&mut self, node: u32, key: BlockKey) {
        if let Some(queue) = self.placing.queue.as_mut()
            && queue.len() < PLACING_MAX
        {
            queue.push_back((node, key));
        }
    }

    /// Blocks waiting to be placed, and those not noted for a full queue.
    pub fn placing(&self) -> (usize, u64) {
        (self.placing.queue.as_ref().map_or(0, VecDeque::len), self.placing.dropped)
    }

    /// Each member's room (its L1 and L2 bytes) as its membership
    /// announced it: its weight in placement (not said: the least).
    pub fn rooms(&mut self, rooms: &[(u32, u64)]) {
        for (node, view) in &mut self.nodes {
            view.room = rooms.iter().find(|(n, _)| n == node).map_or(0, |&(_, room)| room);
        }
    }

    /// The members a block can be placed in: not draining, their L1
    /// known; with their weights and where copies to them go.
    pub(super) fn homes(&self) -> Vec<(u32, u64, ReplicaWire)> {
        self.nodes()
            .into_iter()
            .filter_map(|node| {
                let view = &self.nodes[&node];
                if !view.member || view.draining {
                    return None;
                }
                Some((node, view.room, self.l1_target(node)?))
            })
            .collect()
    }

    /// Where a victim of full node `from` spills to: the member taking
    /// placements that fills the least of its room — blocks held in L1 or
    /// L2 per byte announced (a block in both counts once: its L1 copy
    /// goes free), counting `promised` spills sent it since its blocks
    /// were counted — where that is under nineteen twentieths of what
    /// `from` fills of its own (a member about as full would only drop a
    /// block of its own for it). Both must have announced their room, and
    /// the member must keep `key`'s tenant apart as `from` does, where
    /// `from` keeps it apart ([`super::apart`]).
    pub fn spill_target(&self, key: &BlockKey, from: u32, promised: &HashMap<u32, u64>) -> Option<(u32, ReplicaWire)> {
        let spiller = self.nodes.get(&from).filter(|v| v.room > 0)?;
        let fill = |node: u32| {
            let held = self.nodes.get(&node).map_or(0, |v| v.cached);
            u128::from(held.saturating_add(promised.get(&node).copied().unwrap_or(0)))
        };
        // a/b < c/d as a·d < c·b: no rounding, no float.
        let (node, room, to) = self
            .homes()
            .into_iter()
            .filter(|&(node, room, _)| node != from && room > 0 && self.may_move(key, from, node))
            .min_by(|a, b| (fill(a.0) * u128::from(b.1)).cmp(&(fill(b.0) * u128::from(a.1))))?;
        let roomier = fill(node) * u128::from(spiller.room) * 20 < u128::from(spiller.cached) * u128::from(room) * 19;
        roomier.then_some((node, to))
    }

    /// The copies that answer nodes' `spills` (each a victim the node has
    /// no room for, its replica the source): into the L1 of
    /// [`Summary::spill_target`]'s member, or, where none has room, to the
    /// spilling node itself — the node then drops the block. Counted in
    /// `counters`.
    pub fn spill_plan(&self, spills: &[Transfer], counters: &mut AggregatorCounters) -> Vec<Replication> {
        let mut promised = HashMap::new();
        let mut plan = Vec::with_capacity(spills.len());
        for spill in spills {
            let Some(from) = Replica::from_wire(&spill.source) else { continue };
            let to = match self.spill_target(&spill.key, spill.source.node, &promised) {
                Some((node, to)) => {
                    *promised.entry(node).or_insert(0u64) += 1;
                    counters.spills_placed += 1;
                    to
                }
                None => {
                    counters.spills_unplaced += 1;
                    spill.source
                }
            };
            plan.push(Replication { key: spill.key, from, to });
        }
        plan
    }

    /// Where the pool keeps `key`: its home among the members now.
    pub fn home(&self, key: &BlockKey) -> Option<u32> {
        pick(key, &self.homes()).map(|&(node, _, _)| node)
    }

    /// Copies that place the blocks nodes saved since the last call: a
    /// block held in a member's L1 whose home is another member holding
    /// no copy of it (in any tier) is copied from there into the home's
    /// L1. `skip(key, home)` leaves out copies asked lately. At most
    /// `max`; the rest wait for the next call. A block gone from the node
    /// since, or already home, needs nothing.
    pub fn placement_plan(&mut self, max: usize, mut skip: impl FnMut(&BlockKey, u32) -> bool) -> Vec<Replication> {
        let mut out = Vec::new();
        // Called every pass of the leader's loop: nothing to do, nothing
        // looked at.
        if self.placing.queue.as_ref().is_none_or(VecDeque::is_empty) {
            return out;
        }
        let Some(mut queue) = self.placing.queue.take() else { return out };
        let homes = self.homes();
        if homes.len() < 2 {
            // One node: every block is home.
            queue.clear();
        }
        while out.len() < max {
            let Some((node, key)) = queue.pop_front() else { break };
            let Some(view) = self.nodes.get(&node).filter(|v| v.member) else { continue };
            let held = view.replicas.get(&key).into_iter().flatten();
            let Some(from) = held
                .filter(|h| tier_of(&h.entry) == Some(Tier::L1Dram))
                .find_map(|h| Replica::from_wire(&h.entry.replica))
            else {
                continue;
            };
            let Some(&(home, _, to)) = pick(&key, &homes) else { continue };
            let at_home = self.nodes.get(&home).is_some_and(|v| v.replicas.contains_key(&key));
            if home == node || at_home || skip(&key, home) {
                continue;
            }
            out.push(Replication { key, from, to });
        }
        self.placing.queue = Some(queue);
        out
    }
}
