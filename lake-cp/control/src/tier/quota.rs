//! Namespaces and tenants: byte counts per tier, purges of a namespace's
//! every replica, and the usage an operator reads.

use super::*;

impl Tiers {
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

    /// Namespaces being purged.
    pub fn purging(&self) -> &[u64] {
        &self.purging
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
    pub(super) fn plan_purges(
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
}
