//! Execution-mode routing: where a request runs, as a pure function of the
//! request, the hit view (which node holds how much of its prefix, in
//! which tier) and the load view (how busy each node is, how fast its
//! links and its compute are). Three modes:
//!
//! - **Colocated**: prefill and decode on one node, which loads the prefix
//!   it holds and recomputes the rest.
//! - **PD-disaggregated**: a prefill node computes (loading its own hits),
//!   then its KV crosses the compute network to a decode node (P→D).
//! - **D-direct**: the prefix already sits in a node's HBM (an engine's
//!   advisory L0 replicas), so the request starts there with little or no
//!   transfer.
//!
//! A hit counts only where loading it beats recomputing it: a tier's run of
//! the prefix is loaded if moving a block from that tier takes less time
//! than computing the block again, and the prefix stops at the first tier
//! that does not pay (a prefix is only useful whole, from block 0). Every
//! candidate's time to first token is modelled — queue, loads, compute,
//! the P→D transfer — and the fastest wins (fewer blocks moved between
//! nodes, then fewer moved at all, break a tie: loads hidden under
//! compute still cost bandwidth). A failed execution is routed again with
//! the failed node in [`Request::avoid`] (F4 reroute): the same function,
//! no fallback ladder.
//!
//! The pool is one across nodes: past what a node holds itself, the
//! prefix may go on in other nodes' L1 or L2 ([`HitView::pool`]), pulled
//! over the storage network at the node's [`NodeLoad::pull_ns_per_block`]
//! — loaded, like any tier's run, only where that beats recomputing.

use crate::{NodeId, Tier};

#[cfg(not(loom))]
pub mod hits;

/// What is asked: a prompt of `blocks` blocks (its leading blocks are the
/// prefix the pool may hold) and the nodes not to use.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// Blocks of the prompt.
    pub blocks: u32,
    /// Nodes a failed execution ran on (F4: routed around, not retried).
    pub avoid: Vec<NodeId>,
}

/// How much of the request's prefix one node holds: `through[t]` is the
/// length of the prefix available from tier `t` or a faster one (so the
/// figures never decrease from L0 to L3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeHits {
    /// The node.
    pub node: NodeId,
    /// Prefix blocks available at L0 (an engine's HBM), L0–L1, L0–L2, L0–L3.
    pub through: [u32; 4],
}

/// One node as the router sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeLoad {
    /// The node.
    pub node: NodeId,
    /// It runs prefill work.
    pub prefill: bool,
    /// It runs decode work.
    pub decode: bool,
    /// Time before a new request's prefill would start there (ns).
    pub queue_ns: u64,
    /// Prefill compute rate (ns per block recomputed).
    pub compute_ns_per_block: u64,
    /// Moving one block from each tier into this node's HBM (ns), by
    /// `Tier as usize` (L0: 0, it is there).
    pub load_ns_per_block: [u64; 4],
    /// Moving one block over the compute network to or from this node (ns).
    pub cnic_ns_per_block: u64,
    /// Pulling one block from another node's L1 or L2 into this node's
    /// HBM over the storage network (ns; `u64::MAX`: never).
    pub pull_ns_per_block: u64,
}

/// A run of the prefix held in the pool: blocks `first..last`, each in
/// `node`'s `tier` (L1 or L2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolRun {
    /// First block.
    pub first: u32,
    /// One past the last.
    pub last: u32,
    /// The node holding them.
    pub node: NodeId,
    /// Its tier of them.
    pub tier: Tier,
}

/// The hit view: per node, what it holds of the prefix. Nodes absent hold
/// nothing. L3 is the cluster's: `l3_through` blocks any node may read.
/// `pool` is the prefix as the whole pool holds it, block 0 on, in runs by
/// holder (one holder a block: the fastest): what a node may pull past
/// its own — from another node's L1 or L2, or, a run some node holds in
/// L3, from the object store every node shares.
#[derive(Clone, Debug, Default)]
pub struct HitView {
    /// Per node.
    pub nodes: Vec<NodeHits>,
    /// Prefix blocks in the object store.
    pub l3_through: u32,
    /// The pool's prefix in L1, L2 and L3, in runs from block 0.
    pub pool: Vec<PoolRun>,
}

/// The load view: every node that may run work.
#[derive(Clone, Debug, Default)]
pub struct LoadView {
    /// Per node.
    pub nodes: Vec<NodeLoad>,
}

/// The mode chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Prefill and decode on `node`.
    Colocated {
        /// Where.
        node: NodeId,
    },
    /// Prefill on `prefill`, its KV sent over the compute network to
    /// `decode`.
    PdDisaggregated {
        /// Where the prompt is computed.
        prefill: NodeId,
        /// Where tokens are generated.
        decode: NodeId,
    },
    /// Starts on `node`, where the prefix already is in HBM.
    DDirect {
        /// Where.
        node: NodeId,
    },
}

/// Which network a move crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    /// Within a node: its own tiers into its HBM.
    Local,
    /// The storage network (another node's tiers, L3).
    Storage,
    /// The compute network (P→D).
    Compute,
}

/// Blocks `first..last` of the prompt moving from `from` (node and tier)
/// to `to`'s HBM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    /// First block.
    pub first: u32,
    /// One past the last.
    pub last: u32,
    /// Where they are: a node (L3: any) and tier.
    pub from: (NodeId, Tier),
    /// Where they go.
    pub to: NodeId,
    /// Over what.
    pub network: Network,
}

/// The plan: the mode, what moves, what is recomputed, the modelled TTFT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The mode.
    pub mode: Mode,
    /// Prefix blocks loaded (or already in HBM) rather than recomputed.
    pub hit_blocks: u32,
    /// Blocks computed.
    pub recomputed_blocks: u32,
    /// What moves, in order.
    pub moves: Vec<Move>,
    /// The modelled time to first token (ns).
    pub ttft_ns: u64,
}

impl Plan {
    /// Blocks that cross a network (local loads excluded).
    pub fn blocks_moved_between_nodes(&self) -> u64 {
        self.moves.iter().filter(|m| m.network != Network::Local).map(|m| u64::from(m.last - m.first)).sum()
    }

    /// Blocks that move at all (into HBM or across a network).
    pub fn blocks_moved(&self) -> u64 {
        self.moves.iter().map(|m| u64::from(m.last - m.first)).sum()
    }

    /// How plans compare: the faster first; at equal speed the one moving
    /// fewer blocks between nodes, then fewer at all (HBM hits over loads).
    fn cost(&self) -> (u64, u64, u64) {
        (self.ttft_ns, self.blocks_moved_between_nodes(), self.blocks_moved())
    }
}

/// Why no plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteError {
    /// No node left that may run the request (all avoided, or none with
    /// the roles a mode needs).
    NoNode,
}

/// Which modes a router may choose (the simulation's baselines restrict
/// it; the pool's router allows all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Whatever is fastest.
    Any,
    /// PD-disaggregated only.
    AlwaysPd,
    /// Colocated only.
    AlwaysColocated,
}

/// The fastest plan for `request` (see the module docs).
pub fn route(request: &Request, hits: &HitView, loads: &LoadView, policy: Policy) -> Result<Plan, RouteError> {
    let usable = |n: &&NodeLoad| !request.avoid.contains(&n.node);
    let nodes: Vec<&NodeLoad> = loads.nodes.iter().filter(usable).collect();
    let mut best: Option<Plan> = None;
    let mut consider = |plan: Plan| {
        let better = best.as_ref().is_none_or(|b| plan.cost() < b.cost());
        if better {
            best = Some(plan);
        }
    };
    for &node in &nodes {
        let local = prefill_on(request, hits, node);
        if policy != Policy::AlwaysPd && node.prefill && node.decode {
            let l0 = hits_of(hits, node.node).through[0].min(request.blocks);
            let mode = if l0 > 0 && local.hit >= l0 && policy == Policy::Any {
                Mode::DDirect { node: node.node }
            } else {
                Mode::Colocated { node: node.node }
            };
            consider(local.plan(mode, 0));
        }
        if policy == Policy::AlwaysColocated || !node.prefill {
            continue;
        }
        for &decode in nodes.iter().filter(|d| d.decode && d.node != node.node) {
            // Every block of the prompt crosses to the decode node.
            let transfer = u64::from(request.blocks) * node.cnic_ns_per_block.max(decode.cnic_ns_per_block);
            let mut plan = local.plan(Mode::PdDisaggregated { prefill: node.node, decode: decode.node }, transfer);
            plan.moves.push(Move {
                first: 0,
                last: request.blocks,
                from: (node.node, Tier::L0Hbm),
                to: decode.node,
                network: Network::Compute,
            });
            consider(plan);
        }
    }
    best.ok_or(RouteError::NoNode)
}

fn hits_of(hits: &HitView, node: NodeId) -> NodeHits {
    hits.nodes.iter().copied().find(|h| h.node == node).unwrap_or(NodeHits { node, through: [0; 4] })
}

/// A prefill on one node: which prefix runs it loads (each only if it
/// beats recomputing), the rest computed. The order: its own L0–L2, then
/// the pool's runs past them (pulled from other nodes), then L3.
struct Prefill {
    hit: u32,
    moves: Vec<Move>,
    ttft_ns: u64,
    blocks: u32,
}

impl Prefill {
    fn plan(&self, mode: Mode, extra_ns: u64) -> Plan {
        Plan {
            mode,
            hit_blocks: self.hit,
            recomputed_blocks: self.blocks - self.hit,
            moves: self.moves.clone(),
            ttft_ns: self.ttft_ns.saturating_add(extra_ns),
        }
    }
}

fn prefill_on(request: &Request, hits: &HitView, node: &NodeLoad) -> Prefill {
    let own = hits_of(hits, node.node);
    let mut through = own.through;
    // The object store is every node's L3.
    through[3] = through[3].max(hits.l3_through);
    let mut runs = Runs { node, blocks: request.blocks, covered: 0, load_ns: 0, moves: Vec::new() };
    let mut going = true;
    for (tier, &upto) in through.iter().enumerate().take(3) {
        let from = (node.node, [Tier::L0Hbm, Tier::L1Dram, Tier::L2Nvme][tier]);
        going = going && runs.take(upto, from, node.load_ns_per_block[tier], Network::Local);
    }
    for run in &hits.pool {
        if !going || run.first > runs.covered {
            break;
        }
        let (per_block, network) = if run.tier == Tier::L3Object {
            // The store is every node's: read as this node reads its own.
            (node.load_ns_per_block[3], Network::Storage)
        } else if run.node == node.node {
            (node.load_ns_per_block[run.tier as usize], Network::Local)
        } else {
            (node.pull_ns_per_block, Network::Storage)
        };
        going = runs.take(run.last, (run.node, run.tier), per_block, network);
    }
    if going {
        runs.take(through[3], (node.node, Tier::L3Object), node.load_ns_per_block[3], Network::Storage);
    }
    let Runs { covered, load_ns, moves, .. } = runs;
    let compute_ns = u64::from(request.blocks - covered) * node.compute_ns_per_block;
    // Loads and compute overlap layer by layer: the longer one sets the
    // pace (the prefix's loads feed the suffix's attention).
    Prefill { hit: covered, moves, ttft_ns: node.queue_ns + load_ns.max(compute_ns), blocks: request.blocks }
}

/// The prefix a prefill loads, run by run.
struct Runs<'a> {
    node: &'a NodeLoad,
    blocks: u32,
    covered: u32,
    load_ns: u64,
    moves: Vec<Move>,
}

impl Runs<'_> {
    /// Takes the prefix on to `upto` from `from` at `per_block` a block,
    /// where that pays. Returns whether the prefix may go on past it: it
    /// stops at the first run that does not pay (loading is worth it only
    /// where it is faster than computing).
    fn take(&mut self, upto: u32, from: (NodeId, Tier), per_block: u64, network: Network) -> bool {
        let upto = upto.min(self.blocks).max(self.covered);
        if upto == self.covered {
            return true;
        }
        if from.1 != Tier::L0Hbm && per_block >= self.node.compute_ns_per_block {
            return false;
        }
        if from.1 != Tier::L0Hbm {
            self.moves.push(Move { first: self.covered, last: upto, from, to: self.node.node, network });
        }
        self.load_ns = self.load_ns.saturating_add(u64::from(upto - self.covered).saturating_mul(per_block));
        self.covered = upto;
        true
    }
}

#[cfg(test)]
mod tests;
