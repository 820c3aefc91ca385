//! A request's hit view as one node reads it: its mirror (this node's
//! blocks, with their tiers) and its cluster view (every other node's),
//! walked block by block into every node's leading runs and the pool's
//! prefix in runs by fastest holder — what [`super::route`] weighs.

use std::collections::BTreeMap;

use super::{HitView, NodeHits, PoolRun};
use crate::mirror::MirrorReader;
use crate::mirror::view::{self, ViewReader};
use crate::{BlockKey, NodeId, Tier};

/// The hit view of `keys` (a prompt's blocks, in order) from `mirror` and
/// `view`: every node's leading run in each tier, and the pool's prefix
/// in runs by fastest holder — the nodes of `down` left out, their blocks
/// as good as gone but for those in L3 (the store's, read by any node).
/// This node is the mirror's (its header's node).
pub fn hit_view(mirror: &MirrorReader, view: Option<&ViewReader>, keys: &[BlockKey], down: &[NodeId]) -> HitView {
    let mut hits = Hits::default();
    let here = NodeId(mirror.header().node);
    let mut holders = Vec::new();
    view::walk(mirror, view, keys, |i, local, remote| {
        holders.clear();
        // The mirror names this node's fastest replica.
        if let Some(entry) = local {
            holders.push((here, entry.tier));
        }
        holders.extend(remote.iter().map(|h| (h.node, h.tier)));
        holders.retain(|(node, tier)| !down.contains(node) || *tier == Tier::L3Object);
        !holders.is_empty() && hits.add(u32::try_from(i).unwrap_or(u32::MAX), &holders)
    });
    hits.into_view()
}

/// A hit view being built, block by block.
#[derive(Default)]
struct Hits {
    /// Per node: its leading run through each tier, and whether each run
    /// is still going.
    nodes: BTreeMap<NodeId, ([u32; 4], [bool; 4])>,
    pool: Vec<PoolRun>,
    pool_going: bool,
}

impl Hits {
    /// Block `block`, held by `holders` (node, fastest tier there).
    /// Returns whether any run may still go on.
    fn add(&mut self, block: u32, holders: &[(NodeId, Tier)]) -> bool {
        for &(node, _) in holders {
            self.nodes.entry(node).or_insert(([0; 4], [block == 0; 4]));
        }
        let mut going = false;
        for (node, (through, open)) in &mut self.nodes {
            let tier = holders.iter().find(|(n, _)| n == node).map(|&(_, t)| t as usize);
            for t in 0..4 {
                open[t] = open[t] && tier.is_some_and(|held| held <= t);
                through[t] += u32::from(open[t]);
                going |= open[t];
            }
        }
        // The pool's run: the fastest holder below HBM (the lowest node
        // among equals); a block only in HBM ends it.
        if block == 0 {
            self.pool_going = true;
        }
        let best = holders.iter().filter(|(_, t)| *t != Tier::L0Hbm).min_by_key(|&&(node, tier)| (tier as u8, node.0));
        match best {
            Some(&(node, tier)) if self.pool_going => match self.pool.last_mut() {
                Some(run) if run.node == node && run.tier == tier && run.last == block => run.last += 1,
                _ => self.pool.push(PoolRun { first: block, last: block + 1, node, tier }),
            },
            _ => self.pool_going = false,
        }
        going || self.pool_going
    }

    fn into_view(self) -> HitView {
        let nodes = self.nodes.into_iter().map(|(node, (through, _))| NodeHits { node, through }).collect();
        HitView { nodes, l3_through: 0, pool: self.pool }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_nodes_leading_runs_and_the_pools_runs_by_fastest_holder() {
        let (a, b) = (NodeId(1), NodeId(2));
        let mut hits = Hits::default();
        // Block 0: a in L1, b in L2; 1: a in L2; 2: b in L1; 3: b in L3;
        // 4: a in HBM only.
        assert!(hits.add(0, &[(a, Tier::L1Dram), (b, Tier::L2Nvme)]));
        assert!(hits.add(1, &[(a, Tier::L2Nvme)]));
        assert!(hits.add(2, &[(b, Tier::L1Dram)]));
        assert!(hits.add(3, &[(b, Tier::L3Object)]), "the pool's run goes on through the store");
        assert!(!hits.add(4, &[(a, Tier::L0Hbm)]), "no run goes on past a block only in one engine's HBM");
        let view = hits.into_view();
        assert_eq!(
            view.nodes,
            [NodeHits { node: a, through: [0, 1, 2, 2] }, NodeHits { node: b, through: [0, 0, 1, 1] }]
        );
        let run = |first, last, node, tier| PoolRun { first, last, node, tier };
        assert_eq!(
            view.pool,
            [
                run(0, 1, a, Tier::L1Dram),
                run(1, 2, a, Tier::L2Nvme),
                run(2, 3, b, Tier::L1Dram),
                run(3, 4, b, Tier::L3Object)
            ]
        );
    }
}
