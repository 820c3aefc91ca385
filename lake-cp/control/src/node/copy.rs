//! Copies of this node's blocks into other nodes' L1 (replication, a
//! write-back elsewhere, a drain), a block held here only in L2 promoted
//! into L1 first; and engines' pulls of other nodes' blocks into this
//! node's L1, which the summary's leader relays to their holders.

use super::*;

/// Shared prefixes kept, at most: past it, the oldest marks are let go of
/// (such a block then moves when pulled, as any).
const SHARED_MAX: usize = 1 << 16;

/// The blocks of this node that two or more chains here continue: a
/// block with two or more children here, and every block above it (a
/// system prompt of several blocks is read by every request that starts
/// with it, not only its last block). A pull copies such a block to its
/// reader and the holder keeps its own, where pulls move blocks. A block
/// stays marked while it is held, though the chains under it go: it was
/// read by several.
#[derive(Debug, Default)]
pub struct Shared {
    marked: std::collections::HashSet<BlockKey>,
    order: std::collections::VecDeque<BlockKey>,
    /// Pulls of such blocks copied rather than moved.
    pub kept: u64,
}

impl Shared {
    /// A block was added under `parent`: where `parent` is continued by
    /// two or more blocks now, it and the blocks above it are marked.
    pub(super) fn continued(&mut self, index: &crate::index::Index, parent: Option<BlockKey>) {
        let Some(mut at) = parent.and_then(|key| index.get(&key)) else { return };
        if index.children(at) < 2 {
            return;
        }
        loop {
            let key = index.key(at);
            if !self.marked.insert(key) {
                return; // Its ancestors were marked with it.
            }
            self.order.push_back(key);
            if self.order.len() > SHARED_MAX
                && let Some(oldest) = self.order.pop_front()
            {
                self.marked.remove(&oldest);
            }
            let Some(up) = index.parent(at) else { return };
            at = up;
        }
    }

    /// Whether `key`, held here, is a shared prefix.
    pub(super) fn contains(&self, index: &crate::index::Index, key: &BlockKey) -> bool {
        self.marked.contains(key) && index.get(key).is_some()
    }
}

impl Node {
    /// Asks this node's `lake-dp` to copy block `key` (its ready L1
    /// replica here) into any slot of another node's L1 (`to`: its node,
    /// region and epoch) — replication, a write-back elsewhere, a drain;
    /// the copy lands there checked and is published by that node's
    /// `lake-cp`. Sent with the next plan; returns its request id. A block
    /// held here only in L2 (or L3) is promoted into L1 first (its replica
    /// there stays) — [`PROMOTIONS_IN_FLIGHT`] at a time, one refused for want
    /// of a slot asked again shortly — and copied once it is there; the id
    /// is then 0, and the copy is dropped if the block is not in L1
    /// within [`PROMOTION_WAIT_NS`] (whoever asked, asks again).
    pub fn copy_to(&mut self, key: &BlockKey, to: ReplicaWire, priority: Priority) -> Result<u64, NodeError> {
        if to.node == self.node.0 || to.tier != Tier::L1Dram as u8 {
            return Err(NodeError::Field("copy_to: another node's L1"));
        }
        let Some(source) = self.locations.ready(key).find(|r| r.tier == Tier::L1Dram && r.node == self.node) else {
            return self.promote_for_copy(key, to, priority);
        };
        self.copy_requests += 1;
        let request = COPY_REQUESTS | self.copy_requests;
        let target = ReplicaWire { slot: lake_dp::wire::message::SLOT_ANY, generation: 0, ..to };
        // Not sent by then, its data plane drops it (its slot is held
        // while it waits).
        let wait_ms = self.tiers.copy_deadline_ms();
        let deadline_unix_ns =
            if wait_ms == 0 { 0 } else { unix_ns().saturating_add(wait_ms.saturating_mul(1_000_000)) };
        let transfer = Transfer {
            source: source.to_wire(),
            target,
            key: *key,
            deadline_unix_ns,
            priority: priority as u8,
            reserved: [0; 7],
        };
        self.copies.push(TierCommand { request, region: source.region.0, action: TierAction::Copy(transfer) });
        if self.copies_out.len() < COPIES_OUT_MAX {
            self.copies_out.insert(request, (source.region.0, self.draining, transfer));
        }
        // A pull's copy, where pulls move blocks: the reader's copy is the
        // pool's once it landed (a block promoted for it comes here too),
        // and this node's a copy unless it is a shared prefix then.
        if priority == Priority::CriticalLoad && self.pulls_move && self.placing.len() < COPIES_OUT_MAX {
            self.placing.insert(request, (*key, true));
        }
        Ok(request)
    }

    /// A copy of `key` placing it elsewhere landed (`to_reader`: moving it
    /// to the node that pulled it): whether this node's copy is a copy now
    /// ([`crate::tier::Tiers::placed_away`]). A shared prefix pulled stays
    /// the pool's here too: it is read here as well. A copy is withheld
    /// from the cluster summary at once ([`crate::location::Locations::
    /// withhold`]): while it waits to go, other nodes read the pool's.
    pub(super) fn goes_from_here(&mut self, key: &BlockKey, to_reader: bool) -> bool {
        if to_reader && self.shared.contains(&self.locations.index, key) {
            self.shared.kept += 1;
            return false;
        }
        let placed = self.tiers.placed_away(key);
        if placed {
            self.locations.withhold(key);
        }
        placed
    }

    /// The pool's placement: block `key`, saved here, belongs in another
    /// node's L1 (`to`: its home, `lake-cp::summary::place`). Copied
    /// there as a write-back from its L1 replica here (none: nothing is
    /// done — a block already demoted is not promoted to be placed); once
    /// the home has it, this node's copy is a copy as a pulled one is
    /// ([`crate::tier::Tiers::placed_away`]). A copy the home refuses (no
    /// room, its tenant's cap) leaves the block here as it was.
    pub fn place_to(&mut self, key: &BlockKey, to: ReplicaWire) -> Result<u64, NodeError> {
        if !self.locations.ready(key).any(|r| r.tier == Tier::L1Dram && r.node == self.node) {
            return Err(NodeError::Field("place_to: not in L1 here"));
        }
        let request = self.copy_to(key, to, Priority::WriteBack)?;
        if self.placing.len() < COPIES_OUT_MAX {
            self.placing.insert(request, (*key, false));
        }
        Ok(request)
    }

    /// Takes back copy `request` ([`Node::copy_to`]): its data plane drops
    /// it if it has not gone out yet — it is answered `Cancelled` — and
    /// lets it finish if it has. Whether it was a copy still out.
    pub fn cancel_copy(&mut self, request: u64) -> bool {
        let Some(&(region, _, _)) = self.copies_out.get(&request) else { return false };
        if self.copies_again.get(&request).is_some_and(|again| again.waiting) {
            // Not at its data plane: answered here.
            self.copies_again.remove(&request);
            self.transfer_done(request, lake_dp::wire::message::ErrorCode::Cancelled as u32);
            return true;
        }
        self.copies.push(TierCommand { request, region, action: TierAction::Cancel });
        true
    }

    /// Copy `request`'s answer, `status`: refused because every send of
    /// its data plane was taken, or the target had no slot free yet
    /// (`QueueFull` — a pull of a long prefix asks more at once than the
    /// puller has victims marked), it is asked again shortly — after
    /// [`COPY_AGAIN_FIRST_NS`], doubling to [`COPY_AGAIN_NS`] — until its
    /// deadline ([`COPY_AGAIN_FOR_NS`] where it has none), rather than
    /// failed.
    /// Whether it was kept to be asked again.
    pub(super) fn copy_again(&mut self, request: u64, status: u32) -> bool {
        if status != lake_dp::wire::message::ErrorCode::QueueFull as u32 {
            if !self.copies_again.is_empty() {
                self.copies_again.remove(&request);
            }
            return false;
        }
        let Some(&(_, _, transfer)) = self.copies_out.get(&request) else { return false };
        let now = unix_ns();
        let again = self.copies_again.entry(request).or_insert(CopyAgain {
            at_ns: 0,
            until_ns: if transfer.deadline_unix_ns == 0 {
                now.saturating_add(COPY_AGAIN_FOR_NS)
            } else {
                transfer.deadline_unix_ns
            },
            waiting: false,
            wait_ns: 0,
        });
        if now >= again.until_ns {
            self.copies_again.remove(&request);
            return false;
        }
        again.wait_ns = (again.wait_ns * 2).clamp(COPY_AGAIN_FIRST_NS, COPY_AGAIN_NS);
        again.at_ns = now.saturating_add(again.wait_ns);
        again.waiting = true;
        self.copies_asked_again += 1;
        true
    }

    /// When the first copy refused for want of a send is due to be asked
    /// again (Unix ns), if any waits: the event loop waits no longer.
    pub fn copy_again_due(&self) -> Option<u64> {
        self.copies_again.values().filter(|again| again.waiting).map(|again| again.at_ns).min()
    }

    /// The copies refused for want of a send whose wait is over go to
    /// the data plane again.
    pub(super) fn copies_due(&mut self) {
        if self.copies_again.is_empty() {
            return;
        }
        let now = unix_ns();
        for (&request, again) in &mut self.copies_again {
            if !again.waiting || now < again.at_ns {
                continue;
            }
            let Some(&(region, _, transfer)) = self.copies_out.get(&request) else { continue };
            again.waiting = false;
            self.copies.push(TierCommand { request, region, action: TierAction::Copy(transfer) });
        }
    }

    /// A copy of a block held here only in L2 or L3: queued for its
    /// promotion into this node's L1, the copy to follow
    /// ([`Node::copy_to`]).
    fn promote_for_copy(&mut self, key: &BlockKey, to: ReplicaWire, priority: Priority) -> Result<u64, NodeError> {
        if self.below_l1(key).is_none() {
            return Err(NodeError::Field("copy_to: no ready replica here"));
        }
        if self.locations.region_of(self.node, Tier::L1Dram).is_none() {
            return Err(NodeError::Field("copy_to: no L1 region here"));
        }
        if let Some(waiting) = self.promoting.get_mut(key) {
            // Asked again (the leader's next round): the same copy.
            waiting.to = to;
            return Ok(0);
        }
        if self.promoting.len() >= PROMOTING_MAX {
            return Err(NodeError::Field("copy_to: too many copies waiting for promotions"));
        }
        let until_ns = self.now_ns.saturating_add(PROMOTION_WAIT_NS);
        self.promoting.insert(*key, Promoting { to, priority, until_ns, asked: None, retry_at_ns: 0 });
        Ok(0)
    }

    /// Copies whose block is in L1 now go; those whose wait ran out are
    /// dropped; promotions are asked, a few at a time.
    pub(super) fn copy_promoted(&mut self, now_ns: u64) {
        if self.promoting.is_empty() {
            return;
        }
        let node = self.node;
        let locations = &self.locations;
        let ready: Vec<(BlockKey, ReplicaWire, Priority)> = self
            .promoting
            .iter()
            .filter(|(key, _)| locations.ready(key).any(|r| r.tier == Tier::L1Dram && r.node == node))
            .map(|(&key, p)| (key, p.to, p.priority))
            .collect();
        self.promoting.retain(|key, p| p.until_ns > now_ns && !ready.iter().any(|(k, _, _)| k == key));
        for (key, to, priority) in ready {
            if self.copy_to(&key, to, priority).is_err() {
                self.copies_failed += 1;
            }
        }
        let mut in_flight = self.promoting.values().filter(|p| p.asked.is_some()).count();
        let due: Vec<BlockKey> = self
            .promoting
            .iter()
            .filter(|(_, p)| p.asked.is_none() && p.retry_at_ns <= now_ns)
            .map(|(&key, _)| key)
            .collect();
        for key in due {
            if in_flight >= PROMOTIONS_IN_FLIGHT {
                break;
            }
            let (Some(source), Some((l1, info))) = (self.below_l1(&key), self.locations.region_of(node, Tier::L1Dram))
            else {
                // Its replica went (evicted, purged): nothing to copy.
                self.promoting.remove(&key);
                continue;
            };
            let Some(waiting) = self.promoting.get_mut(&key) else { continue };
            self.copy_requests += 1;
            let request = PROMOTE_REQUESTS | self.copy_requests;
            let target = ReplicaWire {
                tier: Tier::L1Dram as u8,
                node: node.0,
                region: l1,
                region_epoch: info.epoch,
                slot: lake_dp::wire::message::SLOT_ANY,
                generation: 0,
                ..source.to_wire()
            };
            let transfer = Transfer {
                source: source.to_wire(),
                target,
                key,
                deadline_unix_ns: 0,
                priority: waiting.priority as u8,
                reserved: [0; 7],
            };
            self.copies.push(TierCommand { request, region: source.region.0, action: TierAction::Copy(transfer) });
            waiting.asked = Some(request);
            self.copy_promotions += 1;
            in_flight += 1;
        }
    }

    /// This node's ready replica of `key` below L1 a copy is promoted
    /// from: its L2 one, else its L3 one.
    fn below_l1(&self, key: &BlockKey) -> Option<Replica> {
        let node = self.node;
        let below = |tier| self.locations.ready(key).find(|r| r.tier == tier && r.node == node);
        below(Tier::L2Nvme).or_else(|| below(Tier::L3Object))
    }

    /// A promotion for a copy ended (`status` 0: the block is in L1, its
    /// commit reported): one refused is asked again shortly.
    pub(super) fn promotion_done(&mut self, request: u64, status: u32) {
        let Some(waiting) = self.promoting.values_mut().find(|p| p.asked == Some(request)) else { return };
        if status != 0 {
            self.copy_promotions_failed += 1;
            waiting.asked = None;
            waiting.retry_at_ns = self.now_ns.saturating_add(PROMOTION_RETRY_NS);
        }
    }
}

/// How soon a copy that found no send free is asked again the first
/// time (ns): the puller's control plane marks more victims within a
/// pass of hearing its data plane ran out.
pub(super) const COPY_AGAIN_FIRST_NS: u64 = 250_000;

/// The longest wait between two asks of a copy that found no send free
/// (ns).
pub(super) const COPY_AGAIN_NS: u64 = 2_000_000;

/// How long a copy with no deadline is asked again (ns).
const COPY_AGAIN_FOR_NS: u64 = 10_000_000_000;

/// A copy its data plane refused for want of a send: asked again at
/// `at_ns` (`waiting`: not at the data plane now) until `until_ns`.
#[derive(Clone, Copy, Debug)]
pub(super) struct CopyAgain {
    at_ns: u64,
    until_ns: u64,
    waiting: bool,
    /// The last wait (ns; 0 before the first).
    wait_ns: u64,
}

/// Pulls an engine may have waiting for the leader at once.
const PULLS_MAX: usize = 4096;

/// How long after its pull a block's new L1 copy here is taken for the
/// pulled one.
pub(super) const PULL_LANDS_NS: u64 = 10_000_000_000;

/// Pulls asked within this long of a batch's first are of that batch (an
/// engine asks a prefix's blocks at once).
pub(super) const PULL_BATCH_NS: u64 = 1_000_000;

impl Node {
    /// An engine's pull of another node's block into this node's L1
    /// (the holder and its tier as the cluster view named them), kept for
    /// the summary's leader ([`Node::take_pulls`]) — or, held there only in
    /// L3 and this node having an object store, read from the store by
    /// this node's data plane ([`Node::read_from_store`]). Refused where it
    /// does not name another node and this node's L1, and where the
    /// engine asking (connection `peer`) may not read the block's
    /// namespace ([`Node::may_pull`]).
    pub(super) fn pull(&mut self, peer: u64, transfer: &Transfer) -> Result<(), NodeError> {
        if transfer.target.node != self.node.0 || transfer.target.tier != Tier::L1Dram as u8 {
            return Err(NodeError::Field("pull: into this node's L1"));
        }
        if transfer.source.node == self.node.0 {
            return Err(NodeError::Field("pull: from another node"));
        }
        // The namespace rides in the source's region epoch.
        if !self.may_pull(peer, transfer.source.region_epoch) {
            self.pulls_refused += 1;
            return Err(NodeError::Field("pull: a namespace of a tenant not this engine's"));
        }
        if self.pulls.len() >= PULLS_MAX {
            return Err(NodeError::Field("pull: too many waiting"));
        }
        if !(transfer.source.tier == Tier::L3Object as u8 && self.read_from_store(transfer)) {
            self.relay(transfer);
        }
        let now = unix_ns();
        if self.pulling.len() >= PULLS_MAX * 16 {
            self.pulling.retain(|_, at| now < *at + PULL_LANDS_NS);
        }
        if let Some(at) = self.pulling.remove(&transfer.key) {
            // Asked again (the first ask went nowhere, or is slow): its
            // batch measures nothing, this ask is timed from now.
            self.pull_batches.remove(&at);
        }
        if self.pulling.len() < PULLS_MAX * 16 {
            // Of the batch asked within the last moment, or the first of
            // one.
            let joins = self.pull_batches.contains_key(&self.pull_batch_at) && now < self.pull_batch_at + PULL_BATCH_NS;
            if !joins {
                self.pull_batches.retain(|&at, _| now < at + PULL_LANDS_NS);
                self.pull_batch_at = now;
            }
            if joins || self.pull_batches.len() < PULLS_MAX {
                self.pull_batches.entry(self.pull_batch_at).or_default().0 += 1;
                self.pulling.insert(transfer.key, self.pull_batch_at);
            }
        }
        Ok(())
    }

    /// Tells the node how the data plane tells the engines of the tenants
    /// kept apart ([`Node::with_tenant_mirrors`]) apart: each one's
    /// namespaces, users and groups, in the same order.
    #[must_use]
    pub fn with_tenant_engines(mut self, partitions: lake_dp::runner::config::Partitions) -> Self {
        self.tenant_engines = partitions;
        self
    }

    /// An engine connected on `peer` as user `uid` and group `gid`, as the
    /// kernel saw it connect: a tenant's, where the data plane gives that
    /// user (or, failing it, that group) a tenant's partition.
    pub fn engine_came(&mut self, peer: u64, uid: u32, gid: u32) {
        let partition = self.tenant_engines.of_peer(uid, gid);
        if partition > 0 {
            self.engine_tenants.insert(peer, partition);
        }
    }

    /// Whether the engine on `peer` may pull a block of `namespace`: in a
    /// pool keeping tenants apart, only into the partition it maps (a
    /// tenant's engine, its tenant's namespaces; any other, the pool's).
    /// A pull would land the block in its namespace's partition, taking
    /// that tenant's room for a read its engines never asked. A node not
    /// told whose engines are whose takes no pull there.
    fn may_pull(&self, peer: u64, namespace: u64) -> bool {
        if self.tenant_mirrors.is_empty() {
            return true;
        }
        let asker = self.engine_tenants.get(&peer).copied().unwrap_or(0);
        !self.tenant_engines.each.is_empty() && asker == self.tenant_engines.of_namespace(namespace)
    }

    /// A block pulled in a batch asked at `at` landed: once the batch's
    /// last has, its time over its blocks is what a pulled block cost
    /// (a batch some block of which never lands is no measure).
    pub(super) fn pull_landed(&mut self, at: u64) {
        let Some((asked, landed)) = self.pull_batches.get_mut(&at) else { return };
        *landed += 1;
        if *landed < *asked {
            return;
        }
        let blocks = u64::from(*asked);
        self.pull_batches.remove(&at);
        let cost = unix_ns().saturating_sub(at) / blocks.max(1);
        self.pull_ns_per_block =
            if self.pull_ns_per_block == 0 { cost.max(1) } else { (3 * self.pull_ns_per_block + cost) / 4 };
    }

    /// Asks this node's data plane to read a pulled block held elsewhere
    /// only in L3 from its own object store: the pool's nodes share one,
    /// where the object is named by its namespace (the pull's
    /// `source.region_epoch`) and key, so the block comes straight from
    /// the store instead of through its holder. False where this node has
    /// no L3 (or L1) region, or too many such reads wait.
    fn read_from_store(&mut self, pull: &Transfer) -> bool {
        let (Some((l3, _)), Some((l1, l1_info))) =
            (self.locations.region_of(self.node, Tier::L3Object), self.locations.region_of(self.node, Tier::L1Dram))
        else {
            return false;
        };
        if self.store_reads.len() >= PULLS_MAX {
            return false;
        }
        let any = |tier: Tier, region, region_epoch| ReplicaWire {
            tier: tier as u8,
            reserved: 0,
            region,
            node: self.node.0,
            region_epoch,
            slot: lake_dp::wire::message::SLOT_ANY,
            generation: 0,
        };
        self.copy_requests += 1;
        let request = STORE_READ_REQUESTS | self.copy_requests;
        let read = Transfer {
            // By name: the namespace in place of the region's epoch.
            source: any(Tier::L3Object, l3, pull.source.region_epoch),
            target: any(Tier::L1Dram, l1, l1_info.epoch),
            key: pull.key,
            deadline_unix_ns: 0,
            priority: Priority::CriticalLoad as u8,
            reserved: [0; 7],
        };
        self.copies.push(TierCommand { request, region: l3, action: TierAction::Copy(read) });
        self.store_reads.insert(request, *pull);
        true
    }

    /// A pull's read from the store ended: one that failed (the store has
    /// no such object — it is not shared with the holder's — or it did not
    /// check) is relayed to the holder through the summary's leader.
    pub(super) fn store_read_done(&mut self, request: u64, status: u32) {
        let Some(pull) = self.store_reads.remove(&request) else { return };
        if status == 0 {
            self.store_reads_done += 1;
            return;
        }
        self.store_reads_failed += 1;
        if self.pulls.len() < PULLS_MAX {
            self.relay(&pull);
        }
    }

    /// Keeps `pull` for the summary's leader, its target naming this
    /// node's L1 region and epoch: the leader learns them from the
    /// membership, or a block held there, only a moment after the node
    /// starts, and till then could send no copy here.
    fn relay(&mut self, pull: &Transfer) {
        let mut pull = *pull;
        if let Some((region, info)) = self.locations.region_of(self.node, Tier::L1Dram) {
            pull.target.region = region;
            pull.target.region_epoch = info.epoch;
        }
        self.pulls.push(pull);
    }

    /// The engines' pulls since the last call, for the leader.
    pub fn take_pulls(&mut self) -> Vec<Transfer> {
        core::mem::take(&mut self.pulls)
    }
}
