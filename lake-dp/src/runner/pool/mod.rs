//! The runner's block service: what `lake-dp` does for the control plane
//! (tier moves and evictions) and for agents (two-phase saves into L1,
//! loads from L2 that promote into L1), on top of the poller.
//!
//! - **Saves**: an agent reserves an L1 slot, writes the stored object
//!   (header naming this slot and generation, then the payload) straight
//!   into shared memory, and commits; the data plane checks the header —
//!   and the payload CRCs, before publishing ([`CommitCheck::Inline`]) or
//!   after, off the commit's path ([`CommitCheck::Background`]: a block
//!   that fails is evicted as corrupt) — then reports the block to
//!   `lake-cp`, which publishes it. A reservation not committed within
//!   [`RESERVATION_TIMEOUT_NS`] is taken back.
//! - **Demotion** (`MoveBlock` L1→L2): the L1 slot's header says what the
//!   block is. The slot is retired first but kept (its generation moves
//!   on, so no new reader pins it; readers already in it finish), and once
//!   no pin is left the data plane owns it alone: the write to a free L2
//!   slot rewrites its header to name the L2 slot and sends header and
//!   payload in one transfer, with no copy and no reader seeing the header
//!   change. Then the L2 replica is reported, the L1 one evicted, and the
//!   slot freed. Readers between the retire and the report miss in L1 (the
//!   block is a cold victim) and find it in L2 right after.
//! - **Promotion** (an agent's `Load`, or `CopyBlock` L2→L1): the block is
//!   read into a free L1 slot and verified against its CRCs; the copy's
//!   header is rewritten to name its L1 slot (so an L1 slot always
//!   describes itself), and the L1 replica is reported.
//! - **Evictions** (`EvictBlock`): the named replica is freed if it is
//!   still the one named (generation checked), and reported.
//!
//! Every command is answered (`TransferDone`), success or not. All tables
//! are sized at start; nothing here allocates once the runner is sealed.

mod agents;
mod commands;
mod compact;
mod invariants;
mod l3;
mod promote;
mod remote;
mod save;
mod verify;

use std::collections::VecDeque;
use std::sync::Arc;

pub(crate) use self::l3::L3Tier;
pub use self::l3::{DELETE_BATCH_MAX, L3Stats};
pub(crate) use self::remote::PoolLanding;

use crate::agent::port::{AgentError, AgentRequest, CrcOrigin, DpPort};
use crate::arena::{ArenaError, SlotTable};
use crate::constants::STORED_HEADER_BYTES;
use crate::cplink::CpLink;
use crate::io::IoBackend;
use crate::l2::L2Grant;
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, Priority, ReplicaWire, Tier};
use crate::op::{Command, Event, L2Slot, OpError, Ticket, WriteBlock};
use crate::poller::L2Geometry;
use crate::region::SlotRegion;
use crate::runner::Parts;
use crate::runner::os::Wakeup;
use crate::stored::{ObjectMeta, StoredError, decode_header, object_bytes};
use crate::wire::message::{BlockEvicted, BlockRecord, ErrorCode, EvictReason, SLOT_ANY, Transfer, TransferDone};

/// A reservation not committed within this time is taken back.
pub const RESERVATION_TIMEOUT_NS: u64 = 30_000_000_000;

/// Cookies of the pool's own poller requests carry this bit (the
/// self-test's do not).
pub const POOL_COOKIE: u64 = 1 << 63;

/// A save refused for want of room keeps the pool "under save pressure"
/// (agents see it without asking, and skip whole saves) this long.
pub const SAVE_PRESSURE_NS: u64 = 100_000_000;

/// What the pool still takes from agents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Closing {
    /// Everything.
    #[default]
    Open,
    /// No new saves (the pool is writing L1 down before it stops): each
    /// is refused `Stopping`; loads are still served.
    Saves,
    /// Nothing new (the data plane drains and stops): saves, commits and
    /// loads are refused `Stopping`, so no engine waits on a pool that is
    /// going.
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum L1State {
    Free,
    Reserved {
        agent: u16,
        since_ns: u64,
    },
    Ready,
    /// Being written to L2 or read from it.
    Busy,
    /// Being read by `readers` sends to other nodes (a block copied to
    /// several nodes at once is read by each): not evicted, demoted or
    /// rewritten until the last one ends.
    Sending {
        readers: u16,
    },
}

/// What an operation in flight is for.
#[derive(Clone, Copy, Debug)]
enum Purpose {
    /// Demotion for `lake-cp`: L1 `l1_slot` → L2, once the slot drained.
    Demote { request: u64, l1_generation: u32, write: WriteBlock },
    /// A write-back for `lake-cp`: an L1 block copied to the staging slot
    /// `stage`, written from there to L2; the L1 copy stays where it was.
    WriteBack { request: u64, stage: u32 },
    /// Promotion into `l1_slot`, for an agent (`agent`, `cookie`) or for
    /// `lake-cp` (`request`).
    Promote { to: Requester, l1_slot: u32, l1_generation: u32 },
    /// An L2 block read into a staging L1 slot for the L3 write `op`.
    StageL3 { op: u32 },
    /// An L2 block moved to another L2 file (a drain), for `lake-cp`'s
    /// `request`: read from `source` into the staging slot `stage`, then
    /// written from there to `target`; the source is freed after.
    Relocate { request: u64, stage: u32, source: L2Slot, source_generation: u32, target: L2Grant, priority: Priority },
}

#[derive(Clone, Copy, Debug)]
enum Requester {
    Agent { agent: u16, cookie: u64 },
    Cp { request: u64 },
}

/// Traced loads in flight at most (a load traced beyond it goes
/// untraced, counted in [`PoolStats::traces_dropped`]), and answered
/// traced loads kept for the runner's log between two of its passes.
pub const TRACED_MAX: usize = 256;

/// A traced load in flight.
#[derive(Clone, Copy, Debug)]
struct TracedLoad {
    agent: u16,
    cookie: u64,
    trace: u64,
    tier: u8,
    started_ns: u64,
}

/// A traced load, answered: what the runner logs under its trace id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSpan {
    /// The engine's trace id.
    pub trace: u64,
    /// The agent's place on this node.
    pub agent: u16,
    /// The tier it was read from (`Tier` code: 2 L2, 3 L3).
    pub tier: u8,
    /// Its answer.
    pub result: Result<(), AgentError>,
    /// From taking the request to the answer, ns.
    pub took_ns: u64,
}

/// What the pool has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Traced loads taken untraced: [`TRACED_MAX`] already in flight, or
    /// the log's spans not yet taken.
    pub traces_dropped: u64,
    /// Times a copy to another node waited for its tenant's network cap.
    pub sends_throttled: u64,
    /// Copies to other nodes `lake-cp` took back (`Cancel`) while they
    /// were queued or in the transport.
    pub sends_cancelled: u64,
    /// Copies to other nodes dropped for waiting past their deadline.
    pub sends_expired: u64,
    /// Blocks saved by agents (committed).
    pub saves: u64,
    /// Saves refused, for any reason below.
    pub saves_refused: u64,
    /// Of those: the only free L1 slots were the load reserve.
    pub saves_refused_reserve: u64,
    /// Of those: the pool was stopping.
    pub saves_refused_stopping: u64,
    /// Of those: the block would have taken a quota past its ceiling.
    pub saves_refused_quota: u64,
    /// Loads an agent cancelled before their read (`AgentRequest::Cancel`).
    pub loads_cancelled: u64,
    /// Commits refused: the object failed its checks.
    pub commits_corrupt: u64,
    /// Published blocks the background commit check found corrupt (and
    /// evicted).
    pub commits_corrupt_late: u64,
    /// Commits and blocks from peers refused: their namespace's blocks lie
    /// in another partition of the arena than their slot.
    pub commits_foreign: u64,
    /// Commits the background check read through and found sound.
    pub commits_verified: u64,
    /// Blocks peers sent over the transport that landed here.
    pub remote_landed: u64,
    /// Blocks this node sent to peers that landed there.
    pub remote_sent: u64,
    /// Requests refused as malformed (a field out of its domain).
    pub requests_invalid: u64,
    /// Reservations taken back after their timeout.
    pub reservations_expired: u64,
    /// L1 blocks the control plane marked evictable that a save took on
    /// the spot (no free slot): with a copy below (its L1 copy dropped)...
    pub victims_clean: u64,
    /// ...and without one (dropped: no lower tier had room).
    pub victims_dropped: u64,
    /// Blocks promoted L2→L1 (agent loads and control-plane copies).
    pub promotions: u64,
    /// Blocks demoted L1→L2.
    pub demotions: u64,
    /// Blocks written back L1→L2, their L1 copy kept.
    pub write_backs: u64,
    /// Write-backs answered "no space" for want of a free L1 slot to stage
    /// in (the control plane asks again later).
    pub write_backs_deferred: u64,
    /// Replicas evicted on command.
    pub evictions: u64,
    /// Commands answered with an error.
    pub commands_failed: u64,
    /// Commands for a replica no longer where they named it (answered
    /// `StaleGeneration`; its eviction was reported).
    pub commands_stale: u64,
    /// Bytes moved L1→L2.
    pub bytes_down: u64,
    /// Bytes moved L2→L1.
    pub bytes_up: u64,
    /// Blocks sealed (encrypted) on their way below L1.
    pub sealed: u64,
    /// Sealed blocks opened on their way back into L1.
    pub opened: u64,
    /// Sealed blocks that could not be opened (their namespace's key
    /// forgotten or replaced, or their tag failed): dropped.
    pub unreadable: u64,
    /// Replicas dropped by a purge of their namespace.
    pub purged: u64,
    /// Blocks moved from one L2 file to another (off a drained disk).
    pub relocations: u64,
    /// Agent loads held for their tenant's read cap (L2 or L3).
    pub loads_throttled: u64,
    /// Passes a demotion waited for its tenant's L2 write cap, and L3
    /// writes refused for a while for its L3 write cap.
    pub writes_throttled: u64,
    /// Saves and promotions that found their L1 size class with no slot.
    pub l1_class_short: u64,
    /// L1 chunks this pool began emptying for a class that ran short.
    pub l1_chunks_emptied: u64,
    /// Times a class ran short and no other class's chunk could be emptied
    /// (their blocks had nowhere else to go).
    pub l1_rebalance_impossible: u64,
    /// L1 blocks moved to another slot of their class (emptying a chunk).
    pub l1_moves: u64,
    /// Moves dropped because the block failed its checks (evicted).
    pub l1_moves_failed: u64,
}

/// What a pool is sized for.
#[derive(Clone, Copy, Debug)]
pub struct PoolShape {
    /// This node.
    pub node: u32,
    /// The data plane's region epoch.
    pub epoch: u64,
    /// The L1 arena's region.
    pub l1_region: u16,
    /// Its slots.
    pub l1_slots: u32,
    /// The L2 tier.
    pub geometry: L2Geometry,
    /// Operations in flight at most (the poller's).
    pub ops: u32,
}

/// How a commit's payload is checked against the CRCs its agent wrote in
/// the header. Every reader checks every segment it reads whatever this
/// is (a block that fails is never served); this is about what the pool
/// publishes, and when it finds out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CommitCheck {
    /// By where the CRCs came from, as the commit says (`CrcOrigin`):
    /// computed by Lake's own code (the agent, from the bytes it copied, or
    /// Lake's GPU kernel over the engine's registered memory), the block
    /// is published at once and its payload read off the commit's path, as
    /// `Background` does; not said, it is checked `Inline`.
    #[default]
    Auto,
    /// Before the block is published: a commit whose bytes fail is refused
    /// (`Corrupt`). Costs the poller a CPU pass over every saved byte on
    /// the commit's path.
    Inline,
    /// Published at once (header checked), the payload read off the
    /// commit's path — on a thread of its own beside the poller, oldest
    /// commit first; a block that fails is evicted (`Corrupt`, and
    /// counted) before or while readers, who check it themselves, meet it.
    Background,
    /// Header only: the agent's CRCs are taken as they are (readers still
    /// check every segment; nothing evicts a block that fails).
    Trust,
}

impl CommitCheck {
    /// Whether a commit whose CRCs came from `origin` is published before
    /// its payload is read.
    pub fn publishes_first(self, origin: CrcOrigin) -> bool {
        match self {
            Self::Auto => origin != CrcOrigin::Unknown,
            Self::Inline => false,
            Self::Background | Self::Trust => true,
        }
    }

    /// Whether commits published first are read afterwards.
    pub fn reads_later(self) -> bool {
        matches!(self, Self::Auto | Self::Background)
    }
}

/// A copy of an L1 block to another node, handed to the runner's
/// transport.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteSend {
    /// The command's request id.
    pub request: u64,
    /// The source slot and its generation.
    pub slot: u32,
    /// See `slot`.
    pub generation: u32,
    /// The stored object's bytes.
    pub len: u64,
    /// Where it goes: node, region and epoch (any slot).
    pub target: ReplicaWire,
    /// Its class.
    pub priority: Priority,
    /// The block's namespace (its tenant's cap on the network).
    pub namespace: u64,
    /// Not handed to the transport by then (Unix ns; 0: no deadline), it
    /// ends `DeadlineExceeded`, its slot released.
    pub deadline_unix_ns: u64,
    /// Given to the transport already.
    pub handed: bool,
}

/// Copies to other nodes in flight at most.
const REMOTE_SENDS_MAX: usize = 256;

/// Payload bytes the background check reads per pass at most where the
/// poller reads them itself (at least one segment): bounds what it adds
/// to a pass's latency.
const VERIFY_BYTES_PER_PASS: u64 = 1 << 20;

/// Commits handed to the check thread and not answered, at most.
const VERIFY_DEPTH: usize = 256;

/// A committed L1 block whose payload the background check has not
/// finished.
#[derive(Clone, Copy, Debug)]
struct Unverified {
    slot: u32,
    generation: u32,
    next_segment: u16,
}

/// An L1 block the control plane marked evictable.
#[derive(Clone, Copy, Debug)]
struct Victim {
    slot: u32,
    generation: u32,
    key: BlockKey,
}

/// Marked victims a reservation that finds no free slot takes at once (one
/// scan of the agents' pins frees them together; the rest serve the
/// reservations that follow).
const VICTIMS_PER_TAKE: usize = 16;

/// The longest a save that finds no free L1 slot and no marked victim
/// waits for the control plane to mark more before it is refused (ns).
pub const SAVE_WAIT_NS: u64 = 50_000_000;

/// The block service. See the module docs.
pub struct Pool {
    node: u32,
    epoch: u64,
    l1_region: u16,
    geometry: L2Geometry,
    commit_check: CommitCheck,
    /// Commits the background check has yet to read, oldest first (at
    /// most one per L1 slot: allocated once).
    unverified: VecDeque<Unverified>,
    /// The thread that reads them, where one runs (else the poller reads
    /// a bounded share each pass).
    verifier: Option<verify::Verifier>,
    /// Copies of L1 blocks to other nodes in flight (allocated once).
    sends: Vec<RemoteSend>,
    /// Sends the transport refused, to end.
    failed_sends: Vec<(u64, ErrorCode)>,
    /// Sends handed to the transport that `lake-cp` took back.
    send_cancels: Vec<u64>,
    l1: Vec<L1State>,
    /// A size class that found no free L1 slot since the last rebalance.
    short_class: Option<usize>,
    reserved: u32,
    /// Free L1 slots of a class that an engine's save may not take: they
    /// stay for loads (see [`Pool::set_load_reserve`]).
    load_reserve_slots: u32,
    /// Per L2 slot: the header of the object there (its generation and
    /// length; what a re-adoption report says), `None` when empty.
    l2_meta: Vec<Option<ObjectMeta>>,
    ops: Vec<Option<Purpose>>,
    /// The poller's ticket of each op's request (to cancel a promotion).
    tickets: Vec<Option<Ticket>>,
    free_ops: Vec<u32>,
    /// Demotions waiting for their L1 slot to drain: (slot, op cookie).
    draining: Vec<(u32, u64)>,
    /// L1 blocks the control plane marked evictable, in its order (the
    /// first to go first); an entry whose slot's mark no longer matches is
    /// stale and skipped. Allocated once (twice the slots: room for stale
    /// entries before a compaction).
    evictable: VecDeque<Victim>,
    /// Per L1 slot: the generation marked and why it may go, if marked.
    marked: Vec<Option<(u32, u8)>>,
    /// Agent ports: the in-process ones given at start, then one place per
    /// shared port (`None` while no agent holds it).
    agents: Vec<Option<DpPort>>,
    /// Ports the agent broke (an index ran ahead): to detach.
    broken: Vec<u16>,
    /// The place of shared port 0.
    shared_base: usize,
    /// Requests popped per agent and not yet answered.
    outstanding: Vec<u32>,
    passes: u64,
    /// The object store tier, if this node has one.
    l3: Option<L3Tier>,
    /// The tenants' data keys: blocks of a namespace with one are sealed
    /// below L1.
    keys: crate::auth::at_rest::KeyRing,
    /// Per-tenant bandwidth caps.
    rates: crate::rates::TenantRates,
    /// L1 quotas, held at each commit.
    quotas: crate::quota::L1Quotas,
    /// The arena's partitions past 0: whose namespaces' blocks lie in each.
    partitions: crate::runner::config::Partitions,
    /// Per agent place: the partition its agent maps (where its saves go,
    /// and the only one it may load into).
    agent_partition: Vec<u8>,
    /// Per agent place: a load popped from its port that waits for its
    /// tenant's bucket (the port is not read past it meanwhile).
    held: Vec<Option<AgentRequest>>,
    /// Per agent place: since when its held save has waited for a victim.
    held_since: Vec<Option<u64>>,
    /// What the pool still takes from agents.
    closing: Closing,
    /// When a save was last refused for want of room (see
    /// [`Pool::save_pressure`]).
    refused_at_ns: Option<u64>,
    /// Whether the control plane may still mark victims here (it says
    /// when it has none left): a save finding no slot waits only then (a
    /// load, an engine's critical path, waits either way: the next pass
    /// may free a slot all the same).
    victims_left: bool,
    /// Traced loads in flight, and answered ones for the log (both at most
    /// [`TRACED_MAX`], allocated once); the clock they are timed on.
    traced: Vec<TracedLoad>,
    spans: Vec<LoadSpan>,
    clock: std::time::Instant,
    /// What it has done.
    pub stats: PoolStats,
}

impl PoolStats {
    /// Saves refused for want of room: no free L1 slot and no victim in
    /// time (the refusals not counted under another reason).
    pub fn saves_refused_no_space(&self) -> u64 {
        self.saves_refused - self.saves_refused_reserve - self.saves_refused_stopping - self.saves_refused_quota
    }
}

impl core::fmt::Debug for Pool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Pool").field("stats", &self.stats).finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool over `l1_slots` arena slots and the L2 `geometry`, with room
    /// for `ops` operations in flight, serving `agents`.
    pub fn new(shape: &PoolShape, agents: Vec<DpPort>, shared_ports: u32) -> Self {
        let PoolShape { node, epoch, l1_region, l1_slots, geometry, ops } = *shape;
        let shared_base = agents.len();
        let l2_slots = usize::from(geometry.files) * geometry.slots_per_file as usize;
        let mut agents: Vec<Option<DpPort>> = agents.into_iter().map(Some).collect();
        agents.extend((0..shared_ports).map(|_| None));
        let agents_len = agents.len();
        Self {
            node,
            epoch,
            l1_region,
            geometry,
            commit_check: CommitCheck::Auto,
            unverified: VecDeque::with_capacity(l1_slots as usize),
            verifier: None,
            sends: Vec::with_capacity(REMOTE_SENDS_MAX),
            failed_sends: Vec::with_capacity(REMOTE_SENDS_MAX),
            send_cancels: Vec::with_capacity(REMOTE_SENDS_MAX),
            l1: vec![L1State::Free; l1_slots as usize],
            short_class: None,
            reserved: 0,
            load_reserve_slots: 0,
            l2_meta: vec![None; l2_slots],
            ops: vec![None; ops as usize],
            tickets: vec![None; ops as usize],
            free_ops: (0..ops).rev().collect(),
            draining: Vec::with_capacity(ops as usize),
            evictable: VecDeque::with_capacity(2 * l1_slots as usize),
            marked: vec![None; l1_slots as usize],
            agents,
            broken: Vec::with_capacity(agents_len),
            shared_base,
            outstanding: vec![0; agents_len],
            passes: 0,
            l3: None,
            keys: crate::auth::at_rest::KeyRing::new(),
            rates: crate::rates::TenantRates::default(),
            quotas: crate::quota::L1Quotas::default(),
            partitions: crate::runner::config::Partitions::default(),
            agent_partition: vec![0; agents_len],
            held: vec![None; agents_len],
            closing: Closing::Open,
            refused_at_ns: None,
            victims_left: true,
            held_since: vec![None; agents_len],
            traced: Vec::with_capacity(TRACED_MAX),
            spans: Vec::with_capacity(TRACED_MAX),
            clock: std::time::Instant::now(),
            stats: PoolStats::default(),
        }
    }

    /// How commits are checked (default [`CommitCheck::Auto`]).
    pub fn set_commit_check(&mut self, check: CommitCheck) {
        self.commit_check = check;
    }

    /// Installs the arena's partitions: which namespaces' blocks lie in
    /// each.
    pub fn set_partitions(&mut self, partitions: crate::runner::config::Partitions) {
        self.partitions = partitions;
    }

    /// The partition of `namespace`'s blocks.
    fn partition_of(&self, namespace: u64) -> usize {
        self.partitions.of_namespace(namespace)
    }

    /// Whether a block of `namespace` may lie in L1 `slot`: the slot is in
    /// the namespace's partition (any slot, in an arena not partitioned).
    fn in_its_partition(&self, namespace: u64, slot: u32, table: &SlotTable) -> bool {
        self.partitions.each.is_empty() || table.partition_of(slot) == Some(self.partitions.of_namespace(namespace))
    }

    /// Starts the thread that reads published commits' payloads off the
    /// poller's core, where the commit check reads any later (`Auto`,
    /// `Background`); one agent record of `arena` is taken for its pins.
    /// Without it the poller reads them, a bounded share each pass.
    pub fn start_verifier(&mut self, arena: &crate::arena::Arena, wakeup: Arc<Wakeup>) -> Result<(), ArenaError> {
        if self.commit_check.reads_later() && self.verifier.is_none() {
            self.verifier = Some(verify::Verifier::start(arena, VERIFY_DEPTH, wakeup)?);
        }
        Ok(())
    }

    /// Commits whose payload the background check has yet to read (handed
    /// to its thread and not answered included).
    pub fn unverified(&self) -> usize {
        self.unverified.len() + self.verifier.as_ref().map_or(0, verify::Verifier::out)
    }

    fn l2_index(&self, slot: L2Slot) -> Option<usize> {
        (slot.file < self.geometry.files && slot.slot < self.geometry.slots_per_file)
            .then(|| usize::from(slot.file) * self.geometry.slots_per_file as usize + slot.slot as usize)
    }

    fn l2_slot_of(&self, replica: &ReplicaWire) -> Option<L2Slot> {
        let file = replica.region.checked_sub(self.geometry.region_first)?;
        let slot = L2Slot { file, slot: replica.slot };
        self.l2_index(slot).map(|_| slot)
    }

    /// An object now lives in an L2 slot (written, or found at start).
    pub fn l2_written(&mut self, slot: L2Slot, meta: &ObjectMeta) {
        if let Some(index) = self.l2_index(slot) {
            self.l2_meta[index] = Some(*meta);
        }
    }

    /// The report of every block this node holds, L1 and L2, as
    /// re-adoption gives it to a control plane that connects anew (one
    /// that took over, or restarted). L1 blocks are read from their slot's
    /// header, checked against the slot's generation.
    pub(crate) fn resident_records(&self, region: &SlotRegion, table: &SlotTable, out: &mut dyn FnMut(BlockRecord)) {
        for (slot, state) in (0u32..).zip(&self.l1) {
            if !matches!(state, L1State::Ready | L1State::Sending { .. }) {
                continue;
            }
            // SAFETY: a ready (or sending) slot is written by nobody until
            // the pool frees it, which this thread alone does.
            let Some(bytes) = (unsafe { region.slot(slot) }) else { continue };
            let Ok(header) = decode_header(bytes) else { continue };
            let meta = header.meta();
            if table.arena().generation(slot) == Some(meta.generation) {
                out(self.l1_record(slot, meta.generation, meta));
            }
        }
        let per_file = self.geometry.slots_per_file as usize;
        for (index, meta) in self.l2_meta.iter().enumerate() {
            let Some(meta) = meta else { continue };
            let (Ok(file), Ok(slot)) = (u16::try_from(index / per_file), u32::try_from(index % per_file)) else {
                continue;
            };
            out(crate::runner::l2_record(&self.geometry, self.node, self.epoch, L2Slot { file, slot }, meta));
        }
        self.l3_records(out);
    }

    /// Whether `slot` still holds the object of `generation`.
    pub fn l2_holds(&self, slot: L2Slot, generation: u32) -> bool {
        generation != 0 && self.l2_object(slot, generation).is_some()
    }

    /// The header of the object of `generation` in `slot`, if it is there.
    fn l2_object(&self, slot: L2Slot, generation: u32) -> Option<&ObjectMeta> {
        let meta = self.l2_meta.get(self.l2_index(slot)?)?.as_ref()?;
        (meta.generation == generation).then_some(meta)
    }

    /// An L2 slot was given up.
    pub fn l2_released(&mut self, slot: L2Slot) {
        if let Some(index) = self.l2_index(slot) {
            self.l2_meta[index] = None;
        }
    }

    fn take_op(&mut self, purpose: Purpose) -> Option<u64> {
        let index = self.free_ops.pop()?;
        assert!(self.ops[index as usize].is_none(), "operation {index} taken while in flight");
        self.ops[index as usize] = Some(purpose);
        Some(POOL_COOKIE | u64::from(index))
    }

    fn put_op(&mut self, cookie: u64) -> Option<Purpose> {
        let index = u32::try_from(cookie & !POOL_COOKIE).ok()?;
        let purpose = self.ops.get_mut(index as usize)?.take()?;
        if let Some(ticket) = self.tickets.get_mut(index as usize) {
            *ticket = None;
        }
        self.free_ops.push(index);
        Some(purpose)
    }

    fn l1_record(&self, slot: u32, generation: u32, meta: &crate::stored::ObjectMeta) -> BlockRecord {
        crate::runner::block_record(self.l1_replica(slot, generation), meta, Durability::Volatile)
    }

    fn l1_replica(&self, slot: u32, generation: u32) -> ReplicaWire {
        ReplicaWire {
            tier: Tier::L1Dram as u8,
            reserved: 0,
            region: self.l1_region,
            node: self.node,
            region_epoch: self.epoch,
            slot,
            generation,
        }
    }

    /// Serves the agents' rings and the control plane's commands; submits
    /// what needs I/O to the poller. Bounded by `budget` items.
    pub(crate) fn serve<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, now_ns: u64, budget: u32) -> u32 {
        let mut done = self.serve_agents(parts, now_ns, budget);
        while done < budget {
            let Some(command) = parts.link.as_mut().and_then(CpLink::next_command) else { break };
            done += 1;
            self.command(command, parts);
        }
        while let Some(request) = parts.link.as_mut().and_then(CpLink::next_cancel) {
            done += 1;
            self.cancel_send(request, parts);
        }
        done += self.start_drained(parts, now_ns);
        done += self.rebalance(parts);
        done += self.verify_backlog(parts);
        done += self.poll_l3(parts);
        self.passes = self.passes.wrapping_add(1);
        if self.reserved > 0 && self.passes.is_multiple_of(4096) {
            self.expire_reservations(parts.table, now_ns);
        }
        done
    }

    fn clock_ns(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Keeps the last `slots` free L1 slots of each class from engines'
    /// saves: loads (a request's critical path) still find a slot while
    /// write-back fills L1 faster than demotion empties it, instead of
    /// being refused and asked again. The tier manager's high-water mark
    /// must lie below what saves can fill, or it never demotes (`lake
    /// serve` checks; `[l1] load_reserve_slots`).
    pub fn set_load_reserve(&mut self, slots: u32) {
        self.load_reserve_slots = slots;
    }

    /// Stops taking saves (`Closing::Saves`), or anything new
    /// (`Closing::All`); never opens again.
    pub fn close(&mut self, closing: Closing) {
        self.closing = self.closing.max(closing);
    }

    /// An operation of the pool finished (`event.cookie` has
    /// [`POOL_COOKIE`]).
    pub(crate) fn finished<B: IoBackend>(&mut self, event: &Event, parts: &mut Parts<'_, B>) {
        let Some(purpose) = self.put_op(event.cookie) else { return };
        let (table, l2, region) = (&mut *parts.table, &mut *parts.l2, parts.region);
        let link = &mut *parts.link;
        match (purpose, event.command) {
            (Purpose::Demote { request, l1_generation, .. }, Command::Write(write)) => {
                let l1_slot = write.l1_slot;
                // The slot drained before the write: it is ours to free,
                // and its L1 replica is gone whatever the write did.
                let _ = table.free_drained(l1_slot);
                self.l1[l1_slot as usize] = L1State::Free;
                let l1_evicted = BlockEvicted {
                    replica: self.l1_replica(l1_slot, l1_generation),
                    key: write.meta.key,
                    reason: EvictReason::Demoted as u8,
                    reserved: [0; 7],
                };
                let target;
                let status = match event.outcome {
                    Ok(done) => {
                        self.stats.demotions += 1;
                        self.stats.bytes_down += done.bytes;
                        self.l2_written(write.target, &write.meta);
                        let record =
                            crate::runner::l2_record(&self.geometry, self.node, self.epoch, write.target, &write.meta);
                        target = record.replica;
                        if let Some(cp) = link {
                            cp.committed(&record);
                            cp.evicted(&l1_evicted);
                        }
                        0
                    }
                    Err(e) => {
                        self.stats.commands_failed += 1;
                        let _ = l2.release(write.target);
                        if let Some(cp) = link {
                            cp.evicted(&BlockEvicted { reason: EvictReason::Capacity as u8, ..l1_evicted });
                        }
                        target = ReplicaWire { slot: SLOT_ANY, ..self.l1_replica(l1_slot, l1_generation) };
                        op_code(e) as u32
                    }
                };
                if let Some(cp) = link {
                    cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes: 0 });
                }
            }
            (Purpose::WriteBack { request, stage }, Command::Write(write)) => {
                self.release_l1(stage, table);
                let (status, target) = match event.outcome {
                    Ok(done) => {
                        self.stats.write_backs += 1;
                        self.stats.bytes_down += done.bytes;
                        self.l2_written(write.target, &write.meta);
                        let record =
                            crate::runner::l2_record(&self.geometry, self.node, self.epoch, write.target, &write.meta);
                        if let Some(cp) = link {
                            cp.committed(&record);
                        }
                        (0, record.replica)
                    }
                    Err(e) => {
                        self.stats.commands_failed += 1;
                        let _ = l2.release(write.target);
                        let target =
                            crate::runner::l2_record(&self.geometry, self.node, self.epoch, write.target, &write.meta)
                                .replica;
                        (op_code(e) as u32, ReplicaWire { slot: SLOT_ANY, generation: 0, ..target })
                    }
                };
                if let Some(cp) = link {
                    cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes: 0 });
                }
            }
            (Purpose::StageL3 { op }, Command::Read(_)) => self.l3_staged(op, event.outcome.is_ok(), parts),
            (relocate @ Purpose::Relocate { .. }, _) => self.relocation_step(relocate, event, parts),
            (Purpose::Promote { to, l1_slot, l1_generation }, Command::Read(read)) => {
                let opened = match event.outcome {
                    Ok(done) => self.promoted(l1_slot, l1_generation, region, link).map(|_| done.bytes),
                    Err(e) => Err(match e {
                        OpError::Corrupt(_) => AgentError::Corrupt,
                        OpError::Mismatch(_) => AgentError::Stale,
                        OpError::Cancelled => AgentError::Cancelled,
                        _ => AgentError::Io,
                    }),
                };
                let result = match opened {
                    Err(AgentError::Corrupt) => {
                        // The L2 copy is bad (or sealed with a key this
                        // node no longer has): it goes, and the reader
                        // recomputes.
                        self.drop_bad_l2(read.source, read.generation, read.key, l2, link);
                        Err(AgentError::Corrupt)
                    }
                    other => other,
                };
                self.promotion_ended(to, l1_slot, l1_generation, result, parts);
            }
            _ => {}
        }
    }

    fn seal_failed<B: IoBackend>(&mut self, cookie: u64, parts: &mut Parts<'_, B>) {
        let Some(Purpose::Demote { request, l1_generation, write }) = self.put_op(cookie) else { return };
        let _ = parts.table.free_drained(write.l1_slot);
        self.l1[write.l1_slot as usize] = L1State::Free;
        let _ = parts.l2.release(write.target);
        self.stats.commands_failed += 1;
        let replica = self.l1_replica(write.l1_slot, l1_generation);
        if let Some(cp) = parts.link.as_mut() {
            let reason = EvictReason::Capacity as u8;
            cp.evicted(&BlockEvicted { replica, key: write.meta.key, reason, reserved: [0; 7] });
            let target = ReplicaWire { slot: SLOT_ANY, ..replica };
            cp.transfer_done(request, &TransferDone { status: ErrorCode::Io as u32, reserved: 0, target, bytes: 0 });
        }
    }

    /// Applies a change to the key ring; a forgotten namespace is purged.
    pub(crate) fn key_change<B: IoBackend>(
        &mut self,
        change: crate::auth::at_rest::KeyChange,
        parts: &mut Parts<'_, B>,
    ) {
        use crate::auth::at_rest::KeyChange;
        match change {
            KeyChange::Set(namespace, key) => self.keys.insert(namespace, key),
            KeyChange::Require(required) => self.keys.required = required,
            KeyChange::Forget(namespace) => {
                self.keys.forget(namespace);
                self.purge(namespace, parts);
            }
        }
    }

    /// Drops every replica of `namespace` this node holds, L1, L2 and L3,
    /// found from the headers it keeps (L2, L3) or reads (L1) as
    /// re-adoption does — no payload is read — each reported to `lake-cp`
    /// as released. Returns how many.
    pub(crate) fn purge<B: IoBackend>(&mut self, namespace: crate::NamespaceId, parts: &mut Parts<'_, B>) -> u64 {
        // What re-adoption reports of this node, the namespace's part.
        let mut victims: Vec<(ReplicaWire, BlockKey)> = Vec::new();
        self.resident_records(parts.region, parts.table, &mut |record| {
            if record.namespace == namespace.0 {
                victims.push((record.replica, record.key));
            }
        });
        let mut purged = 0;
        for (replica, key) in victims {
            let evict = BlockEvicted { replica, key, reason: EvictReason::Released as u8, reserved: [0; 7] };
            if self.evict(&evict, parts).is_ok() {
                purged += 1;
            }
        }
        self.stats.purged += purged;
        purged
    }
}

/// Decodes the object in `bytes` (a whole slot) and, if `verify`, checks
/// its payload CRCs.
/// A write-back: a copy of a block from this node's L1 into its L2.
fn is_write_back(transfer: &Transfer) -> bool {
    transfer.source.tier == Tier::L1Dram as u8 && transfer.target.tier == Tier::L2Nvme as u8
}

fn check_object(bytes: &[u8], verify: bool) -> Result<crate::stored::ObjectMeta, StoredError> {
    let decoded = decode_header(bytes)?;
    // L1 holds blocks in the clear only: a commit of a sealed object would
    // hand readers ciphertext that passes its CRCs.
    if decoded.seal().is_some() {
        return Err(StoredError::UnsupportedFlags(crate::stored::FLAG_SEALED));
    }
    let meta = *decoded.meta();
    if verify {
        let end = usize::try_from(meta.payload_len)
            .ok()
            .and_then(|len| len.checked_add(STORED_HEADER_BYTES))
            .filter(|&end| end <= bytes.len())
            .ok_or(StoredError::PayloadLength { expected: meta.payload_len, actual: bytes.len() as u64 })?;
        decoded.verify_payload(&bytes[STORED_HEADER_BYTES..end])?;
    } else if object_bytes(meta.payload_len) > bytes.len() as u64 {
        return Err(StoredError::PayloadLength { expected: meta.payload_len, actual: bytes.len() as u64 });
    }
    Ok(meta)
}

fn code_of(error: AgentError) -> ErrorCode {
    match error {
        AgentError::NoSpace => ErrorCode::NoSpace,
        AgentError::Stale => ErrorCode::StaleGeneration,
        AgentError::Corrupt => ErrorCode::Checksum,
        AgentError::Io => ErrorCode::Io,
        AgentError::Busy => ErrorCode::QueueFull,
        AgentError::Invalid => ErrorCode::BadFrame,
        AgentError::Cancelled => ErrorCode::Cancelled,
        AgentError::Reserved => ErrorCode::NoSpace,
        AgentError::Stopping => ErrorCode::Cancelled,
        AgentError::OverQuota => ErrorCode::NoSpace,
    }
}

fn op_code(error: OpError) -> ErrorCode {
    match error {
        OpError::Corrupt(_) => ErrorCode::Checksum,
        OpError::Mismatch(_) => ErrorCode::StaleGeneration,
        OpError::Cancelled => ErrorCode::Cancelled,
        OpError::DeadlineExceeded => ErrorCode::DeadlineExceeded,
        OpError::Invalid(_) => ErrorCode::BadFrame,
        OpError::Io(_) | OpError::Short { .. } | OpError::FlushFailed(_) => ErrorCode::Io,
    }
}
