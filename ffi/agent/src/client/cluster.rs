//! The engine's lookup across the pool's nodes: its node's mirror first,
//! then the cluster view of what every other node holds; and pulls of
//! blocks only other nodes hold into this node's L1.

use std::time::Duration;

use lake_core::mirror::view::{self, Holder, PullWait, Where};
use lake_core::model::key::BlockKey;

use super::Agent;

impl Agent {
    /// The longest prefix of `keys` held anywhere in the pool, and where
    /// each block of it is (into `out`): on this node (its mirror entry,
    /// loaded as [`Agent::lookup`]'s are), or only on another node (which,
    /// in which tier). Where the pool keeps no cluster view (a single
    /// node, or a view not published yet), this node's blocks only. Shared
    /// memory only; the run of this node's blocks is reported to `lake-cp`
    /// as [`Agent::lookup`]'s hits are.
    pub fn lookup_cluster(&mut self, keys: &[BlockKey], out: &mut Vec<Where>) -> usize {
        let found = view::lookup(&self.mirror, self.cluster.reader(), keys, out);
        let local = out.iter().take_while(|w| matches!(w, Where::Local(_))).count();
        self.report_access(keys, local);
        found
    }

    /// Asks for each block of `pulls`, held by another node, to be copied
    /// into this node's L1: this node's `lake-cp` has the summary's leader
    /// ask the holder, whose data plane sends it over the storage network
    /// — or, a block held only in L3, has its own data plane read it from
    /// the object store the nodes share; it lands checked and is
    /// published in this node's mirror. Returns
    /// how many were asked (none where the control plane takes no pulls,
    /// or there is none).
    pub fn pull(&mut self, pulls: &[(BlockKey, Holder)]) -> usize {
        let (node, namespace) = (self.arena.header().node, self.namespace.0);
        let Some(cp) = &mut self.cp else { return 0 };
        let asked =
            pulls.iter().filter(|(key, holder)| cp.pull(key, namespace, holder.node.0, holder.tier, node)).count();
        let _ = cp.pump();
        asked
    }

    /// Makes as much of `keys` this node's as the pool can within
    /// `within`: the blocks of its longest prefix held anywhere that only
    /// other nodes hold are pulled ([`Agent::pull`]), and this waits until
    /// that prefix is in this node's mirror or the time is up. While it
    /// waits the view is read again: a block of this node's that went
    /// meanwhile (moved to another reader), or one whose holder changed,
    /// is pulled from where it is now; a block seen nowhere for a while
    /// (not moving: gone from the pool) ends the wait before it
    /// ([`PullWait`]). Returns this node's hit then, its block table into
    /// `table`: load it as [`Agent::lookup`]'s. A block that went from its
    /// holder before it was copied never lands: the hit ends before it,
    /// and the engine computes the rest — never wrong bytes (a copy lands
    /// checked).
    pub fn pull_cluster(
        &mut self,
        keys: &[BlockKey],
        within: Duration,
        table: &mut Vec<lake_core::mirror::MirrorEntry>,
    ) -> usize {
        let mut wait = PullWait::new(keys, within);
        let mut places = Vec::new();
        loop {
            let writes = self.mirror.writes();
            let (mirror, view) = (&self.mirror, self.cluster.reader());
            let pulls = wait.look(keys, |keys, out| view::lookup(mirror, view, keys, out), &mut places);
            if !pulls.is_empty() && self.pull(&pulls) > 0 {
                wait.asked(&pulls);
            }
            let hit = self.mirror.lookup(&keys[..wait.found()], table);
            if wait.over(hit) {
                self.report_access(keys, hit);
                return hit;
            }
            if let Some(cp) = &mut self.cp {
                let _ = cp.pump();
            }
            wait.sleep(&self.mirror, writes);
        }
    }
}
