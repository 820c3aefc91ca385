//! The cluster view the leader streams back down to every node: for each
//! (node, block), the fastest tier of the node's replicas offered to
//! readers. The summary notes each (node, block) a change touches, with
//! what it was before; taking the changes compares that with what it is
//! now, so a block removed and added back between two takes sends nothing,
//! and a node's snapshot replacing its view sends only what differs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use lake_dp::constants::DELTA_ENTRIES_MAX;
use lake_dp::mirror::view::{ViewOpener, ViewWriter};
use lake_dp::wire::message::{Delta, NamedViewEntry, Records, VIEW_TIER_NONE, ViewEntry};
use lake_dp::wire::{Message, WireError, append_frame};
use lake_dp::{BlockKey, NodeId, ObjectKind, Tier};

use super::apart::{Apart, alike};
use super::link::{UplinkCounters, meta};
use super::{NodeView, Summary, available, tier_of};

/// What a (node, block) shows readers: its offered tier, kind and
/// namespace. The record of changes keeps what it showed when a change
/// first touched it since the last take.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shown {
    tier: Option<Tier>,
    kind: u8,
    namespace: u64,
    /// Sent again whatever it shows now (who may see it changed).
    resend: bool,
}

/// The fastest tier of `view`'s replicas of `key` offered to readers (L0
/// is no other node's to read), and the block's kind and namespace.
fn offered(view: &NodeView, key: &BlockKey) -> Shown {
    let mut best = None;
    let mut kind = ObjectKind::KvBlock as u8;
    let mut namespace = 0;
    for held in view.replicas.get(key).into_iter().flatten() {
        kind = u8::try_from(held.entry.kind).unwrap_or(kind);
        namespace = held.entry.namespace;
        if let Some(tier) = tier_of(&held.entry)
            && tier != Tier::L0Hbm
            && available(view, tier)
            && best.is_none_or(|b| tier < b)
        {
            best = Some(tier);
        }
    }
    Shown { tier: best, kind, namespace, resend: false }
}

fn entry(key: BlockKey, shown: Shown) -> NamedViewEntry {
    let Shown { tier, kind, namespace, .. } = shown;
    NamedViewEntry { key, namespace, tier: tier.map_or(VIEW_TIER_NONE, |t| t as u8), kind, reserved: [0; 6] }
}

/// Room the record of changes keeps between takes (a burst's is given
/// back).
const PENDING_KEPT: usize = 1 << 16;

/// The changes noted since the last take, where the summary notes them.
pub(super) type Pending = Option<HashMap<(u32, BlockKey), Shown>>;

/// Notes `key` of `node` as about to change (its state now is what the
/// next take compares with).
pub(super) fn note(pending: &mut Pending, node: u32, view: &NodeView, key: &BlockKey) {
    if let Some(pending) = pending {
        pending.entry((node, *key)).or_insert_with(|| offered(view, key));
    }
}

/// Notes every block of `node` (its view is about to be replaced, or
/// what of it is offered changes).
pub(super) fn note_all(pending: &mut Pending, node: u32, view: &NodeView) {
    if pending.is_some() {
        for key in view.replicas.keys() {
            note(pending, node, view, key);
        }
    }
}

/// Notes every block of `node` to be sent again, whatever it shows
/// (which nodes may see it changed).
pub(super) fn resend_all(pending: &mut Pending, node: u32, view: &NodeView) {
    if let Some(pending) = pending {
        for key in view.replicas.keys() {
            pending.entry((node, *key)).or_insert_with(|| offered(view, key)).resend = true;
        }
    }
}

impl Summary {
    /// Notes the changes of the cluster view from now on
    /// ([`Summary::take_view_changes`]): the leader streaming it calls
    /// this once.
    pub fn track_view(&mut self) {
        self.view.get_or_insert_with(HashMap::new);
    }

    /// The cluster view's changes since the last call, by node (in node
    /// order): each block whose fastest offered tier on that node is not
    /// what it was ([`VIEW_TIER_NONE`]: it holds it no more).
    pub fn take_view_changes(&mut self) -> Vec<(u32, Vec<NamedViewEntry>)> {
        let Some(pending) = self.view.as_mut() else { return Vec::new() };
        let mut changes: Vec<((u32, BlockKey), Shown)> = pending.drain().collect();
        // A burst (a node's snapshot, a lapse) leaves no room behind it.
        pending.shrink_to(PENDING_KEPT);
        changes.sort_unstable_by_key(|&(at, _)| at);
        let mut out: Vec<(u32, Vec<NamedViewEntry>)> = Vec::new();
        for ((node, key), before) in changes {
            // A block gone keeps the kind and namespace it had.
            let now = self.nodes.get(&node).map(|view| offered(view, &key)).filter(|now| now.tier.is_some());
            let now = now.unwrap_or(Shown { tier: None, ..before });
            if now.tier == before.tier && !before.resend {
                continue;
            }
            match out.last_mut() {
                Some((n, entries)) if *n == node => entries.push(entry(key, now)),
                _ => out.push((node, vec![entry(key, now)])),
            }
        }
        out
    }

    /// The whole cluster view, by node, as a node keeping `to` apart is to
    /// see it ([`super::apart`]): every block each node offers, with its
    /// fastest tier (a snapshot for a node that connects or saw a gap).
    pub fn view_entries(&self, to: &Apart) -> Vec<(u32, Vec<NamedViewEntry>)> {
        let mut out = Vec::new();
        for node in self.nodes() {
            let view = &self.nodes[&node];
            let held = self.apart_of(node);
            let mut entries: Vec<NamedViewEntry> = view
                .replicas
                .keys()
                .filter_map(|key| {
                    let shown = offered(view, key);
                    let seen = shown.tier.is_some() && alike(held, shown.namespace, to);
                    seen.then(|| entry(*key, shown))
                })
                .collect();
            if !entries.is_empty() {
                entries.sort_unstable_by_key(|e| e.key);
                out.push((node, entries));
            }
        }
        out
    }
}

/// A node's cluster views, where its engines are given them: the pool's
/// beside its mirror (`<mirror>.cluster`), and each tenant kept apart's
/// beside that tenant's own mirror, showing its namespaces' blocks alone.
#[derive(Debug)]
pub struct NodeViews {
    /// The pool's.
    pub pool: ViewWriter,
    /// Each tenant's namespaces and view.
    pub tenants: Vec<(Vec<u64>, ViewWriter)>,
}

impl NodeViews {
    /// Views of up to `blocks` other nodes' blocks each for node `node`:
    /// beside `mirror`, and beside each tenant's mirror of `tenants`
    /// (its namespaces, its mirror's path).
    pub fn create(
        node: NodeId,
        blocks: u64,
        mirror: &Path,
        tenants: &[(Vec<u64>, PathBuf)],
    ) -> Result<Self, lake_dp::mirror::MirrorError> {
        let beside = |mirror: &Path| ViewWriter::create_at(ViewOpener::path_beside(mirror), node, blocks);
        let pool = beside(mirror)?;
        let tenants = tenants.iter().map(|(namespaces, path)| beside(path).map(|view| (namespaces.clone(), view)));
        Ok(Self { pool, tenants: tenants.collect::<Result<_, _>>()? })
    }
}

/// The node's copy of the leader's cluster view.
#[derive(Debug)]
pub(super) struct ViewCopy {
    pub(super) writer: ViewWriter,
    /// Each tenant kept apart: its namespaces, and its own view, the only
    /// one that shows their blocks. With any, a block of no known
    /// namespace is shown in none.
    pub(super) tenants: Vec<(Vec<u64>, ViewWriter)>,
    pub(super) term: u64,
    /// The last frame applied.
    pub(super) sequence: u64,
    /// A gap was seen: deltas wait for the snapshot asked.
    pub(super) gap: bool,
    /// The snapshot being received: its (term, sequence).
    pub(super) receiving: Option<(u64, u64)>,
    /// The leader of this connection streams the view (it sent a
    /// snapshot): it takes pulls too.
    pub(super) streaming: bool,
}

impl ViewCopy {
    /// Other nodes' blocks its views show, and the other nodes they name.
    pub(super) fn figures(&self) -> (u64, usize) {
        let writers = || std::iter::once(&self.writer).chain(self.tenants.iter().map(|(_, writer)| writer));
        let nodes: std::collections::HashSet<NodeId> =
            writers().flat_map(|writer| writer.nodes().into_iter().map(|(node, _)| node)).collect();
        (writers().map(ViewWriter::live).sum(), nodes.len())
    }

    /// Applies a view delta frame: the view's term asked for a snapshot
    /// of where it does not follow the last.
    pub(super) fn delta(
        &mut self,
        head: &Delta,
        entries: impl IntoIterator<Item = NamedViewEntry>,
        counters: &mut UplinkCounters,
    ) -> Option<u64> {
        self.receiving = None;
        if self.gap || (head.term == self.term && head.sequence <= self.sequence) {
            return None;
        }
        if head.term != self.term || head.sequence != self.sequence + 1 {
            self.gap = true;
            counters.view_gaps += 1;
            return Some(head.term);
        }
        self.apply(head.node, entries, counters);
        self.sequence = head.sequence;
        counters.view_deltas += 1;
        None
    }

    /// Applies a view snapshot frame; its first frame starts the view over.
    pub(super) fn snapshot(
        &mut self,
        head: &Delta,
        entries: impl IntoIterator<Item = NamedViewEntry>,
        counters: &mut UplinkCounters,
    ) {
        if self.receiving != Some((head.term, head.sequence)) {
            self.receiving = Some((head.term, head.sequence));
            self.writer.clear();
            for (_, writer) in &mut self.tenants {
                writer.clear();
            }
            counters.view_snapshots += 1;
        }
        (self.term, self.sequence, self.gap, self.streaming) = (head.term, head.sequence, false, true);
        self.apply(head.node, entries, counters);
    }

    fn apply(&mut self, node: u32, entries: impl IntoIterator<Item = NamedViewEntry>, counters: &mut UplinkCounters) {
        for entry in entries {
            let writer = if self.tenants.is_empty() {
                &mut self.writer
            } else if entry.namespace == 0 {
                counters.view_unnamed += 1;
                continue;
            } else {
                match self.tenants.iter_mut().find(|(namespaces, _)| namespaces.contains(&entry.namespace)) {
                    Some((_, writer)) => writer,
                    None => &mut self.writer,
                }
            };
            let tier = if entry.tier == VIEW_TIER_NONE { None } else { Tier::from_u8(entry.tier) };
            let kind = ObjectKind::from_u16(u16::from(entry.kind)).unwrap_or(ObjectKind::KvBlock);
            if writer.set(&entry.key, NodeId(node), tier, kind).is_err() {
                counters.view_refused += 1;
            }
        }
    }
}

/// An entry of a view frame without namespaces (an older leader's), as
/// one of no known namespace.
pub(super) fn unnamed(entry: ViewEntry) -> NamedViewEntry {
    let ViewEntry { key, tier, kind, reserved } = entry;
    NamedViewEntry { key, namespace: 0, tier, kind, reserved }
}

/// Appends one view frame of `entries` under `head` (its count set here):
/// `named`, with each block's namespace (kinds 39 and 40), else without.
pub(super) fn append_view_frame(
    out: &mut Vec<u8>,
    head: Delta,
    entries: &[NamedViewEntry],
    snapshot: bool,
    named: bool,
) -> Result<(), WireError> {
    let head = Delta { count: u32::try_from(entries.len()).unwrap_or(u32::MAX), ..head };
    if named {
        let records = Records::from_slice(entries);
        let message =
            if snapshot { Message::ViewSnapshotNamed(head, records) } else { Message::ViewDeltaNamed(head, records) };
        return append_frame(out, meta(0), &message).map(|_| ());
    }
    let plain: Vec<ViewEntry> = entries.iter().map(NamedViewEntry::plain).collect();
    let records = Records::from_slice(&plain);
    let message = if snapshot { Message::ViewSnapshot(head, records) } else { Message::ViewDelta(head, records) };
    append_frame(out, meta(0), &message).map(|_| ())
}

/// The whole view as snapshot frames at `(term, sequence)` (`named`: see
/// [`append_view_frame`]), as a node keeping `to` apart is to see it: at
/// least one (an empty view is one empty frame, which starts the node's
/// over).
pub(super) fn view_snapshot(
    summary: &Summary,
    (term, sequence): (u64, u64),
    named: bool,
    to: &Apart,
) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::new();
    let head = |node| Delta { term, sequence, node, count: 0 };
    let nodes = summary.view_entries(to);
    if nodes.is_empty() {
        append_view_frame(&mut out, head(0), &[], true, named)?;
    }
    for (node, entries) in &nodes {
        for chunk in entries.chunks(DELTA_ENTRIES_MAX) {
            append_view_frame(&mut out, head(*node), chunk, true, named)?;
        }
    }
    Ok(out)
}
