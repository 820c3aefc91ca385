//! Copies to L3: eager write-back of every block saved, and the
//! operator's persist of the blocks held in L1 only.

use super::*;

impl Tiers {
    /// The L3 region of `node` as a target (the data plane picks the
    /// catalog entry), if it has an object store.
    pub(super) fn l3_target(&self, node: u32) -> Option<ReplicaWire> {
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
    pub(super) fn plan_write_backs(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
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
    pub(super) fn plan_persist(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
        // Each write-back stages its block in a free L1 slot: a few at a
        // time, so they do not take the slots saves and loads need, and
        // none while L1 is over its mark and its evictions make room (its
        // victims moved to L2, not dropped). A block being written is no
        // victim: a write asked into a full L1 would be refused for want
        // of a slot and asked again, pass after pass, while the eviction
        // that would free one waits on it. (Where victims would be
        // dropped, marks make room, and a write stages in a marked slot.)
        if self.l1_over_high() && !self.l1_victims_dropped() {
            return;
        }
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
}
