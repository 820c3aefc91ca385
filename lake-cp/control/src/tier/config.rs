//! The tier manager's settings, the commands it sends the data planes,
//! and its counters.

use super::*;

/// A command not answered within this time is given up (its block goes
/// back in the cache).
pub const PENDING_TIMEOUT_NS: u64 = 30_000_000_000;

/// A block whose command the data plane refused waits this long before
/// it may be chosen again.
pub const RETRY_WAIT_NS: u64 = 50_000_000;

/// Commands one planning pass may issue at most (the rest wait for the
/// next pass, so a burst of pressure does not flood the data plane).
pub const COMMANDS_PER_PASS: usize = 256;

/// Which policy each space runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// [`Lake`]: shadow experts (the default).
    #[default]
    Lake,
    /// [`Lru`]: the baseline.
    Lru,
}

impl PolicyKind {
    /// By name: `lake` or `lru`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "lake" => Some(Self::Lake),
            "lru" => Some(Self::Lru),
            _ => None,
        }
    }

    pub(super) fn build(self, capacity_blocks: usize) -> Box<dyn Policy + Send> {
        match self {
            Self::Lake => Box::new(Lake::new(capacity_blocks.max(1))),
            Self::Lru => Box::new(Lru::default()),
        }
    }
}

/// When blocks are written to L3 (the object store).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum L3WriteBack {
    /// When they leave L2 (or L1 with nowhere else to go): L3 holds what
    /// the node's faster tiers could not.
    #[default]
    #[value(name = "evict")]
    OnEviction,
    /// As soon as they are saved, whatever the pressure: L3 holds
    /// everything, the source of truth.
    Eager,
}

/// Which L1 victims are written to L2 (the rest are dropped from L1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum L2Admission {
    /// Every victim L2 has room for; once L2 is over its high-water mark
    /// its policy also judges each against its own victim.
    #[default]
    Always,
    /// Only a block seen a second time — looked up and hit after it was
    /// saved, or saved again after an earlier victim of it was dropped —
    /// or the continuation of a prefix seen a second time (its parent
    /// was: a conversation's next turn). A block used once (a one-off
    /// document) is not worth an L2 write. Remembered for the last
    /// [`SEEN_MAX`] blocks of each kind.
    SecondAccess,
}

/// Blocks the second-access filter remembers, of those seen again and of
/// those dropped (each a bounded FIFO set).
pub const SEEN_MAX: usize = 1 << 20;

/// A namespace's byte quota in one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// The namespace id.
    pub namespace: u64,
    /// The tier.
    pub tier: Tier,
    /// Bytes it may hold there.
    pub bytes: u64,
}

/// A tenant's byte quota in one tier, over all its namespaces (the
/// namespaces are the tenant's as the operator says: a namespace id names
/// a tenant key only to those who hold it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantQuota {
    /// The tenant's name (for logs and `/metrics`).
    pub tenant: String,
    /// Its namespaces.
    pub namespaces: Vec<u64>,
    /// The tier.
    pub tier: Tier,
    /// Bytes its namespaces may hold there together.
    pub bytes: u64,
}

/// How the tiers are managed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes each tier may hold, by `Tier as usize` (`None`: what its
    /// regions hold).
    pub capacity_bytes: [Option<u64>; 4],
    /// Per-namespace quotas.
    pub quotas: Vec<Quota>,
    /// Per-tenant quotas, over several namespaces.
    pub tenant_quotas: Vec<TenantQuota>,
    /// Eviction starts above this percentage of a tier's capacity...
    pub high_percent: u8,
    /// ...and stops below this one.
    pub low_percent: u8,
    /// The policy of every space.
    pub policy: PolicyKind,
    /// When blocks go to L3 (where a node has an object store).
    pub l3_write_back: L3WriteBack,
    /// Which L1 victims are written to L2.
    pub l2_admission: L2Admission,
    /// A copy to another node not sent by then (held behind its tenant's
    /// cap, say) is dropped by its data plane, its slot released: the
    /// deadline every copy carries, from when it is asked (ms; 0: none).
    pub copy_deadline_ms: u64,
    /// The tenants whose L1 blocks lie in partitions of the arena of their
    /// own (the bytes of each, its namespaces): L1's own marks count
    /// neither their bytes nor their blocks (their L1 quotas hold them),
    /// so the rest of L1 is held to what is left of it.
    pub l1_partitions: Vec<(u64, Vec<u64>)>,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: [None; 4],
            quotas: Vec::new(),
            tenant_quotas: Vec::new(),
            high_percent: 95,
            low_percent: 90,
            policy: PolicyKind::Lake,
            l3_write_back: L3WriteBack::OnEviction,
            l2_admission: L2Admission::Always,
            copy_deadline_ms: 30_000,
            l1_partitions: Vec::new(),
        }
    }
}

impl TierConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.low_percent == 0 || self.low_percent >= self.high_percent || self.high_percent > 100 {
            return Err(format!(
                "tiers: need 0 < low_percent ({}) < high_percent ({}) <= 100",
                self.low_percent, self.high_percent
            ));
        }
        Ok(())
    }
}

/// A command for the `lake-dp` holding `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierCommand {
    /// Its request id (the data plane's `TransferDone` echoes it).
    pub request: u64,
    /// The region of the replica it acts on (routes it to its `lake-dp`).
    pub region: u16,
    /// What to do.
    pub action: TierAction,
}

/// What a [`TierCommand`] asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierAction {
    /// Write the source into the target tier, then free the source.
    Move(Transfer),
    /// Write the source into the target (another node's L1), keep it.
    Copy(Transfer),
    /// Free the replica.
    Evict(BlockEvicted),
    /// Drain the L2 region (its data plane writes nothing new there), or
    /// use it again.
    Drain(DrainRegion),
    /// Take back the command's request (a copy to another node not sent
    /// yet): the data plane drops it (`Cancel`, wire kind 10).
    Cancel,
    /// An L1 block chosen as a victim: its data plane may take it for a
    /// save that finds no free slot (`MarkEvictable`; not answered).
    Mark(BlockEvicted),
    /// The mark taken back (`UnmarkEvictable`): the block is wanted again,
    /// or its copy below went.
    Unmark(BlockEvicted),
    /// Whether more victims may come in an L1 region (`VictimsLeft`; not
    /// answered): with none, its data plane refuses a save that finds no
    /// slot at once instead of waiting.
    VictimsLeft(lake_dp::wire::message::VictimsLeft),
}

/// What the manager has done, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Demotions asked (L1→L2).
    pub demotions: u64,
    /// Moves to L3 asked (L2→L3, or L1→L3 on a node without room in L2).
    pub l3_moves: u64,
    /// Eager write-backs asked (copies to L3).
    pub l3_copies: u64,
    /// Eager write-backs let go because the queue was full.
    pub l3_copies_dropped: u64,
    /// Eager write-backs the data plane could not take at once (its
    /// store's queue full), queued again.
    pub l3_copies_deferred: u64,
    /// Write-backs asked (L1→L2, the L1 copy kept: [`Tiers::persist`]).
    pub l2_write_backs: u64,
    /// Drops asked, by the tier dropped from (`Tier as usize`).
    pub drops: [u64; 4],
    /// L1 victims dropped rather than demoted because L2's policy did not
    /// admit them into a full L2.
    pub admission_refused: u64,
    /// Victims passed over because a lease held them.
    pub leased_kept: u64,
    /// Victims passed over because a copy of them (to L3, to another
    /// node) was in flight.
    pub copying_kept: u64,
    /// Commands that failed or timed out (their blocks went back): the
    /// sum of the four below.
    pub failed: u64,
    /// Of those, refused by the data plane, by error code (index: the
    /// code; 0: an unknown one).
    pub refused: [u64; 16],
    /// Of those, not answered within [`PENDING_TIMEOUT_NS`].
    pub timed_out: u64,
    /// Of those, in flight when their data plane's link closed.
    pub link_lost: u64,
    /// Of those, never sent: no data plane holds the region, or it cannot
    /// take the command (an older build).
    pub unrouted: u64,
    /// Evictions reported for a block no space knew (not counted off).
    pub unattributed: u64,
    /// Second copies of a block in one region, evicted.
    pub duplicates: u64,
    /// Blocks asked out because their tenant was over its quota.
    pub tenant_quota_evictions: u64,
    /// L1 victims dropped rather than written to L2 because the
    /// second-access filter had not seen them twice.
    pub l2_filtered: u64,
    /// Replicas dropped by purges of their namespace.
    pub purged: u64,
    /// Purges asked, and those that finished (the namespace held nothing
    /// more in any tier).
    pub purges_started: u64,
    /// See `purges_started`.
    pub purges_done: u64,
    /// Blocks moved off a drained L2 region to another (`MoveBlock`
    /// L2→L2 asked).
    pub drain_moves: u64,
    /// Replicas in a drained L2 region dropped because another L2 region
    /// or L3 holds the block.
    pub drain_drops: u64,
    /// L1 blocks written below ahead of demand (their L1 copy kept), so
    /// that a save may take their slot at once.
    pub cleanings: u64,
    /// Write-backs of L1 blocks its data plane put off (no free L1 slot to
    /// stage the block in): asked again later.
    pub write_backs_deferred: u64,
    /// L1 blocks marked evictable in their data plane: with a copy below,
    /// and without one (no lower tier had room: dropped if taken).
    pub marked_clean: u64,
    /// See [`TierCounters::marked_clean`].
    pub marked_drop: u64,
    /// Marks taken back (the block wanted again, its copy below gone).
    pub unmarked: u64,
    /// Victims (marked, or being written below to be marked) taken back
    /// because a new block continued them: no leaf any more.
    pub victims_continued: u64,
    /// Marked blocks a save took on the spot, by their data plane: with a
    /// copy below, and dropped.
    pub taken_clean: u64,
    /// See [`TierCounters::taken_clean`].
    pub taken_dropped: u64,
    /// L1 victims offered to the pool rather than dropped (no room below
    /// here), those placed in another member, and those not (dropped).
    pub spills: u64,
    /// See [`TierCounters::spills`].
    pub spills_landed: u64,
    /// See [`TierCounters::spills`].
    pub spills_unplaced: u64,
}
