//! A node's reports to the summary's leader: its location view's
//! numbered changes as deltas, and its whole view as a snapshot, in wire
//! records.

use lake_dp::constants::DELTA_ENTRIES_MAX;
use lake_dp::wire::message::{Delta, DeltaEntry, DeltaOp};
use lake_dp::{BlockKey, Durability, ObjectKind, Replica, Tier};

use crate::location::{Change, ChangeOp, Locations};

/// The wire record of `replica` of `key`, as `locations` knows the block.
pub fn entry_of(locations: &Locations, key: &BlockKey, replica: &Replica, op: DeltaOp) -> DeltaEntry {
    let block = locations.index.get(key);
    let parent = block.and_then(|b| locations.index.parent(b)).map_or(BlockKey::NONE, |p| locations.index.key(p));
    let kind = block.map_or(ObjectKind::KvBlock, |b| locations.index.kind(b));
    let durability = match replica.tier {
        Tier::L0Hbm | Tier::L1Dram => Durability::Volatile,
        Tier::L2Nvme => Durability::Acked,
        Tier::L3Object => Durability::Durable,
    };
    DeltaEntry {
        op: op as u8,
        durability: durability as u8,
        kind: kind as u16,
        block_index: 0,
        key: *key,
        parent_key: parent,
        namespace: block.map_or(0, |b| locations.index.namespace(b)),
        layout_fingerprint: 0,
        replica: replica.to_wire(),
    }
}

/// The deltas of `changes` (in sequence order) for `node`: runs of
/// consecutive sequences of one term, at most [`DELTA_ENTRIES_MAX`] each.
pub fn deltas(node: u32, locations: &Locations, changes: &[Change]) -> Vec<(Delta, Vec<DeltaEntry>)> {
    let mut out: Vec<(Delta, Vec<DeltaEntry>)> = Vec::new();
    for change in changes {
        let op = match change.op {
            ChangeOp::Ready => DeltaOp::Add,
            ChangeOp::Removed => DeltaOp::Remove,
        };
        let entry = entry_of(locations, &change.key, &change.replica, op);
        match out.last_mut() {
            Some((head, entries))
                if head.term == change.term
                    && head.sequence + u64::from(head.count) == change.sequence
                    && entries.len() < DELTA_ENTRIES_MAX =>
            {
                entries.push(entry);
                head.count += 1;
            }
            _ => out.push((Delta { term: change.term, sequence: change.sequence, node, count: 1 }, vec![entry])),
        }
    }
    out
}

/// `node`'s whole view as snapshot frames: every ready replica it offers
/// the cluster, at the view's latest sequence.
pub fn snapshot(node: u32, locations: &Locations) -> Vec<(Delta, Vec<DeltaEntry>)> {
    let entries: Vec<DeltaEntry> =
        locations.offered_all().map(|(key, replica)| entry_of(locations, &key, &replica, DeltaOp::Add)).collect();
    let head = |count: usize| Delta {
        term: locations.term(),
        sequence: locations.sequence(),
        node,
        count: u32::try_from(count).unwrap_or(u32::MAX),
    };
    if entries.is_empty() {
        return vec![(head(0), Vec::new())];
    }
    entries.chunks(DELTA_ENTRIES_MAX).map(|chunk| (head(chunk.len()), chunk.to_vec())).collect()
}
