//! Tenants kept apart across the cluster. Each node that keeps tenants
//! apart says which namespaces, and for which tenant, on its link
//! ([`lake_dp::wire::FEATURE_KEPT_APART`]). A block of a namespace its
//! holder keeps apart is moved only to a node that keeps that namespace
//! apart for the same tenant, and shown in no other node's view: a node
//! that does not keep the tenant apart (or keeps it for another) never
//! files it among the blocks its other engines read. A block of no known
//! namespace, of a holder keeping any apart, goes only to a node keeping
//! exactly the same apart. A node that says nothing keeps nothing apart;
//! a node the leader has not heard since it started (restored from a
//! checkpoint) is taken for one that keeps nothing apart until it
//! connects — its blocks in L1 and L2 cannot be moved meanwhile (no
//! connection to ask), and those in L3 are the shared store's.

use std::collections::BTreeMap;

use lake_dp::BlockKey;
use lake_dp::wire::message::{KeptApartEntry, NamedViewEntry, VIEW_TIER_NONE};

use super::{Summary, view};

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
}
