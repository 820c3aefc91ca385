//! Blocks between nodes: the transport one node uses to send blocks into
//! another node's slots and to land blocks sent to it.
//!
//! One library, embedded where the bytes are — the engine's agent for the
//! compute network (P→D, D→P) and `lake-dp` for the storage network (tier
//! traffic, replication) — driven by its owner's poll loop: no thread and
//! no runtime of its own. A block is addressed at the receiver by the slot
//! it goes to, `(region, epoch, slot, generation)`, never by a per-transfer
//! descriptor; it travels as the stored object it is (its self-validating
//! header, then the payload), so the receiver checks it where it lands.
//! "Complete" means landed and checked at the target, not merely sent.
//!
//! - [`frame`]: the frames on a byte stream.
//! - [`tcp`]: TCP, several connections per peer, slices striped and
//!   pipelined, sent from and received into slots.
//! - [`rdma`]: RDMA, the same [`Transport`] ([`rdma::pull::RdmaTransport`]:
//!   the receiver READs each offered block from the sender's memory into
//!   its slot); the verbs are the `rdma` feature's and run where a device
//!   exists.

pub mod fallback;
pub mod faults;
pub mod frame;
pub mod rdma;
pub mod tcp;

use frame::{AckStatus, BlockAddr};

use crate::Priority;

/// A peer a transport writes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerId(pub u32);

/// One block to send.
#[derive(Clone, Copy, Debug)]
pub struct Outgoing {
    /// The caller's id for it (its completion carries it).
    pub transfer: u64,
    /// To whom.
    pub peer: PeerId,
    /// The stored object to send (header and payload, as in the slot).
    pub source: *const u8,
    /// Its bytes.
    pub len: u64,
    /// Where it goes at the peer.
    pub target: BlockAddr,
    /// Its class: the peer's slices wait per class, and a connection with
    /// room takes the most urgent first.
    pub priority: Priority,
    /// The engine's trace id of the request it serves (0: untraced): over
    /// TCP, a peer that takes trace ids logs its landing under it and
    /// answers with its time ([`tcp::TraceEvent`]).
    pub trace: u64,
    /// The block's namespace (0: not said): a block sent to [`ANY_SLOT`]
    /// names it in its reservation, so the receiver can hold its tenant to
    /// what the node receives ([`Landing::admit`]).
    pub namespace: u64,
}

/// What moves blocks to other nodes, whatever the wire: TCP
/// ([`tcp::TcpTransport`]), RDMA ([`rdma::pull::RdmaTransport`]), one
/// transport in front of another
/// ([`fallback::Fallback`]: RDMA degrading to TCP), or a decorator around
/// one that injects faults ([`faults::FaultyTransport`]). Driven from its owner's poll loop; what
/// is above it is the same whichever it is.
pub trait Transport {
    /// Queues `block` for its peer; it completes (once) through
    /// [`Transport::poll`]. A full transport hands it back (`Busy`).
    ///
    /// # Safety
    ///
    /// `block.source` is valid for `block.len` bytes, unchanged, until the
    /// transfer's completion has been returned by [`Transport::poll`].
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError>;

    /// Moves bytes: lands what peers send into `landing`, and puts the
    /// completions of this end's writes into `out`; returns whether
    /// anything happened.
    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool;

    /// Transfers written and not yet completed.
    fn in_flight(&self) -> usize;
}

impl Transport for tcp::TcpTransport {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        // SAFETY: the caller's contract is this method's.
        unsafe { tcp::TcpTransport::write(self, block, now_ns) }
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        tcp::TcpTransport::poll(self, landing, now_ns, out)
    }

    fn in_flight(&self) -> usize {
        tcp::TcpTransport::in_flight(self)
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        // SAFETY: the caller's contract is this method's.
        unsafe { (**self).write(block, now_ns) }
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        (**self).poll(landing, now_ns, out)
    }

    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }
}

/// A transport over TCP links to peers, with or without RDMA in front of
/// them: what a node's `lake-dp` runs on the storage network and an
/// engine's pusher on the compute network. Peers are added by their rails;
/// the TCP links beneath carry the accounting, the keys and the security
/// events whichever wire moves the bytes.
pub trait Links: Transport {
    /// The TCP transport beneath.
    fn tcp(&mut self) -> &mut tcp::TcpTransport;

    /// The TCP transport beneath, to read.
    fn tcp_ref(&self) -> &tcp::TcpTransport;

    /// A peer over `rails`; the id to write to it by.
    fn add_peer_rails(&mut self, rails: &[tcp::Rail]) -> Result<PeerId, tcp::TcpError>;

    /// What each of `peer`'s TCP rails carried.
    fn rail_reports(&self, peer: PeerId) -> Vec<tcp::RailReport>;

    /// Cancels `transfer` if none of its bytes went out yet: whether it
    /// will end `Cancelled`. One offered over RDMA is withdrawn instead —
    /// it ends `Cancelled` if the peer had not started reading it, as it
    /// would have otherwise — and `false` is returned (not promised).
    fn cancel(&mut self, transfer: u64) -> bool;

    /// What happened to RDMA links since the last call, one line each,
    /// for the owner's log (up, declined, fallen back to TCP); the TCP
    /// links' refusals are [`tcp::TcpTransport::take_security_events`].
    fn take_rdma_events(&mut self) -> Vec<String> {
        Vec::new()
    }

    /// What RDMA did, where it runs.
    fn rdma_stats(&self) -> Option<rdma::pull::RdmaStats> {
        None
    }

    /// What traced transfers did since the last call, over TCP and RDMA
    /// alike (appended to `out`).
    fn take_trace_events(&mut self, out: &mut Vec<tcp::TraceEvent>) {
        self.tcp().take_trace_events(out);
    }
}

impl Links for tcp::TcpTransport {
    fn tcp(&mut self) -> &mut tcp::TcpTransport {
        self
    }

    fn tcp_ref(&self) -> &tcp::TcpTransport {
        self
    }

    fn add_peer_rails(&mut self, rails: &[tcp::Rail]) -> Result<PeerId, tcp::TcpError> {
        tcp::TcpTransport::add_peer_rails(self, rails)
    }

    fn rail_reports(&self, peer: PeerId) -> Vec<tcp::RailReport> {
        tcp::TcpTransport::rail_reports(self, peer)
    }

    fn cancel(&mut self, transfer: u64) -> bool {
        tcp::TcpTransport::cancel(self, transfer)
    }
}

impl<T: Links + ?Sized> Links for Box<T> {
    fn tcp(&mut self) -> &mut tcp::TcpTransport {
        (**self).tcp()
    }

    fn tcp_ref(&self) -> &tcp::TcpTransport {
        (**self).tcp_ref()
    }

    fn add_peer_rails(&mut self, rails: &[tcp::Rail]) -> Result<PeerId, tcp::TcpError> {
        (**self).add_peer_rails(rails)
    }

    fn rail_reports(&self, peer: PeerId) -> Vec<tcp::RailReport> {
        (**self).rail_reports(peer)
    }

    fn cancel(&mut self, transfer: u64) -> bool {
        (**self).cancel(transfer)
    }

    fn take_rdma_events(&mut self) -> Vec<String> {
        (**self).take_rdma_events()
    }

    fn rdma_stats(&self) -> Option<rdma::pull::RdmaStats> {
        (**self).rdma_stats()
    }

    fn take_trace_events(&mut self, out: &mut Vec<tcp::TraceEvent>) {
        (**self).take_trace_events(out);
    }
}

/// The end of one transfer this node sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The caller's id of the transfer.
    pub transfer: u64,
    /// Landed and checked at the target, or why not.
    pub result: Result<(), TransferError>,
    /// Where it landed (or was to land): for a block sent to
    /// [`ANY_SLOT`], the slot the peer reserved for it.
    pub target: BlockAddr,
}

/// A target slot the sender leaves to the receiver: the block goes to a
/// slot the receiver reserves for it ([`Landing::reserve`]) when asked.
pub const ANY_SLOT: u32 = u32::MAX;

/// Why a transfer did not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// The target slot was not the peer's to fill for this block (stale
    /// epoch or generation, not reserved, a length that does not fit).
    Refused,
    /// It arrived whole but does not check (header or CRCs): not published.
    Corrupt,
    /// Too much in flight here or at the peer: try again later.
    Busy,
    /// The connection it travelled on broke (the reason).
    PeerLost(String),
    /// No answer before its deadline.
    Timeout,
    /// The request itself was malformed (the field).
    Invalid(&'static str),
    /// This transport cannot carry it (why), though another may: a block
    /// outside the memory registered for RDMA to that peer.
    Unreachable(&'static str),
    /// Its sender cancelled it before any of its bytes went out.
    Cancelled,
}

impl core::fmt::Display for TransferError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Refused => f.write_str("refused by the peer: not its slot to fill for this block"),
            Self::Corrupt => f.write_str("the block arrived but did not check at the peer"),
            Self::Busy => f.write_str("too much in flight: try again"),
            Self::PeerLost(why) => write!(f, "peer lost: {why}"),
            Self::Timeout => f.write_str("no answer before the deadline"),
            Self::Invalid(what) => write!(f, "invalid transfer: {what}"),
            Self::Unreachable(why) => write!(f, "not carried by this transport: {why}"),
            Self::Cancelled => f.write_str("cancelled by its sender before it went out"),
        }
    }
}

impl std::error::Error for TransferError {}

/// What the receiving node does with blocks sent to it: where they land,
/// and whether they check once whole. The transport calls these from its
/// owner's poll loop.
pub trait Landing {
    /// Where the `len` bytes of a block for `target` go: the start of the
    /// target slot's memory (at least `len` bytes, written by the transport
    /// only until [`Landing::landed`] or [`Landing::abandoned`]), or the
    /// verdict that refuses it.
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus>;

    /// All `len` bytes for `target` are there: check them (the stored
    /// header names this target; the segment CRCs match) and publish.
    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus;

    /// A block placed for `target` will not complete (its connection broke
    /// or it timed out): the slot is the node's again, unpublished.
    fn abandoned(&mut self, target: &BlockAddr);

    /// A peer asks for a slot of this node's `region` at `epoch` for a
    /// `len`-byte block of `namespace` (where the sender names it; it sent
    /// it to [`ANY_SLOT`]): the slot reserved for it — then placed, landed
    /// or given back like any target — or the verdict refusing it. By
    /// default a node takes no block it did not name the slot of.
    fn reserve(&mut self, region: u16, epoch: u64, len: u64, namespace: Option<u64>) -> Result<BlockAddr, AckStatus> {
        let _ = (region, epoch, len, namespace);
        Err(AckStatus::Refused)
    }

    /// Whether a `len`-byte block of `namespace` that a peer asks a slot
    /// for may come now, under its tenant's cap on what this node
    /// receives: `Err` with the wait in µs before it is asked again (the
    /// sender holds it meanwhile; nothing is refused or lost). By default
    /// every block may.
    fn admit(&mut self, namespace: u64, len: u64, now_ns: u64) -> Result<(), u64> {
        let _ = (namespace, len, now_ns);
        Ok(())
    }
}

/// Checks a stored object that arrived whole in `bytes` (its `len` bytes)
/// and rewrites its header to name the slot it landed in, `target` (an
/// object names the slot it sits in, as a promoted one does): the header
/// must decode, its length be `len`, every segment match its CRC. What a
/// [`Landing`] does in [`Landing::landed`] before it publishes the block;
/// returns the object's metadata as rewritten.
pub fn check_and_adopt(bytes: &mut [u8], len: u64, target: &BlockAddr) -> Result<crate::stored::ObjectMeta, AckStatus> {
    use crate::constants::STORED_HEADER_BYTES;
    use crate::stored::{decode_header, object_bytes};
    let whole = usize::try_from(len).ok().and_then(|len| bytes.get_mut(..len)).ok_or(AckStatus::Refused)?;
    let decoded = decode_header(whole).map_err(|_| AckStatus::Corrupt)?;
    // L1 holds blocks in the clear only (sealed ones are opened on their
    // way in): a sealed object would pass its CRCs and hand readers
    // ciphertext.
    if decoded.seal().is_some() {
        return Err(AckStatus::Corrupt);
    }
    let meta = *decoded.meta();
    let payload_end = STORED_HEADER_BYTES as u64 + meta.payload_len;
    // The object as sent: its header, its payload, at most the padding a
    // slot rounds it to.
    if payload_end > len || len > object_bytes(meta.payload_len) {
        return Err(AckStatus::Corrupt);
    }
    let payload_end = usize::try_from(payload_end).map_err(|_| AckStatus::Corrupt)?;
    let payload = whole.get(STORED_HEADER_BYTES..payload_end).ok_or(AckStatus::Corrupt)?;
    decoded.verify_payload(payload).map_err(|_| AckStatus::Corrupt)?;
    let header: &mut [u8; STORED_HEADER_BYTES] =
        (&mut whole[..STORED_HEADER_BYTES]).try_into().map_err(|_| AckStatus::Corrupt)?;
    let region = crate::model::replica::RegionId(target.region);
    decoded.encode_moved(region, target.epoch, target.slot, target.generation, header).map_err(|_| AckStatus::Corrupt)
}
