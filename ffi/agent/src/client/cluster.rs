//! The engine's lookup across the pool's nodes: its node's mirror first,
//! then the cluster view of what every other node holds.

use lake_core::mirror::view::{self, Where};
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
}
