//! The location view: which replicas hold each block, in which state, and
//! the two-phase put that creates them. This node's `lake-cp` is the
//! authority for this node's replicas; every change is numbered
//! (term, sequence) for the cluster summary.
//!
//! ```text
//! reserve(key, parent, region, slot, generation, deadline) ── Writing
//!    │ commit(epoch, generation) ──► Ready      (stale epoch/generation: refused, dropped)
//!    │ abort / deadline passed   ──► removed    (an empty leaf block goes too)
//! evict ──► Evicting ──► removed
//! ```
//!
//! A region's epoch is bumped whenever its `lake-dp` restarts; replicas
//! carry a one-byte tag of the epoch they were written under, so a region
//! re-registered under a new epoch makes its old replicas stale at once
//! (they are dropped as they are met, and never served).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use lake_dp::{BlockKey, NodeId, ObjectKind, Replica, Tier};

use crate::index::{BlockRef, Index, IndexError, Loc, LocState};

/// A region as the location view knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its tier.
    pub tier: Tier,
    /// Its node.
    pub node: NodeId,
    /// Its current epoch.
    pub epoch: u64,
    /// The tag replicas of this epoch carry.
    tag: u8,
}

impl RegionInfo {
    /// The one-byte tag replicas written under the current epoch carry
    /// (what the mirror publishes beside a slot).
    pub fn epoch_tag(&self) -> u8 {
        self.tag
    }
}

/// Why a location operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocationError {
    /// The index refused.
    Index(IndexError),
    /// No such region registered.
    UnknownRegion,
    /// The epoch named is not the region's current one (a stale `lake-dp`
    /// incarnation, or a message from before a restart).
    StaleEpoch,
    /// The generation named is not the reserved one.
    StaleGeneration,
    /// No reservation for this block in this region.
    NoReservation,
    /// A reservation exists under another request id.
    Conflict,
}

impl core::fmt::Display for LocationError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Index(e) => write!(f, "{e}"),
            Self::UnknownRegion => f.write_str("location: unknown region"),
            Self::StaleEpoch => f.write_str("location: stale region epoch"),
            Self::StaleGeneration => f.write_str("location: stale slot generation"),
            Self::NoReservation => f.write_str("location: no reservation"),
            Self::Conflict => f.write_str("location: reserved under another request"),
        }
    }
}

impl std::error::Error for LocationError {}

impl From<IndexError> for LocationError {
    fn from(e: IndexError) -> Self {
        Self::Index(e)
    }
}

/// What changed, numbered for the cluster summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    /// The term of the sequence.
    pub term: u64,
    /// Sequence within the term (no gaps).
    pub sequence: u64,
    /// Added (ready), or removed.
    pub op: ChangeOp,
    /// The block.
    pub key: BlockKey,
    /// The replica.
    pub replica: Replica,
}

/// A change's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeOp {
    /// A replica became ready.
    Ready,
    /// A ready replica went away.
    Removed,
}

#[derive(Clone, Copy, Debug)]
struct Reservation {
    block: BlockRef,
    region: u16,
    generation: u32,
    deadline_ns: u64,
    request: u64,
}

/// The location view over the index. See the module docs.
#[derive(Debug)]
pub struct Locations {
    /// The index it keeps replicas in.
    pub index: Index,
    regions: HashMap<u16, RegionInfo>,
    reservations: HashMap<(BlockRef, u16), Reservation>,
    deadlines: BinaryHeap<Reverse<(u64, u32, u16)>>,
    term: u64,
    sequence: u64,
    changes: Vec<Change>,
    /// Blocks whose L1 and L2 replicas here are copies of one the pool
    /// keeps on another node (moved to its reader, placed in its home,
    /// spilled), waiting to go: their changes are not recorded and
    /// snapshots leave them out, so no other node reads them from here.
    /// An L3 replica, the store's, is offered as ever. Forgotten once
    /// none of those replicas is left.
    withheld: HashSet<BlockKey>,
}

impl Locations {
    /// An empty view for `term`.
    pub fn new(term: u64) -> Self {
        Self {
            index: Index::default(),
            regions: HashMap::new(),
            reservations: HashMap::new(),
            deadlines: BinaryHeap::new(),
            term,
            sequence: 0,
            changes: Vec::new(),
            withheld: HashSet::new(),
        }
    }

    /// Registers a region, or re-registers it under a new epoch (its
    /// `lake-dp` restarted): the replicas of earlier epochs become stale.
    pub fn register_region(&mut self, region: u16, tier: Tier, node: NodeId, epoch: u64) -> Result<(), LocationError> {
        match self.regions.get_mut(&region) {
            Some(info) if epoch < info.epoch => Err(LocationError::StaleEpoch),
            Some(info) if epoch == info.epoch => Ok(()),
            Some(info) => {
                info.epoch = epoch;
                info.tag = info.tag.wrapping_add(1);
                info.tier = tier;
                info.node = node;
                // Its replicas are stale now: blocks withheld for them alone
                // are forgotten.
                let gone: Vec<BlockKey> =
                    self.withheld.iter().filter(|key| self.ready_copies(key).next().is_none()).copied().collect();
                for key in gone {
                    self.withheld.remove(&key);
                }
                Ok(())
            }
            None => {
                self.regions.insert(region, RegionInfo { tier, node, epoch, tag: 0 });
                Ok(())
            }
        }
    }

    /// A region's current state.
    pub fn region(&self, region: u16) -> Option<RegionInfo> {
        self.regions.get(&region).copied()
    }

    /// `node`'s region of `tier` (the lowest-numbered, where it has
    /// several), and its state.
    pub fn region_of(&self, node: NodeId, tier: Tier) -> Option<(u16, RegionInfo)> {
        self.regions
            .iter()
            .filter(|(_, r)| r.node == node && r.tier == tier)
            .map(|(&id, &r)| (id, r))
            .min_by_key(|r| r.0)
    }

    fn replica(&self, loc: Loc) -> Option<Replica> {
        let info = self.regions.get(&loc.region)?;
        Some(Replica {
            tier: info.tier,
            node: info.node,
            region: lake_dp::RegionId(loc.region),
            region_epoch: info.epoch,
            slot: loc.slot,
            generation: loc.generation,
        })
    }

    fn is_current(&self, loc: &Loc) -> bool {
        self.regions.get(&loc.region).is_some_and(|info| info.tag == loc.epoch_tag)
    }

    fn record(&mut self, op: ChangeOp, key: BlockKey, loc: Loc) {
        if self.is_withheld(&key) && self.is_copy(&loc) {
            return;
        }
        if let Some(replica) = self.replica(loc) {
            self.sequence += 1;
            self.changes.push(Change { term: self.term, sequence: self.sequence, op, key, replica });
        }
    }

    /// Phase one of a put: reserves `slot` of `region` (at `generation`)
    /// for `key` under `parent`, inserting the block if needed. Idempotent
    /// per `request`: the same request reserving again gets the same
    /// reservation back.
    #[allow(clippy::too_many_arguments)] // the fields of one reservation
    pub fn reserve(
        &mut self,
        parent: Option<BlockKey>,
        key: BlockKey,
        kind: ObjectKind,
        region: u16,
        slot: u32,
        generation: u32,
        deadline_ns: u64,
        request: u64,
    ) -> Result<BlockRef, LocationError> {
        let info = self.regions.get(&region).copied().ok_or(LocationError::UnknownRegion)?;
        let block = self.index.insert(parent, key, kind)?;
        if let Some(existing) = self.reservations.get(&(block, region)) {
            return if existing.request == request { Ok(block) } else { Err(LocationError::Conflict) };
        }
        let loc = Loc { region, state: LocState::Writing, epoch_tag: info.tag, slot, generation };
        if let Err(e) = self.index.add_replica(block, loc) {
            self.drop_if_empty_leaf(block);
            return Err(e.into());
        }
        self.reservations.insert((block, region), Reservation { block, region, generation, deadline_ns, request });
        self.deadlines.push(Reverse((deadline_ns, block.0, region)));
        Ok(block)
    }

    /// Phase two: the bytes are written; the replica becomes ready. A stale
    /// epoch or generation is refused and the reservation dropped.
    pub fn commit(&mut self, key: &BlockKey, region: u16, epoch: u64, generation: u32) -> Result<(), LocationError> {
        let block = self.index.get(key).ok_or(LocationError::NoReservation)?;
        let reservation = self.reservations.get(&(block, region)).copied().ok_or(LocationError::NoReservation)?;
        let info = self.regions.get(&region).copied().ok_or(LocationError::UnknownRegion)?;
        let stale = if epoch != info.epoch {
            Some(LocationError::StaleEpoch)
        } else if generation != reservation.generation {
            Some(LocationError::StaleGeneration)
        } else {
            None
        };
        if let Some(error) = stale {
            self.abort_reservation(reservation);
            return Err(error);
        }
        self.reservations.remove(&(block, region));
        self.index.set_replica_state(block, region, LocState::Ready)?;
        let loc = self.index.replicas(block).find(|l| l.region == region).ok_or(LocationError::NoReservation)?;
        if !self.is_current(&loc) {
            // The region restarted between reserve and commit.
            self.abort_reservation(reservation);
            return Err(LocationError::StaleEpoch);
        }
        self.record(ChangeOp::Ready, *key, loc);
        Ok(())
    }

    /// Drops a reservation (the write failed or was cancelled).
    pub fn abort(&mut self, key: &BlockKey, region: u16) -> Result<(), LocationError> {
        let block = self.index.get(key).ok_or(LocationError::NoReservation)?;
        let reservation = self.reservations.get(&(block, region)).copied().ok_or(LocationError::NoReservation)?;
        self.abort_reservation(reservation);
        Ok(())
    }

    fn abort_reservation(&mut self, reservation: Reservation) {
        self.reservations.remove(&(reservation.block, reservation.region));
        let _ = self.index.remove_replica(reservation.block, reservation.region);
        self.drop_if_empty_leaf(reservation.block);
    }

    /// Drops `block` if it is a leaf without replicas, and then each
    /// ancestor the drop leaves a leaf without replicas (one kept only as
    /// the path to a child that is gone now).
    fn drop_if_empty_leaf(&mut self, block: BlockRef) {
        let mut at = Some(block);
        while let Some(block) = at {
            if !(self.index.is_live(block) && self.index.is_leaf(block) && self.index.replicas(block).next().is_none())
            {
                return;
            }
            at = self.index.parent(block);
            let _ = self.index.remove(block);
        }
    }

    /// Aborts every reservation whose deadline has passed (an abandoned
    /// put). Returns how many.
    pub fn reap_expired(&mut self, now_ns: u64) -> usize {
        let mut reaped = 0;
        while let Some(Reverse((deadline, raw, region))) = self.deadlines.peek().copied() {
            if deadline > now_ns {
                break;
            }
            self.deadlines.pop();
            let key = (BlockRef(raw), region);
            // Only if this entry still names the live reservation.
            if let Some(reservation) = self.reservations.get(&key).copied()
                && reservation.deadline_ns == deadline
            {
                self.abort_reservation(reservation);
                reaped += 1;
            }
        }
        reaped
    }

    /// Records a ready replica no put reserved: one `lake-dp` re-adopted
    /// from its files after a restart, or wrote on its own. The epoch must
    /// be the region's current one. Idempotent: the same replica again
    /// changes nothing; another slot in the same region replaces it.
    #[allow(clippy::too_many_arguments)] // the fields of one replica
    pub fn adopt(
        &mut self,
        parent: Option<BlockKey>,
        key: BlockKey,
        kind: ObjectKind,
        region: u16,
        epoch: u64,
        slot: u32,
        generation: u32,
    ) -> Result<BlockRef, LocationError> {
        let info = self.regions.get(&region).copied().ok_or(LocationError::UnknownRegion)?;
        if epoch != info.epoch {
            return Err(LocationError::StaleEpoch);
        }
        let block = self.index.insert(parent, key, kind)?;
        let old = self.index.replicas(block).find(|l| l.region == region);
        if let Some(old) = old {
            if old.slot == slot && old.generation == generation && old.state == LocState::Ready && self.is_current(&old)
            {
                return Ok(block);
            }
            self.remove(&key, region)?;
            // The block may have gone with its last replica: insert again.
            return self.adopt(parent, key, kind, region, epoch, slot, generation);
        }
        let loc = Loc { region, state: LocState::Ready, epoch_tag: info.tag, slot, generation };
        self.drop_past(block);
        if let Err(e) = self.index.add_replica(block, loc) {
            self.drop_if_empty_leaf(block);
            return Err(e.into());
        }
        self.record(ChangeOp::Ready, key, loc);
        Ok(block)
    }

    /// Drops `block`'s replicas of a past incarnation of their region
    /// (never served again: an epoch only moves on), so they hold no
    /// place a current one needs.
    fn drop_past(&mut self, block: BlockRef) {
        loop {
            let past = self.index.replicas(block).find(|l| !self.is_current(l)).map(|l| l.region);
            let Some(region) = past else { return };
            if self.index.remove_replica(block, region).is_err() {
                return;
            }
            self.reservations.remove(&(block, region));
        }
    }

    /// Where the index holds `key`: under its parent, or as a root
    /// (`Some(None)`); `None` where it holds no such block.
    pub fn parent_of(&self, key: &BlockKey) -> Option<Option<BlockKey>> {
        let block = self.index.get(key)?;
        Some(self.index.parent(block).map(|parent| self.index.key(parent)))
    }

    /// The ready, current replicas of `key` (what a reader may be sent to).
    pub fn ready(&self, key: &BlockKey) -> impl Iterator<Item = Replica> + '_ {
        self.index
            .get(key)
            .into_iter()
            .flat_map(move |block| self.index.replicas(block))
            .filter(move |loc| loc.state == LocState::Ready && self.is_current(loc))
            .filter_map(move |loc| self.replica(loc))
    }

    /// Removes the replica of `key` in `region` (evicted or lost); the
    /// block goes too when it was its last replica and it is a leaf.
    pub fn remove(&mut self, key: &BlockKey, region: u16) -> Result<(), LocationError> {
        let block = self.index.get(key).ok_or(LocationError::Index(IndexError::Unknown))?;
        let loc = self.index.remove_replica(block, region)?;
        if loc.state == LocState::Ready && self.is_current(&loc) {
            self.record(ChangeOp::Removed, *key, loc);
        }
        self.reservations.remove(&(block, region));
        self.drop_if_empty_leaf(block);
        if self.is_withheld(key) && self.ready_copies(key).next().is_none() {
            self.withheld.remove(key);
        }
        Ok(())
    }

    /// Whether `loc` is in L1 or L2: a copy [`Locations::withhold`] may
    /// take out of what the cluster sees.
    fn is_copy(&self, loc: &Loc) -> bool {
        self.regions.get(&loc.region).is_some_and(|info| withholds(info.tier))
    }

    /// `key`'s ready, current L1 and L2 replicas here.
    fn ready_copies(&self, key: &BlockKey) -> impl Iterator<Item = Loc> + '_ {
        self.index
            .get(key)
            .into_iter()
            .flat_map(|block| self.index.replicas(block))
            .filter(|loc| loc.state == LocState::Ready && self.is_current(loc) && self.is_copy(loc))
    }

    /// `key`'s L1 and L2 replicas here are copies of one the pool keeps
    /// on another node, to be dropped: each is recorded removed now, and
    /// until none is left no change of them is recorded and snapshots
    /// leave them out (see [`Locations::offered_all`]). An L3 replica
    /// stays offered. Nothing where none is ready.
    pub fn withhold(&mut self, key: &BlockKey) {
        if self.withheld.contains(key) {
            return;
        }
        let ready: Vec<Loc> = self.ready_copies(key).collect();
        if ready.is_empty() {
            return;
        }
        for loc in ready {
            self.record(ChangeOp::Removed, *key, loc);
        }
        self.withheld.insert(*key);
    }

    /// Whether `key`'s replicas here are withheld ([`Locations::withhold`]).
    pub fn is_withheld(&self, key: &BlockKey) -> bool {
        !self.withheld.is_empty() && self.withheld.contains(key)
    }

    /// The term its changes are numbered in.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// The sequence of the latest change recorded.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Every ready, current replica of every block but the copies
    /// withheld ([`Locations::withhold`]): what the cluster summary is
    /// offered.
    pub fn offered_all(&self) -> impl Iterator<Item = (BlockKey, Replica)> + '_ {
        self.index.blocks().flat_map(move |block| {
            let key = self.index.key(block);
            let withheld = self.is_withheld(&key);
            self.ready(&key)
                .filter(move |replica| !(withheld && withholds(replica.tier)))
                .map(move |replica| (key, replica))
                .collect::<Vec<_>>()
        })
    }

    /// Takes the changes recorded since the last call, in sequence order.
    pub fn drain_changes(&mut self) -> std::vec::Drain<'_, Change> {
        self.changes.drain(..)
    }

    /// Reservations outstanding.
    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }
}

/// Whether a replica in `tier` is a copy [`Locations::withhold`] takes
/// out of what the cluster sees: L1 and L2, not L3 (the store's).
fn withholds(tier: Tier) -> bool {
    matches!(tier, Tier::L1Dram | Tier::L2Nvme)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    fn view() -> Locations {
        let mut view = Locations::new(7);
        view.register_region(1, Tier::L1Dram, NodeId(3), 10).unwrap();
        view.register_region(2, Tier::L2Nvme, NodeId(3), 10).unwrap();
        view
    }

    #[test]
    fn reserve_then_commit_makes_a_ready_replica_and_a_change() {
        let mut v = view();
        v.reserve(None, key(1), ObjectKind::KvBlock, 1, 5, 9, 1_000, 42).unwrap();
        assert_eq!(v.ready(&key(1)).count(), 0, "a writing replica is not served");
        // The same request again: the same reservation; another: refused.
        v.reserve(None, key(1), ObjectKind::KvBlock, 1, 5, 9, 1_000, 42).unwrap();
        assert_eq!(v.reserve(None, key(1), ObjectKind::KvBlock, 1, 6, 9, 1_000, 43), Err(LocationError::Conflict));
        v.commit(&key(1), 1, 10, 9).unwrap();
        let ready: Vec<Replica> = v.ready(&key(1)).collect();
        assert_eq!(ready.len(), 1);
        assert_eq!(
            (ready[0].tier, ready[0].slot, ready[0].generation, ready[0].region_epoch),
            (Tier::L1Dram, 5, 9, 10)
        );
        let changes: Vec<Change> = v.drain_changes().collect();
        assert_eq!(changes.len(), 1);
        assert_eq!((changes[0].term, changes[0].sequence, changes[0].op), (7, 1, ChangeOp::Ready));
        v.remove(&key(1), 1).unwrap();
        assert_eq!(v.drain_changes().map(|c| (c.sequence, c.op)).collect::<Vec<_>>(), vec![(2, ChangeOp::Removed)]);
        assert!(!v.index.contains(&key(1)), "the block went with its last replica");
    }

    #[test]
    fn a_withheld_blocks_replicas_are_recorded_removed_and_left_out_until_the_last_goes() {
        let mut v = view();
        v.adopt(None, key(1), ObjectKind::KvBlock, 1, 10, 4, 9).unwrap();
        v.adopt(None, key(1), ObjectKind::KvBlock, 2, 10, 5, 9).unwrap();
        v.adopt(None, key(2), ObjectKind::KvBlock, 1, 10, 6, 9).unwrap();
        assert_eq!(v.drain_changes().len(), 3);
        v.withhold(&key(1));
        let changes: Vec<_> = v.drain_changes().map(|c| (c.op, c.key, c.replica.slot)).collect();
        assert_eq!(changes, vec![(ChangeOp::Removed, key(1), 4), (ChangeOp::Removed, key(1), 5)]);
        // Still served here; no longer offered.
        assert_eq!(v.ready(&key(1)).count(), 2);
        assert_eq!(v.offered_all().map(|(k, r)| (k, r.slot)).collect::<Vec<_>>(), vec![(key(2), 6)]);
        // Withheld again: nothing more. Its replicas' changes go unrecorded
        // (a new one, a removal), another block's do not.
        v.withhold(&key(1));
        v.adopt(None, key(1), ObjectKind::KvBlock, 1, 10, 7, 1).unwrap();
        v.remove(&key(1), 2).unwrap();
        v.remove(&key(2), 1).unwrap();
        assert_eq!(v.drain_changes().map(|c| (c.op, c.key)).collect::<Vec<_>>(), vec![(ChangeOp::Removed, key(2))]);
        // An L3 replica, the store's, is offered as ever: its own changes
        // recorded, and in snapshots.
        v.register_region(3, Tier::L3Object, NodeId(3), 10).unwrap();
        v.adopt(None, key(1), ObjectKind::KvBlock, 3, 10, 9, 1).unwrap();
        assert_eq!(v.drain_changes().map(|c| (c.op, c.replica.slot)).collect::<Vec<_>>(), vec![(ChangeOp::Ready, 9)]);
        assert_eq!(v.offered_all().map(|(k, r)| (k, r.slot)).collect::<Vec<_>>(), vec![(key(1), 9)]);
        // Its last copy gone, it is forgotten: a new one is offered.
        v.remove(&key(1), 1).unwrap();
        assert!(!v.is_withheld(&key(1)));
        v.remove(&key(1), 3).unwrap();
        assert_eq!(v.drain_changes().map(|c| (c.op, c.replica.slot)).collect::<Vec<_>>(), vec![(ChangeOp::Removed, 9)]);
        v.adopt(None, key(1), ObjectKind::KvBlock, 1, 10, 8, 1).unwrap();
        assert_eq!(v.drain_changes().map(|c| (c.op, c.replica.slot)).collect::<Vec<_>>(), vec![(ChangeOp::Ready, 8)]);
        assert_eq!(v.offered_all().count(), 1);
    }

    #[test]
    fn stale_epochs_and_generations_are_refused() {
        let mut v = view();
        v.reserve(None, key(1), ObjectKind::KvBlock, 2, 5, 9, 1_000, 1).unwrap();
        assert_eq!(v.commit(&key(1), 2, 9, 9), Err(LocationError::StaleEpoch));
        assert_eq!(v.reservations(), 0, "a refused commit drops the reservation");
        assert!(!v.index.contains(&key(1)));
        v.reserve(None, key(1), ObjectKind::KvBlock, 2, 5, 9, 1_000, 2).unwrap();
        assert_eq!(v.commit(&key(1), 2, 10, 8), Err(LocationError::StaleGeneration));
        // A ready replica of a region that restarts is no longer served.
        v.reserve(None, key(2), ObjectKind::KvBlock, 2, 6, 1, 1_000, 3).unwrap();
        v.commit(&key(2), 2, 10, 1).unwrap();
        assert_eq!(v.ready(&key(2)).count(), 1);
        v.register_region(2, Tier::L2Nvme, NodeId(3), 11).unwrap();
        assert_eq!(v.ready(&key(2)).count(), 0);
        assert_eq!(v.register_region(2, Tier::L2Nvme, NodeId(3), 10), Err(LocationError::StaleEpoch));
        // A commit under the old epoch after the restart is refused.
        v.reserve(None, key(3), ObjectKind::KvBlock, 2, 7, 1, 1_000, 4).unwrap();
        assert_eq!(v.commit(&key(3), 2, 10, 1), Err(LocationError::StaleEpoch));
        assert_eq!(v.commit(&key(9), 2, 11, 1), Err(LocationError::NoReservation));
        assert_eq!(v.reserve(None, key(4), ObjectKind::KvBlock, 9, 7, 1, 1_000, 5), Err(LocationError::UnknownRegion));
    }

    #[test]
    fn adopted_replicas_are_ready_at_once_and_stale_epochs_refused() {
        let mut view = view();
        view.adopt(None, key(1), ObjectKind::KvBlock, 2, 10, 4, 9).unwrap();
        view.adopt(Some(key(1)), key(2), ObjectKind::KvBlock, 2, 10, 5, 9).unwrap();
        assert_eq!(view.ready(&key(2)).map(|r| (r.slot, r.generation)).collect::<Vec<_>>(), vec![(5, 9)]);
        // Again: nothing changes; another slot replaces it.
        view.adopt(Some(key(1)), key(2), ObjectKind::KvBlock, 2, 10, 5, 9).unwrap();
        assert_eq!(view.drain_changes().len(), 2);
        view.adopt(Some(key(1)), key(2), ObjectKind::KvBlock, 2, 10, 6, 1).unwrap();
        let changes: Vec<_> = view.drain_changes().map(|c| (c.op, c.replica.slot)).collect();
        assert_eq!(changes, vec![(ChangeOp::Removed, 5), (ChangeOp::Ready, 6)]);
        assert_eq!(view.adopt(None, key(3), ObjectKind::KvBlock, 2, 9, 1, 1), Err(LocationError::StaleEpoch));
        assert_eq!(view.adopt(None, key(3), ObjectKind::KvBlock, 7, 10, 1, 1), Err(LocationError::UnknownRegion));
        assert_eq!(
            view.adopt(Some(key(99)), key(3), ObjectKind::KvBlock, 2, 10, 1, 1),
            Err(LocationError::Index(IndexError::NoParent))
        );
        assert!(!view.index.contains(&key(3)));
    }

    /// Found by the node's simulation restarting its data plane under
    /// `lake-cp`: a block's replicas of the last incarnation (its L1 and
    /// L2 copies, say) are never served again, but they kept the index's
    /// replica slots, so the new incarnation's first copy of the block (an
    /// L3 object found by its catalog scan) was refused: every slot in use.
    #[test]
    fn a_replica_of_a_past_incarnation_gives_its_place_to_a_new_one() {
        let mut view = view();
        view.register_region(3, Tier::L3Object, NodeId(3), 10).unwrap();
        view.adopt(None, key(1), ObjectKind::KvBlock, 1, 10, 4, 9).unwrap();
        view.adopt(None, key(1), ObjectKind::KvBlock, 2, 10, 5, 9).unwrap();
        // The data plane starts again: each region under a new epoch.
        for (region, tier) in [(1, Tier::L1Dram), (2, Tier::L2Nvme), (3, Tier::L3Object)] {
            view.register_region(region, tier, NodeId(3), 11).unwrap();
        }
        assert_eq!(view.ready(&key(1)).count(), 0, "the past incarnation's replicas are not served");
        view.adopt(None, key(1), ObjectKind::KvBlock, 3, 11, 0, 1).unwrap();
        assert_eq!(view.ready(&key(1)).map(|r| r.region.0).collect::<Vec<_>>(), vec![3]);
        // And the L2 copy the new incarnation re-adopted fits beside it.
        view.adopt(None, key(1), ObjectKind::KvBlock, 2, 11, 5, 9).unwrap();
        assert_eq!(view.ready(&key(1)).count(), 2);
    }

    #[test]
    fn abandoned_reservations_are_reclaimed_after_their_deadline() {
        let mut v = view();
        v.reserve(None, key(1), ObjectKind::KvBlock, 1, 1, 1, 500, 1).unwrap();
        v.reserve(Some(key(1)), key(2), ObjectKind::KvBlock, 1, 2, 1, 900, 2).unwrap();
        assert_eq!(v.reap_expired(499), 0);
        // key(1)'s reservation expires, but key(2) (its child) keeps the
        // block in the index.
        assert_eq!(v.reap_expired(500), 1);
        assert!(v.index.contains(&key(1)));
        assert_eq!(v.reap_expired(1_000), 1);
        assert!(!v.index.contains(&key(2)));
        assert_eq!(v.reservations(), 0);
        // A committed reservation's old deadline reaps nothing.
        v.reserve(None, key(5), ObjectKind::KvBlock, 1, 3, 1, 2_000, 3).unwrap();
        v.commit(&key(5), 1, 10, 1).unwrap();
        assert_eq!(v.reap_expired(3_000), 0);
        assert_eq!(v.ready(&key(5)).count(), 1);
        v.abort(&key(5), 1).unwrap_err();
    }
}
