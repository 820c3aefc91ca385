//! P→D's sending half, from the engine's side: blocks this node's L1
//! holds (the prefill engine saved them) are pinned where they sit and
//! sent over the compute network's transport to any slot of another
//! node's L1 (the decode node's pool picks the slot, checks the block and
//! publishes it). The bytes go from the pinned slot to the socket; the pin
//! is held until the peer says the block landed or why not.
//!
//! A tenant capped on its pushes (`push_bytes_per_s`, told by the data
//! plane at attach) has its blocks held here, pinned, until its bucket
//! allows them; other tenants' go meanwhile.
//!
//! A push under the engine's trace id carries it to the peer, which logs
//! the block's landing under it and answers with its time (over TCP, where
//! the peer takes trace ids); the pusher keeps what it saw of each block
//! as a [`PushSpan`].

use std::collections::{HashMap, VecDeque};

use lake_core::arena::{Pin, PinArray};
use lake_core::constants::STORED_HEADER_BYTES;
use lake_core::mirror::MirrorEntry;
use lake_core::model::key::BlockKey;
use lake_core::model::replica::{Priority, Tier};
use lake_core::rates::RatePath;
use lake_core::stored::decode_header;
use lake_dp::transport::frame::BlockAddr;
use lake_dp::transport::tcp::{Outgoing, PeerId, TcpTransport, TraceEvent};
use lake_dp::transport::{ANY_SLOT, Completion, Landing, Links, TransferError};

/// Why a block was not sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PushError {
    /// Not an L1 hit of this node's arena (only those are sent from here).
    NotInL1,
    /// Evicted (or reused) since the lookup: its pin failed.
    Evicted,
    /// The slot does not hold this key's block.
    Mismatch,
    /// The transport refused it (its reason).
    Transport(TransferError),
}

/// A block pushed under the engine's trace id, as the pusher saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushSpan {
    /// The engine's trace id.
    pub trace: u64,
    /// The block.
    pub key: BlockKey,
    /// How it ended.
    pub result: Result<(), TransferError>,
    /// From the push to its answer, as the pusher saw it, ns.
    pub took_ns: u64,
    /// The peer's own time on it, µs, from its answer (0: a peer that
    /// does not time traced blocks).
    pub peer_us: u32,
}

/// Traced pushes a pusher keeps for its engine at most (the oldest go).
pub const PUSH_SPANS_KEPT: usize = 256;

/// Sends L1 blocks to peers' pools and holds their pins until each lands,
/// over TCP or over RDMA negotiated on the TCP links ([`Links`]): a peer
/// READs a block from its pinned slot (the pin is the fence), or takes it
/// from the socket.
pub struct Pusher<T: Links = TcpTransport> {
    transport: T,
    pins: PinArray,
    held: HashMap<u64, Pin>,
    next: u64,
    arena_region: u16,
    landed: Vec<Completion>,
    /// Traced transfers in flight: their trace id, key, start, and the
    /// peer's time once its answer said it.
    traced: HashMap<u64, (u64, BlockKey, u64, u32)>,
    trace_events: Vec<TraceEvent>,
    spans: VecDeque<PushSpan>,
    /// The caps on tenants' pushes (none: no bucket is looked up).
    caps: lake_core::rates::TenantRates,
    /// Blocks of capped tenants waiting for their bucket, oldest first:
    /// each with its namespace (its pin is held in `held`).
    waiting: VecDeque<(Outgoing, u64)>,
    /// Blocks cancelled while they waited, ended at the next poll.
    cancelled: Vec<Completion>,
    /// Pushes that waited for their tenant's cap.
    pub throttled: u64,
}

impl<T: Links> core::fmt::Debug for Pusher<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Pusher").field("held", &self.held.len()).finish_non_exhaustive()
    }
}

/// The sending side keeps nothing landing.
struct Sends;

impl Landing for Sends {
    fn place(&mut self, _: &BlockAddr, _: u64) -> Result<*mut u8, lake_dp::transport::frame::AckStatus> {
        Err(lake_dp::transport::frame::AckStatus::Refused)
    }
    fn landed(&mut self, _: &BlockAddr, _: u64) -> lake_dp::transport::frame::AckStatus {
        lake_dp::transport::frame::AckStatus::Refused
    }
    fn abandoned(&mut self, _: &BlockAddr) {}
}

impl<T: Links> Pusher<T> {
    /// A pusher over `transport`, pinning through `pins` (a pin array of
    /// this node's arena, whose region is `arena_region`). Over RDMA, the
    /// transport's memory is this process's mapping of that arena.
    pub fn new(transport: T, pins: PinArray, arena_region: u16) -> Self {
        Self {
            transport,
            pins,
            held: HashMap::new(),
            next: 1,
            arena_region,
            landed: Vec::new(),
            traced: HashMap::new(),
            trace_events: Vec::new(),
            spans: VecDeque::new(),
            caps: lake_core::rates::TenantRates::default(),
            waiting: VecDeque::new(),
            cancelled: Vec::new(),
            throttled: 0,
        }
    }

    /// Holds pushes to the tenants' caps in `caps` (their net-send path):
    /// a block of a tenant whose bucket is empty waits, pinned, until it
    /// refills.
    pub fn with_caps(mut self, caps: lake_core::rates::TenantRates) -> Self {
        self.caps = caps;
        self
    }

    /// The transport (to add peers, read its figures).
    pub fn transport(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Sends block `key` (this node's L1 `entry`, from a lookup) to any
    /// slot of `peer`'s L1 `(region, epoch)`, under the engine's trace id
    /// `trace` (0: untraced); returns the transfer's id (its completion
    /// carries it and the slot it landed in).
    #[allow(clippy::too_many_arguments)] // one push's parts, each named
    pub fn push(
        &mut self,
        key: &BlockKey,
        entry: &MirrorEntry,
        peer: PeerId,
        (region, epoch): (u16, u64),
        priority: Priority,
        trace: u64,
        now_ns: u64,
    ) -> Result<u64, PushError> {
        if entry.tier != Tier::L1Dram || entry.region.0 != self.arena_region {
            return Err(PushError::NotInL1);
        }
        let pin = self.pins.pin(entry.slot, entry.generation).map_err(|_| PushError::Evicted)?;
        let bytes = self.pins.bytes(&pin);
        let (len, namespace) = match decode_header(bytes) {
            Ok(header) if header.meta().key == *key => {
                (STORED_HEADER_BYTES as u64 + header.meta().payload_len, header.meta().namespace.0)
            }
            _ => {
                self.pins.unpin(pin);
                return Err(PushError::Mismatch);
            }
        };
        let transfer = self.next;
        self.next += 1;
        let block = Outgoing {
            transfer,
            peer,
            source: bytes.as_ptr(),
            len,
            target: BlockAddr { region, epoch, slot: ANY_SLOT, generation: 0 },
            priority,
            trace,
            namespace,
        };
        // Its tenant's cap first: behind others of its tenant that wait,
        // or while its bucket is empty, it waits too (pinned).
        let waits = self.waiting.iter().any(|(_, ns)| *ns == namespace)
            || !self.caps.admit(namespace, RatePath::NetSend, len, now_ns);
        if waits {
            self.throttled += 1;
            self.waiting.push_back((block, namespace));
        } else {
            // SAFETY: the source is a pinned slot's stored object; the pin
            // is held (the slot unchanged) until this transfer's completion.
            if let Err(e) = unsafe { self.transport.write(&block, now_ns) } {
                self.pins.unpin(pin);
                return Err(PushError::Transport(e));
            }
        }
        self.held.insert(transfer, pin);
        if trace != 0 {
            self.traced.insert(transfer, (trace, *key, now_ns, 0));
        }
        Ok(transfer)
    }

    /// Moves bytes; each ended transfer's pin is released and its
    /// completion (landed in which slot, or why not) goes to `out`.
    pub fn poll(&mut self, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let entered = std::time::Instant::now();
        self.send_waiting(now_ns);
        self.landed.append(&mut self.cancelled);
        let busy = self.transport.poll(&mut Sends, now_ns, &mut self.landed);
        // The peer's time on a traced block comes with its answer.
        self.transport.take_trace_events(&mut self.trace_events);
        for event in self.trace_events.drain(..) {
            if let TraceEvent::Answered { transfer, peer_us, .. } = event
                && let Some(traced) = self.traced.get_mut(&transfer)
            {
                traced.3 = peer_us;
            }
        }
        for completion in self.landed.drain(..) {
            if let Some(pin) = self.held.remove(&completion.transfer) {
                self.pins.unpin(pin);
            }
            if let Some((trace, key, started_ns, peer_us)) = self.traced.remove(&completion.transfer) {
                if self.spans.len() >= PUSH_SPANS_KEPT {
                    self.spans.pop_front();
                }
                // Timed when its completion was seen: this thread may
                // have waited for a core since `now_ns` was read, while
                // the peer landed the block and acked it.
                let seen_ns = now_ns.saturating_add(u64::try_from(entered.elapsed().as_nanos()).unwrap_or(u64::MAX));
                let took_ns = seen_ns.saturating_sub(started_ns);
                self.spans.push_back(PushSpan { trace, key, result: completion.result.clone(), took_ns, peer_us });
            }
            out.push(completion);
        }
        busy
    }

    /// Sends the waiting blocks whose tenant's bucket has refilled, oldest
    /// first; each tenant's keep their order, others pass a tenant that
    /// still waits.
    fn send_waiting(&mut self, now_ns: u64) {
        let mut blocked: Vec<u64> = Vec::new();
        let mut at = 0;
        while at < self.waiting.len() {
            let (block, namespace) = self.waiting[at];
            if blocked.contains(&namespace) || !self.caps.admit(namespace, RatePath::NetSend, block.len, now_ns) {
                blocked.push(namespace);
                at += 1;
                continue;
            }
            self.waiting.remove(at);
            // SAFETY: its pin is held in `held` until its completion.
            if let Err(e) = unsafe { self.transport.write(&block, now_ns) } {
                self.cancelled.push(Completion { transfer: block.transfer, result: Err(e), target: block.target });
            }
        }
    }

    /// Hands over the traced pushes ended since the last call, oldest
    /// first.
    pub fn take_spans(&mut self, mut each: impl FnMut(&PushSpan)) {
        for span in self.spans.drain(..) {
            each(&span);
        }
    }

    /// Cancels `transfer` if none of its bytes went out yet
    /// ([`Links::cancel`]; over RDMA, its offer is withdrawn and it ends
    /// `Cancelled` if the peer had not started reading it): it ends at a
    /// later poll, its pin released then.
    pub fn cancel(&mut self, transfer: u64) -> bool {
        if let Some(at) = self.waiting.iter().position(|(b, _)| b.transfer == transfer) {
            // Still waiting for its tenant's cap: never sent.
            if let Some((block, _)) = self.waiting.remove(at) {
                let result = Err(TransferError::Cancelled);
                self.cancelled.push(Completion { transfer, result, target: block.target });
            }
            return true;
        }
        self.transport.cancel(transfer)
    }

    /// Transfers not ended yet.
    pub fn in_flight(&self) -> usize {
        self.held.len()
    }
}
