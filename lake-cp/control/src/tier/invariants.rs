//! The tier manager's invariants over its whole state, asserted by the
//! simulation after every pass and by the unit tests (each walks every
//! command in flight, mark and byte count: too dear for every report).

use super::*;

impl Tiers {
    /// Panics, naming the block or region, where the manager's bookkeeping
    /// disagrees with itself: a command looked up but not pending, one on
    /// a region never registered, a mark not queued or its block still a
    /// candidate in its cache, bytes counted on a region that holds no
    /// block.
    pub fn assert_invariants(&self) {
        for (&(key, region), request) in &self.pending_of {
            let pending = self.pending.get(request);
            assert!(
                pending.is_some_and(|p| p.key == key && p.region == region),
                "{key:?} in region {region}: request {request} is looked up but pending as {pending:?}"
            );
        }
        for (&request, pending) in &self.pending {
            assert!(request < self.next_request, "request {request} pending but never asked: {pending:?}");
            assert!(self.regions.contains_key(&pending.region), "request {request} on an unknown region: {pending:?}");
        }
        let queued: HashSet<&BlockKey> = self.mark_order.iter().collect();
        for (key, marked) in &self.marked {
            let region = marked.replica.region.0;
            assert!(queued.contains(key), "{key:?} is marked in region {region} but not queued to be evicted");
            assert!(
                self.regions.get(&region).is_some_and(|r| r.tier == Tier::L1Dram),
                "{key:?} is marked in region {region}, which is not a registered L1 region"
            );
            let space = self.spaces.get(&(Tier::L1Dram, marked.namespace));
            assert!(
                space.is_none_or(|s| !s.cache.index.contains(key)),
                "{key:?} is marked in region {region} and still a candidate in its L1 cache"
            );
        }
        for (&(region, namespace), &bytes) in &self.used {
            assert!(
                self.regions.contains_key(&region),
                "{bytes} bytes of namespace {namespace} in unknown region {region}"
            );
            assert!(
                bytes == 0 || self.blocks.get(&region).is_some_and(|&b| b > 0),
                "{bytes} bytes of namespace {namespace} counted in region {region}, which holds no block"
            );
        }
    }
}
