//! What the node publishes in its mirrors, and the engines it wakes.

use lake_dp::mirror::MirrorEntry;
use lake_dp::{BlockKey, ObjectKind, Replica};

use super::Node;

impl Node {
    /// Republishes `key` in the mirror: its fastest ready replica and every
    /// tier holding one, or nothing if none is ready.
    pub(super) fn publish(&mut self, key: &BlockKey) {
        let tenant = self.tenant_of.get(key).copied();
        let mirror = match tenant {
            Some(tenant) => self.tenant_mirrors.get_mut(tenant).map(|(_, mirror)| mirror),
            None => self.mirror.as_mut(),
        };
        let Some(mirror) = mirror else { return };
        let ready: Vec<Replica> = self.locations.ready(key).collect();
        let Some(best) = ready.iter().min_by_key(|r| r.tier as u8) else {
            mirror.remove(key);
            self.tenant_of.remove(key);
            return;
        };
        let tiers = ready.iter().fold(0u8, |bits, r| bits | 1 << (r.tier as u8));
        let kind = self.locations.index.get(key).map_or(ObjectKind::KvBlock, |b| self.locations.index.kind(b));
        let epoch_tag = self.locations.region(best.region.0).map_or(0, |info| info.epoch_tag());
        let entry = MirrorEntry {
            kind,
            tier: best.tier,
            tiers,
            region: best.region,
            epoch_tag,
            slot: best.slot,
            generation: best.generation,
        };
        if mirror.upsert(key, &entry).is_err() {
            self.counters.mirror_skipped += 1;
        }
    }

    /// Wakes the engines waiting for blocks to be published (a pass's
    /// batch: [`lake_dp::mirror::MirrorWriter::wake_readers`]).
    pub fn wake_readers(&mut self) {
        let tenants = self.tenant_mirrors.iter_mut().map(|(_, mirror)| mirror);
        for mirror in self.mirror.iter_mut().chain(tenants) {
            mirror.wake_readers();
        }
    }
}
