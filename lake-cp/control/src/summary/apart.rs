//! Tenants kept apart across the cluster. Each node that keeps tenants
//! apart says which namespaces, and for which tenant, on its link
//! ([`lake_dp::wire::FEATURE_KEPT_APART`]). A block of a namespace its
//! holder keeps apart is moved only to a node that keeps that namespace
//! apart for the same tenant, and shown in no other node's view: a node
//! that does not keep the tenant apart (or keeps it for another) never
//! files it among the blocks its other engines read. A block of no known
//! namespace, of a holder keeping any apart, goes only to a node keeping
//! exactly the same apart. A node that says nothing keeps nothing apart.
//! What each node keeps apart is in the leader's checkpoint: a leader
//! restored from it holds a node it has not heard since it started (one
//! gone, whose L3 blocks stay in every view) to what that node last said,
//! until it connects and says again.

use std::collections::BTreeMap;

use lake_dp::BlockKey;
use lake_dp::wire::message::{KEPT_APART_MAX, KeptApartEntry, NamedViewEntry, VIEW_TIER_NONE};

use super::{CheckpointError, Summary, u32_at, u64_at, view};

/// What one node keeps apart: each namespace's tenant
/// ([`KeptApartEntry::tenant_of`]).
pub type Apart = BTreeMap<u64, u64>;

/// A node that keeps nothing apart.
static NOTHING: Apart = Apart::new();

/// Whether a block of `namespace` that a node keeping `held` apart holds
/// may go to, or be shown to, a node keeping `to` apart.
pub(super) fn alike(held: &Apart, namespace: u64, to: &Apart) -> bool {
    if held.is_empty() {
        return true;
    }
    if namespace == 0 {
        return held == to;
    }
    match held.get(&namespace) {
        None => true,
        Some(tenant) => to.get(&namespace) == Some(tenant),
    }
}

impl Summary {
    /// Node `node` keeps `entries` apart (none: it keeps nothing apart).
    /// Where that changes, each of its blocks is sent again in the view
    /// (to the nodes it is shown to now, and as gone to the others).
    pub fn kept_apart(&mut self, node: u32, entries: impl IntoIterator<Item = KeptApartEntry>) {
        let apart: Apart = entries.into_iter().map(|e| (e.namespace, e.tenant)).collect();
        if self.apart_of(node) == &apart {
            return;
        }
        if apart.is_empty() {
            self.apart.remove(&node);
        } else {
            self.apart.insert(node, apart);
        }
        if let Some(view) = self.nodes.get(&node) {
            view::resend_all(&mut self.view, node, view);
        }
    }

    /// What node `node` keeps apart, as it said.
    pub fn apart_of(&self, node: u32) -> &Apart {
        self.apart.get(&node).unwrap_or(&NOTHING)
    }

    /// Whether any node keeps anything apart.
    pub(super) fn keeps_any_apart(&self) -> bool {
        !self.apart.is_empty()
    }

    /// Whether node `from`'s copy of `key` may be copied to node `to`.
    pub fn may_move(&self, key: &BlockKey, from: u32, to: u32) -> bool {
        let held = self.apart_of(from);
        if held.is_empty() {
            return true;
        }
        let namespace = self
            .nodes
            .get(&from)
            .and_then(|view| view.replicas.get(key))
            .and_then(|replicas| replicas.first())
            .map_or(0, |held| held.entry.namespace);
        alike(held, namespace, self.apart_of(to))
    }

    /// The nodes keeping any namespace apart otherwise than node `node`,
    /// for an operator: each keeps one of them apart for another tenant,
    /// or not at all (their blocks of it do not pass between them).
    pub fn unlike(&self, node: u32) -> Vec<u32> {
        let mine = self.apart_of(node);
        let mut out: Vec<u32> = self
            .nodes
            .keys()
            .chain(self.apart.keys())
            .copied()
            .filter(|&other| other != node && self.apart_of(other) != mine)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// `entries` of node `holder`'s blocks as a node keeping `to` apart
    /// is to see them: each it may not see as gone.
    pub(super) fn shown<'e>(
        &self,
        holder: u32,
        entries: &'e [NamedViewEntry],
        to: &Apart,
    ) -> std::borrow::Cow<'e, [NamedViewEntry]> {
        let held = self.apart_of(holder);
        if held.is_empty() || entries.iter().all(|e| alike(held, e.namespace, to)) {
            return std::borrow::Cow::Borrowed(entries);
        }
        let hide = |e: &NamedViewEntry| {
            if alike(held, e.namespace, to) { *e } else { NamedViewEntry { tier: VIEW_TIER_NONE, ..*e } }
        };
        std::borrow::Cow::Owned(entries.iter().map(hide).collect())
    }

    /// What each node keeps apart, as a checkpoint's last section: the
    /// nodes u32, then each (in id order) its id u32, its count u32 and
    /// that many (namespace u64, tenant u64) in namespace order. Nothing
    /// where no node keeps anything apart (a checkpoint of version 1).
    pub(super) fn write_apart(&self, out: &mut Vec<u8>) {
        if self.apart.is_empty() {
            return;
        }
        let mut nodes: Vec<(&u32, &Apart)> = self.apart.iter().collect();
        nodes.sort_unstable_by_key(|&(node, _)| *node);
        out.extend_from_slice(&u32::try_from(nodes.len()).unwrap_or(u32::MAX).to_le_bytes());
        for (node, apart) in nodes {
            out.extend_from_slice(&node.to_le_bytes());
            out.extend_from_slice(&u32::try_from(apart.len()).unwrap_or(u32::MAX).to_le_bytes());
            for (namespace, tenant) in apart {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&tenant.to_le_bytes());
            }
        }
    }

    /// Reads back what [`Summary::write_apart`] wrote, through `take` (the
    /// checkpoint's next `n` bytes). A node twice, none kept apart, over
    /// [`KEPT_APART_MAX`], a namespace or tenant 0 or out of order: refused
    /// by name.
    pub(super) fn read_apart<'a>(
        &mut self,
        take: &mut impl FnMut(usize) -> Result<&'a [u8], CheckpointError>,
    ) -> Result<(), CheckpointError> {
        let nodes = u32_at(take(4)?);
        if nodes == 0 {
            return Err(CheckpointError::Field("apart.nodes (none)"));
        }
        let mut last_node = None;
        for _ in 0..nodes {
            let node = u32_at(take(4)?);
            if last_node.is_some_and(|last| node <= last) {
                return Err(CheckpointError::Field("apart.node (out of order, or twice)"));
            }
            last_node = Some(node);
            let count = u32_at(take(4)?) as usize;
            if count == 0 || count > KEPT_APART_MAX {
                return Err(CheckpointError::Field("apart.count"));
            }
            let mut apart = Apart::new();
            for record in take(count * 16)?.chunks_exact(16) {
                let (namespace, tenant) = (u64_at(&record[..8]), u64_at(&record[8..]));
                if namespace == 0 || tenant == 0 || apart.last_key_value().is_some_and(|(&last, _)| namespace <= last) {
                    return Err(CheckpointError::Field("apart.entry"));
                }
                apart.insert(namespace, tenant);
            }
            self.apart.insert(node, apart);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use lake_dp::BlockKey;
    use lake_dp::wire::message::KeptApartEntry;

    use super::super::tests::{key, report, view};
    use super::super::{CheckpointError, Summary};

    #[test]
    fn a_restored_leader_keeps_a_gone_nodes_tenant_blocks_from_nodes_not_keeping_them_apart() {
        const ACME: u64 = 0xa1;
        const OTHER: u64 = 0x0b;
        let acme = KeptApartEntry { namespace: ACME, tenant: KeptApartEntry::tenant_of("acme") };
        // Node 1 keeps acme apart and holds an acme block and a pool block in
        // L3 (the store's: they stay in the summary once it is gone); node 2
        // keeps nothing apart.
        let mut summary = Summary::new();
        let mut one = view(1, 1);
        for (i, namespace) in [(1u8, ACME), (2, OTHER)] {
            let at = one.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, 9, 5, u32::from(i), 1).unwrap();
            one.index.set_namespace(at, namespace);
        }
        report(&mut summary, 1, &mut one);
        summary.kept_apart(1, [acme]);
        summary.kept_apart(2, []);
        let shown_to_two = |summary: &Summary| -> Vec<BlockKey> {
            summary.view_entries(summary.apart_of(2)).into_iter().flat_map(|(_, e)| e).map(|e| e.key).collect()
        };
        assert_eq!(shown_to_two(&summary), [key(2)]);

        // The leader dies; node 1 is gone too. A new leader starts from the
        // checkpoint: node 1 keeps acme apart as it last said.
        let bytes = summary.checkpoint(7);
        let (back, _) = Summary::restore(&bytes).unwrap();
        assert_eq!(back.apart_of(1), summary.apart_of(1));
        assert_eq!(shown_to_two(&back), [key(2)], "acme's block, shown to a node not keeping acme apart");
        assert!(!back.may_move(&key(1), 1, 2) && back.may_move(&key(2), 1, 2));
        assert_eq!(back.checkpoint(7), bytes, "the same summary writes the same bytes");

        // With nothing kept apart it is the version older builds read.
        let mut plain = Summary::restore(&bytes).unwrap().0;
        plain.kept_apart(1, []);
        assert_eq!(plain.checkpoint(7)[8..12], 1u32.to_le_bytes());
        assert_eq!(bytes[8..12], 2u32.to_le_bytes());
        // A tenant of 0, its CRC made good: refused by name.
        let mut zero = bytes.clone();
        let crc_at = zero.len() - 4;
        zero[crc_at - 8..crc_at].fill(0);
        let crc = crc32fast::hash(&zero[..crc_at]);
        zero[crc_at..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Summary::restore(&zero).unwrap_err(), CheckpointError::Field("apart.entry"));
    }
}
