//! The data plane's end of the cp↔dp protocol: one Unix-socket connection
//! to the node's `lake-cp`, over which `lake-dp` reports its regions and
//! every block it commits, re-adopts or evicts.
//!
//! The hello exchange is done at connect (blocking, with a deadline);
//! after that the socket is non-blocking and the runner calls
//! [`CpLink::pump`] from its loop. Reports go into a bounded buffer
//! allocated at connect: when it is full (the control plane is not
//! reading) a report is dropped and counted — never a block and never a
//! stall of the poll loop; the control plane learns the truth again from
//! the re-adoption a reconnect reports. Frames the control plane sends are
//! decoded as they complete: `Error` frames are counted (a refused report
//! is the control plane's call); tier commands (`MoveBlock`, `CopyBlock`,
//! `EvictBlock`) wait in a bounded queue for the runner, which answers each
//! with a `TransferDone` (a command that finds the queue full is answered
//! `QueueFull` at once); lease grants wait for the agent that asked; a
//! malformed stream closes the link.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::wire::hello::{self, Identity};
use std::collections::VecDeque;

use crate::model::key::BlockKey;
use crate::model::replica::Replica;
use crate::wire::message::{
    Accessed, BlockEvicted, BlockRecord, ErrorCode, HelloAck, LeaseRelease, LeaseRequest, RegisterRegion, Resident,
    Transfer, TransferDone,
};
use crate::wire::{FLAG_REPLY, FrameMeta, Limits, Message, Records, WireError, decode_frame, encode_frame};

/// Tier commands the link holds for the runner before it answers
/// `QueueFull`.
pub const COMMANDS_MAX: usize = 4096;

/// A tier command from the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpCommand {
    /// Write the source into the target tier, then free the source.
    Move {
        /// The command's request id (the answer echoes it).
        request: u64,
        /// What to move.
        transfer: Transfer,
    },
    /// Write the source into the target tier and keep the source.
    Copy {
        /// The command's request id.
        request: u64,
        /// What to copy.
        transfer: Transfer,
    },
    /// Free the replica.
    Evict {
        /// The command's request id.
        request: u64,
        /// What to free.
        replica: BlockEvicted,
    },
    /// Drain an L2 file (write nothing new there), or use it again.
    Drain {
        /// The command's request id.
        request: u64,
        /// Which region, and whether to drain it.
        drain: crate::wire::message::DrainRegion,
    },
    /// An L1 block the control plane chose as a victim (`evictable`:
    /// taken back when false): a save that finds no free slot may take it.
    /// Not answered.
    Mark {
        /// The block, and why it may go (`Demoted`: a copy is below;
        /// `Capacity`: dropped).
        replica: BlockEvicted,
        /// Marked, or taken back.
        evictable: bool,
    },
    /// Whether the control plane may still mark victims (or free slots)
    /// in the L1 `region`. Not answered.
    VictimsLeft {
        /// The region.
        region: u16,
        /// More may come.
        left: bool,
    },
}

impl CpCommand {
    /// Its request id and the replica its answer names.
    pub fn request_and_target(&self) -> (u64, crate::model::replica::ReplicaWire) {
        match *self {
            Self::Move { request, transfer } | Self::Copy { request, transfer } => (request, transfer.target),
            Self::Evict { request, replica } => (request, replica.replica),
            Self::Mark { replica, .. } => (0, replica.replica),
            Self::VictimsLeft { region, .. } => (
                0,
                crate::model::replica::ReplicaWire {
                    tier: crate::model::replica::Tier::L1Dram as u8,
                    reserved: 0,
                    region,
                    node: 0,
                    region_epoch: 0,
                    slot: 0,
                    generation: 0,
                },
            ),
            Self::Drain { request, drain } => (
                request,
                crate::model::replica::ReplicaWire {
                    tier: crate::model::replica::Tier::L2Nvme as u8,
                    reserved: 0,
                    region: drain.region,
                    node: 0,
                    region_epoch: 0,
                    slot: crate::wire::message::SLOT_ANY,
                    generation: 0,
                },
            ),
        }
    }
}

/// A lease the control plane granted to this link's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Granted {
    /// The request id it answers.
    pub request: u64,
    /// The lease (release it when done).
    pub lease_id: u64,
    /// Wall-clock expiry.
    pub deadline_unix_ns: u64,
    /// The replicas held, in key order.
    pub entries: Vec<(BlockKey, Replica)>,
}

/// Bytes of reports the link buffers before it drops reports.
pub const OUT_BYTES: usize = 1 << 20;

/// Why the link failed.
#[derive(Debug)]
pub enum CpLinkError {
    /// The socket failed.
    Io(io::Error),
    /// The control plane sent something that is not the protocol.
    Wire(WireError),
    /// The control plane answered the hello with something else, or not
    /// within the deadline.
    Hello(&'static str),
}

impl core::fmt::Display for CpLinkError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "link to lake-cp: {e}"),
            Self::Wire(e) => write!(f, "link to lake-cp: {e}"),
            Self::Hello(what) => write!(f, "link to lake-cp: hello: {what}"),
        }
    }
}

impl std::error::Error for CpLinkError {}

impl From<io::Error> for CpLinkError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// What the link has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpLinkCounters {
    /// Reports queued.
    pub sent: u64,
    /// Reports dropped because the buffer was full.
    pub dropped: u64,
    /// Error frames received (reports the control plane refused).
    pub refused: u64,
    /// Frames received in all.
    pub received: u64,
    /// Commands refused for a leader term below the fence's.
    pub stale_terms: u64,
    /// Commands refused because a newer term could not be made durable.
    pub fence_errors: u64,
    /// Rail reports not sent: the control plane does not take them (an
    /// older build, [`crate::wire::FEATURE_RAIL_STATS`]).
    pub rails_withheld: u64,
}

/// The link. See the module docs.
#[derive(Debug)]
pub struct CpLink {
    stream: UnixStream,
    out: Vec<u8>,
    sent_upto: usize,
    input: Vec<u8>,
    input_len: usize,
    limits: Limits,
    ack: HelloAck,
    next_request: u64,
    closed: bool,
    commands: VecDeque<CpCommand>,
    /// Requests the control plane takes back (`Cancel`, kind 10): copies
    /// to other nodes not yet sent are dropped.
    cancels: VecDeque<u64>,
    grants: VecDeque<Granted>,
    /// The data plane's fence: commands below its term are refused.
    fence: Option<crate::fence::TermFence>,
    /// What it has done.
    pub counters: CpLinkCounters,
}

impl CpLink {
    /// Connects to the control plane at `path` and exchanges hellos within
    /// `deadline`.
    pub fn connect(path: &Path, identity: &Identity<'_>, deadline: Duration) -> Result<Self, CpLinkError> {
        let mut stream = UnixStream::connect(path)?;
        let local = hello::hello(identity).map_err(CpLinkError::Wire)?;
        let mut frame = [0u8; 256];
        let meta = FrameMeta { version: hello::HELLO_WIRE_VERSION, flags: 0, request_id: 1, leader_term: 0 };
        let len = encode_frame(meta, &Message::Hello(local), &mut frame).map_err(CpLinkError::Wire)?;
        stream.write_all(&frame[..len])?;
        let end = Instant::now() + deadline;
        let mut input = vec![0u8; crate::constants::WIRE_FRAME_BYTES_MAX.min(1 << 20)];
        let mut have = 0;
        let ack = loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CpLinkError::Hello("no answer before the deadline"));
            }
            stream.set_read_timeout(Some(left))?;
            let n = match stream.read(&mut input[have..]) {
                Ok(0) => return Err(CpLinkError::Hello("the control plane closed the connection")),
                Ok(n) => n,
                // A signal landed on this thread: read again (the deadline
                // still holds).
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(CpLinkError::Hello("no answer before the deadline"));
                }
                Err(e) => return Err(e.into()),
            };
            have += n;
            match decode_frame(&input[..have], &Limits::default()) {
                Err(WireError::Incomplete { .. }) => {}
                Err(e) => return Err(CpLinkError::Wire(e)),
                Ok(frame) => match frame.message {
                    Message::HelloAck(ack) => {
                        let used = frame.len();
                        input.copy_within(used..have, 0);
                        have -= used;
                        break ack;
                    }
                    Message::Error(_) => return Err(CpLinkError::Hello("the control plane refused the hello")),
                    _ => return Err(CpLinkError::Hello("the control plane answered with something else")),
                },
            }
        };
        stream.set_read_timeout(None)?;
        Self::established(stream, ack, input, have)
    }

    /// The link over `stream`, whose hellos are done (`ack` agreed): the
    /// simulator's link, whose control-plane end the simulation holds.
    pub(crate) fn over(stream: UnixStream, ack: HelloAck) -> Result<Self, CpLinkError> {
        let input = vec![0u8; crate::constants::WIRE_FRAME_BYTES_MAX.min(1 << 20)];
        Self::established(stream, ack, input, 0)
    }

    /// The link once the hellos agreed on `ack`; `input` holds `have`
    /// bytes that came after the answer.
    fn established(stream: UnixStream, ack: HelloAck, input: Vec<u8>, have: usize) -> Result<Self, CpLinkError> {
        let limits = hello::limits_after(&ack).map_err(CpLinkError::Wire)?;
        stream.set_nonblocking(true)?;
        Ok(Self {
            stream,
            out: Vec::with_capacity(OUT_BYTES),
            sent_upto: 0,
            input,
            input_len: have,
            limits,
            ack,
            next_request: 2,
            closed: false,
            commands: VecDeque::with_capacity(COMMANDS_MAX),
            cancels: VecDeque::with_capacity(COMMANDS_MAX),
            grants: VecDeque::new(),
            fence: None,
            counters: CpLinkCounters::default(),
        })
    }

    /// Fences commands by leader term from now on (a data plane's link;
    /// an agent's takes no commands): one below `fence`'s term is answered
    /// `StaleTerm` and never queued; one of a newer term is queued only
    /// once that term is durable in the fence's file (`Io` if it cannot
    /// be made so).
    pub fn fence_with(&mut self, fence: crate::fence::TermFence) {
        self.fence = Some(fence);
    }

    /// The highest leader term seen (0 without a fence).
    pub fn term_floor(&self) -> u64 {
        self.fence.as_ref().map_or(0, crate::fence::TermFence::floor)
    }

    /// The control plane's answer to the hello.
    pub fn ack(&self) -> &HelloAck {
        &self.ack
    }

    /// The socket (to wait on for input).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.stream.as_raw_fd()
    }

    /// Whether tier commands wait.
    pub fn has_commands(&self) -> bool {
        !self.commands.is_empty()
    }

    /// Whether the control plane closed the link (or it failed).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether every queued report has been written to the socket.
    pub fn is_flushed(&self) -> bool {
        self.sent_upto == self.out.len()
    }

    /// Reports a region (at start, and again after every restart).
    pub fn register_region(&mut self, region: &RegisterRegion) {
        self.queue(&Message::RegisterRegion(*region));
    }

    /// Reports a block written and acked.
    pub fn committed(&mut self, block: &BlockRecord) {
        self.queue(&Message::BlockCommitted(*block));
    }

    /// Reports a block found on disk at start.
    pub fn readopted(&mut self, block: &BlockRecord) {
        self.queue(&Message::BlockReadopted(*block));
    }

    /// Reports the data plane's running figures.
    pub fn stats(&mut self, stats: &crate::wire::message::DataPlaneStats) {
        self.queue(&Message::DataPlaneStats(*stats));
    }

    /// Sends the refused saves by reason (where the control plane takes
    /// them).
    pub fn save_refusals(&mut self, refusals: &crate::wire::message::SaveRefusals) {
        if self.takes(crate::wire::FEATURE_SAVE_REFUSALS) {
            self.queue(&Message::SaveRefusals(*refusals));
        }
    }

    /// Sends the listeners' shed connections (where the control plane
    /// takes them).
    pub fn connections_shed(&mut self, shed: &crate::wire::message::ConnectionsShed) {
        if self.takes(crate::wire::FEATURE_CONNECTIONS_SHED) {
            self.queue(&Message::ConnectionsShed(*shed));
        }
    }

    /// Whether the control plane's answer named `feature` (it takes what
    /// that bit stands for).
    pub fn takes(&self, feature: u64) -> bool {
        self.ack.features & feature != 0
    }

    /// Reports how often each capped tenant's work waited: every path to a
    /// control plane that takes [`crate::wire::FEATURE_TENANT_WAITS`], the
    /// first five to one that takes only
    /// [`crate::wire::FEATURE_TENANT_THROTTLES`], nothing to one before.
    pub fn tenant_throttles(&mut self, entries: &[crate::wire::message::TenantWait]) {
        use crate::wire::message::{TENANTS_REPORTED_MAX, TenantThrottle, TenantThrottles};
        if entries.is_empty() {
            return;
        }
        if self.takes(crate::wire::FEATURE_TENANT_WAITS) {
            for chunk in entries.chunks(TENANTS_REPORTED_MAX) {
                let count = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
                self.queue(&Message::TenantWaits(TenantThrottles { count, reserved: 0 }, Records::from_slice(chunk)));
            }
        } else if self.takes(crate::wire::FEATURE_TENANT_THROTTLES) {
            for chunk in entries.chunks(TENANTS_REPORTED_MAX) {
                let count = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
                let old: heapless::Vec<TenantThrottle, TENANTS_REPORTED_MAX> =
                    chunk.iter().map(crate::wire::message::TenantWait::throttle).collect();
                self.queue(&Message::TenantThrottles(
                    TenantThrottles { count, reserved: 0 },
                    Records::from_slice(&old),
                ));
            }
        }
    }

    /// Reports what each rail of a transport carried.
    pub fn rails(&mut self, network: crate::wire::message::Network, rails: &[crate::wire::message::RailEntry]) {
        use crate::wire::message::{RAILS_REPORTED_MAX, RailStats};
        // Only to a control plane that said it takes them.
        if !self.takes(crate::wire::FEATURE_RAIL_STATS) {
            self.counters.rails_withheld += 1;
            return;
        }
        for chunk in rails.chunks(RAILS_REPORTED_MAX) {
            let count = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            let head = RailStats { count, network: network as u8, reserved: [0; 3] };
            self.queue(&Message::RailStats(head, Records::from_slice(chunk)));
        }
    }

    /// Reports how long each path's operations took (to a control plane
    /// that takes it: [`crate::wire::FEATURE_PATH_LATENCY`]).
    /// Paths past the first four go only where the answer names
    /// [`crate::wire::FEATURE_PATHS_L3`], past the first six only where it
    /// names [`crate::wire::FEATURE_PATHS_AGENT`]; at most one entry per
    /// path.
    pub fn path_latency(&mut self, entries: &[crate::wire::message::PathEntry]) {
        use crate::wire::message::{Path, PathEntry, PathLatency};
        if !self.takes(crate::wire::FEATURE_PATH_LATENCY) {
            return;
        }
        let known = if self.takes(crate::wire::FEATURE_PATHS_AGENT) && self.takes(crate::wire::FEATURE_PATHS_L3) {
            Path::ALL.len()
        } else if self.takes(crate::wire::FEATURE_PATHS_L3) {
            Path::WITH_L3
        } else {
            Path::FIRST
        };
        let mut sent = [PathEntry::new(Path::L2ReadCritical); Path::ALL.len()];
        let mut count = 0;
        for entry in entries {
            if count < sent.len() && usize::from(entry.path) >= 1 && usize::from(entry.path) <= known {
                sent[count] = *entry;
                count += 1;
            }
        }
        if count == 0 {
            return;
        }
        let head = PathLatency { count: u32::try_from(count).unwrap_or(u32::MAX), reserved: 0 };
        self.queue(&Message::PathLatency(head, Records::from_slice(&sent[..count])));
    }

    /// Reports a block whose slot was given up.
    pub fn evicted(&mut self, evicted: &BlockEvicted) {
        self.queue(&Message::BlockEvicted(*evicted));
    }

    /// The next request the control plane took back, oldest first.
    pub fn next_cancel(&mut self) -> Option<u64> {
        self.cancels.pop_front()
    }

    /// The next command the control plane sent, oldest first.
    pub fn next_command(&mut self) -> Option<CpCommand> {
        self.commands.pop_front()
    }

    /// Answers tier command `request`.
    pub fn transfer_done(&mut self, request: u64, done: &TransferDone) {
        self.queue_frame(&Message::TransferDone(*done), Some(request));
    }

    /// Reports an agent's request (its keys, how many hit) for eviction.
    /// Keys past the wire's limit are left out.
    pub fn accessed(&mut self, namespace: u64, keys: &[BlockKey], hit_blocks: usize) {
        let keys = &keys[..keys.len().min(crate::constants::LOOKUP_KEYS_MAX)];
        let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let hit_blocks = u32::try_from(hit_blocks).unwrap_or(u32::MAX).min(count);
        let head = Accessed { namespace, hit_blocks, count };
        self.queue(&Message::Accessed(head, Records::from_slice(keys)));
    }

    /// Reports that the engine now holds `keys` in its own GPU memory
    /// (`resident`), or no longer does: advisory L0 replicas. Long lists go
    /// as several frames rather than cut short (a lost "gone" would leave
    /// the control plane routing to blocks the engine dropped); a full
    /// buffer drops and counts them like any report.
    pub fn resident(&mut self, namespace: u64, keys: &[BlockKey], resident: bool) {
        for chunk in keys.chunks(crate::constants::LOOKUP_KEYS_MAX) {
            let count = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            let head = Resident { namespace, resident: u32::from(resident), count };
            self.queue(&Message::Resident(head, Records::from_slice(chunk)));
        }
    }

    /// Asks for a lease on the replicas of `keys` (their leading run that
    /// has one) for `ttl_ms`; returns the request id its grant will carry.
    pub fn request_lease(&mut self, namespace: u64, keys: &[BlockKey], ttl_ms: u32) -> u64 {
        let keys = &keys[..keys.len().min(crate::constants::LOOKUP_KEYS_MAX)];
        let request = self.next_request;
        let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        self.queue(&Message::LeaseRequest(LeaseRequest { namespace, ttl_ms, count }, Records::from_slice(keys)));
        request
    }

    /// Asks for `key` of `namespace`, held by node `from` in `tier`, to be
    /// copied into this node's (`node`'s) L1: the control plane relays it
    /// through the summary's leader to the holder, or — an L3 holder —
    /// has its own data plane read the object from the store they share
    /// (a critical load: the engine waits on it). The source names the
    /// holder and tier only (slot [`SLOT_ANY`]); its `region_epoch`
    /// carries the namespace, which names the object in the store. False
    /// where the control plane does not take pulls
    /// ([`crate::wire::FEATURE_PULL`]).
    ///
    /// [`SLOT_ANY`]: crate::wire::message::SLOT_ANY
    pub fn pull(&mut self, key: &BlockKey, namespace: u64, from: u32, tier: crate::Tier, node: u32) -> bool {
        use crate::wire::message::{SLOT_ANY, Transfer};
        if !self.takes(crate::wire::FEATURE_PULL) {
            return false;
        }
        let replica = |node, tier: crate::Tier| crate::model::replica::ReplicaWire {
            tier: tier as u8,
            node,
            slot: SLOT_ANY,
            ..crate::model::replica::ReplicaWire::default()
        };
        self.queue(&Message::CopyBlock(Transfer {
            source: crate::model::replica::ReplicaWire { region_epoch: namespace, ..replica(from, tier) },
            target: replica(node, crate::Tier::L1Dram),
            key: *key,
            deadline_unix_ns: 0,
            priority: crate::Priority::CriticalLoad as u8,
            reserved: [0; 7],
        }));
        true
    }

    /// Releases a lease.
    pub fn release_lease(&mut self, lease_id: u64) {
        self.queue(&Message::LeaseRelease(LeaseRelease { lease_id }));
    }

    /// The grant answering `request`, once it has arrived.
    pub fn take_grant(&mut self, request: u64) -> Option<Granted> {
        let at = self.grants.iter().position(|g| g.request == request)?;
        self.grants.remove(at)
    }

    fn queue(&mut self, message: &Message<'_>) {
        self.queue_frame(message, None);
    }

    /// Queues one frame: a report with the next request id, or the answer
    /// to `reply_to`.
    fn queue_frame(&mut self, message: &Message<'_>, reply_to: Option<u64>) {
        if self.closed {
            self.counters.dropped += 1;
            return;
        }
        // Written reports are dropped from the front first, so the buffer
        // never grows past what was allocated at connect.
        if self.sent_upto > 0 && self.out.len() + 256 > self.out.capacity() {
            self.out.drain(..self.sent_upto);
            self.sent_upto = 0;
        }
        let start = self.out.len();
        let room = self.out.capacity() - start;
        let needed = message.body_len() + crate::wire::FRAME_HEADER_BYTES;
        if room < needed {
            self.counters.dropped += 1;
            return;
        }
        self.out.resize(start + needed, 0);
        let meta = FrameMeta {
            version: self.limits.version_max,
            flags: if reply_to.is_some() { FLAG_REPLY } else { 0 },
            request_id: reply_to.unwrap_or(self.next_request),
            leader_term: self.ack.leader_term_seen,
        };
        match encode_frame(meta, message, &mut self.out[start..]) {
            Ok(len) => {
                self.out.truncate(start + len);
                if reply_to.is_none() {
                    self.next_request += 1;
                }
                self.counters.sent += 1;
            }
            Err(_) => {
                self.out.truncate(start);
                self.counters.dropped += 1;
            }
        }
    }

    /// Writes what is queued and reads what arrived, without blocking.
    pub fn pump(&mut self) -> Result<(), CpLinkError> {
        if self.closed {
            return Ok(());
        }
        while self.sent_upto < self.out.len() {
            match self.stream.write(&self.out[self.sent_upto..]) {
                Ok(0) => return self.close(CpLinkError::Hello("the control plane closed the connection")),
                Ok(n) => self.sent_upto += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.close(e.into()),
            }
        }
        if self.sent_upto == self.out.len() {
            self.out.clear();
            self.sent_upto = 0;
        }
        self.drain_input()?;
        loop {
            if self.input_len == self.input.len() {
                return self.close(CpLinkError::Wire(WireError::FrameTooLarge {
                    bytes: self.input_len as u64,
                    max: self.input.len(),
                }));
            }
            match self.stream.read(&mut self.input[self.input_len..]) {
                Ok(0) => return self.close(CpLinkError::Hello("the control plane closed the connection")),
                Ok(n) => self.input_len += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.close(e.into()),
            }
            self.drain_input()?;
        }
        Ok(())
    }

    /// Takes every whole frame the input holds (what came with the hello
    /// ack included).
    fn drain_input(&mut self) -> Result<(), CpLinkError> {
        loop {
            let (used, incoming) = match decode_frame(&self.input[..self.input_len], &self.limits) {
                Err(WireError::Incomplete { .. }) => break,
                Err(e) => return self.close(CpLinkError::Wire(e)),
                Ok(frame) => {
                    let request = frame.header.request_id;
                    let term = frame.header.leader_term;
                    let incoming = match frame.message {
                        Message::Error(_) => Incoming::Refused,
                        Message::MoveBlock(transfer) => Incoming::Command(CpCommand::Move { request, transfer }),
                        Message::CopyBlock(transfer) => Incoming::Command(CpCommand::Copy { request, transfer }),
                        Message::EvictBlock(replica) => Incoming::Command(CpCommand::Evict { request, replica }),
                        Message::DrainRegion(drain) => Incoming::Command(CpCommand::Drain { request, drain }),
                        Message::MarkEvictable(replica) => {
                            Incoming::Command(CpCommand::Mark { replica, evictable: true })
                        }
                        Message::UnmarkEvictable(replica) => {
                            Incoming::Command(CpCommand::Mark { replica, evictable: false })
                        }
                        Message::VictimsLeft(v) => {
                            Incoming::Command(CpCommand::VictimsLeft { region: v.region, left: v.left == 1 })
                        }
                        Message::Cancel(cancel) => Incoming::Cancel(cancel.request_id),
                        Message::LeaseGrant(head, entries) => Incoming::Grant(Granted {
                            request,
                            lease_id: head.lease_id,
                            deadline_unix_ns: head.deadline_unix_ns,
                            entries: entries
                                .iter()
                                .filter_map(|e| Replica::from_wire(&e.replica).map(|r| (e.key, r)))
                                .collect(),
                        }),
                        _ => Incoming::Other,
                    };
                    (frame.len(), (incoming, term))
                }
            };
            let (incoming, term) = incoming;
            self.counters.received += 1;
            match incoming {
                Incoming::Refused => self.counters.refused += 1,
                Incoming::Command(command) => match self.fence.as_mut().map(|f| f.admit(term)) {
                    None | Some(Ok(true)) => self.take_command(command),
                    Some(Ok(false)) => {
                        self.counters.stale_terms += 1;
                        self.answer(command, ErrorCode::StaleTerm);
                    }
                    // Not durable, so not run: the leader hears why.
                    Some(Err(_)) => {
                        self.counters.fence_errors += 1;
                        self.answer(command, ErrorCode::Io);
                    }
                },
                // Not fenced: taking a copy back cannot do harm, whoever
                // asks; the oldest is dropped past the bound.
                Incoming::Cancel(request) => {
                    if self.cancels.len() >= COMMANDS_MAX {
                        self.cancels.pop_front();
                    }
                    self.cancels.push_back(request);
                }
                Incoming::Grant(grant) => {
                    // Bounded: grants nobody collects do not pile up.
                    if self.grants.len() >= 64 {
                        self.grants.pop_front();
                    }
                    self.grants.push_back(grant);
                }
                Incoming::Other => {}
            }
            self.input.copy_within(used..self.input_len, 0);
            self.input_len -= used;
        }
        Ok(())
    }

    fn take_command(&mut self, command: CpCommand) {
        if self.commands.len() < COMMANDS_MAX {
            self.commands.push_back(command);
            return;
        }
        self.answer(command, ErrorCode::QueueFull);
    }

    /// Answers a command that will not run (a mark needs no answer: the
    /// block stays until the control plane evicts it).
    fn answer(&mut self, command: CpCommand, code: ErrorCode) {
        if matches!(command, CpCommand::Mark { .. }) {
            return;
        }
        let (request, target) = command.request_and_target();
        let done = TransferDone { status: code as u32, reserved: 0, target, bytes: 0 };
        self.transfer_done(request, &done);
    }

    fn close(&mut self, error: CpLinkError) -> Result<(), CpLinkError> {
        self.closed = true;
        Err(error)
    }
}

enum Incoming {
    Refused,
    Command(CpCommand),
    Cancel(u64),
    Grant(Granted),
    Other,
}
