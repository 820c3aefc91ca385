//! The agent itself (see the crate docs).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::port::{AgentCompletion, AgentError, AgentPort, AgentRequest, CrcOrigin, LOAD_BATCH};
use lake_core::arena::{Arena, Pin, PinArray, PinError};
use lake_core::constants::{SEGMENTS_MAX, STORED_HEADER_BYTES};
use lake_core::mirror::{MirrorEntry, MirrorReader};
use lake_core::model::key::BlockKey;
use lake_core::model::namespace::NamespaceId;
use lake_core::model::replica::{ObjectKind, Priority, ReplicaWire, Tier};
use lake_core::region::SlotRegion;
use lake_core::stored::{ObjectMeta, ReadableObject, Reader, Refusal, encode_header, object_bytes};
use lake_core::wire::hello::Identity;
use lake_core::wire::message::Role;
use lake_dp::cplink::{CpLink, Granted};

mod attach;
mod cluster;
pub use attach::AttachError;

/// How long a blocking call waits for the data plane or `lake-cp`.
pub const WAIT_MAX: Duration = Duration::from_secs(10);

/// Lease length asked for a fetch.
pub const LEASE_TTL_MS: u32 = 10_000;

/// Blocks one lease of a fetch covers at most (the next window is leased
/// when the fetch gets there).
pub(crate) const LEASE_WINDOW: usize = 64;

/// Blocks a save reserves at a time: its reservations, then its commits,
/// must fit the port's request ring (a larger save goes in windows, so a
/// ring that is full is never mistaken for a pool that is).
pub(super) const SAVE_WINDOW: usize = 64;

/// How long a fetch retries loads refused for want of an L1 slot (while
/// `lake-cp` makes room) before it gives up on the rest and the engine
/// recomputes them.
pub const LOAD_RETRY_MAX: Duration = Duration::from_millis(500);

/// How often an agent whose `lake-cp` link closed tries to make it again
/// (to a standby that took over, or the same one restarted), and how long
/// a try waits for the hello.
const RELINK_EVERY: Duration = Duration::from_millis(200);
const RELINK_WAIT: Duration = Duration::from_millis(200);

/// Where the pool is.
#[derive(Clone, Copy, Debug)]
pub struct AgentConfig<'a> {
    /// The L1 arena's path.
    pub arena: &'a Path,
    /// The mirror's path.
    pub mirror: &'a Path,
    /// The control plane's socket (leases and access reports); without
    /// it only L1 hits are served.
    pub cp_socket: Option<&'a Path>,
    /// A name for the control plane's logs.
    pub name: &'a str,
    /// The namespace blocks are saved in.
    pub namespace: NamespaceId,
    /// Fingerprint of the payload layout saved.
    pub layout_fingerprint: u64,
    /// Bytes per CRC segment of a saved payload (a layer's share, say).
    pub segment_bytes: u64,
    /// What this agent saves and reads: KV blocks, or a hybrid model's
    /// recurrent-state checkpoints (an attachment of their own, under
    /// their [`lake_core::RecurrentLayout`]'s fingerprint).
    pub object_kind: ObjectKind,
}

/// What became of one block of a save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStatus {
    /// Committed: published; the pool holds it.
    Saved,
    /// The data plane refused it, and why: its slot (`NoSpace`: L1 full
    /// of blocks it could not let go of in time; `Reserved`: only the load
    /// reserve free; `Stopping`), or its commit (`Corrupt`, `Stopping`);
    /// `Invalid`/`Io` where this agent could not write or fill it.
    Refused(AgentError),
    /// Not saved: its parent was not (a prefix is of use only from its
    /// start).
    ParentUnsaved,
    /// Not sent: the port had no room.
    NotSent,
}

/// One block to save.
#[derive(Clone, Copy)]
pub struct SaveBlock<'a> {
    /// Its key.
    pub key: BlockKey,
    /// The previous block's key ([`BlockKey::NONE`] for the first).
    pub parent: BlockKey,
    /// Its position in the prompt.
    pub block_index: u32,
    /// Its bytes.
    pub payload: SavePayload<'a>,
}

impl core::fmt::Debug for SaveBlock<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SaveBlock").field("key", &self.key).field("len", &self.payload.len()).finish_non_exhaustive()
    }
}

/// A block saved by [`Agent::save_prepared`]: its payload written by the
/// caller, its segment CRCs known.
#[derive(Clone, Copy, Debug)]
pub struct PreparedSave<'a> {
    /// Its key.
    pub key: BlockKey,
    /// The previous block's key.
    pub parent: BlockKey,
    /// Its position in the prompt.
    pub block_index: u32,
    /// Payload bytes.
    pub len: usize,
    /// The CRC of each segment ([`Agent::segment_bytes_for`] bytes each).
    pub crcs: &'a [u32],
    /// Who computed them, over what (the data plane's commit check goes
    /// by it).
    pub crcs_from: CrcOrigin,
}

/// A turn of [`Agent::reserve_prepared`]: the slots granted, their headers
/// written, waiting for their payloads.
#[derive(Debug)]
pub struct PreparedTurn {
    /// (block index, slot, generation) of each block granted a slot.
    slots: Vec<(usize, u32, u32)>,
    /// Where each of those blocks' payload goes: (block index, payload
    /// area of its reserved slot, `len` bytes).
    pub bodies: Vec<(usize, *mut u8)>,
}

/// Commits sent by [`Agent::commit_prepared`], not yet answered: (block
/// index, cookie, payload bytes).
#[derive(Debug)]
pub struct SentCommits(Vec<(usize, u64, usize)>);

/// Where a saved block's bytes come from.
#[derive(Clone, Copy)]
pub enum SavePayload<'a> {
    /// One contiguous run, copied as it is.
    Bytes(&'a [u8]),
    /// `len` bytes that `fill` writes, in payload order, into the slot it
    /// is given (engine memory laid out otherwise: gathered per layer and
    /// plane straight into shared memory, no staging copy), computing the
    /// CRC of each segment from the bytes as it copies them.
    Gather {
        /// Payload length.
        len: usize,
        /// `fill(slot, segment_bytes, crcs)` writes exactly the payload
        /// into `slot` (`len` bytes) and the CRC of each of its
        /// `segment_bytes` segments, in order, into `crcs` (one a
        /// segment). False if it could not.
        fill: &'a GatherFill<'a>,
    },
}

/// The fill of a [`SavePayload::Gather`]: `(slot, segment_bytes, crcs)`.
pub type GatherFill<'a> = dyn Fn(&mut [u8], u64, &mut [u32]) -> bool + 'a;

impl core::fmt::Debug for SavePayload<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Bytes(bytes) => write!(f, "Bytes({})", bytes.len()),
            Self::Gather { len, .. } => write!(f, "Gather({len})"),
        }
    }
}

impl SavePayload<'_> {
    /// Payload length.
    pub fn len(&self) -> usize {
        match self {
            Self::Bytes(bytes) => bytes.len(),
            Self::Gather { len, .. } => *len,
        }
    }

    /// Whether there is no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a fetch stopped before the end of the hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FetchFailure {
    /// The block left its slot between lookup and read (evicted,
    /// replaced), or its lower-tier load found it gone.
    Evicted,
    /// The block failed its header or CRC checks.
    Corrupt,
    /// The block was saved under another layout (another shard, dtype or
    /// geometry), namespace or object kind than this agent's: its bytes are not this
    /// reader's to use.
    Foreign,
    /// A lower-tier block could not be leased or loaded (no `lake-cp`, a
    /// refused lease, no L1 room in time, a device error).
    Unavailable,
    /// The caller cancelled the fetch (its request was aborted or
    /// preempted): nothing past the block it stopped before was read.
    Cancelled,
}

impl From<Refusal> for FetchFailure {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Damaged => Self::Corrupt,
            Refusal::AnotherBlock => Self::Evicted,
            Refusal::NotTheReaders => Self::Foreign,
        }
    }
}

/// Leases a fetch asks again for a block whose L1 copy went while the
/// control plane still named it (each after 200 µs), before it gives up.
const STALE_LEASES_MAX: u32 = 10;

/// What the agent has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentStats {
    /// Lookups.
    pub lookups: u64,
    /// Blocks a lookup found.
    pub hit_blocks: u64,
    /// Blocks read from L1.
    pub l1_reads: u64,
    /// Blocks loaded from L2 (promoted into L1).
    pub l2_loads: u64,
    /// Blocks loaded from L3 (read through into L1).
    pub l3_loads: u64,
    /// Hit blocks that could not be delivered (evicted under the lookup,
    /// lease refused, corrupt): the engine recomputed them.
    pub fetch_failures: u64,
    /// Loads stopped in the data plane before their read, their fetch
    /// cancelled.
    pub loads_cancelled: u64,
    /// Blocks saved.
    pub saves: u64,
    /// Saves skipped (no slot free, or the data plane busy).
    pub saves_skipped: u64,
    /// Payload bytes delivered.
    pub bytes_read: u64,
    /// Payload bytes saved.
    pub bytes_saved: u64,
    /// Links to `lake-cp` made again after one closed.
    pub cp_relinks: u64,
    /// What loading one block from each tier costs this agent, measured
    /// on its own fetches (ns, a moving average; 0: not measured yet;
    /// index by tier: 1 L1, 2 L2, 3 L3 — L0 is the engine's): the live
    /// inputs of a cost-aware hit ([`lake_core::route`]).
    pub load_ns_per_block: [u64; 4],
}

/// A load cost's moving average with one more block's time folded in
/// (weight 1/8; the first sample sets it; never 0 once measured).
pub fn fold_load_cost(average_ns: u64, took: Duration) -> u64 {
    let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).max(1);
    if average_ns == 0 { ns } else { average_ns.saturating_mul(7).saturating_add(ns) / 8 }
}

/// Traced loads an agent keeps for its engine at most (the oldest go).
pub const SPANS_KEPT: usize = 256;

/// A load done under the engine's trace id ([`Agent::set_trace`]), as the
/// agent saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceSpan {
    /// The engine's trace id.
    pub trace: u64,
    /// The block.
    pub key: BlockKey,
    /// The tier it was loaded from (`Tier` code: 2 L2, 3 L3).
    pub tier: u8,
    /// The data plane's answer.
    pub result: Result<(), AgentError>,
    /// From asking the data plane to its answer, as the agent saw it, ns.
    pub took_ns: u64,
    /// The data plane's own time on it, µs, from its answer (0: a data
    /// plane that does not time traced loads).
    pub data_plane_us: u32,
}

/// The agent. See the module docs.
pub struct Agent {
    arena: Arena,
    region: Arc<SlotRegion>,
    pins: PinArray,
    mirror: MirrorReader,
    /// The other nodes' blocks, beside the mirror (where the pool keeps them).
    cluster: lake_core::mirror::view::ViewOpener,
    port: AgentPort,
    cp: Option<CpLink>,
    /// Where `lake-cp` listens and the name the agent gives it, to link
    /// again when the link closes; the next try not before `relink_at`.
    cp_socket: Option<std::path::PathBuf>,
    cp_name: String,
    relink_at: Instant,
    namespace: NamespaceId,
    layout_fingerprint: u64,
    segment_bytes: u64,
    object_kind: ObjectKind,
    next_cookie: u64,
    /// Completions that arrived for other requests than the one waited on.
    early: Vec<AgentCompletion>,
    /// The attach socket to a `lake-dp` in another process (kept open: it
    /// is this agent's liveness).
    attach_socket: Option<UnixStream>,
    /// Why the last fetch stopped short, if it did.
    last_failure: Option<FetchFailure>,
    /// The priority of the data plane loads a fetch asks for.
    load_priority: Priority,
    /// The engine's trace id its loads carry (0: none), whether the data
    /// plane takes one ([`lake_core::wire::FEATURE_TRACE`]), and the traced
    /// loads done, oldest first (at most [`SPANS_KEPT`]).
    trace: u64,
    traces_taken: bool,
    spans: std::collections::VecDeque<TraceSpan>,
    /// Caps on tenants' pushes, from the data plane at attach.
    push_caps: Vec<lake_core::wire::message::PushCap>,
    /// How long its reads of L1 hits and its loads from L2 and L3 took, by
    /// block (`agent_read_l1`, `agent_load_l2`, `agent_load_l3`), since it
    /// attached; sent to `lake-cp` at most once a second.
    paths: [lake_core::wire::message::PathEntry; 3],
    paths_sent: Instant,
    /// Blocks lately not saved (refused, skipped), newest last, at most
    /// [`UNSAVED_KEPT`]: a later save of a block under one of them is not
    /// saved either, so a request whose save broke off does not leave the
    /// rest of its prefix in the pool where no lookup reaches it.
    unsaved_recent: std::collections::VecDeque<BlockKey>,
    unsaved_set: std::collections::HashSet<BlockKey>,
    /// What it has done.
    pub stats: AgentStats,
}

/// Blocks an agent remembers as lately not saved.
const UNSAVED_KEPT: usize = 4096;

impl Drop for Agent {
    /// What it timed since its last report goes to `lake-cp` before the
    /// link closes (an engine that lived less than a second is counted too).
    fn drop(&mut self) {
        if let Some(cp) = &mut self.cp {
            cp.path_latency(&self.paths);
            let _ = cp.pump();
        }
    }
}

impl core::fmt::Debug for Agent {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Agent").field("stats", &self.stats).finish_non_exhaustive()
    }
}

impl Agent {
    /// Attaches to the pool through `port` (one of the runner's agent
    /// ports).
    pub fn attach(config: &AgentConfig<'_>, port: AgentPort) -> Result<Self, AttachError> {
        let arena = Arena::attach(config.arena).map_err(|e| AttachError::Memory(e.to_string()))?;
        Self::with(config, (arena, None), port, None, true)
    }

    /// An agent over `arena` and the mirror passed with it (none: the one
    /// at `config.mirror`).
    fn with(
        config: &AgentConfig<'_>,
        (arena, mirror): (Arena, Option<std::os::fd::OwnedFd>),
        port: AgentPort,
        attach_socket: Option<UnixStream>,
        traces_taken: bool,
    ) -> Result<Self, AttachError> {
        let memory = |e: &dyn core::fmt::Display| AttachError::Memory(e.to_string());
        let region = arena.region().map_err(|e| memory(&e))?;
        let pins = arena.claim_agent().map_err(AttachError::of_claim)?;
        let mirror = match mirror {
            Some(fd) => MirrorReader::attach_fd(fd),
            None => MirrorReader::attach(config.mirror),
        }
        .map_err(|e| memory(&e))?;
        let cp = match config.cp_socket {
            Some(socket) => {
                let identity = Identity {
                    role: Role::Agent,
                    node: arena.header().node,
                    pid: std::process::id(),
                    region_epoch: 0,
                    features: lake_core::wire::FEATURES,
                    name: config.name,
                };
                Some(
                    CpLink::connect(socket, &identity, WAIT_MAX)
                        .map_err(|e| AttachError::ControlPlane(e.to_string()))?,
                )
            }
            None => None,
        };
        if config.segment_bytes == 0 {
            return Err(AttachError::Invalid("segment_bytes: must be above 0"));
        }
        Ok(Self {
            arena,
            region,
            pins,
            mirror,
            cluster: lake_core::mirror::view::ViewOpener::beside(config.mirror),
            port,
            cp,
            cp_socket: config.cp_socket.map(Path::to_path_buf),
            cp_name: config.name.to_owned(),
            relink_at: Instant::now(),
            namespace: config.namespace,
            layout_fingerprint: config.layout_fingerprint,
            segment_bytes: config.segment_bytes,
            object_kind: config.object_kind,
            next_cookie: 1,
            early: Vec::new(),
            unsaved_recent: std::collections::VecDeque::with_capacity(UNSAVED_KEPT),
            unsaved_set: std::collections::HashSet::with_capacity(UNSAVED_KEPT),
            attach_socket,
            last_failure: None,
            load_priority: Priority::CriticalLoad,
            trace: 0,
            traces_taken,
            spans: std::collections::VecDeque::with_capacity(SPANS_KEPT),
            push_caps: Vec::new(),
            paths: {
                use lake_core::wire::message::{Path, PathEntry};
                [Path::AgentReadL1, Path::AgentLoadL2, Path::AgentLoadL3].map(PathEntry::new)
            },
            paths_sent: Instant::now(),
            stats: AgentStats::default(),
        })
    }

    /// Sets the engine's trace id that the loads this agent asks from now on
    /// carry (0: none). The data plane logs each under it with its time
    /// (`{"event":"trace",...}` in its log) and answers with that time;
    /// the agent keeps each as a [`TraceSpan`] ([`Agent::take_spans`]).
    /// With a data plane built before trace ids, loads go untraced and
    /// the spans say the data plane's time is 0.
    pub fn set_trace(&mut self, trace: u64) {
        self.trace = trace;
    }

    /// Whether the data plane takes trace ids ([`lake_core::wire::FEATURE_TRACE`]).
    pub fn traces_taken(&self) -> bool {
        self.traces_taken
    }

    /// Hands over the traced loads done since the last call, oldest first.
    pub fn take_spans(&mut self, mut each: impl FnMut(&TraceSpan)) {
        for span in self.spans.drain(..) {
            each(&span);
        }
    }

    fn keep_span(&mut self, span: TraceSpan) {
        if self.spans.len() >= SPANS_KEPT {
            self.spans.pop_front();
        }
        self.spans.push_back(span);
    }

    /// Whether the data plane is still there: its attach socket open (an
    /// agent that connected), or its arena live (an in-process one). When
    /// it is not, nothing this agent holds is valid any more: attach again.
    pub fn data_plane_alive(&self) -> bool {
        match &self.attach_socket {
            Some(socket) => !lake_core::os::peer_closed(socket.as_raw_fd()),
            None => self.arena.is_live(),
        }
    }

    /// A second pin array in this agent's arena, for another thread of the
    /// engine (a pin array has one writer); its pins go with it, or with
    /// the process.
    pub fn claim_pin_array(&self) -> Result<PinArray, AttachError> {
        self.arena.claim_agent().map_err(AttachError::of_claim)
    }

    /// Where this process maps the L1 arena's slots (in a partitioned
    /// arena, its partition's): base and length (to register them once
    /// with a device, so kernels read and write slots across the bus).
    pub fn slot_area(&self) -> (*mut u8, usize) {
        self.region.visible_area()
    }

    /// The largest block payload one of the L1 arena's size classes holds:
    /// a block larger than that can never be saved into this pool.
    pub fn payload_bytes_max(&self) -> u64 {
        let header = self.arena.header();
        let classes = &header.classes[..usize::from(header.class_count).min(header.classes.len())];
        let largest = classes.iter().map(|class| class.slot_bytes).max().unwrap_or(0);
        largest.saturating_sub(STORED_HEADER_BYTES as u64)
    }

    /// The L1 arena's region (block-table entries naming it are L1 hits).
    pub fn arena_region(&self) -> u16 {
        self.arena.header().region
    }

    /// The L1 arena's epoch (its `lake-dp`'s start): blocks a peer sends
    /// into this node's L1 name it.
    pub fn arena_epoch(&self) -> u64 {
        self.arena.header().epoch
    }

    /// The mirror this agent reads.
    pub fn mirror(&self) -> &MirrorReader {
        &self.mirror
    }

    /// The cluster view this agent reads, opened again for another
    /// reader (the one passed at attach mapped again, and the same path
    /// to look for one at).
    pub fn reopen_cluster_view(&self) -> lake_core::mirror::view::ViewOpener {
        self.cluster.reopen()
    }

    /// The longest cached prefix of `keys` and its block table (into
    /// `table`); reports the request to `lake-cp` for eviction.
    pub fn lookup(&mut self, keys: &[BlockKey], table: &mut Vec<MirrorEntry>) -> usize {
        let hit = self.mirror.lookup(keys, table);
        self.stats.lookups += 1;
        self.stats.hit_blocks += hit as u64;
        // Queued only: it goes out with the next call that talks to
        // lake-cp (or `pump`), off the lookup's path.
        if let Some(cp) = &mut self.cp {
            cp.accessed(self.namespace.0, keys, hit);
        }
        hit
    }

    /// Reports a lookup made elsewhere (another thread read the mirror) to
    /// `lake-cp`, like [`Agent::lookup`] does.
    pub fn report_access(&mut self, keys: &[BlockKey], hit: usize) {
        self.stats.lookups += 1;
        self.stats.hit_blocks += hit as u64;
        if let Some(cp) = &mut self.cp {
            cp.accessed(self.namespace.0, keys, hit);
        }
    }

    /// Makes the `lake-cp` link again if it closed (its control plane died
    /// or gave up a leadership), at most every [`RELINK_EVERY`]: the next
    /// control plane serving the socket gets this agent's reports and
    /// lease requests; what was queued on the closed link is lost (access
    /// reports, residency: advisory).
    fn relink(&mut self) {
        let Some(socket) = &self.cp_socket else { return };
        if !self.cp.as_ref().is_some_and(CpLink::is_closed) || Instant::now() < self.relink_at {
            return;
        }
        self.relink_at = Instant::now() + RELINK_EVERY;
        let identity = Identity {
            role: Role::Agent,
            node: self.arena.header().node,
            pid: std::process::id(),
            region_epoch: 0,
            features: lake_core::wire::FEATURES,
            name: &self.cp_name,
        };
        if let Ok(link) = CpLink::connect(socket, &identity, RELINK_WAIT) {
            self.cp = Some(link);
            self.stats.cp_relinks += 1;
        }
    }

    /// Whether this agent talks to a `lake-cp` (attached with its socket).
    pub fn has_control_plane(&self) -> bool {
        self.cp.is_some()
    }

    /// Reports what each rail of this engine's transport carried (its
    /// compute network: `node` is the peer's number in the order the
    /// engine first pushed to it); false without a control plane.
    pub fn report_rails(
        &mut self,
        network: lake_core::wire::message::Network,
        rails: &[lake_core::wire::message::RailEntry],
    ) -> bool {
        self.relink();
        let Some(cp) = &mut self.cp else { return false };
        cp.rails(network, rails);
        true
    }

    /// Reports that the engine now holds `keys` in its own GPU memory
    /// (`resident`), or no longer does (see [`CpLink::resident`]); false
    /// without a control plane.
    pub fn report_resident(&mut self, keys: &[BlockKey], resident: bool) -> bool {
        self.relink();
        let Some(cp) = &mut self.cp else { return false };
        cp.resident(self.namespace.0, keys, resident);
        true
    }

    /// Delivers the payloads of the looked-up blocks `keys[i]` (entries
    /// `table[i]`), in order, to `sink(i, payload)`; stops at the first
    /// that cannot be delivered. Returns how many were.
    pub fn fetch(&mut self, keys: &[BlockKey], table: &[MirrorEntry], mut sink: impl FnMut(usize, &[u8])) -> usize {
        self.fetch_with(keys, table, false, &|| false, &mut |i, _, bytes| sink(i, bytes))
    }

    /// Like [`Agent::fetch`], stopping before the next block (or batch of
    /// lower-tier loads) once `cancelled()` says so: an aborted or
    /// preempted request reads no more, its pins and lease let go at once
    /// ([`FetchFailure::Cancelled`]).
    pub fn fetch_cancellable(
        &mut self,
        keys: &[BlockKey],
        table: &[MirrorEntry],
        cancelled: &dyn Fn() -> bool,
        mut sink: impl FnMut(usize, &[u8]),
    ) -> usize {
        self.fetch_with(keys, table, false, cancelled, &mut |i, _, bytes| sink(i, bytes))
    }

    /// Like [`Agent::fetch`], but each block is handed over segment by
    /// segment — `sink(i, offset, segment)` — as soon as that segment has
    /// matched its CRC, while it is still in the cache: a copy into engine
    /// memory then reads memory once. A block whose later segment fails
    /// has had its earlier segments delivered; it counts as not delivered
    /// (the engine recomputes it), like any failed block.
    pub fn fetch_segments(
        &mut self,
        keys: &[BlockKey],
        table: &[MirrorEntry],
        sink: impl FnMut(usize, usize, &[u8]),
    ) -> usize {
        self.fetch_segments_at(keys, table, Priority::CriticalLoad, sink)
    }

    /// Like [`Agent::fetch_segments`], with the data plane's loads from
    /// lower tiers queued at `priority` (a prefetch behind the loads a
    /// request waits for).
    pub fn fetch_segments_at(
        &mut self,
        keys: &[BlockKey],
        table: &[MirrorEntry],
        priority: Priority,
        sink: impl FnMut(usize, usize, &[u8]),
    ) -> usize {
        self.fetch_segments_cancellable(keys, table, priority, &|| false, sink)
    }

    /// [`Agent::fetch_segments_at`] that stops once `cancelled()` says so
    /// (see [`Agent::fetch_cancellable`]).
    pub fn fetch_segments_cancellable(
        &mut self,
        keys: &[BlockKey],
        table: &[MirrorEntry],
        priority: Priority,
        cancelled: &dyn Fn() -> bool,
        mut sink: impl FnMut(usize, usize, &[u8]),
    ) -> usize {
        self.load_priority = priority;
        let delivered = self.fetch_with(keys, table, true, cancelled, &mut sink);
        self.load_priority = Priority::CriticalLoad;
        delivered
    }

    fn fetch_with(
        &mut self,
        keys: &[BlockKey],
        table: &[MirrorEntry],
        segmented: bool,
        cancelled: &dyn Fn() -> bool,
        sink: &mut dyn FnMut(usize, usize, &[u8]),
    ) -> usize {
        let count = keys.len().min(table.len());
        let region = self.arena.header().region;
        self.last_failure = None;
        let mut failure = None;
        // The lease, and the index of the key its first entry names.
        let mut lease: Option<(Granted, usize)> = None;
        let mut delivered = 0;
        // A block whose L1 copy went between lookup and read (a save took
        // its slot) but that a lower tier holds: read from there instead.
        let mut below_l1 = usize::MAX;
        let mut stale_leases = 0;
        'blocks: while delivered < count {
            let i = delivered;
            if cancelled() {
                failure = Some(FetchFailure::Cancelled);
                break;
            }
            if table[i].tier == Tier::L1Dram && table[i].region.0 == region && below_l1 != i {
                match self
                    .read_l1_timed(&keys[i], table[i].slot, table[i].generation, segmented, &mut |o, p| sink(i, o, p))
                {
                    Ok(()) => {
                        delivered += 1;
                        continue;
                    }
                    Err(FetchFailure::Evicted)
                        if table[i].tiers & (1 << Tier::L2Nvme as u8 | 1 << Tier::L3Object as u8) != 0 =>
                    {
                        below_l1 = i;
                        // A lease from before this knew only the L1 copy.
                        if let Some((granted, _)) = lease.take()
                            && let Some(cp) = &mut self.cp
                        {
                            cp.release_lease(granted.lease_id);
                        }
                    }
                    Err(why) => {
                        failure = Some(why);
                        break;
                    }
                }
            }
            // Below L1: a lease for the next window of the prefix, then
            // loads in small batches (each load takes an L1 slot until
            // evicted). A window, not the whole rest: what a lease holds
            // cannot be moved to make room for the loads.
            if let Some((granted, base)) = &lease
                && i - base >= granted.entries.len()
                && granted.entries.len() == LEASE_WINDOW
            {
                if let Some(cp) = &mut self.cp {
                    cp.release_lease(granted.lease_id);
                }
                lease = None;
            }
            if lease.is_none() {
                match self.lease(&keys[i..count.min(i + LEASE_WINDOW)]) {
                    Some(granted) => lease = Some((granted, i)),
                    None => {
                        failure = Some(FetchFailure::Unavailable);
                        break;
                    }
                }
            }
            let Some((granted, base)) = &lease else { break };
            // The block is in L1 after all (promoted since the lookup, or
            // the control plane has not yet heard that its L1 copy went).
            if let Some(&(key, replica)) = granted.entries.get(i - *base)
                && key == keys[i]
                && replica.tier == Tier::L1Dram
                && replica.region.0 == region
            {
                let stale = below_l1 == i && (replica.slot, replica.generation) == (table[i].slot, table[i].generation);
                if stale && stale_leases < STALE_LEASES_MAX {
                    // Asked again in a moment, when its eviction is known.
                    stale_leases += 1;
                    if let (Some(cp), Some((granted, _))) = (&mut self.cp, lease.take()) {
                        cp.release_lease(granted.lease_id);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                match self
                    .read_l1_timed(&keys[i], replica.slot, replica.generation, segmented, &mut |o, p| sink(i, o, p))
                {
                    Ok(()) => {
                        delivered += 1;
                        continue;
                    }
                    Err(why) => {
                        failure = Some(why);
                        break;
                    }
                }
            }
            let mut batch: Vec<(usize, ReplicaWire)> = Vec::with_capacity(LOAD_BATCH);
            for j in i..count.min(i + LOAD_BATCH) {
                if table[j].tier == Tier::L1Dram && j != below_l1 {
                    break;
                }
                let Some(&(key, replica)) = granted.entries.get(j - base) else { break };
                if key != keys[j] || !matches!(replica.tier, Tier::L2Nvme | Tier::L3Object) {
                    break;
                }
                batch.push((j, replica.to_wire()));
            }
            if batch.is_empty() {
                failure = Some(FetchFailure::Evicted);
                break;
            }
            let started = Instant::now();
            let mut pinned = self.load_batch(keys, &batch, cancelled);
            let mut stop = false;
            let mut batch_blocks = [0u32; 4];
            for ((j, source), pin) in batch.iter().zip(pinned.iter_mut()) {
                if cancelled() {
                    failure = Some(FetchFailure::Cancelled);
                    stop = true;
                    break;
                }
                let Some(pin) = pin.take() else {
                    failure = Some(FetchFailure::Unavailable);
                    stop = true;
                    break;
                };
                let read = self.read_pinned(&keys[*j], &pin, segmented, &mut |o, p| sink(*j, o, p));
                self.pins.unpin(pin);
                match read {
                    Ok(bytes) => {
                        if source.tier == Tier::L3Object as u8 {
                            self.stats.l3_loads += 1;
                            batch_blocks[3] += 1;
                        } else {
                            self.stats.l2_loads += 1;
                            batch_blocks[2] += 1;
                        }
                        self.stats.bytes_read += bytes as u64;
                        delivered += 1;
                    }
                    Err(why) => {
                        failure = Some(why);
                        stop = true;
                        break;
                    }
                }
            }
            // Blocks after a failure are not delivered: their pins go.
            for pin in pinned.into_iter().flatten() {
                self.pins.unpin(pin);
            }
            // The batch's time, shared by the blocks it delivered.
            let delivered_here: u32 = batch_blocks.iter().sum();
            if delivered_here > 0 {
                let per_block = started.elapsed() / delivered_here;
                for tier in [Tier::L2Nvme, Tier::L3Object] {
                    if batch_blocks[tier as usize] > 0 {
                        self.cost(tier, per_block);
                        // The rest of the batch's blocks from this tier,
                        // each timed (the cost folds the batch once).
                        for _ in 1..batch_blocks[tier as usize] {
                            self.time_block(tier, per_block);
                        }
                    }
                }
            }
            if stop {
                break 'blocks;
            }
        }
        self.stats.fetch_failures += (count - delivered) as u64;
        self.last_failure = failure;
        self.report_paths();
        if let (Some(cp), Some((granted, _))) = (&mut self.cp, lease) {
            cp.release_lease(granted.lease_id);
            let _ = cp.pump();
        }
        delivered
    }

    /// Why the last fetch stopped before the end of its hit (`None` when
    /// it delivered every block).
    pub fn last_fetch_failure(&self) -> Option<FetchFailure> {
        self.last_failure
    }

    /// [`Agent::read_l1`], timed into the agent's L1 read cost and
    /// counted.
    fn read_l1_timed(
        &mut self,
        key: &BlockKey,
        slot: u32,
        generation: u32,
        segmented: bool,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), FetchFailure> {
        let started = Instant::now();
        let bytes = self.read_l1(key, slot, generation, segmented, sink)?;
        self.cost(Tier::L1Dram, started.elapsed());
        self.stats.l1_reads += 1;
        self.stats.bytes_read += bytes as u64;
        Ok(())
    }

    /// Reads one L1 block through a pin: the generation must still be
    /// `generation`, the header must name `key` in this agent's namespace
    /// and layout, the payload must match its CRCs. Returns the payload
    /// length.
    fn read_l1(
        &mut self,
        key: &BlockKey,
        slot: u32,
        generation: u32,
        segmented: bool,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<usize, FetchFailure> {
        let pin = self.pins.pin(slot, generation).map_err(|_| FetchFailure::Evicted)?;
        let result = self.read_pinned(key, &pin, segmented, sink);
        self.pins.unpin(pin);
        result
    }

    /// Folds one block's load from `tier`, which took `per_block`, into
    /// the tier's cost ([`fold_load_cost`]), and times it.
    fn cost(&mut self, tier: Tier, per_block: Duration) {
        self.time_block(tier, per_block);
        let Some(average) = self.stats.load_ns_per_block.get_mut(tier as usize) else { return };
        *average = fold_load_cost(*average, per_block);
    }

    /// Counts one block from `tier` that took `took` in its path's
    /// histogram.
    fn time_block(&mut self, tier: Tier, took: Duration) {
        if let Some(path) = (tier as usize).checked_sub(1).and_then(|i| self.paths.get_mut(i)) {
            path.record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
        }
    }

    /// How long this agent's reads and loads took, by path (what it sends
    /// `lake-cp`).
    pub fn path_latency(&self) -> &[lake_core::wire::message::PathEntry] {
        &self.paths
    }

    /// Sends the path histograms to `lake-cp` if a second has passed since
    /// they last went (and the control plane takes them).
    fn report_paths(&mut self) {
        if self.paths_sent.elapsed() < Duration::from_secs(1) {
            return;
        }
        if let Some(cp) = &mut self.cp {
            self.paths_sent = Instant::now();
            cp.path_latency(&self.paths);
        }
    }

    /// [`Agent::read_l1`] of a block pinned already.
    fn read_pinned(
        &self,
        key: &BlockKey,
        pin: &Pin,
        segmented: bool,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<usize, FetchFailure> {
        let reader =
            Reader { namespace: self.namespace, layout_fingerprint: self.layout_fingerprint, kind: self.object_kind };
        let object = ReadableObject::check(self.pins.bytes(pin), key, &reader).map_err(FetchFailure::from)?;
        if segmented {
            for segment in object.segments() {
                let (offset, bytes) = segment.map_err(FetchFailure::from)?;
                sink(offset, bytes);
            }
        } else {
            object.header.verify_payload(object.payload).map_err(|_| FetchFailure::Corrupt)?;
            sink(0, object.payload);
        }
        Ok(object.payload.len())
    }

    /// A lease on the replicas of `keys` (their leading run that has one).
    fn lease(&mut self, keys: &[BlockKey]) -> Option<Granted> {
        self.lease_for(keys, LEASE_TTL_MS)
    }

    /// Asks `lake-cp` for a lease on the replicas of `keys` (their leading
    /// run that has a ready one) for `ttl_ms`, and waits for the grant (at
    /// most [`WAIT_MAX`]). `None` without a `lake-cp` or without an answer.
    /// While held, eviction passes those replicas over; release it with
    /// [`Agent::release_lease`] (it also ends at its deadline, or when this
    /// agent goes).
    pub fn lease_for(&mut self, keys: &[BlockKey], ttl_ms: u32) -> Option<Granted> {
        self.relink();
        let cp = self.cp.as_mut()?;
        let request = cp.request_lease(self.namespace.0, keys, ttl_ms);
        let deadline = Instant::now() + WAIT_MAX;
        loop {
            cp.pump().ok()?;
            if let Some(grant) = cp.take_grant(request) {
                return Some(grant);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Loads a batch of L2 (or L3) blocks into L1, each pinned as soon as
    /// its load is answered (before the control plane, seeing L1 over its
    /// mark, can take the new copy away): its pin, `None` where it failed.
    /// A load refused for want of an L1 slot is retried
    /// while `lake-cp` makes room, for at most [`LOAD_RETRY_MAX`]; so is one
    /// whose new copy was taken away between the answer and the pin (an L1
    /// of a few slots under demotions can pick it as its next victim).
    ///
    /// Once `cancelled` says so, the loads still queued in the data plane
    /// are cancelled there ([`AgentRequest::Cancel`]): they stop using the
    /// disk at once, and none is retried.
    fn load_batch(
        &mut self,
        keys: &[BlockKey],
        batch: &[(usize, ReplicaWire)],
        cancelled: &dyn Fn() -> bool,
    ) -> Vec<Option<Pin>> {
        let deadline = Instant::now() + LOAD_RETRY_MAX;
        let mut slots: Vec<Option<Pin>> = (0..batch.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..batch.len()).collect();
        let mut stopped = false;
        let trace = if self.traces_taken { self.trace } else { 0 };
        while !pending.is_empty() {
            let mut cookies = Vec::with_capacity(pending.len());
            let asked = Instant::now();
            for &b in &pending {
                let (j, source) = batch[b];
                let cookie = self.cookie();
                let priority = self.load_priority;
                let load = AgentRequest::Load { cookie, key: keys[j], source, priority, trace };
                if self.port.submit(load).is_err() {
                    break;
                }
                cookies.push((b, cookie));
            }
            let mut retry = Vec::new();
            for at in 0..cookies.len() {
                if !stopped && cancelled() {
                    stopped = true;
                    let loads: Vec<u64> = cookies[at..].iter().map(|&(_, c)| c).collect();
                    self.cancel_loads(&loads);
                }
                let (b, cookie) = cookies[at];
                let answer = self.wait_for(cookie);
                if self.trace != 0 {
                    let (j, source) = batch[b];
                    self.keep_span(TraceSpan {
                        trace: self.trace,
                        key: keys[j],
                        tier: source.tier,
                        result: answer.result.map(|_| ()),
                        took_ns: u64::try_from(asked.elapsed().as_nanos()).unwrap_or(u64::MAX),
                        data_plane_us: answer.took_us,
                    });
                }
                match answer.result {
                    Ok((slot, generation)) => match self.pins.pin(slot, generation) {
                        Ok(pin) => slots[b] = Some(pin),
                        Err(PinError::Stale { .. }) => retry.push(b),
                        Err(_) => {}
                    },
                    Err(AgentError::NoSpace | AgentError::Busy) => retry.push(b),
                    Err(_) => {}
                }
            }
            // Only a failure-free prefix is useful.
            let first_failed = (0..batch.len()).find(|&b| slots[b].is_none() && !retry.contains(&b));
            retry.retain(|&b| first_failed.is_none_or(|f| b < f));
            if retry.is_empty() || stopped || cancelled() || Instant::now() > deadline {
                break;
            }
            pending = retry;
            std::thread::sleep(Duration::from_micros(200));
        }
        slots
    }

    /// Asks the data plane to stop each of `loads` (their cookies) still
    /// queued; waits for its answers (each at once), so none is left for
    /// a later wait to trip over. The loads' own answers still come.
    fn cancel_loads(&mut self, loads: &[u64]) {
        let mut asked = Vec::with_capacity(loads.len());
        for &load in loads {
            let cookie = self.cookie();
            if self.port.submit(AgentRequest::Cancel { cookie, load }).is_ok() {
                asked.push(cookie);
            }
        }
        for cookie in asked {
            if self.wait(cookie).is_ok() {
                self.stats.loads_cancelled += 1;
            }
        }
    }

    /// Saves `blocks` (best effort); returns how many were committed.
    pub fn save(&mut self, blocks: &[SaveBlock<'_>]) -> usize {
        let mut statuses = vec![SaveStatus::NotSent; blocks.len()];
        self.save_with_statuses(blocks, &mut statuses)
    }

    /// [`Agent::save`], with what became of each block in `statuses` (as
    /// long as `blocks`).
    pub fn save_with_statuses(&mut self, blocks: &[SaveBlock<'_>], statuses: &mut [SaveStatus]) -> usize {
        debug_assert_eq!(blocks.len(), statuses.len());
        self.forget_unsaved(blocks.iter().map(|b| b.key));
        blocks
            .chunks(SAVE_WINDOW)
            .zip(statuses.chunks_mut(SAVE_WINDOW))
            .map(|(window, statuses)| {
                let saved = self.save_window(window, statuses);
                self.note_unsaved_of(window.iter().map(|b| b.key), statuses);
                saved
            })
            .sum()
    }

    /// The blocks of a save about to be sent are judged afresh: a block
    /// not saved before and asked again is no longer held against its
    /// children in the same save.
    fn forget_unsaved(&mut self, keys: impl Iterator<Item = BlockKey>) {
        if self.unsaved_set.is_empty() {
            return;
        }
        for key in keys {
            self.unsaved_set.remove(&key);
        }
    }

    /// Remembers `keys` as not saved (see [`Agent::save_with_statuses`]):
    /// a save of a block under one of them, in this call or a later one,
    /// is not sent. A caller that skips a save of its own accord (the pool
    /// under save pressure) says so here.
    pub fn note_unsaved(&mut self, keys: &[BlockKey]) {
        for key in keys {
            self.remember_unsaved(*key);
        }
    }

    /// [`Agent::note_unsaved`] of the blocks of a save whose `statuses`
    /// say they were not saved.
    fn note_unsaved_of(&mut self, keys: impl Iterator<Item = BlockKey>, statuses: &[SaveStatus]) {
        for (key, status) in keys.zip(statuses) {
            if *status != SaveStatus::Saved {
                self.remember_unsaved(key);
            }
        }
    }

    fn remember_unsaved(&mut self, key: BlockKey) {
        if !self.unsaved_set.insert(key) {
            return;
        }
        if self.unsaved_recent.len() == UNSAVED_KEPT
            && let Some(old) = self.unsaved_recent.pop_front()
        {
            self.unsaved_set.remove(&old);
        }
        self.unsaved_recent.push_back(key);
    }

    /// Asks a slot for each block to save — `(parent, key, object bytes)` —
    /// all before waiting for any: its reservation's cookie, or `None`
    /// where it was not asked (its parent is known not saved, so it will
    /// not be either; or the port had no room, and neither is the rest).
    fn reserve_each(&mut self, blocks: impl Iterator<Item = (BlockKey, BlockKey, u64)>) -> Vec<Option<u64>> {
        let mut reserved = Vec::new();
        let mut full = false;
        for (parent, key, object_bytes) in blocks {
            if full || self.parent_unsaved(&parent) {
                self.remember_unsaved(key);
                reserved.push(None);
                continue;
            }
            let cookie = self.cookie();
            full = self.port.submit(AgentRequest::Reserve { cookie, object_bytes }).is_err();
            reserved.push((!full).then_some(cookie));
        }
        reserved
    }

    /// The slot reserved (`cookie`, if asked) for the block `(parent,
    /// key)` of a save, once granted; or what became of the block, which
    /// is then remembered as not saved. A block whose parent was not saved
    /// gets none: a slot granted to it is given back unwritten.
    fn slot_for(&mut self, cookie: Option<u64>, (parent, key): (BlockKey, BlockKey)) -> Result<(u32, u32), SaveStatus> {
        let orphan = self.parent_unsaved(&parent);
        let status = match cookie.map(|cookie| self.wait(cookie)) {
            Some(Ok((slot, generation))) if orphan => {
                let cookie = self.cookie();
                let _ = self.port.submit(AgentRequest::Abort { cookie, slot, generation });
                SaveStatus::ParentUnsaved
            }
            Some(Ok(granted)) => return Ok(granted),
            _ if orphan => SaveStatus::ParentUnsaved,
            Some(Err(why)) => SaveStatus::Refused(why),
            None => SaveStatus::NotSent,
        };
        self.remember_unsaved(key);
        Err(status)
    }

    /// Whether the parent of a block to save was not saved (earlier in
    /// this save, or lately).
    /// Whether `parent` is known not saved: this agent failed to save it
    /// and the pool holds no copy (saved again, or by another engine).
    fn parent_unsaved(&self, parent: &BlockKey) -> bool {
        *parent != BlockKey::NONE && self.unsaved_set.contains(parent) && !self.mirror.get(parent).is_hit()
    }

    /// Whether the data plane refuses saves now (it refused one for want
    /// of room lately, or it is stopping): read from the port's shared
    /// memory, no request sent. An engine then skips saving a request
    /// rather than have its prefix refused part way.
    pub fn save_pressure(&self) -> bool {
        self.port.save_pressure()
    }

    /// A handle that reads [`Agent::save_pressure`] from any thread.
    pub fn save_pressure_probe(&self) -> crate::port::SavePressure {
        self.port.save_pressure_probe()
    }

    /// [`Agent::save`] of at most [`SAVE_WINDOW`] blocks. A block whose
    /// parent was not saved (refused, or itself skipped) is not saved
    /// either — a prefix is of use only from its start.
    fn save_window(&mut self, blocks: &[SaveBlock<'_>], statuses: &mut [SaveStatus]) -> usize {
        debug_assert!(blocks.len() <= SAVE_WINDOW);
        statuses.fill(SaveStatus::NotSent);
        let reserved =
            self.reserve_each(blocks.iter().map(|b| (b.parent, b.key, object_bytes(b.payload.len() as u64))));
        let header = *self.arena.header();
        let mut commits = Vec::with_capacity(reserved.len());
        for (i, block) in blocks.iter().enumerate() {
            let (slot, generation) = match self.slot_for(reserved[i], (block.parent, block.key)) {
                Ok(granted) => granted,
                Err(status) => {
                    statuses[i] = status;
                    continue;
                }
            };
            let cookie = self.cookie();
            let meta = self.object_meta(
                &header,
                (block.key, block.parent, block.block_index),
                slot,
                generation,
                block.payload.len(),
            );
            let written = self.write_object(slot, &meta, &block.payload);
            let request = if written {
                AgentRequest::Commit { cookie, slot, generation, crcs: CrcOrigin::Slot }
            } else {
                statuses[i] = SaveStatus::Refused(AgentError::Invalid);
                AgentRequest::Abort { cookie, slot, generation }
            };
            if self.port.submit(request).is_ok() && written {
                commits.push((i, cookie, block.payload.len()));
            }
        }
        self.await_commits(commits, statuses)
    }

    /// Waits for the commits sent (block index, cookie, payload bytes) of a
    /// save, counts them and sets their `statuses`; returns how many were
    /// committed.
    fn await_commits(&mut self, commits: Vec<(usize, u64, usize)>, statuses: &mut [SaveStatus]) -> usize {
        let mut saved = 0;
        for (i, cookie, len) in commits {
            match self.wait(cookie) {
                Ok(_) => {
                    saved += 1;
                    self.stats.bytes_saved += len as u64;
                    statuses[i] = SaveStatus::Saved;
                }
                Err(why) => statuses[i] = SaveStatus::Refused(why),
            }
        }
        self.stats.saves += saved as u64;
        self.stats.saves_skipped += (statuses.len() - saved) as u64;
        saved
    }

    /// The stored header of a block this agent saves into `slot`:
    /// `(key, parent, block index)`, its payload length.
    fn object_meta(
        &self,
        arena: &lake_core::arena::layout::ArenaHeader,
        (key, parent_key, block_index): (BlockKey, BlockKey, u32),
        slot: u32,
        generation: u32,
        len: usize,
    ) -> ObjectMeta {
        ObjectMeta {
            kind: self.object_kind,
            key,
            parent_key,
            block_index,
            namespace: self.namespace,
            layout_fingerprint: self.layout_fingerprint,
            region: lake_core::model::replica::RegionId(arena.region),
            region_epoch: arena.epoch,
            slot,
            generation,
            committed_unix_ns: unix_ns(),
            payload_len: len as u64,
            segment_bytes: self.segment_bytes_for(len as u64),
        }
    }

    /// Bytes per CRC segment of a payload of `len` bytes saved by this
    /// agent (what a caller computing the CRCs itself must use).
    pub fn segment_bytes_for(&self, len: u64) -> u64 {
        self.segment_bytes.min(len).max(1)
    }

    /// Saves blocks whose payloads someone else writes and whose segment
    /// CRCs are already known (a GPU gathers them straight into the slots
    /// and computed the CRCs from the engine's memory): reserves a slot per
    /// block, hands every payload area to `fill` at once — `(block index,
    /// where its payload goes)` — and, if `fill` returns true, writes each
    /// header with the given CRCs and commits them (aborts them
    /// otherwise). The data plane checks the CRCs against the bytes as its
    /// commit check says for their origin. Best effort; returns how many
    /// were committed.
    pub fn save_prepared(
        &mut self,
        blocks: &[PreparedSave<'_>],
        statuses: &mut [SaveStatus],
        fill: impl FnOnce(&[(usize, *mut u8)]) -> bool,
    ) -> usize {
        self.forget_unsaved(blocks.iter().map(|b| b.key));
        let turn = self.reserve_prepared(blocks, statuses);
        let filled = !turn.bodies.is_empty() && fill(&turn.bodies);
        let sent = self.commit_prepared(turn, blocks, filled, statuses);
        self.await_prepared(sent, blocks, statuses)
    }

    /// [`Agent::save_prepared`] in three steps, for a caller that fills
    /// one turn's slots while it reserves the next and commits the one
    /// before: reserves a slot per block; the payload areas are in the
    /// turn's `bodies`. Only the blocks' keys, parents, positions and
    /// lengths are read here: their CRCs may still be being computed (the
    /// headers are written at commit). Every block of the save goes
    /// through [`Agent::commit_prepared`] and [`Agent::await_prepared`]
    /// after. A caller that saves a prompt in several turns calls
    /// [`Agent::forget_unsaved_of`] once, first.
    pub fn reserve_prepared(&mut self, blocks: &[PreparedSave<'_>], statuses: &mut [SaveStatus]) -> PreparedTurn {
        debug_assert_eq!(blocks.len(), statuses.len());
        statuses.fill(SaveStatus::NotSent);
        let reserved = self.reserve_each(blocks.iter().map(|b| (b.parent, b.key, object_bytes(b.len as u64))));
        let mut turn =
            PreparedTurn { slots: Vec::with_capacity(reserved.len()), bodies: Vec::with_capacity(reserved.len()) };
        for (i, (block, cookie)) in blocks.iter().zip(&reserved).enumerate() {
            let (slot, generation) = match self.slot_for(*cookie, (block.parent, block.key)) {
                Ok(granted) => granted,
                Err(status) => {
                    statuses[i] = status;
                    continue;
                }
            };
            // SAFETY: reserved to this agent (see write_object).
            let body = match unsafe { self.region.slot_mut(slot) } {
                Some(bytes) if bytes.len() >= STORED_HEADER_BYTES + block.len => {
                    Some(bytes[STORED_HEADER_BYTES..].as_mut_ptr())
                }
                _ => None,
            };
            match body {
                Some(body) => {
                    turn.slots.push((i, slot, generation));
                    turn.bodies.push((i, body));
                }
                None => {
                    let cookie = self.cookie();
                    let _ = self.port.submit(AgentRequest::Abort { cookie, slot, generation });
                    statuses[i] = SaveStatus::Refused(AgentError::Invalid);
                }
            }
        }
        turn
    }

    /// Commits a turn of [`Agent::reserve_prepared`] whose payloads are in
    /// their slots (`filled`; aborts it otherwise): writes each header with
    /// its block's CRCs (`blocks` as given to the reserve, the CRCs known
    /// now) and sends the commits. A block whose CRCs do not fit its
    /// payload is aborted (`Invalid`), and so is a block whose parent was
    /// not saved (`ParentUnsaved`): its children later in the save go too.
    pub fn commit_prepared(
        &mut self,
        turn: PreparedTurn,
        blocks: &[PreparedSave<'_>],
        filled: bool,
        statuses: &mut [SaveStatus],
    ) -> SentCommits {
        let header = *self.arena.header();
        let mut sent = SentCommits(Vec::with_capacity(turn.slots.len()));
        for (i, slot, generation) in turn.slots {
            let cookie = self.cookie();
            let block = &blocks[i];
            let orphan = self.parent_unsaved(&block.parent);
            let encoded = filled && !orphan && {
                let meta = self.object_meta(
                    &header,
                    (block.key, block.parent, block.block_index),
                    slot,
                    generation,
                    block.len,
                );
                // SAFETY: reserved to this agent (see write_object); the
                // payload's writers are done (`filled`), the header is
                // this agent's alone until the commit below.
                let slot_bytes = unsafe { self.region.slot_mut(slot) };
                slot_bytes
                    .and_then(|bytes| bytes.get_mut(..STORED_HEADER_BYTES))
                    .and_then(|head| <&mut [u8; STORED_HEADER_BYTES]>::try_from(head).ok())
                    .is_some_and(|head| encode_header(&meta, block.crcs, head).is_ok())
            };
            let request = if encoded {
                AgentRequest::Commit { cookie, slot, generation, crcs: block.crcs_from }
            } else {
                statuses[i] = if orphan {
                    SaveStatus::ParentUnsaved
                } else if filled {
                    SaveStatus::Refused(AgentError::Invalid)
                } else {
                    SaveStatus::Refused(AgentError::Io)
                };
                // Known now: its children later in this turn go too.
                self.remember_unsaved(block.key);
                AgentRequest::Abort { cookie, slot, generation }
            };
            if self.port.submit(request).is_ok() && encoded {
                sent.0.push((i, cookie, block.len));
            }
        }
        sent
    }

    /// Waits for a turn's commits, sets their `statuses` and remembers the
    /// blocks not saved; returns how many were committed.
    pub fn await_prepared(
        &mut self,
        sent: SentCommits,
        blocks: &[PreparedSave<'_>],
        statuses: &mut [SaveStatus],
    ) -> usize {
        let saved = self.await_commits(sent.0, statuses);
        self.note_unsaved_of(blocks.iter().map(|b| b.key), statuses);
        saved
    }

    /// Forgets that the blocks of a save about to be sent were not saved
    /// lately (see [`Agent::reserve_prepared`]).
    pub fn forget_unsaved_of(&mut self, keys: &[BlockKey]) {
        self.forget_unsaved(keys.iter().copied());
    }

    /// Writes a stored object into the reserved `slot`: the payload's
    /// segment CRCs computed from the bytes as they are copied (a segment
    /// is read once, into cache, checksummed, and streamed into the slot
    /// with stores that do not read the slot's lines first), then the
    /// header with them.
    fn write_object(&mut self, slot: u32, meta: &ObjectMeta, payload: &SavePayload<'_>) -> bool {
        // SAFETY: the data plane reserved this slot to this agent: nobody
        // else writes it, and it is not published (so nobody reads it)
        // until this agent commits it.
        let Some(bytes) = (unsafe { self.region.slot_mut(slot) }) else { return false };
        let len = payload.len();
        if bytes.len() < STORED_HEADER_BYTES + len {
            return false;
        }
        let (head, body) = bytes.split_at_mut(STORED_HEADER_BYTES);
        let body = &mut body[..len];
        let mut crcs = [0u32; SEGMENTS_MAX];
        let Ok(count) = meta.segment_count() else { return false };
        let Some(crcs_out) = crcs.get_mut(..usize::from(count)) else { return false };
        let filled = match payload {
            SavePayload::Bytes(source) => {
                let segment = usize::try_from(meta.segment_bytes).unwrap_or(usize::MAX);
                for ((from, to), crc) in source.chunks(segment).zip(body.chunks_mut(segment)).zip(crcs_out) {
                    *crc = crc32fast::hash(from);
                    // SAFETY: `from` and `to` are segments of equal length
                    // of the source and of this agent's reserved slot.
                    unsafe { lake_core::copy::copy_streaming(to.as_mut_ptr(), from.as_ptr(), from.len()) };
                }
                true
            }
            SavePayload::Gather { fill, .. } => fill(body, meta.segment_bytes, crcs_out),
        };
        if !filled {
            return false;
        }
        let Ok(head) = <&mut [u8; STORED_HEADER_BYTES]>::try_from(head) else { return false };
        encode_header(meta, &crcs[..usize::from(count)], head).is_ok()
    }

    fn cookie(&mut self) -> u64 {
        self.next_cookie += 1;
        self.next_cookie
    }

    /// Waits for the completion of `cookie` (others that arrive meanwhile
    /// are kept for their own waits).
    fn wait(&mut self, cookie: u64) -> Result<(u32, u32), AgentError> {
        self.wait_for(cookie).result
    }

    /// [`Agent::wait`], the whole answer (a traced load's time with it).
    fn wait_for(&mut self, cookie: u64) -> AgentCompletion {
        if let Some(at) = self.early.iter().position(|c| c.cookie == cookie) {
            return self.early.swap_remove(at);
        }
        let deadline = Instant::now() + WAIT_MAX;
        let mut spins = 0u32;
        loop {
            while let Some(completion) = self.port.complete() {
                if completion.cookie == cookie {
                    return completion;
                }
                // Bounded: answers to waits that timed out are dropped
                // oldest first.
                if self.early.len() >= 4096 {
                    self.early.remove(0);
                }
                self.early.push(completion);
            }
            if let Some(cp) = &mut self.cp {
                let _ = cp.pump();
            }
            spins += 1;
            if spins > 64 {
                if Instant::now() > deadline {
                    return AgentCompletion { cookie, result: Err(AgentError::Busy), took_us: 0 };
                }
                std::thread::sleep(Duration::from_micros(10));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Releases a lease from [`Agent::lease_for`] (sent with the next
    /// call that talks to `lake-cp`, or [`Agent::pump`]).
    pub fn release_lease(&mut self, lease_id: u64) {
        if let Some(cp) = &mut self.cp {
            cp.release_lease(lease_id);
            let _ = cp.pump();
        }
    }

    /// Sends what is queued to `lake-cp` (access reports, lease releases).
    pub fn pump(&mut self) {
        self.relink();
        self.report_paths();
        if let Some(cp) = &mut self.cp {
            let _ = cp.pump();
        }
    }
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
