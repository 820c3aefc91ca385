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

mod compact;
mod invariants;
mod l3;
mod remote;
mod verify;

use std::collections::VecDeque;
use std::sync::Arc;

pub(crate) use self::l3::L3Tier;
pub use self::l3::{DELETE_BATCH_MAX, L3Stats};
pub(crate) use self::remote::PoolLanding;

use crate::agent::port::{AgentCompletion, AgentError, AgentRequest, CrcOrigin, DpPort};
use crate::agent::shm::Popped;
use crate::arena::{ArenaError, SlotTable};
use crate::constants::STORED_HEADER_BYTES;
use crate::cplink::{CpCommand, CpLink};
use crate::io::IoBackend;
use crate::l2::{L2Grant, L2Slots};
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, Priority, ReplicaWire, Tier};
use crate::op::{Command, Event, L2Slot, OpError, ReadBlock, Request, Ticket, WriteBlock};
use crate::poller::{L2Geometry, Poller};
use crate::region::SlotRegion;
use crate::runner::Parts;
use crate::runner::os::Wakeup;
use crate::stored::{ObjectMeta, Seal, StoredError, decode_header, object_bytes};
use crate::wire::message::{
    BlockEvicted, BlockRecord, DrainRegion, ErrorCode, EvictReason, SLOT_ANY, Transfer, TransferDone,
};

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
    /// Loads an agent cancelled before their read (`AgentRequest::Cancel`).
    pub loads_cancelled: u64,
    /// Commits refused: the object failed its checks.
    pub commits_corrupt: u64,
    /// Published blocks the background commit check found corrupt (and
    /// evicted).
    pub commits_corrupt_late: u64,
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
        self.saves_refused - self.saves_refused_reserve - self.saves_refused_stopping
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

    /// Caps tenants' bandwidth on this node's tiers (`[[tenants]]`).
    pub fn set_rates(&mut self, rates: crate::rates::TenantRates) {
        self.rates = rates;
    }

    /// Each capped tenant's waits, for the control plane (none without
    /// caps).
    pub fn tenant_throttles(&self) -> Vec<crate::wire::message::TenantWait> {
        use crate::wire::message::{TENANT_WAIT_PATHS, TenantWait};
        self.rates
            .waits()
            .map(|(name, waits)| {
                let mut all = [0; TENANT_WAIT_PATHS];
                all[..waits.len()].copy_from_slice(&waits);
                TenantWait {
                    // Names are checked at config to fit.
                    name: crate::wire::message::text_field("tenant_throttle.name", name).unwrap_or_default(),
                    waits: all,
                }
            })
            .collect()
    }

    /// Whether `request` may start now under its tenant's caps (only loads
    /// are capped here; their bytes are taken from the bucket when so).
    fn admitted(&mut self, request: &AgentRequest, now_ns: u64) -> bool {
        use crate::rates::RatePath;
        if self.rates.is_empty() {
            // Not even the object's header looked up.
            return true;
        }
        let AgentRequest::Load { source, .. } = request else { return true };
        let cost = if source.tier == Tier::L2Nvme as u8 {
            self.l2_slot_of(source)
                .and_then(|slot| self.l2_object(slot, source.generation))
                .map(|meta| (meta.namespace.0, RatePath::L2Read, object_bytes(meta.payload_len)))
        } else if source.tier == Tier::L3Object as u8 {
            self.l3_object_meta(source).map(|meta| (meta.namespace.0, RatePath::L3Read, object_bytes(meta.payload_len)))
        } else {
            None
        };
        // A load of nothing known is answered (stale) at once, uncapped.
        cost.is_none_or(|(namespace, path, bytes)| self.rates.admit(namespace, path, bytes, now_ns))
    }

    /// How commits are checked (default [`CommitCheck::Auto`]).
    pub fn set_commit_check(&mut self, check: CommitCheck) {
        self.commit_check = check;
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

    /// Whether an agent has requests waiting (checked before parking).
    pub fn has_agent_work(&mut self) -> bool {
        self.agents.iter_mut().flatten().any(DpPort::has_requests)
    }

    /// The place of shared port `port` among the agents.
    pub fn shared_place(&self, port: u32) -> usize {
        self.shared_base + port as usize
    }

    /// An agent attached at `place` (see [`Pool::shared_place`]).
    pub fn attach(&mut self, place: usize, port: DpPort) {
        if let Some(slot) = self.agents.get_mut(place) {
            *slot = Some(port);
            self.outstanding[place] = 0;
        }
    }

    /// The agent on `place` detached (or died): its port goes, its
    /// reservations are taken back (loads in flight finish; their copies
    /// stay in L1, reported).
    pub fn detach(&mut self, place: usize, table: &mut SlotTable) {
        if let Some(slot) = self.agents.get_mut(place) {
            *slot = None;
        }
        let agent = u16::try_from(place).unwrap_or(u16::MAX);
        for slot in 0..self.l1.len() {
            if matches!(self.l1[slot], L1State::Reserved { agent: owner, .. } if owner == agent) {
                self.release_l1(u32::try_from(slot).unwrap_or(u32::MAX), table);
            }
        }
    }

    /// Ports agents broke since the last call (places), to detach.
    pub fn take_broken(&mut self) -> Option<u16> {
        self.broken.pop()
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

    /// Serves the agents' rings (while the data plane stops too: closed,
    /// the pool answers them at once). Bounded by `budget` requests.
    pub(crate) fn serve_agents<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, now_ns: u64, budget: u32) -> u32 {
        let mut done = 0;
        for agent in 0..self.agents.len() {
            let place = u16::try_from(agent).unwrap_or(u16::MAX);
            // A load waiting for its tenant's bucket goes first, or the
            // port waits with it.
            if let Some(request) = self.held[agent].take() {
                if !self.admitted(&request, now_ns) {
                    self.held[agent] = Some(request);
                    continue;
                }
                done += 1;
                self.agent_request(place, request, parts, now_ns);
                if self.held[agent].is_some() {
                    // Still waiting (a save for a victim).
                    continue;
                }
            }
            while done < budget {
                let Some(port) = self.agents[agent].as_mut() else { break };
                // Never more answers owed than the completion ring holds.
                if self.outstanding[agent] as usize >= port.free() {
                    break;
                }
                let Some(popped) = port.pop() else { break };
                done += 1;
                match popped {
                    Popped::Request(request) => {
                        self.outstanding[agent] += 1;
                        if !self.admitted(&request, now_ns) {
                            self.stats.loads_throttled += 1;
                            self.held[agent] = Some(request);
                            break;
                        }
                        self.agent_request(place, request, parts, now_ns);
                        if self.held[agent].is_some() {
                            break;
                        }
                    }
                    Popped::Invalid(cookie) => {
                        self.outstanding[agent] += 1;
                        self.stats.requests_invalid += 1;
                        self.answer(place, cookie, Err(AgentError::Invalid));
                    }
                    Popped::Broken => {
                        self.agents[agent] = None;
                        if self.broken.len() < self.broken.capacity() {
                            self.broken.push(place);
                        }
                        break;
                    }
                }
            }
        }
        done
    }

    /// Starts the writes of demotions whose L1 slot has drained.
    fn start_drained<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, now_ns: u64) -> u32 {
        let mut started = 0;
        let mut at = 0;
        while at < self.draining.len() {
            let (slot, cookie) = self.draining[at];
            if !parts.table.is_drained(slot) {
                at += 1;
                continue;
            }
            let Some(Some(Purpose::Demote { write, .. })) = self.ops.get((cookie & !POOL_COOKIE) as usize) else {
                self.draining.swap_remove(at);
                continue;
            };
            let mut write = *write;
            let bytes = object_bytes(write.meta.payload_len);
            if !self.rates.admit(write.meta.namespace.0, crate::rates::RatePath::L2Write, bytes, now_ns) {
                // Its tenant is at its L2 write cap: it waits here.
                self.stats.writes_throttled += 1;
                at += 1;
                continue;
            }
            // Drained: nobody reads the slot, and it is freed after the
            // write, so its payload is sealed where it lies.
            if write.seal.is_none() {
                // SAFETY: the slot drained (no pins) and is Busy: this
                // thread alone touches it until the write's end frees it.
                let bytes = unsafe { parts.region.slot_mut(slot) };
                match self.seal_in_place(&write.meta, bytes) {
                    Ok(None) => {}
                    Ok(Some(seal)) => {
                        write.seal = Some(seal);
                        if let Some(Some(Purpose::Demote { write: kept, .. })) =
                            self.ops.get_mut((cookie & !POOL_COOKIE) as usize)
                        {
                            kept.seal = Some(seal);
                        }
                    }
                    Err(_) => {
                        self.draining.swap_remove(at);
                        self.seal_failed(cookie, parts);
                        continue;
                    }
                }
            }
            let request =
                Request { command: Command::Write(write), priority: Priority::Demotion, deadline_ns: 0, cookie };
            if parts.poller.submit(request).is_err() {
                // The poller is full: next pass.
                break;
            }
            self.draining.swap_remove(at);
            started += 1;
        }
        started
    }

    /// Seals, in place, the payload of the stored object in `object`
    /// (header first) with its tenant's data key: `None` where the tenant
    /// has none; `Unauthorized` where it cannot be sealed (no random salt,
    /// or no slot), and then it is not written at all: never in the clear.
    fn seal_in_place(&mut self, meta: &ObjectMeta, object: Option<&mut [u8]>) -> Result<Option<Seal>, ErrorCode> {
        let Some(key) = self.keys.get(meta.namespace) else { return Ok(None) };
        let payload_len = usize::try_from(meta.payload_len).unwrap_or(usize::MAX);
        let payload = object.and_then(|b| b.get_mut(STORED_HEADER_BYTES..)).and_then(|p| p.get_mut(..payload_len));
        let sealed = payload.map(|p| crate::auth::at_rest::seal(key, meta, p));
        let seal = sealed.and_then(Result::ok).ok_or(ErrorCode::Unauthorized)?;
        self.stats.sealed += 1;
        Ok(Some(seal))
    }

    fn answer(&mut self, agent: u16, cookie: u64, result: Result<(u32, u32), AgentError>) {
        let took_us = self.traced_answer(agent, cookie, result);
        let place = usize::from(agent);
        let Some(Some(port)) = self.agents.get_mut(place) else { return };
        assert!(self.outstanding[place] > 0, "agent {agent} answered for {cookie} with nothing owed");
        self.outstanding[place] -= 1;
        // Room was checked before the request was taken.
        assert!(port.free() > 0, "agent {agent}'s completion ring is full: an answer was not counted as owed");
        port.push(AgentCompletion { cookie, result, took_us });
    }

    /// A load of `agent`'s under an engine's trace id: timed from here to
    /// its answer (untraced, and counted, when [`TRACED_MAX`] are).
    fn trace_load(&mut self, agent: u16, cookie: u64, trace: u64, tier: u8) {
        if self.traced.iter().any(|t| t.agent == agent && t.cookie == cookie) {
            // Asked again after waiting for a slot: timed from the first.
            return;
        }
        if self.traced.len() >= TRACED_MAX {
            self.stats.traces_dropped += 1;
            return;
        }
        let started_ns = self.clock_ns();
        self.traced.push(TracedLoad { agent, cookie, trace, tier, started_ns });
    }

    /// If `agent`'s request `cookie` is a traced load, its span (kept for
    /// the log) and its time in µs for the answer; else 0.
    fn traced_answer(&mut self, agent: u16, cookie: u64, result: Result<(u32, u32), AgentError>) -> u32 {
        if self.traced.is_empty() {
            return 0;
        }
        let Some(at) = self.traced.iter().position(|t| t.agent == agent && t.cookie == cookie) else { return 0 };
        let traced = self.traced.swap_remove(at);
        let took_ns = self.clock_ns().saturating_sub(traced.started_ns);
        if self.spans.len() < TRACED_MAX {
            let result = result.map(|_| ());
            self.spans.push(LoadSpan { trace: traced.trace, agent, tier: traced.tier, result, took_ns });
        } else {
            self.stats.traces_dropped += 1;
        }
        u32::try_from(took_ns / 1000).unwrap_or(u32::MAX).max(1)
    }

    fn clock_ns(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The traced loads answered since the last call, for the log.
    pub fn take_spans(&mut self, mut each: impl FnMut(&LoadSpan)) {
        for span in &self.spans {
            each(span);
        }
        self.spans.clear();
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

    fn agent_request<B: IoBackend>(
        &mut self,
        agent: u16,
        request: AgentRequest,
        parts: &mut Parts<'_, B>,
        now_ns: u64,
    ) {
        let table = &mut *parts.table;
        match request {
            AgentRequest::Reserve { cookie, .. } if self.closing != Closing::Open => {
                self.held_since[usize::from(agent)] = None;
                self.refuse_save(agent, cookie, AgentError::Stopping, now_ns);
            }
            AgentRequest::Commit { cookie, slot, generation, .. } if self.closing == Closing::All => {
                // Not published: acked now, it would be lost with the
                // data plane. Its slot is given back, as for an abort.
                let _ = self.abort(agent, slot, generation, table);
                self.answer(agent, cookie, Err(AgentError::Stopping));
            }
            AgentRequest::Load { cookie, .. } if self.closing == Closing::All => {
                self.answer(agent, cookie, Err(AgentError::Stopping));
            }
            AgentRequest::Reserve { cookie, object_bytes } => {
                let reserve = self.load_reserve_slots as usize;
                match self.slot_or_victim(object_bytes, reserve, parts) {
                    Some(grant) => {
                        self.held_since[usize::from(agent)] = None;
                        self.l1[grant.slot as usize] = L1State::Reserved { agent, since_ns: now_ns };
                        self.reserved += 1;
                        self.answer(agent, cookie, Ok((grant.slot, grant.generation)));
                    }
                    // Every marked victim spent: the control plane marks
                    // more at its next pass. The save waits for them (its
                    // port with it), a while at most.
                    None if self.victims_left && self.may_wait(agent, parts, now_ns) => {
                        self.held[usize::from(agent)] = Some(request);
                    }
                    // Waited long enough: refused, and so is every save of
                    // this agent after it until one finds a slot (the wait
                    // is not begun again for each).
                    None => {
                        // Free slots of its class left, all of them the
                        // load reserve's; or none at all.
                        let reserved =
                            parts.table.class_for(object_bytes).is_some_and(|c| parts.table.free_slots(c) > 0);
                        let why = if reserved { AgentError::Reserved } else { AgentError::NoSpace };
                        self.refuse_save(agent, cookie, why, now_ns);
                    }
                }
            }
            AgentRequest::Commit { cookie, slot, generation, crcs } => {
                let result = self.commit(agent, (slot, generation), crcs, parts);
                self.answer(agent, cookie, result.map(|()| (slot, generation)));
            }
            AgentRequest::Abort { cookie, slot, generation } => {
                let result = self.abort(agent, slot, generation, table);
                self.answer(agent, cookie, result);
            }
            AgentRequest::Load { cookie, key, source, priority, trace } => {
                if trace != 0 {
                    self.trace_load(agent, cookie, trace, source.tier);
                }
                let to = Requester::Agent { agent, cookie };
                match self.promote(to, key, &source, priority, parts) {
                    Ok(()) => self.held_since[usize::from(agent)] = None,
                    // No L1 slot and no marked victim: the load waits for
                    // the control plane's next marks, as a save does.
                    Err(AgentError::NoSpace) if self.may_wait(agent, parts, now_ns) => {
                        self.held[usize::from(agent)] = Some(request);
                    }
                    Err(e) => self.answer(agent, cookie, Err(e)),
                }
            }
            AgentRequest::Cancel { cookie, load } => {
                // The agent's own load, still with the poller.
                let op = self.ops.iter().position(|purpose| {
                    matches!(purpose, Some(Purpose::Promote { to: Requester::Agent { agent: a, cookie: c }, .. })
                        if *a == agent && *c == load)
                });
                let ticket = op.and_then(|i| self.tickets.get(i).copied().flatten());
                // Or an L3 read still queued for the store's workers.
                let stopped = ticket.is_some_and(|t| parts.poller.cancel(t)) || self.cancel_l3_load(agent, load);
                if stopped {
                    self.stats.loads_cancelled += 1;
                }
                self.answer(agent, cookie, if stopped { Ok((0, 0)) } else { Err(AgentError::Stale) });
            }
        }
    }

    /// The control plane marks the L1 block `replica` evictable (or takes
    /// the mark back). A mark that no longer names the block there (moved,
    /// freed, another generation) is ignored.
    fn mark<B: IoBackend>(&mut self, replica: &BlockEvicted, evictable: bool, parts: &mut Parts<'_, B>) {
        let wire = &replica.replica;
        if wire.tier != Tier::L1Dram as u8
            || wire.region != self.l1_region
            || wire.region_epoch != self.epoch
            || wire.node != self.node
        {
            return;
        }
        let slot = wire.slot as usize;
        if self.l1.get(slot) != Some(&L1State::Ready)
            || parts.table.arena().generation(wire.slot) != Some(wire.generation)
        {
            return;
        }
        if !evictable {
            self.marked[slot] = None;
            return;
        }
        self.victims_left = true;
        if self.marked[slot].is_some_and(|(generation, _)| generation == wire.generation) {
            return;
        }
        if self.evictable.len() == self.evictable.capacity() {
            // Stale entries out first; still full (every slot marked
            // twice over cannot be): the mark is dropped.
            let marked = &self.marked;
            self.evictable.retain(|v| marked[v.slot as usize].is_some_and(|(g, _)| g == v.generation));
            if self.evictable.len() == self.evictable.capacity() {
                return;
            }
        }
        self.marked[slot] = Some((wire.generation, replica.reason));
        self.evictable.push_back(Victim { slot: wire.slot, generation: wire.generation, key: replica.key });
    }

    /// Gives back the L1 `slot` (at `generation`) `agent` reserved and
    /// did not commit; `Stale` if it holds no such reservation.
    fn abort(
        &mut self,
        agent: u16,
        slot: u32,
        generation: u32,
        table: &mut SlotTable,
    ) -> Result<(u32, u32), AgentError> {
        match self.l1.get(slot as usize) {
            Some(L1State::Reserved { agent: owner, .. })
                if *owner == agent && table.arena().generation(slot) == Some(generation) =>
            {
                self.release_l1(slot, table);
                Ok((slot, generation))
            }
            _ => Err(AgentError::Stale),
        }
    }

    /// Refuses `agent`'s save `cookie` for `why`, counted by reason.
    fn refuse_save(&mut self, agent: u16, cookie: u64, why: AgentError, now_ns: u64) {
        self.stats.saves_refused += 1;
        match why {
            AgentError::Reserved => self.stats.saves_refused_reserve += 1,
            AgentError::Stopping => self.stats.saves_refused_stopping += 1,
            _ => {}
        }
        self.refused_at_ns = Some(now_ns);
        self.answer(agent, cookie, Err(why));
    }

    /// Stops taking saves (`Closing::Saves`), or anything new
    /// (`Closing::All`); never opens again.
    pub fn close(&mut self, closing: Closing) {
        self.closing = self.closing.max(closing);
    }

    /// Whether the pool refuses saves now: it is closing, or it refused
    /// one for want of room within [`SAVE_PRESSURE_NS`]. Agents read it
    /// (shared memory, no request) and skip a whole save rather than have
    /// it refused part way.
    pub fn save_pressure(&self, now_ns: u64) -> bool {
        self.closing != Closing::Open
            || self.refused_at_ns.is_some_and(|at| now_ns.saturating_sub(at) < SAVE_PRESSURE_NS)
    }

    /// Whether a request of `agent` that found no L1 slot (nor a marked
    /// victim) may wait for the control plane to mark more: it marks
    /// victims, and this agent has not waited [`SAVE_WAIT_NS`] in vain
    /// since its last request that found a slot.
    fn may_wait<B: IoBackend>(&mut self, agent: u16, parts: &Parts<'_, B>, now_ns: u64) -> bool {
        parts.link.as_ref().is_some_and(|l| l.takes(crate::wire::FEATURE_EVICTABLE))
            && now_ns.saturating_sub(*self.held_since[usize::from(agent)].get_or_insert(now_ns)) < SAVE_WAIT_NS
    }

    /// A free L1 slot for an object of `object_bytes` (leaving `keep` of
    /// its class free), else one a marked victim gave up.
    fn slot_or_victim<B: IoBackend>(
        &mut self,
        object_bytes: u64,
        keep: usize,
        parts: &mut Parts<'_, B>,
    ) -> Option<crate::arena::SlotGrant> {
        if let Some(grant) = self.allocate_l1(parts.table, object_bytes, keep) {
            return Some(grant);
        }
        if self.take_victims(object_bytes, parts) == 0 {
            return None;
        }
        self.allocate_l1(parts.table, object_bytes, keep)
    }

    /// A save found no free L1 slot of `object_bytes`'s class: takes up to
    /// [`VICTIMS_PER_TAKE`] of the marked victims of that class, in the
    /// control plane's order (each still there, ready, and its mark
    /// current), frees those no reader pins, and reports each as evicted.
    /// Returns how many were taken.
    fn take_victims<B: IoBackend>(&mut self, object_bytes: u64, parts: &mut Parts<'_, B>) -> usize {
        let Some(class) = parts.table.class_for(object_bytes) else { return 0 };
        let reserve = self.load_reserve_slots as usize;
        if parts.table.evacuating().is_some() || parts.table.chunk_to_evacuate(class, reserve).is_some() {
            // Another class's chunk can be emptied for it by moving blocks
            // (the rebalance does it): nothing need leave L1.
            self.short_class = Some(class);
            return 0;
        }
        let mut taken = 0;
        let mut looked = 0;
        let queued = self.evictable.len();
        while taken < VICTIMS_PER_TAKE && looked < queued {
            let Some(victim) = self.evictable.pop_front() else { break };
            looked += 1;
            let slot = victim.slot as usize;
            let Some((generation, reason)) = self.marked[slot].filter(|(g, _)| *g == victim.generation) else {
                continue;
            };
            if self.l1[slot] != L1State::Ready || parts.table.arena().generation(victim.slot) != Some(generation) {
                self.marked[slot] = None;
                continue;
            }
            if parts.table.class_of_slot(victim.slot) != Some(class) {
                // Another size class's: it stays marked, at the back.
                self.evictable.push_back(victim);
                continue;
            }
            self.marked[slot] = None;
            let replica = self.l1_replica(victim.slot, generation);
            self.release_l1(victim.slot, parts.table);
            if reason == EvictReason::Demoted as u8 {
                self.stats.victims_clean += 1;
            } else {
                self.stats.victims_dropped += 1;
            }
            if let Some(cp) = parts.link.as_mut() {
                cp.evicted(&BlockEvicted { replica, key: victim.key, reason, reserved: [0; 7] });
            }
            taken += 1;
        }
        if taken > 0 {
            // Unpinned ones free now; a pinned one when its reader lets go.
            parts.table.reclaim();
        }
        taken
    }

    /// A copy of an L1 block to another node's L1 (replication, or a
    /// node's write-back elsewhere): the slot is held (no eviction or
    /// demotion while it is read) and the send handed to the runner's
    /// transport ([`Pool::take_sends`]).
    /// The header of the committed L1 block `source` names, if it still
    /// holds `key`: this epoch's L1, the slot `Ready` (or, where
    /// `sending` says, read by sends), at the generation named.
    fn committed_l1<B: IoBackend>(
        &self,
        source: &ReplicaWire,
        key: &BlockKey,
        sending: bool,
        parts: &Parts<'_, B>,
    ) -> Result<ObjectMeta, ErrorCode> {
        if source.region_epoch != self.epoch || source.node != self.node || source.region != self.l1_region {
            return Err(ErrorCode::StaleEpoch);
        }
        let slot = source.slot;
        let committed = match self.l1.get(slot as usize) {
            Some(L1State::Ready) => true,
            Some(L1State::Sending { .. }) => sending,
            _ => false,
        };
        if !committed || parts.table.arena().generation(slot) != Some(source.generation) {
            return Err(ErrorCode::StaleGeneration);
        }
        // SAFETY: a ready (or sending) slot is not written until it is
        // retired, which this thread alone does, and not in this call.
        let bytes = unsafe { parts.region.slot(slot) }.ok_or(ErrorCode::NoSuchBlock)?;
        let meta = *decode_header(bytes).map_err(|_| ErrorCode::Checksum)?.meta();
        if meta.key != *key {
            return Err(ErrorCode::NoSuchBlock);
        }
        Ok(meta)
    }

    fn release_l1(&mut self, slot: u32, table: &mut SlotTable) {
        if let Some(state) = self.l1.get_mut(slot as usize) {
            assert!(*state != L1State::Free, "L1 slot {slot} released twice");
            if matches!(state, L1State::Reserved { .. }) {
                self.reserved = self.reserved.saturating_sub(1);
            }
            *state = L1State::Free;
        }
        let _ = table.retire(slot);
    }

    fn commit<B: IoBackend>(
        &mut self,
        agent: u16,
        (slot, generation): (u32, u32),
        crcs: CrcOrigin,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        let table = &mut *parts.table;
        match self.l1.get(slot as usize) {
            Some(L1State::Reserved { agent: owner, .. })
                if *owner == agent && table.arena().generation(slot) == Some(generation) => {}
            _ => return Err(AgentError::Stale),
        }
        // SAFETY: the slot is reserved to this agent, which has finished
        // writing it (it committed); nobody else writes a reserved slot.
        let bytes = unsafe { parts.region.slot(slot) }.ok_or(AgentError::Invalid)?;
        // The header must name this very slot, generation and epoch: an
        // object copied from elsewhere, or written for an old reservation,
        // is not published.
        let first = self.commit_check.publishes_first(crcs);
        let checked = check_object(bytes, !first).ok().filter(|meta| {
            meta.region.0 == self.l1_region
                && meta.slot == slot
                && meta.generation == generation
                && meta.region_epoch == self.epoch
        });
        let meta = match checked {
            Some(meta) => meta,
            None => {
                self.stats.commits_corrupt += 1;
                self.release_l1(slot, table);
                return Err(AgentError::Corrupt);
            }
        };
        self.reserved = self.reserved.saturating_sub(1);
        self.l1[slot as usize] = L1State::Ready;
        self.stats.saves += 1;
        if first && self.commit_check.reads_later() && self.unverified.len() < self.l1.len() {
            self.unverified.push_back(Unverified { slot, generation, next_segment: 0 });
        }
        if let Some(cp) = parts.link {
            cp.committed(&self.l1_record(slot, generation, &meta));
        }
        Ok(())
    }

    fn expire_reservations(&mut self, table: &mut SlotTable, now_ns: u64) {
        for slot in 0..self.l1.len() {
            if let L1State::Reserved { since_ns, .. } = self.l1[slot]
                && now_ns.saturating_sub(since_ns) > RESERVATION_TIMEOUT_NS
            {
                self.stats.reservations_expired += 1;
                self.release_l1(u32::try_from(slot).unwrap_or(u32::MAX), table);
            }
        }
    }

    /// Starts reading `source` (an L2 replica of `key`) into a new L1 slot.
    fn promote<B: IoBackend>(
        &mut self,
        to: Requester,
        key: BlockKey,
        source: &ReplicaWire,
        priority: Priority,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        if source.tier == Tier::L3Object as u8 {
            return self.promote_l3(to, key, source, parts);
        }
        if source.tier != Tier::L2Nvme as u8 || source.region_epoch != self.epoch || source.node != self.node {
            return Err(AgentError::Stale);
        }
        let slot = self.l2_slot_of(source).ok_or(AgentError::Invalid)?;
        self.l2_index(slot).ok_or(AgentError::Invalid)?;
        let payload_len = match self.l2_object(slot, source.generation) {
            Some(meta) if source.generation != 0 => meta.payload_len,
            _ => return Err(AgentError::Stale),
        };
        let grant = self.slot_or_victim(object_bytes(payload_len), 0, parts).ok_or(AgentError::NoSpace)?;
        let table = &mut *parts.table;
        let purpose = Purpose::Promote { to, l1_slot: grant.slot, l1_generation: grant.generation };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = table.retire(grant.slot);
            return Err(AgentError::Busy);
        };
        let read = ReadBlock { source: slot, l1_slot: grant.slot, key, generation: source.generation, payload_len };
        if self.read_into(cookie, read, priority, parts.poller) {
            Ok(())
        } else {
            self.put_op(cookie);
            self.release_l1(grant.slot, parts.table);
            Err(AgentError::Busy)
        }
    }

    /// Submits op `cookie`'s read of an L2 object into the L1 slot it was
    /// given (busy from now on; its ticket kept, so the read can be
    /// cancelled). False when the poller is full: the caller undoes.
    fn read_into<B: IoBackend>(
        &mut self,
        cookie: u64,
        read: ReadBlock,
        priority: Priority,
        poller: &mut Poller<B>,
    ) -> bool {
        self.l1[read.l1_slot as usize] = L1State::Busy;
        match poller.submit(Request { command: Command::Read(read), priority, deadline_ns: 0, cookie }) {
            Ok(ticket) => {
                let index = usize::try_from(cookie & !POOL_COOKIE).unwrap_or(usize::MAX);
                if let Some(slot) = self.tickets.get_mut(index) {
                    *slot = Some(ticket);
                }
                true
            }
            Err(_) => false,
        }
    }

    fn command<B: IoBackend>(&mut self, command: CpCommand, parts: &mut Parts<'_, B>) {
        let (request, target, outcome) = match command {
            CpCommand::Evict { request, replica } => (request, replica.replica, self.evict(&replica, parts)),
            CpCommand::Mark { replica, evictable } => {
                self.mark(&replica, evictable, parts);
                return;
            }
            CpCommand::VictimsLeft { region, left } => {
                if region == self.l1_region {
                    self.victims_left = left;
                }
                return;
            }
            CpCommand::Move { request, transfer } | CpCommand::Copy { request, transfer }
                if transfer.target.tier == Tier::L3Object as u8 =>
            {
                let evict = matches!(command, CpCommand::Move { .. });
                match self.write_l3(request, &transfer, evict, parts) {
                    // Answered when the object is stored.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L3Object as u8 && transfer.target.tier == Tier::L1Dram as u8 =>
            {
                let to = Requester::Cp { request };
                match self.promote_l3(to, transfer.key, &transfer.source, parts) {
                    Ok(()) => return,
                    Err(e) => (request, transfer.target, Err(code_of(e))),
                }
            }
            CpCommand::Move { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8 && transfer.target.tier == Tier::L2Nvme as u8 =>
            {
                let outcome = self.demote(request, &transfer.source, &transfer.key, parts);
                match outcome {
                    // Answered when the write completes.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L2Nvme as u8 && transfer.target.tier == Tier::L1Dram as u8 =>
            {
                let priority = Priority::from_u8(transfer.priority).unwrap_or(Priority::Replication);
                let to = Requester::Cp { request };
                match self.promote(to, transfer.key, &transfer.source, priority, parts) {
                    Ok(()) => return,
                    Err(e) => (request, transfer.target, Err(code_of(e))),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8
                    && transfer.target.tier == Tier::L2Nvme as u8
                    && transfer.target.node == self.node =>
            {
                match self.write_back(request, &transfer, parts) {
                    // Answered when the write completes.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8
                    && transfer.target.tier == Tier::L1Dram as u8
                    && transfer.target.node != self.node =>
            {
                match self.send_remote(request, &transfer, parts) {
                    // Answered when the peer says it landed, or why not.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Move { request, transfer }
                if transfer.source.tier == Tier::L2Nvme as u8 && transfer.target.tier == Tier::L2Nvme as u8 =>
            {
                match self.relocate(request, &transfer, parts) {
                    // Answered when the copy is written.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Drain { request, drain } => {
                let (_, target) = command.request_and_target();
                let target = ReplicaWire { node: self.node, region_epoch: self.epoch, ..target };
                (request, target, self.drain(&drain, parts))
            }
            CpCommand::Move { request, transfer } | CpCommand::Copy { request, transfer } => {
                (request, transfer.target, Err(ErrorCode::BadFrame))
            }
        };
        let status = match outcome {
            Ok(()) => 0,
            // A write-back ahead of demand that found no free L1 slot to
            // stage in waits for a later pass: not a failure.
            Err(ErrorCode::NoSpace) if matches!(command, CpCommand::Copy { transfer, .. } if is_write_back(&transfer)) =>
            {
                self.stats.write_backs_deferred += 1;
                ErrorCode::NoSpace as u32
            }
            // The block left that slot before the command came (a save or
            // a load took it as a marked victim, say): the control plane
            // hears so from its eviction report too. Not a failure.
            Err(ErrorCode::StaleGeneration) => {
                self.stats.commands_stale += 1;
                ErrorCode::StaleGeneration as u32
            }
            Err(code) => {
                self.stats.commands_failed += 1;
                code as u32
            }
        };
        if let Some(cp) = parts.link {
            cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes: 0 });
        }
    }

    /// Drains one of this node's L2 files (no new object goes there) or
    /// uses it again.
    fn drain<B: IoBackend>(&mut self, drain: &DrainRegion, parts: &mut Parts<'_, B>) -> Result<(), ErrorCode> {
        let file = drain
            .region
            .checked_sub(self.geometry.region_first)
            .filter(|&f| f < self.geometry.files)
            .ok_or(ErrorCode::NoSuchBlock)?;
        parts.l2.set_draining(file, drain.draining == 1).map_err(|_| ErrorCode::NoSuchBlock)
    }

    /// Starts moving an L2 object to a slot of another L2 file (not one
    /// being drained): read into a staging L1 slot first.
    fn relocate<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let source = &transfer.source;
        if source.region_epoch != self.epoch || source.node != self.node {
            return Err(ErrorCode::StaleEpoch);
        }
        if transfer.target.node != self.node {
            return Err(ErrorCode::BadFrame);
        }
        let slot = self.l2_slot_of(source).ok_or(ErrorCode::NoSuchBlock)?;
        let meta = match self.l2_object(slot, source.generation) {
            Some(meta) if source.generation != 0 => *meta,
            _ => return Err(ErrorCode::StaleGeneration),
        };
        if meta.key != transfer.key {
            return Err(ErrorCode::NoSuchBlock);
        }
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        let class = table.class_for(object_bytes(meta.payload_len)).ok_or(ErrorCode::NoSpace)?;
        let target = l2.allocate_avoiding(Some(slot.file)).ok_or(ErrorCode::NoSpace)?;
        let Some(stage) = table.allocate(class) else {
            let _ = l2.release(target.slot);
            return Err(ErrorCode::NoSpace);
        };
        let priority = Priority::from_u8(transfer.priority).unwrap_or(Priority::Demotion);
        let purpose = Purpose::Relocate {
            request,
            stage: stage.slot,
            source: slot,
            source_generation: source.generation,
            target,
            priority,
        };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = l2.release(target.slot);
            let _ = table.retire(stage.slot);
            return Err(ErrorCode::QueueFull);
        };
        let read = ReadBlock {
            source: slot,
            l1_slot: stage.slot,
            key: meta.key,
            generation: source.generation,
            payload_len: meta.payload_len,
        };
        if !self.read_into(cookie, read, priority, parts.poller) {
            self.put_op(cookie);
            self.release_l1(stage.slot, parts.table);
            let _ = parts.l2.release(target.slot);
            return Err(ErrorCode::QueueFull);
        }
        Ok(())
    }

    /// A relocation's read or write ended: after the read, the staged
    /// object (sealed or not, as it lay) is written to its new slot with
    /// a header naming it; after the write, the new replica is reported,
    /// the source freed and reported, and the command answered.
    fn relocation_step<B: IoBackend>(&mut self, purpose: Purpose, event: &Event, parts: &mut Parts<'_, B>) {
        let Purpose::Relocate { request, stage, source, source_generation, target, priority } = purpose else {
            return;
        };
        let (node, epoch) = (self.node, self.epoch);
        let fail = |pool: &mut Self, code: ErrorCode, parts: &mut Parts<'_, B>| {
            pool.release_l1(stage, parts.table);
            let _ = parts.l2.release(target.slot);
            pool.stats.commands_failed += 1;
            let target = ReplicaWire {
                slot: SLOT_ANY,
                ..crate::runner::l2_replica(&pool.geometry, node, epoch, target.slot, 0)
            };
            if let Some(cp) = parts.link.as_mut() {
                cp.transfer_done(request, &TransferDone { status: code as u32, reserved: 0, target, bytes: 0 });
            }
        };
        match (event.command, event.outcome) {
            (Command::Read(read), Err(e)) => {
                if matches!(e, OpError::Corrupt(_)) {
                    self.drop_bad_l2(source, source_generation, read.key, parts.l2, parts.link);
                }
                fail(self, op_code(e), parts);
            }
            (Command::Read(_), Ok(_)) => {
                // SAFETY: the staging slot was allocated for this read,
                // which completed; it is never reported, so nobody pins it.
                let Some(decoded) = unsafe { parts.region.slot(stage) }.and_then(|b| decode_header(b).ok()) else {
                    return fail(self, ErrorCode::Checksum, parts);
                };
                let meta = ObjectMeta {
                    region: self.geometry.region(target.slot.file),
                    region_epoch: epoch,
                    slot: target.slot.slot,
                    generation: target.generation,
                    ..*decoded.meta()
                };
                let write = WriteBlock {
                    l1_slot: stage,
                    target: target.slot,
                    meta,
                    durability: Durability::Acked,
                    seal: decoded.seal().copied(),
                };
                let Some(cookie) = self.take_op(purpose) else { return fail(self, ErrorCode::QueueFull, parts) };
                let request = Request { command: Command::Write(write), priority, deadline_ns: 0, cookie };
                if parts.poller.submit(request).is_err() {
                    self.put_op(cookie);
                    fail(self, ErrorCode::QueueFull, parts);
                }
            }
            (Command::Write(_), Err(e)) => fail(self, op_code(e), parts),
            (Command::Write(write), Ok(done)) => {
                self.release_l1(stage, parts.table);
                self.l2_written(target.slot, &write.meta);
                let record = crate::runner::l2_record(&self.geometry, node, epoch, target.slot, &write.meta);
                // The source goes if it still holds what was moved (a purge
                // may have freed it meanwhile).
                let freed = self.l2_object(source, source_generation).is_some() && parts.l2.release(source).is_ok();
                if freed {
                    self.l2_released(source);
                }
                self.stats.relocations += 1;
                if let Some(cp) = parts.link.as_mut() {
                    cp.committed(&record);
                    if freed {
                        let replica = crate::runner::l2_replica(&self.geometry, node, epoch, source, source_generation);
                        let reason = EvictReason::Demoted as u8;
                        cp.evicted(&BlockEvicted { replica, key: write.meta.key, reason, reserved: [0; 7] });
                    }
                    let done = TransferDone { status: 0, reserved: 0, target: record.replica, bytes: done.bytes };
                    cp.transfer_done(request, &done);
                }
            }
            _ => {}
        }
    }

    fn evict<B: IoBackend>(&mut self, evict: &BlockEvicted, parts: &mut Parts<'_, B>) -> Result<(), ErrorCode> {
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        let replica = &evict.replica;
        if replica.region_epoch != self.epoch || replica.node != self.node {
            return Err(ErrorCode::StaleEpoch);
        }
        if replica.tier == Tier::L1Dram as u8 && replica.region == self.l1_region {
            let slot = replica.slot;
            if self.l1.get(slot as usize) != Some(&L1State::Ready)
                || table.arena().generation(slot) != Some(replica.generation)
            {
                return Err(ErrorCode::StaleGeneration);
            }
            self.release_l1(slot, table);
        } else if replica.tier == Tier::L2Nvme as u8 {
            let slot = self.l2_slot_of(replica).ok_or(ErrorCode::NoSuchBlock)?;
            self.l2_index(slot).ok_or(ErrorCode::NoSuchBlock)?;
            if replica.generation == 0 || self.l2_object(slot, replica.generation).is_none() {
                return Err(ErrorCode::StaleGeneration);
            }
            l2.release(slot).map_err(|_| ErrorCode::StaleGeneration)?;
            self.l2_released(slot);
        } else if replica.tier == Tier::L3Object as u8 {
            self.evict_l3(replica, &evict.key)?;
        } else {
            return Err(ErrorCode::NoSuchBlock);
        }
        self.stats.evictions += 1;
        let reason = EvictReason::from_u8(evict.reason).unwrap_or(EvictReason::Capacity);
        let Some(cp) = parts.link else { return Ok(()) };
        cp.evicted(&BlockEvicted { replica: *replica, key: evict.key, reason: reason as u8, reserved: [0; 7] });
        Ok(())
    }

    /// A write-back: the committed L1 block `transfer.source` written to
    /// an L2 slot while it stays in L1. The object is first copied into a
    /// staging slot: the write rewrites its header to name the L2 slot
    /// (and seals the payload, for a namespace with a data key) where it
    /// lies, and readers go on pinning the L1 copy meanwhile.
    fn write_back<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let slot = transfer.source.slot;
        let mut meta = self.committed_l1(&transfer.source, &transfer.key, true, parts)?;
        let region = parts.region;
        // SAFETY: a ready (or sending) slot is not written until it is
        // retired, which this thread alone does, and not in this call (its
        // mark is dropped first: the staging slot is not taken from it).
        let bytes = unsafe { region.slot(slot) }.ok_or(ErrorCode::NoSuchBlock)?;
        if !self.keys.may_store(meta.namespace) {
            // Encryption at rest is required and its tenant gave no key.
            return Err(ErrorCode::Unauthorized);
        }
        let object = object_bytes(meta.payload_len);
        let len = usize::try_from(object).map_err(|_| ErrorCode::NoSuchBlock)?;
        let grant = parts.l2.allocate().ok_or(ErrorCode::NoSpace)?;
        if let Some(mark) = self.marked.get_mut(slot as usize) {
            *mark = None;
        }
        let Some(stage) = self.slot_or_victim(object, 0, parts) else {
            let _ = parts.l2.release(grant.slot);
            return Err(ErrorCode::NoSpace);
        };
        // Written to L2 from here; freed when the write ends.
        self.l1[stage.slot as usize] = L1State::Busy;
        // Both slots go back where the write cannot start.
        let undo = |pool: &mut Self, parts: &mut Parts<'_, B>, code| {
            pool.release_l1(stage.slot, parts.table);
            let _ = parts.l2.release(grant.slot);
            Err(code)
        };
        // SAFETY: the staging slot was just allocated: this thread alone
        // owns it until the write's end frees it.
        let staged = unsafe { parts.region.slot_mut(stage.slot) }.and_then(|b| b.get_mut(..len));
        let (Some(staged), Some(from)) = (staged, bytes.get(..len)) else {
            return undo(self, parts, ErrorCode::NoSuchBlock);
        };
        staged.copy_from_slice(from);
        meta.region = self.geometry.region(grant.slot.file);
        meta.region_epoch = self.epoch;
        meta.slot = grant.slot.slot;
        meta.generation = grant.generation;
        let seal = match self.seal_in_place(&meta, Some(staged)) {
            Ok(seal) => seal,
            Err(code) => return undo(self, parts, code),
        };
        let write = WriteBlock { l1_slot: stage.slot, target: grant.slot, meta, durability: Durability::Acked, seal };
        let Some(cookie) = self.take_op(Purpose::WriteBack { request, stage: stage.slot }) else {
            return undo(self, parts, ErrorCode::QueueFull);
        };
        let submitted =
            Request { command: Command::Write(write), priority: Priority::WriteBack, deadline_ns: 0, cookie };
        if parts.poller.submit(submitted).is_err() {
            self.put_op(cookie);
            return undo(self, parts, ErrorCode::QueueFull);
        }
        Ok(())
    }

    fn demote<B: IoBackend>(
        &mut self,
        request: u64,
        source: &ReplicaWire,
        key: &BlockKey,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let slot = source.slot;
        let mut meta = self.committed_l1(source, key, false, parts)?;
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        if self.draining.len() == self.draining.capacity() {
            return Err(ErrorCode::QueueFull);
        }
        if !self.keys.may_store(meta.namespace) {
            // Encryption at rest is required and its tenant gave no key.
            return Err(ErrorCode::Unauthorized);
        }
        let grant = l2.allocate().ok_or(ErrorCode::NoSpace)?;
        meta.region = self.geometry.region(grant.slot.file);
        meta.region_epoch = self.epoch;
        meta.slot = grant.slot.slot;
        meta.generation = grant.generation;
        // Sealed (if its namespace has a data key) once the slot drains.
        let write = WriteBlock { l1_slot: slot, target: grant.slot, meta, durability: Durability::Acked, seal: None };
        let purpose = Purpose::Demote { request, l1_generation: source.generation, write };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = l2.release(grant.slot);
            return Err(ErrorCode::QueueFull);
        };
        if table.retire_kept(slot).is_err() {
            self.put_op(cookie);
            let _ = l2.release(grant.slot);
            return Err(ErrorCode::StaleGeneration);
        }
        self.l1[slot as usize] = L1State::Busy;
        self.draining.push((slot, cookie));
        Ok(())
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
                    Ok(done) => self.promoted(l1_slot, l1_generation, region, link).map(|()| done.bytes),
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

    /// A demotion whose payload could not be sealed ends failed: the L1
    /// copy goes (it drained for the move), the L2 slot is given back, and
    /// nothing is written in the clear.
    /// An L2 copy a read found bad goes, as a reader would drop it, and
    /// the control plane hears why — only while its slot still holds the
    /// generation that was read: the control plane may have evicted it
    /// while the read was in flight, and the slot may hold another block
    /// by now.
    fn drop_bad_l2(
        &mut self,
        slot: L2Slot,
        generation: u32,
        key: BlockKey,
        l2: &mut L2Slots,
        link: &mut Option<CpLink>,
    ) {
        if self.l2_object(slot, generation).is_none() || l2.release(slot).is_err() {
            return;
        }
        self.l2_released(slot);
        if let Some(cp) = link {
            let replica = crate::runner::l2_replica(&self.geometry, self.node, self.epoch, slot, generation);
            cp.evicted(&BlockEvicted { replica, key, reason: EvictReason::Corrupt as u8, reserved: [0; 7] });
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

    /// Ends a promotion into `l1_slot`, from L2 or L3 alike: counted where
    /// it landed (`result`: its bytes), the slot given back where it did
    /// not, and its requester answered.
    fn promotion_ended<B: IoBackend>(
        &mut self,
        to: Requester,
        l1_slot: u32,
        l1_generation: u32,
        result: Result<u64, AgentError>,
        parts: &mut Parts<'_, B>,
    ) {
        if let Ok(bytes) = result {
            self.stats.promotions += 1;
            self.stats.bytes_up += bytes;
        } else {
            self.release_l1(l1_slot, parts.table);
        }
        match to {
            Requester::Agent { agent, cookie } => {
                self.answer(agent, cookie, result.map(|_| (l1_slot, l1_generation)));
            }
            Requester::Cp { request } => {
                if let Some(cp) = parts.link.as_mut() {
                    let status = match result {
                        Ok(_) => 0,
                        Err(e) => code_of(e) as u32,
                    };
                    let target = self.l1_replica(l1_slot, l1_generation);
                    let bytes = result.unwrap_or(0);
                    cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes });
                }
            }
        }
    }

    /// A block read into `l1_slot`: its header is rewritten to name the L1
    /// slot, and the replica is reported.
    fn promoted(
        &mut self,
        l1_slot: u32,
        l1_generation: u32,
        region: &SlotRegion,
        link: &mut Option<CpLink>,
    ) -> Result<(), AgentError> {
        // SAFETY: the slot was allocated for this read, which completed; no
        // agent can pin it before it is reported.
        let bytes = unsafe { region.slot_mut(l1_slot) }.ok_or(AgentError::Invalid)?;
        let decoded = decode_header(bytes).map_err(|_| AgentError::Corrupt)?;
        let region = crate::model::replica::RegionId(self.l1_region);
        let meta = match decoded.seal() {
            None => {
                let header: &mut [u8; STORED_HEADER_BYTES] =
                    (&mut bytes[..STORED_HEADER_BYTES]).try_into().map_err(|_| AgentError::Invalid)?;
                decoded
                    .encode_moved(region, self.epoch, l1_slot, l1_generation, header)
                    .map_err(|_| AgentError::Corrupt)?
            }
            Some(_) => {
                // Opened in the slot (its CRCs, over the ciphertext, were
                // checked by the read), then headed anew with the
                // plaintext's CRCs, as L1 readers check them.
                let meta = ObjectMeta {
                    region,
                    region_epoch: self.epoch,
                    slot: l1_slot,
                    generation: l1_generation,
                    ..*decoded.meta()
                };
                let Some(key) = self.keys.get(meta.namespace) else {
                    self.stats.unreadable += 1;
                    return Err(AgentError::Corrupt);
                };
                match crate::auth::at_rest::open_object(key, &decoded, &meta, bytes) {
                    Ok(()) => {}
                    Err(crate::auth::at_rest::OpenError::Malformed) => return Err(AgentError::Invalid),
                    Err(_) => {
                        self.stats.unreadable += 1;
                        return Err(AgentError::Corrupt);
                    }
                }
                self.stats.opened += 1;
                meta
            }
        };
        self.l1[l1_slot as usize] = L1State::Ready;
        if let Some(cp) = link {
            cp.committed(&self.l1_record(l1_slot, l1_generation, &meta));
        }
        Ok(())
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
