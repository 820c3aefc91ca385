//! Saves: an L1 slot found (free, or taken from a cold victim), the
//! commit checked and published, reservations not committed taken back,
//! and victims marked evictable for the control plane.

use super::{
    Closing, L1State, Pool, RESERVATION_TIMEOUT_NS, SAVE_PRESSURE_NS, Unverified, VICTIMS_PER_TAKE, Victim,
    check_object,
};
use crate::agent::port::{AgentError, CrcOrigin};
use crate::arena::SlotTable;
use crate::constants::STORED_HEADER_BYTES;
use crate::io::IoBackend;
use crate::model::key::BlockKey;
use crate::model::replica::{ReplicaWire, Tier};
use crate::runner::Parts;
use crate::stored::{ObjectMeta, Seal, decode_header};
use crate::wire::message::{BlockEvicted, ErrorCode, EvictReason};

impl Pool {
    /// Seals, in place, the payload of the stored object in `object`
    /// (header first) with its tenant's data key: `None` where the tenant
    /// has none; `Unauthorized` where it cannot be sealed (no random salt,
    /// or no slot), and then it is not written at all: never in the clear.
    pub(super) fn seal_in_place(
        &mut self,
        meta: &ObjectMeta,
        object: Option<&mut [u8]>,
    ) -> Result<Option<Seal>, ErrorCode> {
        let Some(key) = self.keys.get(meta.namespace) else { return Ok(None) };
        let payload_len = usize::try_from(meta.payload_len).unwrap_or(usize::MAX);
        let payload = object.and_then(|b| b.get_mut(STORED_HEADER_BYTES..)).and_then(|p| p.get_mut(..payload_len));
        let sealed = payload.map(|p| crate::auth::at_rest::seal(key, meta, p));
        let seal = sealed.and_then(Result::ok).ok_or(ErrorCode::Unauthorized)?;
        self.stats.sealed += 1;
        Ok(Some(seal))
    }

    /// The control plane marks the L1 block `replica` evictable (or takes
    /// the mark back). A mark that no longer names the block there (moved,
    /// freed, another generation) is ignored.
    pub(super) fn mark<B: IoBackend>(&mut self, replica: &BlockEvicted, evictable: bool, parts: &mut Parts<'_, B>) {
        let wire = &replica.replica;
        if wire.tier != Tier::L1Dram as u8
            || wire.region != self.l1_region
            || wire.region_epoch != self.epoch
            || wire.node != self.node
        {
            return;
        }
        let slot = wire.slot as usize;
        if self.l1.get(slot) != Some(&L1State::Ready)
            || parts.table.arena().generation(wire.slot) != Some(wire.generation)
        {
            return;
        }
        if !evictable {
            self.marked[slot] = None;
            return;
        }
        self.victims_left = true;
        if self.marked[slot].is_some_and(|(generation, _)| generation == wire.generation) {
            return;
        }
        if self.evictable.len() == self.evictable.capacity() {
            // Stale entries out first; still full (every slot marked
            // twice over cannot be): the mark is dropped.
            let marked = &self.marked;
            self.evictable.retain(|v| marked[v.slot as usize].is_some_and(|(g, _)| g == v.generation));
            if self.evictable.len() == self.evictable.capacity() {
                return;
            }
        }
        self.marked[slot] = Some((wire.generation, replica.reason));
        self.evictable.push_back(Victim { slot: wire.slot, generation: wire.generation, key: replica.key });
    }

    /// Whether the pool refuses saves now: it is closing, or it refused
    /// one for want of room within [`SAVE_PRESSURE_NS`]. Agents read it
    /// (shared memory, no request) and skip a whole save rather than have
    /// it refused part way.
    pub fn save_pressure(&self, now_ns: u64) -> bool {
        self.closing != Closing::Open
            || self.refused_at_ns.is_some_and(|at| now_ns.saturating_sub(at) < SAVE_PRESSURE_NS)
    }

    /// A free L1 slot of partition `partition` for an object of
    /// `object_bytes` (leaving `keep` of its class free), else one a marked
    /// victim there gave up.
    pub(super) fn slot_or_victim<B: IoBackend>(
        &mut self,
        partition: usize,
        object_bytes: u64,
        keep: usize,
        parts: &mut Parts<'_, B>,
    ) -> Option<crate::arena::SlotGrant> {
        let class = parts.table.class_in(partition, object_bytes)?;
        if let Some(grant) = self.allocate_l1(parts.table, class, keep) {
            return Some(grant);
        }
        if self.take_victims(class, parts) == 0 {
            return None;
        }
        self.allocate_l1(parts.table, class, keep)
    }

    /// A save found no free L1 slot of size class `class` (of one
    /// partition): takes up to [`VICTIMS_PER_TAKE`] of the marked victims
    /// of that class, in the control plane's order (each still there,
    /// ready, and its mark current), frees those no reader pins, and
    /// reports each as evicted. Returns how many were taken.
    pub(super) fn take_victims<B: IoBackend>(&mut self, class: usize, parts: &mut Parts<'_, B>) -> usize {
        let reserve = self.load_reserve_slots as usize;
        if parts.table.evacuating().is_some() || parts.table.chunk_to_evacuate(class, reserve).is_some() {
            // Another class's chunk can be emptied for it by moving blocks
            // (the rebalance does it): nothing need leave L1.
            self.short_class = Some(class);
            return 0;
        }
        let mut taken = 0;
        let mut looked = 0;
        let queued = self.evictable.len();
        while taken < VICTIMS_PER_TAKE && looked < queued {
            let Some(victim) = self.evictable.pop_front() else { break };
            looked += 1;
            let slot = victim.slot as usize;
            let Some((generation, reason)) = self.marked[slot].filter(|(g, _)| *g == victim.generation) else {
                continue;
            };
            if self.l1[slot] != L1State::Ready || parts.table.arena().generation(victim.slot) != Some(generation) {
                self.marked[slot] = None;
                continue;
            }
            if parts.table.class_of_slot(victim.slot) != Some(class) {
                // Another size class's: it stays marked, at the back.
                self.evictable.push_back(victim);
                continue;
            }
            self.marked[slot] = None;
            let replica = self.l1_replica(victim.slot, generation);
            self.release_l1(victim.slot, parts.table);
            if reason == EvictReason::Demoted as u8 {
                self.stats.victims_clean += 1;
            } else {
                self.stats.victims_dropped += 1;
            }
            if let Some(cp) = parts.link.as_mut() {
                cp.evicted(&BlockEvicted { replica, key: victim.key, reason, reserved: [0; 7] });
            }
            taken += 1;
        }
        if taken > 0 {
            // Unpinned ones free now; a pinned one when its reader lets go.
            parts.table.reclaim();
        }
        taken
    }

    /// A copy of an L1 block to another node's L1 (replication, or a
    /// node's write-back elsewhere): the slot is held (no eviction or
    /// demotion while it is read) and the send handed to the runner's
    /// transport ([`Pool::take_sends`]).
    /// The header of the committed L1 block `source` names, if it still
    /// holds `key`: this epoch's L1, the slot `Ready` (or, where
    /// `sending` says, read by sends), at the generation named.
    pub(super) fn committed_l1<B: IoBackend>(
        &self,
        source: &ReplicaWire,
        key: &BlockKey,
        sending: bool,
        parts: &Parts<'_, B>,
    ) -> Result<ObjectMeta, ErrorCode> {
        if source.region_epoch != self.epoch || source.node != self.node || source.region != self.l1_region {
            return Err(ErrorCode::StaleEpoch);
        }
        let slot = source.slot;
        let committed = match self.l1.get(slot as usize) {
            Some(L1State::Ready) => true,
            Some(L1State::Sending { .. }) => sending,
            _ => false,
        };
        if !committed || parts.table.arena().generation(slot) != Some(source.generation) {
            return Err(ErrorCode::StaleGeneration);
        }
        // SAFETY: a ready (or sending) slot is not written until it is
        // retired, which this thread alone does, and not in this call.
        let bytes = unsafe { parts.region.slot(slot) }.ok_or(ErrorCode::NoSuchBlock)?;
        let meta = *decode_header(bytes).map_err(|_| ErrorCode::Checksum)?.meta();
        if meta.key != *key {
            return Err(ErrorCode::NoSuchBlock);
        }
        Ok(meta)
    }

    pub(super) fn release_l1(&mut self, slot: u32, table: &mut SlotTable) {
        if let Some(state) = self.l1.get_mut(slot as usize) {
            assert!(*state != L1State::Free, "L1 slot {slot} released twice");
            if matches!(state, L1State::Reserved { .. }) {
                self.reserved = self.reserved.saturating_sub(1);
            }
            *state = L1State::Free;
        }
        let _ = table.retire(slot);
    }

    pub(super) fn commit<B: IoBackend>(
        &mut self,
        agent: u16,
        (slot, generation): (u32, u32),
        crcs: CrcOrigin,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        let table = &mut *parts.table;
        match self.l1.get(slot as usize) {
            Some(L1State::Reserved { agent: owner, .. })
                if *owner == agent && table.arena().generation(slot) == Some(generation) => {}
            _ => return Err(AgentError::Stale),
        }
        // SAFETY: the slot is reserved to this agent, which has finished
        // writing it (it committed); nobody else writes a reserved slot.
        let bytes = unsafe { parts.region.slot(slot) }.ok_or(AgentError::Invalid)?;
        // The header must name this very slot, generation and epoch: an
        // object copied from elsewhere, or written for an old reservation,
        // is not published.
        let first = self.commit_check.publishes_first(crcs);
        let checked = check_object(bytes, !first).ok().filter(|meta| {
            meta.region.0 == self.l1_region
                && meta.slot == slot
                && meta.generation == generation
                && meta.region_epoch == self.epoch
        });
        let meta = match checked {
            Some(meta) => meta,
            None => {
                self.stats.commits_corrupt += 1;
                self.release_l1(slot, table);
                return Err(AgentError::Corrupt);
            }
        };
        if !self.in_its_partition(meta.namespace.0, slot, table) {
            // Another partition's namespace, saved by an engine that does
            // not map that partition: not published where that tenant's
            // engines would be handed it.
            self.stats.commits_foreign += 1;
            self.release_l1(slot, table);
            return Err(AgentError::Invalid);
        }
        let slot_bytes = bytes.len() as u64;
        if !self.admits(meta.namespace.0, slot_bytes, table) {
            // Refused for its own namespace's quota: no save pressure for
            // anyone else (unlike a full L1).
            self.stats.saves_refused += 1;
            self.stats.saves_refused_quota += 1;
            self.release_l1(slot, table);
            return Err(AgentError::OverQuota);
        }
        self.reserved = self.reserved.saturating_sub(1);
        self.l1[slot as usize] = L1State::Ready;
        self.charge(slot, generation, meta.namespace.0, slot_bytes);
        self.stats.saves += 1;
        if first && self.commit_check.reads_later() && self.unverified.len() < self.l1.len() {
            self.unverified.push_back(Unverified { slot, generation, next_segment: 0 });
        }
        if let Some(cp) = parts.link {
            cp.committed(&self.l1_record(slot, generation, &meta));
        }
        Ok(())
    }

    /// Installs the L1 quotas held at each commit.
    pub fn set_quotas(&mut self, quotas: crate::quota::L1Quotas) {
        self.quotas = quotas;
    }

    /// Each L1 quota's name and figures, after giving back what retired
    /// slots held.
    pub fn quota_usage(&mut self, table: &mut SlotTable) -> impl Iterator<Item = (&str, crate::quota::QuotaUsage)> {
        self.settle_quotas(table);
        self.quotas.usage()
    }

    /// Whether a block of `namespace` in a slot of `slot_bytes` fits under
    /// its quotas, what retired slots held given back first.
    pub(super) fn admits(&mut self, namespace: u64, slot_bytes: u64, table: &mut SlotTable) -> bool {
        if self.quotas.is_empty() {
            return true;
        }
        self.settle_quotas(table);
        self.quotas.admits(namespace, slot_bytes).is_ok()
    }

    /// Charges the block just published in L1 `slot` (`slot_bytes` big) to
    /// its namespace's quotas.
    pub(super) fn charge(&mut self, slot: u32, generation: u32, namespace: u64, slot_bytes: u64) {
        if !self.quotas.is_empty() {
            self.quotas.charge(slot, generation, namespace, slot_bytes);
        }
    }

    /// Gives back to the quotas what the slots retired since the last call
    /// held.
    fn settle_quotas(&mut self, table: &mut SlotTable) {
        let quotas = &mut self.quotas;
        // The table records what it retires from the first call on; what
        // it retired before is found by a sweep.
        let followed = table.follows_retired();
        if !followed {
            table.follow_retired();
        }
        if !table.take_retired(|slot, now| quotas.retired(slot, Some(now))) || !followed {
            quotas.sweep(|slot| table.generation_of(slot));
        }
    }

    pub(super) fn expire_reservations(&mut self, table: &mut SlotTable, now_ns: u64) {
        for slot in 0..self.l1.len() {
            if let L1State::Reserved { since_ns, .. } = self.l1[slot]
                && now_ns.saturating_sub(since_ns) > RESERVATION_TIMEOUT_NS
            {
                self.stats.reservations_expired += 1;
                self.release_l1(u32::try_from(slot).unwrap_or(u32::MAX), table);
            }
        }
    }
}
