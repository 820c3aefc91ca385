//! The cluster summary (DESIGN §4): what the leader knows of
//! every node's replicas, built from the nodes' numbered deltas.
//!
//! Each node's `lake-cp` is the authority for its own replicas; every
//! change its location view makes is numbered (term, sequence), the term
//! being that control plane's incarnation. The leader applies a node's
//! deltas in order:
//!
//! - the next sequence of the node's current term: applied;
//! - a sequence past the next (a delta was lost): a **gap** — nothing more
//!   of that node is applied until it sends a snapshot, which the leader
//!   asks for ([`Outcome::NeedSnapshot`]);
//! - a newer term (the node's control plane restarted, or a standby took
//!   over): its view starts again from that term's first delta, or from a
//!   snapshot;
//! - an older term, or a sequence already applied: dropped ([`Outcome::Stale`]).
//!
//! A snapshot is the node's whole set of ready replicas at a sequence,
//! sent as [`Message::Snapshot`] frames in a row (its first frame starts
//! it over); deltas continue after that sequence.
//!
//! **Membership**: a node whose etcd lease has expired loses its volatile
//! (L1) replicas from the summary at once; its L2 replicas stay, marked
//! unavailable (not offered to readers) until it is a member again; its L3
//! replicas are the object store's and stay available.
//!
//! **Checkpoint**: [`Summary::checkpoint`] writes the whole summary in a
//! self-checking format (magic, version, every node's term and sequence,
//! its replicas as wire [`DeltaEntry`] records, what each node keeps
//! apart ([`apart`]), a CRC over all of it) to
//! be stored on L2 or L3 — never in etcd, which holds only its pointer.
//! A new leader starts from it ([`Summary::restore`]) and the nodes'
//! snapshots bring it up to date.
//!
//! [`Message::Snapshot`]: lake_dp::wire::Message::Snapshot

mod aggregator;
pub mod apart;
mod conn;
pub mod link;
pub mod metrics;
mod place;
mod report;
mod view;

use std::collections::{HashMap, HashSet};

use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::{Delta, DeltaEntry, DeltaOp};
use lake_dp::{BlockKey, Durability, Replica, Tier};

/// What applying a delta or a snapshot frame did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Applied: the node's view is at `sequence`.
    Applied {
        /// The last sequence applied.
        sequence: u64,
    },
    /// Not applied: the node's view has a gap (or is of an older term);
    /// ask it for a snapshot.
    NeedSnapshot {
        /// The node.
        node: u32,
        /// The term it is in.
        term: u64,
    },
    /// Not applied: older than what the summary holds.
    Stale,
}

/// One replica as the summary holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    entry: DeltaEntry,
}

#[derive(Clone, Debug, Default)]
struct NodeView {
    term: u64,
    /// The last sequence applied (0: none yet in this term).
    sequence: u64,
    /// Waiting for a snapshot (a gap was seen): deltas are not applied.
    gap: bool,
    /// Its membership lease stands.
    member: bool,
    /// An operator is taking it out (`lake drain-node`): nothing is
    /// copied to it, and what only it holds is copied elsewhere.
    draining: bool,
    /// Its L1 `(region, epoch)`, as its membership announced it: where
    /// copies to it go, before it holds any L1 replica.
    l1: Option<(u16, u64)>,
    /// The bytes its L1 and L2 hold, as its membership announced them
    /// (0: not said): its weight in placement.
    room: u64,
    /// The snapshot being received: its (term, sequence).
    receiving: Option<(u64, u64)>,
    /// Its replicas, by block (one per region).
    replicas: HashMap<BlockKey, Vec<Held>>,
    /// Of its blocks, those in its L1 or L2 (one in both counts once: its
    /// L1 copy goes free): what it fills of its room.
    cached: u64,
}

impl NodeView {
    fn held(&self) -> impl Iterator<Item = &Held> + '_ {
        self.replicas.values().flatten()
    }

    fn count(&self) -> usize {
        self.replicas.values().map(Vec::len).sum()
    }

    fn clear(&mut self) {
        self.replicas.clear();
        self.cached = 0;
    }
}

/// Figures of one node's view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeFigures {
    /// Its term.
    pub term: u64,
    /// The last sequence applied.
    pub sequence: u64,
    /// Whether its membership stands.
    pub member: bool,
    /// Whether a gap waits for a snapshot.
    pub gap: bool,
    /// Whether it is being drained, and of its blocks how many only it
    /// holds (none in L3, none on another member not draining).
    pub draining: bool,
    /// See `draining` (0 when not draining).
    pub drain_left: u64,
    /// Whether blocks are placed in it: a member, not draining, its L1
    /// known (announced, or holding a block there).
    pub takes_placements: bool,
    /// Replicas per tier (`Tier as usize`).
    pub replicas: [u64; 4],
    /// Of them, offered to readers (L2 of a lapsed node is not).
    pub available: [u64; 4],
}

/// One node's run of a prefix in the cluster-wide hit view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeHits {
    /// The node.
    pub node: u32,
    /// The leading blocks it can serve from L1 or faster, L2 or faster,
    /// L3 or faster (`[L1, L2, L3]`).
    pub through: [usize; 3],
}

/// A copy the leader asks of a node: its L1 replica of `key` into any
/// slot of another node's L1 (replication of a hot block; draining a
/// node, its L2 replica where it holds none in L1 — the node promotes it
/// first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replication {
    /// The block.
    pub key: BlockKey,
    /// The L1 replica it is copied from (its node is asked).
    pub from: Replica,
    /// The node, region and epoch it goes to (any slot).
    pub to: ReplicaWire,
}

/// Why a checkpoint could not be read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointError {
    /// Shorter than its own header or its counts say.
    Truncated,
    /// Not a summary checkpoint (magic), or of a version this build does
    /// not read.
    Format(String),
    /// The CRC does not match: damaged.
    Crc,
    /// A record's field is out of its domain.
    Field(&'static str),
}

impl core::fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Truncated => f.write_str("summary checkpoint: truncated"),
            Self::Format(why) => write!(f, "summary checkpoint: {why}"),
            Self::Crc => f.write_str("summary checkpoint: CRC mismatch (damaged)"),
            Self::Field(field) => write!(f, "summary checkpoint: {field} out of its domain"),
        }
    }
}

impl std::error::Error for CheckpointError {}

/// What an uplink has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UplinkCounters {
    /// Connections made to the leader.
    pub connects: u64,
    /// Delta frames sent.
    pub deltas: u64,
    /// Snapshots sent (one per connection, and one per request).
    pub snapshots: u64,
    /// Changes dropped while no leader was connected (a snapshot follows).
    pub dropped: u64,
    /// Copies to other nodes the leader asked of this node.
    pub copies_asked: u64,
    /// Connections closed because the leader failed its authentication
    /// (another key, a bad proof, a record's tag).
    pub refused: u64,
    /// Cluster view deltas applied.
    pub view_deltas: u64,
    /// Cluster view snapshots received.
    pub view_snapshots: u64,
    /// Gaps seen in the view stream (a view snapshot asked for).
    pub view_gaps: u64,
    /// View entries the node's view could not take (its table full, or
    /// every node slot taken): those blocks read as misses.
    pub view_refused: u64,
    /// View entries of no known namespace on a node keeping tenants apart
    /// (its holder, or its leader, older): shown to no engine there.
    pub view_unnamed: u64,
    /// Engines' pulls sent to the leader, and dropped (no leader streaming
    /// the view connected).
    pub pulls_sent: u64,
    /// See `pulls_sent`.
    pub pulls_dropped: u64,
    /// L1 victims offered to the leader to be placed elsewhere (the node
    /// full), and not offered (no leader placing spills connected).
    pub spills_sent: u64,
    /// See `spills_sent`.
    pub spills_dropped: u64,
}

/// What the aggregator has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AggregatorCounters {
    /// Node connections accepted.
    pub accepted: u64,
    /// Deltas applied.
    pub applied: u64,
    /// Snapshot frames applied.
    pub snapshot_frames: u64,
    /// Gaps found (a snapshot asked for).
    pub gaps: u64,
    /// Deltas dropped as older than what the summary holds.
    pub stale: u64,
    /// Connections closed for a bad frame.
    pub bad_frames: u64,
    /// Replication copies asked of nodes.
    pub copies_asked: u64,
    /// Copies asked of draining nodes (their blocks to other members).
    pub drain_copies_asked: u64,
    /// Blocks a node saved asked to be copied to their home
    /// ([`Summary::placement_plan`]).
    pub placements_asked: u64,
    /// Engines' pulls relayed to the blocks' holders, and not relayed (no
    /// member offers the block, or the puller's L1 is not known yet).
    pub pulls_relayed: u64,
    /// See `pulls_relayed`.
    pub pulls_unheld: u64,
    /// Spills (a full node's victims) placed in a member with room, and
    /// not placed (no member had room enough).
    pub spills_placed: u64,
    /// See `spills_placed`.
    pub spills_unplaced: u64,
    /// Connections closed for failing their authentication (no handshake,
    /// another key, a bad proof, a record's tag).
    pub refused: u64,
    /// Connections closed as they came: [`Aggregator::connections_max`]
    /// were open.
    pub over_cap: u64,
    /// Connections closed for saying no hello within [`HELLO_DEADLINE`].
    pub no_hello: u64,
    /// Accepts that failed (out of file descriptors, most often); the
    /// connection waits in the kernel's queue for a later pass.
    pub accept_failed: u64,
    /// Cluster view delta frames made (each sent to every node taking
    /// the view and not too far behind).
    pub view_deltas: u64,
    /// Cluster view snapshots sent.
    pub view_snapshots: u64,
    /// View deltas not sent to a node too far behind (a snapshot
    /// follows once it catches up).
    pub view_skipped: u64,
    /// Copies not asked: the block's holder keeps it apart, and the
    /// target does not keep it apart alike ([`apart`]).
    pub copies_kept_apart: u64,
}

const MAGIC: [u8; 8] = *b"LAKESUM\0";
/// The version written where any node keeps anything apart (its list
/// follows the nodes); else 1, as builds before it wrote and read.
const VERSION: u32 = 2;
const HEAD_BYTES: usize = 8 + 4 + 4 + 8;
const NODE_BYTES: usize = 4 + 4 + 8 + 8 + 8;
const ENTRY_BYTES: usize = size_of::<DeltaEntry>();

/// The cluster summary. See the module docs.
#[derive(Debug, Default)]
pub struct Summary {
    nodes: HashMap<u32, NodeView>,
    /// The cluster view's changes since they were last taken, where they
    /// are noted ([`Summary::track_view`]).
    view: view::Pending,
    /// Blocks newly held in a node's L1, to be placed, where they are
    /// noted ([`Summary::track_placement`]).
    placing: place::Pending,
    /// What each node keeping tenants apart keeps apart
    /// ([`Summary::kept_apart`]).
    apart: HashMap<u32, apart::Apart>,
}

fn tier_of(entry: &DeltaEntry) -> Option<Tier> {
    Tier::from_u8(entry.replica.tier)
}

impl Summary {
    /// An empty summary.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one delta of a node.
    pub fn delta(&mut self, head: &Delta, entries: impl IntoIterator<Item = DeltaEntry>) -> Outcome {
        let view = self.nodes.entry(head.node).or_insert_with(|| NodeView { member: true, ..NodeView::default() });
        view.receiving = None;
        if head.term < view.term {
            return Outcome::Stale;
        }
        if head.term > view.term {
            // A new incarnation: its view starts over, from its first
            // delta or from a snapshot.
            view::note_all(&mut self.view, head.node, view);
            view.term = head.term;
            view.sequence = 0;
            view.clear();
            view.gap = head.sequence != 1;
        }
        if view.gap {
            return Outcome::NeedSnapshot { node: head.node, term: view.term };
        }
        let last = head.sequence.saturating_add(u64::from(head.count)).saturating_sub(1);
        if head.count == 0 || last <= view.sequence {
            return Outcome::Stale;
        }
        if head.sequence != view.sequence + 1 {
            view.gap = true;
            return Outcome::NeedSnapshot { node: head.node, term: view.term };
        }
        for entry in entries {
            view::note(&mut self.view, head.node, view, &entry.key);
            place::note(&mut self.placing, head.node, &entry);
            apply(view, &entry);
        }
        view.sequence = last;
        Outcome::Applied { sequence: last }
    }

    /// Applies one frame of a node's snapshot: `head.sequence` is the last
    /// sequence it covers; the first frame of a snapshot clears the node's
    /// view.
    pub fn snapshot(&mut self, head: &Delta, entries: impl IntoIterator<Item = DeltaEntry>) -> Outcome {
        let view = self.nodes.entry(head.node).or_insert_with(|| NodeView { member: true, ..NodeView::default() });
        if head.term < view.term {
            return Outcome::Stale;
        }
        if view.receiving != Some((head.term, head.sequence)) {
            view.receiving = Some((head.term, head.sequence));
            view::note_all(&mut self.view, head.node, view);
            view.clear();
        }
        view.term = head.term;
        view.sequence = head.sequence;
        view.gap = false;
        for entry in entries {
            view::note(&mut self.view, head.node, view, &entry.key);
            apply(view, &entry);
        }
        Outcome::Applied { sequence: head.sequence }
    }

    /// The nodes whose membership leases stand now: the others lose their
    /// L1 replicas (and their L2 ones are not offered) until they return.
    pub fn membership(&mut self, members: &[u32]) {
        for (node, view) in &mut self.nodes {
            let member = members.contains(node);
            if view.member != member {
                // What it offers changes: its L1 goes, its L2 is withheld
                // or offered again.
                view::note_all(&mut self.view, *node, view);
            }
            if view.member && !member {
                for held in view.replicas.values_mut() {
                    held.retain(|h| tier_of(&h.entry) != Some(Tier::L1Dram));
                }
                view.replicas.retain(|_, held| !held.is_empty());
                view.cached = view.replicas.values().filter(|list| cached(list)).count() as u64;
            }
            view.member = member;
        }
    }

    /// The nodes an operator is draining (`lake drain-node`, in etcd):
    /// no copy goes to them, and each block only they hold is copied to
    /// another member ([`Summary::drain_plan`]).
    pub fn draining(&mut self, nodes: &[u32]) {
        for (node, view) in &mut self.nodes {
            view.draining = nodes.contains(node);
        }
    }

    /// Each member's L1 `(region, epoch)` as its membership announced it
    /// (`lake serve` under etcd): copies to a node go there even before
    /// it holds an L1 replica the summary could read it from.
    pub fn l1_spaces(&mut self, spaces: &[(u32, (u16, u64))]) {
        for (node, view) in &mut self.nodes {
            view.l1 = spaces.iter().find(|(n, _)| n == node).map(|&(_, l1)| l1);
        }
    }

    /// Where copies into `node`'s L1 go: its announced L1, else the
    /// region and epoch of an L1 replica it holds.
    pub fn l1_target(&self, node: u32) -> Option<ReplicaWire> {
        let view = self.nodes.get(&node)?;
        let l1 = match view.l1 {
            Some((region, epoch)) => {
                ReplicaWire { tier: Tier::L1Dram as u8, node, region, region_epoch: epoch, ..ReplicaWire::default() }
            }
            None => view.held().find(|h| tier_of(&h.entry) == Some(Tier::L1Dram))?.entry.replica,
        };
        Some(ReplicaWire { slot: lake_dp::wire::message::SLOT_ANY, generation: 0, ..l1 })
    }

    /// Whether `key` outlives `node`: in L3 (the store's), or held in L1 or
    /// L2 by a member that is neither `node` nor draining.
    fn kept_elsewhere(&self, key: &BlockKey, node: u32) -> bool {
        self.nodes.iter().any(|(&other, view)| {
            view.replicas.get(key).into_iter().flatten().filter_map(|h| tier_of(&h.entry)).any(|tier| {
                tier == Tier::L3Object
                    || (other != node && view.member && !view.draining && matches!(tier, Tier::L1Dram | Tier::L2Nvme))
            })
        })
    }

    /// Draining nodes' blocks that only they hold, each to be copied into
    /// the L1 of its home among the members not draining (see
    /// [`Summary::home`]): from the node's L1 replica, or its L2 one (the
    /// node promotes it first). `skip(key, node)` leaves out copies asked
    /// lately. At most `max`.
    pub fn drain_plan(&self, max: usize, mut skip: impl FnMut(&BlockKey, u32) -> bool) -> Vec<Replication> {
        let mut out = Vec::new();
        let targets = self.homes();
        if targets.is_empty() || max == 0 {
            return out;
        }
        // A block two drained nodes hold is copied once.
        let mut planned = HashSet::new();
        for node in self.nodes() {
            let view = &self.nodes[&node];
            if !view.draining || !view.member {
                continue;
            }
            let mut keys: Vec<&BlockKey> = view.replicas.keys().collect();
            keys.sort_unstable();
            for key in keys {
                if self.kept_elsewhere(key, node) || planned.contains(key) {
                    continue;
                }
                let held = &view.replicas[key];
                let fastest = [Tier::L1Dram, Tier::L2Nvme]
                    .into_iter()
                    .find_map(|tier| held.iter().find(|h| tier_of(&h.entry) == Some(tier)));
                let Some(from) = fastest.and_then(|h| Replica::from_wire(&h.entry.replica)) else { continue };
                // Among the members that keep the block's tenant apart alike.
                let alike: Vec<(u32, u64, ReplicaWire)>;
                let targets = if self.keeps_any_apart() {
                    alike = targets.iter().filter(|t| self.may_move(key, node, t.0)).copied().collect();
                    &alike
                } else {
                    &targets
                };
                let Some(&(target, _, to)) = place::pick(key, targets) else { continue };
                if skip(key, target) {
                    continue;
                }
                planned.insert(*key);
                out.push(Replication { key: *key, from, to });
                if out.len() >= max {
                    return out;
                }
            }
        }
        out
    }

    /// Nodes the summary knows.
    pub fn nodes(&self) -> Vec<u32> {
        let mut nodes: Vec<u32> = self.nodes.keys().copied().collect();
        nodes.sort_unstable();
        nodes
    }

    /// Every node's figures, by node: each walks the node's replicas, so
    /// a caller reporting them in several forms takes them once.
    pub fn all_figures(&self) -> Vec<(u32, NodeFigures)> {
        self.nodes().into_iter().filter_map(|node| self.figures(node).map(|f| (node, f))).collect()
    }

    /// One node's figures.
    pub fn figures(&self, node: u32) -> Option<NodeFigures> {
        let view = self.nodes.get(&node)?;
        let mut figures = NodeFigures {
            term: view.term,
            sequence: view.sequence,
            member: view.member,
            gap: view.gap,
            draining: view.draining,
            ..NodeFigures::default()
        };
        figures.takes_placements = view.member && !view.draining && self.l1_target(node).is_some();
        if view.draining {
            figures.drain_left = view.replicas.keys().filter(|key| !self.kept_elsewhere(key, node)).count() as u64;
        }
        for held in view.held() {
            let Some(tier) = tier_of(&held.entry) else { continue };
            figures.replicas[tier as usize] += 1;
            if available(view, tier) {
                figures.available[tier as usize] += 1;
            }
        }
        Some(figures)
    }

    /// The cluster-wide hit view of a prefix: for every node holding its
    /// first block, how far it reaches through each tier (only replicas
    /// offered to readers count).
    pub fn hits(&self, keys: &[BlockKey]) -> Vec<NodeHits> {
        let mut out = Vec::new();
        for node in self.nodes() {
            let view = &self.nodes[&node];
            let mut best = Vec::with_capacity(keys.len());
            for key in keys {
                let fastest = view
                    .replicas
                    .get(key)
                    .into_iter()
                    .flatten()
                    .filter_map(|held| tier_of(&held.entry))
                    .filter(|&t| t != Tier::L0Hbm && available(view, t))
                    .min();
                match fastest {
                    Some(tier) => best.push(tier),
                    None => break,
                }
            }
            if best.is_empty() {
                continue;
            }
            let run = |slowest: Tier| best.iter().take_while(|t| **t <= slowest).count();
            out.push(NodeHits { node, through: [run(Tier::L1Dram), run(Tier::L2Nvme), run(Tier::L3Object)] });
        }
        out
    }

    /// The replicas of `key` offered to readers, on every node.
    pub fn replicas(&self, key: &BlockKey) -> Vec<Replica> {
        let mut out = Vec::new();
        for view in self.nodes.values() {
            for held in view.replicas.get(key).into_iter().flatten() {
                if let Some(replica) = Replica::from_wire(&held.entry.replica)
                    && available(view, replica.tier)
                {
                    out.push(replica);
                }
            }
        }
        out.sort_unstable_by_key(|r| (r.tier as u8, r.node.0, r.region.0));
        out
    }

    /// Replication of hot prefixes: a block that at least `min_children`
    /// distinct blocks continue, anywhere in the cluster (a shared system
    /// prompt, a popular few-shot preamble: what many requests start
    /// with), is copied from a member's L1 into the L1 of every other
    /// member that reads its namespace (holds any block of it: its
    /// engines serve that model and tenant; a block of no known namespace,
    /// from a node that does not say, goes to every member) and holds no
    /// L1 copy of it — the copies shared out among the members holding
    /// one, in turn, so that no one node sends them all (and each copy
    /// landed is a source for the next plan). `skip(key, node)` leaves out
    /// copies already asked. At most `max`, the most continued first.
    ///
    /// The children and each member's namespaces are counted over every
    /// node's replicas on each call (a pass over the summary).
    pub fn replication_plan(
        &self,
        min_children: usize,
        max: usize,
        mut skip: impl FnMut(&BlockKey, u32) -> bool,
    ) -> Vec<Replication> {
        if min_children == 0 || max == 0 {
            return Vec::new();
        }
        let mut children: HashMap<BlockKey, HashSet<BlockKey>> = HashMap::new();
        let mut reads: HashSet<(u32, u64)> = HashSet::new();
        for (&node, view) in &self.nodes {
            let mut last = None;
            for held in view.held() {
                if !held.entry.parent_key.is_none() {
                    children.entry(held.entry.parent_key).or_default().insert(held.entry.key);
                }
                // A node's blocks are mostly of one namespace or a few.
                if last != Some(held.entry.namespace) {
                    last = Some(held.entry.namespace);
                    reads.insert((node, held.entry.namespace));
                }
            }
        }
        let mut hot: Vec<(usize, BlockKey)> =
            children.iter().filter(|(_, c)| c.len() >= min_children).map(|(k, c)| (c.len(), *k)).collect();
        hot.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        for (_, key) in hot {
            fn l1_copy<'a>(view: &'a NodeView, key: &BlockKey) -> Option<&'a Held> {
                view.replicas.get(key)?.iter().find(|h| tier_of(&h.entry) == Some(Tier::L1Dram))
            }
            let copies: Vec<&Held> = self
                .nodes()
                .into_iter()
                .map(|node| &self.nodes[&node])
                .filter(|view| view.member)
                .filter_map(|view| l1_copy(view, &key))
                .collect();
            let sources: Vec<Replica> = copies.iter().filter_map(|h| Replica::from_wire(&h.entry.replica)).collect();
            if sources.is_empty() {
                continue;
            }
            let namespace = copies[0].entry.namespace;
            let mut turn = 0;
            for node in self.nodes() {
                let view = &self.nodes[&node];
                if !view.member
                    || view.draining
                    || (namespace != 0 && !reads.contains(&(node, namespace)))
                    || l1_copy(view, &key).is_some()
                    || skip(&key, node)
                {
                    continue;
                }
                let Some(to) = self.l1_target(node) else { continue };
                out.push(Replication { key, from: sources[turn % sources.len()], to });
                turn += 1;
                if out.len() >= max {
                    return out;
                }
            }
        }
        out
    }

    /// The whole summary as a checkpoint (see the module docs), written
    /// by the leader of `term`.
    pub fn checkpoint(&self, term: u64) -> Vec<u8> {
        let entries: usize = self.nodes.values().map(NodeView::count).sum();
        let mut out = Vec::with_capacity(HEAD_BYTES + self.nodes.len() * NODE_BYTES + entries * ENTRY_BYTES + 4);
        out.extend_from_slice(&MAGIC);
        let version = if self.apart.is_empty() { 1 } else { VERSION };
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.nodes.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&term.to_le_bytes());
        for node in self.nodes() {
            let view = &self.nodes[&node];
            out.extend_from_slice(&node.to_le_bytes());
            out.extend_from_slice(&u32::from(view.member).to_le_bytes());
            out.extend_from_slice(&view.term.to_le_bytes());
            out.extend_from_slice(&view.sequence.to_le_bytes());
            out.extend_from_slice(&(view.count() as u64).to_le_bytes());
            let mut held: Vec<&Held> = view.held().collect();
            held.sort_unstable_by_key(|h| (h.entry.key, h.entry.replica.region));
            for h in held {
                out.extend_from_slice(bytemuck::bytes_of(&h.entry));
            }
        }
        self.write_apart(&mut out);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// A summary read back from a checkpoint, and the term that wrote it.
    /// Every node's view comes back marked as needing a snapshot only if
    /// its deltas do not continue where the checkpoint left it — which is
    /// what [`Summary::delta`] finds out.
    pub fn restore(bytes: &[u8]) -> Result<(Self, u64), CheckpointError> {
        let Some((body, crc)) = bytes.split_last_chunk::<4>() else { return Err(CheckpointError::Truncated) };
        if bytes.len() < HEAD_BYTES + 4 {
            return Err(CheckpointError::Truncated);
        }
        if body[..8] != MAGIC {
            return Err(CheckpointError::Format("not a summary checkpoint (magic)".into()));
        }
        if crc32fast::hash(body) != u32::from_le_bytes(*crc) {
            return Err(CheckpointError::Crc);
        }
        let mut at: usize = 8;
        let mut take = |n: usize| -> Result<&[u8], CheckpointError> {
            let end = at.checked_add(n).ok_or(CheckpointError::Truncated)?;
            let part = body.get(at..end).ok_or(CheckpointError::Truncated)?;
            at = end;
            Ok(part)
        };
        let version = u32_at(take(4)?);
        if version != 1 && version != VERSION {
            return Err(CheckpointError::Format(format!("version {version} (this build reads 1 to {VERSION})")));
        }
        let nodes = u32_at(take(4)?);
        let term = u64_at(take(8)?);
        let mut summary = Self::new();
        for _ in 0..nodes {
            let node = u32_at(take(4)?);
            let member = match u32_at(take(4)?) {
                0 => false,
                1 => true,
                _ => return Err(CheckpointError::Field("node.member")),
            };
            let node_term = u64_at(take(8)?);
            let sequence = u64_at(take(8)?);
            let count = u64_at(take(8)?);
            let bytes = usize::try_from(count)
                .ok()
                .and_then(|c| c.checked_mul(ENTRY_BYTES))
                .ok_or(CheckpointError::Truncated)?;
            let records = take(bytes)?;
            let mut view = NodeView { term: node_term, sequence, member, ..NodeView::default() };
            for record in records.chunks_exact(ENTRY_BYTES) {
                let entry: DeltaEntry = bytemuck::pod_read_unaligned(record);
                check_entry(&entry, node)?;
                let held = view.replicas.entry(entry.key).or_insert_with(one_replica);
                if held.iter().any(|h| h.entry.replica.region == entry.replica.region) {
                    return Err(CheckpointError::Field("entry (a region twice)"));
                }
                let before = cached(held);
                held.push(Held { entry });
                if !before && cached(held) {
                    view.cached += 1;
                }
            }
            if summary.nodes.insert(node, view).is_some() {
                return Err(CheckpointError::Field("node (twice)"));
            }
        }
        if version == VERSION {
            summary.read_apart(&mut take)?;
        }
        if at != body.len() {
            return Err(CheckpointError::Format("bytes after the last section".into()));
        }
        Ok((summary, term))
    }
}

/// A checkpoint's little-endian u32 at the start of `b` (0 where short).
fn u32_at(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().unwrap_or([0; 4]))
}

/// A checkpoint's little-endian u64 at the start of `b` (0 where short).
fn u64_at(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))
}

fn check_entry(entry: &DeltaEntry, node: u32) -> Result<(), CheckpointError> {
    if DeltaOp::from_u8(entry.op) != Some(DeltaOp::Add) {
        return Err(CheckpointError::Field("entry.op"));
    }
    if Durability::from_u8(entry.durability).is_none() {
        return Err(CheckpointError::Field("entry.durability"));
    }
    if lake_dp::ObjectKind::from_u16(entry.kind).is_none() {
        return Err(CheckpointError::Field("entry.kind"));
    }
    match Replica::from_wire(&entry.replica) {
        Some(replica) if replica.node.0 == node => Ok(()),
        Some(_) => Err(CheckpointError::Field("entry.replica.node")),
        None => Err(CheckpointError::Field("entry.replica.tier")),
    }
}

/// Whether a replica of `tier` in `view` is offered to readers.
fn available(view: &NodeView, tier: Tier) -> bool {
    view.member || tier == Tier::L3Object
}

/// Whether a block's replicas on a node fill one of its L1 or L2 slots.
fn cached(list: &[Held]) -> bool {
    list.iter().any(|h| matches!(tier_of(&h.entry), Some(Tier::L1Dram | Tier::L2Nvme)))
}

fn apply(view: &mut NodeView, entry: &DeltaEntry) {
    let region = entry.replica.region;
    match DeltaOp::from_u8(entry.op) {
        Some(DeltaOp::Add | DeltaOp::Update) => {
            let held = Held { entry: DeltaEntry { op: DeltaOp::Add as u8, ..*entry } };
            let list = view.replicas.entry(entry.key).or_insert_with(one_replica);
            let before = cached(list);
            match list.iter_mut().find(|h| h.entry.replica.region == region) {
                Some(old) => *old = held,
                None => list.push(held),
            }
            if !before && cached(list) {
                view.cached += 1;
            }
        }
        Some(DeltaOp::Remove) => {
            let Some(list) = view.replicas.get_mut(&entry.key) else { return };
            // Only the replica it names: a later one in the region stays.
            let before = cached(list);
            list.retain(|h| h.entry.replica.region != region || !same_replica(&h.entry.replica, &entry.replica));
            if before && !cached(list) {
                view.cached = view.cached.saturating_sub(1);
            }
            if list.is_empty() {
                view.replicas.remove(&entry.key);
            }
        }
        None => {}
    }
}

/// A block's list of replicas on a node, with room for one: most blocks
/// have one replica a node, and a list grown from empty would take room
/// for four (320 bytes of 80-byte entries).
fn one_replica() -> Vec<Held> {
    Vec::with_capacity(1)
}

fn same_replica(a: &ReplicaWire, b: &ReplicaWire) -> bool {
    (a.region_epoch, a.slot, a.generation) == (b.region_epoch, b.slot, b.generation)
}

#[cfg(test)]
mod tests;
