//! The RDMA transport: [`super::super::Transport`] over verbs, so that
//! everything above it is the same as over TCP.
//!
//! A write is a pull. The sender posts a small two-sided message, an
//! *offer* — "transfer T: `len` bytes at address A of my memory, for your
//! slot S" — and the receiver, once it has room, places the target slot,
//! READs the bytes one-sided from the sender's memory straight into it,
//! checks them where they landed ([`super::super::Landing::landed`]) and
//! sends back an *answer* with the verdict. The sender's transfer
//! completes on the answer: "complete" means landed and checked at the
//! target, as over TCP.
//!
//! Why pull and not one-sided WRITE: a node's slots are only ever written
//! by the node itself (its own READs), so no peer holds a key that writes
//! its memory. And the read is fenced: the sender keeps the source
//! unchanged until its transfer completes (the
//! [`super::super::Transport::write`] contract), which is after the answer.
//!
//! Keys are lent per transfer, not per peer: each offer carries a key
//! ([`Verbs::lend`]) that reads that block's bytes and nothing else, only
//! through that peer's queue pair, and it is taken back
//! ([`Verbs::take_back`]) when the answer comes, the transfer times out or
//! the peer is shut. No peer ever holds a key to the rest of the arena —
//! other blocks, other tenants' — nor to a block once its transfer ended.
//!
//! Where a peer falls silent past a transfer's deadline, its queue pair is
//! shut ([`Verbs::shut`]) before the transfers end, so no READ of this
//! node's memory through it can still complete once the caller has been
//! told and reuses the source.
//!
//! Offers wait at the receiver by priority class and the most urgent is
//! read first (work keeps its class on the wire).
//!
//! An offer names its block's namespace, so a receiver that caps what a
//! tenant may send it ([`super::super::Landing::admit`]) answers an offer
//! over the cap *later*, with the wait: the sender takes its key back,
//! holds the block (no slot taken there, no byte read) and offers it again
//! then, its deadline counted from the new offer — as a TCP reservation is
//! told to ask again. Nothing is refused or lost, and another tenant's
//! offers go by meanwhile. The verbs themselves are
//! behind [`Verbs`]: [`super::verbs::IbVerbs`] (the `rdma` feature, where
//! a device is) and [`super::loopback`] (two ends in one process, memory
//! copies for READs: how the protocol is tested where no device exists).

use std::collections::{HashMap, VecDeque};

use bytemuck::{Pod, Zeroable};

use super::{Endpoint, RdmaError};
use crate::Priority;
use crate::tag::Tag;
use crate::transport::frame::{AckStatus, BlockAddr};
use crate::transport::tcp::TraceEvent;
use crate::transport::{ANY_SLOT, Completion, Landing, Outgoing, PeerId, TransferError, Transport};

/// Bytes of one offer or answer.
pub const MESSAGE_BYTES: usize = 72;

/// "LKRM", little-endian.
const MESSAGE_MAGIC: u32 = u32::from_le_bytes(*b"LKRM");
/// Version 3: an offer names its block's namespace and an answer may say
/// *later* (72 bytes). Version 2: an offer carries the key lent for its
/// block (version 1 named none; its reader used the peer's standing key to
/// the whole arena). Ends of different versions keep their links on TCP
/// (their endpoints' versions differ).
const MESSAGE_VERSION: u8 = 3;

/// The longest wait a *later* answer names, µs, and the shortest its
/// sender keeps to (as over TCP).
pub const LATER_US_MAX: u32 = 1_000_000;
const LATER_US_MIN: u32 = 200;
const KIND_OFFER: u8 = 1;
const KIND_ANSWER: u8 = 2;
const KIND_WITHDRAW: u8 = 3;

/// An offer or an answer as it travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
struct RawMessage {
    magic: u32,
    version: u8,
    kind: u8,
    priority: u8,
    status: u8,
    transfer: u64,
    source: u64,
    /// Offers: the engine's trace id (0: none); others: 0.
    trace: u64,
    /// Offers: the block's namespace (0: not said); others: 0.
    namespace: u64,
    epoch: u64,
    /// Offers: the block's bytes (a READ is at most `u32::MAX`); answers:
    /// the receiver's time on a traced block, µs (0: untraced), or for a
    /// *later* one the wait, µs.
    len: u32,
    slot: u32,
    generation: u32,
    /// Offers: the key lent for the block; others: 0.
    key: u32,
    region: u16,
    reserved: u16,
    crc: u32,
}

const _: () = assert!(size_of::<RawMessage>() == MESSAGE_BYTES);

/// A decoded message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// "Read `len` bytes at `source` of my memory into your `target`."
    Offer {
        /// The sender's transfer id.
        transfer: u64,
        /// Where the stored object is, in the sender's address space.
        source: u64,
        /// The key lent for exactly those bytes ([`Verbs::lend`]).
        key: u32,
        /// Its bytes (at most `u32::MAX`: one READ).
        len: u32,
        /// The engine's trace id of the request it serves (0: none): the
        /// receiver times the block and answers with its time.
        trace: u64,
        /// The block's namespace (0: not said): whose cap on what the
        /// receiver takes in it counts against.
        namespace: u64,
        /// Where it goes at the receiver ([`ANY_SLOT`]: a slot it reserves).
        target: BlockAddr,
        /// Its class.
        priority: Priority,
    },
    /// "Do not read transfer T after all" (its request was aborted): a
    /// receiver that has not started its READ drops the offer and answers
    /// it `Refused`; one that has, answers as it would have.
    Withdraw {
        /// The offer's transfer id.
        transfer: u64,
    },
    /// The receiver's verdict on an offer.
    Answer {
        /// The offer's transfer id.
        transfer: u64,
        /// Landed and checked, or why not.
        status: AckStatus,
        /// The slot it landed in (or was to).
        target: BlockAddr,
        /// The receiver's time on a traced offer, from taking it to its
        /// check, µs (0: untraced); for [`AckStatus::Later`], the wait
        /// before offering it again, µs (at most [`LATER_US_MAX`]).
        took_us: u32,
    },
}

impl Message {
    /// Its bytes.
    pub fn encode(&self) -> [u8; MESSAGE_BYTES] {
        let (kind, priority, status, transfer, (source, key, trace, namespace), len, target) = match *self {
            Self::Offer { transfer, source, key, len, trace, namespace, target, priority } => {
                (KIND_OFFER, priority as u8, 0, transfer, (source, key, trace, namespace), len, target)
            }
            Self::Answer { transfer, status, target, took_us } => {
                (KIND_ANSWER, 0, status as u8, transfer, (0, 0, 0, 0), took_us, target)
            }
            Self::Withdraw { transfer } => (KIND_WITHDRAW, 0, 0, transfer, (0, 0, 0, 0), 0, BlockAddr::default()),
        };
        let mut raw = RawMessage {
            magic: MESSAGE_MAGIC,
            version: MESSAGE_VERSION,
            kind,
            priority,
            status,
            transfer,
            source,
            trace,
            namespace,
            epoch: target.epoch,
            len,
            slot: target.slot,
            generation: target.generation,
            key,
            region: target.region,
            reserved: 0,
            crc: 0,
        };
        raw.crc = crc32fast::hash(&bytemuck::bytes_of(&raw)[..MESSAGE_BYTES - 4]);
        let mut out = [0u8; MESSAGE_BYTES];
        out.copy_from_slice(bytemuck::bytes_of(&raw));
        out
    }

    /// Decodes and checks a message; a bad one is named.
    pub fn decode(bytes: &[u8; MESSAGE_BYTES]) -> Result<Self, &'static str> {
        let raw: RawMessage = bytemuck::pod_read_unaligned(bytes);
        if raw.magic != MESSAGE_MAGIC {
            return Err("not a Lake RDMA message (magic)");
        }
        if raw.version != MESSAGE_VERSION {
            return Err("a message version this end does not speak");
        }
        if crc32fast::hash(&bytes[..MESSAGE_BYTES - 4]) != raw.crc {
            return Err("message CRC mismatch");
        }
        if raw.reserved != 0 {
            return Err("reserved message bytes set");
        }
        let target = BlockAddr { region: raw.region, epoch: raw.epoch, slot: raw.slot, generation: raw.generation };
        match raw.kind {
            KIND_OFFER => {
                let priority = Priority::from_u8(raw.priority).ok_or("unknown priority class")?;
                if raw.status != 0 {
                    return Err("an offer with a status");
                }
                if raw.len == 0 {
                    return Err("an offer of no bytes");
                }
                Ok(Self::Offer {
                    transfer: raw.transfer,
                    source: raw.source,
                    key: raw.key,
                    len: raw.len,
                    trace: raw.trace,
                    namespace: raw.namespace,
                    target,
                    priority,
                })
            }
            KIND_ANSWER => {
                let status = AckStatus::from_u16(u16::from(raw.status)).ok_or("unknown answer status")?;
                if raw.priority != 0 || raw.source != 0 || raw.trace != 0 || raw.key != 0 || raw.namespace != 0 {
                    return Err("an answer with offer fields");
                }
                if status == AckStatus::Later && !(1..=LATER_US_MAX).contains(&raw.len) {
                    return Err("a later answer's wait out of range");
                }
                Ok(Self::Answer { transfer: raw.transfer, status, target, took_us: raw.len })
            }
            KIND_WITHDRAW => {
                let addressed = raw.region != 0 || raw.epoch != 0 || raw.slot != 0 || raw.generation != 0;
                let offered = raw.source != 0 || raw.len != 0 || raw.key != 0 || raw.trace != 0 || raw.namespace != 0;
                if raw.priority != 0 || raw.status != 0 || offered || addressed {
                    return Err("a withdrawal with offer or answer fields");
                }
                Ok(Self::Withdraw { transfer: raw.transfer })
            }
            _ => Err("unknown message kind"),
        }
    }
}

/// Why a verb could not be posted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerbsError {
    /// The peer's queue is full: try again after a poll.
    Full,
    /// The peer's queue pair is broken or shut (why).
    Broken(String),
}

/// What the verbs report from a poll.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerbsEvent {
    /// A message arrived from `peer`.
    Received {
        /// From whom.
        peer: PeerId,
        /// Its bytes, to decode.
        message: [u8; MESSAGE_BYTES],
    },
    /// A READ posted with `wr_id` completed: its bytes are in place, or
    /// the queue pair failed it (and no byte more will be written for it).
    ReadDone {
        /// As posted.
        wr_id: u64,
        /// Whether it read.
        result: Result<(), String>,
    },
    /// `peer`'s queue pair broke (a failed send, a remote error, shut):
    /// nothing more travels on it.
    Broken {
        /// Whose.
        peer: PeerId,
        /// Why.
        why: String,
    },
}

/// The verbs the RDMA transport needs, one reliable connection per peer.
pub trait Verbs {
    /// A new peer: its id here and the endpoint the other end needs to
    /// reach it and read what it exports (carried over the TCP link:
    /// [`super::over_tcp`]); nothing travels until [`Verbs::connect`].
    fn add_peer(&mut self) -> Result<(PeerId, Endpoint), RdmaError>;

    /// Connects `peer` to the endpoint the other end sent (decoded and
    /// checked by [`Endpoint::decode`]).
    fn connect(&mut self, peer: PeerId, remote: &Endpoint) -> Result<(), RdmaError>;

    /// Posts a two-sided SEND of `message` to `peer`.
    fn send(&mut self, peer: PeerId, message: &[u8; MESSAGE_BYTES]) -> Result<(), VerbsError>;

    /// Lends `peer` a key that reads `len` bytes at `address` of this
    /// node's memory and nothing else, through `peer`'s queue pair alone
    /// (a device binds a memory window: read-only, that range, that queue
    /// pair). `Full` while every key of the peer's is out.
    fn lend(&mut self, peer: PeerId, address: u64, len: u64) -> Result<u32, VerbsError>;

    /// Takes back a key [`Verbs::lend`] gave `peer`: once the peer can
    /// learn this end is done with the block (the caller told of its
    /// completion), no READ through the key succeeds. A key not out is
    /// ignored.
    fn take_back(&mut self, peer: PeerId, key: u32);

    /// Posts a one-sided READ of `len` bytes at `remote` in `peer`'s
    /// memory, through the key `key` it lent, into `into`, tagged `wr_id`;
    /// it ends in a [`VerbsEvent::ReadDone`].
    ///
    /// # Safety
    ///
    /// `into` is valid for `len` bytes of this node's registered memory and
    /// left alone until the READ's `ReadDone` has been polled.
    unsafe fn read(
        &mut self,
        peer: PeerId,
        wr_id: u64,
        remote: (u64, u32),
        len: u32,
        into: *mut u8,
    ) -> Result<(), VerbsError>;

    /// Whether `len` bytes at `address` of this node's memory are in what
    /// keys for `peer` may be lent over (the registered arena).
    fn exports(&self, peer: PeerId, address: u64, len: u64) -> bool;

    /// Whether `len` bytes at `address` of `peer`'s memory are in the
    /// region it announced (its keys may lend nothing outside).
    fn imports(&self, peer: PeerId, address: u64, len: u64) -> bool;

    /// Whether `len` bytes at `into` are this node's registered memory (a
    /// READ may land there).
    fn registered(&self, into: *const u8, len: u64) -> bool;

    /// Moves the queue pairs on: what completed or arrived goes to `out`.
    fn poll(&mut self, out: &mut Vec<VerbsEvent>);

    /// Shuts `peer`'s queue pair: no READ through it completes after this
    /// returns (those in flight end failed, as [`VerbsEvent::ReadDone`]),
    /// and every key lent to it is dead.
    fn shut(&mut self, peer: PeerId, why: &str);
}

/// How the RDMA transport runs.
#[derive(Clone, Copy, Debug)]
pub struct RdmaConfig {
    /// Offers in flight to one peer (the peer's receive queue must hold
    /// these and the answers this end owes it).
    pub offers_per_peer: usize,
    /// READs in flight at this end, over all peers.
    pub reads_max: usize,
    /// A transfer with no answer by then ends `Timeout` (and its peer is
    /// shut).
    pub transfer_timeout_ns: u64,
    /// The largest block taken (a READ is at most `u32::MAX` bytes).
    pub max_block_bytes: u64,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self { offers_per_peer: 32, reads_max: 32, transfer_timeout_ns: 5_000_000_000, max_block_bytes: 64 << 20 }
    }
}

/// What the RDMA transport did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Offers this end sent.
    pub offered: u64,
    /// Blocks this end read from peers.
    pub read: u64,
    /// Bytes of them.
    pub read_bytes: u64,
    /// Of them, landed and checked.
    pub landed: u64,
    /// Offers refused here (no such target, a source outside what the
    /// peer exports) or read and found corrupt.
    pub refused: u64,
    /// Messages from peers that did not decode or answered nothing asked
    /// (the peer is shut).
    pub bad_messages: u64,
    /// Peers shut: broken, silent past a deadline, or sending bad
    /// messages.
    pub peers_shut: u64,
    /// Offers this end withdrew ([`RdmaTransport::withdraw`]), and of the
    /// peers' offers, those withdrawn before this end read them.
    pub withdrawn_asked: u64,
    /// See `withdrawn_asked`.
    pub withdrawn_dropped: u64,
    /// Trace events dropped because the owner did not take them.
    pub trace_events_dropped: u64,
    /// Peers' offers this end answered *later* (their tenant over its cap
    /// on what this node receives), and of this end's offers, those held
    /// here for a while after such an answer.
    pub offers_put_off: u64,
    /// See `offers_put_off`.
    pub offers_held: u64,
    /// Keys lent for offers (one a transfer) and taken back; equal once
    /// nothing is in flight.
    pub keys_lent: u64,
    /// See `keys_lent`.
    pub keys_taken_back: u64,
}

/// A transfer this end offered, awaiting its answer.
#[derive(Clone, Copy, Debug)]
struct Offered {
    peer: PeerId,
    /// The engine's trace id (0: none).
    trace: u64,
    /// Withdrawn by the caller: a refusal now means it was not read.
    withdrawn: bool,
    /// The key lent for the block: taken back when the transfer ends (or
    /// is held).
    key: u32,
    target: BlockAddr,
    deadline_ns: u64,
    /// What offering it again takes: where it is, its bytes, class and
    /// namespace.
    source: u64,
    len: u32,
    priority: Priority,
    namespace: u64,
    /// Answered *later*: held here, no key lent, until this time.
    held_until_ns: Option<u64>,
}

/// An offer this end took and has not read yet.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    peer: PeerId,
    transfer: u64,
    source: u64,
    key: u32,
    len: u64,
    /// The engine's trace id (0: none), and when the offer was taken.
    trace: u64,
    taken_ns: u64,
    target: BlockAddr,
    /// Reserved here for it (sent to [`ANY_SLOT`]): given back if dropped.
    reserved: bool,
    /// Placed already (a READ found its queue full): the slot's memory.
    placed: Option<*mut u8>,
}

/// A READ in flight into a placed slot.
#[derive(Clone, Copy, Debug)]
struct Pulling {
    peer: PeerId,
    transfer: u64,
    target: BlockAddr,
    len: u64,
    /// See [`Waiting`].
    trace: u64,
    taken_ns: u64,
}

#[derive(Clone, Debug, Default)]
struct PeerState {
    offered: usize,
    /// Why it is shut (nothing more is sent to it).
    down: Option<String>,
}

/// See the module docs.
#[derive(Debug)]
pub struct RdmaTransport<V> {
    verbs: V,
    config: RdmaConfig,
    peers: Vec<PeerState>,
    offered: HashMap<u64, Offered>,
    waiting: [VecDeque<Waiting>; Priority::COUNT],
    pulling: HashMap<u64, Pulling>,
    /// Answers owed whose send found the peer's queue full.
    owed: VecDeque<(PeerId, [u8; MESSAGE_BYTES])>,
    events: Vec<VerbsEvent>,
    /// Offers held after a *later* answer (`Offered::held_until_ns`), and
    /// those due to be offered again (kept across polls).
    held: usize,
    due: Vec<u64>,
    /// Peers the owner asked to shut, at the next poll.
    closing: Vec<(PeerId, String)>,
    /// What traced transfers did, for the owner.
    trace_events: Vec<TraceEvent>,
    /// What it did.
    pub stats: RdmaStats,
}

// SAFETY: the pointers it holds (slots placed, their READs waiting for
// room) are the landing's memory, used from whichever thread polls it,
// as the `Landing` contract allows; the verbs are `Send` themselves.
unsafe impl<V: Send> Send for RdmaTransport<V> {}

impl<V: Verbs> RdmaTransport<V> {
    /// A transport over `verbs`.
    pub fn new(verbs: V, config: RdmaConfig) -> Self {
        Self {
            verbs,
            config,
            peers: Vec::new(),
            offered: HashMap::new(),
            waiting: Default::default(),
            pulling: HashMap::new(),
            owed: VecDeque::new(),
            events: Vec::new(),
            held: 0,
            due: Vec::new(),
            closing: Vec::new(),
            trace_events: Vec::new(),
            stats: RdmaStats::default(),
        }
    }

    /// The verbs (to add and connect peers).
    pub fn verbs(&mut self) -> &mut V {
        &mut self.verbs
    }

    /// Whether a block of `len` bytes is one this transport takes (a READ
    /// is at most `u32::MAX` bytes).
    fn carries(&self, len: u64) -> bool {
        len > 0 && len <= self.config.max_block_bytes.min(u64::from(u32::MAX))
    }

    /// Shuts `peer` at the next poll (its queue pair replaced, or given
    /// up): as a broken one, its transfers end and its slots go back.
    pub fn close_peer(&mut self, peer: PeerId, why: &str) {
        self.closing.push((peer, why.to_owned()));
    }

    /// Why `peer` is shut, if it is.
    pub fn peer_down(&self, peer: PeerId) -> Option<&str> {
        self.peers.get(peer.0 as usize).and_then(|p| p.down.as_deref())
    }

    fn peer(&mut self, peer: PeerId) -> &mut PeerState {
        let index = peer.0 as usize;
        if index >= self.peers.len() {
            self.peers.resize_with(index + 1, PeerState::default);
        }
        &mut self.peers[index]
    }

    /// Shuts `peer`: its verbs first (no READ of this node's memory
    /// completes after), then every transfer offered to it ends —
    /// `Timeout` those past their deadline, `PeerLost` the rest — and the
    /// offers it made here are dropped.
    fn shut(&mut self, peer: PeerId, why: &str, now_ns: u64, landing: &mut dyn Landing, out: &mut Vec<Completion>) {
        let state = self.peer(peer);
        if state.down.is_none() {
            state.down = Some(why.to_owned());
            self.stats.peers_shut += 1;
        }
        self.verbs.shut(peer, why);
        let mut ended: Vec<(u64, Offered)> =
            self.offered.iter().filter(|(_, o)| o.peer == peer).map(|(&t, &o)| (t, o)).collect();
        ended.sort_unstable_by_key(|&(t, _)| t);
        for (transfer, offered) in ended {
            self.offered.remove(&transfer);
            if offered.held_until_ns.is_none() {
                self.give_back_key(peer, offered.key);
            } else {
                self.held -= 1;
            }
            let result = if now_ns >= offered.deadline_ns {
                Err(TransferError::Timeout)
            } else {
                Err(TransferError::PeerLost(format!("RDMA queue pair shut: {why}")))
            };
            out.push(Completion { transfer, result, target: offered.target });
        }
        self.peer(peer).offered = 0;
        for queue in &mut self.waiting {
            queue.retain(|w| {
                if w.peer == peer && (w.reserved || w.placed.is_some()) {
                    landing.abandoned(&w.target);
                }
                w.peer != peer
            });
        }
        self.owed.retain(|&(p, _)| p != peer);
    }

    fn give_back_key(&mut self, peer: PeerId, key: u32) {
        self.verbs.take_back(peer, key);
        self.stats.keys_taken_back += 1;
    }

    /// Withdraws `transfer`'s offer (its request was aborted): the peer
    /// drops it if it has not started reading it, and it then ends
    /// `Cancelled`; read already, it ends as it would have. Whether a
    /// withdrawal was asked (not: no such offer, or asked before).
    pub fn withdraw(&mut self, transfer: u64) -> bool {
        let Some(offered) = self.offered.get_mut(&transfer) else { return false };
        if offered.withdrawn {
            return false;
        }
        offered.withdrawn = true;
        if offered.held_until_ns.is_some() {
            // Held here: the peer has nothing of it; the next poll ends it.
            offered.held_until_ns = Some(0);
            self.stats.withdrawn_asked += 1;
            return true;
        }
        let peer = offered.peer;
        let message = Message::Withdraw { transfer }.encode();
        if !self.owed.is_empty() || self.verbs.send(peer, &message) == Err(VerbsError::Full) {
            self.owed.push_back((peer, message));
        }
        self.stats.withdrawn_asked += 1;
        true
    }

    /// A peer withdrew its offer `transfer`: dropped if not read yet (its
    /// slot given back), answered `Refused`.
    fn take_withdrawal(&mut self, peer: PeerId, transfer: u64, landing: &mut dyn Landing) {
        for queue in &mut self.waiting {
            let Some(at) = queue.iter().position(|w| w.peer == peer && w.transfer == transfer) else { continue };
            let Some(waiting) = queue.remove(at) else { return };
            if waiting.reserved || waiting.placed.is_some() {
                landing.abandoned(&waiting.target);
            }
            self.stats.withdrawn_dropped += 1;
            self.answer(peer, transfer, AckStatus::Refused, waiting.target);
            // Not a refusal of this end's: the peer took it back.
            self.stats.refused = self.stats.refused.saturating_sub(1);
            return;
        }
        // Being read, or answered already: its answer says how it ended.
    }

    /// Sends `answer` to `peer`, or owes it until the peer's queue has room.
    fn answer(&mut self, peer: PeerId, transfer: u64, status: AckStatus, target: BlockAddr) {
        self.answer_timed(peer, transfer, status, target, 0);
    }

    /// [`Self::answer`], with this end's time on a traced offer.
    fn answer_timed(&mut self, peer: PeerId, transfer: u64, status: AckStatus, target: BlockAddr, took_us: u32) {
        // Put off is not refused (counted as `offers_put_off`).
        if !matches!(status, AckStatus::Landed | AckStatus::Later) {
            self.stats.refused += 1;
        }
        let message = Message::Answer { transfer, status, target, took_us }.encode();
        if !self.owed.is_empty() || self.verbs.send(peer, &message) == Err(VerbsError::Full) {
            self.owed.push_back((peer, message));
        }
        // A broken peer shows as its `Broken` event.
    }

    /// Takes an offer from `peer`: checks it, reserves a slot for one sent
    /// to [`ANY_SLOT`], and queues it by class.
    fn take_offer(&mut self, peer: PeerId, offer: Message, landing: &mut dyn Landing, now_ns: u64) {
        let Message::Offer { transfer, source, key, len, trace, namespace, target, priority } = offer else { return };
        let len = u64::from(len);
        if !self.carries(len) {
            return self.answer(peer, transfer, AckStatus::Refused, target);
        }
        // Only what the peer registered for this node to read.
        if !self.verbs.imports(peer, source, len) {
            return self.answer(peer, transfer, AckStatus::Refused, target);
        }
        // Its tenant over its cap on what this node receives: offered again
        // after the wait, nothing reserved or read meanwhile.
        if let Err(wait_us) = landing.admit(namespace, len, now_ns) {
            let wait_us = u32::try_from(wait_us).unwrap_or(u32::MAX).clamp(LATER_US_MIN, LATER_US_MAX);
            self.stats.offers_put_off += 1;
            return self.answer_timed(peer, transfer, AckStatus::Later, target, wait_us);
        }
        let (target, reserved) = if target.slot == ANY_SLOT {
            match landing.reserve(target.region, target.epoch, len, Some(namespace)) {
                Ok(slot) => (slot, true),
                Err(status) => return self.answer(peer, transfer, status, target),
            }
        } else {
            (target, false)
        };
        self.waiting[priority as usize].push_back(Waiting {
            peer,
            transfer,
            source,
            key,
            len,
            trace,
            taken_ns: now_ns,
            target,
            reserved,
            placed: None,
        });
    }

    /// Starts READs of waiting offers, most urgent first, while there is
    /// room.
    fn start_reads(&mut self, landing: &mut dyn Landing) {
        while self.pulling.len() < self.config.reads_max {
            let Some(next) = self.waiting.iter_mut().find_map(VecDeque::pop_front) else { return };
            let into = match next.placed {
                Some(into) => into,
                None => match landing.place(&next.target, next.len) {
                    Ok(into) => into,
                    Err(status) => {
                        if next.reserved {
                            landing.abandoned(&next.target);
                        }
                        self.answer(next.peer, next.transfer, status, next.target);
                        continue;
                    }
                },
            };
            let wr_id = Tag::new(next.target.epoch, next.target.slot, next.target.generation).raw();
            // A landing that placed outside the registered memory is
            // refused here, by name, before any READ.
            if self.pulling.contains_key(&wr_id) || !self.verbs.registered(into, next.len) {
                landing.abandoned(&next.target);
                self.answer(next.peer, next.transfer, AckStatus::Refused, next.target);
                continue;
            }
            // Checked at the offer: at most `u32::MAX`.
            let len = u32::try_from(next.len).unwrap_or(u32::MAX);
            // SAFETY: `into` is the placed target slot, at least `len`
            // bytes of registered memory, left to this READ until its
            // `ReadDone`: the landing's contract until landed or abandoned.
            match unsafe { self.verbs.read(next.peer, wr_id, (next.source, next.key), len, into) } {
                Ok(()) => {
                    let pull = Pulling {
                        peer: next.peer,
                        transfer: next.transfer,
                        target: next.target,
                        len: next.len,
                        trace: next.trace,
                        taken_ns: next.taken_ns,
                    };
                    self.pulling.insert(wr_id, pull);
                }
                Err(VerbsError::Full) => {
                    // Placed, kept, and read first once the queue drains.
                    self.waiting[0].push_front(Waiting { placed: Some(into), ..next });
                    return;
                }
                Err(VerbsError::Broken(_)) => {
                    // Its `Broken` event ends the peer's other work.
                    landing.abandoned(&next.target);
                }
            }
        }
    }

    fn read_done(&mut self, wr_id: u64, result: Result<(), String>, landing: &mut dyn Landing, now_ns: u64) {
        let Some(pull) = self.pulling.remove(&wr_id) else { return };
        if result.is_err() {
            // The queue pair failed it: no answer can reach the peer
            // either (its `Broken` event follows); the slot is the node's.
            landing.abandoned(&pull.target);
            return;
        }
        self.stats.read += 1;
        self.stats.read_bytes += pull.len;
        let status = landing.landed(&pull.target, pull.len);
        if status == AckStatus::Landed {
            self.stats.landed += 1;
        }
        let mut took_us = 0;
        if pull.trace != 0 {
            // A traced block: its landing logged under the id, its time
            // answered.
            took_us = u32::try_from(now_ns.saturating_sub(pull.taken_ns) / 1000).unwrap_or(u32::MAX).max(1);
            let event = TraceEvent::Landed {
                trace: pull.trace,
                from: None,
                target: pull.target,
                bytes: pull.len,
                status: Some(status),
                us: took_us,
            };
            self.trace_event(event);
        }
        self.answer_timed(pull.peer, pull.transfer, status, pull.target, took_us);
    }

    fn trace_event(&mut self, event: TraceEvent) {
        if self.trace_events.len() < crate::transport::tcp::TRACE_EVENTS_MAX {
            self.trace_events.push(event);
        } else {
            self.stats.trace_events_dropped += 1;
        }
    }

    /// What traced transfers did since the last call (appended to `out`):
    /// blocks landed here under a peer's trace id, answers to this end's
    /// traced offers with the peer's time.
    pub fn take_trace_events(&mut self, out: &mut Vec<TraceEvent>) {
        out.append(&mut self.trace_events);
    }

    /// Lends a key for `offered`'s block and sends the offer; returns it
    /// as in flight (its key and deadline set), or why not (no key kept).
    fn offer(&mut self, transfer: u64, offered: Offered, now_ns: u64) -> Result<Offered, VerbsError> {
        // A key for this block alone, lent to this peer alone.
        let key = self.verbs.lend(offered.peer, offered.source, u64::from(offered.len))?;
        self.stats.keys_lent += 1;
        let offer = Message::Offer {
            transfer,
            source: offered.source,
            key,
            len: offered.len,
            trace: offered.trace,
            namespace: offered.namespace,
            target: offered.target,
            priority: offered.priority,
        };
        if let Err(e) = self.verbs.send(offered.peer, &offer.encode()) {
            self.give_back_key(offered.peer, key);
            return Err(e);
        }
        let deadline_ns = now_ns.saturating_add(self.config.transfer_timeout_ns);
        Ok(Offered { key, deadline_ns, held_until_ns: None, ..offered })
    }

    /// Offers again the blocks held past their wait (a withdrawn one ends
    /// `Cancelled`, one whose peer broke `PeerLost`).
    fn offer_held(&mut self, now_ns: u64, out: &mut Vec<Completion>) {
        if self.held == 0 {
            return;
        }
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        due.extend(
            self.offered.iter().filter(|(_, o)| o.held_until_ns.is_some_and(|at| at <= now_ns)).map(|(&t, _)| t),
        );
        for &transfer in &due {
            let Some(held) = self.offered.get(&transfer).copied() else { continue };
            let ended = if held.withdrawn {
                Some(Err(TransferError::Cancelled))
            } else {
                match self.offer(transfer, held, now_ns) {
                    Ok(offered) => {
                        self.offered.insert(transfer, offered);
                        self.held -= 1;
                        None
                    }
                    // Its queue is full: the next poll tries again.
                    Err(VerbsError::Full) => None,
                    Err(VerbsError::Broken(why)) => Some(Err(TransferError::PeerLost(why))),
                }
            };
            if let Some(result) = ended {
                self.offered.remove(&transfer);
                self.held -= 1;
                let state = self.peer(held.peer);
                state.offered = state.offered.saturating_sub(1);
                out.push(Completion { transfer, result, target: held.target });
            }
        }
        self.due = due;
    }

    fn take_answer(&mut self, peer: PeerId, answer: Message, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let Message::Answer { transfer, status, target, took_us } = answer else { return false };
        match self.offered.get(&transfer) {
            Some(offered) if offered.peer == peer && offered.held_until_ns.is_none() => {}
            _ => return false,
        }
        if status == AckStatus::Later {
            // Its tenant is over the receiver's cap: the key comes back and
            // the block waits here, to be offered again after the wait.
            let Some(offered) = self.offered.get_mut(&transfer) else { return false };
            let key = offered.key;
            let wait_ns = u64::from(took_us.max(LATER_US_MIN)) * 1000;
            offered.held_until_ns = Some(if offered.withdrawn { 0 } else { now_ns.saturating_add(wait_ns) });
            offered.key = 0;
            self.give_back_key(peer, key);
            self.held += 1;
            self.stats.offers_held += 1;
            return true;
        }
        let Some(offered) = self.offered.remove(&transfer) else { return false };
        // The peer is done with the block: its key goes back before the
        // caller may reuse the source.
        self.give_back_key(peer, offered.key);
        if offered.trace != 0 {
            self.trace_event(TraceEvent::Answered { trace: offered.trace, transfer, peer_us: took_us });
        }
        let state = self.peer(peer);
        state.offered = state.offered.saturating_sub(1);
        let result = match status {
            AckStatus::Landed => Ok(()),
            AckStatus::Refused if offered.withdrawn => Err(TransferError::Cancelled),
            AckStatus::Refused => Err(TransferError::Refused),
            AckStatus::Corrupt => Err(TransferError::Corrupt),
            // `Later` is taken above.
            AckStatus::Busy | AckStatus::Later => Err(TransferError::Busy),
        };
        out.push(Completion { transfer, result, target });
        true
    }
}

impl<V: Verbs> Transport for RdmaTransport<V> {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        if !self.carries(block.len) {
            return Err(TransferError::Invalid("length"));
        }
        if self.offered.contains_key(&block.transfer) {
            return Err(TransferError::Invalid("transfer id in flight"));
        }
        let limit = self.config.offers_per_peer;
        let state = self.peer(block.peer);
        if let Some(why) = &state.down {
            return Err(TransferError::PeerLost(format!("RDMA queue pair shut: {why}")));
        }
        if state.offered >= limit {
            return Err(TransferError::Busy);
        }
        // The peer reads the block where it is: it must be in what this
        // node registered for that peer.
        let source = block.source as u64;
        if !self.verbs.exports(block.peer, source, block.len) {
            return Err(TransferError::Unreachable("the block is not in memory registered for RDMA to that peer"));
        }
        let offered = Offered {
            peer: block.peer,
            withdrawn: false,
            key: 0,
            trace: block.trace,
            target: block.target,
            deadline_ns: 0,
            source,
            // Checked by `carries`: at most `u32::MAX`.
            len: u32::try_from(block.len).unwrap_or(u32::MAX),
            priority: block.priority,
            namespace: block.namespace,
            held_until_ns: None,
        };
        let offered = self.offer(block.transfer, offered, now_ns).map_err(|e| match e {
            VerbsError::Full => TransferError::Busy,
            VerbsError::Broken(why) => TransferError::PeerLost(why),
        })?;
        self.peer(block.peer).offered += 1;
        self.offered.insert(block.transfer, offered);
        self.stats.offered += 1;
        Ok(())
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let before = out.len();
        let mut moved = !self.closing.is_empty();
        for (peer, why) in std::mem::take(&mut self.closing) {
            self.shut(peer, &why, now_ns, landing, out);
        }
        // Answers owed first: the peer's transfers wait on them.
        while let Some(&(peer, message)) = self.owed.front() {
            match self.verbs.send(peer, &message) {
                Err(VerbsError::Full) => break,
                Ok(()) | Err(VerbsError::Broken(_)) => {
                    self.owed.pop_front();
                    moved = true;
                }
            }
        }
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.verbs.poll(&mut events);
        moved |= !events.is_empty();
        for event in events.drain(..) {
            match event {
                VerbsEvent::ReadDone { wr_id, result } => self.read_done(wr_id, result, landing, now_ns),
                VerbsEvent::Broken { peer, why } => self.shut(peer, &why, now_ns, landing, out),
                VerbsEvent::Received { peer, message } => {
                    if self.peer_down(peer).is_some() {
                        continue;
                    }
                    match Message::decode(&message) {
                        Ok(offer @ Message::Offer { .. }) => self.take_offer(peer, offer, landing, now_ns),
                        Ok(Message::Withdraw { transfer }) => self.take_withdrawal(peer, transfer, landing),
                        Ok(answer) => {
                            if !self.take_answer(peer, answer, now_ns, out) {
                                self.stats.bad_messages += 1;
                                self.shut(peer, "it answered an offer this end did not make", now_ns, landing, out);
                            }
                        }
                        Err(why) => {
                            self.stats.bad_messages += 1;
                            self.shut(peer, &format!("bad message from the peer: {why}"), now_ns, landing, out);
                        }
                    }
                }
            }
        }
        self.events = events;
        self.offer_held(now_ns, out);
        self.start_reads(landing);
        // A peer silent past a transfer's deadline is shut before any of
        // its transfers end, so no READ of their sources can follow (a
        // block held here is owed no answer).
        let late: Option<PeerId> =
            self.offered.values().find(|o| o.held_until_ns.is_none() && now_ns >= o.deadline_ns).map(|o| o.peer);
        if let Some(peer) = late {
            self.shut(peer, "no answer before the deadline", now_ns, landing, out);
        }
        moved || out.len() > before
    }

    fn in_flight(&self) -> usize {
        self.offered.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> BlockAddr {
        BlockAddr { region: 3, epoch: 0x1234_5678_9abc, slot: 17, generation: 99 }
    }

    #[test]
    fn messages_round_trip_and_any_flipped_bit_is_refused() {
        let messages = [
            Message::Offer {
                transfer: 7,
                source: 0x7f00_1234_0000,
                key: 0x00ab_cd12,
                len: 1 << 20,
                trace: 0x5eed_7ace,
                namespace: 0x7e7e,
                target: target(),
                priority: Priority::Demotion,
            },
            Message::Answer { transfer: 7, status: AckStatus::Corrupt, target: target(), took_us: 412 },
            Message::Answer { transfer: 7, status: AckStatus::Later, target: target(), took_us: LATER_US_MAX },
            Message::Withdraw { transfer: 7 },
        ];
        for message in messages {
            let bytes = message.encode();
            assert_eq!(Message::decode(&bytes), Ok(message));
            for bit in 0..MESSAGE_BYTES * 8 {
                let mut bad = bytes;
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(Message::decode(&bad).is_err(), "bit {bit} of {message:?}");
            }
        }
    }

    #[test]
    fn fields_out_of_range_are_named_even_with_a_good_crc() {
        let reseal = |mut raw: RawMessage| {
            raw.crc = crc32fast::hash(&bytemuck::bytes_of(&raw)[..MESSAGE_BYTES - 4]);
            let mut out = [0u8; MESSAGE_BYTES];
            out.copy_from_slice(bytemuck::bytes_of(&raw));
            out
        };
        let offer = Message::Offer {
            transfer: 1,
            source: 64,
            key: 9,
            len: 64,
            trace: 0,
            namespace: 3,
            target: target(),
            priority: Priority::WriteBack,
        };
        let raw: RawMessage = bytemuck::pod_read_unaligned(&offer.encode());
        let answer: RawMessage = bytemuck::pod_read_unaligned(
            &Message::Answer { transfer: 1, status: AckStatus::Landed, target: target(), took_us: 0 }.encode(),
        );
        let cases: [(RawMessage, &str); 15] = [
            (RawMessage { priority: 9, ..raw }, "priority"),
            (RawMessage { kind: 4, ..raw }, "kind"),
            (RawMessage { kind: KIND_WITHDRAW, ..raw }, "withdrawal with offer"),
            (RawMessage { status: 1, ..raw }, "status"),
            (RawMessage { kind: KIND_ANSWER, status: 7, priority: 0, ..raw }, "status"),
            (RawMessage { kind: KIND_ANSWER, priority: 0, ..raw }, "offer fields"),
            (RawMessage { key: 3, ..answer }, "offer fields"),
            (RawMessage { trace: 5, ..answer }, "offer fields"),
            (RawMessage { namespace: 5, ..answer }, "offer fields"),
            (RawMessage { status: AckStatus::Later as u8, len: 0, ..answer }, "wait out of range"),
            (RawMessage { status: AckStatus::Later as u8, len: LATER_US_MAX + 1, ..answer }, "wait out of range"),
            (
                RawMessage {
                    kind: KIND_WITHDRAW,
                    source: 0,
                    len: 0,
                    key: 0,
                    priority: 0,
                    region: 0,
                    epoch: 0,
                    slot: 0,
                    generation: 0,
                    ..raw
                },
                "withdrawal with offer",
            ),
            (RawMessage { reserved: 1, ..raw }, "reserved"),
            (RawMessage { len: 0, ..raw }, "no bytes"),
            (RawMessage { version: 2, ..raw }, "version"),
        ];
        for (bad, named) in cases {
            let why = Message::decode(&reseal(bad)).unwrap_err();
            assert!(why.contains(named), "{why} should name {named}");
        }
    }
}
