//! Leases: what lets a reader use a replica it did not pin — a block on
//! a lower tier (L2) or on another node — without it being evicted under
//! the read. `lake-cp` grants them; pins (DESIGN §3) cover L1 reads.
//!
//! - A lease names, for the leading keys of a request that have a ready
//!   replica, the replica held for the reader, until a deadline.
//! - Idempotent per request: the same peer asking again with the same
//!   request id gets the same lease back (a retried request after a lost
//!   reply never holds twice).
//! - While a lease holds a replica, the control plane's own eviction
//!   passes it over ([`Leases::is_held`]). A read that has started is
//!   never failed by the control plane; if the data plane loses the bytes
//!   anyway (a crash, a disk error), the reader's checks — generation,
//!   CRCs — fail the read cleanly and it recomputes.
//! - Leases end when released, when their deadline passes
//!   ([`Leases::reap`]), or when their peer disconnects.

use std::collections::{BTreeMap, HashMap};

use lake_dp::{BlockKey, Replica};

/// Longest lease granted, whatever is asked (ms).
pub const TTL_MAX_MS: u32 = 60_000;

/// A granted lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: u64,
    /// Wall-clock expiry (Unix ns).
    pub deadline_ns: u64,
    /// The replicas held, key by key (the leading keys that have one).
    pub entries: Vec<(BlockKey, Replica)>,
    peer: u64,
    request: u64,
}

/// The lease table.
#[derive(Debug, Default)]
pub struct Leases {
    leases: HashMap<u64, Lease>,
    by_request: HashMap<(u64, u64), u64>,
    /// (deadline, lease id), for reaping in deadline order.
    deadlines: BTreeMap<(u64, u64), ()>,
    /// Replicas held: (key, region) → how many leases hold it.
    held: HashMap<(BlockKey, u16), u32>,
    next_id: u64,
    /// Leases granted in all.
    pub granted: u64,
    /// Leases that ended at their deadline.
    pub expired: u64,
}

impl Leases {
    /// An empty table.
    pub fn new() -> Self {
        Self { next_id: 1, ..Self::default() }
    }

    /// Leases held now.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Grants (or, for a request already granted, returns again) a lease
    /// to `peer` for `request`: `replica_of` names the replica held for
    /// each key, and the lease covers keys up to the first without one.
    pub fn grant(
        &mut self,
        peer: u64,
        request: u64,
        keys: impl IntoIterator<Item = BlockKey>,
        mut replica_of: impl FnMut(&BlockKey) -> Option<Replica>,
        ttl_ms: u32,
        now_ns: u64,
    ) -> &Lease {
        if let Some(&id) = self.by_request.get(&(peer, request))
            && self.leases.contains_key(&id)
        {
            return &self.leases[&id];
        }
        let mut entries = Vec::new();
        for key in keys {
            let Some(replica) = replica_of(&key) else { break };
            entries.push((key, replica));
        }
        let id = self.next_id;
        self.next_id += 1;
        let deadline_ns = now_ns.saturating_add(u64::from(ttl_ms.min(TTL_MAX_MS)) * 1_000_000);
        for (key, replica) in &entries {
            *self.held.entry((*key, replica.region.0)).or_default() += 1;
        }
        self.by_request.insert((peer, request), id);
        self.deadlines.insert((deadline_ns, id), ());
        self.granted += 1;
        self.leases.entry(id).or_insert(Lease { id, deadline_ns, entries, peer, request })
    }

    /// Whether a lease holds `key`'s replica in `region`.
    pub fn is_held(&self, key: &BlockKey, region: u16) -> bool {
        self.held.contains_key(&(*key, region))
    }

    /// The leases holding a replica of `key`: id, region, deadline (Unix
    /// ns), by id. Walks every lease (for the operator, not the data path).
    pub fn holding(&self, key: &BlockKey) -> Vec<(u64, u16, u64)> {
        let mut out: Vec<(u64, u16, u64)> = self
            .leases
            .values()
            .flat_map(|l| {
                l.entries.iter().filter(|(k, _)| k == key).map(move |(_, r)| (l.id, r.region.0, l.deadline_ns))
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Gives a lease back. Returns whether it was held.
    pub fn release(&mut self, id: u64) -> bool {
        let Some(lease) = self.leases.remove(&id) else { return false };
        self.forget(&lease);
        true
    }

    /// Ends every lease of `peer` (it disconnected).
    pub fn release_peer(&mut self, peer: u64) -> usize {
        let ids: Vec<u64> = self.leases.values().filter(|l| l.peer == peer).map(|l| l.id).collect();
        for id in &ids {
            self.release(*id);
        }
        ids.len()
    }

    /// Ends every lease whose deadline is at or before `now_ns`. Returns
    /// how many.
    pub fn reap(&mut self, now_ns: u64) -> usize {
        let due: Vec<(u64, u64)> = self.deadlines.range(..=(now_ns, u64::MAX)).map(|(&k, ())| k).collect();
        let mut ended = 0;
        for (_, id) in due {
            if self.release(id) {
                ended += 1;
            }
        }
        self.expired += ended as u64;
        ended
    }

    fn forget(&mut self, lease: &Lease) {
        self.deadlines.remove(&(lease.deadline_ns, lease.id));
        self.by_request.remove(&(lease.peer, lease.request));
        for (key, replica) in &lease.entries {
            let slot = (*key, replica.region.0);
            if let Some(count) = self.held.get_mut(&slot) {
                *count -= 1;
                if *count == 0 {
                    self.held.remove(&slot);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lake_dp::{NodeId, RegionId, Tier};

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    fn replica(slot: u32) -> Option<Replica> {
        Some(Replica { tier: Tier::L2Nvme, node: NodeId(0), region: RegionId(2), region_epoch: 1, slot, generation: 1 })
    }

    #[test]
    fn a_lease_holds_the_leading_keys_until_released_or_due() {
        let mut leases = Leases::new();
        // Keys 1, 2 have replicas, 3 not: 4 is past the gap.
        let lookup = |k: &BlockKey| if k.0[0] <= 2 || k.0[0] == 4 { replica(u32::from(k.0[0])) } else { None };
        let lease = leases.grant(7, 100, [key(1), key(2), key(3), key(4)], lookup, 1000, 5_000_000_000).clone();
        assert_eq!(lease.entries.len(), 2);
        assert_eq!(lease.deadline_ns, 6_000_000_000);
        assert!(leases.is_held(&key(2), 2) && !leases.is_held(&key(4), 2));
        // The same request again: the same lease, nothing held twice.
        let again = leases.grant(7, 100, [key(1)], lookup, 1000, 5_500_000_000).clone();
        assert_eq!(again, lease);
        assert_eq!(leases.granted, 1);
        // Another request holds key 1 too: released once, still held.
        let other = leases.grant(8, 100, [key(1)], lookup, 50_000, 5_000_000_000).id;
        assert!(leases.release(lease.id));
        assert!(!leases.release(lease.id));
        assert!(leases.is_held(&key(1), 2) && !leases.is_held(&key(2), 2));
        // Due: reaped.
        assert_eq!(leases.reap(5_000_000_000 + 50_000 * 1_000_000 - 1), 0);
        assert_eq!(leases.reap(5_000_000_000 + 50_000 * 1_000_000), 1);
        assert!(!leases.is_held(&key(1), 2));
        assert_eq!((leases.len(), leases.expired), (0, 1));
        // A request id reused after its lease ended gets a new lease.
        let renewed = leases.grant(8, 100, [key(1)], lookup, 10, 0).id;
        assert_ne!(renewed, other);
        // Ttl is capped; a peer's leases end with it.
        let long = leases.grant(9, 1, [key(2)], lookup, u32::MAX, 0).deadline_ns;
        assert_eq!(long, u64::from(TTL_MAX_MS) * 1_000_000);
        assert_eq!(leases.release_peer(9), 1);
        assert!(!leases.is_held(&key(2), 2));
    }
}
